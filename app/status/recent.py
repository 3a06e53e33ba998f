"""The last minutes of traffic, from the metrics' counts read when a snapshot is asked for.

Nothing is recorded per request for it: each read (at most one per `TICK_S`) keeps the counts
since start, and a rate is the difference between two reads over the time between them. While
nobody watches, nothing is read: the history then has a gap, and the first read after it
starts a new stretch rather than spreading the gap's requests over it.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise
from typing import Any, NamedTuple

from slotgate.metrics import BUCKETS_S, Totals
from slotgate.outcome import Outcome

#: Seconds between two kept reads (the page's tick).
TICK_S = 1.0
#: Seconds of history the chart and the percentiles cover.
WINDOW_S = 300.0
#: Reads further apart than this are not turned into a rate (nobody watched between them).
GAP_S = 5.0
#: The refusals a client reads as 429 (`errors.ANSWERS`).
REFUSED_429 = (Outcome.QUEUE_FULL, Outcome.TENANT_QUEUE_FULL, Outcome.QUEUE_BYTES_FULL)


class _Read(NamedTuple):
    at: float
    admitted: int
    refused: int
    timeouts: int
    gone: int
    wait: list[int]
    hold: list[int]


class Recent:
    """Rates per second over the last WINDOW_S, and queue wait and slot hold p50/p95."""

    def __init__(self) -> None:
        self._reads: deque[_Read] = deque(maxlen=int(WINDOW_S / TICK_S) + 1)

    def read(self, totals: Totals, now: float) -> None:
        """Keep `totals` as of `now` (time.monotonic()), unless a read was kept under a tick ago."""
        reads = self._reads
        if reads and now - reads[-1].at < TICK_S * 0.9:
            return
        while reads and now - reads[0].at > WINDOW_S:
            reads.popleft()
        rejected = totals.rejected
        reads.append(
            _Read(
                now,
                totals.admitted,
                sum(rejected.get(reason, 0) for reason in REFUSED_429),
                rejected.get(Outcome.QUEUE_TIMEOUT, 0),
                rejected.get(Outcome.CLIENT_GONE, 0),
                totals.wait,
                totals.hold,
            )
        )

    def view(self, now: float) -> dict[str, Any]:
        """`/admission`'s "recent": per second between kept reads (`ago_s` from now, oldest
        first; a gap where nobody watched has no point), and p50/p95 over the window (None
        without a sample; a value past the last bucket reads as that bucket's bound)."""
        reads = list(self._reads)
        ago: list[float] = []
        series: dict[str, list[float]] = {
            "admitted": [],
            "refused_429": [],
            "timeouts": [],
            "gone": [],
        }
        for before, after in pairwise(reads):
            span = after.at - before.at
            if span > GAP_S:
                continue
            ago.append(round(now - after.at, 1))
            series["admitted"].append(round((after.admitted - before.admitted) / span, 2))
            series["refused_429"].append(round((after.refused - before.refused) / span, 2))
            series["timeouts"].append(round((after.timeouts - before.timeouts) / span, 2))
            series["gone"].append(round((after.gone - before.gone) / span, 2))
        first, last = (reads[0], reads[-1]) if reads else (None, None)
        return {
            "window_s": WINDOW_S,
            "ago_s": ago,
            "per_s": series,
            "queue_wait_s": _quantiles(first.wait if first else [], last.wait if last else []),
            "slot_hold_s": _quantiles(first.hold if first else [], last.hold if last else []),
        }


def _quantiles(before: list[int], after: list[int]) -> dict[str, float | None]:
    counts = [a - b for a, b in zip(after, before, strict=True)] if before else list(after)
    return {"p50": quantile(counts, 0.5), "p95": quantile(counts, 0.95)}


def quantile(counts: list[int], q: float) -> float | None:
    """The `q` quantile of samples counted in BUCKETS_S's buckets (the last one past every
    bound), interpolated within its bucket as Prometheus' histogram_quantile does."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            if index == len(BUCKETS_S):
                return float(BUCKETS_S[-1])
            low = BUCKETS_S[index - 1] if index else 0.0
            high = BUCKETS_S[index]
            return round(low + (high - low) * (rank - seen) / count, 3)
        seen += count
    return float(BUCKETS_S[-1])
