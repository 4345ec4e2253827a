"""Policy loss, value loss and aggregation: hand numbers and gradients."""

import math

import pytest
import torch

from posttrain.algos import aggregate_loss, aggregation_weight, policy_loss, value_loss


def logps(ratios, requires_grad=True):
    """(logp, old_logp) with old = ln 0.5 and exp(logp − old) = the given ratios."""
    old = torch.full((1, len(ratios)), math.log(0.5), dtype=torch.float64)
    logp = (old + torch.tensor([ratios], dtype=torch.float64).log()).requires_grad_(requires_grad)
    return logp, old


def grad_of(loss, logp):
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def test_seed_ratio_example():
    # old p = 0.5 → new p = 0.6: ratio 1.2, at the clip edge, so the loss is −A·1.2 = −2.4
    logp = torch.tensor([[math.log(0.6)]])
    old = torch.tensor([[math.log(0.5)]])
    loss, metrics = policy_loss(logp, old, torch.tensor([2.0]), torch.ones(1, 1))
    assert metrics["ratio/mean"].item() == pytest.approx(1.2)
    assert loss.item() == pytest.approx(-2.4)
    assert metrics["clip_frac"].item() == 0.0  # 1.2 is not > 1.2


def test_clipped_surrogate_by_hand():
    # per token ℓ = max(−A r, −A clip(r, 0.8, 1.2)):
    #   A=+1 r=1.5 → max(−1.5, −1.2) = −1.2  (clipped high)
    #   A=−1 r=0.5 → max(0.5, 0.8)   =  0.8  (clipped low)
    #   A=−1 r=2.0 → max(2.0, 1.2)   =  2.0  (wrong direction: unclipped)
    #   A=+1 r=0.5 → max(−0.5, −0.8) = −0.5  (wrong direction: unclipped)
    # token-mean: (−1.2 + 0.8 + 2.0 − 0.5) / 4 = 0.275
    logp, old = logps([1.5, 0.5, 2.0, 0.5])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(0.275)
    assert metrics["clip_frac/high"].item() == pytest.approx(0.25)
    assert metrics["clip_frac/low"].item() == pytest.approx(0.25)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["clip_frac/dual"].item() == 0.0
    assert metrics["ratio/mean"].item() == pytest.approx(4.5 / 4)
    # approx_kl = mean(old − logp) = −mean(ln r) = −ln(1.5 · 0.5 · 2 · 0.5) / 4 = −ln(0.75) / 4
    assert metrics["approx_kl"].item() == pytest.approx(-math.log(0.75) / 4)
    # gradients d ℓ/d logp = −A r where unclipped, 0 where clipped; then / 4
    expected = torch.tensor([[0.0, 0.0, 2.0, -0.5]], dtype=torch.float64) / 4
    torch.testing.assert_close(grad_of(loss, logp), expected)


def test_positive_advantage_above_clip_high_has_no_gradient():
    logp, old = logps([1.3])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1))
    assert grad_of(loss, logp).item() == 0.0


def test_positive_advantage_below_clip_low_keeps_its_gradient():
    # r = 0.5 < 0.8 with A > 0: the unclipped term is the max, gradient −A r = −0.5
    logp, old = logps([0.5])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1))
    assert grad_of(loss, logp).item() == pytest.approx(-0.5)


def test_clip_higher_decouples_the_bounds():
    # r = 1.25, A > 0: clipped under [0.8, 1.2], still learning under DAPO's [0.8, 1.28]
    logp, old = logps([1.25])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    symmetric, _ = policy_loss(logp, old, adv, mask)
    higher, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert grad_of(symmetric, logp).item() == 0.0
    assert grad_of(higher, logp).item() == pytest.approx(-1.25)
    assert metrics["clip_frac"].item() == 0.0


