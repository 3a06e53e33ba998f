"""The `slotgate` command as a process: start-up errors, help, and a drained stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import httpx
import pytest
import uvicorn
from aiohttp import web
from slotgate import __version__, cli
from slotgate.cli import listen
from slotgate.settings import Settings

from bench.procs import free_port
from tests.conftest import chat, needs_engine, serve
from tests.support.standin import StandIn

if TYPE_CHECKING:
    from slotgate.engine.engines import Engines
    from slotgate.main import Service

APP = Path(__file__).resolve().parent.parent / "app"


def run(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slotgate", *args], cwd=cwd,
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


def variables_read() -> set[str]:
    """Every environment variable slotgate reads: its settings, and those its code looks up."""
    looked_up = set()
    for module in APP.rglob("*.py"):
        found = re.findall(
            r"""(?:environ\.get\(|environ\[|getenv\()["'](\w+)["']""", module.read_text()
        )
        looked_up.update(found)
    assert {"LLAMA_SERVER_BIN", "SLOTGATE_CACHE_DIR"} <= looked_up  # the scan sees them
    return looked_up | {name.upper() for name in Settings.model_fields}


def test_help_and_env_example_list_every_variable_slotgate_reads() -> None:
    result = run({}, "--help")
    example = (APP.parent / ".env.example").read_text()
    assert result.returncode == 0
    for name in variables_read():
        assert name in result.stdout, name
        assert name in example, name


def test_version_is_printed() -> None:
    result = run({}, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"slotgate {__version__}"


@pytest.mark.parametrize("flag", ["--parallel", "--ctx-size", "--threads", "--replicas", "--gpus"])
def test_engine_flags_without_a_local_engine_are_refused(flag: str) -> None:
    result = run({}, flag, "4")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"slotgate: error: {flag} needs --model or --demo: it applies to a local engine only; "
        "see slotgate --help"
    ]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--port", "99999"], "argument --port: '99999' is not a port from 0 to 65535"),
        (
            ["--demo", "--model", "x.gguf"],
            "--model and --demo exclude each other; give one of them",
        ),
        (["--model="], "argument --model: is empty; give the path of a .gguf model"),
        (["--host="], "argument --host: is empty; give an address such as 127.0.0.1 or ::1"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--demo", "--replicas", "0"], "argument --replicas: '0' must be at least 1"),
        (
            ["--demo", "--gpus", "0,1", "--replicas", "3"],
            "--gpus names 2 GPUs for --replicas 3; give one GPU per replica",
        ),
        (
            ["--demo", "--gpus", "0,,1"],
            "argument --gpus: '0,,1' lacks a GPU; give one per replica, comma-separated, "
            "such as 0,1",
        ),
    ],
    ids=[
        "port",
        "model-and-demo",
        "empty-model",
        "empty-host",
        "unknown",
        "no-replicas",
        "gpus-and-replicas",
        "empty-gpu",
    ],
)
def test_a_bad_flag_stops_start_up_with_one_line_naming_it(args: list[str], line: str) -> None:
    result = run({}, *args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"slotgate: error: {line}; see slotgate --help"]


@pytest.mark.parametrize(
    ("content", "said"),
    [(b"", "no such file"), (b"not a model", "is not a GGUF file")],
    ids=["missing", "not-gguf"],
)
@needs_engine
def test_a_model_slotgate_cannot_use_stops_start_up_with_one_line_and_status_2(
    tmp_path: Path, content: bytes, said: str
) -> None:
    model = tmp_path / "model.gguf"
    if content:
        model.write_bytes(content)
    result = run({"PORT": "0"}, "--model", str(model), cwd=tmp_path)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"slotgate: --model {model}")
    assert said in line


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_busy_port_stops_start_up_with_one_line_naming_port(busy_port: int) -> None:
    result = run({"PORT": str(busy_port)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"slotgate: cannot listen on 127.0.0.1:{busy_port} (PORT={busy_port}): "
        "address already in use"
    ]


def test_a_host_that_is_no_address_stops_start_up_with_one_line_naming_host() -> None:
    result = run({"HOST": "999.1.1.1", "PORT": str(free_port())})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("slotgate: cannot listen on 999.1.1.1:")
    assert "(HOST=999.1.1.1)" in line


def test_host_and_port_flags_override_the_environment_and_are_named(busy_port: int) -> None:
    result = run({"HOST": "999.1.1.1", "PORT": str(free_port())},
                 "--host", "127.0.0.1", "--port", str(busy_port))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"slotgate: cannot listen on 127.0.0.1:{busy_port} (--port={busy_port}): "
        "address already in use"
    ]


def test_the_demo_on_a_busy_port_fails_before_it_touches_its_model(
    busy_port: int, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    result = run({"PORT": str(busy_port), "SLOTGATE_CACHE_DIR": str(cache)}, "--demo")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"slotgate: cannot listen on 127.0.0.1:{busy_port} (PORT={busy_port}): "
        "address already in use"
    ]
    assert not cache.exists()  # the model was not even assembled


@pytest.mark.parametrize(
    ("dotenv", "warning"),
    [
        (
            "QUEUES_PER_SLOTS=4\nLLAMA_ARG_API_KEY=k\nCOMPOSE_FILE=x\n",
            ".env sets QUEUES_PER_SLOTS, which slotgate does not read; "
            "did you mean QUEUE_PER_SLOT?",
        ),
        (
            "DRAIN_TIMEOUT=4\n",
            "DRAIN_TIMEOUT (in .env) is deprecated: rename it DRAIN_TIMEOUT_S "
            "(read as DRAIN_TIMEOUT_S meanwhile)",
        ),
    ],
    ids=["misspelt", "renamed"],
)
def test_a_misspelt_or_renamed_dotenv_key_is_warned_about_naming_the_right_one(
    busy_port: int, tmp_path: Path, dotenv: str, warning: str
) -> None:
    (tmp_path / ".env").write_text(dotenv)
    result = run({"PORT": str(busy_port)}, cwd=tmp_path)  # stops right after the warnings
    warnings = [line for line in result.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1
    assert warnings[0].endswith(warning)


def test_the_engine_s_variables_are_read_from_dotenv_too(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("LLAMA_SERVER_BIN=/nowhere/llama-server\n")
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_BIN"}
    result = subprocess.run(
        [sys.executable, "-m", "slotgate", "--demo"], cwd=tmp_path,
        env={**env, "PORT": str(free_port())}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("slotgate: LLAMA_SERVER_BIN=/nowhere/llama-server is not an executable file")
    )


async def test_a_props_404_names_the_url_tried_and_the_v1_mistake() -> None:
    async def not_found(request: web.Request) -> web.Response:
        body = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
        return web.json_response(body, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}/v1"
    gate = await serve(Settings(_env_file=None, llama_server_url=url, log_level="error"))
    try:
        await gate.until(lambda: "404" in gate.service.upstream.reason)
        reason = gate.service.upstream.reason
    finally:
        await gate.stop()
        await runner.cleanup()
    assert f"GET {url}/props" in reason
    assert "without /v1" in reason


class Process:
    def __init__(self, proc: asyncio.subprocess.Process, url: str, standin: StandIn) -> None:
        self.proc = proc
        self.url = url
        self.standin = standin

    @contextlib.asynccontextmanager
    async def streaming(
        self, client: httpx.AsyncClient, tokens: int
    ) -> AsyncIterator[tuple[AsyncIterator[bytes], bytes]]:
        """A streamed chat of `tokens` tokens 0.05 s apart under way: the rest of its chunks,
        and its first one."""
        self.standin.tokens, self.standin.token_delay_s = tokens, 0.05
        completions = self.url + "/v1/chat/completions"
        async with client.stream("POST", completions, json=chat(stream=True)) as r:
            chunks = r.aiter_raw()
            yield chunks, await anext(chunks)


@pytest.fixture
async def slotgate(standin: StandIn, request: pytest.FixtureRequest) -> AsyncIterator[Process]:
    port = free_port()
    env = {
        **os.environ, "PORT": str(port), "LLAMA_SERVER_URL": standin.url,
        "PROPS_REFRESH_INTERVAL_S": "0.2", "DRAIN_TIMEOUT_S": "1", "LOG_LEVEL": "warning",
        **getattr(request, "param", {}),
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "slotgate", env=env, stderr=asyncio.subprocess.PIPE
    )
    process = Process(proc, f"http://127.0.0.1:{port}", standin)
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


# A drain long enough for a 0.3 s stream however loaded the machine: it ends when they do.
@pytest.mark.parametrize("slotgate", [{"DRAIN_TIMEOUT_S": "10"}], indirect=True)
async def test_sigterm_lets_running_streams_finish_then_exits_zero(slotgate: Process) -> None:
    async with (
        httpx.AsyncClient(timeout=10) as client,
        slotgate.streaming(client, 6) as (chunks, body),  # 0.3 s, within DRAIN_TIMEOUT_S
    ):
        slotgate.proc.send_signal(signal.SIGTERM)
        body += b"".join([c async for c in chunks])
    assert body.endswith(b"data: [DONE]\n\n")
    async with asyncio.timeout(10):
        assert await slotgate.proc.wait() == 0


@pytest.mark.parametrize("slotgate", [{"DRAIN_TIMEOUT_S": "600"}], indirect=True)
async def test_sigterm_ends_every_admission_event_stream_at_once(slotgate: Process) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=30)) as client:
        streams = [client.stream("GET", slotgate.url + "/admission/events") for _ in range(3)]
        opened = [await stream.__aenter__() for stream in streams]
        assert all(answer.status_code == 200 for answer in opened)
        slotgate.proc.send_signal(signal.SIGTERM)
        # Each ends (rather than holding the drain for its 600 s), and slotgate exits.
        async with asyncio.timeout(30):
            for answer, stream in zip(opened, streams, strict=True):
                assert b"data: " in b"".join([chunk async for chunk in answer.aiter_raw()])
                await stream.__aexit__(None, None, None)
            assert await slotgate.proc.wait() == 0


@pytest.mark.parametrize(
    "slotgate", [{}, {"ADMISSION_CONTROL": "false"}], ids=["gated", "ungated"], indirect=True
)
async def test_streams_still_running_at_the_drain_timeout_are_cut_with_an_error(
    slotgate: Process,
) -> None:
    async with (
        httpx.AsyncClient(timeout=20) as client,
        slotgate.streaming(client, 200) as (chunks, body),  # 10 s, past DRAIN_TIMEOUT_S=1
    ):
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
    assert slotgate.standin.running == 0  # the upstream requests were closed, not left running


@pytest.mark.parametrize("slotgate", [{"DRAIN_TIMEOUT_S": "10"}], indirect=True)
async def test_after_sigterm_readyz_stops_saying_ready_and_new_connections_are_refused(
    slotgate: Process,
) -> None:
    seen: list[int] = []
    limits = httpx.Limits(max_keepalive_connections=0)  # each probe a new connection
    async with (
        httpx.AsyncClient(timeout=10) as client,
        httpx.AsyncClient(timeout=5, limits=limits) as probe,
        slotgate.streaming(client, 6) as (chunks, body),  # 0.3 s, well within DRAIN_TIMEOUT_S
    ):
        slotgate.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(5):
            while True:
                try:
                    seen.append((await probe.get(slotgate.url + "/readyz")).status_code)
                # Refused; or taken into the kernel's backlog just before the listener
                # closed, then dropped unanswered (a FIN, or a reset): the race of every
                # closing listener.
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    break
                await asyncio.sleep(0.01)
        body += b"".join([c async for c in chunks])
    # A probe may land before the signal does; once one has not been told "ready", none is.
    after_drain_began = seen[seen.index(503) :] if 503 in seen else []
    assert 200 not in after_drain_began
    assert body.endswith(b"data: [DONE]\n\n")  # the running stream was still let finish


def answered(url: str, timeout_s: float = 20) -> int:
    """The status `url` answers with, once something listens there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url).status_code
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_the_start_up_line_gives_an_ipv6_address_as_a_url_that_answers(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "HOST": "::1", "PORT": str(port), "LLAMA_SERVER_URL": "http://127.0.0.1:9"}
    with subprocess.Popen(
        [sys.executable, "-m", "slotgate"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.rstrip().endswith(
                f"slotgate fronting http://127.0.0.1:9 on http://[::1]:{port}"
            )
            url = line.rsplit(" ", 1)[1].strip()
            assert answered(url + "/healthz") == 200
        finally:
            proc.kill()


def fake_engine_env(tmp_path: Path, mode: str) -> tuple[Path, Path, dict[str, str]]:
    """A model file, where the fake llama-server records its call, and the environment that
    makes slotgate --model run that fake (tests/engine/test_engine.py's) on it."""
    from tests.support.fake_engine import FAKE_SERVER

    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    server = tmp_path / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    record = tmp_path / "record.json"
    env = {**os.environ, "LLAMA_SERVER_BIN": str(server), "FAKE_RECORD": str(record),
           "FAKE_MODE": mode, "PORT": "0"}  # fmt: skip
    return model, record, env


def two_fake_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engines:
    """Two engines of one slot each on the fake llama-server, not started yet."""
    from slotgate.engine.engines import Engines

    model, _, env = fake_engine_env(tmp_path, "serve")
    for name in ("LLAMA_SERVER_BIN", "FAKE_RECORD"):
        monkeypatch.setenv(name, env[name])
    return Engines.from_args(model=str(model), demo=False, parallel=1, ctx_size=64,
                             threads=1, replicas=2)  # fmt: skip


@contextlib.contextmanager
def on_fake_engine(
    tmp_path: Path, mode: str, **popen: Any
) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`slotgate --model` on the fake llama-server in `mode` (see fake_engine_env), killed
    however the test ends; the process, and where the fake records its call."""
    model, record, env = fake_engine_env(tmp_path, mode)
    with subprocess.Popen(
        [sys.executable, "-m", "slotgate", "--model", str(model)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        **popen,
    ) as proc:  # fmt: skip
        try:
            yield proc, record
        finally:
            proc.kill()


def test_ctrl_c_while_the_engine_loads_stops_it_with_one_line_and_no_traceback(
    tmp_path: Path,
) -> None:
    from tests.support.fake_engine import wait_gone

    # A runner started in the background by a shell without job control ignores SIGINT,
    # and so would slotgate, which inherits that: the test is of Ctrl-C at a terminal.
    terminal = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
    with on_fake_engine(tmp_path, "mute", **terminal) as (proc, record):
        while not record.exists() or not record.read_text().endswith("}"):
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "slotgate: interrupted while starting; stopped"
    wait_gone(json.loads(record.read_text())["pid"])  # llama-server was stopped too


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_port_0_on_a_name_with_two_addresses_listens_on_one_port_for_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    both = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0)),
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
    sockets = listen("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
    finally:
        for sock in sockets:
            sock.close()
    assert len(sockets) == 2
    assert len(ports) == 1


def test_an_engine_that_dies_under_slotgate_stops_it_with_status_1_and_its_last_lines(
    tmp_path: Path,
) -> None:
    with on_fake_engine(tmp_path, "serve") as (proc, record):
        assert proc.stderr is not None
        for line in proc.stderr:
            if "llama.cpp is ready" in line:
                break
        server = json.loads(record.read_text())["pid"]
        # The engine is the fake llama-server's parent: the child slotgate started.
        engine = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(engine, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "the local llama.cpp engine was killed by SIGKILL; slotgate stops" in stderr
    assert "llama.cpp ended; its last lines before that:" in stderr
    assert "Traceback" not in stderr


def test_the_documented_commands_install_into_a_venv_and_run_slotgate_from_it() -> None:
    pages = [APP.parent / "README.md", *sorted((APP.parent / "docs").glob("*.md"))]
    commands = [
        command.strip()
        for page in pages
        for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.DOTALL)
        for line in block.splitlines()
        for command in line.split("#")[0].split("&&")
        if command.strip()
    ]
    assert commands
    for command in commands:
        program = next(word for word in command.split() if "=" not in word)
        # A bare pip meets an externally managed Python on many distributions; a bare
        # slotgate is not on PATH after an install into .venv.
        assert program not in ("pip", "pip3", "slotgate"), command


def test_a_dotenv_that_cannot_be_read_stops_start_up_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Unreadable(Settings):
        def __init__(self, **given: Any) -> None:
            raise PermissionError(13, "Permission denied", ".env")

    monkeypatch.setattr(cli, "Settings", Unreadable)
    assert cli.main([]) == 2
    assert capsys.readouterr().err.splitlines() == ["slotgate: cannot read .env: Permission denied"]


def test_a_llama_server_url_beside_a_local_engine_is_said_to_be_ignored(tmp_path: Path) -> None:
    model, _, env = fake_engine_env(tmp_path, "fail")
    env["LLAMA_SERVER_URL"] = "http://127.0.0.1:8080"
    result = subprocess.run(
        [sys.executable, "-m", "slotgate", "--model", str(model)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1  # the fake engine fails to load, after the warning
    warnings = [line for line in result.stderr.splitlines() if " WARNING slotgate " in line]
    assert [line.split(" slotgate ", 1)[1] for line in warnings] == [
        "LLAMA_SERVER_URL=http://127.0.0.1:8080 is ignored: --model/--demo front their own engine"
    ]


def test_engine_log_all_shows_every_engine_line_whatever_log_level_says(tmp_path: Path) -> None:
    model, _, env = fake_engine_env(tmp_path, "fail")
    env["LOG_LEVEL"] = "warning"
    result = subprocess.run(
        [sys.executable, "-m", "slotgate", "--model", str(model), "--engine-log", "all"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert " INFO slotgate.engine load_model: loading model" in result.stderr
    assert " INFO slotgate " not in result.stderr  # slotgate's own information stays out


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_host_all_ipv6_interfaces_takes_ipv4_clients_too_as_with_uvicorn() -> None:
    sockets = listen("::", 0)
    try:
        port = sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


def test_gpus_alone_start_one_replica_for_each() -> None:
    args = cli.parse_args(["--demo", "--gpus", "1,0"])
    assert (args.replicas, args.gpus) == (2, ("1", "0"))
    assert cli.parse_args(["--demo"]).replicas == 1


def test_replicas_put_every_engine_behind_the_gate_and_all_stop_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from tests.support.fake_engine import health, running

    model, _, env = fake_engine_env(tmp_path, "serve")
    for name in ("LLAMA_SERVER_BIN", "FAKE_RECORD", "FAKE_MODE", "PORT"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv("LLAMA_SERVER_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    seen: list[tuple[Settings, Engines, list[int]]] = []

    def serve(settings: Settings, local: Engines, sockets: object) -> int:
        seen.append((settings, local, [health(url) for url in local.urls]))
        return 0

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli, "_print_usage", lambda settings, port: None)

    assert cli.main(["--model", str(model), "--replicas", "3", "--threads", "1"]) == 0

    [(settings, local, statuses)] = seen
    assert settings.llama_server_url == ",".join(local.urls)
    assert len(set(local.urls)) == 3
    assert statuses == [200, 200, 200]
    assert settings.kv_budget_tokens == 0  # each engine's, as with one
    pids = [engine.pid for engine in local]
    assert None not in pids
    assert not [pid for pid in pids if pid is not None and running(pid)]


@pytest.mark.parametrize("together", [False, True], ids=["apart", "at-once"])
def test_a_replica_that_dies_leaves_slotgate_serving_until_the_last_one_goes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    together: bool,
) -> None:
    from slotgate.engine.process import LocalEngine

    local = two_fake_replicas(tmp_path, monkeypatch)
    # A gate without upstreams: what it tells them is another test's.
    gate = cast("Service", SimpleNamespace(fleet=SimpleNamespace(upstreams=[])))
    server = cli.Server(uvicorn.Config(lambda: None), gate, local)

    def die(*engines: LocalEngine) -> list[str]:
        """Kill the engines, then let slotgate look once they have all ended."""
        for engine in engines:
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(engine.poll() is None for engine in engines):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        caplog.clear()
        server._watch(local)
        return [r.getMessage() for r in caplog.records]

    try:
        local.start()
        with caplog.at_level(logging.ERROR, logger="slotgate"):
            if together:
                said = die(*local)
            else:
                said = die(local[0])
                assert not server.should_exit
                said += die(local[1])
    finally:
        local.stop()
    assert said == [
        f"local llama.cpp engine 1 of 2 at {local.urls[0]} was killed by SIGKILL; "
        "slotgate serves on the other 1",
        f"local llama.cpp engine 2 of 2 at {local.urls[1]} was killed by SIGKILL, the last "
        "one; slotgate stops",
    ]
    assert server.should_exit
    assert server.engine_died


def test_with_replicas_a_dead_engine_leaves_the_gate_ready_on_the_other_and_the_last_stops_it(
    tmp_path: Path,
) -> None:
    model, _, env = fake_engine_env(tmp_path, "serve")
    port = free_port()
    env.update(PORT=str(port), PROPS_REFRESH_INTERVAL_S="0.2", LOG_LEVEL="warning")
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "slotgate.log"

    def ready_upstreams() -> list[bool]:
        pool = httpx.get(base + "/admission").json()
        return [upstream["ready"] for upstream in pool["upstreams"]]

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)

    with log.open("w") as stderr, subprocess.Popen(
        [sys.executable, "-m", "slotgate", "--model", str(model), "--replicas", "2",
         "--threads", "1"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
    ) as proc:  # fmt: skip
        try:
            until(lambda: answered(base + "/readyz") == 200 and ready_upstreams() == [True, True])
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            engines = [int(pid) for pid in children]
            assert len(engines) == 2
            os.kill(engines[0], signal.SIGKILL)
            until(lambda: sorted(ready_upstreams()) == [False, True])
            until(lambda: "slotgate serves on the other 1" in log.read_text())
            assert answered(base + "/readyz") == 200
            assert proc.poll() is None
            os.kill(engines[1], signal.SIGKILL)
            assert proc.wait(timeout=30) == 1
        finally:
            proc.kill()
    logged = log.read_text()
    first = re.search(r"local llama.cpp engine (\d) of 2 at \S+ was killed by SIGKILL; "
                      r"slotgate serves on the other 1", logged)  # fmt: skip
    last = re.search(r"local llama.cpp engine (\d) of 2 at \S+ was killed by SIGKILL, "
                     r"the last one; slotgate stops", logged)  # fmt: skip
    assert first is not None, logged
    assert last is not None, logged
    assert {first[1], last[1]} == {"1", "2"}
    assert "Traceback" not in logged


async def test_sighup_without_api_keys_file_is_logged_and_leaves_slotgate_serving(
    slotgate: Process,
) -> None:
    assert slotgate.proc.stderr is not None
    said: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:
        # One signal at a time, each seen handled before the next: two signals sent at once
        # may be delivered as one.
        for _ in range(2):
            slotgate.proc.send_signal(signal.SIGHUP)
            async with asyncio.timeout(30):
                while not said or "nothing to reload" not in said[-1]:
                    said.append((await slotgate.proc.stderr.readline()).decode())
            answer = await client.post(slotgate.url + "/v1/chat/completions", json=chat())
            assert answer.status_code == 200
    assert slotgate.proc.returncode is None
    assert "API_KEYS_FILE" in said[-1]
    slotgate.proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        assert await slotgate.proc.wait() == 0
    logged = "".join(said) + (await slotgate.proc.stderr.read()).decode()
    assert logged.count("nothing to reload") == 2, logged
    assert "Traceback" not in logged


async def test_a_second_ctrl_c_during_the_drain_exits_at_once_with_one_line(
    slotgate: Process,
) -> None:
    async with (
        httpx.AsyncClient(timeout=20) as client,
        slotgate.streaming(client, 400) as (chunks, _),  # 20 s, past any drain here
    ):
        slotgate.proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0.2)
        slotgate.proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(5):
            code = await slotgate.proc.wait()
        with contextlib.suppress(httpx.HTTPError):
            async for _ in chunks:
                pass
    assert slotgate.proc.stderr is not None
    logged = (await slotgate.proc.stderr.read()).decode()
    assert code == 0
    assert "Traceback" not in logged
    assert "ERROR" not in logged
    assert logged.count("second Ctrl-C") == 1, logged


def test_a_misspelt_setting_in_the_environment_stops_start_up_with_one_line(
    busy_port: int, tmp_path: Path
) -> None:
    # On a busy port: without the check, slotgate stops there, after its warnings.
    result = run({"MAXQUEUE": "2", "PORT": str(busy_port)}, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "slotgate: MAXQUEUE is set in the environment, but slotgate reads MAX_QUEUE: rename it "
        "(or unset it, if it is not meant for slotgate)"
    ]


async def test_a_managed_engine_that_dies_takes_its_slots_out_of_readiness_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    local = two_fake_replicas(tmp_path, monkeypatch)
    local.start()
    gate = None
    try:
        # No /props read for a minute: whatever changes readiness is the engine's death.
        settings = Settings(_env_file=None, llama_server_url=",".join(local.urls),
                            props_refresh_interval_s=60, log_level="error")  # fmt: skip
        gate = await serve(settings)
        await gate.until(lambda: gate is not None and gate.service.admission.capacity == 2)
        server = cli.Server(uvicorn.Config(lambda: None), gate.service, local)
        dead = local[0]
        assert dead.pid is not None
        os.kill(dead.pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            while dead.poll() is None:
                await asyncio.sleep(0.02)
        server._watch(local)
        assert gate.service.admission.capacity == 1
        (lost,) = [u for u in gate.service.fleet.upstreams if u.url == local.urls[0]]
        assert not lost.ready
        assert "killed by SIGKILL" in lost.reason
        async with httpx.AsyncClient() as client:
            ready = await client.get(gate.url + "/readyz")
        assert ready.json() == {"status": "ready", "capacity": 1}
    finally:
        if gate is not None:
            await gate.stop()
        local.stop()
