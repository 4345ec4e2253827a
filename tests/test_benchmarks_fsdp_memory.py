"""benchmarks/fsdp_memory.py --cap-mib: the search for the largest layer count under a cap, on
fabricated peaks (the benchmark itself starts gloo workers; benchmarks/README.md records it)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fsdp_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fsdp_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("answer", [0, 1, 2, 7, 31, 100])
@pytest.mark.parametrize("guess", [1, 5, 30, 40, 300])
def test_largest_count_finds_the_last_count_that_fits_from_any_guess(bench, answer, guess):
    probed = []

    def fits(count):
        probed.append(count)
        return count <= answer

    assert bench.largest_count(fits, guess) == answer
    if answer:
        assert answer + 1 in probed  # confirmed: one more does not fit
    # galloping from the guess, then bisection: 2 log2 |answer - guess| probes or so, not one per count
    assert len(set(probed)) <= 4 + 2 * abs(answer - guess).bit_length()


def test_guess_count_fills_the_cap_with_16_bytes_per_parameter_over_the_workers(bench):
    # 512 MiB at start, a cap of 1536: 1024 MiB = 2**26 parameters' training state at W = 1
    # (2**28 at W = 4); a root of 2**24 parameters, layers of 2**22
    assert bench.guess_count(512.0, 2**24, 2**22, 1, 1536.0) == (2**26 - 2**24) // 2**22 == 12
    assert bench.guess_count(512.0, 2**24, 2**22, 4, 1536.0) == (2**28 - 2**24) // 2**22 == 60
    assert bench.guess_count(1500.0, 2**24, 2**22, 1, 1536.0) == 1  # the root alone passes the cap
