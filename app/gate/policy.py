"""How long the line may grow, and how far behind its head a free slot is offered: the numbers
the admission core and the shared line's scripts both follow. Standard library only, imported by
the settings without the rest of the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

#: How far behind the head the line is searched for requests that can run where the head
#: cannot (`Admission._backfill`).
BACKFILL_SCAN = 1024


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """How deep the line may grow for a given capacity; `None` fields mean "not set"."""

    max_queue: int | None = None
    queue_per_slot: int | None = None
    min_queue: int | None = None

    DEFAULT_PER_SLOT = 16
    DEFAULT_MIN = 64

    def unknown_limit(self) -> int | None:
        """The line limit before any capacity is known: MAX_QUEUE, else MIN_QUEUE (or its
        default), else unbounded when QUEUE_PER_SLOT=0."""
        if self.max_queue is not None:
            return self.max_queue or None
        if self.queue_per_slot == 0:
            return None
        return self.DEFAULT_MIN if self.min_queue is None else self.min_queue

    def limit(self, capacity: int) -> int | None:
        """The line limit in requests, or None for an unbounded line."""
        if self.max_queue is not None:
            return self.max_queue or None
        if self.queue_per_slot is None:
            floor = self.DEFAULT_MIN if self.min_queue is None else self.min_queue
            return max(self.DEFAULT_PER_SLOT * capacity, floor)
        if self.queue_per_slot == 0:
            return None
        # An explicit multiplier is taken as meant: the default floor does not apply to it.
        return max(self.queue_per_slot * capacity, self.min_queue or 0)
