"""RL end to end on tiny models: every estimator learns a known optimum, micro-batching and
resuming do not change the run, dynamic sampling stops, failures do not crash, the CLI runs.

The task: reward 1 when the response starts with the word "a" (one of 8 words, so a random
policy gets ~1/11), 0 otherwise; its optimum is reward 1.
"""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from posttrain import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from posttrain.cli import main
from posttrain.config import ConfigError, LoraConfig, build_config
from posttrain.data.tasks import make_task
from posttrain.models import BuiltinLM
from posttrain.models.lora import apply_lora
from posttrain.rewards.checks import RewardFunctionError
from posttrain.rollout.hf import HFEngine
from posttrain.rollout.native import NativeEngine
from posttrain.trainers.rl import RLTrainer

from .words import WORDS, word_tokenizer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TARGET = 3  # the id of "a"
RL_METRICS = (
    "reward/mean reward/std accuracy advantage/mean kl approx_kl clip_frac clip_frac/low clip_frac/high "
    "ratio/mean entropy response_length/mean response_length/max truncation_rate zero_std_group_frac "
    "value_loss policy_loss grad_norm lr timing/gen timing/reward timing/old_logprob timing/ref timing/values "
    "timing/adv timing/update_actor timing/update_critic timing/step throughput/tokens_per_s"
).split()
ROLLOUT_CORR_METRICS = [f"rollout_corr/{k}" for k in (
    "kl k3_kl log_ppl_abs_diff ppl_ratio rollout_is_mean rollout_is_max rollout_is_min rollout_is_eff_sample_size "
    "rollout_rs_masked_fraction").split()]
"""veRL's names (`posttrain.algos.rollout_correction`); the first four with correction off too."""


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return BuiltinLM.from_preset("tiny", vocab_size=len(WORDS) + 3, num_hidden_layers=1, hidden_size=64,
                                 intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)


def starts_with_a(prompts, completions, completion_ids, **columns):
    return [1.0 if ids and ids[0] == TARGET else 0.0 for ids in completion_ids]


starts_with_a.is_correctness = True  # reward 1 is right: it defines `accuracy`


PROMPTS = [{"prompt": " ".join(WORDS[(i * 7 + k) % 8] for k in range(1 + i % 4)), "answer": "a"} for i in range(64)]


def config(run_dir, estimator="grpo", **overrides):
    """A fast config: 8 prompts × 8 responses of 3 tokens (PPO: 32 prompts × 1), lr 1e-2."""
    ppo = estimator == "gae"
    base = {
        "algorithm.adv_estimator": estimator, "rollout.n": 1 if ppo else 8, "rollout.max_new_tokens": 3,
        "data.train_batch_size": 32 if ppo else 8, "actor.micro_batch_size": 16,
        "trainer.max_steps": 15, "trainer.learning_rate": 1e-2, "trainer.lr_scheduler": "constant",
        "trainer.report_to": [], "trainer.progress": False, "trainer.output_dir": str(run_dir),
    }
    base.update(overrides)
    return build_config(PPOConfig if ppo else GRPOConfig, None,
                        [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in base.items()])


def trainer_for(cfg, reward=starts_with_a, model=None, **kwargs):
    cls = PPOTrainer if cfg.use_critic else GRPOTrainer
    return cls(model if model is not None else tiny_model(), reward_funcs=[reward], args=cfg,
               train_dataset=PROMPTS, processing_class=word_tokenizer(), **kwargs)


def in_process_worker(trainer):
    """The local backend's one `RLWorker` (its roles' objects, for checks on them)."""
    return trainer.roles.pools["global_pool"].worker


def metric_lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b, atol=1e-5):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5)


