"""The shared training core: schedule, optimizer groups, accumulation, NaN handling."""

import math
import random

import numpy as np
import pytest
import torch

from posttrain.config.core import ConfigError
from posttrain.config.sections import TrainerConfig
from posttrain.models import BuiltinLM
from posttrain.training.core import (
    BadStepGuard,
    StepResult,
    TrainingDiverged,
    autocast,
    build_optimizer,
    build_scheduler,
    lr_factor,
    merge_metrics,
    resolve_precision,
    set_seed,
    train_step,
)

# --- learning-rate schedule -------------------------------------------------------------


def lrs_over(kind: str, steps: int, **cfg_fields) -> list[float]:
    """The lr used at optimizer steps 0..steps-1 (peak 1.0, total 6 steps)."""
    cfg = TrainerConfig(learning_rate=1.0, lr_scheduler=kind, **cfg_fields)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    sched = build_scheduler(opt, cfg, total_steps=6)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_cosine_with_warmup_and_floor_by_hand():
    # W = 2, total 6, m = 0.1: warmup s/W; then p = (s-2)/4 and m + (1-m)·½(1+cos πp).
    # s=3: p=¼, 0.1 + 0.45·(1 + 0.707107) = 0.868198;  s=4: p=½, 0.1 + 0.45 = 0.55
    # s=5: p=¾, 0.1 + 0.45·(1 − 0.707107) = 0.231802;  s≥6: the floor 0.1, held.
    got = lrs_over("cosine", 8, warmup_steps=2, min_lr_ratio=0.1)
    want = [0.0, 0.5, 1.0, 0.868198, 0.55, 0.231802, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-6)


def test_linear_and_constant_by_hand():
    # linear, W = 2, total 6, m = 0: 1 − (s−2)/4 after warmup, 0 from s = 6 on.
    assert lrs_over("linear", 8, warmup_steps=2) == pytest.approx(
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    )
    # linear with a floor of 0.2: 0.2 + 0.8 · (1 − s/6) without warmup.
    assert lrs_over("linear", 4, min_lr_ratio=0.2) == pytest.approx(
        [1.0, 0.2 + 0.8 * 5 / 6, 0.2 + 0.8 * 4 / 6, 0.6]
    )
    assert lrs_over("constant", 5, warmup_steps=4) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_schedule_matches_transformers():
    from transformers.optimization import (
        get_cosine_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    total, warmup = 20, 3
    references = {
        ("cosine", 0.0): lambda opt: get_cosine_schedule_with_warmup(opt, warmup, total),
        ("linear", 0.0): lambda opt: get_linear_schedule_with_warmup(opt, warmup, total),
        ("cosine", 0.1): lambda opt: get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=0.1
        ),
    }
    for (kind, floor), make in references.items():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        ref = make(opt)
        for step in range(total + 1):
            ours = lr_factor(step, kind, warmup, total, floor)
            assert ours == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12), (kind, step)


def test_lr_schedule_steps_stops_a_longer_schedule_part_way():
    # max_steps=4 of an 8-step linear decay: 1 − s/8 (not 1 − s/4). An actor whose schedule
    # starts one step later (total_steps = max_steps − 1) spans 8 − 1 = 7: 1 − s/7.
    cfg = TrainerConfig(learning_rate=1.0, lr_scheduler="linear", max_steps=4, lr_schedule_steps=8)
    for total, want in ((4, [1.0, 0.875, 0.75, 0.625]), (3, [1.0, 6 / 7, 5 / 7])):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = build_scheduler(opt, cfg, total_steps=total)
        got = []
        for _ in want:
            got.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert got == pytest.approx(want)
    with pytest.raises(ConfigError, match="trainer.lr_schedule_steps"):
        TrainerConfig(max_steps=4, lr_schedule_steps=3).validate()


def test_unknown_scheduler_is_rejected_when_built():
    cfg = TrainerConfig(lr_scheduler="exponential")  # type: ignore[arg-type]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="exponential"):
        build_scheduler(opt, cfg, total_steps=10)


# --- optimizer --------------------------------------------------------------------------


def test_optimizer_groups_decay_only_matrices_and_skip_frozen():
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 10)
    )
    model[2].weight = model[0].weight  # tied: must appear once
    model[1].bias.requires_grad_(False)
    cfg = TrainerConfig(weight_decay=0.1, adam_betas=[0.8, 0.95], adam_eps=1e-6, learning_rate=3e-4)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert [p is model[0].weight for p in decay["params"]] == [True]
    assert decay["weight_decay"] == 0.1
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[2].bias)}
    assert no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.95) and decay["eps"] == 1e-6 and decay["lr"] == 3e-4


# --- gradient accumulation --------------------------------------------------------------

# Lengths chosen so the micro-batches hold very different token counts: a mean of
# per-micro-batch means would weight the short sequences' tokens far more.
LENGTHS = [12, 11, 10, 9, 3, 3, 2, 2]
VOCAB = 64


