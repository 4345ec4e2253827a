"""Epoch-shuffled batches of examples whose position can be saved and restored exactly."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posttrain.config import ConfigError
from posttrain.distributed import Collective, rank_slice


class EpochBatches:
    """Each step takes the next `batch_size` examples of a seeded per-epoch permutation,
    crossing into the next epoch when one runs out, and collates them in micro-batches.

    State is `{"epoch", "index"}`: restoring it continues with exactly the examples an
    uninterrupted run would have seen (the permutation of epoch e is a function of
    seed and e alone), so resuming at an epoch boundary neither repeats nor skips data.
    """

    def __init__(
        self,
        examples: Sequence[Any],
        batch_size: int,
        micro_batch_size: int,
        collate: Callable[[list[Any]], Any],
        seed: int = 0,
        shuffle: bool = True,
    ):
        if not examples:
            raise ValueError("no training examples")
        self.examples, self.batch_size, self.micro_batch_size = examples, batch_size, micro_batch_size
        self.collate, self.seed, self.shuffle = collate, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)
        self.rank, self.world_size = 0, 1
        self.collective: Collective | None = None
        """Set by `shard`: the all-reduces of the group (for step totals across ranks)."""

    def shard(self, rank: int, world_size: int, collective: Collective | None = None) -> None:
        """From now on `next_step` gives this rank's contiguous slice of each step's examples
        (`distributed.rank_slice`); every rank walks the same order, so the state is shared."""
        if self.batch_size < world_size:
            raise ConfigError(f"data.train_batch_size={self.batch_size} is smaller than the {world_size} "
                              "ranks: every rank needs at least one example per step")
        self.rank, self.world_size, self.collective = rank, world_size, collective

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.examples)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def next_indices(self, count: int | None = None) -> list[int]:
        """The example indices of the next optimizer step (`count`: that many instead of batch_size)."""
        want = self.batch_size if count is None else count
        picked: list[int] = []
        while len(picked) < want:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(want - len(picked), len(self._order) - self.index)
            picked += self._order[self.index : self.index + take]
            self.index += take
        return picked

    def next_step(self) -> list[Any]:
        """The next step's micro-batches (this rank's, see `shard`), each collated."""
        idx = self.next_indices()
        idx = idx[rank_slice(len(idx), self.rank, self.world_size)]
        m = self.micro_batch_size
        return [self.collate([self.examples[i] for i in idx[j : j + m]]) for j in range(0, len(idx), m)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)

    @property
    def epoch_progress(self) -> float:
        """Epochs done, fractional."""
        return self.epoch + self.index / len(self._order)

    @property
    def steps_per_epoch(self) -> float:
        """Steps of one pass over the examples: len(examples) / batch_size (fractional)."""
        return len(self.examples) / self.batch_size
