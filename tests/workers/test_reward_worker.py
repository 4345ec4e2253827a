"""Reward role: scores, their placement on the last token, shaping, accuracy, failures, KL."""

import math

import torch

from posttrain.algos import overlong_penalty
from posttrain.rewards import RewardRunner
from posttrain.workers import Reward
from posttrain.workers.reward_worker import place_on_last_token

from .conftest import rollout


def first_is_a(prompts, completions, completion_ids, **kw):
    return [1.0 if ids[0] == 3 else 0.0 for ids in completion_ids]


first_is_a.is_correctness = True  # 1.0 means right: it defines `accuracy`


def half(prompts, completions, completion_ids, **kw):
    return [0.5] * len(completions)


def only_first(prompts, completions, completion_ids, **kw):
    return [2.0] + [None] * (len(completions) - 1)


def boom(prompts, completions, completion_ids, **kw):
    raise RuntimeError("reward function bug")


def test_place_on_last_token():
    out = place_on_last_token(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([2, 3, 1]), 4)
    assert out.tolist() == [[0, 1, 0, 0], [0, 0, -2, 0], [3, 0, 0, 0]]


def test_weighted_total_shaping_and_accuracy(model, tok):
    b = rollout(model, tok, n=4, max_new_tokens=3)
    runner = RewardRunner([("first_is_a", first_is_a), ("half", half)], weights=[1.0, 2.0])
    reward = Reward(runner, max_new_tokens=3, overlong_buffer=2, overlong_penalty=0.5, missing_eos_penalty=0.25)
    scored, metrics = reward.score(b)
    a = torch.tensor([1.0 if ids[0] == 3 else 0.0 for ids in b.response_ids.tolist()])
    expected = a + 1.0 + overlong_penalty(b.lengths, 3, 2, 0.5) - 0.25 * b.truncated.float()
    assert torch.allclose(scored.scores, expected)
    assert torch.allclose(scored.token_rewards.sum(1), expected)
    last = scored.token_rewards.gather(1, (b.lengths - 1)[:, None])[:, 0]
    assert torch.allclose(last, expected)
    assert torch.equal(scored.rewards["correct"], a)  # the function that declares correctness decides it
    assert torch.allclose(scored.rewards["total"], a + 1.0)
    assert metrics["reward/half/mean"] == 0.5


def test_none_is_nan_in_terms_and_leaves_total(model, tok):
    b = rollout(model, tok, n=2, max_new_tokens=2)
    scored, _ = Reward(RewardRunner([("only_first", only_first)])).score(b)
    assert scored.rewards["only_first"][0] == 2.0 and math.isnan(scored.rewards["only_first"][1])
    assert scored.scores[1] == 0.0 and "correct" not in scored.rewards  # only_first declares no correctness


def test_accuracy_comes_only_from_a_function_that_declares_correctness(model, tok):
    """Seen: under a learned reward model `accuracy` was "first function >= 1" and read 0.5. Now the
    first function that declares `is_correctness` decides it, wherever it is in the list; without
    one there is no `correct` term and no `accuracy` metric."""
    from posttrain.rewards import exact_match, format_reward, math_accuracy, task_reward
    from posttrain.rewards.registry import resolve_reward
    from posttrain.trainers.rl_steps import generation_metrics

    assert all(fn.is_correctness for fn in (math_accuracy, exact_match, task_reward(), resolve_reward(
        {"name": "code_tests", "timeout_s": 1.0})[1]))
    assert not hasattr(format_reward(), "is_correctness")
    b = rollout(model, tok, n=4, max_new_tokens=3)
    a = torch.tensor([1.0 if ids[0] == 3 else 0.0 for ids in b.response_ids.tolist()])
    both = Reward(RewardRunner([("half", half), ("first_is_a", first_is_a)]))
    assert both.accuracy_from == "first_is_a"
    scored, metrics = both.score(b)
    assert torch.equal(scored.rewards["correct"], a)
    assert generation_metrics([scored], [metrics], 4)["accuracy"] == float(a.mean())
    model_like = Reward(RewardRunner([("reward_model", half)]))  # a learned score: 0.5 is no "half right"
    assert model_like.accuracy_from is None
    scored, metrics = model_like.score(b)
    assert "correct" not in scored.rewards and "accuracy" not in generation_metrics([scored], [metrics], 4)


def test_a_raising_reward_function_gives_the_failure_reward(model, tok):
    b = rollout(model, tok, n=2, max_new_tokens=2)
    runner = RewardRunner([("boom", boom), ("half", half)], failure_reward=-1.0)
    scored, metrics = Reward(runner).score(b)
    assert torch.allclose(scored.scores, torch.full((len(b),), -0.5))
    assert metrics["reward/boom/errors"] == len(b)


def test_apply_kl_subtracts_per_token_on_valid_tokens(model, tok):
    b = rollout(model, tok, n=2, max_new_tokens=3)
    scored, _ = Reward(RewardRunner([("half", half)])).score(b)
    old = torch.randn(b.response_ids.shape)
    ref = torch.randn(b.response_ids.shape)
    shaped, kl = Reward.apply_kl(scored.replace(old_logp=old, ref_logp=ref), 0.1, "k1")
    mask = b.response_mask.bool()
    expected = scored.token_rewards - 0.1 * torch.where(mask, old - ref, 0.0)
    assert torch.allclose(shaped.token_rewards, expected)
    assert math.isclose(kl, float((old - ref)[mask].mean()), rel_tol=1e-5)
