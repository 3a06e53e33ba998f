"""Non-streamed answers put together from llama-server's stream, so that a client that leaves
frees its slot at once; llama-server's own non-streamed answer is the specification (why and
how: docs/design.md, "Assembled answers").
"""

from __future__ import annotations

from typing import Any

import orjson
from slotgate.intake.endpoints import Kind
from slotgate.intake.rewrite import dump

#: The most an assembled answer may take: the stream is held until its end, so past this the
#: request is cut (its upstream connection closed) and answered 502, rather than holding
#: whatever llama-server sends. Far above any real completion's answer.
MAX_ASSEMBLED_BYTES = 64 * 1024 * 1024
#: The native fields whose pieces are joined across events.
_NATIVE_LISTS = ("tokens", "completion_probabilities", "probs")


class Assembly:
    """Collects one stream's events and builds the non-streamed answer from them."""

    def __init__(self, kind: Kind, path: str, *, return_tokens: bool = False) -> None:
        # /completion, /completions and /infill speak llama.cpp's native format;
        # /v1/completions and the chat routes speak OpenAI's.
        self._native = kind is Kind.COMPLETION and path != "/v1/completions"
        self._chat = kind is Kind.CHAT
        self._received: list[bytes] = []
        self._return_tokens = return_tokens
        self.error: dict[str, Any] | None = None
        #: The stream carried `__verbose` (llama-server runs with --verbose).
        self.verbose = False
        self.size = 0

    def feed(self, data: bytes) -> None:
        # Kept whole and parsed once at the end: the answer needs every event anyway, and one
        # pass over the joined bytes is far cheaper than re-splitting after every chunk.
        self._received.append(data)
        self.size += len(data)

    def _parse(self) -> None:
        # What the events build up is made here, not with the Assembly: a request that waits
        # for its slot holds its Assembly, and should not hold these yet.
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._last: dict[str, Any] = {}
        # Native answers, one per prompt: a `prompt` array makes llama-server interleave the
        # prompts' events in one stream, each tagged with its prompt's `index`.
        self._native_answers: dict[int, _NativeAnswer] = {}
        stream = b"".join(self._received)
        if b"\r" in stream:
            stream = stream.replace(b"\r\n", b"\n")
        payloads = [
            payload
            for line in stream.split(b"\n")
            if line.startswith(b"data:") and (payload := line[5:].strip()) != b"[DONE]" and payload
        ]
        # One parse per event, not one of all of them joined as an array (3 us less for 16
        # tokens): joined, broken events could make a valid whole and go unnoticed.
        loads = orjson.loads
        for payload in payloads:
            chunk = loads(payload)
            if type(chunk) is not dict:
                continue
            if "error" in chunk:
                self.error = chunk
                return
            if "__verbose" in chunk:
                self.verbose = True
            if self._native:
                self._native_chunk(chunk)
                continue
            if not self._head:
                self._head = chunk
            usage, timings = chunk.get("usage"), chunk.get("timings")
            if usage is not None:
                self._last["usage"] = usage
            if timings is not None:
                self._last["timings"] = timings
            for choice in chunk.get("choices") or ():
                self._choice(choice)

    def _choice(self, delta_choice: dict[str, Any]) -> None:
        index = delta_choice.get("index", 0)
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = {
                "index": index, "parts": [], "reasoning": [], "tools": {}, "logprobs": {}
            }  # fmt: skip
        finish_reason = delta_choice.get("finish_reason")
        if finish_reason is not None:
            choice["finish_reason"] = finish_reason
        logprobs = delta_choice.get("logprobs")
        if logprobs:
            _extend(choice["logprobs"], logprobs)
        if not self._chat:
            choice["parts"].append(delta_choice.get("text") or "")
            return
        delta = delta_choice.get("delta")
        if not delta:
            return
        content = delta.get("content")
        if content:
            choice["parts"].append(content)
        if len(delta) == 1 and content is not None:
            return  # the common event: one more piece of content
        if delta.get("reasoning_content"):
            choice["reasoning"].append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            slot = choice["tools"].setdefault(
                call.get("index", 0),
                {"type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function") or {}
            slot["function"]["name"] += function.get("name") or ""
            slot["function"]["arguments"] += function.get("arguments") or ""

    def _native_chunk(self, chunk: dict[str, Any]) -> None:
        if "prompt_progress" in chunk:
            return  # return_progress: stream-only events, no part of the answer
        index = chunk.get("index", 0)
        answer = self._native_answers.get(index)
        if answer is None:
            answer = self._native_answers[index] = _NativeAnswer(self._return_tokens)
        answer.texts.append(chunk.get("content") or "")
        for key in _NATIVE_LISTS:
            if isinstance(chunk.get(key), list):
                answer.lists.setdefault(key, []).extend(chunk[key])
        answer.last = chunk

    def result(self) -> tuple[int, bytes]:
        """Status and JSON body of the assembled answer (an error one if the stream failed).

        Raises ValueError when an event is not JSON.
        """
        self._parse()
        if self.error is not None:
            code = self.error.get("error", {}).get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return status, dump(self.error)
        if self._native:
            answers = [a.result() for _, a in sorted(self._native_answers.items())] or [
                _NativeAnswer(self._return_tokens).result()
            ]
            # As llama-server answers: one object for one prompt, else an array in prompt order.
            return 200, dump(answers[0] if len(answers) == 1 else answers)
        answer: dict[str, Any] = {
            key: self._head[key]
            for key in ("id", "created", "model", "system_fingerprint")
            if key in self._head
        }
        answer["object"] = "chat.completion" if self._chat else "text_completion"
        answer["choices"] = [self._final(c) for _, c in sorted(self._choices.items())]
        answer.update(self._last)
        return 200, dump(answer)

    def _final(self, choice: dict[str, Any]) -> dict[str, Any]:
        final: dict[str, Any] = {
            "index": choice["index"],
            "finish_reason": choice.get("finish_reason"),
        }
        if choice["logprobs"]:
            final["logprobs"] = choice["logprobs"]
        if not self._chat:
            final["text"] = "".join(choice["parts"])
            final.setdefault("logprobs", None)
            return final
        tools = [choice["tools"][i] for i in sorted(choice["tools"])]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(choice["parts"]) if choice["parts"] or not tools else None,
        }
        if choice["reasoning"]:
            message["reasoning_content"] = "".join(choice["reasoning"])
        if tools:
            message["tool_calls"] = tools
        final["message"] = message
        return final


