"""The HTTP side: routes, the request handler, the server, `serve` and `ServerThread`."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from posttrain.serve.batcher import Batcher, BatcherClosed
from posttrain.serve.protocol import ModelInfo, RequestError, parse_request, response, stream_chunks

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
ENGINES = ("native", "hf")


class Events(list):
    """A streamed answer: the chunks to send as server-sent events."""


class App:
    """What the server does, apart from HTTP: validate, batch, answer (JSON-able dicts)."""

    def __init__(
        self,
        engine: Any,
        info: ModelInfo,
        engine_kind: str,
        max_batch_size: int,
        batch_wait_ms: float,
    ):
        self.info = info
        self.engine_kind = engine_kind
        self.batcher = Batcher(engine, max_batch_size, batch_wait_ms)
        self.started = int(time.time())
        # Fast tokenizers may refuse concurrent use from several threads ("Already borrowed").
        self._tokenizer_lock = threading.Lock()
        self.routes: dict[str, tuple[str, Callable[[Any], Any]]] = {
            "/health": ("GET", lambda _: self.health()),
            "/v1/models": ("GET", lambda _: self.models()),
            "/v1/completions": ("POST", lambda body: self.generate(body, chat=False)),
            "/v1/chat/completions": ("POST", lambda body: self.generate(body, chat=True)),
        }

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

    def generate(self, body: Any, chat: bool) -> dict:
        req = parse_request(body, self.info, chat, self._encode)
        try:
            out = self.batcher.submit(req.prompts, req.params)
        except BatcherClosed as err:
            raise RequestError(str(err), 503, type="server_error") from None
        full = response(req, self.info.name, out.texts, out.finish_reasons, out.lengths)
        return Events(stream_chunks(full)) if req.stream else full

    def _encode(self, prompt: str | list[dict]) -> list[int]:
        from posttrain.evaluation import prompt_input

        tok = self.info.tokenizer
        if not isinstance(prompt, str) and getattr(tok, "chat_template", None) is None:
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        with self._tokenizer_lock:
            ids = prompt_input(tok, prompt)
            return tok(ids)["input_ids"] if isinstance(ids, str) else ids

    def close(self) -> None:
        self.batcher.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every response carries a Content-Length
    server_version = "posttrain"
    server: ModelServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        headers: dict[str, str] = {}
        try:
            raw = self._read_body()
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            if path not in app.routes:
                raise RequestError(
                    f"unknown path {path}; this server has {', '.join(app.routes)}",
                    404,
                    type="not_found_error",
                )
            allowed, handle = app.routes[path]
            if method != allowed:
                headers["Allow"] = allowed
                raise RequestError(f"{method} is not allowed on {path}; use {allowed}", 405)
            result = handle(_parse_json(raw) if allowed == "POST" else None)
        except RequestError as err:
            self._send_json(err.status, err.body(), headers)
            return
        except Exception as err:  # a bug or an engine failure: the client still gets JSON
            log.exception("error serving %s %s", method, self.path)
            self._send_json(
                500, RequestError(f"internal error: {err}", 500, type="server_error").body(), {}
            )
            return
        if isinstance(result, Events):
            self._send_events(result)
        else:
            self._send_json(200, result, {})

    def _read_body(self) -> bytes:
        """The request body (empty without one); 411/413 close the connection, since the
        unread body would be taken for the next request."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise RequestError("chunked request bodies are not supported; send Content-Length", 411)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise RequestError(f"invalid Content-Length {length!r}") from None
        limit = self.server.max_body_bytes
        if size > limit or size < 0:
            self.close_connection = True
            raise RequestError(f"the request body has {size} bytes; the limit is {limit}", 413)
        return self.rfile.read(size)

    def _send_json(self, status: int, payload: dict, headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_events(self, chunks: list[dict]) -> None:
        """Server-sent events, then `data: [DONE]`; the connection closes to end the body."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _parse_json(raw: bytes) -> Any:
    if not raw:
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None


class ModelServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer answering with `app`; `url` is its address once bound."""

    daemon_threads = True

    def __init__(
        self,
        app: App,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        try:
            super().__init__((host, port), _Handler)
        except OSError as err:
            app.close()
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # the client went away mid-answer
            log.debug("client %s disconnected", client_address)
        else:
            log.exception("error handling a request from %s", client_address)

    def close(self) -> None:
        """Stop accepting, fail waiting requests, close the socket (serve_forever must have returned)."""
        self.app.close()
        self.server_close()


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
    from posttrain.rollout import engine_kind_for, make_engine

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
    impl = "hf" if engine == "hf" else "auto"
    model, tokenizer = build_model_and_tokenizer(
        ModelConfig(path=str(model_dir), impl=impl, device=device, dtype=dtype)
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
    try:
        generator = make_engine(engine, model, tokenizer)
    except TypeError as err:  # e.g. the native engine asked to run a non-Llama model
        raise ValueError(str(err)) from None
    app = App(generator, info, engine, max_batch_size, batch_wait_ms)
    return ModelServer(app, host, port, max_body_bytes)


def serve(
    model_path: str | Path, host: str = "127.0.0.1", port: int = 8000, **options: Any
) -> None:
    """Serve `model_path` until Ctrl-C or SIGTERM (options as in `load_server`); prints the
    URL once it accepts connections."""
    server = load_server(model_path, host, port, **options)
    app = server.app
    print(
        f"posttrain serve: {app.info.name} ({app.engine_kind} engine) at {server.url}/v1 "
        f"(max batch {app.batcher.max_batch_size} rows, wait {app.batcher.batch_wait_s * 1000:g} ms); "
        "Ctrl-C stops",
        flush=True,
    )
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("posttrain serve: shutting down", flush=True)
    finally:
        server.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class ServerThread:
    """`load_server` + `serve_forever` in a daemon thread, as a context manager (tests,
    notebooks). Binds port 0 (any free port) on 127.0.0.1 by default.

        with ServerThread("runs/sft/final") as srv:
            requests.post(f"{srv.base_url}/completions", json={"prompt": "1+1="})
    """

    def __init__(
        self, model_path: str | Path, host: str = "127.0.0.1", port: int = 0, **options: Any
    ):
        self.server = load_server(model_path, host, port, **options)
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="posttrain-serve", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        """The OpenAI API root, `{url}/v1`."""
        return f"{self.server.url}/v1"

    @property
    def port(self) -> int:
        return self.server.server_address[1]

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
