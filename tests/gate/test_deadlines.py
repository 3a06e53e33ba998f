"""Deadlines per request in the core: the bound a request gives, the refusal at once when its
estimated wait exceeds it, and leaving the line when it runs out."""

from __future__ import annotations

import asyncio

import pytest
from slotgate.errors import BadRequest, DeadlineUnmet, refusal
from slotgate.gate.admission import Admission
from slotgate.gate.deadlines import check, max_wait_s, within
from slotgate.gate.policy import QueuePolicy


def test_a_requests_header_is_its_bound_else_its_tenants() -> None:
    assert max_wait_s(b"2.5", 30.0) == 2.5
    assert max_wait_s(b"0", None) == 0.0
    assert max_wait_s(None, 30.0) == 30.0
    assert max_wait_s(None, None) is None


@pytest.mark.parametrize(
    "value",
    # Python's float() reads more than numbers of seconds: underscores, exponents, words.
    [b"soon", b"-1", b"nan", b"inf", b"86401", b"", b"1_0", b"1e1", b"1e309", b"infinity",
     b"-0", b"5, 7", b"\xd9\xa5", b"0x10"],
)  # fmt: skip
def test_a_bound_that_is_not_a_number_of_seconds_is_a_bad_request(value: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        max_wait_s(value, 30.0)
    assert refused.value.param == "X-Max-Wait"


@pytest.mark.parametrize(("value", "bound"), [(b"0", 0.0), (b"5", 5.0), (b"2.5", 2.5),
                                              (b".5", 0.5), (b"86400", 86400.0)])  # fmt: skip
def test_a_bound_in_seconds_is_read_as_given(value: bytes, bound: float) -> None:
    assert max_wait_s(value, 30.0) == bound


def test_a_request_expected_to_wait_past_its_bound_is_refused_at_once_with_the_estimate() -> None:
    check(2.0, 2.0)  # just in time: it waits
    with pytest.raises(DeadlineUnmet) as refused:
        check(5.0, 2.0)
    r = refusal(refused.value)
    assert (r.status, r.code, r.reason) == (503, "deadline_unmet", "deadline_unmet")
    assert r.extra == {"eta_s": 5.0, "max_wait_s": 2.0}
    assert r.retry_after_s == pytest.approx(3.0)
    assert "5.0 s" in r.message
    assert "X-Max-Wait" in r.message


async def test_a_waiter_still_in_line_at_its_bound_leaves_it() -> None:
    admission = Admission(QueuePolicy(max_queue=0))
    admission.resize(1)
    held = admission.enter(1)
    waiter = admission.enter(1)
    assert admission.queued == 1
    with pytest.raises(DeadlineUnmet) as refused:
        await within(waiter.wait(), 0.05, 0.0, lambda: 7.0)
    assert refused.value.waited_s == 0.05
    assert refused.value.eta_s == 7.0
    assert "no slot became free" in refused.value.message
    assert admission.queued == 0
    # The slot it left goes to whoever comes next, not to nobody.
    held.release()
    assert admission.enter(1).admitted


async def test_a_waiter_granted_within_its_bound_runs() -> None:
    admission = Admission(QueuePolicy(max_queue=0))
    admission.resize(1)
    held = admission.enter(1)
    waiter = admission.enter(1)
    asyncio.get_running_loop().call_soon(held.release)
    await within(waiter.wait(), 60.0, 0.0, lambda: 0.0)
    assert waiter.admitted


async def test_a_timeout_that_is_not_the_bounds_is_not_taken_for_it() -> None:
    async def times_out() -> None:
        raise TimeoutError

    with pytest.raises(TimeoutError):
        await within(times_out(), 60.0, 0.0, lambda: 0.0)
