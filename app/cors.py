"""llama-server's CORS policy, as its own answers show it, for the answers slotgate makes itself.

A 429, a 503 or the head of a stream that waits in line comes from slotgate, not from
llama-server, so it carries no CORS header unless slotgate adds one; and a browser client
cannot read an answer without one. But llama-server's policy is its operator's: by default it
echoes any Origin, yet it can be started with an allowlist (`--cors-origins`), without
credentials, or local-only. Echoing every Origin would widen it: the head of a waiting stream
would let any page read the generation relayed under it. So slotgate repeats, for each Origin,
the Access-Control-Allow-Origin llama-server last gave that Origin (a browser's preflight
teaches it before the first POST), and nothing for an Origin llama-server has not answered.
Credentials are never allowed on slotgate's own answers: llama-server allows them only on a
preflight, and a stricter answer is the safe side.
"""

from __future__ import annotations

from collections.abc import Iterable

Header = tuple[bytes, bytes]

#: Origins remembered; the oldest is forgotten past this (a browser app uses one or a few).
MAX_ORIGINS = 256
_ALLOW_ORIGIN = b"access-control-allow-origin"
_VARY = (b"vary", b"Origin")


class CorsPolicy:
    def __init__(self) -> None:
        self._answers: dict[bytes, tuple[Header, ...]] = {}

    def learn(self, origin: bytes, headers: Iterable[Header]) -> None:
        """Remember what llama-server answered a request from `origin` (lowercase names)."""
        allowed = tuple((name, value) for name, value in headers if name == _ALLOW_ORIGIN)
        self._answers.pop(origin, None)
        self._answers[origin] = allowed
        if len(self._answers) > MAX_ORIGINS:
            del self._answers[next(iter(self._answers))]

    def headers_for(self, origin: bytes | None) -> list[Header]:
        """The CORS headers for an answer of slotgate's own to a request from `origin`."""
        if origin is None:
            return []
        allowed = self._answers.get(origin)
        # Vary even when nothing is allowed: the answer depends on the Origin all the same.
        return [*allowed, _VARY] if allowed else [_VARY]

    def forget(self) -> None:
        """llama-server went away or changed: its policy may have changed with it."""
        self._answers.clear()
