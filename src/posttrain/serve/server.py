"""The HTTP side: the FastAPI routes and error handlers, the uvicorn server, `serve` and
`ServerThread`."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from posttrain.rollout import TextStream
from posttrain.serve.batcher import Batcher, BatcherClosed, Generated
from posttrain.serve.logprobs import chat_logprobs, completion_logprobs
from posttrain.serve.protocol import (
    ChatBody,
    ChunkWriter,
    CompletionBody,
    GenerationRequest,
    ModelInfo,
    RequestError,
    parse_request,
    response,
    response_head,
    validation_error,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
ENGINES = ("native", "hf")
ROUTES = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")


class App:
    """What the server does: validate, batch, answer. `asgi` is the FastAPI app serving it."""

    def __init__(
        self,
        engine: Any,
        info: ModelInfo,
        engine_kind: str,
        max_batch_size: int,
        batch_wait_ms: float,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.info = info
        self.engine_kind = engine_kind
        self.batcher = Batcher(engine, max_batch_size, batch_wait_ms)
        self.started = int(time.time())
        self.asgi = _fastapi_app(self, max_body_bytes)

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.info.name,
            "engine": self.engine_kind,
            "stats": self.batcher.stats(),
        }

    def models(self) -> dict:
        card = {
            "id": self.info.name,
            "object": "model",
            "created": self.started,
            "owned_by": "posttrain",
        }
        return {"object": "list", "data": [card]}

    async def generate(self, body: CompletionBody | ChatBody) -> dict | AsyncIterator[dict]:
        """The response object, or its stream chunks when the request streams."""
        # Tokenizing here, on the event loop's one thread, keeps requests from using the
        # tokenizer concurrently (fast tokenizers may refuse: "Already borrowed").
        req = parse_request(body, self.info, self._encode)
        if req.stream:
            return await self._stream(req)
        out = await _result(self.batcher.submit(req.prompts, req.params, top_logprobs=req.top_logprobs))
        return response(req, self.info.name, out.texts, out.finish_reasons, out.lengths, self._logprobs(req, out))

    def _logprobs(self, req: GenerationRequest, out: Generated) -> list[dict] | None:
        """Each choice's log-probs object, in the endpoint's shape; None when not asked for."""
        if out.logprobs is None:
            return None
        shape = chat_logprobs if req.chat else completion_logprobs
        return [shape(self.info.tokenizer, row) for row in out.logprobs]

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[dict]:
        """Submit a streamed request and wait for its first tokens: a failure before them is
        an HTTP error, as for an unstreamed request; then its chunks as they are decoded."""
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[tuple[list[int], list[int]] | None] = asyncio.Queue()

        def put(item: tuple[list[int], list[int]] | None) -> None:  # on the generation thread
            try:
                loop.call_soon_threadsafe(steps.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        future = self.batcher.submit(req.prompts, req.params, lambda rows, ids: put((rows, ids)), req.top_logprobs)
        future.add_done_callback(lambda _: put(None))  # after every step: the queue keeps order
        try:
            first = await steps.get()
        except asyncio.CancelledError:  # the client left before the first token
            future.cancel()
            raise
        if first is None:
            await _result(future)
        return self._chunks(req, first, steps, future)

    async def _chunks(
        self, req: GenerationRequest, step: Any, steps: asyncio.Queue, future: Any
    ) -> AsyncIterator[dict]:
        """Each row's new text (`TextStream`) as its tokens arrive, then the rest of its final
        text and its finish_reason; an error after the first chunk ends the stream with
        OpenAI's error object."""
        write = ChunkWriter(response_head(req, self.info.name))
        streams = [TextStream(self.info.tokenizer, req.params) for _ in range(req.rows)]
        while step is not None:
            for row, token in zip(*step):
                if text := streams[row].push(token):
                    yield write((row, text, None))
            step = await steps.get()
        try:
            out = await _result(future)
        except RequestError as err:
            yield err.body()
            return
        logprobs = self._logprobs(req, out) or [None] * req.rows
        for row, (stream, text, reason) in enumerate(zip(streams, out.texts, out.finish_reasons)):
            rest = stream.finish(text)
            if rest or row not in write.started or logprobs[row] is not None:
                yield write((row, rest, None, logprobs[row]))  # a row's log-probs: all in one chunk
            yield write((row, "", reason))

    def _encode(self, prompt: str | list[dict]) -> list[int]:
        from posttrain.evaluation import prompt_input

        tok = self.info.tokenizer
        if not isinstance(prompt, str) and getattr(tok, "chat_template", None) is None:
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        ids = prompt_input(tok, prompt)
        return tok(ids)["input_ids"] if isinstance(ids, str) else ids

    def close(self) -> None:
        self.batcher.close()


