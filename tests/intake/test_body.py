"""Request bodies read into a demand and the body to forward, big ones in a worker process."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from slotgate.errors import BadRequest
from slotgate.intake import body as intake
from slotgate.intake.body import OFF_LOOP_BYTES, Reading, Wants, take, take_off_loop
from slotgate.intake.endpoints import ENDPOINTS

CHAT = ENDPOINTS["/v1/chat/completions"]


def big(**fields: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": "x" * OFF_LOOP_BYTES}], **fields}
    return orjson.dumps(body)


def test_a_non_streamed_completion_is_rewritten_to_ask_for_a_stream() -> None:
    taken = take(CHAT, b'{"messages": []}', Reading(2, True))
    assert taken.assembled is True
    assert orjson.loads(taken.body)["stream"] is True
    streamed = take(CHAT, b'{"messages": [], "stream": true}', Reading(2, True))
    assert (streamed.assembled, streamed.body) == (False, b'{"messages": [], "stream": true}')
    as_sent = take(CHAT, b'{"messages": []}', Reading(2, False))
    assert (as_sent.assembled, as_sent.body) == (False, b'{"messages": []}')


@pytest.mark.parametrize(
    ("path", "body", "quiet", "assembled", "teaches"),
    [
        ("/v1/chat/completions", {"messages": []}, True, True, False),
        # Unknown whether llama-server adds __verbose unasked: as sent, and the answer tells.
        ("/v1/chat/completions", {"messages": []}, False, False, True),
        ("/chat/completions", {"messages": [], "verbose": None}, False, False, True),
        ("/v1/completions", {"prompt": "a"}, False, False, True),
        # The body decides for itself, whatever llama-server's own setting.
        ("/v1/chat/completions", {"messages": [], "verbose": True}, True, False, False),
        ("/v1/chat/completions", {"messages": [], "verbose": False}, False, True, False),
        # Not a boolean: llama-server refuses it, as sent.
        ("/v1/completions", {"prompt": "a", "verbose": "yes"}, True, False, False),
        # Native answers carry no __verbose, asked or not.
        ("/completion", {"prompt": "a", "verbose": True}, False, True, False),
        ("/completions", {"prompt": "a"}, False, True, False),
        ("/infill", {"input_prefix": "a"}, False, True, False),
    ],
)
def test_an_answer_that_may_carry_verbose_is_not_assembled(
    path: str, body: dict[str, Any], quiet: bool, assembled: bool, teaches: bool
) -> None:
    taken = take(ENDPOINTS[path], orjson.dumps(body), Reading(2, True, quiet))
    assert (taken.assembled, taken.teaches) == (assembled, teaches)


@pytest.mark.interpreted
async def test_a_big_body_is_read_in_a_worker_process_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = big(n_cmpl=2)
    expected = take(CHAT, body, Reading(4, True))

    def not_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("read on the event loop")

    # The worker process has its own `take`: this one must not be called for a big body...
    monkeypatch.setattr(intake, "take", not_here)
    assert await take_off_loop(CHAT, body, Reading(4, True)) == expected
    # ...and must be for a small one.
    with pytest.raises(AssertionError, match="event loop"):
        await take_off_loop(CHAT, b'{"messages": []}', Reading(4, True))


async def test_a_big_bodys_reading_and_what_it_wants_travel_to_the_worker_and_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Everything that crosses to the worker process must pickle, in a compiled build too: one
    # that does not breaks the worker, and every big body is read on the loop from then on.
    reading = Reading(4, True, False, Wants(budget=4096, default_output=64, expect=True))
    body = big(n_cmpl=2, max_tokens=32)
    read, expected = await take_off_loop(CHAT, body, reading), take(CHAT, body, reading)
    assert read.estimate is not None
    assert expected.estimate is not None
    assert (read.demand, read.body, read.estimate.reserve, read.expected_hold_s) == (
        expected.demand,
        expected.body,
        expected.estimate.reserve,
        expected.expected_hold_s,
    )
    assert not intake._broken
    assert "worker process" not in caplog.text


async def test_a_big_body_refused_in_the_worker_is_refused_with_its_message_and_param() -> None:
    with pytest.raises(BadRequest, match="at most 2") as caught:
        await take_off_loop(CHAT, big(n_cmpl=3), Reading(2, True))
    assert caught.value.param == "n_cmpl"
    with pytest.raises(BadRequest, match="not valid JSON"):
        await take_off_loop(CHAT, big()[:-1], Reading(2, True))


@pytest.mark.interpreted
async def test_without_a_working_worker_big_bodies_are_read_on_the_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_pool() -> None:
        raise OSError("no /dev/shm")

    monkeypatch.setattr(intake, "_pool", no_pool)
    monkeypatch.setattr(intake, "_broken", False)
    body = big(n_cmpl=2)
    assert await take_off_loop(CHAT, body, Reading(4, True)) == take(CHAT, body, Reading(4, True))
    assert "cannot parse big bodies in a worker process" in caplog.text
    assert intake._broken is True  # and it is not tried again for every body


class _Counted(list[Any]):
    """A list that counts how many of its items were looked at."""

    looked = 0

    def __iter__(self) -> Any:
        for item in super().__iter__():
            _Counted.looked += 1
            yield item


def test_the_affinity_key_looks_at_a_bounded_part_of_any_prompt() -> None:
    # Messages or parts with no text give no prefix: however many, a few hundred are read.
    payloads: list[dict[str, object]] = [
        {"messages": _Counted([{}] * 100_000)},
        {"messages": [{"role": "user", "content": _Counted([{"type": "image"}] * 100_000)}]},
        {"input": _Counted([{"role": 7}] * 100_000)},
    ]
    for payload in payloads:
        _Counted.looked = 0
        intake.affinity_of(payload)
        assert _Counted.looked <= 1024
    # Nor is anything but a token id or a piece of text in a prompt of token ids made a string.
    nested = [list(range(10_000))] * 3
    assert intake.affinity_of({"prompt": [[1, nested]]}) == intake.affinity_of(
        {"prompt": [[1, {}]]}
    )


def test_the_affinity_key_is_the_prompt_cache_key_else_the_prompts_start() -> None:
    system = {"role": "system", "content": "You are terse. " * 50}
    turn = [system, {"role": "user", "content": "hello"}]
    later = [*turn, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    assert intake.affinity_of({"messages": turn}) == intake.affinity_of({"messages": later})
    assert intake.affinity_of({"messages": turn}) != intake.affinity_of({"prompt": "hello"})
    keyed = intake.affinity_of({"messages": turn, "prompt_cache_key": "user-1"})
    assert keyed == intake.affinity_of({"prompt": "x", "prompt_cache_key": "user-1"})
    # A key that is not a string is no key; a role that is not a string is no text.
    assert intake.affinity_of({"messages": turn, "prompt_cache_key": 5}) == intake.affinity_of(
        {"messages": turn}
    )
    odd = [{"role": ["user"] * 1000, "content": "hello"}]
    assert intake.affinity_of({"messages": odd}) == intake.affinity_of(
        {"messages": [{"role": None, "content": "hello"}]}
    )
    assert intake.affinity_of({"messages": []}) is None


def test_a_chats_conversation_key_is_its_start_through_the_first_user_message() -> None:
    system = {"role": "system", "content": "You are the support desk of Northwind. " * 20}
    one = [system, {"role": "user", "content": "My order 1 is late"}]
    two = [system, {"role": "user", "content": "My order 2 is late"}]
    turn = [*one, {"role": "assistant", "content": "Sorry"}, {"role": "user", "content": "?"}]
    key = intake.conversation_of({"messages": one})
    assert key is not None
    # Every turn of one conversation has one key; another conversation under the same system
    # prompt (the same affinity key) has its own.
    assert intake.conversation_of({"messages": turn}) == key
    assert intake.conversation_of({"messages": two}) != key
    assert intake.affinity_of({"messages": one}) == intake.affinity_of({"messages": two})
    # The client's own prompt_cache_key says it all; a raw prompt has no conversation.
    assert intake.conversation_of({"messages": one, "prompt_cache_key": "u1"}) is None
    assert intake.conversation_of({"prompt": "hello"}) is None
    assert intake.conversation_of({"messages": []}) is None


def test_the_conversation_key_reads_a_bounded_part_of_any_chat() -> None:
    endless = [{"role": "system", "content": ""}] * 100_000
    assert intake.conversation_of({"messages": endless}) == intake.conversation_of(
        {"messages": endless[: intake.CONVERSATION_CHARS]}
    )
    huge = [{"role": "user", "content": "x" * 10_000_000}]
    assert intake.conversation_of({"messages": huge}) == intake.conversation_of(
        {"messages": [{"role": "user", "content": "x" * intake.CONVERSATION_CHARS}]}
    )
