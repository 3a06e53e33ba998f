"""Which llama-server endpoints occupy slots, and how many slots one request to them takes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from .errors import BadRequest, Flavor, UnsupportedMediaType


class Kind(Enum):
    """How llama-server turns a request body into slot-occupying tasks."""

    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"
    MESSAGES = "messages"
    EMBEDDING = "embedding"
    RERANK = "rerank"
    AUDIO = "audio"


@dataclass(frozen=True, slots=True)
class Endpoint:
    kind: Kind
    flavor: Flavor
    route: str  # the metrics/log label: the canonical path


_ADMITTED: dict[str, tuple[Kind, Flavor]] = {
    "/v1/chat/completions": (Kind.CHAT, "openai"),
    "/chat/completions": (Kind.CHAT, "openai"),
    "/completion": (Kind.COMPLETION, "openai"),
    "/completions": (Kind.COMPLETION, "openai"),
    "/v1/completions": (Kind.COMPLETION, "openai"),
    "/infill": (Kind.COMPLETION, "openai"),
    "/v1/responses": (Kind.RESPONSES, "openai"),
    "/responses": (Kind.RESPONSES, "openai"),
    "/v1/messages": (Kind.MESSAGES, "anthropic"),
    "/embedding": (Kind.EMBEDDING, "openai"),
    "/embeddings": (Kind.EMBEDDING, "openai"),
    "/v1/embeddings": (Kind.EMBEDDING, "openai"),
    "/rerank": (Kind.RERANK, "openai"),
    "/reranking": (Kind.RERANK, "openai"),
    "/v1/rerank": (Kind.RERANK, "openai"),
    "/v1/reranking": (Kind.RERANK, "openai"),
    "/v1/audio/transcriptions": (Kind.AUDIO, "openai"),
}
ENDPOINTS = {path: Endpoint(kind, flavor, path) for path, (kind, flavor) in _ADMITTED.items()}

# curl -d sends form-urlencoded by default and llama-server ignores the content type, so those
# are taken as JSON; a body that declares itself something else is refused.
_JSON_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain")

# Fields that count tokens to generate; llama-server's native n_predict takes -1 for "no limit".
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def admitted(method: str, path: str) -> Endpoint | None:
    """The endpoint behind a request, when it occupies llama-server slots."""
    if method != "POST":
        return None
    return ENDPOINTS.get(path)


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request asks of the pool."""

    weight: int
    stream: bool


def check_content_type(endpoint: Endpoint, content_type: str) -> None:
    if endpoint.kind is Kind.AUDIO or not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media in _JSON_TYPES or media.endswith("+json"):
        return
    raise UnsupportedMediaType(
        f"content type {media!r} is not accepted here; send JSON with "
        "Content-Type: application/json"
    )


def demand(endpoint: Endpoint, body: bytes, capacity: int) -> Demand:
    """Parse and check the body; how many slots it takes and whether it streams."""
    if endpoint.kind is Kind.AUDIO:
        return Demand(1, False)
    payload = parse_json(body)
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    for name in _TOKEN_LIMITS:
        _check_int(payload, name, minimum=0)
    _check_int(payload, "n_predict", minimum=-1)
    n = _check_int(payload, "n", minimum=1) or 1
    if n > capacity:
        raise BadRequest(
            f"n={n} asks for more choices than llama-server has slots ({capacity}); "
            f"ask for at most {capacity}",
            param="n",
        )
    # llama-server runs one task per prompt, input or document in an array; the request
    # holds every slot it fills, and llama-server works through the rest of the array inside
    # those same slots, so the count is capped at the pool's size rather than refused.
    tasks = _array_length(payload, endpoint.kind)
    return Demand(min(n * tasks, capacity), stream)


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson also refuses invalid UTF-8 and nesting deeper than 1024 levels here.
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
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


def _array_length(payload: dict[str, Any], kind: Kind) -> int:
    if kind is Kind.COMPLETION:
        items = payload.get("prompt")
    elif kind is Kind.EMBEDDING:
        items = payload.get("input", payload.get("content"))
    elif kind is Kind.RERANK:
        items = payload.get("documents")
    else:
        return 1
    if not isinstance(items, list) or not items:
        return 1
    # A flat list of token ids is one tokenized prompt, not many.
    if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        return 1
    return len(items)
