"""The three ways llama-server's answer goes back to the client, picked once per request by
`Proxy` (app/proxy/relay.py): relayed as it is, relayed into the event stream whose head
slotgate sent while the request waited, or assembled into the one JSON body a client asked for
from the stream slotgate asked llama-server for (app/proxy/assembly.py).

Bytes are relayed as they come; SSE is never parsed here. Each mode hands the slot on as soon
as llama-server has sent its last byte (`upstream_done`), before the client has all of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic

import orjson
from slotgate.asgi import Headers
from slotgate.errors import BodyTooLarge, ExchangeFailed, Refusal, UpstreamFailed, refusal
from slotgate.outcome import Outcome
from slotgate.proxy import headers
from slotgate.proxy.answer import Answer
from slotgate.proxy.assembly import MAX_ASSEMBLED_BYTES, Assembly
from slotgate.proxy.refusals import stream_event
from slotgate.proxy.request import Request
from slotgate.upstreams.client import Response

log = logging.getLogger("slotgate.relay")

#: Non-streamed answers up to this size are read whole before the head goes out.
WHOLE_BODY_BYTES = 1024 * 1024
#: The most of an upstream error read to relay it as one event into a waiting stream.
#: llama-server's errors are a few hundred bytes; one longer is no error a client can use.
ERROR_BODY_BYTES = 64 * 1024

#: What an answer slotgate makes itself carries besides its error (`Proxy._own_headers`).
Own = Callable[[Request], Headers]


async def refuse(request: Request, answer: Answer, r: Refusal, own: Own) -> None:
    """slotgate's own error for the request, as its outcome too."""
    request.outcome = Outcome(r.reason)
    await answer.refuse(r, request.flavor, own(request))


async def relay(request: Request, answer: Answer, response: Response, own: Own) -> None:
    """Relay llama-server's answer as it is: a small body whole, anything else as it comes."""
    length = response.content_length
    whole = length is not None and length <= WHOLE_BODY_BYTES
    try:
        # A small body of known length (every non-streamed completion) is read whole, so a
        # truncated one still gets a proper 502; otherwise wait for the first bytes.
        first = await response.read() if whole else await response.readany()
        request.first_byte_at = monotonic()
        if whole:
            if upstream_done(request, response):
                await asyncio.sleep(0)  # the waiter handed the slot goes first
            if request.teaches and response.status == 200:
                _learn_verbose(request, first)
        if response.status == 500:
            _failed(request, first)
    except ExchangeFailed as exc:
        await refuse(request, answer, refusal(_upstream_failure(exc)), own)
        return
    stream = response.content_type == headers.SSE
    head = headers.relayed(response.headers, request.id, request.origin, stream=stream)
    if whole:
        await answer.whole(response.status, head, first, stream=stream)
        return
    await answer.start(response.status, head, stream=stream)
    chunk = first
    try:
        while chunk:
            await answer.relay(chunk)
            chunk = await response.readany()
        if upstream_done(request, response):
            await asyncio.sleep(0)  # the waiter handed the slot goes first
    except ExchangeFailed as exc:
        r = refusal(_upstream_failure(exc))
        request.outcome = Outcome(r.reason)
        if not answer.stream:
            # A plain body cut short cannot carry an error: leaving the answer unfinished
            # makes the server drop the connection, so the client sees the truncation.
            log.warning("upstream broke off a response after its head: %s", r.message)
            return
        await answer.event(stream_event(r, request.flavor))
    await answer.end()


