"""Operator controls: drain and restore an upstream, pause and resume admission, cancel one
request; who may use them (ADMIN_KEYS, else loopback clients), and one log line and one count
per action.

The actions themselves live where their state does: a drain and a pause in the admission core
(app/gate/), through the `Gate`; a cancel in the request path's registry (app/proxy/watch.py's
`Running`). This module only names the caller and dispatches.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from slotgate.errors import Forbidden, Unauthorized
from slotgate.gate.tenants import credentials, roster
from slotgate.metrics import ACTIONS as ACTIONS  # the `action` label of each

if TYPE_CHECKING:
    from slotgate.gate.entry import Gate
    from slotgate.metrics import Metrics
    from slotgate.proxy.access import Access
    from slotgate.proxy.watch import Running
    from slotgate.upstreams.fleet import Fleet
    from slotgate.upstreams.upstream import Upstream

log = logging.getLogger("slotgate.operator")

#: The path prefix of the controls, all POST.
PREFIX = "/admin/"


class Operators:
    """Who may act (`who`), and the actions, each logged with whoever took it and counted."""

    def __init__(
        self,
        admin_keys: Iterable[str],
        access: Access,
        gate: Gate,
        fleet: Fleet,
        running: Running,
        metrics: Metrics,
    ) -> None:
        self._keys = roster(admin_keys)
        self._access = access
        self._gate = gate
        self._fleet = fleet
        self._running = running
        self._metrics = metrics

    def who(self, client: str | None, authorization: bytes | None) -> str:
        """The caller as the log names it: its admin key's name (`key-` and 8 hex digits of the
        key's SHA-256), or, without ADMIN_KEYS, the loopback address it called from. Raises
        Unauthorized (no admin key, or a wrong one) or Forbidden (no way in for this caller)."""
        if self._keys.keyed:
            # Bearer only: an X-Api-Key is a client's, never an operator's.
            owner = self._keys.identify(credentials(authorization, None))
            if owner is None:
                raise Unauthorized(
                    "operator controls need an admin key (ADMIN_KEYS): send "
                    "Authorization: Bearer <admin key>"
                )
            return owner.name
        if self._access.enabled:
            raise Forbidden(
                "operator controls are off while API_KEYS is set and ADMIN_KEYS is not; set "
                "ADMIN_KEYS to use them"
            )
        if client is None or not _loopback(client):
            raise Forbidden(
                "operator controls answer loopback clients only unless ADMIN_KEYS is set"
            )
        return client

    # -- the actions ---------------------------------------------------------------------------

    def upstream(self, name: str) -> Upstream | None:
        """The upstream `/admission` names `name` (or whose URL is `name`)."""
        for upstream in self._fleet:
            if name in (upstream.name, upstream.url):
                return upstream
        return None

    def drain(self, who: str, upstream: Upstream) -> None:
        upstream.pool.drain()
        self._done("drain", who, "drained upstream %s: its running requests finish", upstream.name)

    def restore(self, who: str, upstream: Upstream) -> None:
        upstream.pool.restore()
        self._done("restore", who, "restored upstream %s", upstream.name)

    def pause(self, who: str) -> None:
        self._gate.pause()
        self._done("pause", who, "paused admission: new requests wait in line")

    def resume(self, who: str) -> None:
        self._gate.resume()
        self._done("resume", who, "resumed admission")

    def cancel(self, who: str, request_id: str) -> bool:
        """False when no request by that id waits or runs (nothing is logged or counted)."""
        if not self._running.cancel(request_id):
            return False
        self._done("cancel", who, "cancelled request %s", request_id)
        return True

    def _done(self, action: str, who: str, message: str, subject: str | None = None) -> None:
        """One log line naming who did it, and one count."""
        args = (who,) if subject is None else (who, subject)
        log.info(
            "operator %s " + message,
            *args,
            extra={"operator": who, "action": action, "subject": subject},
        )
        self._metrics.operator(action)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
