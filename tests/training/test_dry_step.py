"""The dry run of an optimizer step (`training.dry_step`): the would-be weights are the real
AdamW (and SGD) step's bit for bit, for every setting, and computing them changes nothing."""

import pytest
import torch

from posttrain.config.sections import TrainerConfig
from posttrain.models import BuiltinLM
from posttrain.training.core import build_optimizer
from posttrain.training.dry_step import (
    _chunks,
    _cleared,
    adamw_bound,
    dry_steps,
    max_abs,
    update_finite,
)


def snapshot(optimizer):
    """Copies of every weight and every optimizer-state tensor (and the step counts)."""
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return params, state


def assert_same(optimizer, snap):
    params, state = snap
    assert all(torch.equal(a, p) for a, p in zip(params, (p for g in optimizer.param_groups for p in g["params"])))
    assert {id(p) for p in optimizer.state} == set(state)
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())


def would_be(optimizer):
    """{param: its would-be weight} from the dry run, kept (the dry run frees them as it goes)."""
    return {p: w.clone() for chunk, weights in dry_steps(optimizer) for p, w in zip(chunk, weights)}


def many_shapes():
    """Parameters of several sizes (an embedding larger than the rest together, small vectors
    that share a chunk) and one without a gradient."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in [(40, 6), (6, 6), (6,), (6,), (3, 6), (1,)]]


SETTINGS = {
    "default": {},
    "foreach": {"foreach": True},
    "single_tensor": {"foreach": False},
    "amsgrad_maximize": {"amsgrad": True, "maximize": True, "foreach": True},
    "no_decay_high_lr": {"weight_decay": 0.0, "lr": 3.0, "betas": (0.5, 0.9), "eps": 1e-3},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_dry_run_gives_the_real_step_s_weights_bit_for_bit_and_changes_nothing(name):
    params = many_shapes()
    opt = torch.optim.AdamW([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "lr": 0.3}],
                            **{"lr": 0.05, **SETTINGS[name]})
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # the first step makes the state, the next ones read it
        for p in params[:-1]:
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
        params[-1].grad = None  # no gradient: no step for it in either
        snap = snapshot(opt)
        predicted = would_be(opt)
        assert_same(opt, snap)  # the dry run touched no weight and no state (nor made any)
        opt.step()
        assert set(predicted) == set(params[:-1])
        for p, w in predicted.items():
            assert torch.equal(w, p.detach()), (name, p.shape)
        assert not torch.equal(snap[0][0], params[0].detach())  # the real step did move the weights


def test_the_dry_run_of_the_builtin_model_s_optimizer_is_its_step():
    """The optimizer `build_optimizer` makes (two groups, decay on matrices only) over the
    built-in model, after a real backward."""
    torch.manual_seed(0)
    model = BuiltinLM.from_preset("tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2)
    opt = build_optimizer(model, TrainerConfig(learning_rate=1e-2, weight_decay=0.1))
    ids = torch.randint(0, 32, (2, 8))
    for _ in range(2):
        model(ids).float().logsumexp(-1).sum().backward()
        predicted = would_be(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(torch.equal(w, p.detach()) for p, w in predicted.items()) and len(predicted) > 5


def test_chunks_hold_at_most_the_largest_parameter():
    params = many_shapes()  # numel 240, 36, 6, 6, 18, 1
    assert [[p.numel() for p in c] for c in _chunks(params)] == [[240], [36, 6, 6, 18, 1]]


def test_an_update_past_the_float_range_is_found_and_a_good_one_is_not():
    top = torch.finfo(torch.float32).max  # 3.4028e38
    w = torch.nn.Parameter(torch.tensor([top, 1.0]))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    w.grad = torch.tensor([-1.0, 1.0])  # Adam's first step moves each weight by lr, w[0] up
    assert update_finite(opt)  # 3.4028e38 + 0.1 rounds to itself: finite
    opt.param_groups[0]["lr"] = 1e37  # 3.4028e38 + 1e37 is past the float32 range
    snap = snapshot(opt)
    assert not update_finite(opt)
    assert_same(opt, snap)


def test_the_verdict_is_agreed_over_the_ranks():
    class OtherRankOverflows:
        def all_max(self, values):
            return [max(values[0], 1.0)]

    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    opt = torch.optim.AdamW([w], lr=0.1)
    assert update_finite(opt) and not update_finite(opt, OtherRankOverflows())


@pytest.mark.parametrize("foreach", [False, True])
def test_the_dry_run_of_sgd_with_momentum_is_its_step(foreach):
    """SGD: the tests' optimizer (lr 1: the update is the gradient), also stepped by `train_step`."""
    params = many_shapes()
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=foreach)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        predicted = would_be(opt)
        opt.step()
        assert all(torch.equal(w, p.detach()) for p, w in predicted.items()) and len(predicted) == len(params)


