"""DPO variants and the Bradley-Terry reward-model loss against hand numbers."""

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.algos import bradley_terry_loss, dpo_loss

# log π(y_c) = −1, log π(y_r) = −3, both reference log-probs −2:
# h = (−1 − (−3)) − (−2 − (−2)) = 2 ; with β = 0.1, βh = 0.2
PAIR = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))
SOFTPLUS_NEG = math.log1p(math.exp(-0.2))  # −log σ(0.2) = 0.598139
SOFTPLUS_POS = math.log1p(math.exp(0.2))  # −log σ(−0.2) = 0.798139


@pytest.mark.parametrize(
    "loss_type, smoothing, expected",
    [
        ("sigmoid", 0.0, SOFTPLUS_NEG),
        ("sigmoid", 0.1, 0.9 * SOFTPLUS_NEG + 0.1 * SOFTPLUS_POS),  # 0.618139
        ("robust", 0.0, SOFTPLUS_NEG),
        ("robust", 0.1, (0.9 * SOFTPLUS_NEG - 0.1 * SOFTPLUS_POS) / 0.8),  # 0.573139
        ("hinge", 0.0, 0.8),  # relu(1 − 0.2)
        ("ipo", 0.0, 9.0),  # (2 − 1/(2 · 0.1))² = (2 − 5)²
    ],
)
def test_dpo_losses_by_hand(loss_type, smoothing, expected):
    losses, chosen, rejected = dpo_loss(
        *PAIR, beta=0.1, loss_type=loss_type, label_smoothing=smoothing
    )
    assert losses.shape == (1,)
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    # rewards β(log π − log π_ref): 0.1 · (−1 + 2) = 0.1 and 0.1 · (−3 + 2) = −0.1
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.1)


def test_dpo_gradient_and_detached_rewards():
    chosen = torch.tensor([-1.0], requires_grad=True)
    losses, chosen_rewards, _ = dpo_loss(chosen, *PAIR[1:], beta=0.1)
    assert not chosen_rewards.requires_grad
    losses.sum().backward()
    # d/dπ_c −log σ(βh) = −β σ(−βh)
    assert chosen.grad.item() == pytest.approx(-0.1 * torch.sigmoid(torch.tensor(-0.2)).item())


def test_robust_dpo_is_unbiased_under_label_noise():
    # With labels flipped with probability ε, the expected rDPO loss is the clean DPO loss:
    # (1 − ε) L(h) + ε L(−h) = −log σ(βh)
    h = torch.linspace(-5, 5, 11, dtype=torch.float64)
    zero = torch.zeros_like(h)
    eps, beta = 0.2, 0.5
    forward, _, _ = dpo_loss(h, zero, zero, zero, beta, "robust", eps)
    flipped, _, _ = dpo_loss(-h, zero, zero, zero, beta, "robust", eps)
    torch.testing.assert_close((1 - eps) * forward + eps * flipped, -F.logsigmoid(beta * h))


def test_dpo_rejects_bad_settings():
    with pytest.raises(ValueError, match="DPO loss type"):
        dpo_loss(*PAIR, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*PAIR, loss_type="robust", label_smoothing=0.5)


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    # mean(−log σ(1), −log σ(0)) = (0.313262 + ln 2) / 2
    expected = (math.log1p(math.exp(-1)) + math.log(2)) / 2
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected)
    # margin (1, −1): mean(−log σ(0), −log σ(1))
    with_margin = bradley_terry_loss(chosen, rejected, torch.tensor([1.0, -1.0]))
    assert with_margin.item() == pytest.approx(expected)
    # stable for large gaps: −log σ(−100) = 100, not inf
    far = bradley_terry_loss(torch.tensor([0.0]), torch.tensor([100.0]))
    assert far.item() == pytest.approx(100.0)