async def relay_assembled(
    request: Request, answer: Answer, response: Response, assembly: Assembly, own: Own
) -> None:
    """Answer a non-streamed request from the stream slotgate asked llama-server for."""
    try:
        chunk = await response.readany()
        request.first_byte_at = monotonic()
        while chunk:
            assembly.feed(chunk)
            if assembly.size > MAX_ASSEMBLED_BYTES:
                # Raised, not answered here: the connection is closed, not pooled, and
                # llama-server stops generating.
                raise UpstreamFailed(
                    f"llama-server's answer exceeds {MAX_ASSEMBLED_BYTES} bytes, the most "
                    "slotgate assembles for a non-streamed request; ask for a stream "
                    "(stream: true) or fewer tokens"
                )
            chunk = await response.readany()
        if upstream_done(request, response):
            await asyncio.sleep(0)  # the waiter handed the slot goes first
        status, body = assembly.result()
        if status == 500:
            _failed(request, body)
    except ExchangeFailed as exc:
        await refuse(request, answer, refusal(_upstream_failure(exc)), own)
        return
    except ValueError:
        failure = UpstreamFailed("llama-server sent a stream event that is not JSON")
        await refuse(request, answer, refusal(failure), own)
        return
    upstream = request.upstream
    assert upstream is not None  # noqa: S101 - set by Proxy._forward
    if assembly.verbose and upstream.verbose is not True:
        # Restarted with --verbose unseen: its __verbose object cannot be rebuilt from a
        # stream, so from now on such requests go as sent (this one's is missing).
        log.info("llama-server runs with --verbose: non-streamed requests now go as sent")
        upstream.verbose = True
    if status != 200:
        request.outcome = Outcome.UPSTREAM_ERROR
    head = headers.assembled(response.headers, request.id, request.origin, len(body))
    await answer.whole(status, head, body)


async def relay_into_stream(request: Request, answer: Answer, response: Response) -> None:
    """Relay into an SSE stream whose 200 head went out while the request waited."""
    try:
        if response.status != 200 or response.content_type != headers.SSE:
            # llama-server refused (e.g. the prompt exceeds the context): its JSON error
            # becomes the stream's error event, as llama-server itself does mid-stream.
            error = await response.read(ERROR_BODY_BYTES)
            _failed(request, error)
            if upstream_done(request, response):
                await asyncio.sleep(0)  # the waiter handed the slot goes first
            request.outcome = Outcome.UPSTREAM_ERROR
            prefix = b"event: error\n" if request.flavor == "anthropic" else b""
            await answer.event(prefix + b"data: " + error.strip() + b"\n\n")
        else:
            chunk = await response.readany()
            request.first_byte_at = monotonic()
            while chunk:
                await answer.relay(chunk)
                chunk = await response.readany()
            if upstream_done(request, response):
                await asyncio.sleep(0)  # the waiter handed the slot goes first
    except ExchangeFailed as exc:
        r = refusal(_upstream_failure(exc))
        request.outcome = Outcome(r.reason)
        await answer.event(stream_event(r, request.flavor))
    await answer.end()


def upstream_done(request: Request, response: Response) -> bool:
    """llama-server has sent its last byte: its slot is free, so ours is handed on now, before
    the rest is relayed, and the next request does not wait for the client. True when a waiter
    was handed it: the caller then lets that waiter send its request (or, sharing the line
    through Redis, the release leave for Redis) before this answer is relayed, so that
    llama-server's slot does not sit idle while slotgate writes to a client. (A plain function:
    a coroutine per request for a yield nearly none makes would cost more than the yield.)

    The connection calls it first, as the last byte is parsed (`Proxy._forward` asks it to:
    `Response.when_done`), so that the waiter is woken before the relay and before whatever
    else is ready then; the relay's own call at the end of its reading then finds both given
    back, and is False."""
    response.release()
    return request.ticket is not None and request.ticket.release()


def _failed(request: Request, body: bytes) -> None:
    """A generation failed with 500: let its upstream see whether its cache ran out."""
    if request.upstream is not None:
        request.upstream.check_failure(body)


def _learn_verbose(request: Request, body: bytes) -> None:
    """A non-streamed answer to a body that left `verbose` to llama-server shows whether it adds
    `__verbose` unasked (--verbose): nothing else does (not /props, not /slots).

    Learning it from the first such answer, per upstream and again after each restart, costs
    those few requests their assembly (their cancellation is less prompt) and no round trip of
    its own; a probe would take a slot outside the gate. Parsed, not searched: a completion's
    text may hold the word. Only while unknown."""
    upstream = request.upstream
    if upstream is None or upstream.verbose is not None:
        return
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    if not isinstance(answer, dict):
        return
    upstream.verbose = "__verbose" in answer
    if upstream.verbose:
        log.info("llama-server runs with --verbose: non-streamed requests go as sent")


def _upstream_failure(exc: BaseException) -> UpstreamFailed:
    if isinstance(exc, TimeoutError):
        return UpstreamFailed("llama-server went silent for longer than UPSTREAM_STALL_TIMEOUT_S")
    if isinstance(exc, BodyTooLarge):
        return UpstreamFailed(f"llama-server's error could not be relayed: {exc}")
    return UpstreamFailed(f"llama-server broke off the response ({type(exc).__name__})")
