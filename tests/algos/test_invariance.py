"""Invariances: splitting a batch, and padding that never changes a result.

Padding tests append columns whose mask is 0 and whose values are garbage
(huge, inf, nan) and check every result on the original columns is unchanged
and every padded output is 0.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import (
    AGG_MODES,
    aggregate_loss,
    aggregation_weight,
    compute_gae,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    reinforce_pp_advantages,
    value_loss,
)

FAST = settings(max_examples=30, deadline=None)


@st.composite
def batches(draw, interior_zeros=True):
    """(B, T) mask with ≥ 1 valid token per row, extra padding width, and a seed."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t) < lengths[:, None]
    if interior_zeros and draw(st.booleans()):
        mask &= torch.rand(b, t, generator=gen) > 0.3
        mask[:, 0] = True
    return mask, draw(st.integers(1, 4)), gen


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def pad(x, width, gen):
    """Append `width` garbage columns: huge values, inf and nan."""
    garbage = randn(gen, *x.shape[:-1], width) * 1e6
    garbage.view(-1)[::3] = float("inf")
    garbage.view(-1)[1::3] = float("nan")
    return torch.cat([x, garbage.to(x.dtype)], dim=-1)


def pad_mask(mask, width):
    return torch.cat([mask, torch.zeros(*mask.shape[:-1], width, dtype=mask.dtype)], dim=-1)


@FAST
@given(batches())
def test_masked_reductions_ignore_padding(case):
    mask, width, gen = case
    x = randn(gen, *mask.shape)
    xp, mp = pad(x, width, gen), pad_mask(mask, width)
    for fn in (masked_mean, masked_sum):
        torch.testing.assert_close(fn(xp, mp), fn(x, mask))
        torch.testing.assert_close(fn(xp, mp, dim=-1), fn(x, mask, dim=-1))
    torch.testing.assert_close(masked_var(xp, mp), masked_var(x, mask))
    whitened = masked_whiten(xp, mp)
    torch.testing.assert_close(whitened[..., : x.shape[-1]], masked_whiten(x, mask))
    assert (whitened[..., x.shape[-1] :] == 0).all()


