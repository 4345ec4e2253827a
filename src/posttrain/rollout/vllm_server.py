"""The vllm engine in server mode (`rollout.vllm_mode=server`, TRL's `vllm_mode="server"`):
generation by a vLLM server that `posttrain vllm-serve` started on other GPUs or another
machine, weights pushed to it after each update. Needs no vLLM in the trainer's process.

    engine = make_engine("vllm", model, tok, server_url="http://127.0.0.1:8000")
    out = engine.generate(prompts, SamplingParams(n=8, seed=0))    # Completions, as every engine
    engine.sync_weights(model)                                     # after each update

Notation: B prompts, n samples per prompt, N = B·n rows.

- Start: GET /health/ until the server answers or `timeout_s` (`rollout.server_timeout_s`,
  TRL's `vllm_server_timeout`) passes; then a ConfigError names the URL and how to start the
  server. The server's tokenizer must be the policy's (vocabulary and its fingerprint
  compared: prompts go as token ids and vLLM detokenizes for stop strings). The policy's weights are
  pushed once before the first rollout, so the server samples from them whatever checkpoint
  it started from (a resumed run's, a LoRA run's merged ones).
- Rows: prompts are tokenized here and sent as token ids, each prompt n times, each row with
  its own seed `vllm_rows.request_seed` (the colocated engine's: per-row streams, a batch split in
  slices draws the whole batch's with seed_mode=row); a None seed is drawn from torch's RNG
  first (`resolve_seed`), so `torch.manual_seed` still makes a run repeatable. Log-probs are
  vLLM's processed log-probs (the server's `logprobs_mode`), `rollout/base.py`'s definition
  while no top-k/top-p/min-p filter is on (as the colocated engine: `vllm.py`).
- Weight sync (`sync_weights`): the trainer is rank 0 of a weight group with the server's
  workers (`rollout/weight_stream.py`): gloo, or NCCL when both sides are on CUDA on
  different GPUs. The group's store listens on this machine's address towards the server
  (127.0.0.1 for a local server) only. Each sync: POST /update_weights/ with the bucket plan
  while the buckets are broadcast (`rollout.sync_bucket_mb`), tensors in the server's dtype;
  the server loads them in checkpoint format, the tied lm_head included, then resets its
  prefix cache, and answers once done.
- A server that stops answering mid-run (connection refused or dropped, the weight group
  broken) stops the run with `ServerDied`: one line naming the URL and how to go on, as a
  dead Ray worker does (`trainers/rl_faults.py`). An error the server reports (HTTP 4xx/5xx)
  is raised with its message.
- `offload`/`resume` do nothing (`HoldsNoDeviceMemory`): the server's memory is its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import torch
from torch import nn

from posttrain.config.core import ConfigError, RunStopped
from posttrain.data.collate import pad_id_of
from posttrain.logging import get_logger
from posttrain.rollout.base import (
    Completions,
    HoldsNoDeviceMemory,
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
from posttrain.rollout.sampling import resolve_seed
from posttrain.rollout.vllm_platform import merged_adapters, named_weights
from posttrain.rollout.vllm_rows import (
    check_sampling,
    completions_from_rows,
    model_turn,
    request_sampling,
    request_seed,
)
from posttrain.rollout.weight_stream import (
    WeightGroup,
    listen,
    plan_buckets,
    plan_to_json,
    send_buckets,
    tensor_specs,
)

log = get_logger(__name__)


class ServerDied(RunStopped):
    """The vLLM server stopped answering mid-run; the message names it and what to do."""


class ServerGone(ConnectionError):
    """No answer from the server (refused, dropped, reset): it is not (or no longer) there."""


class ServerError(RunStopped):
    """The server answered with an error (HTTP 4xx/5xx), a failed weight load among them; the
    message is its own. The run cannot go on from it: it stops in one line."""


def vocab_fingerprint(vocab: dict[str, int]) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id): the server and the trainer
    compare theirs (`posttrain vllm-serve`'s /health/ reports its tokenizer's)."""
    items = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(items).hexdigest()[:16]


def start_hint(url: str) -> str:
    """How to start a server at `url` (the command a user types)."""
    parts = urllib.parse.urlsplit(url)
    port = f" --port {parts.port}" if parts.port else ""
    host = f" --host {parts.hostname}" if parts.hostname not in (None, "127.0.0.1", "localhost") else ""
    return f"posttrain vllm-serve --model PATH{host}{port} (PATH: the policy's checkpoint, model.path)"


