"""The stand-in llama-server itself: what the tests that use it rely on."""

from __future__ import annotations

import asyncio
import json
import time

from tests.support.standin import BENCH, StandIn

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


async def fate_of_a_connection_made_as_it_stops(turns: int) -> str:
    """Connect, stop the stand-in `turns` loop turns later, start it again on its port, then
    send a request down the connection: what becomes of it."""
    standin = StandIn(shutdown_timeout_s=0.05)
    await standin.start()
    restarted = asyncio.Event()

    async def client() -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", standin.port)
        except OSError:
            return "refused"
        await restarted.wait()  # the stand-in has stopped and started again meanwhile
        try:
            writer.write(REQUEST)
            async with asyncio.timeout(5):
                answer = await reader.read(100)
        except TimeoutError:
            return "left hanging"
        except OSError:
            return "reset"
        finally:
            writer.close()
        return "answered" if answer else "closed"

    fate = asyncio.create_task(client())
    for _ in range(turns):
        await asyncio.sleep(0)
    await standin.stop()
    await asyncio.sleep(0.05)
    await standin.start()
    restarted.set()
    try:
        return await fate
    finally:
        await standin.stop()


async def test_a_connection_accepted_as_the_standin_stops_is_closed_not_left_hanging() -> None:
    # A connection asyncio accepts just as its server closes never gets a transport (3.11's
    # Server._attach refuses it) and stays open, unread, until the garbage collector finds it:
    # a request sent down it (a warm spare slotgate opened) waited for an answer forever.
    fates = [await fate_of_a_connection_made_as_it_stops(turns % 6) for turns in range(30)]
    assert "left hanging" not in fates, fates


async def get(port: int, target: str, body: bytes | None = None) -> bytes:
    """One request on its own connection; the whole answer, head and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    method = "GET" if body is None else "POST"
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    return answer


async def test_eight_standins_with_their_own_slots_and_paces_run_side_by_side_in_one_loop() -> None:
    standins = [StandIn(total_slots=n + 1, tokens=3, token_delay_s=0.01 * n) for n in range(8)]
    await asyncio.gather(*(standin.start() for standin in standins))
    try:
        stream = b'{"messages": [], "stream": true}'
        answers = await asyncio.gather(
            *(get(s.port, "/v1/chat/completions", stream) for s in standins)
        )
        props = await asyncio.gather(*(get(s.port, "/props") for s in standins))
    finally:
        await asyncio.gather(*(standin.stop() for standin in standins))
    assert len({standin.port for standin in standins}) == 8
    for n, (answer, prop) in enumerate(zip(answers, props, strict=True)):
        assert f'"total_slots": {n + 1}'.encode() in prop
        assert answer.count(b'"content": "t') == 3
        assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert [standin.finished for standin in standins] == [1] * 8


async def test_the_benchmark_configures_it_over_http_and_reads_stamped_tokens() -> None:
    from bench.loadgen import TOKEN_STAMP  # the bench's own parser of a token's clock

    standin = StandIn(**BENCH)
    await standin.start()
    try:
        config = b'{"slots": 3, "tokens": 4, "token_delay_s": 0, "record_gaps": true}'
        assert b'{"ok": true}' in await get(standin.port, "/_bench/config", config)
        assert b'"total_slots": 3' in await get(standin.port, "/props")
        before = time.monotonic_ns()
        answer = await get(standin.port, "/v1/chat/completions", b'{"stream": true}')
        stats = json.loads((await get(standin.port, "/_bench/stats")).split(b"\r\n\r\n")[1])
        refused = await get(standin.port, "/_bench/config", b'{"no_such_knob": 1}')
    finally:
        await standin.stop()
    stamps = [int(stamp) for stamp in TOKEN_STAMP.findall(answer)]
    assert len(stamps) == 4
    assert all(before <= stamp <= time.monotonic_ns() for stamp in stamps)
    assert (stats["started"], stats["finished"], stats["running"]) == (1, 1, 0)
    assert standin.seen == []  # the bench's stand-in keeps no record of what it served
    assert refused.startswith(b"HTTP/1.1 400 ")
