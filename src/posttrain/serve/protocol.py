"""The OpenAI request and response shapes: validate a JSON body into a `GenerationRequest`,
build `text_completion` / `chat.completion` objects and their stream chunks.

Every problem with a request raises `RequestError`, whose `body()` is OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`; the message names the field.

Parameters (both endpoints; defaults as in OpenAI's API where it has one):
  max_tokens (chat also max_completion_tokens): int >= 1, default 16 for completions and
    the server's `default_max_tokens` for chat; prompt + max_tokens must fit the model's
    context (config.json `max_position_embeddings`).
  temperature: >= 0, default 1 (0 = greedy); top_p in (0, 1], default 1; top_k (vLLM's
    extension): -1 or 0 = off; min_p in [0, 1]; n: 1 ..  MAX_N; stop: a string or a list of
    up to MAX_STOP non-empty strings; seed: int or null; stream: bool.
Accepted and ignored: `user`, `stream_options`, `response_format` of type "text", and any
field not listed. Refused (400) when set to something other than their no-op default,
because this server would silently not do them: echo, suffix, logprobs, top_logprobs,
best_of > 1, logit_bias, presence_penalty, frequency_penalty, tools, functions.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.rollout import SamplingParams

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
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
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
        self.message, self.status, self.param, self.type, self.code = (
            message,
            status,
            param,
            type,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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


@dataclass
class GenerationRequest:
    """A validated request: token-id prompts and how to sample them."""

    chat: bool
    """/v1/chat/completions (True) or /v1/completions."""
    prompts: list[list[int]]
    """Token ids of each prompt (chat: the one templated conversation)."""
    params: SamplingParams
    stream: bool = False

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


def parse_request(body: Any, info: ModelInfo, chat: bool, encode: Callable) -> GenerationRequest:
    """Validate a /v1/completions (chat False) or /v1/chat/completions body.

    encode(prompt) -> token ids, for a string or a list of chat messages (the caller
    serialises tokenizer access).
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != info.name:
        raise RequestError(
            f"the model `{model}` does not exist; this server serves `{info.name}`",
            404,
            "model",
            "not_found_error",
            "model_not_found",
        )
    for name, is_default in _UNSUPPORTED.items():
        if name in body and not is_default(body[name]):
            raise RequestError(f"`{name}` is not supported by this server", param=name)
    if chat:
        prompts = [_encode(encode, _messages(body), "messages")]
    else:
        prompts = [
            _encode(encode, p, "prompt") if isinstance(p, str) else p for p in _prompts(body)
        ]
        _check_ids(prompts, info.vocab_size)
    params = _sampling_params(body, info, chat, max(len(p) for p in prompts))
    if len(prompts) * params.n > MAX_ROWS_PER_REQUEST:
        raise RequestError(
            f"{len(prompts)} prompts x n={params.n} completions is more than the "
            f"{MAX_ROWS_PER_REQUEST} one request may ask for",
            param="n",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("`stream` must be a boolean", param="stream")
    return GenerationRequest(chat, prompts, params, stream)


# --- fields ----------------------------------------------------------------------------


def _prompts(body: Mapping) -> list:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("`prompt` is required", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return prompt
    raise RequestError(
        "`prompt` must be a string, a non-empty list of strings, a list of token ids, or a "
        "list of non-empty token-id lists",
        param="prompt",
    )


def _messages(body: Mapping) -> list[dict]:
    """`messages` as [{"role", "content": str}]; content parts of type text are joined."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("`messages` is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "`messages` must be a non-empty list of {role, content} objects", param="messages"
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"`{where}` must be an object with a string `role`", param=where)
        content = m.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, Mapping)
                and p.get("type") == "text"
                and isinstance(p.get("text"), str)
                for p in content
            ):
                raise RequestError(
                    f'`{where}.content` parts must be {{"type": "text", "text": str}}', param=where
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(
                f"`{where}.content` must be a string or a list of text parts", param=where
            )
        out.append({"role": m["role"], "content": content})
    return out


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


def _sampling_params(body: Mapping, info: ModelInfo, chat: bool, prompt_len: int) -> SamplingParams:
    room = None if info.context_length is None else info.context_length - prompt_len
    if room is not None and room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens, which leaves no room in this model's context "
            f"of {info.context_length} tokens",
            param="messages" if chat else "prompt",
        )
    name = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    max_tokens = _int(body, name, None, low=1)
    if max_tokens is None:
        max_tokens = info.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = max_tokens if room is None else min(max_tokens, room)
    elif room is not None and max_tokens > room:
        raise RequestError(
            f"this model's context is {info.context_length} tokens; the prompt has {prompt_len} "
            f"and `{name}` asks for {max_tokens} more (at most {room})",
            param=name,
        )
    top_k = _int(body, "top_k", 0, low=-1)
    return SamplingParams(
        n=_int(body, "n", 1, low=1, high=MAX_N),
        temperature=_number(body, "temperature", 1.0, low=0.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, open_low=True),
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
        max_new_tokens=max_tokens,
        stop=_stop(body),
        seed=_int(body, "seed", None),
        logprobs=False,
    )


def _stop(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("`stop` must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"`stop` has {len(stops)} strings; at most {MAX_STOP}", param="stop")
    return tuple(stops)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(
    body: Mapping, name: str, default: int | None, low: int | None = None, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"`{name}` must be an integer, got {_kind(value)}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"`{name}` must be {bounds}, got {value}", param=name)
    return value


def _number(
    body: Mapping,
    name: str,
    default: float,
    low: float,
    high: float | None = None,
    open_low: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"`{name}` must be a finite number, got {_kind(value)}", param=name)
    too_low = value <= low if open_low else value < low
    if too_low or (high is not None and value > high):
        lo = f"({low}" if open_low else f"[{low}"
        bounds = f">= {low}" if high is None else f"in {lo}, {high}]"
        raise RequestError(f"`{name}` must be {bounds}, got {value}", param=name)
    return float(value)


def _kind(value: Any) -> str:
    return (
        "null"
        if value is None
        else {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}.get(
            type(value), repr(value)
        )
    )


# --- responses -------------------------------------------------------------------------


def response(
    req: GenerationRequest, model: str, texts: list[str], reasons: list[str], lengths: list[int]
) -> dict:
    """The `text_completion` or `chat.completion` object for N = prompts x n results
    (choice index = prompt index x n + sample index, as OpenAI numbers them)."""
    prefix, obj = ("chatcmpl", "chat.completion") if req.chat else ("cmpl", "text_completion")
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(lengths)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(req.chat, i, t, r) for i, (t, r) in enumerate(zip(texts, reasons))],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(chat: bool, index: int, text: str, reason: str) -> dict:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


def stream_chunks(full: dict) -> Iterator[dict]:
    """The stream of a finished response: one chunk per choice carrying its whole text and
    finish_reason (generation is batched, so there are no partial texts to send earlier)."""
    chat = full["object"] == "chat.completion"
    head = {k: full[k] for k in ("id", "created", "model")}
    for choice in full["choices"]:
        if chat:
            delta = {"role": "assistant", "content": choice["message"]["content"]}
            part = {
                "index": choice["index"],
                "delta": delta,
                "logprobs": None,
                "finish_reason": choice["finish_reason"],
            }
        else:
            part = choice
        yield {
            **head,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [part],
        }