def make_batch(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence of this micro-batch."""
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def token_sum_loss(model, batch):
    """Σ next-token cross-entropy over real targets, and their count."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])  # (B, T, V)
    valid = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()  # (B, T-1)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
    ).view_as(valid)
    n = int(valid.sum())
    loss_sum = torch.where(valid, ce, 0.0).sum()
    return loss_sum, n, {"ce": loss_sum.detach() / n}  # a per-token mean: merged exactly


def micro_batch_mean_loss(model, batch):
    """The bug this core avoids: each micro-batch's own token-mean, averaged over micro-batches."""
    loss_sum, n, metrics = token_sum_loss(model, batch)
    return loss_sum / n, 1, metrics


def sgd_update(model, micro_batches, loss_fn, max_grad_norm):
    """One step of SGD with lr 1 on a fresh copy of `model`: returns (result, −Δθ = clipped grad)."""
    torch.manual_seed(0)
    copy = BuiltinLM.from_preset("tiny", vocab_size=VOCAB)
    copy.load_state_dict(model.state_dict())
    before = [p.detach().clone() for p in copy.parameters()]
    opt = torch.optim.SGD(copy.parameters(), lr=1.0)
    result = train_step(copy, micro_batches, loss_fn, opt, None, max_grad_norm)
    return result, [b - p.detach() for b, p in zip(before, copy.parameters())]


