"""Non-streamed answers put together from llama-server's stream events, in-process."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from slotgate.intake.endpoints import Kind
from slotgate.intake.rewrite import streaming_body
from slotgate.proxy.assembly import Assembly

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def stream(*events: dict[str, Any], newline: bytes = b"\n") -> bytes:
    lines = [b"data: " + json.dumps(event).encode() for event in events]
    lines += [b": a comment llama-server may send", b"data: [DONE]"]
    return b"".join(line + newline + newline for line in lines)


def assemble(
    data: bytes,
    kind: Kind = Kind.CHAT,
    path: str = "/v1/chat/completions",
    *,
    return_tokens: bool = False,
) -> Any:
    assembly = Assembly(kind, path, return_tokens=return_tokens)
    for at in range(0, len(data), 7):  # the stream arrives in arbitrary pieces
        assembly.feed(data[at : at + 7])
    status, body = assembly.result()
    return status, json.loads(body)


def delta(index: int = 0, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": index, "delta": fields, "finish_reason": finish}]}


def test_chat_content_reasoning_usage_and_timings_make_one_message() -> None:
    data = stream(
        delta(role="assistant", content=None),
        delta(reasoning_content="think"),
        delta(content="Hel"),
        delta(content="lo"),
        {**delta(finish="stop"), "timings": {"predicted_n": 2}},
        {**HEAD, "choices": [], "usage": {"completion_tokens": 2}},
    )
    status, answer = assemble(data)
    assert status == 200
    assert answer == {
        "id": "chatcmpl-1", "created": 7, "model": "m", "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "Hello", "reasoning_content": "think"}}],
        "usage": {"completion_tokens": 2}, "timings": {"predicted_n": 2},
    }  # fmt: skip


def test_tool_call_fragments_are_joined_per_call_and_content_is_null() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get"}}
    data = stream(
        delta(tool_calls=[call]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a":'}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
        delta(finish="tool_calls"),
    )
    _, answer = assemble(data)
    message = answer["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "get", "arguments": '{"a":1}'}}
    ]


def test_choices_of_n_are_kept_apart_and_in_order_with_their_logprobs() -> None:
    data = stream(
        {**delta(1, content="b"), "choices": [{"index": 1, "delta": {"content": "b"},
                                               "logprobs": {"content": [{"t": "b"}]}}]},
        delta(0, content="a"),
        delta(0, finish="stop"),
        delta(1, finish="length"),
        newline=b"\r\n",
    )  # fmt: skip
    _, answer = assemble(data)
    assert [c["message"]["content"] for c in answer["choices"]] == ["a", "b"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "length"]
    assert answer["choices"][1]["logprobs"] == {"content": [{"t": "b"}]}


def test_openai_text_completions_join_their_text() -> None:
    events = [
        {**HEAD, "choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
        for piece, finish in (("a", None), ("b", "stop"))
    ]
    _, answer = assemble(stream(*events), Kind.COMPLETION, "/v1/completions")
    assert answer["object"] == "text_completion"
    assert answer["choices"] == [
        {"index": 0, "finish_reason": "stop", "text": "ab", "logprobs": None}
    ]


def test_native_completion_joins_content_and_keeps_the_last_events_fields() -> None:
    data = stream(
        {"content": "a", "tokens": [1], "stop": False},
        {"content": "b", "tokens": [2], "stop": False},
        {"content": "", "tokens": [], "stop": True, "timings": {"predicted_n": 2}},
    )
    _, answer = assemble(data, Kind.COMPLETION, "/completion", return_tokens=True)
    assert answer == {"content": "ab", "tokens": [1, 2], "stop": True,
                      "timings": {"predicted_n": 2}}  # fmt: skip


def test_native_tokens_are_empty_unless_asked_for_as_llama_server_answers() -> None:
    data = stream(
        {"content": "a", "tokens": [1], "stop": False},
        {"content": "", "tokens": [], "stop": True, "generation_settings": {"stream": True}},
    )
    _, answer = assemble(data, Kind.COMPLETION, "/completion")
    assert answer == {"content": "a", "tokens": [], "stop": True,
                      "generation_settings": {"stream": False}}  # fmt: skip


def test_native_response_fields_stay_as_selected_and_progress_events_are_left_out() -> None:
    # return_progress sends prompt-progress events with a placeholder token; a
    # response_fields selection filters every event, the last one included.
    data = stream(
        {"content": "", "tokens": [0], "prompt_progress": {"total": 3, "processed": 3}},
        {"content": "a"},
        {"content": "b"},
        {"content": "", "generation_settings/stream": True},
    )
    _, answer = assemble(data, Kind.COMPLETION, "/completion", return_tokens=True)
    assert answer == {"content": "ab", "generation_settings/stream": False}


def test_a_verbose_llama_server_is_noticed() -> None:
    assembly = Assembly(Kind.COMPLETION, "/completion")
    assembly.feed(stream({"content": "a", "stop": True, "__verbose": {"content": "a"}}))
    assembly.result()
    assert assembly.verbose


def test_native_completion_of_several_prompts_answers_an_array_in_prompt_order() -> None:
    # llama-server interleaves the prompts' events in one stream, each with its prompt's index.
    data = stream(
        {"index": 1, "content": "x", "stop": False},
        {"index": 0, "content": "a", "stop": False},
        {"index": 1, "content": "y", "stop": True, "prompt": "second"},
        {"index": 0, "content": "b", "stop": True, "prompt": "first"},
    )
    _, answer = assemble(data, Kind.COMPLETION, "/completion")
    assert answer == [
        {"index": 0, "content": "ab", "stop": True, "prompt": "first"},
        {"index": 1, "content": "xy", "stop": True, "prompt": "second"},
    ]


def test_an_error_event_becomes_the_answer_with_its_own_status() -> None:
    error = {"error": {"code": 500, "message": "boom", "type": "server_error"}}
    status, answer = assemble(stream(delta(content="a"), error, delta(content="b")))
    assert status == 500
    assert answer == error


@pytest.mark.parametrize(
    "payloads", [[b"{not json"], [b'{"a":1},{"b":2}'], [b"[1,"], [b"[1", b"2]", b"3,4"]]
)
def test_an_event_that_is_not_one_json_value_is_refused(payloads: list[bytes]) -> None:
    # The last case: three broken events that would make three values if parsed as one array.
    assembly = Assembly(Kind.CHAT, "/v1/chat/completions")
    assembly.feed(b"".join(b"data: " + payload + b"\n\n" for payload in payloads))
    assembly.feed(stream(delta(content="a")))
    with pytest.raises(ValueError, match=r"."):
        assembly.result()


def test_the_request_asks_for_a_stream_with_usage_whatever_the_client_chose() -> None:
    # A non-streamed answer always has usage: stream_options means nothing to it.
    assert json.loads(streaming_body(b'{"stream":false}')) == {
        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chosen = json.loads(streaming_body(b'{"stream_options":{"include_usage":false}}'))
    assert chosen["stream_options"] == {"include_usage": True}


def test_a_short_rewritten_body_holds_its_own_bytes_not_a_write_buffer() -> None:
    # A rewritten body waits in the queue with its request: it must not keep orjson's 4 KiB
    # write buffer alive for a few dozen bytes.
    tracemalloc.start()
    try:
        body = streaming_body(b'{"messages":[{"role":"user","content":"hi"}]}')
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body) < 200
    assert held < 1024