LEARNERS = {
    "ppo": ("gae", {}),
    "ppo-shared-backbone": ("gae", {"critic.share_backbone": "true", "critic.vf_coef": 0.5}),
    "grpo": ("grpo", {}),
    "dr_grpo": ("dr_grpo", {"actor.policy_loss.loss_agg_mode": "seq-mean-token-sum-norm"}),
    "rloo": ("rloo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
    "gspo": ("grpo", {"actor.policy_loss.level": "sequence", "actor.policy_loss.clip_low": 3e-4,
                      "actor.policy_loss.clip_high": 4e-4, "actor.policy_loss.loss_agg_mode": "seq-mean-token-mean"}),
}


@pytest.mark.parametrize("name", list(LEARNERS))
def test_every_estimator_reaches_the_optimum(tmp_path, name):
    estimator, overrides = LEARNERS[name]
    trainer_for(config(tmp_path, estimator, **overrides)).train()
    rewards = [m["reward/mean"] for m in metric_lines(tmp_path)]
    assert len(rewards) == 15 and rewards[0] < 0.4
    assert sum(rewards[-3:]) / 3 > 0.9, rewards


def test_every_metric_every_step_and_eval_samples(tmp_path):
    # PPO with the rollout correction on (sequence TIS): the native engine in fp32 shows no gap
    cfg = config(tmp_path, "gae", **{"trainer.max_steps": 2, "trainer.eval_steps": 2, "eval.num_examples": 5,
                                     "algorithm.rollout_correction.rollout_is": "sequence", "actor.ppo_epochs": 2})
    trainer_for(cfg, eval_dataset=PROMPTS[:5]).train()
    lines = metric_lines(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        missing = [k for k in RL_METRICS + ROLLOUT_CORR_METRICS if not isinstance(m.get(k), (int, float))]
        assert not missing, missing
        assert abs(m["rollout_corr/kl"]) < 1e-6 and m["rollout_corr/k3_kl"] < 1e-6, m
        assert abs(m["rollout_corr/ppl_ratio"] - 1) < 1e-5 and abs(m["rollout_corr/rollout_is_mean"] - 1) < 1e-5
        assert m["rollout_corr/rollout_is_eff_sample_size"] > 1 - 1e-6 and m["rollout_corr/rollout_rs_masked_fraction"] == 0
    assert "eval/accuracy" in lines[1] and "eval/accuracy" not in lines[0]
    assert lines[0]["data/n_rows"] == 64
    samples = [json.loads(s) for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["split"]) for s in samples] == [(1, "train")] * 4 + [(2, "eval")] * 5 + [(2, "train")] * 4
    assert (tmp_path / "final" / "config.json").is_file() and (tmp_path / "final" / "critic" / "config.json").is_file()


def test_an_on_policy_update_skips_the_old_logprob_pass_exactly(tmp_path, monkeypatch):
    overrides = {"trainer.max_steps": 2, "trainer.learning_rate": 1e-2, "actor.micro_batch_size": 16}
    skipped = trainer_for(config(tmp_path / "a", **overrides))
    skipped.train()
    monkeypatch.setattr(RLTrainer, "on_policy_update", property(lambda self: False))
    recomputed = trainer_for(config(tmp_path / "b", **overrides))
    recomputed.train()
    assert_same_weights(weights(skipped.model), weights(recomputed.model), atol=1e-6)
    a, b = metric_lines(tmp_path / "a"), metric_lines(tmp_path / "b")
    assert all(x["timing/old_logprob"] < y["timing/old_logprob"] / 10 for x, y in zip(a, b))
    assert all(m["ratio/mean"] == 1.0 for m in a)


def test_the_engine_gap_is_logged_with_the_correction_off(tmp_path):
    # GRPO on-policy (no old-log-prob pass of its own): calculate_log_probs=true adds the pass and
    # logs the gap; fp32 native engine: ~0. The update is the one without it (ratio 1, weights none).
    overrides = {"trainer.max_steps": 2, "actor.micro_batch_size": 16}
    plain = trainer_for(config(tmp_path / "a", **overrides))
    plain.train()
    logged = trainer_for(config(tmp_path / "b", **overrides, **{"rollout.calculate_log_probs": "true"}))
    logged.train()
    assert_same_weights(weights(plain.model), weights(logged.model), atol=1e-6)
    for m in metric_lines(tmp_path / "b"):
        assert abs(m["rollout_corr/kl"]) < 1e-6 and m["rollout_corr/log_ppl_abs_diff"] < 1e-6, m
        # the weights the correction would apply are described though it is off: all ~1 here
        assert abs(m["rollout_corr/rollout_is_mean"] - 1) < 1e-5 and m["rollout_corr/rollout_is_eff_sample_size"] > 0.99999, m
    assert not any(k.startswith("rollout_corr/") for k in metric_lines(tmp_path / "a")[0])


def test_the_correction_s_weights_reach_the_update(tmp_path):
    # Token TIS on an engine that agrees (fp32): weights 1, the uncorrected update. Masking every
    # token (a window [0.4, 0.5] that ratio 1 is outside of): weights 0, so the policy never moves.
    overrides = {"trainer.max_steps": 2, "actor.micro_batch_size": 16}
    plain = trainer_for(config(tmp_path / "a", **overrides))
    plain.train()
    tis = trainer_for(config(tmp_path / "b", **overrides, **{"algorithm.rollout_correction.rollout_is": "token"}))
    tis.train()
    assert_same_weights(weights(plain.model), weights(tis.model), atol=1e-5)  # weights 1 ± fp32 rounding
    start = weights(tiny_model())
    masked = trainer_for(config(tmp_path / "c", **overrides, **{
        "algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_is_mode": "mask",
        "algorithm.rollout_correction.rollout_is_threshold_lower": 0.4,
        "algorithm.rollout_correction.rollout_is_threshold": 0.5}))
    masked.train()
    assert_same_weights(start, weights(masked.model), atol=0)
    lines = metric_lines(tmp_path / "c")
    assert all(m["rollout_corr/rollout_rs_masked_fraction"] == 1 and m["rollout_corr/rollout_is_eff_sample_size"] == 0
               for m in lines)
    assert any(m["grad_norm"] > 0 for m in metric_lines(tmp_path / "b")) and all(m["grad_norm"] == 0 for m in lines)


def test_bypass_mode_uses_the_engine_s_log_probs_without_a_pass(tmp_path):
    # ppo_epochs 2 needs old log-probs: bypass takes the engine's (no actor pass), which in fp32
    # are the actor's, so the run is the recomputing one
    overrides = {"trainer.max_steps": 2, "actor.micro_batch_size": 16, "actor.ppo_epochs": 2}
    recomputed = trainer_for(config(tmp_path / "a", **overrides))
    recomputed.train()
    bypass = trainer_for(config(tmp_path / "b", **overrides, **{"algorithm.rollout_correction.bypass_mode": "true"}))
    bypass.train()
    assert_same_weights(weights(recomputed.model), weights(bypass.model), atol=2e-5)
    a, b = metric_lines(tmp_path / "a"), metric_lines(tmp_path / "b")
    assert all(y["timing/old_logprob"] < x["timing/old_logprob"] / 10 for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("correction", [
    {"rollout_is": "token"},
    {"rollout_is": "sequence", "rollout_is_mode": "mask", "rollout_is_threshold_lower": 0.5},
    {"bypass_mode": "true"},
])
def test_a_corrected_run_reaches_the_optimum(tmp_path, correction):
    cfg = config(tmp_path, **{f"algorithm.rollout_correction.{k}": v for k, v in correction.items()})
    trainer_for(cfg).train()
    rewards = [m["reward/mean"] for m in metric_lines(tmp_path)]
    assert rewards[0] < 0.4 and sum(rewards[-3:]) / 3 > 0.9, rewards


@pytest.mark.parametrize("variant", ["micro", "tokens", "memory-levers"])
def test_micro_batching_does_not_change_the_run(tmp_path, variant):
    common = {"trainer.max_steps": 2, "trainer.learning_rate": 1e-3, "algorithm.kl.in_loss": "true",
              "actor.ppo_mini_batch_size": 4, "actor.entropy_coeff": 0.01}
    split = {"micro": {"actor.micro_batch_size": 4}, "tokens": {"actor.max_tokens_per_micro_batch": 40},
             "memory-levers": {"actor.max_tokens_per_micro_batch": 40, "model.use_remove_padding": "true",
                               "model.gradient_checkpointing": "true"}}[variant]
    a = trainer_for(config(tmp_path / "a", **common, **{"actor.micro_batch_size": 32}))
    a.train()
    b = trainer_for(config(tmp_path / "b", **common, **split))
    worker = in_process_worker(b)
    b.train()
    assert_same_weights(weights(a.model), weights(b.model))
    if variant == "memory-levers":  # the keys reached the roles
        assert worker.actor.remove_padding and worker.ref.remove_padding
        assert b.model.model.layers[0].checkpoint_kwargs is not None


def test_skipping_zero_advantage_rows_and_grouping_by_length_do_not_change_the_run(tmp_path, monkeypatch):
    """The actor's two shortcuts (no forward for rows of all-equal groups; micro-batches of
    rows of similar length) against the plain update: every row, micro-batches in order."""
    from posttrain.workers import Actor, forward

    overrides = {"trainer.max_steps": 3, "trainer.learning_rate": 1e-3, "actor.micro_batch_size": 4,
                 "rollout.max_new_tokens": 5, "actor.ppo_mini_batch_size": 4}
    fast = trainer_for(config(tmp_path / "fast", **overrides))
    fast.train()
    monkeypatch.setattr(Actor, "update_parts", lambda self, mini: forward.micro_batches(
        mini, self.a.micro_batch_size, self.a.max_tokens_per_micro_batch, self.device))
    plain = trainer_for(config(tmp_path / "plain", **overrides))
    plain.train()
    assert_same_weights(weights(fast.model), weights(plain.model))
    a, b = metric_lines(tmp_path / "fast"), metric_lines(tmp_path / "plain")
    assert [m["reward/mean"] for m in a] == [m["reward/mean"] for m in b]
    assert [m["policy_loss"] for m in a] == pytest.approx([m["policy_loss"] for m in b], abs=1e-6)


@pytest.mark.parametrize("estimator,extra", [
    ("grpo", {"algorithm.kl.in_loss": "true", "algorithm.kl.adaptive": "true", "algorithm.kl.target": 0.01}),
    ("gae", {"critic.warmup_steps": 1, "algorithm.kl.in_reward": "true"}),
])
def test_resume_continues_exactly(tmp_path, estimator, extra):
    overrides = {"trainer.max_steps": 4, "trainer.save_steps": 2, "trainer.learning_rate": 3e-3, **extra}
    scored = []

    def counting(prompts, completions, completion_ids, **columns):
        scored.append(len(completions))
        return starts_with_a(prompts, completions, completion_ids)

    # The reward functions are the run's (config.yaml records each): both runs score with `counting`.
    full = trainer_for(config(tmp_path / "full", estimator, **overrides), reward=counting)
    full.train()
    # An interrupted run: the same run with everything after the step-2 checkpoint lost.
    run = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    shutil.rmtree(run / "final")
    scored.clear()
    resumed = trainer_for(config(run, estimator, **overrides), reward=counting)
    resumed.train()
    assert len(scored) == 2  # only steps 3 and 4 ran
    assert_same_weights(weights(full.model), weights(resumed.model), atol=1e-6)
    if estimator == "gae":
        assert_same_weights(weights(full.value_model), weights(resumed.value_model), atol=1e-6)
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3, 4]
    assert metric_lines(run)[3]["reward/mean"] == metric_lines(tmp_path / "full")[3]["reward/mean"]
    assert metric_lines(run)[0]["kl"] == 0.0  # the policy is the reference before its first update


def test_a_checkpoint_of_the_layout_before_the_workers_shards_still_resumes(tmp_path):
    """A local checkpoint written before the DCP layout (AdamW in trainer_state.pt, the critic's
    in critic/optimizer.pt) loads into a new run's worker: weights, AdamW moments, schedules
    and step counts (`RLWorker.restore_files`)."""
    from posttrain.checkpoint import RunModels, save_checkpoint

    small = {"trainer.max_steps": 2, "data.train_batch_size": 4, "actor.micro_batch_size": 4}
    done = trainer_for(config(tmp_path / "a", "gae", **small))
    old = in_process_worker(done)
    done.step(1), done.step(2)  # the driver's steps, without the loop's own checkpoints
    path = save_checkpoint(tmp_path / "old", 2, RunModels(old.actor.model, old.critic), done.tokenizer,
                           old.actor.optimizer, old.actor.scheduler, done.state(), 0)
    assert not (path / "dcp").exists()
    fresh = trainer_for(config(tmp_path / "b", "gae", **small))
    assert fresh.restore(path) == 2
    new = in_process_worker(fresh)
    for a, b in ((old.actor, new.actor), (old.critic, new.critic)):
        assert_same_weights(weights(a.model), weights(b.model), atol=0)
        moments = [(s["exp_avg"], t["exp_avg"]) for s, t in zip(a.optimizer.state.values(), b.optimizer.state.values())]
        assert moments and all(torch.equal(x, y) for x, y in moments)
        assert a.scheduler.state_dict() == b.scheduler.state_dict() and a.steps == b.steps == 2


def test_a_python_api_run_records_its_data_and_reward_functions_for_a_rerun(tmp_path):
    """Seen: config.yaml of a run started from Python said data.train_files: [] and
    reward.functions: [], so nothing could rerun it. Now it records what was passed; a rerun
    from it reproduces what is loadable by name and names what is missing; a Python resume on
    other rows is refused."""
    from posttrain.data.sources import rows_sha256
    from posttrain.rewards import format_reward

    def local(prompts, completions, completion_ids, **columns):  # a closure: not loadable by name
        return [0.0] * len(completions)

    run = tmp_path / "run"
    quick = {"trainer.max_steps": 1, "trainer.save_steps": 1, "data.train_batch_size": 2, "rollout.n": 4,
             "actor.micro_batch_size": 8}
    GRPOTrainer(tiny_model(), reward_funcs=[starts_with_a, format_reward(pattern="^a"), local],
                args=config(run, **quick), train_dataset=PROMPTS, processing_class=word_tokenizer()).train()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    here = starts_with_a.__module__
    assert saved["reward"]["functions"] == [f"{here}:starts_with_a", {"name": "format_reward", "pattern": "^a"},
                                            f"{here}:{local.__qualname__}"]
    record = saved["python_api"]
    assert record["train_dataset"] == {"type": "list", "rows": 64, "sha256": rows_sha256(PROMPTS)}
    assert [r["spec"] for r in record["reward_funcs"]][2] is None and record["reward_funcs"][0]["file"] == __file__
    assert saved["data"]["train_files"] == []
    with pytest.raises(ConfigError, match=r"data\.train_files: .*config\.yaml is the config\.yaml of a run started "
                       r"from Python with an in-memory train_dataset \(list of 64 rows, sha256 "
                       + rows_sha256(PROMPTS)[:16]):
        build_config(GRPOConfig, run / "config.yaml", [])
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    with pytest.raises(ConfigError, match=r"reward\.functions: .*cannot be loaded by name: " + here
                       + r":test_a_python_api.*<locals>\.local \(in " + __file__):
        build_config(GRPOConfig, run / "config.yaml", [f"data.train_files=[{train}]"])
    mine = f"reward.functions=[{here}:starts_with_a,{{name: format_reward, pattern: ^a}},{here}:always_one]"
    rerun = build_config(GRPOConfig, run / "config.yaml", [f"data.train_files=[{train}]", mine])
    assert rerun.reward.functions[0] == f"{here}:starts_with_a" and rerun.data.train_files == [str(train)]
    with pytest.raises(ConfigError, match=r"python_api\.train_dataset\.rows: 64 → 32"):  # before weights load
        GRPOTrainer(tiny_model(), reward_funcs=[starts_with_a, format_reward(pattern="^a"), local],
                    args=config(run, **{**quick, "trainer.max_steps": 2}), train_dataset=PROMPTS[:32],
                    processing_class=word_tokenizer()).train()


@pytest.mark.slow  # ~3 s: two runs of the built-in tiny model (the command line builds it from model.init)
def test_a_python_api_run_whose_inputs_load_by_name_resumes_from_its_config_yaml(tmp_path, caplog):
    """The rerun that reproduces: data from a file and a reward function importable by name,
    so `posttrain grpo --config RUN_DIR/config.yaml` continues the run (same fingerprint)."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS[:8]))
    run = tmp_path / "run"
    cfg = config(run, **{"model.init": "tiny", "trainer.max_steps": 1, "trainer.save_steps": 1,
                         "data.train_batch_size": 2, "rollout.n": 2, "actor.micro_batch_size": 4})
    GRPOTrainer(args=cfg, reward_funcs=[starts_with_a], train_dataset=str(train)).train()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["train_files"] == [str(train.resolve())]
    assert saved["reward"]["functions"] == [f"{starts_with_a.__module__}:starts_with_a"]
    with caplog.at_level("INFO", logger="posttrain.trainers.loop"):
        assert main(["grpo", "--config", str(run / "config.yaml"), "trainer.max_steps=2"]) == 0
    assert "resuming with changed settings: trainer.max_steps: 1 → 2\n" in caplog.text + "\n"
    assert [m["step"] for m in metric_lines(run)] == [1, 2]


def always_one(prompts, completions, completion_ids, **columns):
    return [1.0] * len(completions)


def test_dynamic_sampling_gives_up_after_max_gen_batches(tmp_path, caplog):
    cfg = config(tmp_path, **{"algorithm.filter_groups": "true", "algorithm.max_gen_batches": 3,
                              "trainer.max_steps": 1})
    trainer_for(cfg, reward=always_one).train()
    (m,) = metric_lines(tmp_path)
    assert m["dynamic_sampling/gen_batches"] == 3 and m["dynamic_sampling/kept_frac"] == 0.0
    assert m["zero_std_group_frac"] == 1.0 and "dynamic sampling kept 0 of 8 groups" in caplog.text


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    from posttrain.algos import filter_groups
    from posttrain.trainers.rl import rl_step

    cfg = config(tmp_path, **{"algorithm.filter_groups": "true", "algorithm.max_gen_batches": 20,
                              "rollout.n": 4, "data.train_batch_size": 4})
    trainer = trainer_for(cfg)
    metrics, batch = rl_step(trainer, 1)
    assert len(batch) == 16 and bool(filter_groups(batch.scores, 4).all())
    assert metrics["dynamic_sampling/gen_batches"] > 1 and metrics["dynamic_sampling/kept_frac"] < 1


def flaky(prompts, completions, completion_ids, **columns):
    if len(completions) > 1 or completion_ids[0][0] == TARGET:
        raise RuntimeError("reward function bug")
    return [0.0]


def test_a_raising_reward_function_does_not_crash_the_run(tmp_path):
    trainer_for(config(tmp_path, **{"trainer.max_steps": 2, "reward.failure_reward": 1.0}), reward=flaky).train()
    lines = metric_lines(tmp_path)
    assert len(lines) == 2 and all(m["reward/flaky/errors"] > 0 for m in lines)
    assert (tmp_path / "final" / "config.json").is_file()


def test_lora_run_exports_a_merged_policy_and_keeps_one_copy(tmp_path):
    model = apply_lora(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cfg = config(tmp_path, **{"trainer.max_steps": 2, "algorithm.kl.in_loss": "true"})
    trainer = trainer_for(cfg, model=model)
    assert in_process_worker(trainer).ref.model is model
    trainer.train()
    merged = BuiltinLM.from_pretrained(tmp_path / "final")
    ids = torch.tensor([[1, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), copy.deepcopy(model).merge_and_unload()(ids), atol=1e-5, rtol=1e-5)
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    make_task("arithmetic", out, n_train=40, n_test=8, seed=0, difficulty="easy")
    return out


@pytest.mark.parametrize("command,recipe,extra", [
    ("grpo", "grpo", []), ("grpo", "dapo", []),
    ("ppo", "ppo", ["critic.warmup_steps=1"]),  # the recipe's 10 critic-only steps exceed this run's 2
])
def test_cli_runs_a_recipe_on_a_tiny_model(arith, tmp_path, command, recipe, extra):
    torch.manual_seed(0)
    run = tmp_path / "run"
    code = main([
        command, "--config", str(RECIPES / f"{recipe}.yaml"), "model.path=null", "model.init=tiny",
        f"data.train_files=[{arith / 'train.jsonl'}]", f"data.eval_files=[{arith / 'test.jsonl'}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=6",
        "actor.micro_batch_size=4", "trainer.max_steps=2", "trainer.eval_steps=2", "trainer.save_steps=1",
        "eval.num_examples=2", "eval.max_new_tokens=6", "algorithm.overlong.buffer=0", "algorithm.max_gen_batches=2",
        f"trainer.output_dir={run}", "trainer.report_to=[]", "trainer.progress=false", *extra,
    ])
    assert code == 0
    lines = metric_lines(run)
    assert [m["step"] for m in lines] == [1, 2] and "eval/accuracy" in lines[-1]
    assert (run / "config.yaml").is_file() and (run / "final" / "config.json").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert (run / "final" / "critic" / "config.json").is_file() == (command == "ppo")


def test_max_time_s_ends_the_run_like_max_steps(tmp_path):
    run = tmp_path / "run"
    cfg = config(run, **{"trainer.max_time_s": 1e-6, "trainer.save_steps": 0})
    result = trainer_for(cfg, eval_dataset=PROMPTS[:8]).train()
    assert result.step == 1
    lines = metric_lines(run)
    assert [m["step"] for m in lines if "reward/mean" in m] == [1] and "eval/accuracy" in lines[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1"]
    assert (run / "final" / "config.json").is_file()


def test_prompt_loading_follows_the_truncation_rule():
    from posttrain.config import ConfigError
    from posttrain.data.prompts import load_prompts

    rows = [{"question": "a b c d e f", "answer": "x"}, {"question": "a", "extra": 1}]
    cfg = config("unused", **{"data.max_prompt_length": 4, "data.prompt_key": "question"}).data
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length: the prompt of list: row 1 has 7 tokens"):
        load_prompts([dict(r) for r in rows], word_tokenizer(), cfg)
    cfg.truncation = "left"
    examples, stats = load_prompts([dict(r) for r in rows], word_tokenizer(), cfg)
    assert examples[0]["ids"] == [5, 6, 7, 8] and stats["data/n_truncated"] == 1
    assert examples[0]["columns"] == {"answer": "x", "extra": None} and examples[1]["prompt"] == "a"
    cfg.truncation = "drop"
    examples, stats = load_prompts([dict(r) for r in rows], word_tokenizer(), cfg)
    assert len(examples) == 1 and stats["data/n_dropped"] == 1


# ---------------------------------------------------------------- a run that cannot learn says so (#15)


def always_raises(prompts, completions, completion_ids, **columns):
    raise RuntimeError("reward function bug")


def wrong_length(prompts, completions, completion_ids, **columns):
    return [1.0]


def returns_a_string(prompts, completions, completion_ids, **columns):
    return "1.0"


@pytest.mark.parametrize("reward,seen", [
    (always_raises, "RuntimeError: reward function bug"),
    (wrong_length, "returned [1.0] for 64 completions"),
    (returns_a_string, "returned '1.0' for 64 completions"),
])
def test_a_reward_function_that_always_fails_stops_the_run_before_any_update(tmp_path, reward, seen):
    # Before #15 each of these trained 15 steps of reward 0 and grad_norm 0 and exited 0.
    model = tiny_model()
    before = weights(model)
    with pytest.raises(RewardFunctionError) as err:
        trainer_for(config(tmp_path), reward=reward, model=model).train()
    message = str(err.value)
    assert f"reward function {reward.__name__!r} failed on all 64 samples of step 1" in message
    assert "before any update" in message and seen in message
    if reward is always_raises:
        assert "Traceback" in message and "in always_raises" in message
    assert_same_weights(before, weights(model), atol=0)
    assert not (tmp_path / "final").exists() and not (tmp_path / "checkpoints").exists()


def test_max_bad_steps_steps_in_a_row_of_failing_every_sample_stop_the_run(tmp_path):
    calls = []

    def breaks_after_step_1(prompts, completions, completion_ids, **columns):
        calls.append(len(completions))
        if len(calls) > 1:
            raise RuntimeError("the grading server went away")
        return [0.0] * len(completions)

    cfg = config(tmp_path, **{"trainer.max_steps": 6, "trainer.max_bad_steps": 2})
    with pytest.raises(RewardFunctionError) as err:
        trainer_for(cfg, reward=breaks_after_step_1).train()
    message = str(err.value)
    assert "on every sample of 2 steps in a row (trainer.max_bad_steps=2), up to step 3" in message
    assert "the grading server went away" in message and "128 of 192 samples failed" in message
    assert [m["reward/breaks_after_step_1/errors"] for m in metric_lines(tmp_path)] == [0.0, 64.0]


def test_a_run_ends_with_each_reward_functions_error_rate(tmp_path, caplog):
    cfg = config(tmp_path, **{"trainer.max_steps": 2, "reward.failure_reward": 1.0})
    with caplog.at_level("INFO", logger="posttrain"):
        trainer_for(cfg, reward=flaky).train()
    errors = sum(m["reward/flaky/errors"] for m in metric_lines(tmp_path))
    summary = f"flaky: {int(errors)} of 128 samples failed ({errors / 128:.1%}), 0 NaN"
    assert any(r.levelname == "WARNING" and summary in r.getMessage() for r in caplog.records)


def test_nan_rewards_are_counted_and_warned_about_once(tmp_path, caplog):
    def nan_unless_a(prompts, completions, completion_ids, **columns):
        return [1.0 if ids and ids[0] == TARGET else float("nan") for ids in completion_ids]

    with caplog.at_level("WARNING", logger="posttrain"):
        trainer_for(config(tmp_path, **{"trainer.max_steps": 2}), reward=nan_unless_a).train()
    lines = metric_lines(tmp_path)
    nans = [m["reward/nan_unless_a/nan"] for m in lines]
    assert all(k > 0 for k in nans) and nans == [m["reward/nan_unless_a/none_frac"] * 64 for m in lines]
    warned = [r for r in caplog.records if "returned NaN" in r.getMessage()]
    assert len(warned) == 1 and "'nan_unless_a'" in warned[0].getMessage()


def test_task_reward_without_a_task_column_is_refused_before_the_run(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS[:8]))  # prompt, answer: no task
    cfg = config(tmp_path / "run", **{"data.train_files": [str(data)], "reward.functions": ["task_reward"]})
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(tiny_model(), args=cfg, processing_class=word_tokenizer())
    message = str(err.value)
    assert "reward function 'task_reward' needs the column 'task'" in message and str(data) in message
    assert not (tmp_path / "run").exists()


def test_a_reward_function_that_cannot_take_the_arguments_is_refused_before_the_run(tmp_path):
    def no_kwargs(completions):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"reward function 'no_kwargs'\(completions\) cannot be called .*"
                                          r"unexpected keyword argument 'prompts'"):
        trainer_for(config(tmp_path), reward=no_kwargs)


def tiny_gpt2_dir(path, dropout=0.1):
    """A 1-layer GPT-2 on the word vocabulary, with GPT-2's default dropout in its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(WORDS) + 3, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_first_on_policy_step_has_kl_0_and_ratio_1_with_dropout_in_the_config(
        tmp_path, monkeypatch, caplog, recompute):
    """Seen: GPT-2's default dropout 0.1 made step 1 log kl=0.0399, where the policy is the
    reference and the behaviour policy, so KL is exactly 0 and every ratio exactly 1.
    recompute: old log-probs from their own pass, not the loss's own (detached) ones."""
    if recompute:
        monkeypatch.setattr(RLTrainer, "on_policy_update", property(lambda self: False))
    cfg = config(tmp_path / "run", **{"model.path": tiny_gpt2_dir(tmp_path / "gpt2"), "model.init": "null",
                                      "algorithm.kl.in_loss": "true", "trainer.max_steps": 1})
    with caplog.at_level("INFO", logger="posttrain"):
        GRPOTrainer(args=cfg, reward_funcs=[starts_with_a], train_dataset=PROMPTS,
                    processing_class=word_tokenizer()).train()
    (step1,) = metric_lines(tmp_path / "run")
    assert step1["kl"] == 0.0 and step1["ratio/mean"] == 1.0
    assert "policy: dropout off in 4 modules" in caplog.text  # embd + attn, resid, mlp of the layer


