"""A request body turned into what the gate needs (its demand, the body to forward), with big
bodies parsed in a worker process so the event loop does not stall (docs/design.md, "Intake").
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar

from slotgate.errors import BadRequest
from slotgate.gate.routing import AFFINITY_PREFIX_CHARS, stable_hash
from slotgate.gate.sessions import MAX_ID_BYTES
from slotgate.intake.cost import Estimate, local
from slotgate.intake.endpoints import (
    ENDPOINTS,
    Demand,
    Endpoint,
    Kind,
    demand,
    demand_of,
    parse_json,
)
from slotgate.intake.pace import expected_hold_of
from slotgate.intake.rewrite import streaming_request

#: Bodies above this go to the worker: at most ~15 ms of parsing stays on the loop.
OFF_LOOP_BYTES = 1024 * 1024
#: Worker processes, started on the first big body and kept for the life of the process. One:
#: big bodies wait their turn there rather than on the loop, and memory grows by one
#: interpreter (~25 MiB) plus what one big parse leaves to its allocator.
WORKERS = 1
#: Endpoints whose non-streamed requests go upstream as streams (see app/proxy/assembly.py).
#: A tuple, not a set: `in` finds a member by identity, where a set would call Enum's __hash__.
ASSEMBLED = (Kind.CHAT, Kind.COMPLETION)
#: Read once: on Python 3.11 an enum member looked up on its class costs about 0.1 us.
_AUDIO = Kind.AUDIO
#: Routes whose non-streamed answer carries llama-server's `__verbose` object when it runs with
#: --verbose, or when the body sets `verbose` (server-task.cpp: OpenAI chat and text completions
#: only). A stream carries another one (the final result of a stream, without its text), so
#: such an answer cannot be assembled.
VERBOSE_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})

log = logging.getLogger("slotgate.intake")

_T = TypeVar("_T")

#: How much of a chat's start makes its conversation key: the system prompt and the first
#: user message, or this much of them.
CONVERSATION_CHARS = 4096


@dataclass(slots=True, init=False)
class Intake:
    """What `take` read from a body. Not changed once made, but not frozen: a frozen
    dataclass sets each field through `object.__setattr__`, four times the cost of a plain
    one's `__init__`, and one is made for every request. Its `__init__` is written out: the
    one `dataclass` makes is interpreted code even in the compiled build (3 k instructions
    a request)."""

    demand: Demand
    body: bytes  # what goes upstream
    assembled: bool  # the body asks llama-server for a stream; the answer is assembled
    #: Sent as it is while llama-server's verbosity is unknown: its answer shows it.
    teaches: bool = False
    return_tokens: bool = False  # an assembled native answer carries its tokens (asked for)
    estimate: Estimate | None = None  # its reservation of the KV budget, when one binds
    expected_hold_s: float | None = None  # how long it should hold its slots (a cold gate)
    affinity: int | None = None  # its routing key among several upstreams (app/gate/routing.py)
    conversation: int | None = None  # the key of its conversation, within the affinity key's
    session: bytes | None = None  # its `prompt_cache_key`, read for SESSION_FLOWS

    def __init__(
        self, demand: Demand, body: bytes, assembled: bool, teaches: bool = False,
        return_tokens: bool = False, estimate: Estimate | None = None,
        expected_hold_s: float | None = None, affinity: int | None = None,
        conversation: int | None = None, session: bytes | None = None,
    ) -> None:  # fmt: skip
        self.demand = demand
        self.body = body
        self.assembled = assembled
        self.teaches = teaches
        self.return_tokens = return_tokens
        self.estimate = estimate
        self.expected_hold_s = expected_hold_s
        self.affinity = affinity
        self.conversation = conversation
        self.session = session

    def __reduce__(self) -> tuple[type[Intake], tuple[object, ...]]:
        # Made again through `__init__` where a worker's is unpickled: a compiled build's
        # class would call it without arguments.
        return Intake, (
            self.demand, self.body, self.assembled, self.teaches, self.return_tokens,
            self.estimate, self.expected_hold_s, self.affinity, self.conversation, self.session,
        )  # fmt: skip


class Wants(NamedTuple):
    """What the gate wants read from a body besides its demand, in the same parse. A named
    tuple, as `Reading` that carries it: both travel to the worker process that reads a big
    body, and a compiled build's frozen dataclass does not unpickle there."""

    budget: int | None = None  # cost the request against this KV budget (app/intake/cost.py)
    default_output: int | None = None  # llama-server's -n, for a request that bounds none
    expect: bool = False  # a cold gate: how long should it hold its slots (app/intake/pace.py)
    tokens_per_s: float | None = None
    affinity: bool = False  # its routing key (several upstreams, ROUTING=affinity)
    session: bool = False  # its `prompt_cache_key` as a session id (SESSION_FLOWS)