@FAST
@given(batches(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_ignores_padding(case, gamma, lam):
    mask, width, gen = case
    rewards, values = randn(gen, *mask.shape), randn(gen, *mask.shape)
    mp = pad_mask(mask, width)
    adv_p, ret_p = compute_gae(pad(rewards, width, gen), pad(values, width, gen), mp, gamma, lam)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    t = mask.shape[-1]
    torch.testing.assert_close(adv_p[..., :t], adv)
    torch.testing.assert_close(ret_p[..., :t], ret)
    assert (adv_p[..., t:] == 0).all() and (ret_p[..., t:] == 0).all()


@FAST
@given(batches(), st.floats(0.5, 1.0))
def test_reinforce_pp_ignores_padding(case, gamma):
    mask, width, gen = case
    rewards = randn(gen, *mask.shape)
    adv_p = reinforce_pp_advantages(pad(rewards, width, gen), pad_mask(mask, width), gamma)
    t = mask.shape[-1]
    torch.testing.assert_close(adv_p[..., :t], reinforce_pp_advantages(rewards, mask, gamma))
    assert (adv_p[..., t:] == 0).all()


def _agg_kwargs(agg):
    # Dr.GRPO divides by max_len, which must not follow the padded width
    return {"max_len": 8} if agg == "seq-mean-token-sum-norm" else {}


@FAST
@given(batches(), st.sampled_from(sorted(AGG_MODES)))
def test_aggregate_loss_ignores_padding(case, agg):
    mask, width, gen = case
    loss = randn(gen, *mask.shape)
    padded = aggregate_loss(pad(loss, width, gen), pad_mask(mask, width), agg, **_agg_kwargs(agg))
    torch.testing.assert_close(padded, aggregate_loss(loss, mask, agg, **_agg_kwargs(agg)))


@FAST
@given(
    batches(),
    st.sampled_from(sorted(AGG_MODES)),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from([None, 3.0]),
    st.booleans(),
)
def test_policy_loss_ignores_padding(case, agg, level, dual_clip, token_adv):
    mask, width, gen = case
    old = randn(gen, *mask.shape)
    logp = old + 0.3 * randn(gen, *mask.shape)
    adv = randn(gen, *mask.shape) if token_adv else randn(gen, mask.shape[0])
    kwargs = dict(level=level, dual_clip=dual_clip, agg=agg, **_agg_kwargs(agg))

    logp_p = pad(logp, width, gen).requires_grad_()
    adv_p = pad(adv, width, gen) if token_adv else adv
    loss_p, metrics_p = policy_loss(
        logp_p, pad(old, width, gen), adv_p, pad_mask(mask, width), **kwargs
    )
    logp.requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask, **kwargs)

    torch.testing.assert_close(loss_p, loss)
    for key, value in metrics.items():
        torch.testing.assert_close(metrics_p[key], value)
    (grad_p,) = torch.autograd.grad(loss_p, logp_p)
    (grad,) = torch.autograd.grad(loss, logp)
    t = mask.shape[-1]
    torch.testing.assert_close(grad_p[..., :t], grad)
    assert (grad_p[..., t:] == 0).all()


@FAST
@given(batches(), st.sampled_from([None, 0.2]), st.sampled_from(sorted(AGG_MODES)))
def test_value_loss_ignores_padding(case, clip, agg):
    mask, width, gen = case
    old, returns = randn(gen, *mask.shape), randn(gen, *mask.shape)
    values = old + 0.3 * randn(gen, *mask.shape)
    mp = pad_mask(mask, width)
    values_p = pad(values, width, gen).requires_grad_()
    if agg == "seq-mean-token-sum-norm":
        agg = "token-mean"  # value_loss takes no max_len: Dr.GRPO's T-based default is padding-dependent
    loss_p, metrics_p = value_loss(
        values_p, pad(old, width, gen), pad(returns, width, gen), mp, clip, agg
    )
    values.requires_grad_()
    loss, metrics = value_loss(values, old, returns, mask, clip, agg)
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(metrics_p["vf_clip_frac"], metrics["vf_clip_frac"])
    (grad_p,) = torch.autograd.grad(loss_p, values_p)
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad_p[..., : mask.shape[-1]], grad)
    assert (grad_p[..., mask.shape[-1] :] == 0).all()


def _split_batch():
    """A batch of 6 rows, one empty; parts trimmed to their own padded width."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 0, 3, 2, 2])
    mask = torch.arange(5) < lengths[:, None]
    parts = [slice(0, 2), slice(2, 6)]
    widths = [int(lengths[part].max()) for part in parts]
    return gen, mask, parts, widths


@pytest.mark.parametrize("agg", sorted(AGG_MODES))
def test_split_batch_weighted_by_aggregation_weight(agg):
    gen, mask, parts, widths = _split_batch()
    loss = randn(gen, *mask.shape)
    full = aggregate_loss(loss, mask, agg, max_len=5)
    weights = [aggregation_weight(mask[p, :w], agg) for p, w in zip(parts, widths)]
    losses = [
        aggregate_loss(loss[p, :w], mask[p, :w], agg, max_len=5) for p, w in zip(parts, widths)
    ]
    combined = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
    torch.testing.assert_close(combined, full)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", sorted(AGG_MODES))
def test_split_batch_policy_loss_and_gradient(agg, level):
    # Σ_k w_k · loss_k / Σ_k w_k over micro-batches gives the full-batch loss and gradient.
    gen, mask, parts, widths = _split_batch()
    old = randn(gen, *mask.shape)
    logp = (old + 0.3 * randn(gen, *mask.shape)).requires_grad_()
    adv = randn(gen, mask.shape[0])
    kwargs = dict(level=level, agg=agg, max_len=5, dual_clip=3.0)
    full, _ = policy_loss(logp, old, adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, logp)

    total = sum(aggregation_weight(mask[p, :w], agg) for p, w in zip(parts, widths))
    combined = 0.0
    for p, w in zip(parts, widths):
        part, _ = policy_loss(logp[p, :w], old[p, :w], adv[p], mask[p, :w], **kwargs)
        combined = combined + aggregation_weight(mask[p, :w], agg) / total * part
    torch.testing.assert_close(combined, full)
    (grad,) = torch.autograd.grad(combined, logp)
    torch.testing.assert_close(grad, full_grad)
