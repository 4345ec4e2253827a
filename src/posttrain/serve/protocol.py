"""The OpenAI request and response shapes: the request bodies as pydantic models (FastAPI
validates them), `parse_request` from a body to token-id prompts and SamplingParams, and the
`text_completion` / `chat.completion` objects and their stream chunks.

Every problem with a request becomes a `RequestError`, whose `body()` is OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`; the message names the field, and
`validation_error` turns pydantic's errors into one.

Parameters (both endpoints; defaults as in OpenAI's API where it has one; `null` = default):
  max_tokens (chat also max_completion_tokens): int >= 1, default 16 for completions and
    the server's `default_max_tokens` for chat; prompt + max_tokens must fit the model's
    context (config.json `max_position_embeddings`).
  temperature: >= 0, default 1 (0 = greedy); top_p in (0, 1], default 1; top_k (vLLM's
    extension): -1 or 0 = off; min_p in [0, 1]; n: 1 .. MAX_N; stop: a string or a list of
    up to MAX_STOP non-empty strings; seed: a 64-bit int or null; stream: bool.
  Log-probs (`serve.logprobs`: the model's log softmax of each generated token, from a
    scoring forward): chat `logprobs: true` with `top_logprobs` 0 .. MAX_LOGPROBS (refused
    without `logprobs: true`); completions `logprobs` 0 .. MAX_LOGPROBS (the chosen tokens
    and that many most likely). Streamed, a choice's log-probs come in one chunk after its
    text, before its finish_reason.
Types are strict (JSON numbers for numbers, booleans for booleans: "1" is not 1).
Accepted and ignored: `user`, `stream_options`, `response_format` of type "text", and any
field not listed. Refused (400) when set to something other than their no-op default,
because this server would silently not do them: echo, suffix, best_of > 1, logit_bias,
presence_penalty, frequency_penalty, tools, functions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from posttrain.rollout import SamplingParams
from posttrain.serve.logprobs import MAX_LOGPROBS

MAX_N = 64
MAX_STOP = 16
MAX_ROWS_PER_REQUEST = 512
"""Most completions (prompts x n) one request may ask for."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # name -> "is this value the no-op default?"
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, Mapping) and v.get("type") == "text"),
}


class RequestError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error object."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type, self.code = type, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def validation_error(errors: Sequence[Mapping]) -> RequestError:
    """The first of pydantic's errors (as FastAPI reports them, `loc` starting with "body")
    as a 400 naming the field, e.g. `messages[0].content`."""
    err = errors[0]
    if err["type"] == "json_invalid":
        return RequestError(
            f"the request body is not valid JSON: {err.get('ctx', {}).get('error')}"
        )
    loc = list(err["loc"])[1:] if err["loc"][:1] == ("body",) else list(err["loc"])
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if param is None and err["type"] == "missing":
        return RequestError("the request body is empty; send a JSON object")
    if param is None:
        return RequestError(f"the request body must be a JSON object: {err['msg']}")
    return RequestError(f"`{param}`: {err['msg']}", param=param)


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    name: str
    """The model id clients send (`model`) and /v1/models lists."""
    tokenizer: Any
    vocab_size: int
    """Token ids must be below this (the embedding's rows)."""
    context_length: int | None
    """Most tokens (prompt + completion) per sequence; None = no limit."""
    default_max_tokens: int = 256
    """max_tokens of a chat request that sets none (then capped by the context)."""


# --- request bodies --------------------------------------------------------------------


