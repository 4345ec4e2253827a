"""Rollout correction (TIS, IcePop, MIS) and the engine–trainer gap metrics: hand numbers."""

import math

import pytest
import torch

import posttrain.algos
from posttrain.algos import rollout_correction, rollout_gap_metrics

LN = math.log


def pair(ratios, mask=None):
    """(old_logp, rollout_logp, mask) with exp(old − rollout) = ratios (B, T); padding holds NaN."""
    ratios = torch.tensor(ratios, dtype=torch.float64)
    rollout = torch.full_like(ratios, LN(0.25))
    old = rollout + ratios.log()
    mask = torch.ones_like(ratios, dtype=torch.long) if mask is None else torch.tensor(mask)
    return old.masked_fill(mask == 0, math.nan), rollout.masked_fill(mask == 0, math.nan), mask


def close(metrics, key, value):
    assert metrics[f"rollout_corr/{key}"].item() == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_signature_is_the_documented_one():
    assert posttrain.algos.rollout_correction is rollout_correction
    old, rollout, mask = pair([[1.0, 1.0]])
    weights, metrics = posttrain.algos.rollout_correction(old, rollout, mask, level="token", mode="truncate",
                                                          c_low=None, c_high=2.0)
    assert weights.shape == (1, 2) and isinstance(metrics, dict)


def test_token_tis_truncates_each_ratio_at_c():
    # w_t = min(r_t, 2): r = (0.5, 1.5, 4) → (0.5, 1.5, 2); padding → 0
    old, rollout, mask = pair([[0.5, 1.5, 4.0, 1.0]], [[1, 1, 1, 0]])
    w, m = rollout_correction(old, rollout, mask, "token", "truncate", c_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 0.0]], dtype=torch.float64))
    close(m, "rollout_is_mean", (0.5 + 1.5 + 4.0) / 3)  # before truncation, as veRL
    close(m, "rollout_is_max", 4.0)
    close(m, "rollout_is_min", 0.5)
    # ESS = (mean w)² / mean(w²) = (4/3)² / ((0.25 + 2.25 + 4)/3) = (16/9) / (6.5/3) = 32/39
    close(m, "rollout_is_eff_sample_size", 32 / 39)
    close(m, "rollout_rs_masked_fraction", 0.0)


def test_token_tis_with_a_lower_bound_clips_from_below():
    old, rollout, mask = pair([[0.5, 1.5, 4.0]])
    w, _ = rollout_correction(old, rollout, mask, "token", "truncate", c_low=0.8, c_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.8, 1.5, 2.0]], dtype=torch.float64))


def test_sequence_tis_takes_the_product_and_broadcasts_it():
    # row 0: 0.5 · 1.5 · 2 = 1.5 (under C = 2); row 1: 3 · 1 = 3 → 2; row 1's last token is padding
    old, rollout, mask = pair([[0.5, 1.5, 2.0], [3.0, 1.0, 9.0]], [[1, 1, 1], [1, 1, 0]])
    w, m = rollout_correction(old, rollout, mask, "sequence", "truncate", c_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]], dtype=torch.float64))
    close(m, "rollout_is_max", 3.0)
    close(m, "rollout_is_mean", (3 * 1.5 + 2 * 3.0) / 5)  # per token: each row's ratio on its valid tokens


def test_token_mask_zeroes_ratios_outside_the_bounds_and_keeps_the_others():
    # IcePop with [0.5, 2]: r = (0.4, 0.5, 1.2, 2.0, 2.5) → (0, 0.5, 1.2, 2.0, 0)
    old, rollout, mask = pair([[0.4, 0.5, 1.2, 2.0, 2.5]])
    w, m = rollout_correction(old, rollout, mask, "token", "mask", c_low=0.5, c_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.2, 2.0, 0.0]], dtype=torch.float64), atol=1e-12, rtol=0)
    close(m, "rollout_rs_masked_fraction", 2 / 5)
    # ESS = (3.7/5)² / ((0.25 + 1.44 + 4)/5) = 0.5476 / 1.138
    close(m, "rollout_is_eff_sample_size", (3.7 / 5) ** 2 / (5.69 / 5))


