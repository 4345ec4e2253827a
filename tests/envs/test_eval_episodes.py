"""`posttrain eval` and `posttrain generate` with an environment: episodes on the taught
model (a user environment loaded from a file path), accuracy, pass@k, turns and tool calls;
generate prints the episode turn by turn."""

import json

import pytest

from posttrain.cli import main
from posttrain.evaluation import evaluate
from posttrain.rewards import RewardRunner, env_reward

from .conftest import PROMPT, write_setup


@pytest.fixture(scope="module")
def setup(taught, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    write_setup(root, taught, tok)
    rows = [{"prompt": PROMPT, "answer": "1086"}, {"prompt": PROMPT, "answer": "1087"}]
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_eval_plays_episodes_and_reports_turns_and_tool_calls(setup, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", str(setup / "model"), "--data", str(setup / "test.jsonl"), "--env",
                 f"{setup / 'my_env.py'}:MyEnv", "--n", "2", "--temperature", "0", "--max-new-tokens", "48",
                 "--max-turns", "4", "--max-total-tokens", "160", "--out", str(out)]) == 0
    summary = json.loads((out / "eval.json").read_text())
    m = summary["metrics"]
    assert summary["settings"]["reward_specs"] == ["env_reward"]  # no task column: the environment's reward
    assert m["accuracy"] == 0.5 and m["pass@2"] == 0.5  # the taught answer is right for the first row only
    assert m["turns/mean"] == 3.0 and m["tool_calls/mean"] == 2.0 and m["tool/errors"] == 0.0
    assert m["env/reward/mean"] == 0.5 and m["episode/truncated"] == 0.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["turns"] for s in samples] == [3] * 4 and [s["tool_calls"] for s in samples] == [2] * 4
    assert "<result>1081</result>" in samples[0]["completion"]
    for sample, reward in zip(samples, [1.0, 1.0, 0.0, 0.0]):  # each episode in full, as an RL run logs it
        assert [s["author"] for s in sample["spans"]] == ["model", "tool", "model", "tool", "model"]
        assert "".join(s["text"] for s in sample["spans"]) == sample["completion"]
        assert [s["text"] for s in sample["spans"] if s["author"] == "tool"] == ["<result>1081</result>", "<result>1086</result>"]
        assert sample["episode"]["env_reward"] == reward and sample["episode"]["prompt"] == "<|bos|>" + PROMPT
        calls = [(c["name"], c["arguments"], c["result"]) for t in sample["episode"]["turns"] for c in t["calls"]]
        assert calls == [("calculator", "23*47", "1081"), ("calculator", "1081+5", "1086")]


def test_evaluate_takes_an_environment_factory(setup, taught, tok):
    from posttrain.envs import resolve_environment

    env = resolve_environment(f"{setup / 'my_env.py'}:MyEnv")
    rows = [{"prompt": PROMPT, "answer": "1086"}]
    report = evaluate(taught, tok, rows, RewardRunner([("env_reward", env_reward)]), n=1, max_new_tokens=48,
                      environment=env)
    assert report.metrics["accuracy"] == 1.0 and report.metrics["turns/max"] == 3.0


def test_generate_shows_an_episode_turn_by_turn(setup, capsys):
    assert main(["generate", str(setup / "model"), PROMPT, "--env", f"{setup / 'my_env.py'}:MyEnv",
                 "--row", '{"answer": "1086"}', "--max-new-tokens", "48", "--max-total-tokens", "160"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("--- episode 1/1 (3 model turns") and "environment reward: 1" in printed[0]
    assert printed[1:] == ["[model]  <call>calculator(23*47)</call>", "[env]   <result>1081</result>",
                           "[model]  1081+5 <call>calculator(1081+5)</call>", "[env]   <result>1086</result>",
                           "[model]  A: 1086"]


def test_episode_flags_are_checked_before_a_model_loads(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "x", "--env", "nope"]) == 1
    assert "unknown environment 'nope'" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "x", "--env", "guess_number", "--max-turns", "0"]) == 1
    assert "--max-turns must be >= 1" in capsys.readouterr().err