def test_a_reward_model_folder_is_not_a_policy(tmp_path):
    """Seen: GRPO given an RM's final/ as the policy failed with `unexpected ['score.weight']`."""
    from posttrain.models.heads import ScalarHeadModel

    ScalarHeadModel.from_causal_lm(tiny_model()).save_pretrained(tmp_path / "rm")
    cfg = config(tmp_path / "run", **{"model.path": str(tmp_path / "rm"), "model.init": "null"})
    with pytest.raises(ValueError, match=r"is a reward model \(LlamaForSequenceClassification\), not a causal LM"):
        GRPOTrainer(args=cfg, reward_funcs=[starts_with_a], train_dataset=PROMPTS, processing_class=word_tokenizer())


# rollout.engine against the policy, as a TRL user sets it: the hf engine runs a Llama checkpoint (as a
# transformers model); an engine that cannot run the policy is refused in config keys before any model loads.


def grpo_for(cfg, model=None):
    return GRPOTrainer(model, reward_funcs=[starts_with_a], args=cfg, train_dataset=PROMPTS,
                       processing_class=word_tokenizer())


def test_hf_engine_on_a_llama_checkpoint_trains_a_transformers_policy(tmp_path):
    """Seen: rollout.engine=hf on a Llama folder failed in the engine unless model.impl=hf."""
    tiny_model().save_pretrained(tmp_path / "llama")
    cfg = config(tmp_path / "run", **{"model.path": str(tmp_path / "llama"), "rollout.engine": "hf",
                                      "trainer.max_steps": 1, "data.train_batch_size": 2})
    trainer = grpo_for(cfg)
    assert isinstance(trainer.model, transformers.LlamaForCausalLM)
    assert isinstance(in_process_worker(trainer).rollout.engine, HFEngine)
    trainer.train()
    (step,) = metric_lines(tmp_path / "run")
    assert 0.0 <= step["reward/mean"] <= 1.0 and step["response_length/mean"] > 0


