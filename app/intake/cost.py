"""What one request may take of llama-server's KV cache, in tokens: its prompt and its output.

Only needed when the cache is one pool shared by every slot (llama-server without `-np`, or
with `--kv-unified`): then the requests in flight must fit in it together, or llama-server
fails all of them at once with 500 "Context size has been exceeded".

The prompt is counted locally from the body, as an upper bound: one token per UTF-8 byte of
every string a prompt is built from (tokenizers fall back to single bytes, and gemma spells
numbers one digit per token, so nothing tighter is safe), plus the chat template's own tokens.
Measured against llama.cpp (docs/kv-budget.md), it costs about 6 us a request and is
never below the real count, but up to 5 times above it for prose: so a chat or a text prompt
is counted by llama-server itself (`/apply-template` + `/tokenize`, exact, two round trips of
a few milliseconds), and the local bound is the fallback. None of it runs unless the budget
binds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slotgate.errors import ContextExceeded
from slotgate.intake.endpoints import Endpoint, Kind, output_limit

#: Tokens a chat template adds around each message (role markers, turn delimiters); gemma's
#: is 5 (`<start_of_turn>user\n` ... `<end_of_turn>\n`), ChatML's 4-5; counted generously.
MESSAGE_OVERHEAD_TOKENS = 8
#: Tokens a request adds beyond its messages (BOS, the generation prompt, a default system).
REQUEST_OVERHEAD_TOKENS = 16
#: The fields that carry a request's prompt, route by route; everything else (sampling knobs,
#: max_tokens, stream flags) never reaches the model.
_PROMPT_FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.CHAT: ("messages", "tools", "system", "prompt"),
    Kind.COMPLETION: ("prompt", "input_prefix", "input_suffix", "input_extra"),
    Kind.RESPONSES: ("input", "instructions", "tools"),
    Kind.MESSAGES: ("messages", "system", "tools"),
    Kind.EMBEDDING: ("input", "content"),
    Kind.RERANK: ("query", "documents", "texts"),
}


@dataclass(frozen=True, slots=True)
class Cost:
    """A request's tokens: `prompt` (an upper bound) and `output` (None = not bounded)."""

    prompt: int
    output: int | None

    def total(self, budget: int) -> int:
        """What to reserve of a budget: everything when the output is not bounded (it may
        run until the cache is full), and never more than the whole budget."""
        if self.output is None:
            return budget
        return min(self.prompt + self.output, budget)


def estimate(endpoint: Endpoint, payload: dict[str, Any]) -> Cost:
    """The request's cost, from its parsed body alone (no round trip)."""
    kind = endpoint.kind
    fields = _PROMPT_FIELDS.get(kind)
    if fields is None:  # audio: a multipart body whose length says nothing of its tokens
        return Cost(0, None)
    size = 0
    for name in fields:
        value = payload.get(name)
        if value is not None:
            size += _bytes(value)
    messages = payload.get("messages")
    turns = len(messages) if isinstance(messages, list) else 1
    prompt = size + MESSAGE_OVERHEAD_TOKENS * turns + REQUEST_OVERHEAD_TOKENS
    copies = _completions(payload)
    if kind in (Kind.EMBEDDING, Kind.RERANK):
        # Every document is scored with the query in front of it.
        documents = payload.get("documents", payload.get("texts"))
        if kind is Kind.RERANK and isinstance(documents, list) and documents:
            prompt += _bytes(payload.get("query", "")) * (len(documents) - 1)
        return Cost(prompt, 0)
    limit = output_limit(kind, payload)
    tasks = _prompts(payload) if kind is Kind.COMPLETION else 1
    return Cost(prompt * copies, None if limit is None else limit * copies * tasks)


def _bytes(value: object) -> int:
    """UTF-8 bytes of every string and number inside a JSON value (keys of tools included)."""
    if isinstance(value, str):
        # len(str) counts code points; an ASCII-only string (the common case) has as many
        # bytes, and only a non-ASCII one pays for the encoding.
        return len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
    if isinstance(value, list):
        return sum(_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_bytes(key) + _bytes(item) for key, item in value.items())
    if isinstance(value, bool) or value is None:
        return 1
    if isinstance(value, int | float):
        return len(repr(value))
    return 0


def _completions(payload: dict[str, Any]) -> int:
    # llama.cpp's own n_cmpl wins over OpenAI's n.
    for name in ("n_cmpl", "n"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return 1


def _prompts(payload: dict[str, Any]) -> int:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


@dataclass(frozen=True, slots=True)
class Estimate:
    """A request's reservation by the local bound, and what a count by llama-server needs."""

    endpoint: Endpoint
    payload: dict[str, Any]
    budget: int
    default_output: int | None
    reserve: int
    #: False when the payload was left behind (a big body read in intake's worker process):
    #: the local bound stands, and llama-server is not asked to count.
    exact: bool = True

    @property
    def countable(self) -> bool:
        """Can llama-server count this prompt exactly (a chat, or one text prompt)?"""
        if not self.exact:
            return False
        kind = self.endpoint.kind
        return kind is Kind.CHAT or (
            kind is Kind.COMPLETION and isinstance(self.payload.get("prompt"), str)
        )


def local(
    endpoint: Endpoint, payload: dict[str, Any], budget: int, default_output: int | None = None
) -> Estimate:
    """The tokens to reserve of `budget`, by the local upper bound. A request that bounds no
    output gets llama-server's own default (`default_output`, its -n), else the rest."""
    cost = _defaulted(estimate(endpoint, payload), endpoint, payload, default_output)
    return Estimate(endpoint, payload, budget, default_output, cost.total(budget))


async def counted(
    est: Estimate, count: Callable[[bool, dict[str, Any]], Awaitable[int | None]]
) -> int | None:
    """The reservation with the prompt counted by llama-server (`count`), or None when it
    cannot count it; ContextExceeded when the prompt alone could never fit."""
    if not est.countable:
        return None
    exact = await count(est.endpoint.kind is Kind.CHAT, est.payload)
    if exact is None:
        return None
    # As llama-server decides it: a prompt that fills the whole context never runs.
    if exact >= est.budget:
        raise ContextExceeded(exact, est.budget)
    output = estimate(est.endpoint, est.payload).output
    cost = Cost(exact * _completions(est.payload), output)
    return _defaulted(cost, est.endpoint, est.payload, est.default_output).total(est.budget)


def _defaulted(
    cost: Cost, endpoint: Endpoint, payload: dict[str, Any], default_output: int | None
) -> Cost:
    if cost.output is not None or default_output is None or endpoint.kind in _NO_OUTPUT:
        return cost
    return Cost(cost.prompt, default_output * _completions(payload))


_NO_OUTPUT = frozenset({Kind.EMBEDDING, Kind.RERANK, Kind.AUDIO})
