"""benchmarks/demo_robustness.py: its rows, summary and table on fabricated summary.json files,
and one real `--quick` run (seed 1, so that the seed is seen to reach the data and both trainers)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_robustness.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("demo_robustness", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(tmp_path, bench, seed, threads, sft, rl, rl_seconds=300.0):
    """A row from a summary.json as the demo writes it (only the fields the script reads)."""
    stages = {"data": 0.2, "sft": 160.0, "eval_sft": 1.2, "rl": rl_seconds, "eval_rl": 0.8, "report": 2.8}
    f = tmp_path / bench.run_name(seed, threads) / "summary.json"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"sft_accuracy": sft, "rl_accuracy": rl, "gain": rl - sft,
                             "wall_seconds": round(sum(stages.values()), 1), "stage_seconds": stages}))
    return bench.make_row(seed, threads, 0, sum(stages.values()) + 5.0, f, tmp_path / "x.log")


def failed_run(tmp_path, bench, seed, threads):
    log = tmp_path / f"{bench.run_name(seed, threads)}.log"
    log.write_text("\n".join(f"line {i}" for i in range(30)) + "\nRuntimeError: boom\n")
    return bench.make_row(seed, threads, 1, 12.0, tmp_path / "missing" / "summary.json", log)


def test_a_row_holds_the_accuracies_gain_in_points_and_seconds(tmp_path, bench):
    row = fake_run(tmp_path, bench, 2, 1, sft=0.60, rl=0.712)
    assert not row["failed"]
    assert row["gain_points"] == pytest.approx(11.2)  # 100 * (0.712 - 0.600)
    assert row["stage_seconds"]["rl"] == 300.0 and row["demo_seconds"] == 465.0
    assert row["process_seconds"] == 470.0  # the demo's 465 s + 5 s of start-up


def test_a_failed_run_keeps_the_tail_of_its_log(tmp_path, bench):
    row = failed_run(tmp_path, bench, 0, 2)
    assert row["failed"] and row["returncode"] == 1
    tail = row["error_tail"].splitlines()
    assert len(tail) == bench.ERROR_TAIL_LINES and tail[-1] == "RuntimeError: boom"
    assert "FAILED (exit 1)" in bench.progress_line(row) and "boom" in bench.progress_line(row)


def test_exit_code_zero_without_summary_is_a_failure(tmp_path, bench):
    row = bench.make_row(0, 1, 0, 3.0, tmp_path / "none.json", tmp_path / "none.log")
    assert row["failed"] and "no summary.json" in row["error_tail"]


def test_summary_mean_min_slowest_and_pass(tmp_path, bench):
    rows = [fake_run(tmp_path, bench, 0, 1, 0.50, 0.62),   # +12
            fake_run(tmp_path, bench, 0, 2, 0.55, 0.75, rl_seconds=400.0),  # +20, 570 s
            fake_run(tmp_path, bench, 1, 1, 0.40, 0.51)]   # +11
    s = bench.summarize(rows)
    assert s["mean_gain_points"] == pytest.approx(14.33) and s["min_gain_points"] == pytest.approx(11.0)
    assert s["slowest_run"] == "seed0-threads2" and s["slowest_seconds"] == pytest.approx(570.0)
    assert s["verdict"] == "PASS" and s["failed"] == []


@pytest.mark.parametrize("case", ["small gain", "too slow", "a run failed", "all failed"])
def test_summary_fails(tmp_path, bench, case):
    rows = {
        "small gain": lambda: [fake_run(tmp_path, bench, 0, 1, 0.50, 0.62), fake_run(tmp_path, bench, 1, 1, 0.50, 0.59)],
        "too slow": lambda: [fake_run(tmp_path, bench, 0, 1, 0.50, 0.70, rl_seconds=440.0)],  # 610 s
        "a run failed": lambda: [fake_run(tmp_path, bench, 0, 1, 0.50, 0.70), failed_run(tmp_path, bench, 1, 1)],
        "all failed": lambda: [failed_run(tmp_path, bench, 0, 1)],
    }[case]()
    s = bench.summarize(rows)
    assert s["verdict"] == "FAIL"
    if case == "a run failed":
        assert s["failed"] == ["seed1-threads1"] and s["min_gain_points"] == pytest.approx(20.0)
    if case == "all failed":
        assert s["min_gain_points"] is None


def test_the_table_has_every_run_the_summary_and_the_machine(tmp_path, bench):
    rows = [fake_run(tmp_path, bench, 0, 1, 0.60, 0.712), failed_run(tmp_path, bench, 1, 2)]
    machine = {"cpu_model": "AMD EPYC", "avx512f": False, "cores": 2, "torch": "2.13.0+cpu", "date": "d"}
    text = bench.format_results({"machine": machine, "quick": False, "runs": rows, "summary": bench.summarize(rows)})
    assert "AMD EPYC (no AVX-512), 2 cores, torch 2.13.0+cpu" in text
    assert "| 0 | 1 | native | 60.0% | 71.2% | +11.2 | 0.2 | 160.0 | 1.2 | 300.0 | 0.8 | 2.8 | 465.0 | 470.0 |" in text
    assert "| 1 | 2 | native | FAILED (exit 1) |" in text
    assert "mean +11.2, min +11.2 points" in text and "Failed: seed1-threads2" in text
    assert "**FAIL**" in text and "RuntimeError: boom" in text
    header = next(line for line in text.splitlines() if line.startswith("| seed"))
    assert all(line.count("|") == header.count("|") for line in text.splitlines() if line.startswith("| "))


def test_machine_info_reads_lscpu(bench):
    lscpu = "Architecture:  x86_64\nModel name:    Intel(R) Xeon(R) Platinum\nFlags:  fpu avx2 avx512f avx512dq\n"
    m = bench.machine_info(lscpu)
    assert m["cpu_model"] == "Intel(R) Xeon(R) Platinum" and m["avx512f"] is True
    assert bench.machine_info("Model name: AMD EPYC\nFlags: fpu avx2 avx512_bf16\n")["avx512f"] is False
    assert m["cores"] >= 1 and m["torch"]


def test_the_child_gets_the_threads_and_this_checkout(bench):
    env = bench.child_env(2, {"PYTHONPATH": "/elsewhere", "OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    src = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (src / "posttrain" / "demo.py").is_file() and env["PYTHONPATH"].endswith("/elsewhere")


@pytest.mark.slow  # 40 s: the whole quick demo through the harness (tests/test_demo.py runs the demo)
def test_a_real_quick_run(tmp_path, bench, monkeypatch, capsys):
    out = tmp_path / "bench"
    monkeypatch.setattr(sys, "argv", ["demo_robustness.py", "--quick", "--seeds", "1", "--threads", "1",
                                      "--out", str(out)])
    assert bench.main() == 0
    printed = capsys.readouterr().out
    assert "1/1 [seed1-threads1] SFT" in printed and "| 1 | 1 |" in printed
    results = json.loads((out / "results.json").read_text())
    (row,) = results["runs"]
    assert not row["failed"] and results["quick"] is True
    assert (out / "results.md").read_text().strip() in printed
    run = out / "seed1-threads1"
    assert json.loads((run / "summary.json").read_text())["seed"] == 1
    assert json.loads((run / "data" / "task.json").read_text())["seed"] == 1
    for stage in ("sft", "rl"):
        assert "  seed: 1\n" in (run / stage / "config.yaml").read_text(), stage


def test_avx2_runs_are_named_and_tabled_apart(tmp_path, bench):
    assert bench.run_name(0, 2) == "seed0-threads2" and bench.run_name(0, 2, "avx2") == "seed0-threads2-avx2"
    log = tmp_path / "x.log"
    log.write_text("boom\n")
    row = bench.make_row(3, 1, 1, 2.0, tmp_path / "none.json", log, "avx2")
    assert row["isa"] == "avx2" and bench.summarize([row])["failed"] == ["seed3-threads1-avx2"]
    text = bench.format_results({"machine": bench.machine_info(""), "quick": False, "runs": [row],
                                 "summary": bench.summarize([row])})
    assert "| kernels |" in text and "| 3 | 1 | avx2 | FAILED" in text


def test_the_avx2_child_really_runs_avx2_kernels(bench):
    """The variables reach torch: its dispatch reports AVX2 (on an AVX-512 CPU too), and a
    native child is not left with a parent's setting."""
    import subprocess

    probe = ["-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    avx2 = subprocess.run([sys.executable, *probe], env=bench.child_env(1, isa="avx2"),
                          capture_output=True, text=True, check=True).stdout.strip()
    assert avx2 == "AVX2"
    env = bench.child_env(1, {**os.environ, "ATEN_CPU_CAPABILITY": "default"}, isa="native")
    assert "ATEN_CPU_CAPABILITY" not in env and "MKL_ENABLE_INSTRUCTIONS" not in env
