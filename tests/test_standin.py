"""The stand-in llama-server itself: what the tests that use it rely on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.support.router import Hosted
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


async def test_as_a_router_it_answers_as_llama_servers_router_does() -> None:
    alpha = Hosted(StandIn(total_slots=2), ["a"], "loaded")
    beta = Hosted(StandIn(total_slots=3), [], "unloaded")
    router = StandIn(hosted={"alpha": alpha, "beta": beta}, models_max=1, load_delay_s=0.01)
    await router.start()
    try:
        async with httpx.AsyncClient(base_url=router.url) as client:
            props = (await client.get("/props")).json()
            assert props["role"] == "router"
            assert props["max_instances"] == 1
            assert "total_slots" not in props
            listed = (await client.get("/models")).json()["data"]
            assert [(m["id"], m["status"]["value"]) for m in listed] == [
                ("alpha", "loaded"),
                ("beta", "unloaded"),
            ]
            assert (await client.get("/props?model=a")).json()["total_slots"] == 2
            missing = await client.get("/metrics")
            assert missing.status_code == 400
            assert missing.json()["error"]["message"] == "model name is missing from the request"
            unknown = await client.post("/v1/chat/completions", json={"model": "x"})
            assert unknown.status_code == 400
            assert unknown.json()["error"]["message"] == "model 'x' not found"
            off = await client.get("/props?model=beta&autoload=false")
            assert off.json()["error"]["message"] == "model is not loaded"
            # A request for beta loads it, evicting the idle alpha (models_max 1).
            served = await client.post("/v1/chat/completions", json={"model": "beta"})
            assert served.status_code == 200
            assert beta.child.finished == 1
            assert alpha.child.started == 0
            assert (alpha.state, beta.state) == ("unloaded", "loaded")
            assert router.routing is not None
            assert (router.routing.loads, router.routing.evictions) == (1, 1)
            # A load into a full router whose model is busy fails, as llama.cpp's does.
            beta.child.hold_s = 5.0
            held = asyncio.create_task(client.post("/v1/chat/completions", json={"model": "beta"}))
            while beta.child.running == 0:
                await asyncio.sleep(0.01)
            refused = await client.post("/models/load", json={"model": "alpha"})
            assert refused.status_code == 500
            router.hurry()  # the router's connections carry its children's answers
            assert (await held).status_code == 200
    finally:
        await router.stop()
