"""Multi-turn episodes (rollout/episodes.py) on the native and hf engines.

The environment here is a small deterministic one written for the test: it answers every
model turn with `[k:LEN]` (k the turn, LEN the turn's characters) and ends the episode after
`done_after[row]` turns, so rows finish at different turns and the batch shrinks.
"""

import pytest
import torch

from posttrain.algos import policy_loss, token_logprobs
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import MultiTurnLimits, Reply
from posttrain.rollout.native_episodes import packed_positions

from .conftest import PROMPTS


class CountingEnv:
    """Answers `[turn:chars]`; done after done_after[row % len] turns."""

    def __init__(self, tok, done_after=(1, 2, 3, 5), answer=None):
        self.tok, self.done_after, self.answer = tok, done_after, answer
        self.turns: dict[int, int] = {}
        self.seen: list[tuple[int, str]] = []

    def respond(self, rows, texts):
        replies = []
        for r, text in zip(rows, texts):
            k = self.turns[r] = self.turns.get(r, 0) + 1
            self.seen.append((r, text))
            obs = self.answer(r, k) if self.answer else f"[{k}:{len(text)}]"
            ids = self.tok(obs, add_special_tokens=False)["input_ids"]
            replies.append(Reply(ids, done=k >= self.done_after[r % len(self.done_after)], info={"k": k}))
        return replies


PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(), seed=3)
LIMITS = MultiTurnLimits(max_turns=4, max_total_tokens=60)


def run(engine, tok, params=PARAMS, limits=LIMITS, **env):
    handler = CountingEnv(tok, **env)
    return engine.generate_episodes(PROMPTS, params, limits, handler), handler


@pytest.fixture(scope="module")
def native(model, tok):
    return make_engine("native", model, tok)


def teacher_forced_logp(model, prompt, response, temperature=1.0):
    """(len(response),) logprobs of every response token given prompt + response before it."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids)
    return token_logprobs(logits[:, len(prompt) - 1 : -1], ids[:, len(prompt) :], temperature)[0]


def test_response_mask_is_zero_exactly_on_environment_tokens(native, tok):
    out, env = run(native, tok)
    for row in range(len(out)):
        ids = out.response_ids[row, : int(out.total_lengths[row])].tolist()
        mask = out.response_mask[row, : len(ids)].tolist()
        expected, pos = [1] * len(ids), 0
        for k, text in enumerate(out.turn_texts[row], start=1):
            pos += PARAMS.max_new_tokens  # no stop token or string: every turn is this long
            if k < len(out.turn_texts[row]):  # every turn but the last got an answer
                obs = tok(f"[{k}:{len(text)}]", add_special_tokens=False)["input_ids"]
                assert ids[pos : pos + len(obs)] == obs
                expected[pos : pos + len(obs)] = [0] * len(obs)
                pos += len(obs)
        assert pos == len(ids) and mask == expected
        assert int(out.lengths[row]) == sum(expected) == int(out.response_mask[row].sum())
        assert out.logprobs[row][out.response_mask[row] == 0].abs().sum() == 0
    assert out.num_tokens == int(out.lengths.sum()) < int(out.total_lengths.sum())


def test_rows_finish_at_different_turns(native, tok):
    out, _ = run(native, tok)
    assert out.turns.tolist() == [1, 2, 3, 4] * 2  # done_after 1, 2, 3, then max_turns 4
    # No stop token or string: every turn is cut at max_new_tokens, the last ones too, so every
    # episode is truncated, whether the environment or max_turns ended it.
    assert out.truncated.all() and out.finish_reason == ["length"] * 8
    assert [len(i) for i in out.infos] == out.turns.tolist()


def test_rollout_logprobs_equal_a_teacher_forced_forward_of_the_trajectory(native, model, tok):
    """The KV cache extended with the environment's tokens gives the logits of the full
    sequence: nothing is lost or shifted when answers are appended."""
    out, _ = run(native, tok)
    for row in range(len(out)):
        resp = out.response_ids[row, : int(out.total_lengths[row])].tolist()
        ref = teacher_forced_logp(model, out.prompt_ids[row], resp)
        model_tok = out.response_mask[row, : len(resp)].bool()
        torch.testing.assert_close(out.logprobs[row, : len(resp)][model_tok], ref[model_tok], atol=1e-4, rtol=0)


def test_native_and_hf_give_the_same_episodes(model, hf_model, tok, native):
    a, _ = run(native, tok)
    b, _ = run(make_engine("hf", hf_model, tok), tok)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert a.meta["engine"] == "native" and b.meta["engine"] == "hf"


def test_native_and_hf_agree_when_turns_end_at_different_steps(model, hf_model, tok, native):
    """A stop string ends turns at different steps: a chunk then mixes answers and single
    tokens (the native engine runs the answers as a sub-batch and packs padding away)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, stop=("e",), stop_token_ids=(), seed=1)
    limits = MultiTurnLimits(max_turns=4, max_total_tokens=90)
    a, _ = run(native, tok, params, limits, answer=lambda r, k: "[" * (3 + 4 * r + k) + "]")
    b, _ = run(make_engine("hf", hf_model, tok), tok, params, limits, answer=lambda r, k: "[" * (3 + 4 * r + k) + "]")
    assert len(set(a.turns.tolist())) > 1
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.sequence_mask, b.sequence_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    for r in range(len(a)):
        n = int(a.total_lengths[r])
        resp, mask = a.response_ids[r, :n].tolist(), a.response_mask[r, :n].bool()
        forced = teacher_forced_logp(model, a.prompt_ids[r], resp)
        torch.testing.assert_close(a.logprobs[r, :n][mask], forced[mask], atol=1e-4, rtol=0)


