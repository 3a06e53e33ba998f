"""An `Entry` for the shared line's tests, as they think of one: a tenant by name ("": none)
with its share and limits, and a band (the batch band unless asked, so that a test's urgent
requests are the ones it names)."""

from __future__ import annotations

from slotgate.gate.entry import Entry
from slotgate.gate.tenants import BATCH, EVERYONE, Tenant


def entry(
    weight: int = 1,
    *,
    cost: int = 0,
    tenant: str = "",
    share: float = 1.0,
    band: int = BATCH,
    max_active: int | None = None,
    max_queued: int | None = None,
    tasks: int = 0,
) -> Entry:
    named = Tenant(tenant, share, band, max_active, max_queued) if tenant else EVERYONE
    return Entry(weight, cost, tenant=named, band=band, tasks=tasks)
