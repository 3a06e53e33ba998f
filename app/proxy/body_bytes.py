"""The bytes of gated request bodies not yet admitted, bounded by QUEUE_BODY_BYTES.

A body is read whole before its request waits, and the line may be long: the bytes held by
bodies being read, parsed or waiting in the line are counted against one bound (0: none). Each
request's part is a `HeldBody`, a scope like a ticket: its release is idempotent, so an early
release (the request was admitted) and the scope's own end (every other way out) never give
the same bytes back twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotgate.errors import QueueBytesFull, retry_in

if TYPE_CHECKING:
    from slotgate.gate.admission import Admission


class BodyBytes:
    """The count for one app; `held` is what the requests not yet admitted hold now."""

    __slots__ = ("_admission", "held", "limit")

    def __init__(self, limit: int, admission: Admission) -> None:
        self.limit = limit
        self.held = 0
        self._admission = admission


class HeldBody:
    """One request's bytes in the count, from its first byte read until it is admitted or over."""

    __slots__ = ("_count", "bytes")

    def __init__(self, count: BodyBytes) -> None:
        self._count = count
        self.bytes = 0

    def count(self, size: int) -> None:
        """Count `size` more bytes, before they are read, or refuse them (429). A body alone is
        let in whatever its size (MAX_BODY_BYTES bounds it), so a bound below that refuses no
        body for good."""
        count = self._count
        limit = count.limit
        others = count.held - self.bytes
        if limit and others and count.held + size > limit:
            admission = count._admission
            retry_after_s = admission.retry_after_s(admission.queued + 1)
            raise QueueBytesFull(
                f"requests not yet admitted already hold {others} bytes of request bodies "
                f"(being read or waiting in the queue), and {self.bytes + size} would "
                f"pass QUEUE_BODY_BYTES ({limit}); {retry_in(retry_after_s)}",
                admission.snapshot(),
                retry_after_s,
            )
        count.held += size
        self.bytes += size

    def release(self) -> None:
        """Its body no longer counts (admitted, refused or gone); harmless twice."""
        self._count.held -= self.bytes
        self.bytes = 0
