"""Console progress: a tqdm bar with ETA on a terminal, plain timed lines in a log file.

A tqdm bar redrawn with carriage returns turns a log file into one endless line, so when
the stream is not a terminal, `Progress` writes a readable line instead, at most every
`interval` seconds (10 s by default; the bar redraws at most every second):

    12:03:41 sft 40/100 (40%) loss=1.234 lr=1.00e-04 | 12s elapsed, ETA 18s

A run with a wall-clock budget (`trainer.max_time_s`) ends at whichever comes first, its
steps or its budget, and so does its ETA (`ETA 5m00s (time budget)` when the budget ends it).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from tqdm import tqdm


def format_value(value: Any) -> str:
    """A metric value, compact: 1.234, 0.05, 1.00e-04, 12345 → 1.23e+04, 7 (ints as is)."""
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, float):
        return str(value)
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.4g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


def format_metrics(metrics: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """`name=value` pairs for `keys` (all of `metrics` when None; absent keys are left out)."""
    names = list(metrics) if keys is None else [k for k in keys if k in metrics]
    return " ".join(f"{name}={format_value(metrics[name])}" for name in names)


def log_line(step: int, metrics: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """One readable line for a log file: `step 12 loss=1.234 lr=1.00e-04`."""
    text = format_metrics(metrics, keys)
    return f"step {step} {text}" if text else f"step {step}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Progress over `total` steps with ETA and a few key metrics.

    `update(n, **metrics)` advances by n and shows the given metrics, e.g.
    `progress.update(1, loss=1.234, lr=1e-4)` (use `**{"reward/mean": r}` for
    names with a slash). `initial` is the step a resumed run starts from; the ETA
    counts only the steps done in this session. `max_seconds` is a wall-clock budget from
    now: the ETA is the sooner of the steps' and the budget's end (on a terminal, the
    budget's time left is shown after the metrics). `enabled=False` shows nothing.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        initial: int = 0,
        enabled: bool = True,
        file: TextIO | None = None,
        interval: float | None = None,
        max_seconds: float | None = None,
    ):
        self.total, self.desc, self.n = total, desc, initial
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self._start_n, self._start = initial, time.monotonic()
        self.max_seconds = max_seconds
        self._metrics: Mapping[str, Any] = {}
        self._last_line: float | None = None
        self._printed_n: int | None = None
        self._bar = None
        tty = getattr(self.file, "isatty", lambda: False)()
        if enabled and tty:
            self._bar = tqdm(
                total=total,
                desc=desc,
                initial=initial,
                file=self.file,
                mininterval=1.0 if interval is None else interval,
                dynamic_ncols=True,
                unit="step",
            )
        self.interval = 10.0 if interval is None else interval

    def update(self, n: int = 1, **metrics: Any) -> None:
        """Advance by `n` steps; show `metrics` (they replace the previous ones)."""
        self.n += n
        if metrics:
            self._metrics = metrics
        if self._bar is not None:
            if metrics or self.max_seconds is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)
        elif self.enabled:
            now = time.monotonic()
            if self._last_line is None or now - self._last_line >= self.interval:
                self._write_line(now)

    def line(self, now: float | None = None) -> str:
        """The plain progress line: `desc 40/100 (40%) loss=... | 12s elapsed, ETA 18s`."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        done = self.n - self._start_n
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        parts = [f"{self.desc} {self.n}/{self.total}{pct}"]
        if self._metrics:
            parts.append(format_metrics(self._metrics))
        timing = f"{_duration(elapsed)} elapsed"
        if done > 0 and self.total:
            eta = elapsed / done * max(0, self.total - self.n)
            left = self._budget_left(now)
            if left is not None and left < eta:
                timing += f", ETA {_duration(left)} (time budget)"
            else:
                timing += f", ETA {_duration(eta)}"
        return " ".join(parts) + " | " + timing

    def _budget_left(self, now: float) -> float | None:
        """Seconds left of `max_seconds` (None: no budget)."""
        return None if self.max_seconds is None else max(0.0, self.max_seconds - (now - self._start))

    def _postfix(self) -> str:
        """The bar's postfix: the metrics, and the time budget left if there is one."""
        left = self._budget_left(time.monotonic())
        budget = "" if left is None else f"time budget left {_duration(left)}"
        return " ".join(filter(None, [format_metrics(self._metrics), budget]))

    def _write_line(self, now: float) -> None:
        self.file.write(f"{time.strftime('%H:%M:%S')} {self.line(now)}\n")
        self.file.flush()
        self._last_line, self._printed_n = now, self.n

    def close(self) -> None:
        """Finish the bar, or write the last plain line if it was not written yet."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._printed_n != self.n:
            self._write_line(time.monotonic())
            self._printed_n = self.n

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
