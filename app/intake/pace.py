"""How long a generation is expected to hold its slot before slotgate has seen one finish.

Until then the gate has no hold time of its own to base Retry-After on, so it starts from what
can be known: the tokens a request may generate (its max_tokens) over llama-server's measured
generation speed, or a conservative speed when llama-server has not measured one yet, after a
second for the prompt.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from slotgate.intake.endpoints import Kind, output_limit

#: Tokens per second of one generation, assumed while llama-server has measured none: a 7-8B
#: model on a CPU. A faster engine only makes the first Retry-After late, never early, and a
#: client sent back too early spends a retry (the SDKs have two) for nothing.
COLD_TOKENS_PER_S = 10.0
#: Tokens assumed for a request that sets no limit (llama-server then generates until the end
#: of the answer or of the context): a long chat answer.
COLD_TOKENS = 256
#: Seconds assumed for what comes before the first token: the prompt's processing, which a
#: body's size tells too poorly to count (chat templates, images, a cached prefix).
COLD_PROMPT_S = 1.0
#: Embeddings, rerank and transcriptions generate nothing; their holds are not guessed.
_GENERATING = frozenset({Kind.CHAT, Kind.COMPLETION, Kind.RESPONSES, Kind.MESSAGES})


def expected_hold_s(kind: Kind, body: bytes, tokens_per_s: float | None) -> float | None:
    """The longest a request of this body should hold a slot, or None when it generates nothing.

    Only called until the first hold has been observed, so the body's second parse costs
    nothing in steady state.
    """
    if kind not in _GENERATING:
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return expected_hold_of(kind, payload, tokens_per_s)


def expected_hold_of(
    kind: Kind, payload: Any, tokens_per_s: float | None, default_output: int | None = None
) -> float | None:
    """`expected_hold_s` of a body already parsed; `default_output` is llama-server's own -n,
    the limit of a request that leaves it to the server."""
    if kind not in _GENERATING:
        return None
    limit = output_limit(kind, payload) if isinstance(payload, dict) else None
    if limit is None:
        limit = default_output
    tokens = COLD_TOKENS if limit is None else limit
    return COLD_PROMPT_S + tokens / (tokens_per_s or COLD_TOKENS_PER_S)


def generation_speed(metrics: bytes) -> float | None:
    """Tokens per second of one generation so far, from llama-server's /metrics counters
    (`tokens_predicted_total` over `tokens_predicted_seconds_total`, which add up each slot's
    own generation time); None when it has generated nothing yet."""
    values: dict[bytes, float] = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(b" ")
        if name in (b"llamacpp:tokens_predicted_total", b"llamacpp:tokens_predicted_seconds_total"):
            try:
                values[name] = float(value)
            except ValueError:
                return None
    tokens = values.get(b"llamacpp:tokens_predicted_total", 0.0)
    seconds = values.get(b"llamacpp:tokens_predicted_seconds_total", 0.0)
    speed = tokens / seconds if tokens > 0 and seconds > 0 else 0.0
    # NaN or Inf (Prometheus' text allows both) would make every Retry-After NaN or 0.
    return speed if math.isfinite(speed) and speed > 0 else None
