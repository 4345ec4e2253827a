"""KL estimators and controllers against hand numbers."""

import math

import pytest
import torch

from posttrain.algos import AdaptiveKLController, FixedKLController, kl_penalty


def test_kl_kinds_by_hand():
    # π = 0.5, π_ref = 0.25: d = ln 2 = 0.693147
    #   k1 = d ; k2 = d²/2 = 0.240227 ; abs = d
    #   k3 = r − ln r − 1 with r = π_ref/π = 0.5: 0.5 + 0.693147 − 1 = 0.193147
    logp, ref_logp = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert kl_penalty(logp, ref_logp, "k1").item() == pytest.approx(d)
    assert kl_penalty(logp, ref_logp, "k2").item() == pytest.approx(d * d / 2)
    assert kl_penalty(logp, ref_logp, "k3").item() == pytest.approx(0.5 + d - 1)
    assert kl_penalty(logp, ref_logp, "abs").item() == pytest.approx(d)
    # swapped: d = −ln 2 → k1 negative, k3 = 2 − ln 2 − 1 = 0.306853
    assert kl_penalty(ref_logp, logp, "k1").item() == pytest.approx(-d)
    assert kl_penalty(ref_logp, logp, "k3").item() == pytest.approx(1 - d)
    assert kl_penalty(ref_logp, logp, "abs").item() == pytest.approx(d)


def test_k3_is_clamped_as_verl():
    # ref − logp = 50 → clamped to 20 → e^20 − 21 → clamped to 10; −50 → e^-20 + 19 → 10
    out = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([50.0, -50.0]), "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))
    assert kl_penalty(torch.zeros(3), torch.zeros(3), "k3").eq(0).all()


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    # E_{v∼π}[k(v)] over a categorical π equals KL(π ‖ π_ref) exactly for k1 and k3
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    ref_logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    exact = (logp.exp() * (logp - ref_logp)).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((logp.exp() * kl_penalty(logp, ref_logp, kind)).sum(), exact)


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "low_var")


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=64)
    assert ctl.value == 0.05


def test_adaptive_controller_by_hand():
    # target 6, horizon 10000, 256 samples per step:
    #   kl = 9 → e = clip(9/6 − 1) = clip(0.5) = 0.2 → β · (1 + 0.2 · 256/10000) = 0.1 · 1.00512
    #   kl = 3 → e = clip(−0.5) = −0.2 → β · (1 − 0.00512)
    #   kl = 6.6 → e = 0.1 → β · 1.00256
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    ctl.update(torch.tensor(3.0), 256)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(6.6, 256)
    assert ctl.value == pytest.approx(0.1 * 1.00256)
