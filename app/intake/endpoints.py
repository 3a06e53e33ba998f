"""Which llama-server endpoints occupy slots, and how many slots one request to them takes."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson
from slotgate.errors import BadRequest, Flavor, UnsupportedMediaType


class Kind(Enum):
    """How llama-server turns a request body into slot-occupying tasks."""

    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"
    MESSAGES = "messages"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    AUDIO = "audio"


class Tasks(Enum):
    """Which array in a body llama-server splits into one task per element."""

    SINGLE = "single"  # one prompt, whatever the body holds
    PROMPTS = "prompts"  # tokenize_input_prompts: an array with no token id in it is a list
    DOCUMENTS = "documents"  # rerank: an array of strings, one task per document


@dataclass(frozen=True, slots=True)
class Endpoint:
    kind: Kind
    flavor: Flavor
    route: str  # the metrics/log label: the canonical path
    tasks: Tasks = Tasks.SINGLE
    #: The fields holding that array, in the order llama-server looks for them.
    inputs: tuple[str, ...] = ()
    #: llama-server reads n_cmpl (or else n) here: every prompt then runs that many tasks.
    choices: bool = False

    def __reduce__(self) -> tuple[Callable[[str], Endpoint], tuple[str]]:
        # Sent to intake's worker process and back as its route: a compiled build's frozen
        # dataclass cannot be rebuilt field by field, and every endpoint is one of ENDPOINTS.
        return _endpoint_at, (self.route,)


# Every route on which llama-server starts generation or inference work, as registered in
# ggml-org/llama.cpp tools/server/server.cpp (`ctx_http.post(...)`), and how its handler in
# tools/server/server-context.cpp turns a body into tasks:
# - handle_completions_impl: tokenize_input_prompts(prompt) tasks, each with n_cmpl - 1 child
#   tasks (server-schema.cpp: field "n_cmpl", alias "n" when n_cmpl is absent or null, refused
#   outside 1..n_parallel). The chat, Responses and transcription routes build one prompt from
#   the messages; /infill builds one from input_prefix/input_suffix; the Anthropic converter
#   (server-chat.cpp) keeps neither n nor n_cmpl, and a transcription's form fields are strings,
#   which n_cmpl refuses, so both are one task.
# - handle_embeddings_impl: tokenize_input_prompts of "input" (when present) or "content".
# - post_rerank: one task per string of "documents" or, failing that, "texts".
# Not here, as they start no slot's work: /tokenize, /detokenize, /apply-template, the
# */input_tokens and /v1/messages/count_tokens routes, /v1/chat/completions/control (a control
# message to a running task), /props, /slots/:id, /lora-adapters, /models*, /tools,
# /cors-proxy. Vertex AI's predict route (AIP_MODE=PREDICTION) has an operator-chosen path.
_Row = tuple[Kind, Flavor, Tasks, tuple[str, ...], bool]
_COMPLETION: _Row = (Kind.COMPLETION, "openai", Tasks.PROMPTS, ("prompt",), True)
_CHAT: _Row = (Kind.CHAT, "openai", Tasks.SINGLE, (), True)
_RESPONSES: _Row = (Kind.RESPONSES, "openai", Tasks.SINGLE, (), True)
_EMBEDDING: _Row = (Kind.EMBEDDING, "openai", Tasks.PROMPTS, ("input", "content"), False)
_RERANK: _Row = (Kind.RERANK, "openai", Tasks.DOCUMENTS, ("documents", "texts"), False)
_AUDIO: _Row = (Kind.AUDIO, "openai", Tasks.SINGLE, (), False)
_ADMITTED: dict[str, _Row] = {
    "/v1/chat/completions": _CHAT,
    "/chat/completions": _CHAT,
    "/completion": _COMPLETION,
    "/completions": _COMPLETION,
    "/v1/completions": _COMPLETION,
    "/infill": (Kind.COMPLETION, "openai", Tasks.SINGLE, (), True),
    "/v1/responses": _RESPONSES,
    "/responses": _RESPONSES,
    "/v1/messages": (Kind.MESSAGES, "anthropic", Tasks.SINGLE, (), False),
    "/embedding": _EMBEDDING,
    "/embeddings": _EMBEDDING,
    "/v1/embeddings": _EMBEDDING,
    "/rerank": _RERANK,
    "/reranking": _RERANK,
    "/v1/rerank": _RERANK,
    "/v1/reranking": _RERANK,
    "/v1/audio/transcriptions": _AUDIO,
    "/audio/transcriptions": _AUDIO,
}
ENDPOINTS = {
    path: Endpoint(kind, flavor, path, tasks, inputs, choices)
    for path, (kind, flavor, tasks, inputs, choices) in _ADMITTED.items()
}


def _endpoint_at(route: str) -> Endpoint:
    return ENDPOINTS[route]


# curl -d sends form-urlencoded by default and llama-server ignores the content type, so those
# are taken as JSON; a body that declares itself something else is refused.
_JSON_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain")

#: The deepest JSON nesting accepted: orjson writes no deeper (it reads up to 1024 levels).
MAX_JSON_DEPTH = 254

# Where llama-server takes a request's output limit from, route by route (tools/server):
# server-schema.cpp's field n_predict reads the first present, non-null one of n_predict,
# max_completion_tokens, max_tokens (its aliases, in that order) and refuses a value below -1.
# The Responses converter (server-chat.cpp) first turns max_output_tokens into max_tokens,
# replacing any max_tokens (with null too); the Anthropic converter keeps max_tokens alone, and
# puts MESSAGES_OUTPUT in when it is missing.
_OUTPUT_FIELDS = ("n_predict", "max_completion_tokens", "max_tokens")
#: The output limit llama-server gives a /v1/messages request without max_tokens.
MESSAGES_OUTPUT = 4096


#: Read once: on Python 3.11 an enum member looked up on its class costs about 0.1 us, and
#: every request's intake reads several.
_KIND_AUDIO, _KIND_MESSAGES, _KIND_RESPONSES = Kind.AUDIO, Kind.MESSAGES, Kind.RESPONSES
# A tuple, not a set: `in` finds a member by identity, where a set would call Enum's __hash__.
_KINDS_LIMITED = (Kind.CHAT, Kind.COMPLETION, Kind.RESPONSES)
_TASKS_PROMPTS, _TASKS_DOCUMENTS = Tasks.PROMPTS, Tasks.DOCUMENTS


def route_of(method: str, path: str) -> Endpoint | None:
    """The endpoint behind a request, when it occupies llama-server slots."""
    if method != "POST":
        return None
    return ENDPOINTS.get(path)


@dataclass(slots=True, init=False)
class Demand:
    """What one request asks of the pool. Not changed once made; not frozen, and its
    `__init__` written out, as `Intake`'s (app/intake/body.py) is: one is made for every
    request."""

    weight: int
    stream: bool
    #: What the weight comes from: completions per prompt (`n_cmpl` or `n`, named by `field`)
    #: and tasks per completion, so that `at` weighs it for another slot count without the body.
    choices: int = 1
    tasks: int = 1
    field: str = "n"

    def __init__(
        self, weight: int, stream: bool, choices: int = 1, tasks: int = 1, field: str = "n"
    ) -> None:
        self.weight = weight
        self.stream = stream
        self.choices = choices
        self.tasks = tasks
        self.field = field

    def __reduce__(self) -> tuple[type[Demand], tuple[int, bool, int, int, str]]:
        # As `Intake.__reduce__`: a worker process sends one back.
        return Demand, (self.weight, self.stream, self.choices, self.tasks, self.field)

    def at(self, capacity: int) -> Demand:
        """The demand on a pool of `capacity` slots; BadRequest when it asks for more choices."""
        return _weighed(self.stream, self.choices, self.tasks, self.field, capacity)


def _weighed(stream: bool, choices: int, tasks: int, field: str, capacity: int) -> Demand:
    """The demand on a pool of `capacity` slots, built once (not a weightless one, then this)."""
    if choices > capacity:
        # llama-server refuses it too (n_cmpl is bounded by its slot count), but only once
        # the request has reached it.
        raise BadRequest(
            f"{field}={choices} asks for more choices than llama-server has slots "
            f"({capacity}); ask for at most {capacity}",
            param=field,
        )
    # llama-server runs one task per prompt, input or document in an array; the request
    # holds every slot it fills, and llama-server works through the rest of the array
    # inside those same slots, so the count is capped at the pool's size, not refused.
    return Demand(min(choices * tasks, capacity), stream, choices, tasks, field)


def check_content_type(endpoint: Endpoint, content_type: str) -> None:
    if endpoint.kind is _KIND_AUDIO or not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media in _JSON_TYPES or media.endswith("+json"):
        return
    raise UnsupportedMediaType(
        f"content type {media!r} is not accepted here; send JSON with "
        "Content-Type: application/json"
    )


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
#: The most bytes a form part's head, and a text field's value, are read for; the most parts
#: looked at (a transcription's form has a few fields: a crafted one of a million tiny parts
#: would hold the loop for a second).
_FORM_HEAD_BYTES = 1024
_FORM_VALUE_BYTES = 4096
_FORM_PARTS = 64


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """A text field of a multipart/form-data body (a transcription's `model`, which a
    llama-server router routes it by, as it reads the form's fields as a JSON object's); None
    if it has none. Each part's boundary is found once, its head read within a bound: one
    pass over the body, never split into copies of its parts."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        return None
    delimiter = b"--" + found.group(1).encode("latin-1")
    wanted = b'name="' + name.encode() + b'"'
    at = body.find(delimiter)
    for _ in range(_FORM_PARTS):
        if at < 0:
            break
        start = at + len(delimiter)
        following = body.find(b"\r\n" + delimiter, start)
        head_end = body.find(b"\r\n\r\n", start, start + _FORM_HEAD_BYTES)
        if head_end >= 0 and wanted in body[start:head_end]:
            end = len(body) if following < 0 else following
            if end - head_end - 4 > _FORM_VALUE_BYTES:
                return None
            return body[head_end + 4 : end].decode("utf-8", "replace")
        at = -1 if following < 0 else following + 2
    return None