def test_dual_clip_caps_the_loss_for_negative_advantages():
    # A = −1, c = 3: r = 5 → min(max(5, 1.2), 3) = 3, constant → no gradient
    #                r = 2 → min(2, 3) = 2, gradient −A r = 2
    logp, old = logps([5.0, 2.0])
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    plain, _ = policy_loss(logp, old, adv, torch.ones(1, 2))
    assert plain.item() == pytest.approx((5 + 2) / 2)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip=3.0)
    assert loss.item() == pytest.approx((3 + 2) / 2)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert metrics["clip_frac/dual"].item() == pytest.approx(0.5)
    # positive advantages are untouched by the dual clip
    pos, _ = policy_loss(logp, old, -adv, torch.ones(1, 2), dual_clip=3.0)
    assert pos.item() == pytest.approx((-1.2 - 1.2) / 2)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip=1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_first_step_is_the_plain_policy_gradient(agg):
    # old_logp == logp: r = 1, loss = aggregate(−A), gradient = ∇ aggregate(−A · logp)
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=gen, dtype=torch.float64).requires_grad_()
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask, agg=agg)
    assert metrics["ratio/mean"].item() == 1.0 and metrics["approx_kl"].item() == 0.0
    pg = aggregate_loss(-adv[:, None] * logp, mask, agg)
    torch.testing.assert_close(loss, aggregate_loss(-adv[:, None].expand(3, 5), mask, agg))
    torch.testing.assert_close(grad_of(loss, logp), grad_of(pg, logp))


def test_gspo_value_and_gradient_match_the_paper():
    # GSPO: s_i = exp(mean_t(logp − old)) for every token; unclipped
    # ∇_{logp_{i,t}} J = s_i A_i / |y_i| ; with seq-mean-token-mean the loss gradient is
    # −(1/B) s_i A_i / |y_i| on valid tokens and 0 on padding.
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    logp = (old + 0.02 * torch.randn(3, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    lengths = mask.sum(-1)
    seq_ratio = torch.exp(((logp.detach() - old) * mask).sum(-1) / lengths)
    assert ((seq_ratio - 1).abs() < 0.1).all()  # inside the clip range

    loss, metrics = policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean")
    # loss = mean_i(−A_i s_i) since every token of sequence i carries s_i
    torch.testing.assert_close(loss, (-adv * seq_ratio).mean())
    expected = -(seq_ratio * adv / lengths)[:, None] / 3 * mask
    torch.testing.assert_close(grad_of(loss, logp), expected)
    torch.testing.assert_close(metrics["ratio/mean"], (seq_ratio * lengths).sum() / lengths.sum())


def test_gspo_clips_whole_sequences():
    # a sequence with s > 1 + ε and A > 0 gets no gradient on any token
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.5, 0.0, 0.1]], dtype=torch.float64, requires_grad=True)  # s = e^0.2
    loss, metrics = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), level="sequence")
    assert loss.item() == pytest.approx(-1.2)
    assert (grad_of(loss, logp) == 0).all()
    assert metrics["clip_frac"].item() == 1.0


def test_gspo_clamps_the_sequence_log_ratio_at_10_as_verl():
    # log s = 12 with A = −1: the clip does not bound r for A < 0 (max(−A r, −A clip(r))
    # = −A r), so unclamped the gradient would be −A e^12 / 2 per token (token-mean over
    # 2 tokens). veRL clamps log s at 10: loss −A e^10, constant, so no gradient.
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.full((1, 2), 12.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 2), level="sequence")
    assert loss.item() == pytest.approx(math.exp(10.0))  # 22026.47
    assert (grad_of(loss, logp) == 0).all()
    assert metrics["ratio/mean"].item() == pytest.approx(math.exp(10.0))
    assert metrics["clip_frac"].item() == 0.0
    # below the clamp, log s = 9: the unclipped term, gradient −A e^9 / 2 on each token
    logp = torch.tensor([[8.0, 10.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 2), level="sequence")
    assert loss.item() == pytest.approx(math.exp(9.0))
    torch.testing.assert_close(grad_of(loss, logp), torch.full((1, 2), math.exp(9.0) / 2, dtype=torch.float64))
    # no lower clamp: log s = −30 gives r = e^−30, not e^−20
    logp = torch.full((1, 2), -30.0, dtype=torch.float64)
    _, metrics = policy_loss(logp, old, -adv, torch.ones(1, 2), level="sequence")
    assert metrics["ratio/mean"].item() == pytest.approx(math.exp(-30.0))


def test_token_log_ratio_keeps_the_symmetric_clamp():
    # level token clamps ρ to [−20, 20] (veRL's vanilla loss): r = e^20 for ρ = 25
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), 25.0, dtype=torch.float64)
    _, metrics = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1))
    assert metrics["ratio/mean"].item() == pytest.approx(math.exp(20.0))