class Reading(NamedTuple):
    """How a body is read: against the largest upstream's `capacity` (slots); with `assemble`,
    asking for a stream if the client did not (app/proxy/assembly.py), unless its answer may
    carry `__verbose`: when the body asks for it, or it leaves that to llama-server and not
    every upstream is known to be `quiet` (adds none unasked); and what `wants` asks for."""

    capacity: int
    assemble: bool
    quiet: bool = True
    wants: Wants = Wants()


def take(endpoint: Endpoint, body: bytes, reading: Reading) -> Intake:
    """Check the body and work out its demand, as `reading` says."""
    capacity, assemble, quiet, wants = reading
    if endpoint.kind is _AUDIO:
        return Intake(demand(endpoint, body, capacity), body, False)
    payload = parse_json(body)
    want = demand_of(endpoint, payload, capacity)
    estimate = None
    if wants.budget:
        estimate = local(endpoint, payload, wants.budget, wants.default_output)
    expected = None
    if wants.expect:
        expected = expected_hold_of(
            endpoint.kind, payload, wants.tokens_per_s, wants.default_output
        )
    key = affinity_of(payload) if wants.affinity else None
    talk = conversation_of(payload) if key is not None else None
    session = session_of(payload) if wants.session else None
    teaches = False
    if assemble and not want.stream and endpoint.kind in ASSEMBLED:
        # llama-server reads `verbose` as a boolean, null as absent (server-schema.cpp); its
        # default is its own --verbose. Anything else it refuses, as sent.
        verbose = payload.get("verbose") if endpoint.route in VERBOSE_ROUTES else False
        if verbose is False or (verbose is None and quiet):
            streaming, _ = streaming_request(body)
            return Intake(
                want, streaming, True, False, payload.get("return_tokens") is True, estimate,
                expected, key, talk, session,
            )  # fmt: skip
        teaches = verbose is None
    return Intake(want, body, False, teaches, False, estimate, expected, key, talk, session)


def affinity_of(payload: dict[str, object]) -> int | None:
    """The key that keeps a request on the upstream holding its prompt's start in cache: its
    `prompt_cache_key` (the OpenAI parameter for this), else a hash of the prompt's first
    AFFINITY_PREFIX_CHARS (a chat's first messages, a raw prompt's start, a Responses
    request's instructions and input); None when there is no text to go by."""
    key = payload.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return stable_hash("key:" + key)
    parts: list[str] = []
    size = 0
    # Each item looked at yields one text, maybe empty: at most this many are read, so that
    # a list of empty messages costs no more than a prompt's start.
    for text in itertools.islice(_prompt_texts(payload), AFFINITY_PREFIX_CHARS):
        parts.append(text[:AFFINITY_PREFIX_CHARS])
        size += len(text)
        if size >= AFFINITY_PREFIX_CHARS:
            break
    if not size:
        return None
    return stable_hash("\x00".join(parts)[:AFFINITY_PREFIX_CHARS])


def session_of(payload: dict[str, object]) -> bytes | None:
    """Its `prompt_cache_key` as a session id (app/gate/sessions.py), bounded as a header's is;
    None without one."""
    key = payload.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key.encode()[:MAX_ID_BYTES]
    return None


def conversation_of(payload: dict[str, object]) -> int | None:
    """The key of a chat's conversation: its prompt's start up to the end of its first user
    message (at most CONVERSATION_CHARS), the same at every turn. Several conversations share
    one affinity key when their system prompt fills it: each turn then goes back to where its
    own conversation ran last (its whole history is cached there), while a new conversation
    goes where the system prompt is. None for anything but a chat without prompt_cache_key."""
    messages = payload.get("messages")
    if "prompt_cache_key" in payload or not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    texts = _prompt_texts({"system": payload.get("system"), "messages": messages})
    for text in itertools.islice(texts, CONVERSATION_CHARS):
        parts.append(text[: CONVERSATION_CHARS - size])
        size += len(parts[-1])
        if size >= CONVERSATION_CHARS:
            break
        if len(parts) >= 2 and parts[-2] == "user":
            break  # the first user message's content: the conversation is told apart
    if not size:
        return None
    return stable_hash("conversation\x00" + "\x00".join(parts))


