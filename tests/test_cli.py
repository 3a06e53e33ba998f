"""The `slotgate` command as a process: start-up errors, help, and a drained stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from slotgate.settings import Settings

from bench.procs import free_port
from tests.conftest import chat
from tests.standin import StandIn


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slotgate", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_misconfiguration_stops_start_up_with_one_line_naming_the_variable() -> None:
    result = run({"QUEUE_PER_SLOT": "-3"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "slotgate: invalid QUEUE_PER_SLOT=-3: Input should be greater than or equal to 0"
    ]


def test_a_dotenv_that_is_not_utf8_stops_start_up_with_one_line(tmp_path: Path) -> None:
    (tmp_path / ".env").write_bytes(b"MAX_QUEUE=\xff\xfe\n")
    result = subprocess.run(
        [sys.executable, "-m", "slotgate"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("slotgate: invalid .env: not UTF-8")


def test_help_lists_every_variable() -> None:
    result = run({}, "--help")
    assert result.returncode == 0
    for name in Settings.model_fields:
        assert name.upper() in result.stdout


class Process:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url


@pytest.fixture
async def slotgate(standin: StandIn, request: pytest.FixtureRequest) -> AsyncIterator[Process]:
    port = free_port()
    env = {
        **os.environ, "PORT": str(port), "LLAMA_SERVER_URL": standin.url,
        "PROPS_REFRESH_INTERVAL": "0.2", "DRAIN_TIMEOUT": "1", "LOG_LEVEL": "warning",
        **getattr(request, "param", {}),
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "slotgate", env=env, stderr=asyncio.subprocess.PIPE
    )
    process = Process(proc, f"http://127.0.0.1:{port}")
    try:
        async with httpx.AsyncClient() as client, asyncio.timeout(20):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(process.url + "/readyz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
        yield process
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_lets_running_streams_finish_then_exits_zero(
    slotgate: Process, standin: StandIn
) -> None:
    standin.tokens, standin.token_delay_s = 6, 0.05  # 0.3 s, within DRAIN_TIMEOUT=1
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", slotgate.url + "/v1/chat/completions", json=chat(stream=True)) as r,
    ):
        chunks = r.aiter_raw()
        body = await anext(chunks)
        slotgate.proc.send_signal(signal.SIGTERM)
        body += b"".join([c async for c in chunks])
    assert body.endswith(b"data: [DONE]\n\n")
    async with asyncio.timeout(10):
        assert await slotgate.proc.wait() == 0


@pytest.mark.parametrize(
    "slotgate", [{}, {"ADMISSION_CONTROL": "false"}], ids=["gated", "ungated"], indirect=True
)
async def test_streams_still_running_at_the_drain_timeout_are_cut_with_an_error(
    slotgate: Process, standin: StandIn
) -> None:
    standin.tokens, standin.token_delay_s = 200, 0.05  # 10 s, past DRAIN_TIMEOUT=1
    async with (
        httpx.AsyncClient(timeout=20) as client,
        client.stream("POST", slotgate.url + "/v1/chat/completions", json=chat(stream=True)) as r,
    ):
        chunks = r.aiter_raw()
        body = await anext(chunks)
        plain = asyncio.create_task(client.post(slotgate.url + "/v1/chat/completions", json=chat()))
        await asyncio.sleep(0.3)
        slotgate.proc.send_signal(signal.SIGTERM)
        # The connection may close right after the error event.
        with contextlib.suppress(httpx.RemoteProtocolError):
            body += b"".join([c async for c in chunks])
        cut = await plain
    assert b"[DONE]" not in body
    assert b"shutting_down" in body
    assert cut.status_code == 503
    assert cut.json()["error"]["code"] == "shutting_down"
    async with asyncio.timeout(10):
        assert await slotgate.proc.wait() == 0
    assert slotgate.proc.stderr is not None
    logged = (await slotgate.proc.stderr.read()).decode()
    assert "Traceback" not in logged  # a cut request is an answer, not an error of slotgate's
    await asyncio.sleep(0.2)
    assert standin.running == 0  # the upstream requests were closed, not left running
