"""RL over multi-turn episodes: the rollout role returns one RLBatch whose trajectory is one
response (environment tokens masked), the actor's log-probs condition on the observations,
GRPO and PPO with GAE train on it with finite losses, environment rewards combine with
reward functions through reward.weights, and the episode metrics are logged every step."""

import copy
import json
import math

import pytest
import torch
import yaml

from posttrain import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from posttrain.config import ConfigError, build_config, to_dict
from posttrain.data.collate import pad_id_of
from posttrain.envs import ToolEnvironment, calculator, episode_factory
from posttrain.rollout import MultiTurnLimits, SamplingParams, make_engine
from posttrain.workers import RLBatch, Rollout
from posttrain.workers.forward import response_logits

from .conftest import PROMPT

ROWS = [{"prompt": PROMPT, "answer": 1086}] * 8
EPISODE_METRICS = ("turns/mean", "turns/max", "tool_calls/mean", "tool/errors", "tool/timeouts",
                   "env/reward/mean", "episode/truncated")


class Arithmetic(ToolEnvironment):
    """The conftest's calculator episode; the final answer scores 1 when it ends in the answer."""

    def __init__(self, **kw):
        super().__init__(tools=[calculator], describe_tools=False, **kw)

    def score(self, answer: str) -> float:
        return float(answer.strip().endswith(str(self.row["answer"])))


def prompt_batch(tok, rows):
    examples = [{"ids": tok(r["prompt"])["input_ids"], "prompt": r["prompt"],
                 "columns": {"answer": r["answer"]}} for r in rows]
    return RLBatch.from_prompts(examples, pad_id_of(tok))


def environment_positions(batch, row):
    """Columns of row's trajectory that the environment wrote."""
    k = int(batch.total_lengths[row])
    return [t for t in range(k) if batch.response_mask[row, t] == 0]


def test_the_rollout_role_returns_episodes_as_one_response(taught, tok):
    worker = Rollout(make_engine("native", taught, tok), SamplingParams(n=2, temperature=0.0, max_new_tokens=48),
                     Arithmetic, MultiTurnLimits(max_turns=4, max_total_tokens=160))
    b = worker.generate(prompt_batch(tok, ROWS[:2]), seed=0)
    assert len(b) == 4 and b.uid.tolist() == [0, 0, 1, 1] and b.meta["n"] == 2
    env = environment_positions(b, 0)
    assert tok.decode(b.response_ids[0, env].tolist()) == "<result>1081</result><result>1086</result>"
    assert torch.equal(b.lengths, b.response_mask.sum(-1)) and bool((b.total_lengths - b.lengths == 42).all())
    assert b.trajectory_lengths is b.total_lengths and b.token_counts()[0] == b.prompt_mask[0].sum() + b.total_lengths[0]
    assert b.attention_mask[0, b.prompt_ids.shape[1] + env[0]] == 1  # the model sees the results
    assert b.trimmed().response_ids.shape[1] == int(b.total_lengths.max())
    assert b.columns["env_reward"] == [1.0] * 4 and b.completions[0].endswith("A: 1086")
    assert b.meta["episode_metrics"]["tool_calls/mean"] == 2.0 and not b.truncated.any()


def test_actor_logprobs_over_the_full_sequence_equal_the_engines(taught, tok):
    """The teacher-forced pass attends to the environment's tokens (attention over
    total_lengths), so it reproduces the sampling engine's log-probs on every model token."""
    worker = Rollout(make_engine("native", taught, tok), SamplingParams(n=3, temperature=1.0, max_new_tokens=48),
                     Arithmetic, MultiTurnLimits(max_turns=4, max_total_tokens=160))
    b = worker.generate(prompt_batch(tok, ROWS[:2]), seed=1)
    with torch.no_grad():
        logits = response_logits(taught, b.trimmed())
    logp = torch.log_softmax(logits.float(), -1).gather(-1, b.trimmed().response_ids[..., None])[..., 0]
    mask = b.trimmed().response_mask.bool()
    assert (b.total_lengths > b.lengths).any()
    torch.testing.assert_close(logp[mask], b.trimmed().rollout_logp[mask], atol=2e-4, rtol=0)


def config(cls, run_dir, **overrides):
    base = {"rollout.max_new_tokens": 48, "rollout.multi_turn.max_turns": 4,
            "rollout.multi_turn.max_total_tokens": 160, "data.train_batch_size": 2, "actor.micro_batch_size": 2,
            "trainer.max_steps": 2, "trainer.learning_rate": 1e-4, "trainer.lr_scheduler": "constant",
            "trainer.report_to": [], "trainer.progress": False, "trainer.output_dir": str(run_dir)}
    base.update(overrides)
    return build_config(cls, None, [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()])


def lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_masks(trainer):
    """The environment's tokens are the results, and get no advantage (no policy gradient)."""
    b = trainer.last_batch
    for row in range(len(b)):
        env = environment_positions(b, row)
        assert not b.advantages[row, env].any()
        if env:
            assert trainer.tokenizer.decode(b.response_ids[row, env].tolist()).startswith("<result>")