def _prompt_texts(payload: dict[str, object]) -> Iterator[str]:
    """The prompt's texts in order, as far as they are plain to read."""
    for field in ("system", "instructions"):
        value = payload.get(field)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from _texts(value)
    for field in ("messages", "input", "prompt", "content"):
        value = payload.get(field)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    yield from _message_texts(item)
                elif isinstance(item, str):
                    yield item
                elif isinstance(item, list):  # token ids (and pieces of text, mixed in)
                    yield ",".join(_token(t) for t in item[:AFFINITY_PREFIX_CHARS])
                else:
                    return
        elif isinstance(value, dict):  # /completion's multimodal prompt
            text = value.get("prompt_string")
            if isinstance(text, str):
                yield text


def _message_texts(message: dict[str, object]) -> Iterator[str]:
    """A message's role, then its content's texts."""
    role = message.get("role")
    yield role if isinstance(role, str) else ""
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        yield from _texts(content)


def _token(token: object) -> str:
    if isinstance(token, str):
        return token[:AFFINITY_PREFIX_CHARS]
    return str(token) if isinstance(token, int) else ""


def _texts(parts: list[object]) -> Iterator[str]:
    for part in parts:
        if isinstance(part, str):
            yield part
        elif isinstance(part, dict):
            text = part.get("text")
            yield text if isinstance(text, str) else ""
        else:
            yield ""


async def take_off_loop(endpoint: Endpoint, body: bytes, reading: Reading) -> Intake:
    """`take`, in a worker process when the body is big."""
    if len(body) <= OFF_LOOP_BYTES or endpoint.kind is _AUDIO or _broken:
        return take(endpoint, body, reading)
    result = await _in_worker(_take_in_worker, endpoint.route, body, reading)
    if result is None:
        return take(endpoint, body, reading)
    if isinstance(result, Intake):
        return result
    message, param = result
    raise BadRequest(message, param=param)


async def model_off_loop(body: bytes) -> str | None:
    """The body's `model`, if a string (what a llama-server router routes by), parsed in a
    worker process when the body is big: read before `take`, as the model picks the line
    whose figures `take` reads. A big body is parsed twice, but never on the loop."""
    if len(body) <= OFF_LOOP_BYTES or _broken:
        return _model_of(body)
    result = await _in_worker(_model_in_worker, body)
    if result is None:
        return _model_of(body)
    model, refusal = result
    if refusal is not None:
        message, param = refusal
        raise BadRequest(message, param=param)
    return model


def _model_of(body: bytes) -> str | None:
    model = parse_json(body).get("model")
    return model if isinstance(model, str) else None


def _model_in_worker(body: bytes) -> tuple[str | None, tuple[str, str | None] | None]:
    try:
        return _model_of(body), None
    except BadRequest as exc:
        return None, (exc.message, exc.param)


async def _in_worker(call: Callable[..., _T], *args: object) -> _T | None:
    """`call(*args)` in the worker process; None when no worker can run it (then the caller
    runs it on the loop, as every big body is from then on)."""
    global _broken
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(_pool(), call, *args)
    except (BrokenProcessPool, OSError, RuntimeError) as exc:
        # No worker could start (no /dev/shm, an entry point without its __main__ guard) or
        # one died: correctness first, so big bodies are read on the loop from now on.
        log.warning("cannot parse big bodies in a worker process, so on the loop: %r", exc)
        _broken = True
        _reset()
        return None


def _take_in_worker(route: str, body: bytes, reading: Reading) -> Intake | tuple[str, str | None]:
    # A refusal travels back as plain data: a pickled exception keeps only its first argument.
    try:
        taken = take(ENDPOINTS[route], body, reading)
    except BadRequest as exc:
        return exc.message, exc.param
    if taken.estimate is not None:
        # The parsed body stays here: sent back, unpickling it would stall the loop as long
        # as parsing it. Without it, the local bound stands (no count by llama-server).
        taken = replace(taken, estimate=replace(taken.estimate, payload={}, exact=False))
    return taken


_executor: ProcessPoolExecutor | None = None
_broken = False


def _pool() -> ProcessPoolExecutor:
    global _executor  # one pool per process, started on first need
    if _executor is None:
        # spawn, not fork: forking a process that runs an event loop and threads is unsafe.
        _executor = ProcessPoolExecutor(
            WORKERS, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet
        )
        # Let go of it at exit while the modules it needs are still there: kept until the
        # interpreter's last teardown (as a compiled build keeps it), its own cleanup meets
        # multiprocessing already gone and says so on stderr.
        atexit.register(_reset)
    return _executor


def _reset() -> None:
    global _executor
    if _executor is not None:
        _executor.shutdown(wait=False, cancel_futures=True)
        _executor = None


def _quiet() -> None:
    # Ctrl-C reaches the whole process group; slotgate itself decides when workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
