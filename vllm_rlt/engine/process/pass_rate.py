"""Passes per second and rows per pass over a sliding time window, kept by the engine core
from its own counters (one sample per pass)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

RATE_WINDOW_S = 5.0


class PassRate:
    """Rates over the last `window` seconds, read when asked: an idle engine reads 0 passes
    per second, not its last busy rate."""

    def __init__(
        self, window: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.clock = clock
        # (time, passes, rows): cumulative counters; the first is the window's base.
        self._samples: deque[tuple[float, int, int]] = deque([(clock(), 0, 0)])

    def record(self, passes: int, rows: int) -> None:
        now = self.clock()
        self._samples.append((now, passes, rows))
        # Keep one sample at or before the window's start as the base.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()

    def _span(self) -> tuple[float, int, int]:
        """(seconds, passes, rows) over the window ending now."""
        now = self.clock()
        start, passes0, rows0 = self._samples[0]
        _, passes1, rows1 = self._samples[-1]
        return max(now - start, 1e-9), passes1 - passes0, rows1 - rows0

    def passes_per_second(self) -> float:
        seconds, passes, _ = self._span()
        return passes / seconds

    def rows_per_pass(self) -> float:
        _, passes, rows = self._span()
        return rows / passes if passes else 0.0
