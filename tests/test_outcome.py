"""A request's outcome: the words the access log and the metrics' labels share."""

from __future__ import annotations

from slotgate.metrics import REASONS
from slotgate.outcome import Outcome


def test_outcome_values_are_the_label_values_dashboards_select_on() -> None:
    assert [o.value for o in Outcome] == [
        "served", "upstream_error", "shutdown", "queue_full", "tenant_queue_full",
        "queue_bytes_full", "queue_timeout", "quota_exceeded", "deadline_unmet", "client_gone",
        "upstream_unavailable", "upstream_failed", "bad_request", "unauthorized", "internal",
        "cancelled", "admitted",
    ]  # fmt: skip
    assert f"{Outcome.CLIENT_GONE}" == "client_gone"
    assert str(Outcome.QUEUE_FULL) == "queue_full"


def test_a_request_not_served_counts_under_its_reason_and_a_shutdown_as_unavailable() -> None:
    assert Outcome.SERVED.reason is None
    assert Outcome.UPSTREAM_ERROR.reason is None
    assert Outcome.SHUTDOWN.reason is Outcome.UPSTREAM_UNAVAILABLE
    assert all(Outcome(reason).reason == reason for reason in REASONS)
