"""benchmarks/agent_learning.py: its verdict and table on fabricated results (the benchmark
itself takes minutes; benchmarks/README.md records it)."""

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "agent_learning.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("agent_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(bench, sft, rl, notool=0.02, rl_seconds=480.0):
    ep = {"tool_calls/mean": 1.0, "turns/mean": 2.0}
    speed = {"native": {"seconds": 1.0, "episodes_per_s": 256.0, "model_tokens_per_s": 9000.0, "model_tokens": 9000},
             "hf": {"seconds": 2.5, "episodes_per_s": 102.4, "model_tokens_per_s": 3600.0, "model_tokens": 9000},
             "episodes": 256, "native_over_hf": 2.5}
    r = {"machine": {"cpu_model": "Intel Xeon", "avx512f": True, "cores": 2, "torch": "2.13.0", "date": "d"},
         "sft": {"accuracy": sft, **ep}, "rl": {"accuracy": rl, **ep}, "sft_notool": {"accuracy": notool},
         "rl_curve": [{"step": 50, "accuracy": 0.6}], "speed": speed,
         "seconds": {"sft": 200.0, "sft_notool": 190.0, "rl": rl_seconds}}
    r["verdict"] = bench.verdict(r)
    return r


def test_pass_needs_the_gain_the_time_and_the_tool_advantage(bench):
    r = results(bench, 0.30, 0.75)
    assert r["verdict"] == {"gain_points": 45.0, "rl_seconds": 480.0, "tool_advantage_points": 73.0,
                            "sft_tool_advantage_points": 28.0, "pass": True}
    assert not results(bench, 0.30, 0.39)["verdict"]["pass"]  # +9
    assert not results(bench, 0.30, 0.75, rl_seconds=601.0)["verdict"]["pass"]
    assert not results(bench, 0.10, 0.25, notool=0.10)["verdict"]["pass"]  # +15 gain, +15 over no tools


def test_the_table_has_every_model_and_both_engines(bench):
    text = bench.format_results(results(bench, 0.30, 0.75))
    for needle in ("| SFT, no-tool demonstrations | 2.0% |", "| SFT, tool demonstrations | 30.0% |",
                   "| GRPO over episodes | 75.0% |", "RL gain: +45.0 points in 480 s", "+73.0 points",
                   "| native | KV cache extended", "| hf | re-encoded", "native / hf speed: 2.5x", "**PASS**"):
        assert needle in text, needle


def test_sft_is_checked_from_the_first_step_to_the_last(bench):
    assert bench.check_steps(300, 20, 380) == [300, 320, 340, 360, 380]
    assert bench.check_steps(300, 20, 390) == [300, 320, 340, 360, 380, 390]
    assert bench.check_steps(500, 20, 450) == [450]


def test_the_table_names_where_sft_stopped_and_may_leave_out_the_speed(bench):
    r = results(bench, 0.30, 0.75)
    del r["speed"]
    r["sft_stop"] = {"step": 340, "checks": [{"step": 300, "dev_accuracy": 0.02}, {"step": 320, "dev_accuracy": 0.11},
                                             {"step": 340, "dev_accuracy": 0.27}]}
    text = bench.format_results(r)
    assert "Tool SFT stopped at step 340; dev accuracy at the checks: 300: 2%, 320: 11%, 340: 27%." in text
    assert "native / hf" not in text and "**PASS**" in text


def test_speed_only_names_what_a_run_directory_lacks(bench, tmp_path, capsys):
    args = argparse.Namespace(seed=0, rl_minutes=8.0, rl_overrides=[], speed_prompts=2, speed_reps=1)
    assert bench.print_speed(tmp_path, args) == 2
    assert f"run the benchmark with --out {tmp_path} first" in capsys.readouterr().out