def _prompts(value: Any) -> list[str] | list[list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        if all(_is_int(t) for t in value):
            return [value]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return value
    raise PydanticCustomError(
        "prompt_type",
        "must be a string, a non-empty list of strings, a list of token ids, or a list of "
        "non-empty token-id lists",
    )


def _joined_text_parts(value: Any) -> Any:
    """Message content as [{"type": "text", "text": str}, ...] is its parts' joined text."""
    if not isinstance(value, list):
        return value
    if not all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        raise PydanticCustomError("content_parts", 'parts must be {"type": "text", "text": str}')
    return "".join(p["text"] for p in value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Message(BaseModel):
    model_config = ConfigDict(strict=True)

    role: str
    content: Annotated[str, BeforeValidator(_joined_text_parts)]


class _Body(BaseModel):
    """The fields both endpoints share (module docstring); unknown fields are kept in
    `model_extra`, so the unsupported ones can be refused by name."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[
        list[Annotated[StrictStr, Field(min_length=1)]],
        BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
        Field(max_length=MAX_STOP),
    ] = []
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's manual_seed takes: 64 bits
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class CompletionBody(_Body):
    """A /v1/completions request."""

    prompt: Annotated[list[str] | list[list[StrictInt]], PlainValidator(_prompts)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ChatBody(_Body):
    """A /v1/chat/completions request."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class GenerationRequest:
    """A validated request: token-id prompts and how to sample them."""

    chat: bool
    """/v1/chat/completions (True) or /v1/completions."""
    prompts: list[list[int]]
    """Token ids of each prompt (chat: the one templated conversation)."""
    params: SamplingParams
    stream: bool = False
    top_logprobs: int | None = None
    """None: no log-probs; k: each generated token's log-prob and the k most likely."""

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


def parse_request(
    body: CompletionBody | ChatBody, info: ModelInfo, encode: Callable
) -> GenerationRequest:
    """Check what the body's types do not: the model, the unsupported fields, the token ids
    and the context; encode(prompt) -> token ids, for a string or a list of chat messages."""
    if body.model is not None and body.model != info.name:
        raise RequestError(
            f"the model `{body.model}` does not exist; this server serves `{info.name}`",
            404,
            "model",
            "not_found_error",
            "model_not_found",
        )
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and not _UNSUPPORTED[name](value):
            raise RequestError(f"`{name}` is not supported by this server", param=name)
    chat = isinstance(body, ChatBody)
    if chat:
        prompts = [_encode(encode, [m.model_dump() for m in body.messages], "messages")]
    else:
        prompts = [_encode(encode, p, "prompt") if isinstance(p, str) else p for p in body.prompt]
        _check_ids(prompts, info.vocab_size)
    params = _sampling_params(body, info, chat, max(len(p) for p in prompts))
    if len(prompts) * params.n > MAX_ROWS_PER_REQUEST:
        raise RequestError(
            f"{len(prompts)} prompts x n={params.n} completions is more than the "
            f"{MAX_ROWS_PER_REQUEST} one request may ask for",
            param="n",
        )
    return GenerationRequest(chat, prompts, params, body.stream, _top_logprobs(body))


def _top_logprobs(body: CompletionBody | ChatBody) -> int | None:
    """The request's log-probs: None for none, else how many top tokens (module docstring)."""
    if not isinstance(body, ChatBody):
        return body.logprobs
    if body.top_logprobs and not body.logprobs:
        raise RequestError("`top_logprobs` needs `logprobs`: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _encode(encode: Callable, prompt: Any, param: str) -> list[int]:
    try:
        ids = list(encode(prompt))
    except RequestError:
        raise
    except Exception as err:  # a chat template may raise anything (jinja errors included)
        raise RequestError(f"cannot tokenize `{param}`: {err}", param=param) from None
    if not ids:
        raise RequestError(f"`{param}` is empty after tokenization", param=param)
    return ids


def _check_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for p in prompts:
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad} in `prompt` is outside [0, {vocab_size})", param="prompt"
            )


def _sampling_params(
    body: CompletionBody | ChatBody, info: ModelInfo, chat: bool, prompt_len: int
) -> SamplingParams:
    room = None if info.context_length is None else info.context_length - prompt_len
    if room is not None and room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room in this model's context "
            f"of {info.context_length} tokens",
            param="messages" if chat else "prompt",
        )
    name = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
    max_tokens = getattr(body, name)
    if max_tokens is None:
        max_tokens = info.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = max_tokens if room is None else min(max_tokens, room)
    elif room is not None and max_tokens > room:
        raise RequestError(
            f"this model's context is {info.context_length} tokens; the prompt has {prompt_len} "
            f"and `{name}` asks for {max_tokens} more (at most {room})",
            param=name,
        )
    return SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        max_new_tokens=max_tokens,
        stop=tuple(body.stop),
        seed=body.seed,
        logprobs=False,
    )


# --- responses -------------------------------------------------------------------------


def response_head(req: GenerationRequest, model: str) -> dict:
    """The id, object, created and model of a response (and of its stream chunks)."""
    prefix, obj = ("chatcmpl", "chat.completion") if req.chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def response(
    req: GenerationRequest, model: str, texts: list[str], reasons: list[str], lengths: list[int],
    logprobs: Sequence[dict] | None = None,
) -> dict:
    """The `text_completion` or `chat.completion` object for N = prompts x n results
    (choice index = prompt index x n + sample index, as OpenAI numbers them); `logprobs`:
    each choice's log-probs object (`serve.logprobs`), or None."""
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(lengths)
    logprobs = logprobs if logprobs is not None else [None] * len(texts)
    return {
        **response_head(req, model),
        "choices": [_choice(req.chat, i, t, r, lp) for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(chat: bool, index: int, text: str, reason: str, logprobs: dict | None = None) -> dict:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


Piece = tuple[int, str, str | None] | tuple[int, str, str | None, dict | None]
"""A step of a streamed answer: (choice index, text to append, finish_reason or None[,
the log-probs object of the tokens it reports])."""


class ChunkWriter:
    """Turns the pieces of one streamed answer into `chat.completion.chunk` /
    `text_completion` chunks with the id, created and model of `head` (`response_head`);
    a chat choice's first chunk carries the assistant role."""

    def __init__(self, head: dict):
        self.head = {k: head[k] for k in ("id", "created", "model")}
        self.chat = head["object"] == "chat.completion"
        self.started: set[int] = set()

    def __call__(self, piece: Piece) -> dict:
        index, text, reason, logprobs = (*piece, None)[:4]
        if self.chat:
            delta = {"content": text} if index in self.started else {"role": "assistant", "content": text}
            part = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            part = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        self.started.add(index)
        return {
            **self.head,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "choices": [part],
        }


def stream_chunks(head: dict, pieces: Iterable[Piece]) -> Iterator[dict]:
    """The chunks of `pieces` (see `ChunkWriter`); `head` may be a whole response."""
    return map(ChunkWriter(head), pieces)