@pytest.fixture(scope="module")
def tiny_lm_and_sequences():
    set_seed(0)
    model = BuiltinLM.from_preset("tiny", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    return model, seqs


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_accumulation_equals_one_big_batch(tiny_lm_and_sequences, micro):
    model, seqs = tiny_lm_and_sequences
    big, big_grad = sgd_update(model, [make_batch(seqs)], token_sum_loss, max_grad_norm=0.1)
    parts = [make_batch(seqs[i : i + micro]) for i in range(0, len(seqs), micro)]
    acc, acc_grad = sgd_update(model, parts, token_sum_loss, max_grad_norm=0.1)

    assert big.grad_norm > 0.1  # clipping was active: the division must come before it
    assert acc.n_tokens == big.n_tokens == sum(n - 1 for n in LENGTHS)
    assert acc.loss == pytest.approx(big.loss, abs=1e-5)
    assert acc.grad_norm == pytest.approx(big.grad_norm, abs=1e-5)
    assert acc.metrics["ce"] == pytest.approx(big.loss, abs=1e-5)
    for a, b in zip(acc_grad, big_grad):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_mean_of_micro_batch_means_differs(tiny_lm_and_sequences):
    """Negative control: the per-micro-batch mean the contract forbids breaks invariance."""
    model, seqs = tiny_lm_and_sequences
    big, big_grad = sgd_update(model, [make_batch(seqs)], token_sum_loss, max_grad_norm=0.0)
    parts = [make_batch(seqs[i : i + 2]) for i in range(0, len(seqs), 2)]
    bad, bad_grad = sgd_update(model, parts, micro_batch_mean_loss, max_grad_norm=0.0)
    assert abs(bad.loss - big.loss) > 1e-3
    assert max((a - b).abs().max().item() for a, b in zip(bad_grad, big_grad)) > 1e-4


def test_bf16_step_runs_and_keeps_fp32_weights(tiny_lm_and_sequences):
    model, seqs = tiny_lm_and_sequences
    copy = BuiltinLM.from_preset("tiny", vocab_size=VOCAB)
    copy.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(copy.parameters(), lr=0.1)
    result = train_step(copy, [make_batch(seqs[:2])], token_sum_loss, opt, None, 1.0, "bf16")
    assert not result.skipped and math.isfinite(result.loss)
    assert all(p.dtype == torch.float32 for p in copy.parameters())


def test_autocast():
    x = torch.randn(2, 2)
    with autocast("bf16", "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    with autocast("fp32", torch.device("cpu")):
        assert (x @ x).dtype == torch.float32
    with autocast("auto", "cpu"):  # auto is fp32 off CUDA
        assert (x @ x).dtype == torch.float32
    with pytest.raises(ValueError, match="fp16"):
        autocast("fp16", "cpu")


def test_auto_precision_is_fp32_on_cpu_and_explicit_values_pass_through():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("fp32", "cuda") == "fp32"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_precision_is_bf16_on_a_bf16_gpu():
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert resolve_precision("auto", "cuda") == expected


def test_merge_metrics_weights_by_units_and_keeps_extremes():
    merged = merge_metrics(
        [
            (3, {"acc": 1.0, "len/max": 5, "len/min": 2}),
            (1, {"acc": torch.tensor(0.0), "len/max": 9, "len/min": 4}),
        ]
    )
    assert merged == {"acc": 0.75, "len/max": 9.0, "len/min": 2.0}
    assert merge_metrics([(0, {"acc": 1.0}), (0, {"acc": 0.0})]) == {"acc": 0.5}


# --- NaN/inf steps ----------------------------------------------------------------------


def linear_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def scaled_loss(scale):
    def loss_fn(model, x):
        return model(x).sum() * scale, x.shape[0], {}

    return loss_fn


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_nonfinite_loss_skips_the_step(scale):
    model, opt, sched = linear_setup()
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(model, [torch.ones(2, 3)], scaled_loss(scale), opt, sched, 1.0)
    assert result.skipped and result.nonfinite
    assert not math.isfinite(result.loss)
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p) and p.grad is None
    assert opt.state == {} and sched.last_epoch == 0 and result.lr == 0.1


def test_good_step_updates_and_steps_the_scheduler():
    model, opt, sched = linear_setup()
    result = train_step(model, [torch.ones(2, 3)], scaled_loss(1.0), opt, sched, 1.0)
    assert not result.skipped and result.lr == 0.1
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert all(p.grad is None for p in model.parameters())


def test_step_without_units_is_skipped_but_not_bad():
    model, opt, sched = linear_setup()
    result = train_step(model, [torch.ones(0, 3)], scaled_loss(1.0), opt, sched, 1.0)
    assert result.skipped and not result.nonfinite and sched.last_epoch == 0
    guard = BadStepGuard(1)
    guard.update(result, step=3)  # does not raise
    assert guard.total == 0


def test_guard_raises_after_consecutive_bad_steps_and_resets_on_a_good_one():
    bad = StepResult(math.nan, math.nan, 0.1, 10, skipped=True, nonfinite=True)
    good = StepResult(1.0, 0.5, 0.1, 10)
    guard = BadStepGuard(max_bad_steps=3)
    for step, result in enumerate([bad, bad, good, bad, bad]):
        guard.update(result, step)
    assert guard.consecutive == 2 and guard.total == 4
    with pytest.raises(TrainingDiverged) as err:
        guard.update(bad, step=5, last_checkpoint="runs/x/checkpoints/step-4")
    message = str(err.value)
    assert "3 consecutive steps at step 5" in message
    assert "trainer.learning_rate" in message and "runs/x/checkpoints/step-4" in message
    with pytest.raises(ValueError, match="max_bad_steps"):
        BadStepGuard(0)


def test_set_seed_reseeds_python_numpy_torch():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    set_seed(7)
    first = draws()
    set_seed(7)
    assert draws() == first


def test_an_update_that_would_overflow_a_weight_is_skipped_counted_and_the_next_good_step_trains():
    """Issue #31 item 2: a finite loss and gradient whose update is not finite (a weight at the
    top of the float32 range pushed up by lr 1e37). Before: the step was taken, the weight
    became inf, and the guard stopped the run at once. Now the step is skipped as a NaN loss
    is: the weights and AdamW's state stay bit for bit, the scheduler waits, the guard counts."""
    model, opt, sched = linear_setup()
    x = torch.tensor([[1e-3, 1.0, 1.0]])  # a small input, so that the loss stays finite
    train_step(model, [x], scaled_loss(1.0), opt, sched, 1.0)  # a good step: AdamW's state exists
    with torch.no_grad():
        model.weight[0, 0] = torch.finfo(torch.float32).max
    opt.param_groups[0]["lr"] = 1e37
    weights = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    guard = BadStepGuard(max_bad_steps=2)
    bad = train_step(model, [x], scaled_loss(-1.0), opt, sched, 1.0)  # the gradient pushes w[0, 0] up
    guard.update(bad, step=2)
    assert math.isfinite(bad.loss) and math.isfinite(bad.grad_norm)
    assert bad.skipped and bad.nonfinite and bad.overflow
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    for p, s in opt.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    assert sched.last_epoch == 1 and guard.consecutive == 1 and guard.total == 1
    opt.param_groups[0]["lr"] = 0.05
    good = train_step(model, [x], scaled_loss(-1.0), opt, sched, 1.0)
    guard.update(good, step=3)
    assert not good.skipped and not good.overflow and guard.consecutive == 0 and guard.total == 1
    assert sched.last_epoch == 2 and all(float(s["step"]) == 2 for s in opt.state.values())
    assert not torch.equal(weights[1], model.bias) and torch.isfinite(model.weight).all()


def test_overflowing_updates_in_a_row_stop_the_guard_naming_them():
    bad = StepResult(1.0, 0.5, 0.1, 10, skipped=True, nonfinite=True, overflow=True)
    guard = BadStepGuard(max_bad_steps=2)
    guard.update(bad, step=6)
    with pytest.raises(TrainingDiverged, match=r"update was NaN/inf \(2 of them an update that would have overflowed "
                                               r"the weights.* 2 consecutive steps at step 7.*runs/x/step-5"):
        guard.update(bad, step=7, last_checkpoint="runs/x/step-5")


def test_a_good_update_is_not_an_overflow():
    model, opt, sched = linear_setup()
    result = train_step(model, [torch.ones(2, 3)], scaled_loss(1.0), opt, sched, 1.0)
    assert not result.overflow and not result.nonfinite
