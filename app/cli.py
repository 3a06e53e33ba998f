"""The `slotgate` command: settings from the environment, one uvicorn worker, one pool."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from . import logs
from .main import Gate, create_app
from .protocol import bounded_head_protocol
from .settings import Settings, describe

log = logging.getLogger("slotgate")


def _env_help() -> str:
    lines = ["environment variables (also read from ./.env):"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "unset" if default is None or default == () else str(default).lower()
        lines.append(f"  {name.upper():<24} {field.description} [default: {shown}]")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="slotgate",
        description=(
            "Admission gate for llama.cpp's llama-server: at most N generations through, a "
            "bounded FIFO line for the rest, HTTP 429 with Retry-After when the line is full. "
            "Fronts LLAMA_SERVER_URL, or a local llama.cpp engine started with --model/--demo."
        ),
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    local = parser.add_argument_group("local llama.cpp engine (instead of LLAMA_SERVER_URL)")
    local.add_argument("--model", metavar="PATH.gguf", help="start llama.cpp on this model")
    local.add_argument(
        "--demo", action="store_true", help="start llama.cpp on the small gemma-3 270M model"
    )
    local.add_argument("--parallel", type=_positive, default=2, metavar="N", help="slots (2)")
    local.add_argument(
        "--ctx-size", type=_positive, default=4096, metavar="C", help="total context (4096)"
    )
    local.add_argument(
        "--threads", type=_positive, default=None, metavar="T", help="CPU threads (llama.cpp's)"
    )
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


class Server(uvicorn.Server):
    """uvicorn's server, told to drain the gate the moment a stop signal arrives.

    uvicorn closes its listeners on the signal and waits up to DRAIN_TIMEOUT for running
    requests; the gate meanwhile turns new work and the waiting line away with 503.
    """

    def __init__(
        self, config: uvicorn.Config, gate: Gate, engine_exit: Callable[[], int | None] | None
    ) -> None:
        super().__init__(config)
        self._gate = gate
        self._engine_exit = engine_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self._engine_exit is not None and counter % 5 == 0:
            code = self._engine_exit()
            if code is not None:
                log.error("the local llama.cpp engine exited (code %s); slotgate stops", code)
                self.engine_died = True
                self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler, between any two bytecodes: touch the pool only from the loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._gate.drain)
        # Unlike uvicorn's own, do not re-raise the signal after shutdown: a drained stop
        # is a clean exit (status 0), which is what container runtimes expect.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def uvicorn_config(app: Callable[..., Any], settings: Settings) -> uvicorn.Config:
    """How slotgate runs uvicorn (the bench's memory trace runs it the same way)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # One worker, always: each process would hold its own pool and multiply the slots.
        workers=1,
        loop="uvloop",
        http=bounded_head_protocol(settings.head_timeout_s),
        lifespan="on",
        access_log=False,
        server_header=False,
        # slotgate reads no client address, so uvicorn need not rewrite it from X-Forwarded-*.
        proxy_headers=False,
        log_config=None,
        # 0 = no drain (uvicorn cancels at once); None would make it wait forever.
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),
    )


def serve(settings: Settings, engine_exit: Callable[[], int | None] | None = None) -> int:
    app = create_app(settings)
    server = Server(uvicorn_config(app, settings), app.state.gate, engine_exit)
    # Everything built so far (FastAPI, pydantic, uvicorn, the app) lives as long as the
    # process: out of the collector's sight, a full collection no longer walks it, which under
    # a storm of 1,000 clients cut the open-loop p99 time to a 429 from 2-13 ms to under 1 ms.
    gc.collect()
    gc.freeze()
    server.run()
    if server.engine_died:
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(describe(exc), file=sys.stderr)  # noqa: T201 - the one line a misconfiguration gets
        return 2
    except UnicodeDecodeError as exc:
        line = f"slotgate: invalid .env: not UTF-8 text ({exc.reason} at byte {exc.start})"
        print(line, file=sys.stderr)  # noqa: T201
        return 2
    logs.configure(settings.log_level, settings.log_format)
    if not (args.model or args.demo):
        log.info("slotgate fronting %s on http://%s:%d", settings.llama_server_url,
                 settings.host, settings.port)  # fmt: skip
        return serve(settings)
    with _local_engine(args) as (url, engine_exit):
        settings = settings.model_copy(update={"llama_server_url": url})
        _print_usage(settings)
        return serve(settings, engine_exit)


@contextlib.contextmanager
def _local_engine(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], int | None]]]:
    from .engine import EngineFailed, LocalEngine  # xllamacpp is an optional extra

    try:
        engine = LocalEngine.from_args(
            model=args.model,
            demo=args.demo,
            parallel=args.parallel,
            ctx_size=args.ctx_size,
            threads=args.threads,
        )
        engine.start()
    except EngineFailed as exc:
        print(f"slotgate: {exc}", file=sys.stderr)  # noqa: T201 - start-up failure, one line
        raise SystemExit(1) from None
    try:
        yield engine.url, engine.poll
    finally:
        engine.stop()


_EXAMPLE = '{"messages":[{"role":"user","content":"Say hello"}],"max_tokens":32,"stream":true}'


def _print_usage(settings: Settings) -> None:
    base = f"http://{settings.host}:{settings.port}"
    print(  # noqa: T201 - the banner a person starting the demo reads
        f"\nslotgate is starting on {base}, in front of llama.cpp at {settings.llama_server_url}\n"
        f"  OpenAI base URL:  {base}/v1   (any API key)\n"
        f"  pool:             curl {base}/admission\n"
        f"  try:              curl -N {base}/v1/chat/completions \\\n"
        "                      -H 'Content-Type: application/json' \\\n"
        f"                      -d '{_EXAMPLE}'\n",
        flush=True,
    )