def demand(endpoint: Endpoint, body: bytes, capacity: int) -> Demand:
    """Parse and check the body; how many slots it takes and whether it streams."""
    if endpoint.kind is _KIND_AUDIO:
        return Demand(1, False)
    return demand_of(endpoint, parse_json(body), capacity)


def demand_of(endpoint: Endpoint, payload: dict[str, Any], capacity: int) -> Demand:
    """`demand` of a body already parsed (by `parse_json`)."""
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    read = _output_field(endpoint.kind, payload)
    if read is not None:
        _check_int(payload, read, minimum=-1)
    field, choices = _choices(payload) if endpoint.choices else ("n", 1)
    return _weighed(stream, choices, _task_count(payload, endpoint), field, capacity)


def output_limit(kind: Kind, payload: dict[str, Any]) -> int | None:
    """The tokens a request lets itself generate, read as llama-server reads them; None when
    it leaves that to the server's own -n (no field, null, or -1), which is no limit unless
    the server was started with -n. One reading for the KV charge and the pace."""
    if kind is _KIND_MESSAGES and "max_tokens" not in payload:
        return MESSAGES_OUTPUT
    name = _output_field(kind, payload)
    value = payload.get(name) if name is not None else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _output_field(kind: Kind, payload: dict[str, Any]) -> str | None:
    """The field llama-server reads the output limit from, when it reads one."""
    if kind is _KIND_MESSAGES:
        return "max_tokens" if payload.get("max_tokens") is not None else None
    if kind not in _KINDS_LIMITED:
        return None
    names = _OUTPUT_FIELDS
    if kind is _KIND_RESPONSES and "max_output_tokens" in payload:
        names = (*_OUTPUT_FIELDS[:-1], "max_output_tokens")
    # A loop, not next() over a generator: this runs for every request.
    for name in names:
        if payload.get(name) is not None:
            return name
    return None


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, refused (400) unless every later step can handle it."""
    if not body:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson also refuses invalid UTF-8 and nesting deeper than 1024 levels here.
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
    # orjson writes at most MAX_JSON_DEPTH levels, and a body slotgate rewrites (proxy/assembly.py)
    # is written again: the limit is checked here, once, by writing it. Nesting that deep takes
    # as many opening brackets, which C counts far faster than the writer runs, and as many
    # closing ones (the body parsed): a shorter body is not counted at all.
    if len(body) > 2 * MAX_JSON_DEPTH and body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        try:
            orjson.dumps(payload)
        except orjson.JSONEncodeError:
            raise BadRequest(
                f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
            ) from None
    return payload


def _check_int(payload: dict[str, Any], name: str, *, minimum: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if value < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum}, got {value}", param=name)
    return value


def _choices(payload: dict[str, Any]) -> tuple[str, int]:
    """How many completions each prompt runs, and the field that says so: n_cmpl, else n
    (null counts as absent)."""
    name = "n_cmpl" if payload.get("n_cmpl") is not None else "n"
    return name, _check_int(payload, name, minimum=1) or 1


def _task_count(payload: dict[str, Any], endpoint: Endpoint) -> int:
    if endpoint.tasks is _TASKS_PROMPTS:
        # The first field present is the one read, even when it holds something unusable.
        items = next((payload[name] for name in endpoint.inputs if name in payload), None)
        if not isinstance(items, list):
            return 1
        # An array holding any token id is one prompt (token ids, or text mixed with them).
        if any(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return 1
        return len(items) or 1
    if endpoint.tasks is _TASKS_DOCUMENTS:
        # llama-server takes the first field that reads as an array of strings.
        for name in endpoint.inputs:
            items = payload.get(name)
            if isinstance(items, list) and all(isinstance(item, str) for item in items):
                return len(items) or 1
    return 1