def test_native_engine_on_a_model_it_cannot_run_is_refused_before_it_loads(tmp_path):
    """Seen: a raw TypeError naming make_engine('hf', ...), after the model had loaded. The folder
    has a GPT-2 config.json and no weights: loading it would fail otherwise."""
    (tmp_path / "gpt2").mkdir()
    gpt2 = transformers.GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2).to_dict()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(gpt2))
    cfg = config(tmp_path / "run", **{"model.path": str(tmp_path / "gpt2"), "rollout.engine": "native"})
    with pytest.raises(ConfigError, match=r"rollout.engine=native cannot run model.path=.*gpt2: model_type='gpt2' "
                                          r".*set rollout.engine=hf"):
        grpo_for(cfg)
    given = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**gpt2, "vocab_size": 11}))
    with pytest.raises(ConfigError, match="cannot run the GPT2LMHeadModel passed as the model"):
        grpo_for(config(tmp_path / "run2", **{"rollout.engine": "native"}), given)


@pytest.mark.parametrize("setting,key", [({"model.impl": "builtin"}, "model.impl"),
                                         ({"model.init": "tiny"}, "model.init")])
def test_hf_engine_on_the_builtin_model_is_refused_by_key(tmp_path, setting, key):
    tiny_model().save_pretrained(tmp_path / "llama")
    path = {} if "model.init" in setting else {"model.path": str(tmp_path / "llama")}
    cfg = config(tmp_path / "run", **{**path, **setting, "rollout.engine": "hf"})
    with pytest.raises(ConfigError, match=rf"{key}: rollout.engine=hf .*rollout.engine=native"):
        grpo_for(cfg)
    with pytest.raises(ConfigError, match=r"rollout.engine: .*BuiltinLM: set rollout.engine=native"):
        grpo_for(config(tmp_path / "run2", **{"rollout.engine": "hf"}), tiny_model())


