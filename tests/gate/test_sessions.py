"""Agent sessions in the core: the id read from an agent's headers, and a session's flow in the
fair order, bounded whatever the number of sessions."""

from __future__ import annotations

from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.sessions import MAX_ID_BYTES, Sessions, routing_key, session_of
from slotgate.gate.tenants import EVERYONE, Tenant


def test_the_session_id_is_the_first_agent_header_that_carries_one() -> None:
    assert session_of([(b"x-claude-code-session-id", b"abc")]) == b"abc"
    assert session_of([(b"session-id", b" "), (b"x-session-affinity", b"s2")]) == b"s2"
    assert session_of([(b"session_id", b"s3"), (b"session-id", b"s4")]) == b"s3"
    assert session_of([(b"x-request-id", b"r1")]) is None
    assert session_of([(b"session-id", b"x" * 10_000)]) == b"x" * MAX_ID_BYTES


def test_a_sessions_routing_key_is_its_own_and_stable() -> None:
    assert routing_key(b"a") == routing_key(b"a") != routing_key(b"b")


def test_a_session_keeps_one_flow_and_sessions_are_bounded_by_the_lanes() -> None:
    sessions = Sessions(8)
    tenant = Tenant("team", weight=3, band=0)
    assert sessions.flow(tenant, b"s1") is sessions.flow(tenant, b"s1")
    flows = {sessions.flow(tenant, f"s{n}".encode()) for n in range(1000)}
    assert len(flows) == 8
    assert {(f.weight, f.band) for f in flows} == {(3, 0)}
    assert all(f.name.startswith("team~") for f in flows)


def test_a_tenant_whose_limits_count_all_its_requests_keeps_one_flow() -> None:
    sessions = Sessions(8)
    limited = Tenant("team", max_active=2)
    assert sessions.flow(limited, b"s1") is limited
    assert sessions.flow(Tenant("jobs", max_queued=5), b"s1").name == "jobs"


async def test_one_sessions_flood_does_not_hold_back_another_sessions_next_request() -> None:
    sessions = Sessions(64)
    admission = Admission(QueuePolicy(max_queue=0))
    admission.resize(1)
    flood = sessions.flow(EVERYONE, b"agent-a")
    chat = sessions.flow(EVERYONE, b"agent-b")
    assert flood is not chat
    running = admission.enter(1, tenant=flood)
    queued = [admission.enter(1, tenant=flood) for _ in range(20)]
    asked = admission.enter(1, tenant=chat)
    running.release()
    if not asked.granted:  # the flood's next took the slot (a tie goes to arrival)
        assert queued[0].granted
        queued[0].release()
    # Within two grants, not behind the flood's twenty.
    assert asked.granted
    assert sum(t.granted for t in queued) <= 1
    for ticket in [asked, *queued]:
        ticket.release()
