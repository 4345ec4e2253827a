"""Episodes played in parts (`rollout.episodes.EpisodePlay`, the engines' `advance`): the token
loop stops after a number of sampled tokens and goes on later, possibly with other weights
(partial rollouts of multi-turn episodes, `trainers.rl_partial.PartialEpisodes`).

The environment is test_episodes' `CountingEnv` (answers `[k:LEN]`, rows end at different turns).
"""

import copy

import pytest
import torch

from posttrain.rollout import SamplingParams, make_engine

from .conftest import PROMPTS, randomized
from .test_episodes import LIMITS, CountingEnv, teacher_forced_logp

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)


def in_parts(engine, tok, tokens, params=PARAMS, engines=None):
    """The episodes of PROMPTS played `tokens` sampled tokens at a time; call k with
    `engines[k]` (default: `engine` every time) and version k. Returns (episodes, calls)."""
    play = engine.start_episodes(PROMPTS, params, LIMITS, CountingEnv(tok))
    calls = 0
    while not (engines[min(calls, len(engines) - 1)] if engines else engine).advance(play, tokens, calls):
        calls += 1
    return play.episodes(), calls + 1


def whole(engine, tok, params=PARAMS):
    return engine.generate_episodes(PROMPTS, params, LIMITS, CountingEnv(tok))


@pytest.mark.parametrize("seed_mode", ["row", "batch"])
@pytest.mark.parametrize("kind", ["native", "hf"])
def test_episodes_in_parts_without_a_weight_change_are_the_one_call_s_episodes(model, hf_model, tok, kind, seed_mode):
    """Parts of 2 tokens: the same trajectories, turns, environment answers and infos as one
    call, and each token's log-prob to float32 rounding (1e-5 at |log p| up to ~10: a part's prefill against a KV-cache
    step); the draws go on where they stopped in both seed modes. Parts may end mid-turn and
    right after an environment answer (the next one prefills it)."""
    engine = make_engine(kind, model if kind == "native" else hf_model, tok)
    params = SamplingParams(**{**PARAMS.__dict__, "seed_mode": seed_mode})
    one = whole(engine, tok, params)
    parts, calls = in_parts(engine, tok, 2, params)
    assert calls > 3 and int(one.turns.max()) >= 3  # many parts, multi-turn episodes
    assert torch.equal(parts.response_ids, one.response_ids)
    assert torch.equal(parts.response_mask, one.response_mask) and torch.equal(parts.sequence_mask, one.sequence_mask)
    assert parts.turn_bounds == one.turn_bounds and parts.infos == one.infos and parts.texts == one.texts
    assert parts.finish_reason == one.finish_reason and torch.equal(parts.turns, one.turns)
    torch.testing.assert_close(parts.logprobs, one.logprobs, atol=1e-5, rtol=0)
    # each model token's version is the call that sampled it: every call samples 2 per running row
    for row in range(len(parts)):
        model_cols = parts.response_mask[row].bool().nonzero()[:, 0]
        assert parts.versions[row, model_cols].tolist() == [k // 2 for k in range(len(model_cols))]


def test_a_part_after_a_weight_change_samples_with_the_new_weights_from_the_whole_history(model, tok):
    """Parts of 3 tokens, the engine's weights changed after the first: the first 3 model tokens
    of every row are the old weights' (teacher-forced log-probs under them), every later one,
    over environment answers, the new weights' -- not the old ones'."""
    new = randomized(seed=1)
    old_engine, new_engine = make_engine("native", copy.deepcopy(model), tok), make_engine("native", new, tok)
    out, calls = in_parts(old_engine, tok, 3, engines=[old_engine, new_engine])
    assert calls >= 3
    crossed = 0
    for row in range(len(out)):
        resp = out.response_ids[row, : int(out.total_lengths[row])].tolist()
        gen = out.response_mask[row, : len(resp)].bool()
        version = out.versions[row, : len(resp)]
        for weights, v in ((model, 0), (new, 1)):
            at = gen & (version == v) if v == 0 else gen & (version >= 1)
            ref = teacher_forced_logp(weights, out.prompt_ids[row], resp)
            torch.testing.assert_close(out.logprobs[row, : len(resp)][at], ref[at], atol=1e-4, rtol=0)
            assert not at.any() or float((out.logprobs[row, : len(resp)][at] - teacher_forced_logp(
                new if v == 0 else model, out.prompt_ids[row], resp)[at]).abs().max()) > 1e-3
        model_cols = gen.nonzero()[:, 0]
        assert (version[model_cols[:3]] == 0).all() and (version[model_cols[3:]] >= 1).all()
        env_cols = (~gen).nonzero()[:, 0]
        crossed += bool(len(env_cols)) and bool((version[model_cols[model_cols > env_cols[0]]] >= 1).all())
    assert crossed >= 2  # rows whose turns after an environment answer are the new weights'
