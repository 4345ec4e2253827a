"""seed_mode="row": a row's draws depend on (seed, its index in the batch, its position) only,
so a batch generated in slices (each told the index of its first row) gives the tokens of the
whole batch: native and hf, single-turn and episodes (what Ray's split rollout relies on). And
the row sampler draws from the right distribution."""

import dataclasses

import pytest
import torch

from posttrain.envs import GuessNumber
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import MultiTurnLimits
from posttrain.rollout.sampling import inverse_cdf, row_uniforms, sample_next
from posttrain.rollout.vllm_rows import request_seed
from posttrain.trainers.rl_partial import PartialRollout
from posttrain.workers import RLBatch, Rollout

from .conftest import PROMPTS
from .test_episodes import CountingEnv

ROW = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5, seed_mode="row", stop_token_ids=(2,))
SLICES = ([0, 4], [0, 2, 4], [0, 1, 3, 4])
"""Prompt boundaries: the whole batch, then 2 and 3 slices."""


def sliced(generate, params, bounds):
    """Rows of each slice [a, b) of PROMPTS generated alone, first_row a·n, in order."""
    return [generate(PROMPTS[a:b], dataclasses.replace(params, first_row=a * params.n))
            for a, b in zip(bounds, bounds[1:])]


def rows_of(outs):
    """Per row: (response tokens, logprobs) over its length."""
    return [(o.response_ids[r, : int(o.lengths[r])].tolist(), o.logprobs[r, : int(o.lengths[r])])
            for o in outs for r in range(len(o))]


def assert_same_rows(a, b, atol=1e-5):
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


def test_row_uniforms_depend_on_seed_row_and_position_only():
    rows = torch.arange(1000)
    u = row_uniforms(7, rows, 3)
    assert u.dtype == torch.float64 and 0 <= float(u.min()) and float(u.max()) < 1
    assert torch.equal(row_uniforms(7, rows[500:], 3), u[500:])  # a slice draws the batch's values
    assert torch.equal(row_uniforms(7 + 2**64, rows, 3), u)  # the seed is taken mod 2^64
    assert not torch.isin(row_uniforms(8, rows, 3), u).any() and not torch.isin(row_uniforms(7, rows, 4), u).any()
    assert len(set(u.tolist())) == len(u) and abs(float(u.mean()) - 0.5) < 0.03