def test_compaction_and_cache_growth_change_nothing(model, tok):
    """Long episodes (past the first cache allocation) with and without dropping rows."""
    params = SamplingParams(n=1, temperature=0.7, max_new_tokens=30, stop_token_ids=(), seed=5)
    limits = MultiTurnLimits(max_turns=6, max_total_tokens=200)
    a, _ = run(make_engine("native", model, tok, compact_fraction=0.0), tok, params, limits)
    b, _ = run(make_engine("native", model, tok, compact_fraction=None), tok, params, limits)
    assert int(a.total_lengths.max()) > 64
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_packed_positions_drop_padding_columns_and_keep_the_order():
    valid = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    positions, kept = packed_positions(valid)
    # 3 real tokens at most; each row's real positions in order and right-aligned
    assert positions.tolist() == [[1, 3, 4], [5, 0, 4], [4, 5, 3]]  # pad slots: the last pad columns
    assert kept.tolist() == [[True] * 3, [False, True, True], [False, False, True]]
    assert torch.equal(valid.gather(1, positions), kept)


def test_max_turns_and_max_total_tokens_are_respected(native, tok):
    out, _ = run(native, tok, limits=MultiTurnLimits(max_turns=2, max_total_tokens=60), done_after=(9,))
    assert out.turns.tolist() == [2] * 8 and out.truncated.all()
    out, _ = run(native, tok, limits=MultiTurnLimits(max_turns=9, max_total_tokens=17), done_after=(9,))
    assert (out.total_lengths <= 17).all() and out.truncated.all()
    assert out.finish_reason == ["length"] * 8


def test_eos_ends_a_turn_and_the_environment_decides_whether_the_episode_goes_on(native, tok):
    eos = tok.eos_token_id
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=(eos,), seed=0)
    out, env = run(native, tok, params=params, limits=MultiTurnLimits(9, 400), done_after=(3,))
    assert out.turns.tolist() == [3] * 8
    after_eos, last_is_eos = 0, []
    for r in range(len(out)):
        ids = out.response_ids[r, : int(out.total_lengths[r])].tolist()
        mask = out.response_mask[r, : len(ids)].tolist()
        last_is_eos.append(ids[-1] == eos)  # else the last turn was cut at max_new_tokens
        for pos in (p for p, t in enumerate(ids[:-1]) if t == eos and mask[p] == 1):
            assert mask[pos + 1] == 0  # the environment's answer follows the EOS
            after_eos += 1
    assert after_eos, "the test needs an EOS before the last turn somewhere; pick another seed"
    assert out.finish_reason == ["stop" if e else "length" for e in last_is_eos] and any(last_is_eos)
    assert all("<|eos|>" not in text for _, text in env.seen)


