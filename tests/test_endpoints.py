"""How many slots a request takes, read from its body the way llama-server reads it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from slotgate.endpoints import ENDPOINTS, admitted, demand
from slotgate.errors import BadRequest


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


def test_stream_flag_is_read() -> None:
    endpoint = ENDPOINTS["/v1/chat/completions"]
    assert demand(endpoint, b'{"stream": true}', 2).stream is True
    assert demand(endpoint, b"{}", 2).stream is False


def test_only_posts_to_generating_paths_are_admitted() -> None:
    assert admitted("POST", "/v1/chat/completions") is not None
    assert admitted("GET", "/v1/chat/completions") is None
    for path in ("/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
                 "/v1/models", "/health", "/v1/messages/count_tokens"):  # fmt: skip
        assert admitted("POST", path) is None, path


def test_audio_transcription_is_admitted_without_reading_its_multipart_body() -> None:
    endpoint = ENDPOINTS["/v1/audio/transcriptions"]
    assert demand(endpoint, b"--boundary\r\n...", 2).weight == 1
