"""An `Entry` for the shared line, written as the line's tests think of it: a tenant by name
("": none), its share and limits, a band (the batch band unless asked, as requests without a
tenant of their own were in these tests' scenarios)."""

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