def test_critic_model_path_needs_a_trained_head_unless_fresh_head(tmp_path):
    """A causal LM as critic.model_path would start PPO's critic from a random head, silently."""
    from posttrain.config import ConfigError

    tiny_model(seed=1).save_pretrained(tmp_path / "lm")
    cfg = config(tmp_path / "a", "gae", **{"critic.model_path": str(tmp_path / "lm")})
    with pytest.raises(ConfigError, match=r"critic.model_path: .* is a causal LM \(LlamaForCausalLM\), not a reward "
                                          r"model: .*critic.fresh_head=true"):
        trainer_for(cfg)
    cfg = config(tmp_path / "b", "gae", **{"critic.model_path": str(tmp_path / "lm"), "critic.fresh_head": "true"})
    critic = trainer_for(cfg).value_model
    assert not critic.score.weight.any()  # a fresh head starts at zeros, as the default critic's
    assert torch.equal(critic.model.embed_tokens.weight, tiny_model(seed=1).model.embed_tokens.weight)
    with pytest.raises(ConfigError, match="critic.fresh_head: applies to critic.model_path only"):
        config(tmp_path / "c", "gae", **{"critic.fresh_head": "true"})


def test_rl_logs_its_setup_before_the_loop(tmp_path, caplog):
    model = tiny_model()
    cfg = config(tmp_path / "run", **{"trainer.max_steps": 1, "trainer.save_steps": 0})
    with caplog.at_level("INFO", logger="posttrain.trainers.rl"):
        trainer_for(cfg, model=model).train()
    n = f"{sum(p.numel() for p in model.parameters()):,}"
    first = caplog.messages[0]
    assert first == (f"RL (grpo): BuiltinLM, {n} parameters; 64 prompts, 1 steps of 8 x 8; "
                     "rollout engine native, on cpu, torch.float32"), caplog.messages