class ServerClient:
    """JSON over HTTP to one server (stdlib only)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def call(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """GET (body None) or POST `path`; raises ServerGone when nothing answers and ServerError
        with the server's message on an HTTP error."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error") or err.reason
            except (ValueError, AttributeError):
                message = err.reason
            raise ServerError(f"the vLLM server at {self.url}: {path} failed (HTTP {err.code}): {message}") from None
        except urllib.error.URLError as err:
            raise ServerGone(str(getattr(err, "reason", err))) from None
        except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as err:
            raise ServerGone(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None


def wait_for_server(client: ServerClient, timeout_s: float, poll_s: float = 1.0) -> dict:
    """The server's /health/ answer, polled until it comes or `timeout_s` passes (then a
    ConfigError in one line: the URL, what happened, how to start one)."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        try:
            return client.call("/health/", timeout=max(poll_s, 5.0))
        except (ServerGone, ServerError) as err:
            if time.monotonic() + poll_s > deadline:
                raise ConfigError(
                    f"rollout.server_url={client.url}: no vLLM server answered there within "
                    f"rollout.server_timeout_s={timeout_s:g} s ({err}). Start one with `{start_hint(client.url)}`, "
                    "or set rollout.vllm_mode=colocate") from None
            if not logged:
                log.info("waiting up to %g s for the vLLM server at %s (%s)", timeout_s, client.url, err)
                logged = True
            time.sleep(poll_s)


def weight_backend(health: dict, trainer_cuda: bool) -> str:
    """nccl when both the server and the trainer are on CUDA and not on one GPU (NCCL refuses
    two ranks on a device), else gloo."""
    if health.get("device") != "cuda" or not trainer_cuda:
        return "gloo"
    own = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return "gloo" if own == health.get("device_uuid") else "nccl"


def local_address(url: str) -> str:
    """This machine's address on the route to the server at `url` (127.0.0.1 for a local one)."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=10) as s:
            return s.getsockname()[0]
    except OSError as err:
        raise ServerGone(str(err)) from None


class _Background(threading.Thread):
    """`fn(*args)` in a daemon thread, its result or exception kept."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True, name="posttrain-weight-stream")
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as err:  # reported by the caller
            self.error = err


class VLLMServerEngine(HoldsNoDeviceMemory):
    """Sampling through a `posttrain vllm-serve` server (module docstring)."""

    kind = "vllm"

    def __init__(self, model: nn.Module, tokenizer, *, server_url: str, timeout_s: float = 240.0,
                 bucket_mb: float = 256.0, **ignored: Any):
        """
        Args:
            model: the policy; its weights are pushed to the server before the first rollout.
            tokenizer: its tokenizer (the server's must be the same).
            server_url: the server's root, http://HOST:PORT.
            timeout_s: how long to wait for the server at start, and for the weight group to form.
            bucket_mb: size of each weight bucket, MiB.
        """
        if ignored:  # vLLM's own options (dtype, seed, max_model_len, ...) are the server's
            raise TypeError(f"server mode takes no vLLM engine options ({', '.join(sorted(ignored))}): "
                            "pass them to posttrain vllm-serve")
        self.tokenizer, self.timeout_s, self.bucket_bytes = tokenizer, timeout_s, int(bucket_mb * 2**20)
        self.client = ServerClient(server_url)
        self.url = self.client.url
        self.health = wait_for_server(self.client, timeout_s)
        self._check_tokenizer(self.health)
        self.dtype = self.health["dtype"]
        self.group: WeightGroup | None = None
        self.syncs = 0
        self.sync_weights(model)
        log.info("rollout: vLLM server at %s (%s, %s), weights pushed over %s in %.2f s", self.url,
                 self.health["dtype"], self.health["device"], self.group.backend, self.last_sync_s)

    def _check_tokenizer(self, health: dict) -> None:
        ours, theirs = len(self.tokenizer), health.get("vocab_size")
        same = ours == theirs and health.get("vocab_sha") in (None, vocab_fingerprint(self.tokenizer.get_vocab()))
        if not same:
            raise ConfigError(
                f"rollout.server_url={self.url}: the server's tokenizer ({health.get('model')}, {theirs} tokens) is "
                f"not the policy's ({ours} tokens): restart it with --model the policy's checkpoint (model.path)")

    # ------------------------------------------------------------ weights

    def _died(self, during: str, err: BaseException) -> ServerDied:
        return ServerDied(
            f"the vLLM server at {self.url} stopped answering during {during} ({err}). The run stopped; "
            f"restart the server (`{start_hint(self.url)}`) and rerun to resume from the last checkpoint")

    def _join_group(self) -> None:
        trainer_cuda = torch.cuda.is_available()
        backend = weight_backend(self.health, trainer_cuda)
        addr = local_address(self.url)
        listener = listen(addr)
        world = 1 + int(self.health["world_size"])
        body = {"host": addr, "port": listener.getsockname()[1], "world_size": world, "backend": backend,
                "timeout_s": self.timeout_s}
        joining = _Background(WeightGroup.join, addr, body["port"], 0, world, backend, self.timeout_s, listener)
        self.client.call("/init_weight_group/", body)
        joining.join()
        if joining.error is not None:
            raise joining.error
        self.group = joining.result

    def sync_weights(self, model: nn.Module) -> None:
        """Push `model`'s weights to the server (module docstring); a peft model's adapters are
        merged for the copy. Raises ServerDied when the server is gone, ServerError when its load
        failed (it then refuses to generate until a whole push succeeds)."""
        start = time.perf_counter()
        with merged_adapters(model):
            self._push(model)
        self.syncs += 1
        self.last_sync_s = time.perf_counter() - start

    def _push(self, model: nn.Module) -> None:
        try:
            if self.group is None:
                self._join_group()
            named = named_weights(model)
            plan = plan_buckets(tensor_specs(named, self.dtype), self.bucket_bytes)
            sending = _Background(send_buckets, self.group.broadcast, named, plan, 0, self.group.device)
            try:
                self.client.call("/update_weights/", {"plan": plan_to_json(plan)})
                sending.join()
                if sending.error is not None:
                    raise sending.error
            except BaseException:
                self._drop_group()  # a sender still blocked in a broadcast fails with it,
                sending.join(timeout=60)  # and ends before the error goes up: a thread left inside a
                raise  # gloo collective at the interpreter's exit aborted the process (SIGABRT, not exit 1)
        except ServerGone as err:
            raise self._died("the weight sync", err) from None
        except ServerError:
            raise
        except RuntimeError as err:  # the weight group broke: the peer's connection dropped
            raise self._died("the weight sync", err) from None

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        """Leave the weight group (the server stays up for the next run)."""
        if self.group is not None:
            try:
                self.client.call("/close_weight_group/", {}, timeout=30)
            except (ServerGone, ServerError):
                pass
            self._drop_group()

    # ------------------------------------------------------------ generation

    def _rows(self, prompts: list[list[int]], seeds: list[int], budgets: list[int], params: SamplingParams,
              stop_ids: list[int], what: str) -> list[dict]:
        """POST /generate/ for token-id rows; each answer row: token_ids, logprobs, finish_reason,
        stop_reason."""
        body = {"prompts": prompts, "seeds": seeds, "max_tokens": budgets,
                "sampling": request_sampling(params, stop_ids)}
        try:
            rows = self.client.call("/generate/", body)["rows"]
        except ServerGone as err:
            raise self._died(what, err) from None
        if len(rows) != len(prompts):
            raise ServerError(f"the vLLM server at {self.url}: /generate/ answered {len(rows)} rows for {len(prompts)}")
        return rows

    @staticmethod
    def _seed(params: SamplingParams, seed: int, row: int, turn: int = 0, rows: int = 0) -> int:
        return request_seed(seed, params.first_row + row, turn, rows, params.seed_mode)

    def generate(self, prompts: Prompts, params: SamplingParams, on_tokens: TokenCallback | None = None
                 ) -> Completions:
        check_sampling(params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pad_id = pad_id_of(self.tokenizer)
        stop_ids = list(params.resolved_stop_token_ids(self.tokenizer))
        rows = [p for p in prompt_ids for _ in range(params.n)]
        seed = resolve_seed(params.seed)
        seeds = [self._seed(params, seed, r) for r in range(len(rows))]
        start = time.perf_counter()
        answers = self._rows(rows, seeds, [params.max_new_tokens] * len(rows), params, stop_ids, "generation")
        seconds = time.perf_counter() - start
        out = completions_from_rows(answers, rows, params, self.tokenizer, pad_id,
                                    meta={"engine": "vllm-server", "seconds": seconds})
        if on_tokens is not None:
            replay_tokens(on_tokens, out.response_ids, out.lengths)
        return out

    def generate_episodes(self, prompts: Prompts, params: SamplingParams, limits: MultiTurnLimits,
                          handler: TurnHandler) -> Episodes:
        """`params.n` multi-turn episodes of every prompt, one /generate/ per model turn over the
        running rows (the colocated engine's turn loop; the server's prefix cache keeps each
        row's history between turns)."""
        turn_params = dataclasses.replace(params, logprobs=True, include_stop_str_in_output=True)
        check_sampling(turn_params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pad_id = pad_id_of(self.tokenizer)
        stop_ids = list(params.resolved_stop_token_ids(self.tokenizer))
        rows, seed = len(prompt_ids) * params.n, resolve_seed(params.seed)

        def sample(requests: list[TurnRequest]) -> list[ModelTurn]:
            seeds = [self._seed(params, seed, q.row, q.turn, rows) for q in requests]
            answers = self._rows([q.ids for q in requests], seeds, [q.max_tokens for q in requests], turn_params,
                                 stop_ids, "an episode's turn")
            return [model_turn(a) for a in answers]

        out = run_turn_episodes(sample, prompt_ids, params, limits, handler, self.tokenizer, pad_id)
        out.meta["engine"] = "vllm-server"
        return out
