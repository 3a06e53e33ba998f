"""How a request ended: one word that the access log's `outcome` field, the `reason` label of
`slotgate_requests_rejected` and the `outcome` label of `slotgate_queue_wait_seconds` share.

Modelled on the Kubernetes inference gateway's QueueOutcome. The values are label values that
dashboards and alerts select on: renaming one breaks them. Standard library only, so that any
module may name an outcome.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """A request's outcome; a str, so that it is its own label and log value."""

    #: llama-server's answer was relayed.
    SERVED = "served"
    #: llama-server's answer was relayed, and it was an error (a refusal of its own).
    UPSTREAM_ERROR = "upstream_error"
    #: Cut by the drain timeout at shutdown; counted as `upstream_unavailable`.
    SHUTDOWN = "shutdown"
    # The refusals, and the client leaving: each also a `reason` label.
    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"
    QUEUE_BYTES_FULL = "queue_bytes_full"
    QUEUE_TIMEOUT = "queue_timeout"
    QUOTA_EXCEEDED = "quota_exceeded"
    DEADLINE_UNMET = "deadline_unmet"
    CLIENT_GONE = "client_gone"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_FAILED = "upstream_failed"
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"
    #: An operator cancelled it (POST /admin/requests/{id}/cancel), waiting or running.
    CANCELLED = "cancelled"
    #: A wait's outcome only (the wait histogram's label): it ended in a slot. The request it
    #: was for ends as one of the others.
    ADMITTED = "admitted"

    @property
    def reason(self) -> Outcome | None:
        """The `reason` label it is counted under as a request that was not served; None for
        one that was."""
        return _REASON.get(self, self)


#: Every `reason` label, each with a series from the start (app/metrics.py), in this order; as
#: strings, which they are, for whoever counts under one.
REASONS: tuple[str, ...] = (
    Outcome.QUEUE_FULL,
    Outcome.TENANT_QUEUE_FULL,
    Outcome.QUEUE_BYTES_FULL,
    Outcome.QUEUE_TIMEOUT,
    Outcome.QUOTA_EXCEEDED,
    Outcome.DEADLINE_UNMET,
    Outcome.CLIENT_GONE,
    Outcome.UPSTREAM_UNAVAILABLE,
    Outcome.UPSTREAM_FAILED,
    Outcome.BAD_REQUEST,
    Outcome.UNAUTHORIZED,
    Outcome.INTERNAL,
    Outcome.CANCELLED,
)

_REASON: dict[Outcome, Outcome | None] = {
    Outcome.SERVED: None,
    Outcome.UPSTREAM_ERROR: None,
    Outcome.ADMITTED: None,
    Outcome.SHUTDOWN: Outcome.UPSTREAM_UNAVAILABLE,
}
