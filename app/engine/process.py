"""One local engine, from the parent's side: llama.cpp's server in a child process (child.py)
that slotgate starts, watches through its log and its exit, and stops with its process group.
Standard library only, as the whole of `engine/` is.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, NotRequired, TypedDict, Unpack

from slotgate.engine import child
from slotgate.engine.child import ENGINE_DISTRIBUTION, pip
from slotgate.engine.model import (
    DEMO_ALIAS,
    DEMO_CHAT_TEMPLATE,
    EngineFailed,
    EngineMisconfigured,
    resolve_model,
)

#: Loading a large model from a slow disk takes minutes; a hung start must still end.
START_TIMEOUT_S = 300.0
#: How long the engine may take to leave after SIGTERM before its whole group is killed.
STOP_GRACE_S = 10.0
#: How often a starting engine's /health is asked.
HEALTH_POLL_S = 0.1
# llama.cpp's log lines: an optional "0.02.655.775" timestamp, then one level letter.
_LOG_LINE = re.compile(r"^(?:\d+\.\d+\.\d+\.\d+ )?([DIWE]) (.*)$")
_LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}
#: What llama.cpp writes when it aborts, bypassing its logger: GGML_ABORT/GGML_ASSERT's
#: "file.cpp:123: message", or the C++ runtime's uncaught exception. The cause of the crash;
#: a debugger's backtrace usually follows, lines of no use to the reader.
_ABORT_LINE = re.compile(r"^\S+\.(?:c|cc|cpp|cu|h|hpp|m|mm):\d+: |^terminate called after")
#: Warnings that are true of llama-server in general but not of an engine on a private
#: loopback port behind slotgate; shown only with `--engine-log all`, as information.
_MOOT_WARNINGS = ("security: no API key is set",)
#: The demo model's own quirk, harmless and nothing its user can act on: llama.cpp calls it
#: "probably a bug in the model" at every start. Shown for a model of one's own.
_DEMO_MOOT_WARNINGS = ("control-looking token",)
#: How many hidden lines an engine that ended by itself leaves in slotgate's log.
_CRASH_LINES = 20


def find_binary() -> str | None:
    """The llama-server binary named by $LLAMA_SERVER_BIN, else one on PATH, else None."""
    named = os.environ.get("LLAMA_SERVER_BIN")
    if named:
        found = shutil.which(named)
        if found is None:
            raise EngineMisconfigured(
                f"LLAMA_SERVER_BIN={named} is not an executable file; point it at llama-server, "
                "or unset it to use xllamacpp"
            )
        return found
    return shutil.which("llama-server")


def default_threads(cores: int | None = None) -> int:
    """llama.cpp's CPU threads when --threads is not given: 1 on up to 2 cores, else cores - 1.

    llama.cpp shares the machine with slotgate and its clients. On 2 cores, 2 llama.cpp
    threads plus the proxy and a client oversubscribe it and decoding slows to a crawl, while
    1 thread keeps about 40 tokens/s; on bigger machines one core is left to the rest.
    """
    if cores is None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        cores = len(usable) if usable else os.cpu_count() or 1
    return 1 if cores <= 2 else cores - 1


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that nothing listens on right now: all are held at
    once while they are chosen, so that no two replicas are handed the same one."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                  for _ in range(count)]  # fmt: skip
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


class EngineFlags(TypedDict):
    """The command-line flags that shape a local engine: --model, --demo, --parallel,
    --ctx-size, --threads (None: `default_threads()`) and --engine-log all (`log_all`)."""

    model: str | None
    demo: bool
    parallel: int
    ctx_size: int
    threads: int | None
    log_all: NotRequired[bool]


class LocalEngine:
    """llama.cpp's server for slotgate alone: started, watched and stopped with slotgate.

    Call `start()` and `stop()` from one thread; `poll()` from any.
    """

    def __init__(
        self,
        model: Path,
        *,
        parallel: int = 2,
        ctx_size: int = 4096,
        threads: int | None = None,
        binary: str | None = None,
        chat_template: Path | None = None,
        alias: str | None = None,
        log_all: bool = False,
        kv_unified: bool = False,
        moot_warnings: tuple[str, ...] = _MOOT_WARNINGS,
        start_timeout_s: float = START_TIMEOUT_S,
        stop_grace_s: float = STOP_GRACE_S,
        logger: str = "slotgate.engine",
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.threads = threads or default_threads()
        self.binary = binary
        #: A Jinja chat template's file, or None for the model's own.
        self.chat_template = chat_template
        #: The model's id in llama-server's answers, or None for the model's path.
        self.alias = alias
        #: Forward every line of llama.cpp's log, not only its warnings and errors.
        self.log_all = log_all
        self.kv_unified = kv_unified
        #: Warnings shown as information: true of llama.cpp in general, not of this engine.
        self.moot_warnings = moot_warnings
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        #: The logger its lines and news go to: one per replica among several engines.
        self.log = logging.getLogger(logger)
        #: Variables set for this engine alone, over slotgate's environment (its GPU).
        self.env = dict(env or {})
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        #: Its last lines: level, text, and whether slotgate's log has shown them.
        self._tail: collections.deque[tuple[int, str, bool]] = collections.deque(maxlen=50)
        self._stopping = False
        self._deadline = 0.0

    @classmethod
    def from_args(cls, **flags: Unpack[EngineFlags]) -> LocalEngine:
        """The engine slotgate's --model/--demo/--parallel/--ctx-size/--threads ask for.

        A llama-server binary ($LLAMA_SERVER_BIN, else on PATH) is preferred; xllamacpp (the
        `local` extra) is the fallback. The engine is chosen before the model, so a machine
        with neither learns it before the demo model is written out. `threads=None` means
        `default_threads()`.
        """
        binary = find_binary()
        if binary is None and importlib.util.find_spec("xllamacpp") is None:
            raise EngineFailed(
                f"no llama.cpp engine: {pip(ENGINE_DISTRIBUTION)}, "
                "or put llama-server on PATH or name it in LLAMA_SERVER_BIN"
            )
        demo = flags["demo"]
        return cls(
            resolve_model(flags["model"], demo),
            parallel=flags["parallel"],
            ctx_size=flags["ctx_size"],
            threads=flags["threads"],
            binary=binary,
            chat_template=DEMO_CHAT_TEMPLATE if demo else None,
            alias=DEMO_ALIAS if demo else None,
            log_all=flags.get("log_all", False),
            moot_warnings=_MOOT_WARNINGS + _DEMO_MOOT_WARNINGS if demo else _MOOT_WARNINGS,
        )

    def twin(self, *, threads: int) -> LocalEngine:
        """A new engine like this one (same model, slots and flags) on `threads` CPU threads:
        a replica beside it."""
        return LocalEngine(
            self.model, parallel=self.parallel, ctx_size=self.ctx_size, threads=threads,
            binary=self.binary, chat_template=self.chat_template, alias=self.alias,
            log_all=self.log_all, kv_unified=self.kv_unified, moot_warnings=self.moot_warnings,
            start_timeout_s=self.start_timeout_s, stop_grace_s=self.stop_grace_s,
        )  # fmt: skip

    @property
    def kv_budget_tokens(self) -> int:
        """KV_BUDGET_TOKENS for this engine: its whole context when its slots share one
        (unified) cache; 0 otherwise, since each slot then has a context of its own."""
        return self.ctx_size if self.kv_unified and self.parallel > 1 else 0

    @property
    def slot_ctx_tokens(self) -> int:
        """One slot's context, as llama-server gives it: with an explicit -np and no unified
        cache, -c split among the slots, rounded up to a multiple of 256 (-c 4096 -np 2: 2048);
        with a unified cache each slot may take the whole of it."""
        if self.kv_unified or self.parallel == 1:
            return self.ctx_size
        share = -(-self.ctx_size // self.parallel)
        return -(-share // 256) * 256

    @property
    def slots_said(self) -> str:
        """Its slots and their context, in words, for its start line."""
        if self.parallel == 1:
            return f"1 slot with a context of {self.ctx_size} tokens"
        if self.kv_unified:
            return f"{self.parallel} slots sharing one context of {self.ctx_size} tokens"
        return (
            f"{self.parallel} slots with a context of {self.slot_ctx_tokens} tokens each "
            f"({self.ctx_size} split among them)"
        )

    @property
    def kind(self) -> str:
        return f"llama-server ({self.binary})" if self.binary else "xllamacpp"

    @property
    def pid(self) -> int | None:
        """The child's process id (also its process group's), once started."""
        return self._process.pid if self._process is not None else None

    def command(self, port: int) -> list[str]:
        """The child's command line: child.py run as a script. `-P` keeps the script's own
        directory (slotgate's modules) off the front of sys.path, where a module of slotgate
        could shadow a standard one; the child needs nothing but the standard library."""
        command = [
            sys.executable, "-P", str(Path(child.__file__).resolve()), "--model", str(self.model),
            "--port", str(port), "--parallel", str(self.parallel),
            "--ctx-size", str(self.ctx_size), "--threads", str(self.threads),
        ]  # fmt: skip
        if self.binary:
            command += ["--binary", self.binary]
        if self.chat_template:
            command += ["--chat-template-file", str(self.chat_template)]
        if self.alias:
            command += ["--alias", self.alias]
        if self.kv_unified:
            command.append("--kv-unified")
        return command

    def start(self) -> None:
        """Start the engine and block until its /health answers 200; EngineFailed otherwise."""
        self.launch(free_port())
        try:
            while not self.ready():
                time.sleep(HEALTH_POLL_S)
        except BaseException:
            self.stop()
            raise

    def launch(self, port: int) -> None:
        """Start the engine's process on `port` without waiting for it; `ready()` says when
        it serves. `start()` does both."""
        if self._process is not None:
            raise RuntimeError("a LocalEngine starts once")
        self.url = f"http://127.0.0.1:{port}"
        self.log.info(
            "starting llama.cpp (%s) at %s: model %s, %s, %d CPU thread%s%s",
            self.kind, self.url, self.model, self.slots_said, self.threads,
            "" if self.threads == 1 else "s",
            "".join(f", {name}={value}" for name, value in self.env.items()),
        )  # fmt: skip
        try:
            # A session of its own: a terminal's Ctrl-C reaches slotgate alone, which drains
            # its streams first and only then stops the engine they depend on.
            self._process = subprocess.Popen(  # noqa: S603 - our own interpreter and file
                self.command(port),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        except OSError as exc:
            raise EngineFailed(
                f"could not start {sys.executable} for the engine ({exc.strerror or exc})"
            ) from None
        assert self._process.stdout is not None  # noqa: S101 - started with stdout=PIPE
        self._reader = threading.Thread(
            target=self._forward_log, args=(self._process.stdout,), name="slotgate-engine-log",
            daemon=True,
        )  # fmt: skip
        self._reader.start()
        self._deadline = time.monotonic() + self.start_timeout_s

    def ready(self) -> bool:
        """Whether the launched engine answers /health with 200 yet; EngineFailed when it
        ended, or did not answer within the start timeout. The caller stops it then."""
        code = self.poll()
        if code is not None:
            if self._reader is not None:
                self._reader.join(timeout=2)  # so that its last words are in the tail
            raise EngineFailed(f"llama.cpp {ended(code)} before it was ready: {self._last_words()}")
        if _healthy(self.url):
            self.log.info("llama.cpp is ready at %s", self.url)
            return True
        if time.monotonic() > self._deadline:
            raise EngineFailed(
                f"llama.cpp did not answer /health within {self.start_timeout_s:g} s; "
                "its log above says how far it got"
            )
        return False

    def poll(self) -> int | None:
        """The engine's exit code once it has ended (negative: the signal that ended it).

        The process is left unreaped, so that its id, and its process group's, cannot pass
        to a stranger before `stop()` has signalled the group.
        """
        process = self._process
        if process is None:
            return None
        if process.returncode is not None or not hasattr(os, "waitid"):
            return process.poll()
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return process.poll()
        if info is None or info.si_pid == 0:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def terminate(self) -> None:
        """Ask the engine to stop (end of its pipe and SIGTERM) without waiting for it: so
        several engines stop side by side. Safe to call again; `stop()` finishes the job."""
        process = self._process
        if process is None or process.returncode is not None or self._stopping:
            return
        self._stopping = True
        if self.poll() is None:
            self.log.info("stopping llama.cpp (pid %d)", process.pid)
            assert process.stdin is not None  # noqa: S101 - started with stdin=PIPE
            with contextlib.suppress(OSError):
                process.stdin.close()
            os.kill(process.pid, signal.SIGTERM)

    def stop(self) -> None:
        """Stop the engine: end of its pipe and SIGTERM, SIGKILL to its whole group after the
        grace period; then reap it. Safe to call again, and before or after a failed start."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        self.terminate()
        if not self._wait_exit(self.stop_grace_s):
            self.log.warning(
                "llama.cpp did not stop within %.0f s of SIGTERM; killing it", self.stop_grace_s
            )
        # The group goes whatever state its leader is in: a llama-server under the supervisor
        # must not outlive it. The leader is not reaped yet, so the group id is still ours.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    # -- internals -----------------------------------------------------------------------------

    def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _forward_log(self, output: IO[bytes]) -> None:
        level = logging.INFO
        aborted = False
        for raw in output:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            # A line without a level letter continues the one before (a multi-line message),
            # or is output llama.cpp's logger never saw (an assertion, a stack trace): that
            # much of a crash is shown when the engine ends by itself.
            found, text = parse_log_line(line)
            level = level if found is None else found
            this = level
            if found is None and _ABORT_LINE.match(line):
                this, aborted = logging.ERROR, True
            elif found is None and aborted:
                # The backtrace after an abort: out of the tail, where the lines that led to
                # the abort are worth more to the reader.
                if self.log_all:
                    self.log.log(level, "%s", text)
                continue
            if this >= logging.WARNING and any(moot in text for moot in self.moot_warnings):
                this = level = logging.INFO
            shown = self.log_all or this >= logging.WARNING
            self._tail.append((this, text, shown))
            if shown:
                self.log.log(this, "%s", text)
        if not self._stopping:
            hidden = [text for _, text, shown in self._tail if not shown][-_CRASH_LINES:]
            if hidden:
                self.log.warning("llama.cpp ended; its last lines before that:")
            for text in hidden:
                self.log.warning("  %s", text)

    def _last_words(self) -> str:
        """The first error among its last lines (the cause; later ones are consequences)."""
        tail = list(self._tail)
        errors = [text for level, text, _ in tail if level >= logging.ERROR]
        if errors:
            return errors[0]
        return tail[-1][1] if tail else "it printed nothing"


def parse_log_line(line: str) -> tuple[int | None, str]:
    """A llama.cpp log line's logging level and its text without timestamp or level letter;
    None for a line without a level letter."""
    match = _LOG_LINE.match(line)
    if match is None:
        return None, line
    return _LEVELS[match[1]], match[2]


def ended(code: int) -> str:
    """How the engine ended, from its exit code: `exited with code 1`, `was killed by SIGKILL`."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _healthy(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
