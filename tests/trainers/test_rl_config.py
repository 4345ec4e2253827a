"""The RL config tree: batch-size rules, impossible combinations, recipes; errors name the field
and come before any model is loaded."""

from pathlib import Path

import pytest

from posttrain import GRPOConfig, GRPOTrainer, PPOConfig
from posttrain.config import ConfigError, build_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def build(*overrides, cls=GRPOConfig):
    return build_config(cls, None, ["reward.functions=[task_reward]", *overrides])


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"], "actor.ppo_mini_batch_size"),
        (["data.train_batch_size=8", "actor.ppo_mini_batch_size=16"], "actor.ppo_mini_batch_size"),
        (["data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=3"], "actor.micro_batch_size"),
        (["data.train_batch_size=4", "rollout.n=2", "critic.micro_batch_size=3"], "critic.micro_batch_size"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable"),
        (["critic.enable=true"], "critic.enable"),
        (["rollout.n=1"], "rollout.n"),
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n"),
        (["algorithm.adv_estimator=dr_grpo", "algorithm.norm_adv_by_std=group"], "algorithm.norm_adv_by_std"),
        (["algorithm.adv_estimator=reinforce_pp", "algorithm.whiten_advantages=false"], "algorithm.whiten_advantages"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["actor.policy_loss.dual_clip=1.0"], "actor.policy_loss.dual_clip"),
        (["algorithm.overlong.buffer=500", "rollout.max_new_tokens=100"], "algorithm.overlong.buffer"),
        (["reward.functions=[a,b]", "reward.weights=[1.0]"], "reward.weights"),
        (["algorithm.adv_estimator=gae", "critic.share_backbone=true", "critic.warmup_steps=2"], "critic.warmup_steps"),
        (["algorithm.adv_estimator=gae", "critic.share_backbone=true", "model.lora.r=4"], "critic.share_backbone"),
        (["actor.policy_loss.loss_agg_mode=token_mean"], "actor.policy_loss.loss_agg_mode"),
        (["algorithm.rollout_correction.rollout_is=token", "rollout.calculate_log_probs=false"],
         "rollout.calculate_log_probs"),
        (["algorithm.rollout_correction.bypass_mode=true", "rollout.calculate_log_probs=false"],
         "rollout.calculate_log_probs"),
        (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=sequence"],
         "algorithm.rollout_correction.bypass_mode"),
        (["algorithm.rollout_correction.rollout_is_threshold_lower=2.0"], "algorithm.rollout_correction.rollout_is_threshold_lower"),
        (["algorithm.rollout_correction.rollout_is_threshold=0"], "algorithm.rollout_correction.rollout_is_threshold"),
        (["rollout.use_rollout_logprobs=true"], "algorithm.rollout_correction.bypass_mode=true"),
    ],
)
def test_impossible_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build(*overrides)


