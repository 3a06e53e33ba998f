"""How many slots a request takes, read from its body the way llama-server reads it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from slotgate.errors import BadRequest
from slotgate.intake.endpoints import (
    ENDPOINTS,
    MAX_JSON_DEPTH,
    demand,
    form_field,
    parse_json,
    route_of,
)
from slotgate.intake.rewrite import streaming_body


def weight(path: str, body: dict[str, Any], capacity: int = 8) -> int:
    endpoint = ENDPOINTS[path]
    return demand(endpoint, json.dumps(body).encode(), capacity).weight


@pytest.mark.parametrize(
    ("path", "body", "slots"),
    [
        ("/v1/chat/completions", {"messages": []}, 1),
        ("/v1/chat/completions", {"messages": [], "n": 3}, 3),
        ("/v1/completions", {"prompt": "a"}, 1),
        ("/v1/completions", {"prompt": ["a", "b", "c"]}, 3),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 1),  # one tokenized prompt
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, 4),
        ("/completion", {"prompt": "a", "n_predict": -1}, 1),
        ("/infill", {"input_prefix": "a"}, 1),
        ("/v1/embeddings", {"input": ["a", "b"]}, 2),
        ("/embedding", {"content": ["a", "b", "c"]}, 3),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, 2),
        ("/v1/messages", {"messages": [], "max_tokens": 5}, 1),
        ("/v1/responses", {"input": "hi"}, 1),
        # n_cmpl is llama-server's own name for the number of completions, and wins over n.
        ("/v1/chat/completions", {"messages": [], "n_cmpl": 2}, 2),
        ("/v1/chat/completions", {"messages": [], "n_cmpl": 2, "n": 1}, 2),
        ("/v1/chat/completions", {"messages": [], "n_cmpl": 1, "n": 99}, 1),
        ("/v1/chat/completions", {"messages": [], "n_cmpl": None, "n": 3}, 3),
        ("/completion", {"prompt": "a", "n_cmpl": 3}, 3),
        ("/completion", {"prompt": ["a", "b"], "n_cmpl": 2}, 4),
        ("/infill", {"input_prefix": "a", "input_suffix": "b", "n_cmpl": 2}, 2),
        ("/v1/responses", {"input": "hi", "n_cmpl": 2}, 2),
        ("/responses", {"input": "hi", "n": 3}, 3),
        # /infill builds one prompt whatever "prompt" holds.
        ("/infill", {"input_prefix": "a", "prompt": ["a", "b", "c"]}, 1),
        # An array holding any token id is one prompt: text mixed with token ids.
        ("/completion", {"prompt": ["a", 12, "b"]}, 1),
        ("/v1/embeddings", {"input": [[1, 2], "x", [3]]}, 3),
        # "input" is read when present, even beside "content".
        ("/embeddings", {"input": "a", "content": ["a", "b"]}, 1),
        # Rerank's TEI shape names the documents "texts".
        ("/rerank", {"query": "q", "texts": ["a", "b", "c"]}, 3),
        ("/rerank", {"query": "q", "documents": [1], "texts": ["a", "b"]}, 2),
        # The Anthropic converter drops n and n_cmpl: one task, whatever they say.
        ("/v1/messages", {"messages": [], "max_tokens": 5, "n_cmpl": 5, "n": 5}, 1),
        # Embeddings and rerank read neither.
        ("/v1/embeddings", {"input": "a", "n": 3}, 1),
    ],
)
def test_slots_taken_follow_llama_servers_task_count(
    path: str, body: dict[str, Any], slots: int
) -> None:
    assert weight(path, body) == slots


def test_an_array_larger_than_the_pool_takes_the_whole_pool_not_a_refusal() -> None:
    assert weight("/v1/embeddings", {"input": ["x"] * 100}, capacity=4) == 4


def test_n_above_capacity_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="at most 2"):
        weight("/v1/chat/completions", {"messages": [], "n": 3}, capacity=2)


def test_n_cmpl_above_capacity_is_a_bad_request_naming_n_cmpl() -> None:
    with pytest.raises(BadRequest, match="at most 2") as caught:
        weight("/completion", {"prompt": "a", "n_cmpl": 3, "n": 1}, capacity=2)
    assert caught.value.param == "n_cmpl"
    with pytest.raises(BadRequest, match="integer"):
        weight("/completion", {"prompt": "a", "n_cmpl": "2"})


@pytest.mark.parametrize("body", [{"max_tokens": -1}, {"n_predict": 5, "max_tokens": "x"}])
def test_an_output_limit_llama_server_accepts_is_not_refused(body: dict[str, Any]) -> None:
    assert weight("/v1/chat/completions", {"messages": [], **body}) == 1


@pytest.mark.parametrize(
    "body", [{"max_tokens": -2}, {"max_completion_tokens": "5"}, {"n_predict": -2}]
)
def test_an_output_limit_llama_server_refuses_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as caught:
        weight("/v1/chat/completions", {"messages": [], **body})
    assert caught.value.param == next(iter(body))


# Every route on which llama-server starts slot work, from its route registrations in
# ggml-org/llama.cpp tools/server/server.cpp (`ctx_http.post(...)` lines whose handler in
# tools/server/server-context.cpp calls handle_completions_impl, handle_embeddings_impl or
# runs rerank tasks).
LLAMA_SERVER_GENERATING_ROUTES = (
    "/completion", "/completions", "/v1/completions", "/chat/completions",
    "/v1/chat/completions", "/v1/responses", "/responses", "/v1/audio/transcriptions",
    "/audio/transcriptions", "/v1/messages", "/infill", "/embedding", "/embeddings",
    "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
)  # fmt: skip
# The other POST routes registered in the same file: no slot's work behind them.
LLAMA_SERVER_OTHER_POSTS = (
    "/props", "/v1/chat/completions/control", "/tokenize", "/detokenize", "/apply-template",
    "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
    "/responses/input_tokens", "/v1/responses/input_tokens", "/v1/messages/count_tokens",
    "/lora-adapters", "/slots/0", "/models", "/models/load", "/models/unload", "/cors-proxy",
    "/tools",
)  # fmt: skip


def test_the_gated_table_is_exactly_llama_servers_generating_routes() -> None:
    assert set(ENDPOINTS) == set(LLAMA_SERVER_GENERATING_ROUTES)
    for path in LLAMA_SERVER_GENERATING_ROUTES:
        assert route_of("POST", path) is not None, path
    for path in LLAMA_SERVER_OTHER_POSTS:
        assert route_of("POST", path) is None, path


def test_stream_flag_is_read() -> None:
    endpoint = ENDPOINTS["/v1/chat/completions"]
    assert demand(endpoint, b'{"stream": true}', 2).stream is True
    assert demand(endpoint, b"{}", 2).stream is False


def test_only_posts_to_generating_paths_are_admitted() -> None:
    assert route_of("POST", "/v1/chat/completions") is not None
    assert route_of("GET", "/v1/chat/completions") is None
    for path in ("/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
                 "/v1/models", "/health", "/v1/messages/count_tokens"):  # fmt: skip
        assert route_of("POST", path) is None, path


def test_audio_transcription_is_admitted_without_reading_its_multipart_body() -> None:
    for path in ("/v1/audio/transcriptions", "/audio/transcriptions"):
        assert demand(ENDPOINTS[path], b"--boundary\r\n...", 2).weight == 1


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 1024])
def test_json_nested_past_the_one_limit_is_a_bad_request(depth: int) -> None:
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    with pytest.raises(BadRequest, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_json(b'{"messages": ' + inner + b"}")


def test_json_nested_to_the_limit_is_parsed_and_can_be_written_again() -> None:
    inner = b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1)
    payload = parse_json(b'{"messages": ' + inner + b"}")
    assert orjson.loads(streaming_body(orjson.dumps(payload)))["stream"] is True


FORM = "multipart/form-data; boundary=XyZ"


def form(*parts: tuple[str, bytes]) -> bytes:
    return (
        b"".join(
            b'--XyZ\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (n.encode(), v)
            for n, v in parts
        )
        + b"--XyZ--\r\n"
    )


def test_a_forms_field_is_found_after_a_big_file_part() -> None:
    body = form(("file", b"RIFF" * 100_000), ("model", "bêta".encode()))
    assert form_field(body, FORM, "model") == "bêta"
    assert form_field(body, 'multipart/form-data; boundary="XyZ"', "model") == "bêta"


def test_a_form_without_the_field_has_none() -> None:
    assert form_field(form(("models", b"x"), ("file", b"RIFF")), FORM, "model") is None
    assert form_field(form(("model", b"x")), "multipart/form-data", "model") is None
    assert form_field(form(("model", b"x" * 10_000)), FORM, "model") is None  # not a name


def test_a_form_of_very_many_parts_is_read_no_further_than_its_first() -> None:
    # A million tiny parts would hold the loop for a second: past 64, it has no model.
    body = form(*[("x", b"v")] * 1000, ("model", b"alpha"))
    assert form_field(body, FORM, "model") is None
    assert form_field(form(*[("x", b"v")] * 10, ("model", b"alpha")), FORM, "model") == "alpha"
