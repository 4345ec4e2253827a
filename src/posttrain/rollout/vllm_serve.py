"""`posttrain vllm-serve`: a vLLM engine behind HTTP that a training run samples from and
pushes its weights to (TRL's `trl vllm-serve`; the client is `rollout/vllm_server.py`).

    posttrain vllm-serve --model runs/sft/final --port 8000 --dtype bfloat16     # machine or GPU A
    posttrain grpo ... rollout.engine=vllm rollout.vllm_mode=server \\
        rollout.server_url=http://127.0.0.1:8000                                   # machine or GPU B

Endpoints (JSON; FastAPI on uvicorn, one `vllm.LLM` behind a lock):
  GET  /health/              {"status": "ok", model, dtype, device, world_size, vocab_size, ...}
  POST /generate/            token-id prompts, one per row, each with its seed and max_tokens ->
                             per row: token_ids, logprobs (of the sampled tokens), finish_reason,
                             stop_reason (`generate` below)
  POST /init_weight_group/   {host, port, world_size, backend, timeout_s}: the workers join the
                             trainer's weight group (the trainer is rank 0 and hosts its store)
  POST /update_weights/      {plan}: the workers receive the plan's buckets from rank 0 and load
                             them (as the colocated engine: `load_weights_on_worker`), then the
                             prefix cache is reset
  POST /close_weight_group/

Where it departs from TRL's: the weights come as buckets (`rollout/weight_stream.py`), one
request and one broadcast per bucket rather than per parameter, over gloo (CPU) or NCCL (both
sides on CUDA, on different GPUs); the load is the colocated engine's (`vllm_platform`:
`reload_weights` on the CPU build, the tied lm_head sent as a tensor of its own); the request that
starts an update returns once the load is done, so a failed load is an HTTP error the trainer
sees. A load that fails part-way leaves the engine half updated: the server then refuses
/generate/ until a whole update succeeds, rather than sample from a mix of two policies.

Defaults for RL, as TRL's: `logprobs_mode=processed_logprobs` (log-probs of the temperature-
scaled distribution: `rollout/base.py`'s definition), prefix caching on. The engine runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set; tensor-parallel workers are
processes anyway). No authentication: it binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from posttrain.logging import get_logger
from posttrain.rollout.vllm_platform import (
    detect_platform,
    engine_kwargs,
    kv_cache_kwargs,
    serving_dtype,
)
from posttrain.rollout.vllm_rows import row_result, sampling_kwargs

log = get_logger(__name__)

EXTENSION = "posttrain.rollout.vllm_serve.WeightReceiver"
"""The worker extension (`vllm.LLM(worker_extension_cls=...)`) that joins the weight group."""


class WeightReceiver:
    """Mixed into each vLLM worker (`worker_extension_cls`): join the trainer's weight group as
    rank 1 + the worker's rank, receive buckets, load them as the colocated engine does. Attribute names
    carry a `posttrain_` prefix: vLLM refuses an extension that shadows a worker attribute."""

    posttrain_group = None

    def posttrain_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        from posttrain.rollout.weight_stream import WeightGroup

        self.posttrain_leave()
        rank = 1 + int(getattr(self, "rank", 0))
        self.posttrain_group = WeightGroup.join(host, port, rank, world_size, backend, timeout_s)
        return rank

    def posttrain_receive(self, plan_json: list[dict], reload: bool) -> int:
        """Receive every bucket of the plan and load it (`load_weights_on_worker`, as the colocated
        engine does); returns the tensors loaded. The stream is drained even when the load stops
        early, so the trainer's broadcasts all complete."""
        from posttrain.rollout.vllm_platform import load_weights_on_worker
        from posttrain.rollout.weight_stream import plan_from_json, receive_buckets

        group = self.posttrain_group
        if group is None:
            raise RuntimeError("no weight group: POST /init_weight_group/ first")
        plan = plan_from_json(plan_json)
        stream = receive_buckets(group.broadcast, plan, 0, group.device)
        seen = 0

        def counted():
            nonlocal seen
            for item in stream:
                seen += 1
                yield item

        try:
            load_weights_on_worker(self, counted(), reload)
        finally:
            for _ in stream:
                pass
        return seen

    def posttrain_leave(self) -> None:
        if self.posttrain_group is not None:
            self.posttrain_group.close()
            self.posttrain_group = None


