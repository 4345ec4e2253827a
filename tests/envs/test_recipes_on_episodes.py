"""Every RL recipe over episodes of the bundled calculator environment (rollout.env=arithmetic_tools),
2 steps on the conftest's tiny taught model (it calls the calculator, so the trajectories hold
environment tokens), plus a user environment loaded from a file and `posttrain eval` on the
calculator environment. Each run: finite metrics, turns/mean >= 1, and lengths (the metrics'
response_length) that count model tokens only."""

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from posttrain.cli import main
from posttrain.config import build_config

from .conftest import PROMPT, write_setup

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ROW = {"prompt": PROMPT, "answer": "1086"}


@pytest.fixture(scope="module")
def setup(taught, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes_on_episodes")
    write_setup(root, taught, tok)
    (root / "train.jsonl").write_text((json.dumps(ROW) + "\n") * 2)
    return root


def test_eval_on_the_calculator_environment_reports_turns_and_tool_calls(setup, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", str(setup / "model"), "--data", str(setup / "train.jsonl"), "--env", "arithmetic_tools",
                 "--max-new-tokens", "48", "--max-turns", "4", "--max-total-tokens", "160", "--out", str(out)]) == 0
    summary = json.loads((out / "eval.json").read_text())
    m = summary["metrics"]
    assert summary["settings"]["env"] == "arithmetic_tools" and summary["settings"]["reward_specs"] == ["env_reward"]
    assert m["turns/mean"] == 3.0 and m["turns/max"] == 3.0 and m["tool_calls/mean"] == 2.0
    assert m["tool/errors"] == 0.0 and m["episode/truncated"] == 0.0 and math.isfinite(m["env/reward/mean"])
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["turns"] == 3 and sample["tool_calls"] == 2
    assert "<result>1081</result>" in sample["completion"] and "<result>1086</result>" in sample["completion"]


def overrides(setup, run_dir, n, extra=()):
    """A tiny batch and short episodes (two turns: a call, its result, the next turn cut by the
    episode's 72 tokens) on the taught model; no held-out eval."""
    return [f"model.path={setup / 'model'}", f"data.train_files=[{setup / 'train.jsonl'}]", "data.eval_files=[]",
            "eval.task=null", "data.train_batch_size=2", f"rollout.n={n}", "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size=2", "actor.ppo_epochs=1", "rollout.env=arithmetic_tools",
            "rollout.max_new_tokens=40", "rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_total_tokens=72",
            "reward.functions=[env_reward]", "trainer.max_steps=2", "trainer.save_steps=0", "trainer.eval_steps=0",
            "trainer.report_to=[]", "trainer.progress=false", f"trainer.output_dir={run_dir}", *extra]


RECIPE_RUNS = {
    "grpo": (GRPOConfig, 2, ()),
    # the overlong buffer 48 > one turn's 40 tokens: valid against the episode's limit min(2·40, 72)
    "dapo": (GRPOConfig, 2, ("algorithm.max_gen_batches=1", "algorithm.overlong.buffer=48")),
    "gspo": (GRPOConfig, 2, ()),
    "dr_grpo": (GRPOConfig, 2, ()),
    "rloo": (GRPOConfig, 2, ()),
    "reinforce_pp": (GRPOConfig, 2, ()),
    "ppo": (PPOConfig, 1, ("critic.warmup_steps=0",)),
}


def check_run(trainer, run_dir):
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and (run_dir / "final" / "config.json").is_file()
    for m in steps:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert m["turns/mean"] >= 1 and m["turns/max"] >= m["turns/mean"]
    b = trainer.last_batch
    model_tokens = b.response_mask.sum(-1)
    assert torch.equal(b.lengths, model_tokens) and (b.total_lengths > b.lengths).any()  # results in the trajectories
    if not trainer.args.algorithm.filter_groups:  # DAPO's metrics count the groups it dropped too
        assert steps[-1]["response_length/mean"] == pytest.approx(float(model_tokens.float().mean()))
    for row in range(len(b)):
        env = [t for t in range(int(b.total_lengths[row])) if b.response_mask[row, t] == 0]
        assert not env or trainer.tokenizer.decode(b.response_ids[row, env].tolist()).startswith("<result>")
        assert not b.advantages[row, env].any()
    return steps


@pytest.mark.parametrize("recipe", list(RECIPE_RUNS))
def test_each_rl_recipe_trains_two_steps_on_calculator_episodes(setup, tmp_path, recipe):
    cls, n, extra = RECIPE_RUNS[recipe]
    cfg = build_config(cls, RECIPES / f"{recipe}.yaml", overrides(setup, tmp_path, n, extra))
    trainer = (PPOTrainer if cls is PPOConfig else GRPOTrainer)(args=cfg)
    trainer.train()
    steps = check_run(trainer, tmp_path)
    assert all(m["tool_calls/mean"] > 0 for m in steps)  # the calculator was called in every step
    if recipe == "ppo":
        assert all(math.isfinite(m["value_loss"]) for m in steps)


def test_grpo_with_a_user_environment_from_a_file(setup, tmp_path):
    """rollout.env=path/to/file.py:MyEnv through the command line, as a user would run it."""
    run_dir = tmp_path / "run"
    args = overrides(setup, run_dir, 2, (f"rollout.env={setup / 'my_env.py'}:MyEnv",))
    cfg = build_config(GRPOConfig, RECIPES / "grpo.yaml", args)
    trainer = GRPOTrainer(args=cfg)
    assert type(trainer.roles.rollout.env_factory()).__name__ == "MyEnv"
    trainer.train()
    check_run(trainer, run_dir)
