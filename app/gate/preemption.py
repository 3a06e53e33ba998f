"""Preemption before the first byte (PREEMPT_AFTER_S): a waiter of a higher band that has waited
longer than the bound may take the slot of a lower band's request that has not yet sent its
client a single byte; that request goes back to the head of its band and is sent again later.

Standard library only; it knows of running requests only what the request path registers: its
band, whether its answer has begun, and how to stop it. The rules:

- Never a request whose client has had a byte of its answer (llama-server's, or a head it
  goes with; a waiting stream's head and comments are slotgate's own, and it relays into
  that stream when sent again): what it sent cannot be taken back; nor one llama-server has
  begun to answer (an answer assembled from a stream sends nothing until it ends): its tokens
  would be thrown away. The check and the stop happen in one step on the loop, with no await
  between them, so a request cannot begin its answer in between: it is stopped where it
  waits (for llama-server's first bytes), before its answer is written.
- Never twice the same request: one preempted once runs to its end the next time.
- Never one that holds no slot (waiting again for a restarting llama-server): it frees none.
- The victim: of the requests below the waiter's band, one of the lowest band, the most
  recently started among them (the least work thrown away).
- One victim per waiter, once it has waited the bound.
- Only in the waiter's own line: with one line per model (app/gate/models.py), a request
  running on another model's slots frees nothing for the waiter, so it is never a victim.

In one process only: with replicas sharing a line, a replica preempts only what it runs itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("slotgate")


@dataclass(slots=True)
class Running:
    """A running request, as preemption sees it."""

    band: int
    #: Its answer's head went out: it may not be preempted any more.
    started: Callable[[], bool]
    #: Stop it (it then goes back to the head of its band).
    stop: Callable[[], None]
    label: str
    seq: int
    preempted: bool = False
    #: The line it holds slots in (a model's lane; None: the main line).
    line: object = None


class Preemption:
    """The running requests that could be preempted, and the count of those that were."""

    __slots__ = ("_running", "_seq", "after_s", "count")

    def __init__(self, after_s: float) -> None:
        #: How long a waiter waits before it may preempt.
        self.after_s = after_s
        self._running: dict[object, Running] = {}
        self._seq = 0
        #: Requests preempted so far.
        self.count = 0

    def run(
        self, key: object, band: int, started: Callable[[], bool], stop: Callable[[], None],
        label: str, line: object = None,
    ) -> None:  # fmt: skip
        """`key`'s request holds its slots in `line` now (again, after a preemption: then it
        stays immune)."""
        known = self._running.get(key)
        self._seq += 1
        self._running[key] = Running(
            band, started, stop, label, self._seq, known is not None and known.preempted, line
        )

    def end(self, key: object) -> None:
        self._running.pop(key, None)

    def was_preempted(self, key: object) -> bool:
        running = self._running.get(key)
        return running is not None and running.preempted

    def make_room(self, band: int, waiter: str, line: object = None) -> bool:
        """A waiter of `band` in `line` has waited the bound: stop one lower-band request of
        that line that has sent nothing yet; False when there is none."""
        victim: Running | None = None
        for running in self._running.values():
            if (
                running.line is not line
                or running.band >= band
                or running.preempted
                or running.started()
            ):
                continue
            if (
                victim is None
                or running.band < victim.band
                or (running.band == victim.band and running.seq > victim.seq)
            ):
                victim = running
        if victim is None:
            return False
        victim.preempted = True
        self.count += 1
        log.info(
            "preempted request %s (band %d) before its first byte, for request %s (band %d) "
            "waiting longer than PREEMPT_AFTER_S (%g s); it goes back to the head of its band",
            victim.label, victim.band, waiter, band, self.after_s,
        )  # fmt: skip
        victim.stop()
        return True
