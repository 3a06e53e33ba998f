"""A wall clock the test sets, for what counts in windows of the wall clock (quotas)."""

from __future__ import annotations

#: A moment 10 s into a minute and into a UTC day (day 1000 since the epoch).
T0 = 1_000 * 86400 + 10.0


class Clock:
    """Stands still at `now` until the test moves it."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