def test_the_row_sampler_draws_the_filtered_softmax():
    """Pearson's chi-square of 40 000 draws against softmax(z / T) after top-k (df = 3; 99.9%
    quantile 16.27); the token top-k drops is never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).expand(40_000, -1)
    params = SamplingParams(temperature=0.8, top_k=4)
    tokens = torch.cat([sample_next(logits[:20_000], params, uniform=row_uniforms(11, torch.arange(20_000), t))[0]
                        for t in range(2)])
    probs = torch.softmax(logits[0, :4].double() / 0.8, -1)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[4] == 0
    chi2 = float(((counts[:4] - len(tokens) * probs) ** 2 / (len(tokens) * probs)).sum())
    assert chi2 < 16.27, (chi2, counts.tolist(), (len(tokens) * probs).tolist())


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]])
    for u in (0.0, 0.4999, 0.5, 1 - 2**-53):
        picked = inverse_cdf(probs, torch.full((2,), u, dtype=torch.float64)).tolist()
        assert picked[0] in (1, 2) and picked[1] == 2


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_batch_generated_in_slices_is_the_whole_batch(engine, model, hf_model, tok):
    e = make_engine("native", model, tok) if engine == "native" else make_engine("hf", hf_model, tok)
    whole = rows_of(sliced(e.generate, ROW, SLICES[0]))
    assert len({tuple(t) for t, _ in whole}) > 4  # rows differ
    for bounds in SLICES[1:]:
        assert_same_rows(rows_of(sliced(e.generate, ROW, bounds)), whole)
    batch_mode = rows_of([e.generate(PROMPTS, dataclasses.replace(ROW, seed_mode="batch"))])
    assert [t for t, _ in batch_mode] != [t for t, _ in whole]  # the default's stream is another


def test_native_and_hf_sample_the_same_rows_and_chunks_change_nothing(model, hf_model, tok):
    native = rows_of([make_engine("native", model, tok).generate(PROMPTS, ROW)])
    assert_same_rows(rows_of([make_engine("hf", hf_model, tok).generate(PROMPTS, ROW)]), native, atol=1e-4)
    chunked = make_engine("native", model, tok, max_batch_size=2, compact_fraction=None)
    assert_same_rows(rows_of([chunked.generate(PROMPTS, ROW)]), native)


@pytest.mark.parametrize("engine", ["native", "native in chunks", "hf"])
def test_a_generation_resumed_in_segments_is_the_unsegmented_one(engine, model, hf_model, tok):
    """Partial rollouts (`trainers.rl_partial`): segments of 3 tokens, each generated in two
    slices as Ray's split rollout does (resumed rows numbered by `row_index`, drawn at their
    positions `first_position` on), sample the tokens and log-probs of one 8-token call."""
    e = {"native": lambda: make_engine("native", model, tok), "hf": lambda: make_engine("hf", hf_model, tok),
         "native in chunks": lambda: make_engine("native", model, tok, max_batch_size=3)}[engine]()
    params = dataclasses.replace(ROW, stop_token_ids=tuple(range(2, 40)))  # some rows stop early
    rollout = Rollout(e, params)
    rows = [{"ids": tok(p)["input_ids"], "prompt": p, "columns": {}} for p in PROMPTS]
    prompts = RLBatch.from_prompts(rows, 0).replace(uid=torch.arange(4))

    def split(batch, seed, params):
        half = len(batch) // 2
        return RLBatch.concat([rollout.generate(batch.select(torch.arange(a, b)), seed, params, first=a)
                               for a, b in ((0, half), (half, len(batch)))])

    segments = PartialRollout(split, params, 3, lambda step: 5, tok, 0)
    part = segments.start(prompts, 1, version=0)
    while not part.finished:
        part = segments.resume(part, version=1)
    out, whole = segments.complete(part), rollout.generate(prompts, 5)
    assert bool((whole.lengths < 8).any()) and bool((whole.lengths > 3).any())
    assert torch.equal(out.response_ids, whole.response_ids) and torch.equal(out.lengths, whole.lengths)
    assert torch.equal(out.truncated, whole.truncated) and out.completions == whole.completions
    torch.testing.assert_close(out.rollout_logp, whole.rollout_logp, atol=1e-5, rtol=0)
    gen = whole.response_mask.bool()
    assert out.versions[:, :3][gen[:, :3]].unique().tolist() == [0]
    assert out.versions[:, 3:][gen[:, 3:]].unique().tolist() == [1]


def trajectories(outs):
    """Per episode row: (trajectory tokens, its response mask, logprobs)."""
    return [(o.response_ids[r, : int(o.total_lengths[r])].tolist(), o.response_mask[r, : int(o.total_lengths[r])].tolist(),
             o.logprobs[r, : int(o.total_lengths[r])]) for o in outs for r in range(len(o))]


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_episodes_played_in_slices_are_the_whole_batch_s(engine, model, hf_model, tok):
    e = make_engine("native", model, tok) if engine == "native" else make_engine("hf", hf_model, tok)
    params = dataclasses.replace(ROW, max_new_tokens=5, stop_token_ids=())
    limits = MultiTurnLimits(max_turns=3, max_total_tokens=40)

    def play(prompts, p):
        return e.generate_episodes(prompts, p, limits, CountingEnv(tok, done_after=(3,)))

    whole = sliced(play, params, SLICES[0])
    assert int(whole[0].turns.max()) == 3 and int((whole[0].sequence_mask > whole[0].response_mask).sum()) > 0
    expected = trajectories(whole)
    for bounds in SLICES[1:]:
        parts = sliced(play, params, bounds)
        got = trajectories(parts)
        assert [(ids, mask) for ids, mask, _ in got] == [(ids, mask) for ids, mask, _ in expected]
        for (_, _, x), (_, _, y) in zip(got, expected):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        assert [x for p in parts for x in p.texts] == whole[0].texts


def test_a_rollout_of_guess_number_episodes_in_slices_is_the_whole_batch_s(model, tok):
    """Through the rollout role (`Rollout.generate(..., first=k)`), a real environment."""
    rows = [{"ids": tok("Guess.")["input_ids"], "prompt": "Guess.", "columns": {"secret": s, "low": 1, "high": 3}}
            for s in (1, 2, 3, 2, 1)]
    params = dataclasses.replace(ROW, max_new_tokens=6, stop_token_ids=())
    rollout = Rollout(make_engine("native", model, tok), params, GuessNumber, MultiTurnLimits(3, 48))
    whole = rollout.generate(RLBatch.from_prompts(rows, 0), 9)
    parts = [rollout.generate(RLBatch.from_prompts(rows[a:b], 0), 9, first=a) for a, b in ((0, 2), (2, 5))]
    joined = RLBatch.concat(parts)
    assert joined.completions == whole.completions and len(set(whole.completions)) > 3
    assert torch.equal(joined.lengths, whole.lengths) and torch.equal(joined.total_lengths, whole.total_lengths)
    assert joined.columns["env_reward"] == whole.columns["env_reward"]
    with pytest.raises(ValueError, match="first_row"):  # slices need the row mode
        Rollout(make_engine("native", model, tok), dataclasses.replace(params, seed_mode="batch")).generate(
            RLBatch.from_prompts(rows[2:], 0), 9, first=2)


def test_vllm_row_mode_seeds_each_request_by_its_row_in_the_batch():
    batch = [request_seed(4, r, t, 6) for t in range(3) for r in range(6)]
    assert batch[:6] == [4, 5, 6, 7, 8, 9] and len(set(batch)) == 18  # the default, unchanged
    row = [request_seed(4, r, t, mode="row") for t in range(3) for r in range(6)]
    assert len(set(row)) == 18 and all(0 <= s < 2**53 for s in row)
    assert request_seed(4, 5, 2, 99, mode="row") == row[2 * 6 + 5]  # whatever the call's row count
    assert request_seed(None, 3, mode="row") is None


def test_sampling_params_check_the_row_fields():
    with pytest.raises(ValueError, match="seed_mode"):
        SamplingParams(seed_mode="rows")
    with pytest.raises(ValueError, match="first_row"):
        SamplingParams(first_row=4)  # slices draw by their rows only in the row mode
    assert SamplingParams(seed_mode="row", first_row=4).first_row == 4