def test_kl_coef_and_accuracy_are_logged_only_where_they_mean_something(tmp_path, caplog):
    """Seen: `kl_coef` logged (and plotted) for a run without a KL term, and `accuracy` = "first
    reward function >= 1" for any function. Now kl_coef only with a KL term, accuracy only from a
    function that declares correctness, and the log says which."""
    def length_reward(prompts, completions, completion_ids, **columns):  # no correctness notion
        return [len(ids) / 3 for ids in completion_ids]

    quick = {"trainer.max_steps": 1, "trainer.save_steps": 0, "data.train_batch_size": 2, "rollout.n": 4,
             "actor.micro_batch_size": 8}
    with caplog.at_level("INFO", logger="posttrain.trainers.rl"):
        trainer_for(config(tmp_path / "plain", **quick), reward=length_reward).train()
        trainer_for(config(tmp_path / "kl", **quick, **{"algorithm.kl.in_loss": "true",
                                                        "algorithm.kl.coef": 0.04})).train()
    (plain,), (kl,) = metric_lines(tmp_path / "plain"), metric_lines(tmp_path / "kl")
    assert "kl_coef" not in plain and "accuracy" not in plain and plain["reward/mean"] > 0
    assert kl["kl_coef"] == 0.04 and kl["accuracy"] in {k / 8 for k in range(9)}
    assert "no accuracy metric: no reward function declares a correctness notion" in caplog.text
    assert "accuracy: the fraction of samples that the reward function starts_with_a scores >= 1" in caplog.text