class _NativeAnswer:
    """One prompt's answer in llama.cpp's native format, as its events arrive."""

    __slots__ = ("last", "lists", "return_tokens", "texts")

    def __init__(self, return_tokens: bool) -> None:
        self.return_tokens = return_tokens
        self.texts: list[str] = []
        self.lists: dict[str, list[Any]] = {}
        self.last: dict[str, Any] = {}

    def result(self) -> dict[str, Any]:
        """The last event (the stream's final result) with the pieces joined in: only the
        fields it has, so a `response_fields` selection stays as selected."""
        answer = dict(self.last)
        if "content" in answer or not answer:
            answer["content"] = "".join(self.texts)
        if "tokens" in answer or not answer:
            # Sent with every streamed token, but in a non-streamed answer only on request.
            answer["tokens"] = self.lists.get("tokens", []) if self.return_tokens else []
        for key in _NATIVE_LISTS[1:]:
            if key in self.lists:
                answer[key] = self.lists[key]
        settings = answer.get("generation_settings")
        if isinstance(settings, dict) and "stream" in settings:
            answer["generation_settings"] = {**settings, "stream": False}
        if "generation_settings/stream" in answer:
            answer["generation_settings/stream"] = False
        return answer


def _extend(into: dict[str, Any], logprobs: Any) -> None:
    if isinstance(logprobs, dict):
        for key, value in logprobs.items():
            if isinstance(value, list):
                into.setdefault(key, []).extend(value)
