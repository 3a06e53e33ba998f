"""The hold a generation is expected to take before any has been seen."""

from __future__ import annotations

import pytest
from slotgate.intake.endpoints import ENDPOINTS, Kind
from slotgate.intake.pace import (
    COLD_PROMPT_S,
    COLD_TOKENS,
    COLD_TOKENS_PER_S,
    expected_hold_of,
    expected_hold_s,
    generation_speed,
)

from tests.support.limits import OUTPUT_LIMITS

#: llama-server's /metrics after one 64-token answer (xllamacpp build, 2026-11).
LLAMA_METRICS = b"""# HELP llamacpp:prompt_seconds_total Total time spent processing prompts
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.258949
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 64
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 1.28
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 53.0204
"""


@pytest.mark.parametrize(
    ("kind", "body", "speed", "hold_s"),
    [
        (Kind.CHAT, b'{"max_tokens": 64}', 32.0, 2.0),
        (Kind.CHAT, b'{"max_completion_tokens": 30}', None, 30 / COLD_TOKENS_PER_S),
        (Kind.RESPONSES, b'{"max_output_tokens": 50}', 25.0, 2.0),
        (Kind.MESSAGES, b'{"max_tokens": 20, "messages": []}', 10.0, 2.0),
        (Kind.COMPLETION, b'{"n_predict": 100}', 50.0, 2.0),
        (Kind.COMPLETION, b'{"n_predict": -1}', 64.0, COLD_TOKENS / 64.0),
        (Kind.CHAT, b'{"messages": []}', None, COLD_TOKENS / COLD_TOKENS_PER_S),
    ],
)
def test_a_generation_is_expected_to_hold_its_slot_for_a_prompt_and_its_tokens(
    kind: Kind, body: bytes, speed: float | None, hold_s: float
) -> None:
    assert expected_hold_s(kind, body, speed) == pytest.approx(COLD_PROMPT_S + hold_s)


def test_a_generation_is_paced_by_the_output_llama_server_will_let_it_generate() -> None:
    wrong = []
    for path, body, default, tokens in OUTPUT_LIMITS:
        kind = ENDPOINTS[path].kind
        hold_s = (
            expected_hold_of(kind, body, 10.0)
            if default is None
            else expected_hold_of(kind, body, 10.0, default_output=default)
        )
        # With no limit the length is the model's to choose: a long answer is assumed.
        expected = COLD_PROMPT_S + (COLD_TOKENS if tokens is None else tokens) / 10.0
        if hold_s != pytest.approx(expected):
            wrong.append((path, body, default, hold_s, expected))
    assert wrong == []


@pytest.mark.parametrize("kind", [Kind.EMBEDDING, Kind.RERANK, Kind.AUDIO])
def test_work_that_generates_nothing_has_no_expected_hold(kind: Kind) -> None:
    assert expected_hold_s(kind, b'{"input": "hi"}', 50.0) is None


def test_the_engines_speed_is_its_tokens_over_its_generation_time() -> None:
    assert generation_speed(LLAMA_METRICS) == pytest.approx(50.0)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"llamacpp:tokens_predicted_total 0\nllamacpp:tokens_predicted_seconds_total 0\n",
        b"llamacpp:tokens_predicted_total 5\nllamacpp:tokens_predicted_seconds_total x\n",
    ],
)
def test_an_engine_that_has_generated_nothing_has_no_speed(text: bytes) -> None:
    assert generation_speed(text) is None
