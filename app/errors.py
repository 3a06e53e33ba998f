"""slotgate's exceptions, in one tree, and the one table that says how each refusal is answered.

    SlotgateError                 anything slotgate raises on purpose
    ├── GateError                 a request slotgate answers itself: one row of ANSWERS each
    │   ├── ClientError           the request as sent cannot pass; sent again as is, it fails
    │   │   ├── BadRequest
    │   │   │   └── UpgradeRefused
    │   │   ├── Unauthorized
    │   │   ├── Forbidden
    │   │   ├── PayloadTooLarge
    │   │   ├── HeadersTooLarge
    │   │   ├── UnsupportedMediaType
    │   │   ├── HeadTimeout
    │   │   ├── ContextExceeded
    │   │   ├── UnknownModel
    │   │   └── ModelNotLoaded
    │   ├── AdmissionError        not admitted: the pool's Snapshot and a retry estimate
    │   │   ├── NotReady
    │   │   ├── ShuttingDown
    │   │   ├── QueueFull
    │   │   │   └── TenantQueueFull
    │   │   ├── QueueBytesFull
    │   │   ├── QueueTimeout
    │   │   └── TooLarge
    │   │       └── TenantTooLarge
    │   ├── QuotaExceeded         the tenant used up a quota of its keys file; its window frees
    │   ├── DeadlineUnmet         no slot within the request's X-Max-Wait; the line may shorten
    │   ├── Cancelled             an operator ended it (POST /admin/requests/{id}/cancel)
    │   ├── UpstreamError         llama-server could not give its answer
    │   │   ├── UpstreamUnavailable
    │   │   │   ├── UpstreamStarting
    │   │   │   └── ModelLoadFailed
    │   │   └── UpstreamFailed
    │   └── TooManyWatchers       the status stream has all the watchers it takes
    ├── ExchangeFailed            the upstream client's: answered as an UpstreamError
    │   ├── ConnectFailed
    │   ├── Disconnected
    │   ├── ProtocolError
    │   ├── Stalled               (also a TimeoutError)
    │   └── BodyTooLarge
    ├── ClientGone                the client left: nobody is left to answer
    ├── AnswerStarted             a second head for one answer: a bug (also a RuntimeError)
    ├── Down                      Redis did not answer: the replica gates on its own share
    ├── Stale                     a Redis answer that a degrade or a rejoin took back
    └── InvalidTenantsFile        API_KEYS_FILE unusable, at start-up (also a ValueError)

Only a GateError becomes an answer (`refusal`), by its row of ANSWERS; anything else that
reaches an answer is a 500 whose text is not leaked. ExchangeFailed and the last five never
become an answer as they are: the upstream and the relay turn a failed exchange into an
UpstreamError, and the others are signals between parts of slotgate, each caught where it
means something (a client that left is counted, not answered). The managed engine's own
errors (`EngineFailed` in app/engine/model.py) stay in the engine: a package of its own,
standard library only, that imports nothing else of slotgate.

Standard library only, so that the admission core may raise these; the bytes of an answer
are written where HTTP lives (app/proxy/refusals.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    # For annotations only: the gate imports this module, never the reverse at run time.
    from slotgate.gate.pool import Snapshot
    from slotgate.gate.quotas import Standing
    from slotgate.gate.tenants import Tenant

Flavor = Literal["openai", "anthropic"]


def whole_seconds(retry_after_s: float) -> int:
    """A retry estimate as `Retry-After` gives it: whole seconds, rounded half up, at least 1
    (so that it is within half a second of `retry-after-ms`). Messages say the same number, so
    that someone who reads only the message (an SDK's exception) knows when to come back."""
    return max(1, math.floor(retry_after_s + 0.5))


def retry_in(retry_after_s: float) -> str:
    """The end of a refusal's message that says when to come back."""
    return f"retry in {whole_seconds(retry_after_s)} s (Retry-After)"


class SlotgateError(Exception):
    """Anything slotgate raises on purpose."""


# -- answered: a request slotgate answers itself ---------------------------------------------


class GateError(SlotgateError):
    """A request slotgate answers itself, without (or instead of) llama-server's answer."""

    #: The request field the refusal names (OpenAI's `param`).
    param: str | None = None
    #: When a retry may pass, in seconds (sent only where the row says a retry can pass).
    retry_after_s: float | None = None
    #: llama-server's own fields beside its error's, for an answer in its words.
    extra: dict[str, Any] | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param

    @property
    def message(self) -> str:
        """What the client reads."""
        return str(self.args[0])


class ClientError(GateError):
    """The request as sent cannot pass: sent again unchanged, it is refused again."""


class BadRequest(ClientError):
    pass


class UpgradeRefused(BadRequest):
    """A request to switch protocols (WebSocket, h2c): slotgate relays HTTP/1.1 only."""


class Unauthorized(ClientError):
    pass


class Forbidden(ClientError):
    """Not allowed to this client, whatever it sends (operator controls from elsewhere than
    loopback without ADMIN_KEYS)."""


class PayloadTooLarge(ClientError):
    pass


class HeadersTooLarge(ClientError):
    pass


class UnsupportedMediaType(ClientError):
    pass


class HeadTimeout(ClientError):
    """The request head took longer than HEAD_TIMEOUT_S to arrive."""


class ContextExceeded(ClientError):
    """The prompt alone is longer than llama-server's KV cache: it could never run. Said in
    llama-server's own words and shape, before the request waits for anything."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it"
        )
        self.extra = {"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx}


class UnknownModel(ClientError):
    """A router serves no model of that id or alias (or the request named none): said in
    llama-server's router's own words, before the request waits for anything."""

    def __init__(self, name: str, beyond: int | None = None) -> None:
        if beyond is not None:
            # The router serves it, but slotgate keeps no line for it: say so, not "not found".
            message = (
                f"model '{name}' is one of more than {beyond} models the router lists, and "
                f"slotgate keeps a line for {beyond} at most; serve fewer models per router"
            )
        elif name:
            message = f"model '{name}' not found"
        else:
            message = "model name is missing from the request"
        super().__init__(message, param="model")


class ModelNotLoaded(ClientError):
    """The model is not loaded and must not be loaded for this request (`?autoload=false`, or
    a router started with --no-models-autoload): the router's own answer."""

    def __init__(self) -> None:
        super().__init__("model is not loaded", param="model")


class AdmissionError(GateError):
    """A request was not admitted; `snapshot` shows the pool at that moment. The message is
    made only when an answer reads it."""

    retry_after_s: float

    def __init__(self, snapshot: Snapshot, retry_after_s: float) -> None:
        Exception.__init__(self, snapshot, retry_after_s)
        self.snapshot = snapshot
        self.retry_after_s = retry_after_s

    @property
    def counts(self) -> str:
        snap = self.snapshot
        return f"active={snap.active}, queued={snap.queued}, capacity={snap.capacity}"


class NotReady(AdmissionError):
    """The pool's capacity is not known yet (llama-server down, loading or restarting)."""

    @property
    def message(self) -> str:
        return (
            "llama-server is not ready (starting, loading the model, unreachable, or drained "
            "by an operator); retry shortly"
        )


class ShuttingDown(AdmissionError):
    """The gate is draining for shutdown and takes no new work."""

    @property
    def message(self) -> str:
        return "slotgate is shutting down; retry shortly"


class QueueFull(AdmissionError):
    """The line is at its limit."""

    @property
    def message(self) -> str:
        return (
            f"llama-server generation queue is full ({self.counts}); {retry_in(self.retry_after_s)}"
        )


class TenantQueueFull(QueueFull):
    """The request's tenant has max_queued waiters in the line already; others still get in.
    Its snapshot carries the tenant's share."""

    @property
    def message(self) -> str:
        own = self.snapshot.tenant
        if own is None:
            return super().message
        return (
            f"tenant {own.name} has {own.queued} requests waiting already, its limit "
            f"(max_queued; active={own.active}); {retry_in(self.retry_after_s)}"
        )


class QueueBytesFull(AdmissionError):
    """The requests in the queue already hold QUEUE_BODY_BYTES of bodies; a retry may pass."""

    def __init__(self, message: str, snapshot: Snapshot, retry_after_s: float) -> None:
        super().__init__(snapshot, retry_after_s)
        self._message = message

    @property
    def message(self) -> str:
        return self._message


class QueueTimeout(AdmissionError):
    """The request waited longer than the queue timeout."""

    @property
    def message(self) -> str:
        return f"request waited longer than QUEUE_TIMEOUT_S for a free slot ({self.counts})"


class TooLarge(AdmissionError):
    """The request needs more slots than the pool has, so it could never be admitted."""

    param = "n"

    def __init__(self, snapshot: Snapshot, weight: int, largest: int | None = None) -> None:
        super().__init__(snapshot, 0.0)
        self.weight = weight
        #: The most slots one upstream has (a request runs in one): the fleet's, when one.
        self.largest = snapshot.capacity if largest is None else largest

    @property
    def message(self) -> str:
        return (
            f"request needs {self.weight} slots but llama-server has {self.largest}; "
            "ask for fewer choices (n)"
        )


class TenantTooLarge(TooLarge):
    """The request needs more slots than its tenant may hold at once (its max_active)."""

    def __init__(self, snapshot: Snapshot, weight: int, tenant: Tenant) -> None:
        super().__init__(snapshot, weight)
        self.tenant = tenant.name
        self.limit = tenant.max_active

    @property
    def message(self) -> str:
        return (
            f"request needs {self.weight} slots but tenant {self.tenant} may hold at most "
            f"{self.limit} at once (max_active={self.limit}); ask for fewer choices (n) or send "
            "fewer prompts in one request"
        )


_UNITS = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "tokens_per_day": "tokens per day (UTC)",
}


