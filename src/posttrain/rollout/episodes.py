"""Multi-turn episodes: the model and an environment take turns, every row in one batched loop.

Notation: N rows (B prompts x n samples), R rows still running, V vocab, W the widest
chunk of tokens fed to the model in one forward, T the longest trajectory.

An episode row is one growing token sequence:

    prompt | model turn 1 | env answer 1 | model turn 2 | env answer 2 | ... | model turn k

The loop (`EpisodePlay.run`), one iteration per sampled token:
  1. sample the next token of every running row from its logits (`sampling.Draws`: in batch
     mode Exp(1) noise drawn for all N rows from one CPU generator, so a row's sample does
     not depend on which rows are still running, nor on the engine; in row mode a draw of
     (seed, first_row + row, step) alone, so episodes played in slices are the batch's);
  2. a row's model turn ends on a stop token (EOS), on a stop string (the tool-call end,
     `SamplingParams.stop`), after `SamplingParams.max_new_tokens` tokens in the turn, or
     when its trajectory reaches `max_total_tokens`;
  3. the `TurnHandler` (the environment, `posttrain.envs`) answers every turn that ended in
     this iteration, all of them in one call (it runs them concurrently);
  4. a row finishes when the handler says done, after `max_turns` model turns, or when
     its trajectory (with the answer) would pass `max_total_tokens`; finished rows leave
     the batch. EOS ends a turn, not the episode: the environment decides (a turn without
     a tool call is a final answer; a chat model ends every turn, tool calls included,
     with its end-of-turn token);
  5. every running row feeds its chunk: the token just sampled, plus the environment's
     answer for rows whose turn ended. Mixed widths are left-padded inside the chunk, so
     the last column of every row is its newest real token and gives its next logits.

The `EpisodeModel` (one per engine) turns chunks into next-token logits: the native engine
extends each row's KV cache with the chunk only (a prefill of the appended tokens, never
the history again); the hf engine re-encodes the rows' whole histories after an
environment answer and decodes single tokens with transformers' cache in between. With
the same seed both give the same episodes (tests/rollout/test_episodes.py).

An engine that cannot hand out logits token by token (vLLM samples whole responses) runs
`run_turn_episodes` instead, one round per model turn: every running row is sent as one
request (prompt + trajectory, at most `turn_budget` new tokens), the engine stops each on a
stop token, a stop string or that budget, and steps 3-4 above follow for all rows at once.
The end of a turn (`turn_end`), the environment's answer and the limits (`_after_turn`) are
the same functions in both loops, so the two give the same episodes from the same samples.

Masks: `response_mask` is 1 on model tokens only (environment tokens are context, never
trained on), `sequence_mask` 1 on every real token of the trajectory (what the model
attends to). `lengths` and `num_tokens` count model tokens only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.data.collate import pad_id_of
from posttrain.rollout.base import SampledRows, SamplingParams, StopStrings, encode_prompts
from posttrain.rollout.sampling import Draws


@dataclass(frozen=True)
class MultiTurnLimits:
    """The episode limits (config keys `rollout.multi_turn.*`)."""

    max_turns: int = 4
    """Most model turns per episode; an episode still running after it is truncated."""
    max_total_tokens: int = 512
    """Most tokens of the whole trajectory after the prompt (model and environment tokens);
    an episode that would pass it is truncated. Each model turn is also cut at
    `SamplingParams.max_new_tokens`."""
    env_timeout_s: float = 60.0
    """Seconds each environment call may take: the construction and `reset` of an episode's
    environment together, and each `step`; a call past it ends its episode (`env/errors`)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1 or not self.env_timeout_s > 0:
            raise ValueError(f"multi-turn limits must be >= 1 (env_timeout_s > 0), got {self}")

    @classmethod
    def from_config(cls, multi_turn) -> MultiTurnLimits:
        """The limits of a `rollout.multi_turn` config section (`config.rl.MultiTurnConfig`)."""
        return cls(max_turns=multi_turn.max_turns, max_total_tokens=multi_turn.max_total_tokens,
                   env_timeout_s=multi_turn.env_timeout_s)


