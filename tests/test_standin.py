"""The stand-in llama-server itself: what the tests that use it rely on."""

from __future__ import annotations

import asyncio

from tests.standin import StandIn

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


async def fate_of_a_connection_made_as_it_stops(turns: int) -> str:
    """Connect, stop the stand-in `turns` loop turns later, start it again on its port, then
    send a request down the connection: what becomes of it."""
    standin = StandIn(shutdown_timeout_s=0.05)
    await standin.start()

    async def client() -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", standin.port)
        except OSError:
            return "refused"
        await asyncio.sleep(0.2)  # the stand-in has stopped and started again meanwhile
        try:
            writer.write(REQUEST)
            async with asyncio.timeout(2):
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
