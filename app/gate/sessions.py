"""Agent sessions: the id coding agents send with every request of one session, read to keep the
session on the upstream that has its cache and, with SESSION_FLOWS, to give each session a flow
of its own in the fair order.

Standard library only. The id is the first non-empty of the headers agents send
(`x-claude-code-session-id`, `x-session-affinity`, `session-id`, `session_id`), else a body's
`prompt_cache_key` (read with the body, app/intake/body.py): that one already keeps its
requests on one upstream as their affinity key, and names their session for the fair order.

Routing: the session's key takes the place of a chat's conversation key, so that each turn goes
back to the upstream its session last ran on (its whole history is cached there), while its
first goes where its prompt's start is (the affinity key). The pools remember a bounded number
of such keys, the least recently used forgotten first (app/gate/pool.py).

Fair order: sessions are many and come and go, so a session does not get an account of its own
in the fair line (which keeps one per name for good). Its id is hashed into one of
SESSION_FLOWS lanes of its tenant, each a flow named `<tenant>~<lane>` with the tenant's weight
and band: at most SESSION_FLOWS flows per tenant, whatever the number of sessions, and nothing
to forget (two sessions in one lane share it, as requests without a session share their
tenant's flow). Only for a tenant without `max_active` or `max_queued`, whose limits must count
all its requests together.
"""

from __future__ import annotations

from collections.abc import Iterable

from slotgate.gate.routing import stable_hash
from slotgate.gate.tenants import Tenant

#: The headers a session id comes in, the first found wins.
HEADERS = frozenset({b"x-claude-code-session-id", b"x-session-affinity", b"session-id",
                     b"session_id"})  # fmt: skip
#: What is read of an id: enough to tell sessions apart, bounded whatever a client sends.
MAX_ID_BYTES = 256
#: Lanes' tenants kept made, across tenants and reloads, before the cache starts again.
_MADE = 4096


def session_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The request's session id, or None."""
    for name, value in headers:
        if name in HEADERS and (value := value.strip()):
            return value[:MAX_ID_BYTES]
    return None


def routing_key(session: bytes) -> int:
    """The key that keeps a session on the upstream it last ran on."""
    return stable_hash(b"session:" + session)


class Sessions:
    """Each session's flow: one of `lanes` per tenant."""

    __slots__ = ("_made", "lanes")

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self._made: dict[tuple[Tenant, int], Tenant] = {}

    def flow(self, tenant: Tenant, session: bytes) -> Tenant:
        """Whom the fair line counts a request of `session` for: its lane of `tenant`, or
        `tenant` itself when the tenant has limits that count all its requests together."""
        if tenant.max_active is not None or tenant.max_queued is not None:
            return tenant
        lane = stable_hash(b"lane:" + session) % self.lanes
        made = self._made.get((tenant, lane))
        if made is None:
            if len(self._made) >= _MADE:
                self._made.clear()  # reloaded tenants' lanes, left behind
            made = Tenant(f"{tenant.name}~{lane}", tenant.weight, tenant.band)
            self._made[tenant, lane] = made
        return made
