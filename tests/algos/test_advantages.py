"""Advantage estimators: the seed's worked example, hand numbers, loop references."""

import math

import pytest
import torch

from posttrain.algos import (
    ADV_ESTIMATORS,
    compute_gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain Python GAE over each row's valid tokens (interior zeros skipped)."""
    adv = [[0.0] * len(row) for row in rewards]
    for b, (r, v, m) in enumerate(zip(rewards, values, mask)):
        steps = [t for t in range(len(r)) if m[t]]
        next_value = next_adv = 0.0
        for t in reversed(steps):
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[t]
            adv[b][t] = next_adv
    return adv


def test_gae_seed_example_lambda_zero():
    # The seed's table ("This movie is amazing <EOS>", γ = 0.99, λ = 0, so A_t = δ_t):
    #   t=0  0 + .99·2.3 − 2.0 = 0.277     t=1  0 + .99·2.5 − 2.3 = 0.175
    #   t=2  0 + .99·3.0 − 2.5 = 0.47      t=3  0 + .99·4.8 − 3.0 = 1.752
    #   t=4  5 + .99·0   − 4.8 = 0.2       (terminal: V after the last token is 0)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0]])
    values = torch.tensor([[2.0, 2.3, 2.5, 3.0, 4.8]])
    adv, returns = compute_gae(rewards, values, torch.ones(1, 5), gamma=0.99, lam=0.0)
    expected = torch.tensor([[0.277, 0.175, 0.47, 1.752, 0.2]])
    torch.testing.assert_close(adv, expected, atol=1e-3, rtol=0)
    torch.testing.assert_close(returns, expected + values, atol=1e-3, rtol=0)


def test_gae_lambda_one_is_return_minus_value():
    # γ = λ = 1: A_t = G_t − V_t with G_t = 1 for every t (reward 1 at the end)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    adv, returns = compute_gae(rewards, values, torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))


def test_gae_terminal_reward_decays_by_lambda():
    # The seed: zero critic, γ = 1 → A_t = λ^(T−1−t) R
    adv, _ = compute_gae(
        torch.tensor([[0.0, 0.0, 0.0, 2.0]]), torch.zeros(1, 4), torch.ones(1, 4), lam=0.5
    )
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 1.0, 2.0]]))


def test_gae_right_padding_and_interior_zero_by_hand():
    # row 0: valid t=0,1, padding after → t=1 is terminal, padding values are ignored
    #   A_1 = 1 − 0.5 = 0.5 ; A_0 = (0 + 0.5 − 0.25) + 0.5 = 0.75
    # row 1: t=1 masked (e.g. tool output) → t=0 bootstraps from t=2
    #   A_2 = 1 − 0.5 = 0.5 ; A_0 = (0 + 0.5 − 0.25) + 0.5 = 0.75
    rewards = torch.tensor([[0.0, 1.0, 9.0], [0.0, 9.0, 1.0]])
    values = torch.tensor([[0.25, 0.5, 9.0], [0.25, 9.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv, returns = compute_gae(rewards, values, mask)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.5, 0.0], [0.75, 0.0, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_python_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 9, generator=gen) > 0.3
    adv, returns = compute_gae(rewards, values, mask, gamma, lam)
    expected = torch.tensor(
        gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    )
    torch.testing.assert_close(adv, expected.double())
    torch.testing.assert_close(returns, torch.where(mask, expected + values, 0.0))


def test_gae_has_no_gradient():
    values = torch.ones(1, 3, requires_grad=True)
    adv, returns = compute_gae(torch.ones(1, 3), values, torch.ones(1, 3))
    assert not adv.requires_grad and not returns.requires_grad


def test_grpo_equal_rewards_give_zero_advantages():
    for scale in ("group", "batch", "none"):
        adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 4, scale)
        torch.testing.assert_close(adv, torch.zeros(8))


def test_grpo_by_hand():
    # group (1, 0, 0, 0): mean 1/4, population std sqrt(1/4 · 3/4) = √3/4
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0, 2.0])
    std = math.sqrt(3) / 4
    adv = grpo_advantages(scores, 4, eps=0.0)
    # group (2, 4, 4, 2): mean 3, std 1 → (−1, 1, 1, −1)
    expected = torch.tensor([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, -1, 1, 1, -1])
    torch.testing.assert_close(adv, expected)
    # Dr.GRPO: only the group mean is removed
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, -1.0, 1.0, 1.0, -1.0])
    torch.testing.assert_close(grpo_advantages(scores, 4, "none"), expected)
    # batch: group means, std of all 8 scores: mean 13/8,
    # Σ(s − 13/8)² = .390625 + 3 · 2.640625 + 2 · .140625 + 2 · 5.640625 = 19.875
    batch_std = math.sqrt(19.875 / 8)
    torch.testing.assert_close(grpo_advantages(scores, 4, "batch", eps=0.0), expected / batch_std)


