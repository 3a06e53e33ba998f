"""API keys: who may use slotgate, checked in constant time before anything else happens."""

from __future__ import annotations

import hmac

from .errors import Unauthorized

#: Paths that answer without a key: liveness and readiness probes, and llama-server's /health.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/v1/health"})


class Access:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode() for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, path: str, authorization: bytes | None, api_key: bytes | None) -> None:
        """Raise Unauthorized unless the request carries one of the keys (or needs none)."""
        if not self._keys or path in OPEN_PATHS:
            return
        presented = api_key
        if authorization is not None:
            scheme, _, token = authorization.partition(b" ")
            if scheme.lower() == b"bearer":
                presented = token.strip()
        if presented is not None:
            # Compare against every key, so the time taken says nothing about which matched.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(presented, key)
            if matched:
                return
        raise Unauthorized(
            "missing or invalid API key; send Authorization: Bearer <key> or X-Api-Key"
        )