class QuotaExceeded(GateError):
    """The request's tenant reached one of its quotas (app/gate/quotas.py): `limit` names it,
    `retry_after_s` is when its window resets, `standing` what the rate-limit headers show."""

    retry_after_s: float

    def __init__(self, tenant: str, limit: str, retry_after_s: float, standing: Standing) -> None:
        super().__init__(f"tenant {tenant} reached its quota of {limit}")
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.standing = standing
        self.extra = {"quota": limit}

    @property
    def message(self) -> str:
        s = self.standing
        used = s.limit_requests if self.limit == "requests_per_minute" else s.limit_tokens
        return (
            f"tenant {self.tenant} has used its {used} {_UNITS[self.limit]} "
            f"({self.limit}); {retry_in(self.retry_after_s)}"
        )


class DeadlineUnmet(GateError):
    """The request would get its slot, or has not got it, within its bound on waiting
    (X-Max-Wait, or its tenant's max_wait_s; app/gate/deadlines.py). `eta_s`: the wait it
    would still have had; `waited_s`: what it waited. Retry-After: once the line should have
    shortened by what the estimate exceeds the bound."""

    retry_after_s: float

    def __init__(self, bound_s: float, eta_s: float, waited_s: float = 0.0) -> None:
        super().__init__(f"no slot within X-Max-Wait {bound_s:g} s")
        self.bound_s = bound_s
        self.eta_s = eta_s
        self.waited_s = waited_s
        self.retry_after_s = max(waited_s + eta_s - bound_s, 1.0)
        self.extra = {"eta_s": round(eta_s, 3), "max_wait_s": bound_s}

    @property
    def message(self) -> str:
        if self.waited_s:
            return (
                f"no slot became free within the request's wait bound of {self.bound_s:g} s "
                f"(X-Max-Wait); about {self.eta_s:.1f} s more was expected; "
                f"{retry_in(self.retry_after_s)} or allow a longer wait"
            )
        return (
            f"the expected wait for a slot ({self.eta_s:.1f} s) exceeds the request's wait "
            f"bound of {self.bound_s:g} s (X-Max-Wait); {retry_in(self.retry_after_s)} or "
            "allow a longer wait"
        )


