"""A tenant's quotas on the request path: the check before it waits, the `x-ratelimit-*` headers
of its answer, and the tokens its answer used, read from llama-server's own report and charged
when it ends. The windows and the rule are the gate's (app/gate/quotas.py); a request whose
tenant has no quota never reaches this module.

The tokens are read from the last bytes relayed, not by parsing the answer: llama-server ends
every answer with its `usage` (`prompt_tokens`, `completion_tokens`; Anthropic's
`input_tokens`, `output_tokens`; embeddings and rerank only `prompt_tokens`) and `timings`
(`prompt_n`, `predicted_n`), and in JSON a key with its quotes unescaped cannot occur inside a
string, so the last `"completion_tokens":` in the tail is llama-server's. An Anthropic stream
tells its prompt's tokens in its first event (`message_start`), so the first bytes are kept
too, for the prompt when the tail lacks it; and a usage or timings that leaves the tail with
more after it (a native answer's completion_probabilities) is kept. A stream that was cut
before its usage (the client left, llama-server failed) is charged one token per event
relayed, and its prompt where known (Anthropic's).
"""

from __future__ import annotations

import re

from slotgate.asgi import Headers
from slotgate.gate.quotas import Ledger, Standing
from slotgate.gate.tenants import Tenant

#: What is kept of a relayed answer: its usage and timings are in its last few hundred bytes.
TAIL_BYTES = 4096
#: What is kept from a usage or timings that left the tail: both fit in a few hundred bytes.
REPORT_BYTES = 1024

_PROMPT = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_PREDICTED_N = re.compile(rb'"predicted_n"\s*:\s*(\d+)')


class Tally:
    """The tokens one answer used: the tail of what was relayed, and its events, counted; the
    charge to its tenant's windows once it ends (`settle`)."""

    __slots__ = ("_ledger", "_name", "events", "head", "report", "tail")

    def __init__(self, ledger: Ledger, name: str) -> None:
        self._ledger = ledger
        self._name = name
        self.head = b""
        self.tail = bytearray()
        #: llama-server's usage or timings, kept when they left the tail with more after them.
        self.report = b""
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(b"data: ")
        if len(self.head) < TAIL_BYTES:
            self.head += chunk[: TAIL_BYTES - len(self.head)]
        tail = self.tail
        tail += chunk
        if len(tail) > 2 * TAIL_BYTES:
            self._keep_report(tail)
            del tail[:-TAIL_BYTES]

    def _keep_report(self, tail: bytearray) -> None:
        """Keep llama-server's usage and timings when more follows them than the tail holds
        (a native answer's completion_probabilities come after its timings)."""
        leaving = len(tail) - TAIL_BYTES
        at = max(tail.rfind(b'"usage"', 0, leaving), tail.rfind(b'"timings"', 0, leaving))
        if at >= 0:
            self.report = bytes(tail[at : at + REPORT_BYTES])

    def tokens(self) -> int:
        """Prompt and completion tokens, as llama-server reported them; else its events."""
        # The report kept first: a match in the tail, later, wins.
        tail = self.report + self.tail
        counted = tail
        start = tail.rfind(b'"message_start"')
        if start >= 0:
            # An Anthropic stream's first event has a usage too, its output_tokens a
            # placeholder (0): only a later one (message_delta's) counts what was generated.
            end = tail.find(b"\n\n", start)
            counted = tail[end:] if end >= 0 else b""
        completion = _last(_COMPLETION, counted)
        prompt = _last(_PROMPT, tail)
        if prompt is None:  # an Anthropic stream's is in its first event
            prompt = _last(_PROMPT, self.head)
        if completion is not None:
            return completion + (prompt or 0)
        if prompt is not None and start < 0:
            return prompt  # embeddings and rerank: a prompt, nothing generated
        predicted = _last(_PREDICTED_N, tail)
        if predicted is not None:
            return predicted + (_last(_PROMPT_N, tail) or 0)
        return self.events + (prompt or 0)

    def settle(self) -> None:
        """Charge the answer's tokens; once."""
        tokens, self.events, self.head, self.report = self.tokens(), 0, b"", b""
        self.tail.clear()
        self._ledger.charge(self._name, tokens)


def _last(pattern: re.Pattern[bytes], text: bytes) -> int | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - the last one is wanted
        pass
    return int(found.group(1)) if found is not None else None


async def admit(ledger: Ledger, tenant: Tenant) -> tuple[Headers, Tally | None]:
    """Count a request of a tenant with a quota: its answer's rate-limit headers and, when it
    has a token limit, the tally of its answer's tokens. Raises QuotaExceeded (the refusal
    carries the headers: `headers_of`)."""
    quota = tenant.quota
    assert quota is not None  # noqa: S101 - only tenants with a quota come here
    standing = await ledger.admit(tenant.name, quota)
    counts_tokens = quota.tokens_per_minute is not None or quota.tokens_per_day is not None
    return headers_of(standing), Tally(ledger, tenant.name) if counts_tokens else None


def headers_of(standing: Standing) -> Headers:
    """The `x-ratelimit-*` headers as OpenAI sends them: the limit, what is left, and when the
    window resets as a duration ("1s", "6m0s", "20ms"); a trio only for a limit that is set."""
    headers: Headers = []
    if standing.limit_requests is not None:
        headers += [
            (b"x-ratelimit-limit-requests", str(standing.limit_requests).encode()),
            (b"x-ratelimit-remaining-requests", str(standing.remaining_requests).encode()),
            (b"x-ratelimit-reset-requests", duration(standing.reset_requests_s).encode()),
        ]
    if standing.limit_tokens is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(standing.limit_tokens).encode()),
            (b"x-ratelimit-remaining-tokens", str(standing.remaining_tokens).encode()),
            (b"x-ratelimit-reset-tokens", duration(standing.reset_tokens_s).encode()),
        ]
    return headers


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write one (Go's): "20ms", "1.5s", "1m2s", "2h0m5s"."""
    millis = max(round(seconds * 1000), 0)
    if millis < 1000:
        return f"{millis}ms"
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    text = f"{millis / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text
