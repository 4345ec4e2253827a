"""What a vllm engine sends to vLLM and reads back, shared by the colocated engine
(`rollout/vllm.py`) and server mode (`rollout/vllm_serve.py` on the server,
`rollout/vllm_server.py` in the trainer): plain values in, plain values out, no vLLM import.

Notation: N rows (requests), T_r the tokens row r sampled.

- A request: `request_sampling` (the call's fields, JSON-able: what server mode sends) and
  `sampling_kwargs` (one row's `vllm.SamplingParams` arguments: those fields, its budget and
  `request_seed`).
- A row: `row_result` (a vLLM `CompletionOutput` as a JSON-able dict: token_ids, logprobs of
  the sampled tokens, finish_reason, stop_reason), then `completions_from_rows` (a call) or
  `model_turn` (an episode's turn).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.config.rollout import check_vllm_temperature
from posttrain.rollout.base import Completions, SamplingParams, build_completions
from posttrain.rollout.episodes import ModelTurn
from posttrain.rollout.sampling import row_uniforms


def request_seed(seed: int | None, row: int, turn: int = 0, rows: int = 0, mode: str = "batch") -> int | None:
    """The seed of one vLLM request. mode "batch": seed + row for a single-turn call; for turn
    k of an episode over `rows` rows, seed + row + k·rows, so that no two requests of a call
    share a random stream (a row's turns reusing one would draw the same noise). mode "row"
    (`SamplingParams.seed_mode`; `row` is then the row's index in the whole batch): a 53-bit
    hash of (seed, row, turn), which needs no row count, so a batch sampled in slices draws
    the whole batch's streams. None = vLLM's RNG."""
    if seed is None:
        return None
    if mode == "batch":
        return seed + row + turn * rows
    return int(row_uniforms(seed, torch.tensor([row]), turn)[0] * 2**53)


RESUME_REFUSAL = (
    "the vllm engine cannot resume a generation (trainer.async_training.partial_rollout): vLLM seeds each "
    "request's random stream at the request's first token and numbers the rows of a call itself, so a "
    "resumed segment would redraw the first segment's randomness instead of continuing the row's; set "
    "rollout.engine=native or hf, or trainer.async_training.partial_rollout=false")
"""Why the vllm engines refuse `SamplingParams.first_position` / `row_index`."""


def check_sampling(params: SamplingParams) -> None:
    """Refuse a temperature vLLM would change (ValueError: it rejects T > 2 and raises 0 < T <
    0.01 to 0.01, so its log-probs would not be those of softmax(logits / T)) and a resumed
    generation (`RESUME_REFUSAL`); warn that with a
    top_k/top_p/min_p filter on, vLLM's log-probs are renormalised over the kept tokens."""
    problem = check_vllm_temperature(params.temperature)
    if problem:
        raise ValueError(problem)
    if params.first_position or params.row_index is not None:
        raise ValueError(RESUME_REFUSAL)
    if params.logprobs and not params.greedy and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0):
        warnings.warn("vllm engine: with top_k/top_p/min_p on, vLLM's logprobs are renormalised over the kept "
                      "tokens and differ from log softmax(logits / T); recompute old_logp with the actor's "
                      "forward.", stacklevel=3)


def request_sampling(params: SamplingParams, stop_ids: Sequence[int]) -> dict[str, Any]:
    """The sampling fields every row of a call shares, JSON-able (server mode's /generate/ body)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p, "stop": list(params.stop), "stop_token_ids": list(stop_ids),
            "include_stop_str_in_output": params.include_stop_str_in_output, "logprobs": params.logprobs}


def sampling_kwargs(sampling: Mapping[str, Any], max_tokens: int, seed: int | None) -> dict[str, Any]:
    """vLLM SamplingParams arguments of one row: the call's `request_sampling` fields, the row's
    budget and seed. vLLM's implicit eos is off (`ignore_eos`): stop_token_ids say what stops a
    row, as in the other engines (also `()`: never stop)."""
    return {
        "n": 1, "temperature": float(sampling["temperature"]), "top_p": float(sampling.get("top_p", 1.0)),
        "top_k": int(sampling.get("top_k", 0)), "min_p": float(sampling.get("min_p", 0.0)),
        "max_tokens": int(max_tokens), "stop": list(sampling.get("stop") or []) or None,
        "stop_token_ids": [int(t) for t in sampling.get("stop_token_ids") or []], "ignore_eos": True,
        "include_stop_str_in_output": bool(sampling.get("include_stop_str_in_output", False)),
        "seed": seed, "logprobs": 0 if sampling.get("logprobs", True) else None,
    }


def sampled_logprobs(token_ids: Sequence[int], step_logprobs) -> list[float]:
    """The sampled tokens' log-probs out of a vLLM CompletionOutput's `logprobs`: one
    {token id: Logprob} per step (the sampled token is always in it, whatever the number of
    top log-probs asked for), in `token_ids` order."""
    if len(step_logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(step_logprobs)} log-prob steps for {len(token_ids)} tokens")
    return [float(step[tok].logprob) for tok, step in zip(token_ids, step_logprobs)]


def row_result(completion) -> dict[str, Any]:
    """One row out of a vLLM CompletionOutput: token_ids, logprobs (of the sampled tokens, None
    when not asked for), finish_reason ("stop" | "length"), stop_reason (the stop string or
    token id that ended it, else None)."""
    ids = [int(t) for t in completion.token_ids]
    logprobs = None if completion.logprobs is None else sampled_logprobs(ids, completion.logprobs)
    stop = completion.stop_reason
    return {"token_ids": ids, "logprobs": logprobs, "finish_reason": completion.finish_reason,
            "stop_reason": stop if isinstance(stop, (int, str)) or stop is None else str(stop)}


def model_turn(row: Mapping[str, Any]) -> ModelTurn:
    """An episode's model turn out of a `row_result`. A "length" finish is vLLM's max_tokens,
    which is the turn's budget, or its max_model_len: `cut_short` lets the turn loop treat the
    second as a truncation; a stop string ends a tool call (`called`)."""
    if row["logprobs"] is None:
        raise ValueError("vLLM returned no log-probs: episodes ask for them (SamplingParams.logprobs=0)")
    return ModelTurn(token_ids=list(row["token_ids"]), logprobs=list(row["logprobs"]),
                     called=isinstance(row["stop_reason"], str), cut_short=row["finish_reason"] == "length")


def completions_from_rows(rows: Sequence[Mapping[str, Any]], prompt_ids: list[list[int]], params: SamplingParams,
                          tokenizer, pad_id: int, meta: dict) -> Completions:
    """A call's Completions from its N `row_result`s: response_ids (N, T) padded with `pad_id`
    to the longest row, logprobs (N, T) (0 past a row's end, and everywhere when not asked for),
    lengths (N,), stopped (N,) = finish_reason "stop"."""
    width = max((len(r["token_ids"]) for r in rows), default=0)
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    stopped = torch.zeros(len(rows), dtype=torch.bool)
    for r, row in enumerate(rows):
        ids = row["token_ids"]
        response_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths[r], stopped[r] = len(ids), row["finish_reason"] == "stop"
        if params.logprobs and row["logprobs"] is not None:
            logprobs[r, : len(ids)] = torch.tensor(row["logprobs"], dtype=torch.float32)
    return build_completions(prompt_ids=prompt_ids, response_ids=response_ids, lengths=lengths, stopped=stopped,
                             logprobs=logprobs, params=params, tokenizer=tokenizer, pad_id=pad_id, meta=meta)
