"""API keys: who may use slotgate, and as which tenant, checked before anything else happens."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from slotgate.errors import Unauthorized
from slotgate.gate.tenants import EVERYONE, Tenant, Tenants

#: Paths that answer without a key: liveness and readiness probes, and llama-server's /health.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/v1/health"})


class Access:
    """The keys of API_KEYS and API_KEYS_FILE (app/gate/tenants.py); one per app, shared by the
    routes and the proxy, so that a reload (SIGHUP) reaches both."""

    def __init__(self, keys: Iterable[str] = (), path: Path | None = None) -> None:
        self.tenants = Tenants(keys, path)

    @property
    def enabled(self) -> bool:
        return self.tenants.keyed

    def check(self, path: str, authorization: bytes | None, api_key: bytes | None) -> Tenant:
        """The tenant of the request's key; raise Unauthorized unless it carries one of the
        keys (or needs none: then EVERYONE). Keys are compared in constant time."""
        if not self.tenants.roster.keyed or path in OPEN_PATHS:
            return EVERYONE
        tenant = self.tenants.identify(authorization, api_key)
        if tenant is None:
            raise Unauthorized(
                "missing or invalid API key; send Authorization: Bearer <key> or X-Api-Key"
            )
        return tenant
