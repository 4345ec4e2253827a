"""Each rank's share of a global batch.

`data.train_batch_size` stays the global batch (as veRL and TRL count it): every rank reads
the same seeded order, takes its contiguous slice of the step's examples, and cuts that slice
into micro-batches. The loss normalisation (`collectives.Collective`) makes the update the
one of the whole batch in one process.
"""

from __future__ import annotations


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous part of n items, as `numpy.array_split` cuts them:
    the first n mod W ranks get ⌈n/W⌉ items, the others ⌊n/W⌋.

    n = 10, W = 4 → [0:3], [3:6], [6:8], [8:10].
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))
