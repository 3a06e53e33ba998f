"""The last minutes' figures: rates between reads, gaps left as gaps, quantiles from buckets."""

from __future__ import annotations

from slotgate.metrics import BUCKETS_S, Totals
from slotgate.status.recent import GAP_S, Recent, quantile

EMPTY = [0] * (len(BUCKETS_S) + 1)


def totals(admitted: int, **rejected: int) -> Totals:
    return Totals(admitted, rejected, list(EMPTY), list(EMPTY))


def test_rates_are_the_difference_between_reads_over_the_time_between_them() -> None:
    recent = Recent()
    recent.read(totals(10, queue_full=1), now=100.0)
    recent.read(totals(30, queue_full=5, tenant_queue_full=1, queue_timeout=2), now=102.0)
    view = recent.view(now=102.0)
    assert view["ago_s"] == [0.0]
    assert view["per_s"] == {
        "admitted": [10.0],
        "refused_429": [2.5],
        "timeouts": [1.0],
        "gone": [0.0],
    }


def test_reads_closer_than_a_tick_are_not_kept() -> None:
    recent = Recent()
    recent.read(totals(0), now=100.0)
    recent.read(totals(5), now=100.2)
    recent.read(totals(10), now=101.0)
    assert recent.view(now=101.0)["per_s"]["admitted"] == [10.0]


def test_a_stretch_nobody_watched_is_a_gap_not_a_rate() -> None:
    recent = Recent()
    recent.read(totals(0), now=100.0)
    recent.read(totals(1000), now=100.0 + GAP_S + 1)
    recent.read(totals(1002), now=100.0 + GAP_S + 2)
    assert recent.view(now=100.0 + GAP_S + 2)["per_s"]["admitted"] == [2.0]


def test_quantiles_interpolate_within_their_bucket() -> None:
    counts = list(EMPTY)
    counts[BUCKETS_S.index(1)] = 10  # ten samples in (0.5, 1]
    assert quantile(counts, 0.5) == 0.75
    assert quantile(list(EMPTY), 0.5) is None
    counts[-1] = 90  # past every bound: reads as the last bound
    assert quantile(counts, 0.95) == BUCKETS_S[-1]


def test_percentiles_cover_the_window_not_the_time_before_it() -> None:
    recent = Recent()
    before = list(EMPTY)
    before[BUCKETS_S.index(60)] = 100  # old, slow waits
    recent.read(Totals(0, {}, before, list(EMPTY)), now=100.0)
    after = list(before)
    after[BUCKETS_S.index(0.1)] += 10  # quick ones since
    recent.read(Totals(10, {}, after, list(EMPTY)), now=101.0)
    waits = recent.view(now=101.0)["queue_wait_s"]
    assert waits["p50"] is not None
    assert waits["p95"] is not None
    assert waits["p95"] <= 0.1
