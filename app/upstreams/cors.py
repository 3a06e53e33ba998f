"""llama-server's CORS policy, as its own answers show it, for the answers slotgate makes itself.

A 429, a 503 or the head of a stream that waits in the queue comes from slotgate, not from
llama-server, so it carries no CORS header unless slotgate adds one; and a browser client
cannot read an answer without one. But llama-server's policy is its operator's: by default it
echoes any Origin, yet it can be started with an allowlist (`--cors-origins`), without
credentials, or local-only. Echoing every Origin would widen it: the head of a waiting stream
would let any page read the generation relayed under it. So slotgate repeats, for each Origin,
the Access-Control-Allow-Origin llama-server last gave that Origin (a browser's preflight
teaches it before the first POST), and nothing for an Origin llama-server has not answered.

- Credentials are never allowed on slotgate's own answers: llama-server allows them only on a
  preflight, and a stricter answer is the safe side.
- Only an answer that carries the header teaches: one refused before llama-server's routing
  (a header too long, say) has none, and must not let a client unlearn another's Origin.
- What is learned lasts TTL_S unless llama-server says it again, and is forgotten at once when
  slotgate sees llama-server restart or change: a policy made stricter by a restart slotgate
  did not notice outlives it by TTL_S at most.
- Who teaches is the relay's choice (app/proxy/relay.py): with API keys, only answers to requests
  whose key was checked; without, only answers on the generation routes.
- Wherever an Origin is allowed, slotgate exposes the headers it sets (`EXPOSED`): a page may
  otherwise read none of Retry-After, x-should-retry or the request id, and the OpenAI SDK in a
  browser falls back to its own backoff. On a relayed answer they are added to whatever
  Access-Control-Expose-Headers llama-server sent (it sends none today), in its one line.
- The table holds MAX_ORIGINS. An entry is live while its TTL runs; when the table is full of
  live entries a new Origin is not learned (its answers from slotgate carry no CORS header until
  an entry lapses), rather than evicting one in use: a flood of made-up Origins can then delay
  a new Origin by TTL_S at most, and never take the header from a browser app already served.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from slotgate.asgi import Header

#: Origins remembered (a browser app uses one or a few); see above for when it is full.
MAX_ORIGINS = 256
#: Seconds an Origin's answer is trusted without llama-server repeating it.
TTL_S = 60.0
_ALLOW_ORIGIN = b"access-control-allow-origin"
_VARY = (b"vary", b"Origin")
_EXPOSE = b"access-control-expose-headers"
#: The headers slotgate sets that a client reads: when to retry, and the request's id.
EXPOSED = (b"retry-after", b"retry-after-ms", b"x-should-retry", b"x-request-id", b"request-id")
_EXPOSED_LINE = b", ".join(EXPOSED)


class CorsPolicy:
    def __init__(self) -> None:
        self._answers: dict[bytes, tuple[float, Header]] = {}

    def learn(self, origin: bytes, headers: Iterable[Header]) -> None:
        """Remember what llama-server answered a request from `origin` (lowercase names)."""
        for name, value in headers:
            if name == _ALLOW_ORIGIN:
                answers = self._answers
                now = time.monotonic()
                # Kept in the order last taught, so the first entry is the first to lapse.
                if answers.pop(origin, None) is None and len(answers) >= MAX_ORIGINS:
                    while answers and next(iter(answers.values()))[0] < now:
                        del answers[next(iter(answers))]
                    if len(answers) >= MAX_ORIGINS:
                        return  # full of live entries: none is given up for a newcomer
                answers[origin] = (now + TTL_S, (name, value))
                return

    def headers_for(self, origin: bytes | None) -> list[Header]:
        """The CORS headers for an answer of slotgate's own to a request from `origin`."""
        if origin is None:
            return []
        answer = self._answers.get(origin)
        # Vary even when nothing is allowed: the answer depends on the Origin all the same.
        if answer is None or answer[0] < time.monotonic():
            return [_VARY]
        return [answer[1], (_EXPOSE, _EXPOSED_LINE), _VARY]

    @staticmethod
    def expose(headers: list[Header]) -> None:
        """Add EXPOSED to a relayed answer's headers (lowercase names) if it allows an Origin,
        merged into llama-server's own Access-Control-Expose-Headers if it sent one."""
        at = None
        for index, (name, _) in enumerate(headers):
            if name == _EXPOSE:
                at = index
            elif name == _ALLOW_ORIGIN and at is None:
                at = -1
        if at is None:
            return
        if at < 0:
            headers.append((_EXPOSE, _EXPOSED_LINE))
            return
        given = headers[at][1]
        named = {part.strip().lower() for part in given.split(b",")}
        missing = [name for name in EXPOSED if name not in named]
        if missing:
            joined = b", ".join([given.strip(), *missing]) if given.strip() else _EXPOSED_LINE
            headers[at] = (_EXPOSE, joined)

    def forget(self) -> None:
        """llama-server went away or changed: its policy may have changed with it."""
        self._answers.clear()