def test_overlong_buffer_of_episodes_is_checked_against_their_model_token_limit(tmp_path):
    """With rollout.env the penalty counts an episode's model tokens against
    min(max_turns · max_new_tokens, max_total_tokens), not one turn's max_new_tokens."""
    episodes = ["rollout.env=arithmetic_tools", "rollout.max_new_tokens=32", "rollout.multi_turn.max_turns=4"]
    cfg = build(*episodes, "rollout.multi_turn.max_total_tokens=512", "algorithm.overlong.buffer=100")
    assert cfg.rollout.max_response_tokens() == 128  # a buffer past one turn's 32 tokens is fine
    with pytest.raises(ConfigError, match=r"algorithm\.overlong\.buffer: must be <= the episode's model-token "
                       r"limit 96 = min\(rollout\.multi_turn\.max_turns 4 × rollout\.max_new_tokens 32, "
                       r"rollout\.multi_turn\.max_total_tokens 96\), got 100"):
        build(*episodes, "rollout.multi_turn.max_total_tokens=96", "algorithm.overlong.buffer=100")
    # The Python API's environment_factory makes a run of episodes that the config alone does not show.
    single = build("rollout.max_new_tokens=256", "rollout.multi_turn.max_total_tokens=96",
                   "algorithm.overlong.buffer=100", f"trainer.output_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"algorithm\.overlong\.buffer: must be <= the episode's model-token limit 96"):
        GRPOTrainer(None, args=single, train_dataset=[{"prompt": "1+1=", "answer": "2"}],
                    environment_factory="arithmetic_tools")


def test_one_response_per_prompt_is_reported_before_the_batch_arithmetic():
    # n=1 makes the mini-batch 16 rows, which micro_batch_size=32 does not divide either.
    with pytest.raises(ConfigError, match=r"rollout\.n: grpo compares the responses of a prompt: needs rollout\.n >= 2"):
        build("data.train_batch_size=16", "actor.micro_batch_size=32", "rollout.n=1")
    with pytest.raises(ConfigError, match=r"rollout\.n: grpo .* needs rollout\.n >= 2"):
        build_config(GRPOConfig, RECIPES / "grpo.yaml", ["rollout.n=1"])


def test_a_missing_prompt_column_points_to_data_prompt_key():
    from posttrain.data.prompts import load_prompts

    rows = [{"question": "1+1=", "answer": "2"}]
    with pytest.raises(ConfigError, match=r"data\.prompt_key: list: row 1 has no column 'prompt' "
                       r"\(found question, answer\); set data\.prompt_key=COLUMN"):
        load_prompts(rows, None, build().data)


def test_trainer_micro_batch_size_is_not_an_rl_key(capsys):
    # RL cuts micro-batches by actor.micro_batch_size; the trainer section has no such field.
    from posttrain.cli import main

    assert main(["grpo", "trainer.micro_batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "unknown key trainer.micro_batch_size. Did you mean actor.micro_batch_size?" in err
    assert "micro_batch_size" not in err.split("valid keys of trainer:")[1]
    with pytest.raises(ConfigError, match=r"unknown key trainer\.micro_batch_size\. Did you mean actor\.micro_batch_size\?"):
        build("trainer.micro_batch_size=4", cls=PPOConfig)


def test_batch_semantics_and_defaults():
    cfg = build("data.train_batch_size=8", "rollout.n=4", "actor.micro_batch_size=16")
    assert cfg.mini_batch_prompts == 8 and not cfg.use_critic  # null mini batch = one step per rollout
    assert cfg.algorithm.grpo_scale == "group" and not cfg.algorithm.whiten
    dr = build("algorithm.adv_estimator=dr_grpo")
    assert dr.algorithm.grpo_scale == "none"
    ppo = build_config(PPOConfig, None, ["algorithm.gamma=0.99"])
    assert ppo.algorithm.adv_estimator == "gae" and ppo.rollout.n == 1 and ppo.use_critic and ppo.algorithm.whiten
    # dynamic batching replaces the micro-batch rule
    build("data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=3", "actor.max_tokens_per_micro_batch=256")


def test_both_kl_placements_warn(caplog):
    build("algorithm.kl.in_reward=true", "algorithm.kl.in_loss=true")
    assert "penalised twice" in caplog.text


def test_a_kl_coefficient_without_a_kl_term_is_refused_naming_the_switches(tmp_path):
    """TRL's beta > 0 is a KL term in the loss; here the placement is its own switch, so a β set
    with both placements off would do nothing: refused, before any model loads."""
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.coef: algorithm\.kl\.coef=0\.04 would do nothing: the "
                       r"KL term is off\. .*algorithm\.kl\.in_loss=true \(what TRL's GRPOTrainer does for beta > 0"
                       r".*algorithm\.kl\.in_reward=true"):
        build("algorithm.kl.coef=0.04")
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.adaptive"):
        build("algorithm.kl.adaptive=true")
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.coef=0\.04"):  # the grpo recipe with its KL term off
        build_config(GRPOConfig, RECIPES / "grpo.yaml", ["algorithm.kl.in_loss=false"])
    cfg = GRPOConfig()
    cfg.algorithm.kl.coef = 0.2  # the Python API: refused when the trainer validates it
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.coef=0\.2 would do nothing"):
        GRPOTrainer(args=cfg, reward_funcs=["task_reward"], train_dataset=[{"prompt": "1+1="}])
    assert build("algorithm.kl.coef=0").algorithm.kl.enabled is False  # TRL's beta=0: no KL
    assert build("algorithm.kl.coef=0.04", "algorithm.kl.in_loss=true").algorithm.kl.enabled
    assert not GRPOConfig().algorithm.kl.enabled and not PPOConfig().algorithm.kl.enabled  # the defaults pass


def test_errors_come_before_any_model_loads(tmp_path):
    cfg = GRPOConfig()
    cfg.model.path = str(tmp_path / "no-such-model")
    cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size = 8, 3
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size"):
        GRPOTrainer(args=cfg, reward_funcs=["task_reward"], train_dataset=[{"prompt": "1+1="}])
    cfg = GRPOConfig()
    cfg.model.path = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match="reward.functions"):
        GRPOTrainer(args=cfg, train_dataset=[{"prompt": "1+1="}])


NON_RL = {"sft_arithmetic.yaml", "sft_tools.yaml", "rm_arithmetic.yaml", "dpo_arithmetic.yaml"}


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml") if p.name not in NON_RL))
def test_recipes_resolve_and_open_with_a_citation(recipe):
    text = (RECIPES / recipe).read_text()
    assert text.startswith("# ") and "arXiv" in text.split("\n\n")[0]
    cfg = build_config(PPOConfig if recipe == "ppo.yaml" else GRPOConfig, RECIPES / recipe)
    assert cfg.reward.functions and cfg.eval.task in ("arithmetic", "arithmetic_tools")


@pytest.mark.parametrize("overrides,field", [
    (["rollout.engine=vllm", "rollout.temperature=2.5"], "rollout.temperature"),  # vLLM refuses > 2
    (["rollout.engine=vllm", "rollout.temperature=0.005"], "rollout.temperature"),  # vLLM would use 0.01
    (["rollout.engine=vllm", "eval.temperature=0.001"], "eval.temperature"),
])
def test_vllm_temperatures_outside_what_it_serves_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        build(*overrides)


def test_vllm_serves_temperatures_0_01_to_2_and_greedy_eval_and_other_engines_any():
    for t in ("0.01", "2.0"):
        build("rollout.engine=vllm", f"rollout.temperature={t}", "eval.temperature=0")
    build("rollout.engine=native", "rollout.temperature=2.5")


def test_episodes_on_the_vllm_engine_build_their_config():
    cfg = build("rollout.engine=vllm", "rollout.env=arithmetic_tools", "rollout.multi_turn.max_turns=3")
    assert cfg.rollout.engine == "vllm" and cfg.rollout.episodes and cfg.rollout.multi_turn.max_turns == 3
    assert build("rollout.engine=vllm", "rollout.tools=[calculator]").rollout.episodes
    with pytest.raises(ConfigError, match="rollout.temperature"):  # what vLLM serves still applies
        build("rollout.engine=vllm", "rollout.env=arithmetic_tools", "rollout.temperature=2.5")


def test_vllm_options_carry_the_base_model_path_for_a_lora_policy():
    from posttrain.trainers.rl_build import engine_options

    cfg = build("rollout.engine=vllm", "model.path=/models/base", "rollout.gpu_memory_utilization=0.3",
                "trainer.seed=7")
    assert engine_options(cfg, "vllm", peft=True) == {
        "gpu_memory_utilization": 0.3, "seed": 7, "model_path": "/models/base"}
    assert "model_path" not in engine_options(cfg, "vllm", peft=False)  # the engine saves the policy
    with pytest.raises(ConfigError, match="model.path"):
        engine_options(build("rollout.engine=vllm"), "vllm", peft=True)
    assert engine_options(build("rollout.max_batch_size=4"), "native", peft=True) == {"max_batch_size": 4}


@pytest.mark.parametrize("overrides,wanted", [
    ([], False),
    (["rollout.calculate_log_probs=true"], True),
    (["algorithm.rollout_correction.rollout_is=token"], True),
    (["algorithm.rollout_correction.bypass_mode=true"], True),
])
def test_the_engine_returns_log_probs_when_they_are_read(overrides, wanted):
    from posttrain.trainers.rl_build import sampling_params

    cfg = build(*overrides)
    assert cfg.rollout_log_probs is wanted and sampling_params(cfg).logprobs is wanted


@pytest.mark.parametrize("theirs,ours", [
    ("vllm_importance_sampling_mode=token_mask", "algorithm.rollout_correction.rollout_is=token"),
    ("vllm_importance_sampling_clip_max=3.0", "algorithm.rollout_correction.rollout_is_threshold=3.0"),
    ("vllm_importance_sampling_clip_min=0.5", "algorithm.rollout_correction.rollout_is_threshold_lower=0.5"),
    ("actor_rollout_ref.rollout.calculate_log_probs=true", "rollout.calculate_log_probs=true"),
    ("algorithm.rollout_correction.rollout_rs=seq_mean_k1", "algorithm.rollout_correction.rollout_is_mode"),
])
def test_trl_and_verl_rollout_correction_keys_point_to_ours(theirs, ours):
    with pytest.raises(ConfigError, match=f"Did you mean {ours}"):
        build(theirs)