@pytest.mark.parametrize("cls,estimator,n", [(GRPOConfig, "grpo", 4), (PPOConfig, "gae", 1)])
def test_grpo_and_ppo_train_on_episodes(taught, tok, tmp_path, cls, estimator, n):
    cfg = config(cls, tmp_path, **{"algorithm.adv_estimator": estimator, "rollout.n": n,
                                   "actor.ppo_epochs": 2})
    trainer_cls = PPOTrainer if cls is PPOConfig else GRPOTrainer
    trainer = trainer_cls(copy.deepcopy(taught), args=cfg, train_dataset=ROWS, processing_class=tok,
                          environment_factory=Arithmetic)
    trainer.train()
    steps = lines(tmp_path)
    critic = ("value_loss", "values/mean", "returns/mean", "critic/grad_norm", "timing/values", "timing/update_critic")
    for m in steps:
        for key in ("policy_loss", "grad_norm", "reward/mean", *EPISODE_METRICS):
            assert math.isfinite(m[key]), (key, m)
        if cls is PPOConfig:
            assert all(math.isfinite(m[key]) for key in critic), m
        else:  # no critic: none of its metrics, not even zeros
            assert not [k for k in m if k in critic or k.startswith("critic/")], m
        assert m["reward/env_reward/mean"] == pytest.approx(m["env/reward/mean"])
        assert m["turns/max"] >= m["turns/mean"] >= 1
    assert len(steps) == 2 and max(m["tool_calls/mean"] for m in steps) > 0
    check_masks(trainer)


def test_environment_rewards_combine_with_reward_functions_by_weight(taught, tok, tmp_path):
    cfg = config(GRPOConfig, tmp_path, **{"rollout.n": 2, "trainer.max_steps": 1,
                                          "reward.functions": ["env_reward", "exact_match"],
                                          "reward.weights": [1.0, 0.5]})
    trainer = GRPOTrainer(copy.deepcopy(taught), args=cfg, train_dataset=ROWS, processing_class=tok,
                          environment_factory=Arithmetic)
    trainer.train()
    r = trainer.last_batch.rewards
    assert not r["env_reward"].isnan().any() and not r["exact_match"].isnan().any()
    torch.testing.assert_close(r["total"], r["env_reward"] + 0.5 * r["exact_match"])
    # config.yaml records the Python API's environment_factory as the rollout.env that loads it again
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout"]["env"] == f"{__name__}:Arithmetic"


def test_a_python_api_environment_or_tool_that_cannot_be_loaded_by_name_stops_a_rerun(tmp_path):
    """config.yaml of a run given a closure as a tool: a rerun from it names rollout.tools."""
    from posttrain.config.core import save_config
    from posttrain.config.inputs import recorded_config
    from posttrain.trainers.setup import python_inputs

    def lookup(query: str) -> str:
        return query

    inputs = python_inputs(None, None, environment_factory=Arithmetic, tools=["calculator", lookup])
    saved = recorded_config(to_dict(GRPOConfig()), inputs)
    assert saved["rollout"]["env"] == f"{__name__}:Arithmetic"
    assert saved["rollout"]["tools"] == ["calculator", f"{__name__}:{lookup.__qualname__}"]
    save_config(saved, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"rollout\.tools: .* with tools that cannot be loaded by name: "
                       + f"{__name__}:test_a_python_api.*lookup"):
        build_config(GRPOConfig, tmp_path / "config.yaml", ["reward.functions=[exact_match]"])
    rerun = build_config(GRPOConfig, tmp_path / "config.yaml",
                         ["reward.functions=[exact_match]", "rollout.tools=[calculator]"])
    assert rerun.rollout.env == f"{__name__}:Arithmetic"


def test_rollout_tools_in_the_config_make_a_tool_environment(taught, tok, tmp_path):
    """rollout.tools alone: a ToolEnvironment with those tools (its description appended to
    the prompt), trained with the configured reward functions."""
    factory = episode_factory(None, ["calculator"])
    env = factory()
    assert isinstance(env, ToolEnvironment) and list(env.tools) == ["calculator"]
    cfg = config(GRPOConfig, tmp_path, **{"rollout.n": 2, "trainer.max_steps": 1, "rollout.tools": ["calculator"],
                                          "reward.functions": ["exact_match"]})
    trainer = GRPOTrainer(copy.deepcopy(taught), args=cfg, train_dataset=ROWS, processing_class=tok)
    assert trainer.roles.rollout.env_factory is not None
    assert trainer.roles.pools["global_pool"].worker.actor.max_len == min(4 * 48, 160)  # Dr.GRPO's L counts an episode's model tokens
    trainer.train()
    assert all(math.isfinite(lines(tmp_path)[0][k]) for k in EPISODE_METRICS)


def test_episode_config_is_checked(tmp_path):
    cfg = config(GRPOConfig, tmp_path, **{"rollout.env": "no_such_env"})
    with pytest.raises(ConfigError, match="rollout.env: unknown environment"):
        GRPOTrainer(None, args=cfg, train_dataset=ROWS)
    assert config(GRPOConfig, tmp_path, **{"rollout.env": "guess_number"}).rollout.max_response_tokens() == 160
