"""The exception tree, the table that answers it, and the retry headers of an answer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import slotgate.errors as errors
from slotgate.errors import (
    ANSWERS,
    INTERNAL,
    AdmissionError,
    BadRequest,
    Cancelled,
    ClientError,
    ContextExceeded,
    DeadlineUnmet,
    Forbidden,
    GateError,
    HeadersTooLarge,
    HeadTimeout,
    ModelLoadFailed,
    ModelNotLoaded,
    NotReady,
    PayloadTooLarge,
    QueueBytesFull,
    QueueFull,
    QueueTimeout,
    QuotaExceeded,
    ShuttingDown,
    SlotgateError,
    TenantQueueFull,
    TenantTooLarge,
    TooLarge,
    TooManyWatchers,
    Unauthorized,
    UnknownModel,
    UnsupportedMediaType,
    UpgradeRefused,
    UpstreamError,
    UpstreamFailed,
    UpstreamStarting,
    UpstreamUnavailable,
    refusal,
)
from slotgate.gate.fairline import Share
from slotgate.gate.pool import Snapshot
from slotgate.gate.quotas import Standing
from slotgate.gate.tenants import Tenant
from slotgate.proxy.refusals import retry_headers

#: The branches of the tree: none is raised, so none has a row.
FAMILIES = (GateError, ClientError, AdmissionError, UpstreamError)

_SNAP = Snapshot(2, 2, 1, 4)
#: One of each GateError that can be raised.
RAISED: list[GateError] = [
    BadRequest("bad"),
    UpgradeRefused("upgrade"),
    Unauthorized("who"),
    PayloadTooLarge("big"),
    HeadersTooLarge("head"),
    UnsupportedMediaType("media"),
    HeadTimeout("slow"),
    ContextExceeded(5000, 4096),
    UnknownModel("gamma"),
    ModelNotLoaded(),
    ModelLoadFailed("gamma", 1),
    NotReady(_SNAP, 1.0),
    ShuttingDown(_SNAP, 1.0),
    QueueFull(_SNAP, 2.0),
    TenantQueueFull(dataclasses.replace(_SNAP, tenant=Share("acme", 1.0, 1, 2, 0.0)), 3.0),
    QueueBytesFull("bodies", _SNAP, 2.5),
    QueueTimeout(_SNAP, 0.5),
    TooLarge(_SNAP, 3),
    TenantTooLarge(_SNAP, 2, Tenant("acme", max_active=1)),
    QuotaExceeded("acme", "tokens_per_day", 60.0, Standing(None, 0, 0.0, 10, 0, 60.0)),
    DeadlineUnmet(2.0, 5.0),
    UpstreamUnavailable("away"),
    UpstreamStarting("starting", sent=True),
    UpstreamFailed("broke"),
    Forbidden("not here"),
    Cancelled("an operator"),
    TooManyWatchers("watched"),
]


def _walk(cls: type[BaseException], depth: int = 0) -> list[tuple[int, str]]:
    found = []
    for sub in cls.__subclasses__():
        found += [(depth + 1, sub.__name__), *_walk(sub, depth + 1)]
    return found


def _drawn() -> list[tuple[int, str]]:
    """The tree in errors.py's docstring, as (depth, name) in the order drawn."""
    drawn = []
    for line in (errors.__doc__ or "").splitlines():
        for mark in ("├── ", "└── "):
            at = line.find(mark)
            if at >= 0:
                drawn.append((at // 4, line[at + len(mark) :].split()[0]))
    return drawn


def test_the_tree_in_the_docstring_is_the_tree_of_classes() -> None:
    assert "    SlotgateError " in (errors.__doc__ or "")
    assert _drawn() == _walk(SlotgateError)
    for _, name in _drawn():
        assert getattr(errors, name).__module__ == errors.__name__


def test_every_gate_error_that_can_be_raised_has_one_row_and_no_branch_has_one() -> None:
    tree = {getattr(errors, name) for _, name in _drawn()}
    answered = {cls for cls in tree if issubclass(cls, GateError)} | {GateError}
    assert set(ANSWERS) == answered - set(FAMILIES)
    assert {type(exc) for exc in RAISED} == set(ANSWERS)


@pytest.mark.parametrize("exc", RAISED, ids=lambda exc: type(exc).__name__)
def test_each_refusal_is_answered_as_its_row_says(exc: GateError) -> None:
    shape = ANSWERS[type(exc)]
    r = refusal(exc)
    assert (r.status, r.type, r.code, r.reason) == (
        shape.status,
        shape.type,
        shape.code,
        shape.reason,
    )
    assert r.message == exc.message
    assert (r.retry_after_s is not None) == shape.retry
    assert (r.snapshot is not None) == (shape.retry and isinstance(exc, AdmissionError))


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("a secret"), errors.ClientGone(), errors.Down("redis"), ValueError("x")],
    ids=lambda exc: type(exc).__name__,
)
def test_anything_without_a_row_is_an_internal_error_that_leaks_no_text(
    exc: Exception,
) -> None:
    r = refusal(exc)
    assert (r.status, r.type, r.code, r.reason) == (
        INTERNAL.status, INTERNAL.type, INTERNAL.code, INTERNAL.reason,
    )  # fmt: skip
    assert r.message == "slotgate failed internally"


def test_errors_imports_nothing_but_the_standard_library() -> None:
    """So that the admission core, standard library only, may raise its refusals from it."""
    probe = (
        "import sys; before = set(sys.modules); import slotgate.errors; "
        "new = set(sys.modules) - before; "
        "print(sorted(m for m in new if m.partition('.')[0] not in sys.stdlib_module_names))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['slotgate', 'slotgate.errors']"


@pytest.mark.parametrize(
    ("retry_after_s", "seconds", "milliseconds"),
    [
        (0.2, "1", "200"),
        (1.0, "1", "1000"),
        (1.49, "1", "1490"),
        (1.5, "2", "1500"),
        (2.5, "3", "2500"),
        (2.75, "3", "2750"),
        (3.2, "3", "3200"),
        (59.6, "60", "59600"),
    ],
)
def test_retry_after_is_retry_after_ms_rounded_to_the_nearest_second_and_at_least_one(
    retry_after_s: float, seconds: str, milliseconds: str
) -> None:
    headers = dict(retry_headers(retry_after_s))
    assert headers[b"retry-after"] == seconds.encode()
    assert headers[b"retry-after-ms"] == milliseconds.encode()
    assert headers[b"x-should-retry"] == b"true"


@pytest.mark.parametrize(
    "exc",
    [
        QueueFull(_SNAP, 2.75),
        QueueFull(_SNAP, 0.2),
        TenantQueueFull(dataclasses.replace(_SNAP, tenant=Share("acme", 1.0, 1, 2, 0.0)), 3.5),
        QuotaExceeded("acme", "requests_per_minute", 41.5, Standing(60, 0, 41.5, None, 0, 0.0)),
        DeadlineUnmet(2.0, 5.0),
        DeadlineUnmet(2.0, 5.0, waited_s=2.0),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_refusal_to_retry_says_when_in_its_message_as_retry_after_does(exc: GateError) -> None:
    # An SDK's exception shows the message, not the headers: it names the same whole seconds.
    r = refusal(exc)
    assert r.retry_after_s is not None
    seconds = dict(retry_headers(r.retry_after_s))[b"retry-after"].decode()
    assert f"retry in {seconds} s (Retry-After)" in r.message
