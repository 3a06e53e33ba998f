"""Preemption before the first byte, as the core decides it: whom a waiter may preempt."""

from __future__ import annotations

import logging

import pytest
from slotgate.gate.preemption import Preemption


class Victim:
    def __init__(
        self, preemption: Preemption, name: str, band: int, started: bool = False,
        line: object = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.started = started
        self.stopped = 0
        preemption.run(self, band, lambda: self.started, self.stop, name, line)

    def stop(self) -> None:
        self.stopped += 1


def test_the_lowest_band_most_recently_started_request_that_sent_nothing_is_preempted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    preemption = Preemption(1.0)
    old = Victim(preemption, "old", 0)
    new = Victim(preemption, "new", 0)
    middle = Victim(preemption, "middle", 1)
    with caplog.at_level(logging.INFO, "slotgate"):
        assert preemption.make_room(2, "chat")
    assert (old.stopped, new.stopped, middle.stopped) == (0, 1, 0)
    assert preemption.count == 1
    assert "preempted request new (band 0)" in caplog.text
    assert "for request chat (band 2)" in caplog.text


def test_never_a_request_that_has_sent_bytes_nor_one_preempted_before() -> None:
    preemption = Preemption(1.0)
    speaking = Victim(preemption, "speaking", 0, started=True)
    once = Victim(preemption, "once", 0)
    assert preemption.make_room(1, "chat")
    assert once.stopped == 1
    # Sent again later, and now running again: immune.
    preemption.run(once, 0, lambda: False, once.stop, "once")
    assert preemption.was_preempted(once)
    assert not preemption.make_room(1, "chat")
    assert (speaking.stopped, once.stopped) == (0, 1)
    assert preemption.count == 1


def test_never_a_request_of_the_waiters_band_or_above() -> None:
    preemption = Preemption(1.0)
    same = Victim(preemption, "same", 1)
    above = Victim(preemption, "above", 2)
    assert not preemption.make_room(1, "chat")
    preemption.end(same)
    preemption.end(above)
    assert not preemption.make_room(9, "chat")
    assert (same.stopped, above.stopped) == (0, 0)


def test_a_waiter_preempts_only_a_request_running_in_its_own_models_line() -> None:
    preemption = Preemption(1.0)
    alpha, beta = object(), object()
    # beta's batch request started last, on beta's slots: it frees nothing for alpha's waiter.
    on_alpha = Victim(preemption, "on-alpha", 0, line=alpha)
    on_beta = Victim(preemption, "on-beta", 0, line=beta)
    on_main = Victim(preemption, "on-main", 0)
    assert preemption.make_room(2, "chat", alpha)
    assert (on_alpha.stopped, on_beta.stopped, on_main.stopped) == (1, 0, 0)
    # Nothing else of alpha's line to take: beta's and the main line's are not alpha's.
    assert not preemption.make_room(2, "chat", alpha)
    assert (on_beta.stopped, on_main.stopped) == (0, 0)