@dataclass
class Reply:
    """The environment's answer to one model turn."""

    tokens: list[int]
    """Tokens appended to the trajectory (the formatted observation); ignored when done."""
    done: bool
    """The episode is over (the model answered, or the environment ended it)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to report about the step (reward, tool calls, errors), kept per turn."""


class TurnHandler(Protocol):
    """Answers the model turns that ended in one loop iteration (`posttrain.envs` adapts
    an `Environment` to this)."""

    def respond(self, rows: list[int], texts: list[str]) -> list[Reply]:
        """rows: output row of each ended turn; texts: the turn decoded (special tokens
        skipped, stop token left out, stop string kept). One Reply per row, same order."""
        ...


class EpisodeModel(Protocol):
    """An engine's view of the model for the episode loop; rows are those still held,
    in the order of the last `start` / `keep`."""

    def start(self, prompt_ids: list[list[int]], n: int) -> torch.Tensor:
        """Encode B prompts and repeat each n times (rows grouped by prompt) -> logits (N, V)."""
        ...

    def feed(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append one non-empty token list per held row -> next-token logits (R, V)."""
        ...

    def keep(self, rows: torch.Tensor) -> None:
        """Hold only batch rows `rows` (long indices into the rows held now)."""
        ...


@dataclass
class Episodes(SampledRows):
    """One call's episodes, N = B·n rows grouped by prompt. Tensors on the CPU; padding holds
    `pad_token_id` in `response_ids` and 0 in every mask and in `logprobs`."""

    prompt_ids: list[list[int]]
    """N prompts, unpadded."""
    prompt_index: torch.Tensor
    """(N,) long: the prompt each row answers."""
    response_ids: torch.Tensor
    """(N, T) long: the whole trajectory after the prompt (model and environment tokens)."""
    response_mask: torch.Tensor
    """(N, T) long: 1 on model tokens, 0 on environment tokens and padding."""
    sequence_mask: torch.Tensor
    """(N, T) long: 1 on every trajectory token (model and environment), 0 on padding."""
    logprobs: torch.Tensor
    """(N, T) float32: log softmax(logits / T)[token] of model tokens (as `Completions`); 0
    on environment tokens and padding."""
    lengths: torch.Tensor
    """(N,) long: model tokens per row = response_mask.sum(-1)."""
    total_lengths: torch.Tensor
    """(N,) long: trajectory tokens per row = sequence_mask.sum(-1)."""
    turns: torch.Tensor
    """(N,) long: model turns per row."""
    truncated: torch.Tensor
    """(N,) bool: a limit ended the episode: `max_turns`, `max_total_tokens`, or its last
    model turn was cut by `max_new_tokens` or `max_total_tokens` (also when the environment
    then said done, as a single-turn response cut there is truncated)."""
    finish_reason: list[str]
    """N strings: "length" where `truncated`, else "stop" (the environment ended it after a
    turn that ended on a stop token or string)."""
    texts: list[str]
    """N strings: the trajectory decoded, special tokens skipped."""
    turn_texts: list[list[str]]
    """Per row, each model turn's text as the handler saw it."""
    infos: list[list[dict]]
    """Per row, the handler's `Reply.info` of each turn."""
    turn_bounds: list[list[tuple[int, int, int]]] = field(default_factory=list)
    """Per row, (start, model_end, end) of each turn in `response_ids` columns: the model's
    tokens are [start, model_end), the environment's answer to them [model_end, end) (empty
    when the episode ended there); turn k+1 starts where turn k ends."""
    resets: list[str | None] = field(default_factory=list)
    """Per row, the text the environment's `reset` added to the prompt (None for none);
    filled by `envs.play_episodes`."""
    versions: torch.Tensor | None = None
    """(N, T) long: the weights' version of each token (`EpisodePlay.run`'s `version` of the
    call that added it; 0 on padding and where no version was given)."""
    pad_token_id: int = 0
    meta: dict = field(default_factory=dict)



@dataclass
class _Row:
    """One episode's state in the loop."""

    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)  # 1 model token, 0 environment token
    logp: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)  # tokens of the current model turn
    turns: int = 0
    reason: str | None = None  # set when the row finishes
    turn_texts: list[str] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    bounds: list[tuple[int, int, int]] = field(default_factory=list)  # Episodes.turn_bounds
    versions: list[int] = field(default_factory=list)  # per token: the version of the call that added it