def test_sequence_mask_bounds_the_geometric_mean():
    # row 0: ratios (4, 0.25, 2, 0.5): product 1 but geometric mean 1, kept with weight 1;
    # row 1: (4, 4, 4, 4): geometric mean 4 > 2, masked;
    # row 2: (1.21, 1.21 | pad): geometric mean 1.21, kept; a product bound (1.4641) would keep it too,
    #        but row 3, 16 tokens of 1.1 (product 4.59 > 2, geometric mean 1.1), is kept only by the mean
    old, rollout, mask = pair([[4.0, 0.25, 2.0, 0.5], [4.0] * 4, [1.21, 1.21, 1.0, 1.0]],
                              [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    w, m = rollout_correction(old, rollout, mask, "sequence", "mask", c_low=0.5, c_high=2.0)
    expected = torch.tensor([[1.0] * 4, [0.0] * 4, [1.21, 1.21, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, atol=1e-12, rtol=0)
    close(m, "rollout_rs_masked_fraction", 4 / 10)
    long_old, long_rollout, long_mask = pair([[1.1] * 16])
    w, _ = rollout_correction(long_old, long_rollout, long_mask, "sequence", "mask", c_low=0.5, c_high=2.0)
    torch.testing.assert_close(w, torch.full((1, 16), 1.1, dtype=torch.float64))


def test_gap_metrics_by_hand():
    # row 0: δ = (ln 2, 0), row 1: δ = (−ln 2 | pad).  Means over the 3 valid tokens:
    #   kl = mean(−δ) = (−ln 2 + 0 + ln 2) / 3 = 0
    #   k3 = mean(e^δ − δ − 1) = ((1 − ln 2) + 0 + (0.5 + ln 2 − 1)) / 3 = 0.5 / 3
    #   per row d = (ln 2 / 2, −ln 2): log_ppl_abs_diff = (ln 2 / 2 + ln 2) / 2 = 0.75 ln 2
    #   ppl_ratio = mean(exp(−d)) = (2^−0.5 + 2) / 2
    old, rollout, mask = pair([[2.0, 1.0], [0.5, 1.0]], [[1, 1], [1, 0]])
    m = rollout_gap_metrics(old, rollout, mask)
    close(m, "kl", 0.0)
    close(m, "k3_kl", 0.5 / 3)
    close(m, "log_ppl_abs_diff", 0.75 * LN(2))
    close(m, "ppl_ratio", (2**-0.5 + 2) / 2)
    _, with_weights = rollout_correction(old, rollout, mask)
    assert {k: v.item() for k, v in m.items()} == {k: with_weights[k].item() for k in m}


def test_an_engine_that_agrees_shows_no_gap_and_weights_of_one():
    logp = torch.randn(4, 6, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = 0
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w, m = rollout_correction(logp, logp.clone(), mask, level, mode, c_low=0.5)
            torch.testing.assert_close(w, mask.double())
            close(m, "kl", 0.0)
            close(m, "k3_kl", 0.0)
            close(m, "log_ppl_abs_diff", 0.0)
            close(m, "ppl_ratio", 1.0)
            close(m, "rollout_is_eff_sample_size", 1.0)


def test_bad_bounds_and_names_are_refused():
    old, rollout, mask = pair([[1.0]])
    with pytest.raises(ValueError, match="c_low < c_high"):
        rollout_correction(old, rollout, mask, c_low=3.0, c_high=2.0)
    with pytest.raises(ValueError, match="rollout correction level"):
        rollout_correction(old, rollout, mask, level="geometric")
    with pytest.raises(ValueError, match="rollout correction mode"):
        rollout_correction(old, rollout, mask, mode="clip")