def test_value_loss_by_hand():
    # V = 1.5, V_old = 1.0, R = 2.0, c = 0.2:
    #   unclipped (1.5 − 2)² = 0.25 ; clipped V = 1.2 → (1.2 − 2)² = 0.64 ; ½ max = 0.32
    # V = 1.1: both errors (1.1 − 2)² = 0.81 → ½ · 0.81 = 0.405, gradient ½ · 2 · (1.1 − 2) = −0.9
    values = torch.tensor([[1.5, 1.1]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    assert loss.item() == pytest.approx((0.32 + 0.405) / 2)
    assert metrics["vf_clip_frac"].item() == 0.5
    torch.testing.assert_close(
        grad_of(loss, values), torch.tensor([[0.0, -0.9 / 2]], dtype=torch.float64)
    )
    # without a clip: ½ (0.25 + 0.81) / 2
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.81) / 2)
    assert metrics["vf_clip_frac"].item() == 0.0


def test_value_clip_frac_ignores_last_bit_rounding():
    # |V − V_old| = 0.059 < c = 0.2: the clip does not bind, but in float64
    # V_old + (V − V_old) is V − 3.5e-18, whose error is larger by 7e-18.
    v, v_old, r = 0.01829948726200419, 0.07739375860330931, 0.20852995374718417
    values, old, returns = (torch.tensor([[x]], dtype=torch.float64) for x in (v, v_old, r))
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 1), clip=0.2)
    assert metrics["vf_clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (v - r) ** 2)


def test_value_clip_frac_counts_only_the_clip_that_decides_the_loss():
    # V_old = 1, c = 0.2, R = 2: V = 1.5 is clipped to 1.2, farther from R → counted;
    # V = 0.5 is clipped to 0.8, nearer to R → the unclipped error is taken, not counted
    values = torch.tensor([[1.5, 0.5]], dtype=torch.float64)
    old = torch.ones(1, 2, dtype=torch.float64)
    returns = torch.full((1, 2), 2.0, dtype=torch.float64)
    _, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    assert metrics["vf_clip_frac"].item() == 0.5


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third row is empty (filtered)


@pytest.mark.parametrize(
    "agg, expected, weight",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4, 4),  # 2.5 over 4 valid tokens
        ("seq-mean-token-mean", (2 + 4) / 2, 2),  # row means 2 and 4; the empty row is absent
        ("seq-mean-token-sum", (6 + 4) / 2, 2),  # row sums 6 and 4
        ("seq-mean-token-sum-norm", 10 / (3 * 3), 3),  # Σ / (B · T) with all 3 rows, T = 3
    ],
)
def test_aggregate_loss_by_hand(agg, expected, weight):
    assert aggregate_loss(LOSS, MASK, agg).item() == pytest.approx(expected)
    assert aggregation_weight(MASK, agg).item() == weight


def test_dr_grpo_uses_max_len():
    # Σ / (B · max_len) = 10 / (3 · 5)
    loss = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=5)
    assert loss.item() == pytest.approx(10 / 15)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate_loss(LOSS, MASK, "mean")
    logp, old = logps([1.0], requires_grad=False)
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), level="seq")


def test_rollout_correction_weights_multiply_the_policy_gradient_term():
    # The hand example above with weights w = (0.5, 2, 0, 1):
    #   ℓ = (−1.2·0.5 + 0.8·2 + 2.0·0 − 0.5·1) / 4 = (−0.6 + 1.6 + 0 − 0.5) / 4 = 0.125
    #   dℓ/dlogp = w · (0, 0, 2.0, −0.5) / 4 = (0, 0, 0, −0.5) / 4
    logp, old = logps([1.5, 0.5, 2.0, 0.5])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, 2.0, 0.0, 1.0]], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 4), is_weights=w)
    assert loss.item() == pytest.approx(0.125)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, 0.0, 0.0, -0.5]], dtype=torch.float64) / 4)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)  # the ratio metrics do not see the weights


@pytest.mark.parametrize("level,agg", [("token", "token-mean"), ("sequence", "seq-mean-token-mean"),
                                       ("token", "seq-mean-token-sum-norm")])
def test_weights_of_one_leave_every_loss_as_it_was(level, agg):
    # PPO / GRPO (token), GSPO (sequence), Dr.GRPO (sum-norm): w = 1 on valid tokens is no correction
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    old, adv = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    ones = torch.where(mask.bool(), 1.0, 7.0).double()  # padding's weight is never read
    plain, _ = policy_loss(logp, old, adv, mask, level=level, agg=agg, max_len=5)
    weighted, _ = policy_loss(logp, old, adv, mask, level=level, agg=agg, max_len=5, is_weights=ones)
    assert weighted.item() == plain.item()
    torch.testing.assert_close(grad_of(weighted, logp), grad_of(plain, logp), rtol=0, atol=0)
