"""The turn loop (`episodes.run_turn_episodes`, how the vllm engine plays episodes) and its
pure parts: why a turn ended, each turn's budget, the checks on what an engine returns.

The loop runs here over a real engine that samples whole turns: the native engine's
single-turn `generate`, one call per requested turn with the request's budget as
max_new_tokens (what vLLM's `LLM.generate` is asked per turn). Greedy, the turn loop must
give exactly the token loop's episodes (`EpisodePlay`, native `generate_episodes`).
"""

import dataclasses
from collections import Counter

import pytest
import torch

from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import (
    ModelTurn,
    MultiTurnLimits,
    TurnRequest,
    run_turn_episodes,
    sampled_turn_end,
    turn_budget,
    turn_end,
)

from .conftest import PROMPTS
from .test_episodes import CountingEnv

GREEDY = SamplingParams(n=2, temperature=0, max_new_tokens=6, stop_token_ids=())
LIMITS = MultiTurnLimits(max_turns=4, max_total_tokens=60)


class WholeTurns:
    """A TurnSampler over an engine's single-turn `generate` (one call per request); it
    keeps every (request, turn) it served."""

    def __init__(self, engine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.stop_ids = set(params.resolved_stop_token_ids(engine.tokenizer))
        self.served: list[tuple[TurnRequest, ModelTurn]] = []

    def __call__(self, requests):
        turns = []
        for q in requests:
            seed = None if self.params.seed is None else self.params.seed + 1000 * q.turn + q.row
            params = dataclasses.replace(self.params, n=1, max_new_tokens=q.max_tokens, seed=seed)
            out = self.engine.generate([q.ids], params)
            ids = out.response_ids[0, : int(out.lengths[0])].tolist()
            called = out.finish_reason[0] == "stop" and ids[-1] not in self.stop_ids
            turns.append(ModelTurn(ids, out.logprobs[0, : len(ids)].tolist(), called=called))
            self.served.append((q, turns[-1]))
        return turns


@pytest.fixture(scope="module")
def native(model, tok):
    return make_engine("native", model, tok)


def turn_loop(engine, tok, params=GREEDY, limits=LIMITS, **env):
    sampler, handler = WholeTurns(engine, params), CountingEnv(tok, **env)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    out = run_turn_episodes(sampler, prompt_ids, params, limits, handler, tok, 0)
    return out, sampler, handler


def token_loop(engine, tok, params=GREEDY, limits=LIMITS, **env):
    handler = CountingEnv(tok, **env)
    return engine.generate_episodes(PROMPTS, params, limits, handler), handler


def frequent_model_token(native, tok, printable=False) -> int:
    """The model token the greedy episodes sample most (a printable ASCII character if asked)."""
    out, _ = token_loop(native, tok)
    ids = out.response_ids[out.response_mask.bool()].tolist()
    ids = [t for t in ids if not printable or (c := tok.decode([t])).isascii() and c.isprintable() and c.strip()]
    return Counter(ids).most_common(1)[0][0]


def assert_same_episodes(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.sequence_mask, b.sequence_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert torch.equal(a.turns, b.turns) and torch.equal(a.truncated, b.truncated)
    assert a.finish_reason == b.finish_reason and a.turn_texts == b.turn_texts and a.infos == b.infos


@pytest.mark.parametrize("limits", [LIMITS, MultiTurnLimits(max_turns=9, max_total_tokens=15)])
def test_the_turn_loop_gives_the_token_loops_episodes(native, tok, limits):
    a, sampler, _ = turn_loop(native, tok, limits=limits)
    b, _ = token_loop(native, tok, limits=limits)
    assert_same_episodes(a, b)
    assert a.meta["rounds"] == int(a.turns.max())
    assert (a.total_lengths <= limits.max_total_tokens).all()
    # every request's budget: the turn limit, or what the trajectory has left if that is less
    for q, _ in sampler.served:
        assert q.max_tokens == min(6, limits.max_total_tokens - (len(q.ids) - len(a.prompt_ids[q.row])))
    assert min(q.max_tokens for q, _ in sampler.served) == (6 if limits is LIMITS else 4)


def test_a_stop_token_ends_the_turn_alike_in_both_loops(native, tok):
    stop = frequent_model_token(native, tok)
    params = dataclasses.replace(GREEDY, max_new_tokens=12, stop_token_ids=(stop,))
    a, _, _ = turn_loop(native, tok, params)
    b, _ = token_loop(native, tok, params)
    assert_same_episodes(a, b)
    ends = [a.response_ids[r, p].item() for r in range(len(a)) for p in range(int(a.total_lengths[r]) - 1)
            if a.response_mask[r, p] == 1 and a.response_mask[r, p + 1] == 0]
    assert stop in ends  # some turn ended on it, and the environment answered


def test_a_stop_string_ends_the_turn_alike_in_both_loops(native, tok):
    char = tok.decode([frequent_model_token(native, tok, printable=True)])
    params = dataclasses.replace(GREEDY, max_new_tokens=12, stop=(char,))
    a, _, env = turn_loop(native, tok, params)
    b, _ = token_loop(native, tok, params)
    assert_same_episodes(a, b)
    assert any(text.endswith(char) for _, text in env.seen)  # kept in the turn's text


def test_sampled_turn_loop_masks_environment_tokens_and_keeps_the_limits(native, tok):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)
    limits, done_after = MultiTurnLimits(max_turns=3, max_total_tokens=25), (1, 2, 9)
    out, sampler, _ = turn_loop(native, tok, params, limits, done_after=done_after)
    assert (out.total_lengths <= 25).all()
    for row in range(len(out)):
        ids = out.response_ids[row, : int(out.total_lengths[row])].tolist()
        expected, k = [], 0
        for q, turn in ((q, t) for q, t in sampler.served if q.row == row):
            start = len(q.ids) - len(out.prompt_ids[row])  # the trajectory this turn came after
            if k:  # the environment's answer to the turn before
                obs = tok(f"[{k}:{len(out.turn_texts[row][k - 1])}]", add_special_tokens=False)["input_ids"]
                assert ids[len(expected) : start] == obs
            expected += [0] * (start - len(expected)) + [1] * len(turn.token_ids)
            assert ids[start : len(expected)] == turn.token_ids and len(turn.token_ids) <= 6
            k += 1
        assert out.response_mask[row, : len(ids)].tolist() == expected  # it ends with the last turn
        assert out.logprobs[row][out.response_mask[row] == 0].abs().sum() == 0
        assert k == int(out.turns[row]) <= min(3, done_after[row % 3])
    # No stop token or string: every last turn was cut by a limit (turn or total), so every
    # episode is truncated, also those the environment ended.
    assert out.truncated.all()
    again, _, _ = turn_loop(native, tok, params, limits, done_after=done_after)
    assert torch.equal(again.response_ids, out.response_ids)  # same seeds, same episodes


def test_turn_end_applies_the_first_rule_that_holds():
    eos = 2
    assert turn_end([5, eos], 10, {eos}, called=True, max_new_tokens=2, max_total_tokens=10) == "eos"
    assert turn_end([5, 6], 10, {eos}, called=True, max_new_tokens=2, max_total_tokens=10) == "call"
    assert turn_end([5, 6], 10, {eos}, called=False, max_new_tokens=2, max_total_tokens=10) == "total"
    assert turn_end([5, 6], 9, {eos}, called=False, max_new_tokens=2, max_total_tokens=10) == "turn"
    assert turn_end([5], 9, {eos}, called=False, max_new_tokens=2, max_total_tokens=10) is None


def test_a_turns_budget_is_the_turn_limit_or_what_the_trajectory_has_left():
    assert turn_budget(0, max_new_tokens=6, max_total_tokens=60) == 6
    assert turn_budget(56, max_new_tokens=6, max_total_tokens=60) == 4
    assert turn_budget(59, max_new_tokens=6, max_total_tokens=60) == 1
    with pytest.raises(ValueError, match="no room"):
        turn_budget(60, max_new_tokens=6, max_total_tokens=60)


def test_an_engines_turn_ends_by_the_same_rules_or_is_refused():
    def end(ids, traj, **kw):
        return sampled_turn_end(ModelTurn(ids, [0.0] * len(ids), **kw), traj, {2}, 4, 20)

    assert end([7, 2], 5) == "eos"
    assert end([7, 8], 5, called=True) == "call"
    assert end([7, 8, 9, 10], 6) == "turn"
    assert end([7, 8], 20) == "total"
    assert end([7, 8], 9, cut_short=True) == "total"  # vLLM's max_model_len: no room for more
    with pytest.raises(ValueError, match="no stop token, stop string or limit"):
        end([7, 8], 9)


@pytest.mark.parametrize("turn", [ModelTurn([], []), ModelTurn([5] * 7, [0.0] * 7), ModelTurn([5, 6], [0.0])])
def test_a_turn_past_its_budget_empty_or_without_a_logprob_per_token_is_refused(tok, turn):
    with pytest.raises(ValueError, match="expected 1 to 6 tokens"):
        run_turn_episodes(lambda requests: [turn for _ in requests], [[1, 5]], GREEDY, LIMITS, CountingEnv(tok), tok, 0)
