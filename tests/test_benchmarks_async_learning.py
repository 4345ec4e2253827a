"""benchmarks/async_learning.py: the goal's verdict, the reward curve's smoothing and the table
on fabricated runs (the benchmark itself trains 6 runs; benchmarks/README.md records it)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "async_learning.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("async_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(mode, seed, acc, reward=(0.0, 1.0)):
    return {"mode": mode, "seed": seed, "final_accuracy": acc, "reward": list(reward), "staleness_max": 1.0 * (mode != "sync"),
            "wall_s": 10.0, "samples_per_step": 128, "evals": [(1, acc)]}


def test_moving_average_is_the_mean_of_the_last_k_values(bench):
    assert bench.moving_average([1.0, 2.0, 3.0, 4.0], 2) == pytest.approx([1.0, 1.5, 2.5, 3.5])


@pytest.mark.parametrize("async_accs,met", [((0.50, 0.54, 0.58), True), ((0.40, 0.44, 0.45), False)])
def test_the_goal_is_async_mean_inside_the_synchronous_seeds_spread(bench, async_accs, met):
    # sync seeds 0.48, 0.52, 0.60 → spread [48%, 60%]; async mean 54% inside, 43% outside.
    runs = [run("sync", s, a) for s, a in enumerate((0.48, 0.52, 0.60))]
    runs += [run("async_k1", s, a) for s, a in enumerate(async_accs)]
    ok, line = bench.verdict(runs)
    assert ok is met
    assert ("[48.0%, 60.0%]" in line) and (("goal met" in line) is met)
    table = bench.table(runs)
    assert "| sync | 48.0%, 52.0%, 60.0% | 53.3% | 12.0 pts |" in table
