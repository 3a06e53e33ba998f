"""The engine's child process: llama.cpp's HTTP server on a loopback port, for slotgate alone.

slotgate runs this file as a script (`python -P app/engine/child.py ...`) in a process group of
its own. The child either supervises a real `llama-server` binary or hosts xllamacpp, which
embeds the same server, in-process. Either way it never outlives slotgate: it holds the read
end of a pipe whose only writer is slotgate, and when that pipe reaches end-of-file (slotgate
stopped it, exited, or was killed by SIGKILL) the child ends itself and its server.

Run as a script, it can import nothing of slotgate: standard library only, and xllamacpp
only in the child and only when it is the engine. What the child shares with the parent
(the install command, llama-server's command line) therefore lives here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

#: The distribution to install for a local engine: slotgate is not on PyPI, so an error that
#: said `pip install 'slotgate[local]'` would send a newcomer to whatever is there.
ENGINE_DISTRIBUTION = "xllamacpp"


def pip(*arguments: str) -> str:
    """The command that installs into slotgate's own Python (a venv's, often not `pip`'s)."""
    return shlex.join([sys.executable, "-m", "pip", "install", *arguments])


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
    (unified) cache that every request could exhaust at once. `chat_template` is a Jinja
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
        params.use_jinja = True  # see DEMO_CHAT_TEMPLATE in model.py
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
