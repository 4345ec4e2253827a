"""The all-reduces a data-parallel optimizer step needs, on float64 tensors.

Exactness (2 ranks give the update of 1 process on the same global batch) rests on two rules,
which `training.core.train_step` applies through this object:
- the loss is normalised by the all-reduced global unit count N = Σ_r n_r (tokens for SFT,
  pairs for RM and DPO), not by each rank's own: DDP and FSDP2 average gradients over the W
  ranks, so each rank's Σ-loss gradient is divided by N / W, giving
      g = (1/W) Σ_r ∇(Σ_{i∈r} ℓ_i) · W / N = ∇ Σ_i ℓ_i / N;
  a mean of per-rank means is off whenever the ranks hold different token counts;
- every rank runs the same number of forward/backward passes (the MAX over ranks); a rank
  with fewer micro-batches repeats its last one with weight 0, or the collectives inside
  the backward go out of step (DDP desynchronises, FSDP2 blocks until the timeout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


class Collective:
    """Sum / max all-reduces over the default process group, on `device`.

    average_gradients: `sync_gradients` averages the gradients over the ranks (for a model
    that no DDP / FSDP2 wrapper averages: the Ray backend's actor); otherwise it does nothing."""

    def __init__(self, world_size: int, device: torch.device, average_gradients: bool = False):
        self.world_size, self.device = world_size, device
        self.average_gradients = average_gradients

    def sync_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """g ← (1/W) Σ_r g_r for every parameter, as DDP's backward leaves them (one flat
        all-reduce per dtype). A parameter no rank has a gradient for keeps None (AdamW then
        skips it, as in one process); one that only some ranks have counts 0 on the others."""
        import torch.distributed as dist

        if not self.average_gradients:
            return
        flags = self.all_max([float(p.grad is not None) for p in params])
        live = [p for p, f in zip(params, flags, strict=True) if f > 0]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in dict.fromkeys(p.grad.dtype for p in live):
            group = [p for p in live if p.grad.dtype == dtype]
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat)
            flat.div_(self.world_size)
            offset = 0
            for p in group:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Σ over ranks of each value."""
        return self._reduce(values, "sum")

    def all_max(self, values: Sequence[float]) -> list[float]:
        """max over ranks of each value."""
        return self._reduce(values, "max")

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        import torch.distributed as dist

        if not values:
            return []
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (pickled; needs numpy)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order (pickled; needs numpy)."""
        import torch.distributed as dist

        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def reduce_metrics(self, n_units: float | Mapping[str, float], metrics: Mapping[str, float]) -> dict[str, float]:
        """One rank's merged step metrics → the global batch's, as `merge_metrics` merges
        micro-batches: `*/max` the max over ranks, `*/min` the min, any other name the mean
        weighted by each rank's units, Σ_r n_r · v_r / Σ_r n_r (a plain mean over ranks when
        no rank has units). `n_units` is one count for every name, or one per name (the units
        of the micro-batches that reported it: an RL part that skips the forward reports no
        `entropy`). A name some ranks lack is reduced over the ranks that report it; every
        rank returns every name."""
        per_name = n_units if isinstance(n_units, Mapping) else dict.fromkeys(metrics, float(n_units))
        names = list(dict.fromkeys([*metrics, *(k for m in self.all_gather_object(sorted(metrics)) for k in m)]))
        means = [k for k in names if not k.endswith(("/max", "/min"))]
        extrema = [k for k in names if k.endswith(("/max", "/min"))]
        has = {k: k in metrics for k in names}
        sums = self.all_sum([
            *(per_name.get(k, 0.0) for k in means), *(per_name.get(k, 0.0) * metrics.get(k, 0.0) for k in means),
            *(metrics.get(k, 0.0) for k in means), *(float(has[k]) for k in means),
        ])
        m = len(means)
        units, weighted, plain, ranks = sums[:m], sums[m:2 * m], sums[2 * m:3 * m], sums[3 * m:]
        out = {k: (w / u if u > 0 else p / r)
               for k, u, w, p, r in zip(means, units, weighted, plain, ranks, strict=True)}
        signed = [(metrics[k] if k.endswith("/max") else -metrics[k]) if has[k] else -math.inf for k in extrema]
        for k, v in zip(extrema, self.all_max(signed), strict=True):
            out[k] = v if k.endswith("/max") else -v
        return {k: out[k] for k in names}