def test_stop_string_ends_a_model_turn(native, tok):
    """A stop string ends the turn (and is kept in the text the environment sees)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop=("e",), stop_token_ids=(), seed=1)
    out, env = run(native, tok, params=params, done_after=(1, 2))
    assert any(text.endswith("e") for _, text in env.seen)
    for _, text in env.seen:
        assert "e" not in text[:-1]  # ended by "e" or by max_new_tokens
    # The environment ends every episode after 1 or 2 turns; one whose last turn was cut at
    # max_new_tokens is truncated (as a single-turn response cut there is), the others not.
    turns: dict[int, list[str]] = {}
    for r, text in env.seen:
        turns.setdefault(r, []).append(text)
    cut = [not turns[r][-1].endswith("e") for r in range(len(out))]
    assert out.truncated.tolist() == cut and True in cut and False in cut
    assert out.finish_reason == ["length" if c else "stop" for c in cut]


def test_an_observation_conditions_the_model_tokens_after_it_only(model, tok):
    out, _ = run(make_engine("native", model, tok), tok)
    row = 5  # three turns: model, [1:..], model, [2:..], model
    resp = out.response_ids[row, : int(out.total_lengths[row])].tolist()
    mask = out.response_mask[row, : len(resp)]
    env_at = (mask == 0).nonzero()[:, 0]
    first_env, first_env_end = int(env_at[0]), int(env_at[0]) + 1
    changed = list(resp)
    changed[first_env + 1] = tok("9", add_special_tokens=False)["input_ids"][0]  # "[1:.." -> "[9:.."
    assert changed != resp
    a = teacher_forced_logp(model, out.prompt_ids[row], resp)
    b = teacher_forced_logp(model, out.prompt_ids[row], changed)
    assert torch.equal(a[:first_env_end], b[:first_env_end])  # before it: the same
    later_model = mask.bool() & (torch.arange(len(resp)) > first_env + 1)
    assert (a[later_model] - b[later_model]).abs().max() > 1e-3  # after it: conditioned on it


def test_the_policy_loss_and_gradient_ignore_observation_token_logprobs(native, tok):
    out, _ = run(native, tok)
    mask = out.response_mask
    old = out.logprobs
    adv = torch.randn(len(out))
    logp = (old + 0.1 * torch.randn_like(old)).requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logp)
    env_tokens = out.sequence_mask.bool() & ~mask.bool()
    assert env_tokens.any()
    perturbed = logp.detach().masked_fill(env_tokens, -50.0).requires_grad_()
    loss2, _ = policy_loss(perturbed, old, adv, mask, agg="seq-mean-token-mean")
    (grad2,) = torch.autograd.grad(loss2, perturbed)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert grad[env_tokens].abs().sum() == 0


def test_limits_are_checked():
    with pytest.raises(ValueError):
        MultiTurnLimits(max_turns=0)


def test_the_limits_come_from_the_rollout_multi_turn_config():
    from posttrain.config import ConfigError, GRPOConfig, build_config

    base = ["model.init=tiny", "data.train_files=[train.jsonl]"]
    cfg = build_config(GRPOConfig, None, [*base, "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_total_tokens=99"])
    assert MultiTurnLimits.from_config(cfg.rollout.multi_turn) == MultiTurnLimits(max_turns=3, max_total_tokens=99)
    assert MultiTurnLimits.from_config(GRPOConfig().rollout.multi_turn) == MultiTurnLimits()  # one set of defaults
    with pytest.raises(ConfigError, match="rollout.multi_turn.max_turns"):
        build_config(GRPOConfig, None, [*base, "rollout.multi_turn.max_turns=0"])
