"""The rollout section of an RL config: the engine, sampling and multi-turn episodes
(`RLConfig.rollout`), and the sampling temperatures the vllm engine serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.config.aliases import aliases, openrlhf, trl, verl
from posttrain.config.core import check

VLLM_MIN_TEMPERATURE, VLLM_MAX_TEMPERATURE = 0.01, 2.0
"""The sampling temperatures vLLM serves as asked (0 aside: greedy)."""


def check_vllm_temperature(temperature: float) -> str | None:
    """What is wrong with `temperature` for the vllm engine, or None (config and engine both
    check it; the constants are vLLM's): 0 (greedy) and [0.01, 2] are
    served as asked; vLLM refuses T > 2 and would sample 0 < T < 0.01 at 0.01."""
    if temperature == 0 or VLLM_MIN_TEMPERATURE <= temperature <= VLLM_MAX_TEMPERATURE:
        return None
    return (f"the vllm engine samples at temperatures in [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] "
            f"(or 0, greedy), got {temperature}")


ROLLOUT_ENGINE_OPTIONS = (
    "engine", "max_batch_size", "gpu_memory_utilization", "calculate_log_probs", "multi_turn", "env", "tools",
    "dispatch",
)
"""The RolloutConfig fields that choose or tune the engine (and the episodes); every
other one is a SamplingParams field of the same name (`SamplingParams.from_config`)."""


@dataclass
class MultiTurnConfig:
    """Limits of multi-turn episodes (`posttrain.rollout.episodes`), when an environment
    answers the model's turns (`posttrain.envs`)."""

    max_turns: int = field(default=4, metadata=aliases(verl("actor_rollout_ref.rollout.multi_turn.max_assistant_turns")))
    """Most model turns per episode; an episode the environment has not ended by then is
    truncated. Each model turn is cut at rollout.max_new_tokens."""
    max_total_tokens: int = 512
    """Most tokens of an episode after the prompt, model and environment tokens together;
    an episode that would pass it is truncated."""
    env_timeout_s: float = 60.0
    """Seconds each environment call may take: building an episode's environment and its
    `reset` (together), and each `step`. A call past it, one that raises, or one that returns
    a malformed value ends its episode and is counted in env/errors; the run goes on."""

    def validate(self) -> None:
        check(self.env_timeout_s > 0, "rollout.multi_turn.env_timeout_s", f"must be > 0, got {self.env_timeout_s}")
        check(self.max_turns >= 1, "rollout.multi_turn.max_turns", f"must be >= 1, got {self.max_turns}")
        check(self.max_total_tokens >= 1, "rollout.multi_turn.max_total_tokens",
              f"must be >= 1, got {self.max_total_tokens}")


@dataclass
class RolloutConfig:
    """Sampling the responses (`posttrain.rollout` engines)."""

    n: int = field(default=8, metadata=aliases(
        trl("num_generations"), verl("actor_rollout_ref.rollout.n"), openrlhf("n_samples_per_prompt")))
    """Responses per prompt; group estimators need n >= 2."""
    max_new_tokens: int = field(default=256, metadata=aliases(
        trl("max_completion_length"), trl("response_length"), verl("data.max_response_length"),
        verl("actor_rollout_ref.rollout.response_length"), openrlhf("generate_max_len")))
    """Longest response; a response that reaches it without a stop token is truncated."""
    temperature: float = field(default=1.0, metadata=aliases(
        trl("temperature"), verl("actor_rollout_ref.rollout.temperature"), openrlhf("temperature")))
    """Sampling temperature (> 0). Log-probs are always those of softmax(logits / temperature)."""
    top_p: float = field(default=1.0, metadata=aliases(
        trl("top_p"), verl("actor_rollout_ref.rollout.top_p"), openrlhf("top_p")))
    """Nucleus sampling (1 = off). Filters choose tokens; log-probs stay unfiltered (veRL's convention)."""
    top_k: int = field(default=0, metadata=aliases(trl("top_k"), verl("actor_rollout_ref.rollout.top_k")))
    """Top-k sampling (0 = off)."""
    min_p: float = field(default=0.0, metadata=aliases(trl("min_p")))
    """Min-p sampling (0 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings besides the EOS token."""
    engine: Literal["auto", "native", "hf", "vllm"] = field(default="auto", metadata=aliases(
        trl("use_vllm", {True: "vllm", False: "auto"}),
        verl("actor_rollout_ref.rollout.name", {"vllm": "vllm", "hf": "hf"}),
        openrlhf("vllm_num_engines", same_value=False, note="rollout.engine=vllm runs one vLLM engine per worker")))
    """Generation engine: `native` (KV-cache decoding of the built-in model: Llama, Qwen2/Qwen2.5,
    Qwen3 and Mistral checkpoints), `hf` (transformers generate, any causal LM; model.impl=auto
    then loads the policy with transformers), `vllm` (GPU), or `auto` (native when the model
    allows it, else hf). A model the engine cannot run is refused before it loads."""
    max_batch_size: int = 0
    """Native engine: most rows decoded at once (0 = all)."""
    gpu_memory_utilization: float = field(default=0.5, metadata=aliases(
        trl("vllm_gpu_memory_utilization"), verl("actor_rollout_ref.rollout.gpu_memory_utilization"),
        openrlhf("vllm_gpu_memory_utilization")))
    """vLLM engine: fraction of GPU memory it may take."""
    calculate_log_probs: bool | None = field(default=None, metadata=aliases(
        verl("actor_rollout_ref.rollout.calculate_log_probs")))
    """The engine returns each sampled token's log-prob, and every step logs their gap to
    the actor's (rollout_corr/*; docs/rollout_correction.md). null = true exactly when
    algorithm.rollout_correction needs them (rollout_is or bypass_mode set). Where the update
    needs no old log-probs (one optimizer step per rollout) the gap costs the actor's
    log-prob pass, which then runs."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Episode limits of multi-turn rollouts."""
    env: str | None = None
    """Multi-turn episodes: the environment that answers the model's turns, a built-in name
    (guess_number, arithmetic_tools), `module:Class` or `file.py:Class` (called with no
    arguments once per episode; `posttrain.envs`). null = single-turn responses, unless
    rollout.tools is set. Its rewards reach the reward functions as the `env_reward` column
    (the built-in reward `env_reward`, the default when reward.functions is empty)."""
    tools: list[str] = field(default_factory=list)
    """Tools of multi-turn episodes: built-in names (calculator, python), `module:function`
    or `file.py:function`. Without rollout.env they make a `ToolEnvironment` (the plain-text
    `<call>` protocol); with it, they are its `tools=` argument."""
    seed_mode: Literal["batch", "row"] = "batch"
    """How sampling draws its randomness. `batch`: one random stream per generation call (the
    samples depend on the batch they are drawn in). `row`: each response row draws from a
    stream of (seed, its index in the batch, its position) alone, so a batch generated in
    slices gives the tokens of the whole batch: what `rollout.dispatch=split` needs. Native
    and hf engines (single-turn and episodes) sample the same tokens in either mode for the
    same logits; vllm seeds each request (row mode: a hash of seed, row and turn)."""
    dispatch: Literal["auto", "rank_zero", "split"] = "auto"
    """trainer.backend=ray: where generation runs. `rank_zero`: worker 0 generates the whole
    batch (the other workers wait); `split`: the prompts are cut into one contiguous slice per
    worker (about equal prompt counts), each worker generates its slice and the rows are
    gathered back in order (needs rollout.seed_mode=row: the tokens are then the local run's
    with seed_mode=row). `auto`: split with seed_mode=row, else rank_zero."""

    @property
    def split(self) -> bool:
        """Generation is split over the Ray workers (rollout.dispatch, `auto` resolved)."""
        return self.dispatch == "split" or (self.dispatch == "auto" and self.seed_mode == "row")

    @property
    def episodes(self) -> bool:
        """The rollout plays multi-turn episodes (rollout.env or rollout.tools is set)."""
        return self.env is not None or bool(self.tools)

    def max_response_tokens(self, episodes: bool = False) -> int:
        """Most model tokens of one response (Dr.GRPO's constant): max_new_tokens, or for
        episodes (`episodes`, or rollout.env / rollout.tools set) min(max_turns ·
        max_new_tokens, multi_turn.max_total_tokens)."""
        if not (episodes or self.episodes):
            return self.max_new_tokens
        return min(self.multi_turn.max_turns * self.max_new_tokens, self.multi_turn.max_total_tokens)

    def validate(self) -> None:
        check(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, "rollout.temperature",
              f"must be > 0 for RL (greedy samples carry no exploration), got {self.temperature}")
        check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0 and self.max_batch_size >= 0, "rollout.top_k", "top_k and max_batch_size must be >= 0")
        if self.engine == "vllm":  # outside vLLM's range its log-probs are not softmax(logits / T)
            problem = check_vllm_temperature(self.temperature)
            check(problem is None, "rollout.temperature", problem or "")
        check(not (self.dispatch == "split" and self.seed_mode != "row"), "rollout.dispatch",
              "split generation gives the whole batch's tokens only when each row draws its own random "
              "stream: set rollout.seed_mode=row (or rollout.dispatch=rank_zero)")