def test_grpo_eps_and_errors():
    # σ + eps: (1, 0) has σ = 0.5 → A = ±0.5 / (0.5 + 0.5)
    torch.testing.assert_close(
        grpo_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.5), torch.tensor([0.5, -0.5])
    )
    with pytest.raises(ValueError, match="multiple"):
        grpo_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="GRPO scale"):
        grpo_advantages(torch.zeros(4), 4, scale="std")


def test_rloo_by_hand():
    # (1, 0, 0, 0): A_0 = 1 − mean(0, 0, 0) = 1 ; A_j = 0 − mean(1, 0, 0) = −1/3
    # G = 2 leaves one other: (3, 5) → (3 − 5, 5 − 3)
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([3.0, 5.0]), 2), torch.tensor([-2.0, 2.0])
    )
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # equals G/(G−1) times the Dr.GRPO advantage
    scores = torch.randn(12, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        rloo_advantages(scores, 4), grpo_advantages(scores, 4, "none") * 4 / 3
    )
    with pytest.raises(ValueError, match="RLOO"):
        rloo_advantages(torch.zeros(4), 1)


def reinforce_pp_reference(rewards, mask, gamma):
    """Python loop: returns-to-go over the valid positions (masked ones skipped), then whitening."""
    returns = [[0.0] * len(row) for row in rewards]
    for b, (r, m) in enumerate(zip(rewards, mask)):
        running = 0.0
        for t in reversed(range(len(r))):
            if m[t]:
                running = r[t] + gamma * running
                returns[b][t] = running
    valid = [x for row, m in zip(returns, mask) for x, keep in zip(row, m) if keep]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if keep else 0.0 for x, keep in zip(row, m)]
        for row, m in zip(returns, mask)
    ]


def test_reinforce_pp_by_hand():
    # γ = 1: returns (1, 1, 1 | 2, 2, pad) → valid 1, 1, 1, 2, 2: mean 1.4,
    # unbiased var (3 · 0.16 + 2 · 0.36) / 4 = 0.3
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask)
    s = math.sqrt(0.3 + 1e-8)
    expected = torch.tensor([[-0.4 / s, -0.4 / s, -0.4 / s], [0.6 / s, 0.6 / s, 0.0]])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_python_loop(gamma):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 8, generator=gen) > 0.25
    expected = reinforce_pp_reference(rewards.tolist(), mask.tolist(), gamma)
    torch.testing.assert_close(
        reinforce_pp_advantages(rewards, mask, gamma), torch.tensor(expected).double()
    )


def _estimator_inputs():
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    rewards = torch.randn(4, 3, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    return rewards.sum(-1), rewards, values, mask


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_estimator_table_entries_are_the_functions_above(name):
    # every entry: one signature, (B, T) advantages that are 0 off the mask
    outcome, rewards, values, mask = _estimator_inputs()
    scale = "none" if name == "dr_grpo" else "group"
    est = ADV_ESTIMATORS[name]
    adv, returns = est.fn(outcome, rewards, values if est.needs_values else None, mask,
                          group_size=2, gamma=0.9, lam=0.8, scale=scale)
    direct = {
        "gae": lambda: compute_gae(rewards, values, mask, 0.9, 0.8),
        "grpo": lambda: (grpo_advantages(outcome, 2, "group")[:, None] * mask, None),
        "dr_grpo": lambda: (grpo_advantages(outcome, 2, "none")[:, None] * mask, None),
        "rloo": lambda: (rloo_advantages(outcome, 2)[:, None] * mask, None),
        "reinforce_pp": lambda: (reinforce_pp_advantages(rewards, mask, 0.9), None),
    }[name]()
    torch.testing.assert_close(adv, direct[0])
    assert (returns is None) == (direct[1] is None) == (not est.needs_values)
    if returns is not None:
        torch.testing.assert_close(returns, direct[1])
    assert (adv[mask == 0] == 0).all()


def test_estimator_properties():
    assert [n for n, e in ADV_ESTIMATORS.items() if e.needs_values] == ["gae"]
    assert [n for n, e in ADV_ESTIMATORS.items() if e.whitens] == ["reinforce_pp"]
    assert sorted(n for n, e in ADV_ESTIMATORS.items() if e.grouped) == ["dr_grpo", "grpo", "rloo"]
    outcome, rewards, _, mask = _estimator_inputs()
    with pytest.raises(ValueError, match="values"):
        ADV_ESTIMATORS["gae"].fn(outcome, rewards, None, mask, group_size=1, gamma=1.0, lam=1.0, scale="group")
