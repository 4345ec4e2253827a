"""benchmarks/ray_overhead.py: aggregation of metrics rows, the ratio, the verdict and the table
on fabricated rows (the benchmark itself starts processes and Ray; benchmarks/README.md records it)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ray_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("ray_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(step, gen, ref, update, tokens=1000, other=0.0):
    total = gen + ref + update + 0.002 + other
    return {"step": step, "timing/step": total, "timing/gen": gen, "timing/reward": 0.001, "timing/old_logprob": 0.0,
            "timing/ref": ref, "timing/values": 0.0, "timing/adv": 0.001, "timing/update_critic": 0.0,
            "timing/update_actor": update, "throughput/tokens_per_s": tokens / total}


def run(backend, rnd, scale, other=0.0):
    rows = [{"eval/accuracy": 0.0}]  # a row without timing/step is not a step
    rows += [row(1, 9.0, 9.0, 9.0)]  # warm-up
    rows += [row(s, scale * g, scale * 0.25, scale * 0.5, other=other) for s, g in ((2, 0.4), (3, 0.5), (4, 0.6))]
    return {"backend": backend, "round": rnd, "rows": rows}


def test_step_rows_drop_warmup_and_non_step_rows(bench):
    rows = run("local", 0, 1.0)["rows"]
    kept = bench.step_rows(rows, warmup=1)
    assert [r["step"] for r in kept] == [2, 3, 4]


def test_aggregate_takes_medians_of_step_stages_other_and_tokens(bench):
    agg = bench.aggregate(bench.step_rows(run("local", 0, 1.0, other=0.05)["rows"], 1))
    assert agg["stages"]["gen"] == pytest.approx(0.5)
    assert agg["stages"]["ref"] == pytest.approx(0.25)
    assert agg["stages"]["update_actor"] == pytest.approx(0.5)
    assert agg["stages"]["other"] == pytest.approx(0.05)
    assert agg["step"] == pytest.approx(0.5 + 0.25 + 0.5 + 0.002 + 0.05)
    assert agg["tokens_per_s"] == pytest.approx(1000 / agg["step"])
    assert agg["steps"] == 3
    with pytest.raises(ValueError):
        bench.aggregate([])


def test_tokens_per_s_computed_when_missing(bench):
    r = row(2, 0.5, 0.25, 0.5)
    del r["throughput/tokens_per_s"]
    r["num_tokens"] = 500
    assert bench.aggregate([r])["tokens_per_s"] == pytest.approx(500 / r["timing/step"])


def test_summary_ratio_verdict_and_ray_minus_local(bench):
    runs = [run("local", 0, 1.0), run("ray", 0, 1.1, other=0.02), run("ray", 1, 1.1, other=0.02), run("local", 1, 1.0)]
    s = bench.summarize(runs, warmup=1)
    assert s["ratio"] == pytest.approx(s["ray"]["step"] / s["local"]["step"])
    assert 1.0 < s["ratio"] < 1.15 and s["verdict"] == "PASS"
    assert len(s["ratio_per_round"]) == 2
    assert s["ray_minus_local"]["update_actor"] == pytest.approx(0.05)
    assert s["ray_minus_local"]["other"] == pytest.approx(0.02)
    assert bench.verdict(1.15) == "PASS" and bench.verdict(1.16) == "FAIL"
    slow = bench.summarize([run("local", 0, 1.0), run("ray", 0, 1.5)], warmup=1)
    assert slow["verdict"] == "FAIL"


def test_table_and_estimate(bench):
    s = bench.summarize([run("local", 0, 1.0), run("ray", 0, 1.1, other=0.02)], warmup=1)
    text = bench.table(s)
    assert text.splitlines()[0].startswith("| | local")
    assert "| update_actor (s): median (best) | 0.500 (0.500) | 0.550 (0.550) | +0.050 | 1.10x (1.10x) |" in text
    assert "values (s)" not in text  # stages this workload does not run are left out
    assert "target ≤ 1.15): **PASS**; best steps: " in text
    assert s["ratio_best"] == pytest.approx(s["ray"]["step_best"] / s["local"]["step_best"])
    assert s["local"]["step_best"] == pytest.approx(0.4 + 0.25 + 0.5 + 0.002)
    est = bench.comm_estimate(s)
    assert "communication/dispatch" in est and "0.095" in est  # ref 0.025 + update 0.05 + other 0.02
