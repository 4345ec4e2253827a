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

from collections.abc import Mapping, Sequence

import torch


class Collective:
    """Sum / max all-reduces over the default process group, on `device`."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device

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

    def reduce_metrics(self, n_units: float, metrics: Mapping[str, float]) -> dict[str, float]:
        """One rank's merged step metrics → the global batch's, as `merge_metrics` merges
        micro-batches: `*/max` the max over ranks, `*/min` the min, any other name the mean
        weighted by each rank's units, Σ_r n_r · v_r / Σ_r n_r (a plain mean over ranks when
        no rank has units). Every rank must report the same names."""
        names = sorted(metrics)
        means = [k for k in names if not k.endswith(("/max", "/min"))]
        extrema = [k for k in names if k.endswith(("/max", "/min"))]
        sums = self.all_sum([n_units, 1.0, *(n_units * metrics[k] for k in means), *(metrics[k] for k in means)])
        units, ranks, weighted, plain = sums[0], sums[1], sums[2:2 + len(means)], sums[2 + len(means):]
        out = {k: (w / units if units > 0 else p / ranks) for k, w, p in zip(means, weighted, plain, strict=True)}
        signed = [metrics[k] if k.endswith("/max") else -metrics[k] for k in extrema]
        for k, v in zip(extrema, self.all_max(signed), strict=True):
            out[k] = v if k.endswith("/max") else -v
        return {k: out[k] for k in metrics}
