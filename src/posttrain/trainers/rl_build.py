"""Building an RL run's roles from its config, and evaluating the policy.

Order matters: the reference (a frozen copy) and a separate critic are taken from the
policy's *initial* weights, before a resume loads trained ones into the policy.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.config.core import ConfigError, check
from posttrain.config.rl import RLConfig
from posttrain.data.collate import pad_id_of
from posttrain.logging import get_logger
from posttrain.models.heads import ScalarHeadModel
from posttrain.models.lora import apply_lora, is_peft
from posttrain.rewards import RewardRunner
from posttrain.rewards.checks import check_reward_signature
from posttrain.rewards.registry import resolve_reward
from posttrain.rollout import SamplingParams, make_engine
from posttrain.trainers.rl_steps import step_seed
from posttrain.workers import Reference, Reward, RLBatch, Rollout

log = get_logger(__name__)

EVAL_SALT = 2_000_000


def check_reward_source(cfg: RLConfig, reward_funcs: Any, episodes: bool = False) -> None:
    """A run needs reward functions (config or Python API), a reward model, or episodes
    (whose environment rewards are then the reward: `env_reward`); DAPO's overlong buffer
    must fit the response limit, an episode's when the Python API passes an environment; partial
    rollouts take rollout.stop strings in episodes only."""
    episodes = episodes or cfg.rollout.episodes
    cfg.check_overlong(episodes)
    cfg.check_partial_rollout(episodes)
    check(bool(cfg.reward.functions or reward_funcs or cfg.reward.model_path or episodes), "reward.functions",
          "no reward: set reward.functions=[...] (e.g. [task_reward]) or reward.model_path")
    if reward_funcs:
        check(cfg.reward.weights is None or len(cfg.reward.weights) == len(reward_funcs), "reward.weights",
              f"needs one weight per reward function ({len(reward_funcs)}), got {cfg.reward.weights}")


def build_reward(cfg: RLConfig, reward_funcs: Any, columns: Sequence[str] | None = None,
                 data: str = "the data", episodes: bool = False) -> Reward:
    """The reward role; with `columns` (the training data's, besides the prompt), each function
    is first checked to take them and to find the columns it needs (`check_reward_signature`).
    Episodes without reward functions or model score with `env_reward`; DAPO's overlong
    shaping counts their model tokens against `rollout.max_response_tokens(episodes)`."""
    rc = cfg.reward
    specs = list(reward_funcs) if reward_funcs else list(rc.functions)
    if episodes and not specs and rc.model_path is None:  # the environment's rewards are the reward
        specs = ["env_reward"]
    functions = [resolve_reward(s) for s in specs]
    for name, fn in functions if columns is not None else ():
        try:
            check_reward_signature(name, fn, columns, data)
        except ValueError as e:
            raise ConfigError(f"reward.functions: {e}") from None
    weights = list(rc.weights) if rc.weights is not None else [1.0] * len(functions)
    if rc.model_path is not None:
        from posttrain.rewards.reward_model import reward_model

        functions.append(("reward_model", reward_model(rc.model_path, device=cfg.model.device).load()))
        weights.append(rc.model_weight)
    try:
        runner = RewardRunner(functions, weights=weights, timeout_s=rc.timeout_s, failure_reward=rc.failure_reward,
                              isolation=rc.isolation)
    except ValueError as e:  # a function that cannot go to a worker process
        raise ConfigError(f"reward.isolation: {e}") from None
    ov = cfg.algorithm.overlong
    return Reward(runner, cfg.rollout.max_response_tokens(episodes), ov.buffer, ov.penalty, rc.missing_eos_penalty,
                  cfg.trainer.max_bad_steps)


def engine_options(cfg: RLConfig, kind: str, peft: bool) -> dict[str, Any]:
    """`make_engine`'s options for engine `kind`. vllm: rollout.gpu_memory_utilization and vLLM's
    own options (rollout.vllm.*); it loads a peft policy's base model from model.path (then
    syncs the merged adapters), so a LoRA run needs one."""
    rc = cfg.rollout
    if kind == "native":
        return {"max_batch_size": rc.max_batch_size} if rc.max_batch_size else {}
    if kind != "vllm":
        return {}
    if rc.vllm_mode == "server":  # the server holds the base model; merged LoRA weights are pushed
        return {"server_url": rc.server_url, "timeout_s": rc.server_timeout_s, "bucket_mb": rc.sync_bucket_mb}
    opts: dict[str, Any] = {"gpu_memory_utilization": rc.gpu_memory_utilization, "seed": cfg.trainer.seed,
                            **rc.vllm.engine_options()}
    if peft:
        check(cfg.model.path is not None, "model.path",
              "rollout.engine=vllm with a LoRA policy loads the base model from model.path; set it")
        opts["model_path"] = cfg.model.path
    return opts


def episode_source(cfg: RLConfig, environment_factory: Any = None, tools: Any = None) -> Any:
    """The per-episode environment factory of the Python API's `environment_factory` / `tools`
    (they win) or of rollout.env / rollout.tools; None for single-turn rollouts."""
    from posttrain.envs import episode_factory

    env = environment_factory if environment_factory is not None else cfg.rollout.env
    tools = list(tools) if tools is not None else list(cfg.rollout.tools)
    if env is None and not tools:
        return None
    try:
        return episode_factory(env, tools)
    except ValueError as e:
        raise ConfigError(f"rollout.env: {e}") from None


def build_rollout(cfg: RLConfig, model: torch.nn.Module, tokenizer: Any, env_factory: Any = None) -> Rollout:
    """Built last (`build_roles`): a colocated vllm engine takes its share of what the policy,
    reference and critic leave free on the GPU. With `env_factory` it plays episodes."""
    from posttrain.rollout import MultiTurnLimits, engine_kind_for

    rc = cfg.rollout
    kind = engine_kind_for(model) if rc.engine == "auto" else rc.engine
    opts = engine_options(cfg, kind, is_peft(model))
    return Rollout(make_engine(kind, model, tokenizer, **opts), sampling_params(cfg),
                   env_factory, MultiTurnLimits.from_config(rc.multi_turn))


def sampling_params(cfg: RLConfig) -> SamplingParams:
    """The rollout's sampling settings; the engine returns log-probs when
    rollout.calculate_log_probs (null resolved, `RLConfig.rollout_log_probs`) says so."""
    return dataclasses.replace(SamplingParams.from_config(cfg.rollout), logprobs=cfg.rollout_log_probs)


def check_engine_fits(cfg: RLConfig, model: Any) -> None:
    """rollout.engine can run the policy (`model`, else model.path / model.init): checked before
    any model loads (reads config.json only), with the keys that fix it; in server mode, the
    vLLM server answers at rollout.server_url. The hf engine's
    policy is a transformers model: model.impl=auto loads it so (`policy_config`)."""
    from posttrain.models.builtin import BuiltinLM
    from posttrain.models.llama_checkpoint import read_config_json, unsupported_features
    from posttrain.rollout.native import native_problems, native_refusal

    engine, m = cfg.rollout.engine, cfg.model
    given = isinstance(model, torch.nn.Module)
    if engine == "vllm" and cfg.rollout.vllm_mode == "server":  # the server is there before any model loads
        from posttrain.rollout.vllm_server import ServerClient, wait_for_server

        wait_for_server(ServerClient(cfg.rollout.server_url), cfg.rollout.server_timeout_s)
    if engine == "hf":
        base = model.get_base_model() if given and hasattr(model, "get_base_model") else model
        check(not isinstance(base, BuiltinLM), "rollout.engine",
              "rollout.engine=hf runs transformers' generate, and the model passed is posttrain's built-in "
              "BuiltinLM: set rollout.engine=native (or auto), or pass a transformers model")
        if not given:
            check(m.impl != "builtin", "model.impl",
                  "rollout.engine=hf runs transformers' generate, which the built-in model lacks: set "
                  "model.impl=auto or hf (a transformers model), or rollout.engine=native")
            check(m.init is None, "model.init",
                  f"rollout.engine=hf (transformers' generate) cannot run a fresh built-in model "
                  f"(model.init={m.init}): set rollout.engine=native (or auto)")
    if engine != "native":
        return
    if given:
        problems = native_problems(model)
        if problems:
            raise ConfigError(native_refusal(f"the {type(model).__name__} passed as the model", problems))
        return
    check(m.lora.quantize == "none", "model.lora.quantize",
          f"rollout.engine=native runs full-precision weights, not a {m.lora.quantize} base: set "
          "rollout.engine=hf (or auto)")
    if m.path is not None:
        problems = unsupported_features(read_config_json(m.path))
        if problems:
            raise ConfigError(native_refusal(f"model.path={m.path}", problems))


def policy_config(cfg: RLConfig) -> Any:
    """model.* to load the policy with: model.impl=auto means hf under rollout.engine=hf, whose
    `generate` needs a transformers model (as in a TRL run); anything else as set."""
    from posttrain.rollout import model_impl_for

    impl = model_impl_for(cfg.rollout.engine, cfg.model.impl)
    if impl != cfg.model.impl:
        log.info("rollout.engine=%s: the policy loads with transformers (model.impl=auto -> %s)", cfg.rollout.engine, impl)
    return dataclasses.replace(cfg.model, impl=impl)


def check_critic_source(cfg: RLConfig) -> None:
    """critic.model_path holds a trained score head, unless critic.fresh_head asks for a new one
    (cheap: reads config.json and the weights' names)."""
    from posttrain.models.heads import MissingScoreHead, require_score_head

    c = cfg.critic
    if not cfg.use_critic or c.model_path is None or c.fresh_head:
        return
    try:
        require_score_head(c.model_path)
    except MissingScoreHead as err:
        raise ConfigError(
            f"critic.model_path: {err}. Point it at a critic or reward model (an RM's final/), or set "
            "critic.fresh_head=true to start a fresh value head on this model"
        ) from None


def build_value_model(cfg: RLConfig, policy: torch.nn.Module, value_model: Any) -> ScalarHeadModel:
    """A separate critic's initial model: `value_model` (Python API), else critic.model_path,
    else the policy's initial weights with a zero head; dropout off."""
    from posttrain.models.factory import weights_dtype
    from posttrain.models.loading import disable_dropout, resolve_device

    c = cfg.critic
    if value_model is None and c.model_path is not None:
        device = resolve_device(cfg.model.device)
        dtype = weights_dtype(cfg.model.dtype, device, trained=True)  # the critic trains every weight
        head, std = ("fresh", 0.0) if c.fresh_head else ("stored", None)
        value_model = ScalarHeadModel.from_pretrained(c.model_path, device, dtype, head=head, init_std=std)
    if value_model is None:
        value_model = ScalarHeadModel.from_causal_lm(policy, init_std=0.0)  # policy: dropout already off
    disable_dropout(value_model, "critic")
    return value_model


def build_reference(cfg: RLConfig, policy: torch.nn.Module) -> Reference | None:
    """π_ref when the run has a KL term (a frozen copy of `policy`, or its adapter-disabled
    self with LoRA), else None."""
    a = cfg.actor
    if not cfg.algorithm.kl.enabled:
        return None
    return Reference.for_policy(policy, temperature=cfg.rollout.temperature, micro_batch_size=a.micro_batch_size,
                                max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
                                precision=cfg.trainer.precision, remove_padding=cfg.model.use_remove_padding)


def initial_models(cfg: RLConfig, tokenizer: Any, model: Any, reward_funcs: Any, value_model: Any,
                   columns: Sequence[str] | None = None, data: str = "the data", env_factory: Any = None,
                   build: bool = True) -> tuple[torch.nn.Module | None, ScalarHeadModel | None, Reward]:
    """(policy, separate critic's value model or None, reward role): engine, reward and critic
    checks first (cheap, fail early: `check_engine_fits`, then `build_reward` checks the reward
    against the data's `columns`, plus `env_reward` for episodes), then the models
    (`build_initial_models`). With `build=False` (trainer.backend=ray) a policy that is not a
    module passed in is not built here: (None, `value_model`, reward), and each worker builds
    its own (`RLWorker`), so the driver never holds its weights. The reward stays in the driver."""
    check_engine_fits(cfg, model)
    if env_factory is not None and columns is not None:
        from posttrain.envs.registry import check_environment_columns

        try:
            check_environment_columns(env_factory, columns, data)
        except ValueError as e:
            raise ConfigError(f"rollout.env: {e}") from None
        columns = [*columns, "env_reward"]
    reward = build_reward(cfg, reward_funcs, columns, data, episodes=env_factory is not None)
    check_critic_source(cfg)
    if not build and not isinstance(model, torch.nn.Module):
        return None, value_model, reward
    return (*build_initial_models(cfg, tokenizer, model, value_model), reward)


def build_initial_models(cfg: RLConfig, tokenizer: Any, model: Any = None, value_model: Any = None,
                         critic: bool = True) -> tuple[torch.nn.Module, ScalarHeadModel | None]:
    """(policy, separate critic's value model or None): the policy (a module passed in gets
    `model.lora` adapters, as a built one) and, with `critic`, a separate critic's initial
    value model, both with dropout off (`disable_dropout`)."""
    from posttrain.models.factory import build_model
    from posttrain.models.loading import disable_dropout

    if isinstance(model, torch.nn.Module):
        model = apply_lora(model, cfg.model.lora)  # as build_model does
    else:
        model = build_model(policy_config(cfg), tokenizer, train=True)
    disable_dropout(model, "policy")  # before the reference and a critic are copied from it
    if is_peft(model):
        log.info("LoRA policy: the reference is the base model with adapters disabled (no copy)")
    separate = critic and cfg.use_critic and not cfg.critic.share_backbone
    return model, build_value_model(cfg, model, value_model) if separate else None


def evaluate_policy(trainer: Any, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """eval/* metrics and samples, generated on the workers: the task's scorer on greedy
    completions when eval.task is set (as `posttrain sft` reports it; actor worker 0,
    `RLWorker.evaluate_task`), else the reward functions on eval.temperature samples (the
    rollout's `generate`); both play episodes when the rollout does (rollout.env / rollout.tools)."""
    e, cfg = trainer.args.eval, trainer.args
    examples = trainer.eval_examples
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    if e.task is not None:
        rows = [{"prompt": x["prompt"], **x["columns"]} for x in examples]
        check("answer" in rows[0], "eval.task", "the eval rows need an `answer` column")
        metrics, samples = trainer.roles.actor.evaluate_task(rows, e.task, max_new, e.batch_size, e.temperature)
    else:
        metrics, samples = _evaluate_with_rewards(trainer, examples, max_new, step)
    return {f"eval/{k}": v for k, v in metrics.items()}, [{"split": "eval", **s} for s in samples]


def _evaluate_with_rewards(trainer: Any, examples: list[dict], max_new: int, step: int):
    e, roles = trainer.args.eval, trainer.roles
    params = dataclasses.replace(roles.rollout.params, n=1, temperature=e.temperature, max_new_tokens=max_new)
    pad = pad_id_of(trainer.tokenizer)
    parts = []
    for i in range(0, len(examples), e.batch_size):
        prompts = RLBatch.from_prompts(examples[i : i + e.batch_size], pad)
        seed = step_seed(trainer.args.trainer.seed, step, EVAL_SALT + i)
        parts.append(roles.reward.score(roles.rollout.generate(prompts, seed, params))[0])
    if not parts:
        raise ConfigError("data.eval_files: no eval prompts")
    scores = torch.cat([p.rewards["total"] for p in parts])
    lengths = torch.cat([p.lengths for p in parts]).float()
    metrics = {"reward/mean": float(scores.mean()), "response_length/mean": float(lengths.mean()),
               "truncation_rate": float(torch.cat([p.truncated for p in parts]).float().mean())}
    if roles.reward.accuracy_from is not None:  # only a declared correctness notion gives accuracy
        metrics["accuracy"] = float(torch.cat([p.rewards["correct"] for p in parts]).mean())
    samples = [{"prompt": p.prompts[j], "completion": p.completions[j], "score": float(p.rewards["total"][j])}
               for p in parts for j in range(len(p))]
    return metrics, samples


def load_final_models(cfg: RLConfig, tokenizer: Any, model: Any, value_model: Any,
                      final_dir: Path) -> tuple[torch.nn.Module, ScalarHeadModel | None]:
    """(policy, critic or None) of a finished Ray run, on the CPU, read from its `final_dir`
    (the workers are gone): the initial models rebuilt as the run built them
    (`build_initial_models`, from copies of the modules passed in), then the trained weights
    (a LoRA policy: its adapter, `adapter/`; the critic: `critic/`)."""
    from posttrain.checkpoint import RunModels, load_weights

    cpu = copy.copy(cfg)
    cpu.model = dataclasses.replace(cfg.model, device="cpu")
    given = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else None
    with torch.random.fork_rng(devices=[]):  # the run's seed (a fresh built-in model), the caller's RNG untouched
        torch.manual_seed(cfg.trainer.seed)
        policy, critic = build_initial_models(cpu, tokenizer, given, copy.deepcopy(value_model))
    load_weights(final_dir / RunModels.ADAPTER if is_peft(policy) else final_dir, policy)
    if critic is not None:
        load_weights(final_dir / RunModels.CRITIC, critic)
    return policy, critic