def _fastapi_app(app: App, max_body_bytes: int) -> FastAPI:
    """The routes, and error handlers that answer every failure with OpenAI's error object."""
    # A body without Content-Type is read as JSON, as before; form and text bodies are
    # refused, so a web page cannot post to this unauthenticated server from a browser.
    api = FastAPI(title="posttrain serve", strict_content_type=False)

    @api.get("/health")
    async def health() -> dict:
        return app.health()

    @api.get("/v1/models")
    async def models() -> dict:
        return app.models()

    @api.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        return _answer(await app.generate(body))

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Any:
        return _answer(await app.generate(body))

    @api.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), err.status)

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        sent = request.headers.get("content-type", "application/json")
        if "json" not in sent:  # e.g. curl -d, which sends a form type
            message = f"send the body as JSON with Content-Type: application/json, not {sent}"
            return await refused(request, RequestError(message))
        return await refused(request, validation_error(err.errors()))

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        path, status, kind = request.url.path, err.status_code, "invalid_request_error"
        message = str(err.detail)
        if status == 404:
            message, kind = (
                f"unknown path {path}; this server has {', '.join(ROUTES)}",
                "not_found_error",
            )
        elif status == 405:
            allowed = (err.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {path}; use {allowed}"
        return JSONResponse(RequestError(message, status, type=kind).body(), status, err.headers)

    @api.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> JSONResponse:  # a bug: still JSON
        body = RequestError(f"internal error: {err}", 500, type="server_error").body()
        return JSONResponse(body, 500)

    api.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    return api


class _BodyLimit:
    """Refuses a request body over `max_bytes` with 413 and OpenAI's error object (not
    FastAPI's max_body_size, whose 413 is plain text): at once when its Content-Length says
    so; a chunked body (no Content-Length) is read chunk by chunk and refused once it passes
    the limit (so at most the limit and one chunk are held), else handed on as read."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        size = headers.get(b"content-length", b"").decode("latin-1")
        if size.isdigit():
            if int(size) > self.max_bytes:
                return await self._refuse(scope, receive, send, f"the request body has {size} bytes")
            return await self.app(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            return await self.app(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            total, more = total + len(chunks[-1]), message.get("more_body", False)
            if total > self.max_bytes:
                return await self._refuse(scope, receive, send, f"the chunked request body passed {total} bytes")
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:  # after the body: the server's own messages (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any, what: str) -> None:
        error = RequestError(f"{what}; the limit is {self.max_bytes} (max_body_bytes)", 413)
        await JSONResponse(error.body(), 413, headers={"Connection": "close"})(scope, receive, send)


async def _result(future: Any) -> Generated:
    """A batcher job's result, its failure as the HTTP error to answer with."""
    try:
        return await asyncio.wrap_future(future)
    except BatcherClosed as err:
        raise RequestError(str(err), 503, type="server_error") from None
    except Exception as err:  # logged by the batcher
        raise RequestError(f"generation failed: {err}", 500, type="server_error") from None


def _answer(result: dict | AsyncIterator[dict]) -> JSONResponse | StreamingResponse:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        _server_sent_events(result),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _server_sent_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class ModelServer:
    """uvicorn serving `app` on a socket bound (and listening) at construction, so `url`
    is known at once and clients that connect early wait until it serves."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 8000):
        self.app = app
        try:
            self.socket = socket.create_server((host, port))
        except OSError as err:
            app.close()
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
        config = uvicorn.Config(
            app.asgi, log_level="warning", lifespan="off", timeout_graceful_shutdown=10
        )
        self.uvicorn = uvicorn.Server(config)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve until `shutdown` (or, in the main thread, SIGINT / SIGTERM, which uvicorn
        raises again once it has stopped)."""
        self.uvicorn.run(sockets=[self.socket])

    def shutdown(self) -> None:
        """Ask `serve_forever` to finish the requests in progress and return."""
        self.uvicorn.should_exit = True

    def close(self) -> None:
        """Fail waiting requests and close the socket (serve_forever must have returned)."""
        self.app.close()
        self.socket.close()


def load_server(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine: str | None = None,
    max_batch_size: int = 32,
    batch_wait_ms: float = 10.0,
    device: str = "auto",
    dtype: str = "auto",
    served_model_name: str | None = None,
    default_max_tokens: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> ModelServer:
    """Load the causal LM at `model_path` (a model folder or a run directory: its final/ or
    newest checkpoint) and bind a server for it (not yet serving)."""
    from posttrain.config import ModelConfig
    from posttrain.export import LORA_ADAPTER, SEQUENCE_CLASSIFIER, detect_kind, resolve_model_dir
    from posttrain.models.factory import build_model_and_tokenizer
    from posttrain.rollout import engine_kind_for, make_engine, model_impl_for

    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    if max_batch_size < 1 or batch_wait_ms < 0 or default_max_tokens < 1:
        raise ValueError("need max_batch_size >= 1, batch_wait_ms >= 0 and default_max_tokens >= 1")
    model_dir = resolve_model_dir(model_path)
    kind = detect_kind(model_dir)
    if kind == LORA_ADAPTER:
        raise ValueError(
            f"{model_dir} is a LoRA adapter; merge it first: posttrain export {model_dir} --merge-lora --out DIR"
        )
    if kind == SEQUENCE_CLASSIFIER:
        raise ValueError(
            f"{model_dir} is a sequence classifier (a reward model or critic); serve takes a causal LM"
        )
    model, tokenizer = build_model_and_tokenizer(
        ModelConfig(path=str(model_dir), impl=model_impl_for(engine or "auto", "auto"), device=device, dtype=dtype)
    )
    model.eval()
    engine = engine or engine_kind_for(model)
    config = model.config
    info = ModelInfo(
        name=served_model_name or str(model_path),
        tokenizer=tokenizer,
        vocab_size=int(getattr(config, "vocab_size", None) or len(tokenizer)),
        context_length=getattr(config, "max_position_embeddings", None),
        default_max_tokens=default_max_tokens,
    )
    generator = make_engine(engine, model, tokenizer)  # ValueError for a model the engine cannot run
    app = App(generator, info, engine, max_batch_size, batch_wait_ms, max_body_bytes)
    return ModelServer(app, host, port)


def serve(
    model_path: str | Path, host: str = "127.0.0.1", port: int = 8000, **options: Any
) -> None:
    """Serve `model_path` until Ctrl-C or SIGTERM (options as in `load_server`); prints the
    URL once it accepts connections."""
    server = load_server(model_path, host, port, **options)
    app = server.app
    line = (f"posttrain serve: {app.info.name} ({app.engine_kind} engine) at {server.url}/v1 "
            f"(max batch {app.batcher.max_batch_size} rows, wait {app.batcher.batch_wait_s * 1000:g} ms); "
            "Ctrl-C stops")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGINT too: a process started in the background by a non-interactive shell
        # inherits SIGINT ignored, and a Ctrl-C before uvicorn's handler would be lost.
        previous = {sig: signal.signal(sig, handler) for sig, handler in
                    ((signal.SIGTERM, _raise_interrupt), (signal.SIGINT, signal.default_int_handler))}
    # The URL is printed once uvicorn has started (its signal handlers installed), so that a
    # Ctrl-C as soon as it appears stops the server the graceful way.
    threading.Thread(target=_announce_when_started, args=(server, line), daemon=True,
                     name="posttrain-serve-ready").start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn raises the signal it stopped on again
        pass
    finally:
        print("posttrain serve: shutting down", flush=True)
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _announce_when_started(server: ModelServer, line: str) -> None:
    while not server.uvicorn.started:
        if server.uvicorn.should_exit:
            return
        time.sleep(0.01)
    print(line, flush=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class ServerThread:
    """`load_server` + `serve_forever` in a daemon thread, as a context manager (tests,
    notebooks). Binds port 0 (any free port) on 127.0.0.1 by default.

        with ServerThread("runs/sft/final") as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none")
    """

    def __init__(
        self, model_path: str | Path, host: str = "127.0.0.1", port: int = 0, **options: Any
    ):
        self.server = load_server(model_path, host, port, **options)
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="posttrain-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
            if time.monotonic() > deadline:
                break
        if not self.server.uvicorn.started:
            url = self.url
            self.close()
            raise RuntimeError(f"the server at {url} did not start")

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        """The OpenAI API root, `{url}/v1`."""
        return f"{self.server.url}/v1"

    @property
    def port(self) -> int:
        return self.server.socket.getsockname()[1]

    @property
    def model_name(self) -> str:
        return self.server.app.info.name

    def stats(self) -> dict:
        return self.server.app.batcher.stats()

    def close(self) -> None:
        self.server.shutdown()
        self._thread.join()
        self.server.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