def test_an_optimizer_without_a_dry_run_is_refused_by_name():
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    with pytest.raises(TypeError, match="dry-run for AdamW or SGD, not Adam"):
        update_finite(torch.optim.Adam([w], lr=0.1))


def test_adamw_bound_by_hand():
    # step 1: bc1 = 1 − 0.9 = 0.1, |m'| ≤ 0.9·0 + 0.1·1 = 0.1, lr/bc1 = 1, |m'|/eps = 1e7;
    # |w'| ≤ 2·|1 − 0.1·0.01| + 1·1e7 = 1.998 + 1e7.
    assert adamw_bound(2.0, 0.0, 1.0, 1, 0.1, (0.9, 0.999), 1e-8, 0.01) == pytest.approx(1e7 + 1.998)
    # step 2: bc1 = 0.19, |m'| ≤ 0.9·0.5 + 0.1·1 = 0.55, lr/bc1 = 0.1/0.19, |m'|/eps = 5.5.
    assert adamw_bound(10.0, 0.5, 1.0, 2, 0.1, (0.9, 0.999), 0.1, 0.0) == pytest.approx(10.0 + 0.1 / 0.19 * 5.5)
    assert adamw_bound(float("nan"), 0.0, 1.0, 1, 0.1, (0.9, 0.999), 1e-8, 0.0) == float("inf")


@pytest.mark.parametrize("seed", range(4))
def test_adamw_bound_holds_over_real_steps(seed):
    """After each real step, every |w| is within the bound computed before it (up to float32
    rounding, which `SAFE_FRACTION` leaves room for)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(50, generator=gen) * 10)
    opt = torch.optim.AdamW([w], lr=[0.5, 3.0, 1e-3, 1e3][seed], betas=(0.8, 0.99), eps=[1e-8, 1e-2, 1e-8, 1.0][seed],
                            weight_decay=0.3, amsgrad=seed % 2 == 1)
    for _ in range(5):
        w.grad = torch.randn(50, generator=gen) * 2
        state = opt.state.get(w, {})
        w_max, m_max, g_max = max_abs([w, state.get("exp_avg"), w.grad])
        bound = adamw_bound(w_max, m_max, g_max, int(state["step"]) + 1 if state else 1, opt.param_groups[0]["lr"],
                            (0.8, 0.99), opt.param_groups[0]["eps"], 0.3)
        opt.step()
        assert float(w.detach().abs().max()) <= bound * (1 + 1e-6)


def test_the_bound_clears_a_sane_tensor_and_leaves_one_at_the_float_range_to_the_dry_run():
    top = torch.finfo(torch.float32).max
    params = [torch.nn.Parameter(torch.tensor([top, 1.0])), torch.nn.Parameter(torch.ones(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert _cleared(opt, opt.param_groups[0], params) == [False, True]
    sgd = torch.optim.SGD(params, lr=1e-3)  # no bound for SGD: always the dry run
    assert _cleared(sgd, sgd.param_groups[0], params) == [False, False]
