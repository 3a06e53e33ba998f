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
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

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
#: Headers a reverse proxy adds to say whom it relays for, or that it relays (Envoy, a service
#: mesh's sidecar, sets x-forwarded-proto on everything): a request with one came from
#: elsewhere, whatever address it arrived from.
_RELAYED = (
    "forwarded", "x-forwarded-for", "x-real-ip", "x-forwarded-proto", "x-forwarded-host", "via",
)  # fmt: skip


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

    def who(
        self,
        client: str | None,
        authorization: bytes | None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """The caller as the log names it: its admin key's name (`key-` and 8 hex digits of the
        key's SHA-256), or, without ADMIN_KEYS, the loopback address it called from. Raises
        Unauthorized (no admin key, or a wrong one) or Forbidden (no way in for this caller).

        `headers` (the request's, lower-case names) matter without ADMIN_KEYS only, where the
        address is all there is: see `_browsed_or_relayed`."""
        if self._keys.keyed:
            # Bearer only: an X-Api-Key is a client's, never an operator's.
            presented = credentials(authorization, None)
            owner = self._keys.identify(presented)
            if owner is None:
                raise Unauthorized(
                    "operator controls need an admin key (ADMIN_KEYS): send "
                    "Authorization: Bearer <admin key>"
                )
            if self._access.enabled and self._access.tenants.identify(authorization, None):
                # Settings refuse a key in both API_KEYS and ADMIN_KEYS; API_KEYS_FILE (read
                # again on SIGHUP) is only known here. Its clients hold it too.
                raise Forbidden(
                    "this admin key is also an API key (API_KEYS_FILE); give operators keys "
                    "of their own"
                )
            return owner.name
        if self._access.enabled:
            raise Forbidden(
                "operator controls are off while API_KEYS is set and ADMIN_KEYS is not; set "
                "ADMIN_KEYS to use them"
            )
        if client is None or not _loopback(client) or _browsed_or_relayed(headers or {}):
            raise Forbidden(
                "operator controls answer loopback clients only unless ADMIN_KEYS is set "
                "(not one relayed by a proxy, nor a page of another origin)"
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
        upstream.drain()
        self._done("drain", who, "drained upstream %s: its running requests finish", upstream.name)

    def restore(self, who: str, upstream: Upstream) -> None:
        upstream.restore()
        self._done("restore", who, "restored upstream %s", upstream.name)

    def pause(self, who: str) -> None:
        self._gate.pause()
        if (lanes := self._fleet.lanes) is not None:
            lanes.pause()  # each model's line too (a router's)
        self._done("pause", who, "paused admission: new requests wait in line")

    def resume(self, who: str) -> None:
        self._gate.resume()
        if (lanes := self._fleet.lanes) is not None:
            lanes.resume()
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


def _browsed_or_relayed(headers: Mapping[str, str]) -> bool:
    """A loopback request that is not from someone on the host: relayed by a reverse proxy on
    it, or sent by a browser on it for a page of another origin.

    A page anywhere may make its visitor's browser POST to http://127.0.0.1:<port>/admin/...:
    a POST without a body or custom headers needs no CORS preflight, so only the reading of
    the answer is stopped, not the action. Browsers say whose page it is (`Origin`, and
    `Sec-Fetch-Site`); slotgate's own page is of its origin. A page whose name an attacker
    resolved to 127.0.0.1 (DNS rebinding) is of its own origin, so the name the request was
    sent to (`Host`) must be a loopback one too.
    """
    if any(name in headers for name in _RELAYED):
        return True
    if headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return True
    host = headers.get("host")
    if host is not None and not _loopback_name(host):
        return True
    origin = headers.get("origin")
    return origin is not None and (host is None or _netloc(origin) != host)


def _loopback_name(host: str) -> bool:
    """`host` (a Host header: a name or an address, and a port) names this host's loopback."""
    try:
        name = urlsplit("//" + host).hostname
    except ValueError:  # an unclosed "[", say
        return False
    return name is not None and (
        name == "localhost" or name.endswith(".localhost") or _loopback(name)
    )


def _netloc(origin: str) -> str | None:
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None