class RecordingEngine(NativeEngine):
    """A native engine that logs each call with a fingerprint of the watched models' weights
    at that moment, so the log shows which calls came before the update and which after."""

    def __init__(self, model, tokenizer, watched):
        super().__init__(model, tokenizer)
        self.calls, self.watched = [], watched

    def _log(self, name):
        self.calls.append((name, tuple(float(sum(p.detach().double().sum() for p in m.parameters()))
                                       for m in self.watched)))

    def generate(self, *args, **kwargs):
        self._log("generate")
        return super().generate(*args, **kwargs)

    def offload(self):
        self._log("offload")

    def resume(self):
        self._log("resume")

    def sync_weights(self, model):
        if hasattr(self, "calls"):  # NativeEngine.__init__ syncs too
            self._log("sync_weights")
        super().sync_weights(model)


def test_the_driver_offloads_the_engine_for_the_update_and_resumes_it_for_the_sync(tmp_path):
    trainer = trainer_for(config(tmp_path, "gae", **{"trainer.max_steps": 2}))
    w = in_process_worker(trainer)
    engine = RecordingEngine(w.actor.model, trainer.tokenizer, [w.actor.model, w.critic.model])
    w.rollout.engine = engine
    trainer.train()
    names = [name for name, _ in engine.calls]
    assert names == ["generate", "offload", "resume", "sync_weights"] * 2
    for step in range(2):
        generate, offload, resume, sync = (w for _, w in engine.calls[4 * step : 4 * step + 4])
        assert offload == generate  # asleep before the critic or the actor moved
        assert all(a != b for a, b in zip(offload, resume))  # awake after both moved
        assert sync == resume
