"""Requests that wait while llama-server (re)starts, with big bodies and a KV budget: the helpers
the startup-wait and body-bytes tests share."""

from __future__ import annotations

from typing import Any

from slotgate.intake.body import OFF_LOOP_BYTES

from tests.conftest import GateFactory, RunningGate, chat
from tests.support.standin import StandIn

#: A body big enough to be parsed in the worker process (app/intake/body.py).
BIG = OFF_LOOP_BYTES + 64 * 1024


def big_chat(**extra: Any) -> dict[str, Any]:
    return chat(**extra) | {"messages": [{"role": "user", "content": "x" * BIG}]}


def settled(gate: RunningGate) -> bool:
    """Nobody waits or holds anything: no place, no slot, no token, no body byte."""
    admission = gate.service.admission
    return (
        admission.queued == 0
        and admission.active == 0
        and admission.committed_tokens == 0
        and not list(admission._line.tickets())
        and gate.service.proxy.body_bytes.held == 0
    )


async def restarting_gate(
    start_gate: GateFactory, standin: StandIn, **overrides: Any
) -> RunningGate:
    """slotgate that knew llama-server (2 slots, a KV budget) and now finds it loading again."""
    values: dict[str, Any] = {"kv_budget_tokens": 100_000, "queue_body_bytes": 8 * BIG}
    values |= overrides
    gate: RunningGate = await start_gate(**values)
    assert gate.service.admission.budget_tokens == values["kv_budget_tokens"]
    standin.loading = True
    gate.service.upstream.poke()
    await gate.until(lambda: gate.service.admission.capacity is None)
    return gate
