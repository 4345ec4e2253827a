"""Whether an optimizer step would leave the weights finite, found before the step is taken.

A finite loss and gradient can still give a non-finite update: a weight near the float
range (|w| ≈ 3.4e38 in float32) pushed past it, or a huge learning rate. Checking the weights
after `optimizer.step()` is too late to skip that step (the weights and moments are already
overwritten), and keeping a copy of the weights and the optimizer state to roll back would
triple the training memory. So `update_finite` decides before the step, and `train_step`
steps for real only when every would-be weight is finite; otherwise the step is skipped and
counted, as a NaN loss is (`BadStepGuard`). Two tests, both exact:

1. A bound (`adamw_bound`, AdamW only): from max|w|, max|exp_avg| and max|g| of a tensor, a
   bound on every |w| after the step. A tensor whose bound is far below the float range
   cannot overflow. This clears every tensor of a sane run, for three read passes (w,
   exp_avg, g) and one device sync.
2. A dry run (`dry_steps`) of the tensors the bound does not clear: torch's own functional
   step (`torch.optim.adamw.adamw`, what `AdamW.step` runs; `torch.optim.sgd.sgd` for SGD, the
   tests' optimizer) with the param group's settings and the `foreach` choice the real step
   makes, on clones of each parameter, its moments and its step count (zeros and 0 before the
   first step, as `AdamW` initialises them). The math is elementwise per parameter, so each
   would-be weight is bit for bit the one the real step writes (tests/training/test_dry_step.py
   checks it against `optimizer.step()`). Its clones are one chunk at a time: a chunk holds at
   most as many elements as the group's largest parameter, so the extra memory is about three
   times that parameter (weight, exp_avg, exp_avg_sq), never a copy of the model.

Measured on the built-in `small` model (25.9 M parameters, fp32, CPU, one thread, one run):
`optimizer.step()` 697 ms; `update_finite` 155 ms (a step with the check / without: 1.22); a
dry run of every tensor 2.67 s (4.8: clones, the step's arithmetic again, a max-|w| pass),
which is why the bound comes first. FSDP2's DTensor parameters are checked shard by shard,
and the verdict is agreed over the ranks (MAX of "some weight is not finite"), so every rank
skips or steps together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_scalar_dtype
from torch.optim.sgd import sgd

SAFE_FRACTION = 2.0**-10
"""A bound below this fraction of the dtype's largest value clears a tensor: room for the
rounding of every operation of the step, many times over."""


class MaxCollective(Protocol):
    def all_max(self, values: list[float]) -> list[float]: ...


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or this rank's shard of an FSDP2 DTensor."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def max_abs(tensors: list[torch.Tensor | None]) -> list[float]:
    """max|x| of each tensor (NaN when it holds a NaN, inf for an inf; 0 for None or an empty
    one), with one device sync. `aminmax` is ~8× faster than an inf-norm on CPU."""
    values = []
    for t in tensors:
        if t is None or not t.numel():
            values.append(torch.zeros((), dtype=torch.float64))
            continue
        low, high = torch.aminmax(t)
        values.append(torch.maximum(low.abs(), high.abs()).double().cpu())
    return torch.stack(values).tolist() if values else []


def adamw_bound(w_max: float, m_max: float, g_max: float, step: int, lr: float, betas: tuple[float, float],
                eps: float, weight_decay: float) -> float:
    """A bound on max|w| after AdamW's step `step` (1-based) of one tensor, from its max|w|,
    max|exp_avg| before the step and max|g|:

        |m'| ≤ β1·m_max + (1 − β1)·g_max                          (m' = lerp(m, g, 1 − β1))
        denom = sqrt(v')/sqrt(1 − β2^t) + eps ≥ eps               (amsgrad: a larger v', same)
        |w'| ≤ w_max·|1 − lr·wd| + lr/(1 − β1^t) · |m'|/eps        (w' = w(1 − lr·wd) − lr·m̂'/denom)

    and no intermediate (|m'|/eps, lr/(1 − β1^t)) exceeds the bound either. In exact arithmetic:
    the float rounding of the step is what `SAFE_FRACTION` leaves room for. Loose (eps in the
    denominator), but it only has to clear tensors that are nowhere near the float range; NaN
    or inf inputs give inf."""
    bc1 = 1.0 - betas[0] ** step
    m_next = betas[0] * m_max + (1.0 - betas[0]) * g_max
    step_size = lr / bc1 if bc1 > 0 else float("inf")
    ratio = m_next / eps if eps > 0 else float("inf")
    bound = max(w_max * abs(1.0 - lr * weight_decay) + step_size * ratio, ratio, step_size)
    return bound if bound == bound else float("inf")


def _cleared(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> list[bool]:
    """Which of the group's `params` `adamw_bound` clears (none outside plain AdamW: SGD, or a
    capturable, fused or differentiable AdamW, whose arithmetic the bound does not follow)."""
    if not isinstance(optimizer, torch.optim.AdamW) or torch.is_tensor(group["lr"]) or \
            group["capturable"] or group["fused"] or group["differentiable"]:
        return [False] * len(params)
    state = [optimizer.state.get(p, {}) for p in params]
    maxima = max_abs([_local(p) for p in params] + [_local(s["exp_avg"]) if s else None for s in state]
                     + [_local(p.grad) for p in params])
    n = len(params)
    out = []
    for i, (p, s) in enumerate(zip(params, state)):
        step = int(s["step"]) + 1 if s else 1
        bound = adamw_bound(maxima[i], maxima[n + i], maxima[2 * n + i], step, group["lr"], group["betas"],
                            group["eps"], group["weight_decay"])
        out.append(bound < SAFE_FRACTION * torch.finfo(p.dtype).max)
    return out


def _resolved_foreach(group: dict[str, Any], params: list[torch.Tensor], differentiable: bool) -> bool | None:
    """The `foreach` the real step uses for `group` (torch.optim's default rule, decided on the
    whole group's parameters, as the real step decides it)."""
    foreach = group["foreach"]
    if foreach is None and not group.get("fused"):
        _, foreach = _default_to_fused_or_foreach(params, differentiable, use_fused=False)
    return foreach


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`params` in order, in runs of at most max(numel) elements in all (a larger one alone)."""
    limit = max(_local(p).numel() for p in params)
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        n = _local(p).numel()
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += n
    if chunk:
        yield chunk


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.Tensor | None:
    """A clone of p's state tensor `key` (this rank's shard), or None before the first step."""
    value = optimizer.state.get(p, {}).get(key)
    return None if value is None else _local(value).clone()


def _adamw(optimizer: torch.optim.Optimizer, group: dict[str, Any], chunk: list[torch.Tensor],
           weights: list[torch.Tensor], grads: list[torch.Tensor], foreach: bool | None) -> None:
    """torch.optim.AdamW's step on `weights`, from clones of the chunk's moments and step counts
    (zeros and 0 before the first step, with the dtype and device `AdamW` gives them)."""
    amsgrad, fused = group["amsgrad"], group["fused"]
    on_device = group["capturable"] or fused
    zero_step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=weights[0].device) if on_device
                 else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    moments = [[_state(optimizer, p, k) for p in chunk] for k in keys]
    moments = [[torch.zeros_like(w) if m is None else m for m, w in zip(ms, weights)] for ms in moments]
    steps = [optimizer.state[p]["step"].clone() if p in optimizer.state else zero_step.clone() for p in chunk]
    beta1, beta2 = group["betas"]
    adamw(weights, grads, moments[0], moments[1], moments[2] if amsgrad else [], steps, foreach=foreach,
          capturable=group["capturable"], differentiable=group["differentiable"], fused=fused,
          has_complex=any(torch.is_complex(p) for p in chunk), amsgrad=amsgrad, beta1=beta1, beta2=beta2,
          lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def _sgd(optimizer: torch.optim.Optimizer, group: dict[str, Any], chunk: list[torch.Tensor],
         weights: list[torch.Tensor], grads: list[torch.Tensor], foreach: bool | None) -> None:
    """torch.optim.SGD's step on `weights`, from clones of the chunk's momentum buffers (the
    tests' optimizer: with lr 1 its update is the gradient itself)."""
    buffers = [_state(optimizer, p, "momentum_buffer") for p in chunk] if group["momentum"] != 0 else []
    sgd(weights, grads, buffers, foreach=foreach, fused=group["fused"], weight_decay=group["weight_decay"],
        momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
        maximize=group["maximize"])


DRY_RUNS = {torch.optim.AdamW: _adamw, torch.optim.SGD: _sgd}
"""The optimizers a step can be dry-run for (AdamW, the one `build_optimizer` makes; SGD, the tests')."""


def dry_steps(optimizer: torch.optim.Optimizer, only: set[torch.Tensor] | None = None
              ) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The step `optimizer.step()` would take, chunk by chunk, without changing anything:
    yields (params, their would-be weights) per chunk, local shards, the clones freed once the
    next chunk is asked for; `only`: just these parameters. (The moments need no check: with a
    finite gradient norm, g² and so exp_avg_sq are finite.)"""
    run = DRY_RUNS.get(type(optimizer))
    if run is None:
        raise TypeError(f"a step can be dry-run for {' or '.join(t.__name__ for t in DRY_RUNS)}, "
                        f"not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        foreach = _resolved_foreach(group, params, run is _adamw and group["differentiable"])
        if run is _adamw and foreach and torch.is_tensor(group["lr"]) and not group["capturable"]:
            foreach = False  # as torch.optim.adam.adam decides it
        chosen = [p for p in params if only is None or p in only]
        for chunk in _chunks(chosen) if chosen else ():
            weights = [_local(p).clone() for p in chunk]
            run(optimizer, group, chunk, weights, [_local(p.grad) for p in chunk], foreach)
            yield chunk, weights


def update_finite(optimizer: torch.optim.Optimizer, collective: MaxCollective | None = None) -> bool:
    """True when `optimizer.step()` would leave every weight finite (on every rank); nothing is
    changed. The bound first, the dry run for the tensors it does not clear; one all-reduce
    with `collective`."""
    with torch.no_grad():
        suspects: set[torch.Tensor] = set()
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            suspects.update(p for p, cleared in zip(params, _cleared(optimizer, group, params)) if not cleared)
        ok = all(math.isfinite(m) for _, weights in dry_steps(optimizer, suspects) for m in max_abs(weights)) \
            if suspects else True
    if collective is not None:
        ok = collective.all_max([float(not ok)])[0] == 0
    return ok