@dataclass
class ServeOptions:
    """What `posttrain vllm-serve` starts (its --help documents each)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    seed: int = 0
    enable_prefix_caching: bool = True
    log_level: str = "warning"


def llm_kwargs(opts: ServeOptions, dtype: str, platform) -> dict[str, Any]:
    """The arguments of `vllm.LLM` for `opts` on `platform` (the colocated engine's, no sleep mode)."""
    kv = kv_cache_kwargs(opts.kv_cache_gb, platform, os.environ, "--kv-cache-gb")
    return engine_kwargs(opts.model, dtype, opts.gpu_memory_utilization, opts.seed, sleep_mode=False,
                         enforce_eager=opts.enforce_eager, max_model_len=opts.max_model_len,
                         tensor_parallel_size=opts.tensor_parallel_size,
                         enable_prefix_caching=opts.enable_prefix_caching, worker_extension_cls=EXTENSION, **kv)


class Engine:
    """The `vllm.LLM` and the state the endpoints share; every engine call holds `lock`."""

    def __init__(self, opts: ServeOptions):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from posttrain.models.llama_checkpoint import checkpoint_dtype, read_config_json
        from posttrain.rollout.vllm import require_vllm

        vllm = require_vllm()
        self.platform = detect_platform(vllm)
        self.dtype, note = serving_dtype(opts.dtype, checkpoint_dtype(read_config_json(opts.model)), self.platform,
                                         "--dtype")
        if note:
            log.info("vllm-serve: %s", note)
        self.opts, self.cuda, self.vllm = opts, self.platform.device == "cuda", vllm
        self.llm = vllm.LLM(**llm_kwargs(opts, self.dtype, self.platform))
        self.lock = threading.Lock()
        self.torn: str | None = None  # why the weights are half updated, until a whole update succeeds
        self.updates = 0

    def health(self) -> dict[str, Any]:
        import torch

        from posttrain.rollout.vllm_server import vocab_fingerprint

        config, tokenizer = self.llm.llm_engine.vllm_config, self.llm.get_tokenizer()
        uuid = str(torch.cuda.get_device_properties(0).uuid) if self.cuda else None
        return {"status": "ok" if self.torn is None else "torn", "model": self.opts.model, "dtype": self.dtype,
                "device": "cuda" if self.cuda else "cpu", "device_uuid": uuid,
                "world_size": self.llm.get_world_size(include_dp=False),
                "vocab_size": len(tokenizer), "vocab_sha": vocab_fingerprint(tokenizer.get_vocab()),
                "max_model_len": config.model_config.max_model_len,
                "weight_updates": self.updates, "torn": self.torn}

    def generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        prompts, seeds, budgets = body["prompts"], body["seeds"], body["max_tokens"]
        if not (len(prompts) == len(seeds) == len(budgets)):
            raise ValueError("prompts, seeds and max_tokens need one entry per row")
        sampling = [self.vllm.SamplingParams(**sampling_kwargs(body["sampling"], m, s))
                    for m, s in zip(budgets, seeds)]
        with self.lock:
            if self.torn is not None:
                raise RuntimeError(f"the weights are half updated ({self.torn}); push them again")
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        return [row_result(o.outputs[0]) for o in outputs]

    def join(self, body: dict[str, Any]) -> list[int]:
        args = (str(body["host"]), int(body["port"]), int(body["world_size"]), str(body["backend"]),
                float(body["timeout_s"]))
        with self.lock:
            return self.llm.collective_rpc("posttrain_join", args=args)

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        with self.lock:
            try:
                loaded = self.llm.collective_rpc("posttrain_receive",
                                                 args=(body["plan"], self.platform.reloads_weights))
            except Exception as err:  # a load failure, whatever vLLM raised: the server's error (500)
                self.torn = f"update {self.updates + 1} failed: {type(err).__name__}: {err}"
                raise RuntimeError(self.torn) from err
            self.llm.reset_prefix_cache()  # KV computed by the old weights must not be reused
            self.torn, self.updates = None, self.updates + 1
        return {"tensors": loaded[0], "seconds": time.perf_counter() - start, "updates": self.updates}

    def leave(self) -> None:
        with self.lock:
            self.llm.collective_rpc("posttrain_leave")


def build_app(engine: Engine):
    """The FastAPI app over `engine`; a failed call answers {"error": message} with 400 (a bad
    request) or 500 (the engine or the weight load failed)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="posttrain vllm-serve")

    def call(fn, *args):
        try:
            return fn(*args)
        except (KeyError, TypeError, ValueError) as err:
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=400)
        except Exception as err:  # the engine's own failure: the trainer stops on it
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=500)

    @app.get("/health/")
    def health():
        return engine.health()

    @app.post("/generate/")
    def generate(body: dict):
        return call(lambda: {"rows": engine.generate(body)})

    @app.post("/init_weight_group/")
    def init_weight_group(body: dict):
        return call(lambda: {"ranks": engine.join(body)})

    @app.post("/update_weights/")
    def update_weights(body: dict):
        return call(engine.update, body)

    @app.post("/close_weight_group/")
    def close_weight_group():
        return call(lambda: engine.leave() or {"closed": True})

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception):
        return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=500)

    return app


def serve_vllm(opts: ServeOptions) -> None:
    """Start the engine, then serve until Ctrl-C / SIGTERM; prints one line once it listens."""
    import socket

    import uvicorn

    try:
        sock = socket.create_server((opts.host, opts.port))
    except OSError as err:
        raise ValueError(f"cannot listen on {opts.host}:{opts.port}: {err.strerror or err}") from None
    try:
        engine = Engine(opts)  # clients that connect meanwhile wait in the socket's backlog
        server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level=opts.log_level, lifespan="off"))
        host, port = sock.getsockname()[:2]
        print(f"posttrain vllm-serve: {opts.model} ({engine.dtype}, {engine.health()['device']}) at "
              f"http://{host}:{port}; train with rollout.engine=vllm rollout.vllm_mode=server "
              f"rollout.server_url=http://{host}:{port}. Ctrl-C stops", flush=True)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