class Cancelled(GateError):
    """An operator cancelled the request: it left the line, or its generation was cut. Not
    to be sent again as it is: its answer says so (`x-should-retry: false`)."""


class UpstreamError(GateError):
    """llama-server could not give its answer."""


class UpstreamUnavailable(UpstreamError):
    """llama-server cannot be reached or is not ready; a retry may succeed."""

    #: Its start-up is not estimated: a second is a short wait that a client honours.
    retry_after_s = 1.0


class UpstreamStarting(UpstreamUnavailable):
    """llama-server is not there or still loading, and did not answer the request: it may be
    sent again once llama-server is back. `sent`: it may have reached a llama-server that
    then went away (a connection closed before any answer), so it is sent again once only,
    in case it was what made llama-server fall over."""

    def __init__(self, message: str, *, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent


class ModelLoadFailed(UpstreamUnavailable):
    """A llama-server router's child for the model exited while it loaded (a broken file, too
    little memory): its waiters are told at once, as the router tells its own, rather than
    waiting out STARTUP_WAIT_S for a load that will not come. slotgate asks for it again for
    the next request."""

    def __init__(self, name: str, exit_code: int | None) -> None:
        code = "" if exit_code is None else f" (exit code {exit_code})"
        super().__init__(
            f"model '{name}' failed to load{code}; llama-server's log says why, and the next "
            "request for it tries again"
        )


class UpstreamFailed(UpstreamError):
    """llama-server broke off, stalled or answered something that is not HTTP."""


# -- the upstream client's ---------------------------------------------------------------------


class TooManyWatchers(GateError):
    """`GET /admission/events` has STATUS_WATCHERS watchers already."""

    retry_after_s = 5.0


class ExchangeFailed(SlotgateError):
    """The exchange with the upstream failed."""


class ConnectFailed(ExchangeFailed):
    """No connection could be made (refused, unreachable, or too slow)."""


class Disconnected(ExchangeFailed):
    """The upstream closed the connection before the response was complete."""


class ProtocolError(ExchangeFailed):
    """The upstream answered something that is not HTTP/1.1."""


class Stalled(ExchangeFailed, TimeoutError):
    """The upstream sent nothing for longer than the stall timeout."""


class BodyTooLarge(ExchangeFailed):
    """A body read whole is longer than the caller's limit."""


# -- signals that never become an answer -------------------------------------------------------


class ClientGone(SlotgateError):
    """The client closed its connection; nobody is left to answer."""


class AnswerStarted(SlotgateError, RuntimeError):
    """A second head for an answer whose head went out already."""


class Down(SlotgateError):
    """Redis did not answer in time, or not at all."""


class Stale(SlotgateError):
    """An answer from before a degrade or a rejoin: what it gave, the rejoin took back."""


class InvalidTenantsFile(SlotgateError, ValueError):
    """API_KEYS_FILE cannot be used; the message is one line naming the file, the tenant and
    the field."""


# -- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """How one kind of refusal is answered."""

    status: int
    #: OpenAI's error type (Anthropic's follows from it: `anthropic_type`) and code.
    type: str
    code: str
    #: The outcome label of the metrics' series and of the access log.
    reason: str
    #: A retry can pass: Retry-After headers, and the pool's snapshot when the refusal has one.
    retry: bool = False
    #: Meant to end the request for good: `x-should-retry: false`, which the OpenAI and
    #: Anthropic SDKs obey, where a 5xx alone makes them send it again.
    final: bool = False


_BAD = "invalid_request_error"
_RATE = "rate_limit_error"
_AWAY = "unavailable_error"

#: Every GateError that can be raised, and its answer: the one place a refusal's status, type,
#: code, reason and Retry-After are chosen. Keyed by the exact class: a subclass is a row.
# fmt: off
ANSWERS: dict[type[GateError], Shape] = {
    BadRequest:           Shape(400, _BAD, "invalid_request", "bad_request"),
    UpgradeRefused:       Shape(400, _BAD, "upgrade_not_supported", "bad_request"),
    Unauthorized:         Shape(401, "authentication_error", "invalid_api_key", "unauthorized"),
    Forbidden:            Shape(403, "permission_error", "forbidden", "unauthorized"),
    PayloadTooLarge:      Shape(413, _BAD, "body_too_large", "bad_request"),
    HeadersTooLarge:      Shape(431, _BAD, "headers_too_large", "bad_request"),
    UnsupportedMediaType: Shape(415, _BAD, "unsupported_media_type", "bad_request"),
    HeadTimeout:          Shape(408, _BAD, "request_timeout", "bad_request"),
    ContextExceeded:      Shape(400, "exceed_context_size_error", "exceed_context_size_error",
                                "bad_request"),
    UnknownModel:         Shape(400, _BAD, "model_not_found", "bad_request"),
    ModelNotLoaded:       Shape(400, _BAD, "model_not_loaded", "bad_request"),
    NotReady:             Shape(503, _AWAY, "upstream_not_ready", "upstream_unavailable", True),
    ShuttingDown:         Shape(503, _AWAY, "shutting_down", "upstream_unavailable", True),
    QueueFull:            Shape(429, _RATE, "queue_full", "queue_full", True),
    TenantQueueFull:      Shape(429, _RATE, "tenant_queue_full", "tenant_queue_full", True),
    QueueBytesFull:       Shape(429, _RATE, "queue_bytes_full", "queue_bytes_full", True),
    QueueTimeout:         Shape(503, _AWAY, "queue_timeout", "queue_timeout", True),
    TooLarge:             Shape(400, _BAD, "too_many_slots", "bad_request"),
    TenantTooLarge:       Shape(400, _BAD, "too_many_slots", "bad_request"),
    QuotaExceeded:        Shape(429, _RATE, "quota_exceeded", "quota_exceeded", True),
    DeadlineUnmet:        Shape(503, _AWAY, "deadline_unmet", "deadline_unmet", True),
    UpstreamUnavailable:  Shape(503, _AWAY, "upstream_unavailable", "upstream_unavailable", True),
    UpstreamStarting:     Shape(503, _AWAY, "upstream_unavailable", "upstream_unavailable", True),
    ModelLoadFailed:      Shape(503, _AWAY, "model_load_failed", "upstream_unavailable", True),
    UpstreamFailed:       Shape(502, "server_error", "upstream_failed", "upstream_failed"),
    Cancelled:            Shape(503, _AWAY, "cancelled_by_operator", "cancelled", final=True),
    TooManyWatchers:      Shape(429, _RATE, "too_many_watchers", "bad_request", True),
}
# fmt: on

#: Anything without a row: a 500 whose text is not leaked.
INTERNAL = Shape(500, "server_error", "internal_error", "internal")

#: OpenAI's error types in Anthropic's words; the others are the same in both.
_ANTHROPIC_TYPES = {"unavailable_error": "overloaded_error", "server_error": "api_error"}


def anthropic_type(openai_type: str) -> str:
    """The error type an Anthropic client reads for OpenAI's `openai_type`."""
    return _ANTHROPIC_TYPES.get(openai_type, openai_type)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Everything needed to write an error answer."""

    status: int
    type: str
    code: str
    message: str
    reason: str
    param: str | None = None
    retry_after_s: float | None = None
    snapshot: Snapshot | None = None
    extra: dict[str, Any] | None = None  # llama-server's own fields beside its error's
    final: bool = False  # `Shape.final`


def refusal(exc: BaseException) -> Refusal:
    """Classify an exception by its row of ANSWERS; anything else is INTERNAL."""
    if not isinstance(exc, GateError) or (shape := ANSWERS.get(type(exc))) is None:
        s = INTERNAL
        return Refusal(s.status, s.type, s.code, "slotgate failed internally", s.reason)
    retry_after_s = exc.retry_after_s if shape.retry else None
    snapshot = exc.snapshot if shape.retry and isinstance(exc, AdmissionError) else None
    return Refusal(
        shape.status, shape.type, shape.code, exc.message, shape.reason, exc.param,
        retry_after_s, snapshot, exc.extra, shape.final,
    )  # fmt: skip


def route_refusal(status: int, message: str) -> Refusal:
    """An answer the web framework chose for one of slotgate's own routes (405, 404)."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    return Refusal(status, _BAD, code, message, "bad_request")
