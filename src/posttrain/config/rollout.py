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
    "dispatch", "vllm", "vllm_mode", "server_url", "server_timeout_s", "sync_bucket_mb",
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
class VLLMConfig:
    """vLLM's own engine options (rollout.engine=vllm), passed to `vllm.LLM` under vLLM's names
    (docs/vllm.md). rollout.gpu_memory_utilization sizes the engine on a GPU."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(default="auto", metadata=aliases(
        verl("actor_rollout_ref.rollout.dtype")))
    """The engine's weight dtype. `auto`: a 16-bit policy keeps its dtype; a float32 policy is
    served in bfloat16 where the device computes it natively (GPUs from Ampere on; CPUs with
    `avx512_bf16`/`amx_bf16` or Arm `bf16` in /proc/cpuinfo), else float16 on a GPU and float32 on
    a CPU (vLLM's emulated bf16 is 3.5-3.8x slower there); the choice and its reason are logged.
    float32 serves the trainer's numbers (log-probs within ~1e-6)."""
    enforce_eager: bool = field(default=False, metadata=aliases(
        verl("actor_rollout_ref.rollout.enforce_eager"), openrlhf("enforce_eager")))
    """Run the model eagerly: no torch.compile and no CUDA graphs. Starts in seconds instead of
    tens of seconds (a CPU compiles ~40 s), decodes more slowly on a GPU."""
    max_model_len: int | None = field(default=None, metadata=aliases(
        trl("vllm_max_model_length"), verl("actor_rollout_ref.rollout.max_model_len")))
    """Longest prompt + response the engine holds (null: the model's max_position_embeddings).
    Smaller leaves more KV-cache blocks for rows."""
    cpu_kvcache_space_gb: int = 1
    """vLLM's CPU build: GiB of host memory for the KV cache, the CPU counterpart of
    rollout.gpu_memory_utilization (vLLM's `kv_cache_memory_bytes`, set per engine; a different
    VLLM_CPU_KVCACHE_SPACE in the environment is refused). Unused on a GPU."""

    lora_sync: Literal["adapter", "merged"] = "adapter"
    """A LoRA policy's weight sync. `adapter`: only the adapter goes to the engine each step,
    served by vLLM's LoRA support over the base model (model.path) as loaded; `merged`: the
    adapter is merged into the weights and the whole model is loaded (TRL's path; needed for
    DoRA, a bias or modules_to_save, which vLLM's LoRA does not serve)."""

    def validate(self) -> None:
        check(self.max_model_len is None or self.max_model_len >= 1, "rollout.vllm.max_model_len",
              f"must be >= 1 (or null: the model's length), got {self.max_model_len}")
        check(self.cpu_kvcache_space_gb >= 1, "rollout.vllm.cpu_kvcache_space_gb",
              f"must be >= 1 (whole GiB, as VLLM_CPU_KVCACHE_SPACE), got {self.cpu_kvcache_space_gb}")

    def engine_options(self) -> dict:
        """The `VLLMEngine` keyword arguments these options give (max_model_len only when set)."""
        opts = {"dtype": self.dtype, "enforce_eager": self.enforce_eager,
                "cpu_kvcache_space_gb": self.cpu_kvcache_space_gb, "lora_sync": self.lora_sync}
        return opts | ({"max_model_len": self.max_model_len} if self.max_model_len is not None else {})


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
    then loads the policy with transformers), `vllm` (vLLM: on a GPU, or its CPU build; rollout.vllm.*), or `auto` (native when the model
    allows it, else hf). A model the engine cannot run is refused before it loads."""
    vllm_mode: Literal["colocate", "server"] = field(default="colocate", metadata=aliases(trl("vllm_mode")))
    """rollout.engine=vllm: `colocate` builds the engine in the trainer's process, on its GPU (it
    sleeps during updates); `server` samples from a vLLM server started apart with `posttrain
    vllm-serve --model PATH` (other GPUs or another machine) at rollout.server_url, and pushes
    the policy's weights to it over a torch.distributed group after each update (TRL's server mode)."""
    server_url: str = field(default="http://127.0.0.1:8000", metadata=aliases(
        trl("vllm_server_base_url"),
        trl("vllm_server_host", same_value=False, note="set the whole URL: rollout.server_url=http://HOST:PORT"),
        trl("vllm_server_port", same_value=False, note="set the whole URL: rollout.server_url=http://HOST:PORT")))
    """rollout.vllm_mode=server: the server's root URL, http://HOST:PORT."""
    server_timeout_s: float = field(default=240.0, metadata=aliases(trl("vllm_server_timeout")))
    """rollout.vllm_mode=server: seconds to wait for the server at start (and for the weight
    group to form) before the run stops with the URL and how to start the server."""
    sync_bucket_mb: float = field(default=256.0, metadata=aliases(
        verl("actor_rollout_ref.rollout.update_weights_bucket_megabytes")))
    """Size (MiB) of each bucket the actor's weights travel in, one broadcast per bucket
    (`rollout/weight_stream.py`): to a rollout pool of its own
    (placement.rollout.enable_resource_pool, over a gloo or NCCL group joining actor worker 0
    and the rollout workers) and to a vLLM server (rollout.vllm_mode=server, in the server's
    dtype). The sender and each receiver hold one bucket at a time beyond their weights."""
    max_batch_size: int = 0
    """Native engine: most rows decoded at once (0 = all)."""
    gpu_memory_utilization: float = field(default=0.5, metadata=aliases(
        trl("vllm_gpu_memory_utilization"), verl("actor_rollout_ref.rollout.gpu_memory_utilization"),
        openrlhf("vllm_gpu_memory_utilization")))
    """vLLM engine on a GPU: fraction of GPU memory it may take (weights and KV cache; checked
    against what the training models leave free). vLLM's CPU build: rollout.vllm.cpu_kvcache_space_gb."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vllm engine's dtype, eager mode, context length and (CPU build) KV-cache size."""
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
        check(self.vllm_mode == "colocate" or self.engine == "vllm", "rollout.vllm_mode",
              f"server mode samples from a vLLM server: set rollout.engine=vllm too (it is {self.engine})")
        check(self.vllm_mode == "colocate" or self.server_url.startswith(("http://", "https://")),
              "rollout.server_url", f"must be http://HOST:PORT, got {self.server_url!r}")
        check(self.server_timeout_s > 0 and self.sync_bucket_mb > 0, "rollout.server_timeout_s",
              "rollout.server_timeout_s and rollout.sync_bucket_mb must be > 0")
        if self.engine == "vllm":  # outside vLLM's range its log-probs are not softmax(logits / T)
            problem = check_vllm_temperature(self.temperature)
            check(problem is None, "rollout.temperature", problem or "")
        check(not (self.dispatch == "split" and self.seed_mode != "row"), "rollout.dispatch",
              "split generation gives the whole batch's tokens only when each row draws its own random "
              "stream: set rollout.seed_mode=row (or rollout.dispatch=rank_zero)")