class EpisodePlay:
    """The token loop's episodes in play (module docstring), run in one call or in parts.

    `run(model, tokens)` samples up to `tokens` more tokens per running row (None: until every
    episode ends) and stops after a whole loop iteration: the tokens just sampled and the
    environment's answers are in the rows, not yet fed. A later `run` goes on with a model of
    its own (an engine's weights of now: partial rollouts, `trainers.rl_partial`): it encodes
    every running row's whole history (prompt + trajectory so far) afresh, and the draws go on
    where they stopped (one `Draws` for the whole play: batch mode's generator, row mode's
    (row, token index)), so with unchanged weights the parts play the one call's episodes (up
    to the rounding of a prefill against a KV-cache step). Each token records the `version` of
    the call that added it (`Episodes.versions`); the environments live in the `handler`."""

    def __init__(self, prompt_ids: list[list[int]], params: SamplingParams, limits: MultiTurnLimits,
                 handler: TurnHandler, tokenizer, pad_id: int):
        self.prompt_ids, self.params, self.limits, self.handler = prompt_ids, params, limits, handler
        self.tokenizer, self.pad_id, self.n = tokenizer, pad_id, params.n
        self.rows = [_Row() for _ in range(len(prompt_ids) * params.n)]
        self.draws = Draws(params)  # batch mode: one CPU generator, whatever the engine's device
        self.stop_ids = set(params.resolved_stop_token_ids(tokenizer))
        self.stops = StopStrings(tokenizer, params.stop)
        self.held = list(range(len(self.rows)))  # output row of each batch row
        self.steps = self.forwards = self.calls = 0
        self.seconds = 0.0

    @property
    def finished(self) -> bool:
        return not self.held

    def run(self, model: EpisodeModel, tokens: int | None = None, version: int = 0) -> bool:
        """Play on with `model` for up to `tokens` sampled tokens per running row (None: to the
        end), each recorded as `version`'s; returns whether every episode has ended."""
        if self.finished:
            return True
        start, rows = time.perf_counter(), self.rows
        if self.calls == 0:
            logits = model.start(self.prompt_ids, self.n)
        else:  # a fresh encoding of each running row's history: the weights may have changed
            logits = model.start([[*self.prompt_ids[r // self.n], *rows[r].ids] for r in self.held], 1)
        self.calls += 1
        end = None if tokens is None else self.steps + tokens
        while True:
            held = self.held
            tok, logp = self.draws.sample(logits, held, len(rows), self.steps)  # a row's draw ignores the others
            ended = {}  # output row -> why its model turn ended
            for r, t, lp in zip(held, tok.tolist(), logp.tolist()):
                row = rows[r]
                row.ids.append(t)
                row.model.append(1)
                row.logp.append(lp)
                row.turn.append(t)
                why = turn_end(row.turn, len(row.ids), self.stop_ids, self.stops.completes(row.turn),
                               self.params.max_new_tokens, self.limits.max_total_tokens)
                if why is not None:
                    ended[r] = why
            answers = _answer(rows, ended, self.handler, self.tokenizer, self.stop_ids)
            chunks, keep = [], []
            for i, (r, t) in enumerate(zip(held, tok.tolist())):
                extra = _after_turn(rows[r], ended.get(r), answers.get(r), self.limits)
                rows[r].versions += [version] * (len(rows[r].ids) - len(rows[r].versions))
                if rows[r].reason is None:
                    keep.append(i)
                    chunks.append([t, *extra])
            self.steps += 1
            if len(keep) < len(held):
                self.held = [held[i] for i in keep]
                model.keep(torch.tensor(keep, dtype=torch.long))
            if not self.held or self.steps == end:
                break
            logits = model.feed(chunks)
            self.forwards += 1
        self.seconds += time.perf_counter() - start
        return self.finished

    def episodes(self) -> Episodes:
        """The episodes played (each row as far as it got: call once `finished`)."""
        return _assemble(self.prompt_ids, self.rows, self.n, self.tokenizer, self.pad_id, {
            "decode_steps": self.steps, "forwards": self.forwards, "seconds": self.seconds, "calls": self.calls,
        })


class PlaysEpisodes:
    """`generate_episodes` of an engine that runs the token loop (native, hf): `start_episodes`,
    then the engine's `advance(play, tokens, version)` (`play.run` over an `EpisodeModel` of its
    weights now) to the end. Partial rollouts call the two themselves (`envs.EnvEpisodes`)."""

    tokenizer: object
    kind: str

    def start_episodes(self, prompts, params: SamplingParams, limits: MultiTurnLimits,
                       handler: TurnHandler) -> EpisodePlay:
        """`params.n` episodes of every prompt (strings or token ids), none of them begun."""
        return EpisodePlay(encode_prompts(self.tokenizer, prompts), params, limits, handler, self.tokenizer,
                           pad_id_of(self.tokenizer))

    def generate_episodes(self, prompts, params: SamplingParams, limits: MultiTurnLimits,
                          handler: TurnHandler) -> Episodes:
        """`params.n` multi-turn episodes of every prompt with `handler` answering each model turn."""
        play = self.start_episodes(prompts, params, limits, handler)
        self.advance(play)
        out = play.episodes()
        out.meta["engine"] = self.kind
        return out


def turn_end(
    turn: Sequence[int], trajectory_len: int, stop_ids, called: bool, max_new_tokens: int, max_total_tokens: int
) -> str | None:
    """Why a model turn ends with its newest token, or None if it goes on; first that applies:
    "eos" (the token is a stop token), "call" (`called`: it completed a stop string, the
    tool-call end), "total" (the trajectory, `trajectory_len` tokens after the prompt, reached
    `max_total_tokens`), "turn" (the turn has `max_new_tokens` tokens). `turn` is the turn's
    tokens so far, the newest last. The same rule for every engine: the token loop applies it
    per token, the turn loop to the last token of each turn an engine returns."""
    if turn[-1] in stop_ids:
        return "eos"
    if called:
        return "call"
    if trajectory_len >= max_total_tokens:
        return "total"
    if len(turn) >= max_new_tokens:
        return "turn"
    return None


def turn_budget(trajectory_len: int, max_new_tokens: int, max_total_tokens: int) -> int:
    """Most tokens the next model turn of a row may sample: the per-turn limit, or what is left
    of `max_total_tokens` after the `trajectory_len` tokens so far if that is less. A running
    row always has room for one (`_after_turn` ends a row whose answer would fill it)."""
    budget = min(max_new_tokens, max_total_tokens - trajectory_len)
    if budget < 1:
        raise ValueError(f"no room for a model turn: {trajectory_len} of {max_total_tokens} tokens used")
    return budget


@dataclass(frozen=True)
class TurnRequest:
    """One row's next model turn, as the turn loop asks an engine for it."""

    row: int
    """The output row (0 .. N-1, grouped by prompt)."""
    turn: int
    """Model turns the row has had (0 for its first)."""
    ids: list[int]
    """The whole context: prompt, then the trajectory so far (model and environment tokens)."""
    max_tokens: int
    """Most tokens to sample (`turn_budget`)."""


@dataclass(frozen=True)
class ModelTurn:
    """One model turn as an engine sampled it (vLLM: `vllm.model_turn`)."""

    token_ids: list[int]
    """The turn's tokens, the one that ended it (stop token, stop string's end) included."""
    logprobs: list[float]
    """log softmax(logits / T)[token] of each of them (base.py's definition)."""
    called: bool = False
    """The engine ended the turn on a stop string (the tool-call end)."""
    cut_short: bool = False
    """The engine ended it for want of room (vLLM: its max_model_len) before any rule of
    `turn_end` applied; the episode is then truncated."""


class TurnSampler(Protocol):
    """An engine that samples whole model turns (vLLM): the turn loop's counterpart of
    `EpisodeModel`."""

    def __call__(self, requests: list[TurnRequest]) -> list[ModelTurn]:
        """One ModelTurn per request, same order; each ends on a stop token, a stop string
        or after `max_tokens` tokens, whichever comes first."""
        ...


def sampled_turn_end(turn: ModelTurn, trajectory_len: int, stop_ids, max_new_tokens: int, max_total_tokens: int) -> str:
    """Why an engine's sampled turn ended (`turn_end` of its last token; "total" when the engine
    cut it short), the trajectory holding `trajectory_len` tokens with the turn. An engine that
    stopped where no rule applies broke the TurnSampler contract: ValueError."""
    why = turn_end(turn.token_ids, trajectory_len, stop_ids, turn.called, max_new_tokens, max_total_tokens)
    if why is None and turn.cut_short:
        why = "total"  # the engine has no room for more: nor would the next turn
    if why is None:
        raise ValueError(
            f"the engine ended a model turn after {len(turn.token_ids)} tokens with no stop token, "
            f"stop string or limit (max_new_tokens={max_new_tokens}, trajectory {trajectory_len} of "
            f"{max_total_tokens} tokens)"
        )
    return why


def run_turn_episodes(
    sample_turns: TurnSampler,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    limits: MultiTurnLimits,
    handler: TurnHandler,
    tokenizer,
    pad_id: int,
) -> Episodes:
    """The token loop's episodes for an engine that samples whole turns (vLLM): one round per model turn.

    Each round every running row is one `TurnRequest` (its prompt + trajectory, at most
    `turn_budget` new tokens); the turns that come back all ended (`sampled_turn_end`), so
    the handler answers all of them at once and rows finish by the rules of `_after_turn`.
    Same episodes, masks and log-probs as the token loop for the same samples; the samples
    themselves come from the engine's RNG (its seeds, not the token loop's noise)."""
    start = time.perf_counter()
    n, rows = params.n, [_Row() for _ in range(len(prompt_ids) * params.n)]
    stop_ids = set(params.resolved_stop_token_ids(tokenizer))
    live, rounds = list(range(len(rows))), 0
    while live:
        requests = [
            TurnRequest(r, rows[r].turns, [*prompt_ids[r // n], *rows[r].ids],
                        turn_budget(len(rows[r].ids), params.max_new_tokens, limits.max_total_tokens))
            for r in live
        ]
        turns = sample_turns(requests)
        if len(turns) != len(requests):
            raise ValueError(f"the engine sampled {len(turns)} turns, expected {len(requests)}")
        ended = {}
        for q, turn in zip(requests, turns):
            _check_turn(turn, q.max_tokens)
            row = rows[q.row]
            row.ids += turn.token_ids
            row.model += [1] * len(turn.token_ids)
            row.logp += turn.logprobs
            row.turn = list(turn.token_ids)
            ended[q.row] = sampled_turn_end(turn, len(row.ids), stop_ids, params.max_new_tokens,
                                            limits.max_total_tokens)
        answers = _answer(rows, ended, handler, tokenizer, stop_ids)
        for r in live:
            _after_turn(rows[r], ended[r], answers[r], limits)
        live = [r for r in live if rows[r].reason is None]
        rounds += 1
    return _assemble(prompt_ids, rows, n, tokenizer, pad_id, {
        "rounds": rounds, "seconds": time.perf_counter() - start,
    })


def _check_turn(turn: ModelTurn, max_tokens: int) -> None:
    if not 1 <= len(turn.token_ids) <= max_tokens or len(turn.logprobs) != len(turn.token_ids):
        raise ValueError(
            f"the engine returned a turn of {len(turn.token_ids)} tokens and {len(turn.logprobs)} "
            f"log-probs; expected 1 to {max_tokens} tokens, one log-prob each"
        )


def _answer(rows, ended: dict[int, str], handler: TurnHandler, tokenizer, stop_ids) -> dict[int, Reply]:
    """Ask the handler about every turn that ended, in one call; record the turn text."""
    if not ended:
        return {}
    texts = []
    for r in ended:
        turn = rows[r].turn[:-1] if rows[r].turn[-1] in stop_ids else rows[r].turn
        texts.append(tokenizer.decode(turn, skip_special_tokens=True))
        rows[r].turn_texts.append(texts[-1])
    replies = handler.respond(list(ended), texts)
    if len(replies) != len(texts):
        raise ValueError(f"the turn handler answered {len(replies)} turns, expected {len(texts)}")
    return dict(zip(ended, replies))


def _after_turn(row: _Row, why: str | None, reply: Reply | None, limits: MultiTurnLimits) -> list[int]:
    """Apply the end of a model turn to `row`: finish it (set `reason`) or return the
    environment tokens to append (also added to the row, unmasked)."""
    if why is None:
        return []
    start = row.bounds[-1][2] if row.bounds else 0
    row.turns += 1
    row.turn = []
    row.infos.append(dict(reply.info))
    row.bounds.append((start, len(row.ids), len(row.ids)))
    if reply.done:  # a last turn cut by a length limit is truncated, as a single-turn response is
        row.reason = "length" if why in ("total", "turn") else "stop"
    elif why == "total" or row.turns >= limits.max_turns:
        row.reason = "length"
    elif len(row.ids) + len(reply.tokens) >= limits.max_total_tokens:
        row.reason = "length"  # the answer would leave no room for another model token
    if row.reason is not None:
        return []
    row.ids += reply.tokens
    row.model += [0] * len(reply.tokens)
    row.logp += [0.0] * len(reply.tokens)
    row.bounds[-1] = (start, row.bounds[-1][1], len(row.ids))
    return list(reply.tokens)


def _assemble(prompt_ids, rows: Sequence[_Row], n: int, tokenizer, pad_id: int, meta: dict) -> Episodes:
    width = max((len(r.ids) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    seq = torch.zeros((len(rows), width), dtype=torch.long)
    logp = torch.zeros((len(rows), width), dtype=torch.float32)
    versions = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r.ids)
        ids[i, :k], mask[i, :k], seq[i, :k] = torch.tensor(r.ids), torch.tensor(r.model), 1
        logp[i, :k] = torch.tensor(r.logp)
        versions[i, : len(r.versions)] = torch.tensor(r.versions, dtype=torch.long)
    return Episodes(
        prompt_ids=[list(p) for p in prompt_ids for _ in range(n)],
        prompt_index=torch.arange(len(rows)) // n,
        response_ids=ids,
        response_mask=mask,
        sequence_mask=seq,
        logprobs=logp,
        lengths=mask.sum(-1),
        total_lengths=seq.sum(-1),
        turns=torch.tensor([r.turns for r in rows], dtype=torch.long),
        truncated=torch.tensor([r.reason == "length" for r in rows], dtype=torch.bool),
        finish_reason=[r.reason or "length" for r in rows],
        texts=[tokenizer.decode(r.ids, skip_special_tokens=True) for r in rows],
        turn_texts=[r.turn_texts for r in rows],
        infos=[r.infos for r in rows],
        turn_bounds=[r.bounds for r in rows],
        versions=versions,
        pad_token_id=pad_id,
        meta=meta,
    )
