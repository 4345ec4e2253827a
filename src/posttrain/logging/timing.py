"""Wall time per stage of a step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence


class StageTimer:
    """Wall time per stage of a step (veRL's timing/* metrics): every stage named at construction
    reports, 0 when it did not run."""

    def __init__(self, stages: Sequence[str]) -> None:
        self.seconds = dict.fromkeys(stages, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}
