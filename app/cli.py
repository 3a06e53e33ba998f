"""The `slotgate` command: settings from the environment, one uvicorn worker, one gate."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import gc
import logging
import math
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from pydantic import ValidationError
from slotgate import __version__, logs
from slotgate.proxy.protocol import http_protocol
from slotgate.settings import (
    ENGINE_VARIABLES,
    Settings,
    describe,
    export_engine_variables,
    misspelt,
    mistyped,
    renamed,
)

if TYPE_CHECKING:
    from slotgate.engine.engines import Engines
    from slotgate.main import Service

log = logging.getLogger("slotgate")

#: How long a stop forced by a second Ctrl-C may take to cut requests and close the app.
FORCED_STOP_S = 5.0


def _env_help() -> str:
    lines = ["environment variables (also read from ./.env):"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "unset" if default is None or default == () else str(default).lower()
        lines.append(f"  {name.upper():<24} {field.description} [default: {shown}]")
    for name, (description, shown) in ENGINE_VARIABLES.items():
        lines.append(f"  {name:<24} {description} [default: {shown}]")
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag answered in one line like a bad variable, not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see slotgate --help\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="slotgate",
        description=(
            "Admission gate for llama.cpp's llama-server: at most N generations through, a "
            "bounded FIFO queue for the rest, HTTP 429 with Retry-After when the queue is full. "
            "Fronts LLAMA_SERVER_URL, or a local llama.cpp engine started with --model/--demo."
        ),
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"slotgate {__version__}")
    parser.add_argument("--host", type=_address, help="address to listen on (overrides HOST)")
    parser.add_argument("--port", type=_port, help="port to listen on (overrides PORT)")
    local = parser.add_argument_group("local llama.cpp engine (instead of LLAMA_SERVER_URL)")
    local.add_argument(
        "--model", type=_path, metavar="PATH.gguf", help="start llama.cpp on this model"
    )
    local.add_argument(
        "--demo", action="store_true", help="start llama.cpp on the small gemma-3 270M model"
    )
    local.add_argument("--parallel", type=_positive, metavar="N", help="slots of each engine (2)")
    local.add_argument(
        "--ctx-size",
        type=_positive,
        metavar="C",
        help="context of each engine, split evenly among its slots (4096: 2048 per slot)",
    )
    local.add_argument(
        "--threads", type=_positive, metavar="T",
        help="CPU threads of each engine (llama.cpp's; by default shared out among replicas)",
    )  # fmt: skip
    local.add_argument(
        "--replicas", type=_positive, metavar="R",
        help="engines to start, each on its own port with its own slots and threads (1)",
    )  # fmt: skip
    local.add_argument(
        "--gpus", type=_gpus, metavar="G1,G2",
        help="one GPU per replica, as CUDA_VISIBLE_DEVICES gives it (sets --replicas too)",
    )  # fmt: skip
    local.add_argument(
        "--engine-log",
        choices=("warnings", "all"),
        help="llama.cpp's log lines to show: its warnings and errors (default), or all",
    )
    args = parser.parse_args(argv)
    # These only shape a local engine: without one they would be silently ignored.
    engine_only = {"--parallel": args.parallel, "--ctx-size": args.ctx_size,
                   "--threads": args.threads, "--engine-log": args.engine_log,
                   "--replicas": args.replicas, "--gpus": args.gpus}  # fmt: skip
    given = [flag for flag, value in engine_only.items() if value is not None]
    if args.model and args.demo:
        parser.error("--model and --demo exclude each other; give one of them")
    if given and not (args.model or args.demo):
        parser.error(f"{given[0]} needs --model or --demo: it applies to a local engine only")
    if args.gpus and args.replicas and len(args.gpus) != args.replicas:
        parser.error(f"--gpus names {len(args.gpus)} GPUs for --replicas {args.replicas}; "
                     "give one GPU per replica")  # fmt: skip
    args.gpus = args.gpus or ()
    args.replicas = args.replicas or len(args.gpus) or 1
    args.parallel = args.parallel or 2
    args.ctx_size = args.ctx_size or 4096
    args.engine_log = args.engine_log or "warnings"
    return args


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _port(text: str) -> int:
    value = _whole(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port from 0 to 65535")
    return value


def _address(text: str) -> str:
    # An empty --host would listen on every interface of the machine, not on none.
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give an address such as 127.0.0.1 or ::1")
    return text


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give the path of a .gguf model")
    return text


def _gpus(text: str) -> tuple[str, ...]:
    gpus = tuple(gpu.strip() for gpu in text.split(","))
    if not all(gpus):
        raise argparse.ArgumentTypeError(
            f"{text!r} lacks a GPU; give one per replica, comma-separated, such as 0,1"
        )
    return gpus


def _positive(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


class Server(uvicorn.Server):
    """uvicorn's server, told to drain the gate the moment a stop signal arrives.

    uvicorn closes its listeners on the signal and waits up to DRAIN_TIMEOUT_S for running
    requests; the gate meanwhile turns new work and the queue away with 503.
    """

    def __init__(self, config: uvicorn.Config, service: Service, engines: Engines | None) -> None:
        super().__init__(config)
        self._service = service
        self._engines = engines
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self._engines is not None:  # each tick (0.1 s): one waitid per engine, cheap
            self._watch(self._engines)
        return await super().on_tick(counter)

    def _watch(self, engines: Engines) -> None:
        """An engine that ended leaves the rest serving (the gate routes around it); slotgate
        stops, with status 1, once none is left."""
        from slotgate.engine.process import ended

        news = engines.ended()
        left = engines.running
        for number, code in news:
            # Its slots are gone now: /readyz and the pool must not wait for a /props read to
            # find out (PROPS_REFRESH_INTERVAL_S later).
            for upstream in self._service.fleet.upstreams:
                if upstream.url == engines[number - 1].url:
                    upstream.stopped(f"the local llama.cpp engine {ended(code)}")
        for index, (number, code) in enumerate(news):
            # Told one by one, as if apart: of two found ended at once, the first is not the last.
            rest = left + len(news) - 1 - index
            if len(engines) == 1:
                log.error("the local llama.cpp engine %s; slotgate stops", ended(code))
            elif rest:
                log.error("local llama.cpp engine %s %s; slotgate serves on the other %d",
                          engines.name(number), ended(code), rest)  # fmt: skip
            else:
                log.error("local llama.cpp engine %s %s, the last one; slotgate stops",
                          engines.name(number), ended(code))  # fmt: skip
        if not left:
            self.engine_died = True
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler, between any two bytecodes: touch the gate only from the loop.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._service.drain)
        # Unlike uvicorn's own, do not re-raise the signal after shutdown: a drained stop
        # is a clean exit (status 0), which is what container runtimes expect.
        if self.should_exit and sig == signal.SIGINT:
            if not self.force_exit and self._loop is not None:
                self._loop.call_soon_threadsafe(
                    log.warning, "second Ctrl-C: slotgate stops now, cutting running requests"
                )
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if not self.force_exit:
            return
        # uvicorn stops waiting at a second Ctrl-C but then skips the app's shutdown, and the
        # loop's end cancels the app's lifespan, which logs that as a failed shutdown with a
        # traceback. Cut the running requests as at the end of DRAIN_TIMEOUT_S instead, then shut
        # the app down as usual (a replica gives back what Redis counts for it).
        tasks = list(self.server_state.tasks)
        for task in tasks:
            task.cancel(msg="slotgate stopped at a second Ctrl-C")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FORCED_STOP_S):
                if tasks:
                    await asyncio.wait(tasks)
                await self.lifespan.shutdown()


def _hangup(keyed: bool) -> Callable[[int, FrameType | None], None]:
    if keyed:
        said = "SIGHUP: API_KEYS_FILE is read again only while slotgate serves; nothing reloaded"
    else:
        said = "SIGHUP: nothing to reload (API_KEYS_FILE is unset); slotgate carries on"

    def handle(sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two bytecodes, perhaps inside a log call: on a
        # running loop the line is written from the loop instead.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("%s", said)
        else:
            loop.call_soon_threadsafe(log.warning, "%s", said)

    return handle


def uvicorn_config(app: Callable[..., Any], settings: Settings) -> uvicorn.Config:
    """How slotgate runs uvicorn (the bench's memory trace runs it the same way): slotgate's
    app through its front (app/proxy/front.py)."""
    from slotgate.main import Gateway  # imported when used, as the CLI imports the app

    return uvicorn.Config(
        app.front if isinstance(app, Gateway) else app,
        host=settings.host,
        port=settings.port,
        # One worker, always: each process would hold its own gate and multiply the slots.
        workers=1,
        loop="uvloop",
        http=http_protocol(settings.head_timeout_s),
        lifespan="on",
        access_log=False,
        server_header=False,
        # The client's address is the peer's, never one a header claims: the operator controls
        # trust loopback peers without keys (and refuse those a proxy relayed, app/controls.py).
        proxy_headers=False,
        log_config=None,
        # 0 = no drain (uvicorn cancels at once); None would make it wait forever.
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s),
    )


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for HOST and PORT, as uvicorn would open them; OSError otherwise.

    slotgate binds before anything else (reading /props, loading a model), so that a busy
    port or a wrong address is the one line it prints, not the last of many.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # IPv6 only beside an IPv4 socket of our own; HOST=:: alone takes both, as
                # with uvicorn, so that a container's dual-stack setting keeps its IPv4 clients.
                v4 = any(info[0] == socket.AF_INET for info in infos)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v4))
            if port == 0 and sockets[1:]:
                # PORT=0 on a name with several addresses (localhost): one port for them all.
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            # Listening at once holds the port: a second bind would succeed until then.
            sock.listen(2048)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def cannot_listen(host: str, port: int, names: tuple[str, str], exc: OSError) -> str:
    """The one line for a listening address slotgate cannot have, naming the variable."""
    host_name, port_name = names
    if isinstance(exc, socket.gaierror):
        name, value, reason = host_name, host, "not an address of this machine or a known name"
    elif exc.errno == errno.EADDRINUSE:
        name, value, reason = port_name, str(port), "address already in use"
    elif exc.errno == errno.EACCES:
        name, value, reason = port_name, str(port), "permission denied"
    elif exc.errno == errno.EADDRNOTAVAIL:
        name, value, reason = host_name, host, "not an address of this machine"
    else:
        name, value, reason = host_name, host, exc.strerror or str(exc)
    shown = f"[{host}]" if ":" in host else host
    return f"slotgate: cannot listen on {shown}:{port} ({name}={value}): {reason}"


def base_url(host: str, port: int) -> str:
    """slotgate's URL on `host`, an IPv6 address in brackets as URLs need it."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    settings: Settings,
    engines: Engines | None = None,
    sockets: list[socket.socket] | None = None,
) -> int:
    # The app (FastAPI and the whole request path) is imported only to serve: `--help` and a
    # start-up refused for its settings answer in a fraction of the time.
    from slotgate.main import create_app

    app = create_app(settings)
    server = Server(uvicorn_config(app, settings), app.state.service, engines)
    # Everything built so far (FastAPI, pydantic, uvicorn, the app) lives as long as the
    # process: out of the collector's sight, a full collection no longer walks it, which under
    # a storm of 1,000 clients cut the open-loop p99 time to a 429 from 2-13 ms to under 1 ms.
    gc.collect()
    gc.freeze()
    server.run(sockets)
    if server.engine_died:
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = {"host": args.host, "port": args.port}
    try:
        settings = Settings(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as exc:
        print(describe(exc), file=sys.stderr)  # noqa: T201 - the one line a misconfiguration gets
        return 2
    except UnicodeDecodeError as exc:
        line = f"slotgate: invalid .env: not UTF-8 text ({exc.reason} at byte {exc.start})"
        print(line, file=sys.stderr)  # noqa: T201
        return 2
    except OSError as exc:  # a .env that is there but cannot be read
        print(f"slotgate: cannot read .env: {exc.strerror or exc}", file=sys.stderr)  # noqa: T201
        return 2
    if (mistake := mistyped()) is not None:
        print(mistake, file=sys.stderr)  # noqa: T201 - the one line a misconfiguration gets
        return 2
    logs.configure(settings.log_level, settings.log_format)
    if args.engine_log == "all":  # asked for by name: every engine line, whatever LOG_LEVEL says
        logging.getLogger("slotgate.engine").setLevel(logging.DEBUG)
    for warning in [*renamed(), *misspelt()]:
        log.warning("%s", warning)
    # SIGHUP's default ends the process. With API_KEYS_FILE the app reloads it while it
    # serves (app/gate/tenants.py); at any other moment, or without the file, it is only told.
    signal.signal(signal.SIGHUP, _hangup(settings.api_keys_file is not None))
    try:
        sockets = listen(settings.host, settings.port)
    except OSError as exc:
        names = ("--host" if args.host else "HOST", "--port" if args.port is not None else "PORT")
        print(cannot_listen(settings.host, settings.port, names, exc), file=sys.stderr)  # noqa: T201
        return 2
    try:
        port = int(sockets[0].getsockname()[1])  # PORT=0 picks one
        if not (args.model or args.demo):
            log.info("slotgate fronting %s on %s", settings.llama_server_url,
                     base_url(settings.host, port))  # fmt: skip
            return serve(settings, sockets=sockets)
        if "llama_server_url" in settings.model_fields_set:
            log.warning("LLAMA_SERVER_URL=%s is ignored: --model/--demo front their own engine",
                        settings.llama_server_url)  # fmt: skip
        export_engine_variables()
        with _local_engines(args) as engines:
            update: dict[str, object] = {"llama_server_url": ",".join(engines.urls)}
            if settings.kv_budget_tokens is None:
                # It knows whether its slots share a cache; every replica is alike.
                update["kv_budget_tokens"] = engines.kv_budget_tokens
            settings = settings.model_copy(update=update)
            _print_usage(settings, port)
            return serve(settings, engines, sockets)
    except KeyboardInterrupt:
        # Ctrl-C before uvicorn took the signal over (assembling the demo model, loading one):
        # the engine has been stopped on the way out; a traceback would say nothing more.
        print("slotgate: interrupted while starting; stopped", file=sys.stderr)  # noqa: T201
        return 130
    finally:
        for sock in sockets:
            sock.close()


@contextlib.contextmanager
def _local_engines(args: argparse.Namespace) -> Iterator[Engines]:
    from slotgate.engine.engines import Engines  # stdlib only
    from slotgate.engine.model import EngineFailed, EngineMisconfigured

    try:
        engines = Engines.from_args(
            model=args.model,
            demo=args.demo,
            parallel=args.parallel,
            ctx_size=args.ctx_size,
            threads=args.threads,
            log_all=args.engine_log == "all",
            replicas=args.replicas,
            gpus=args.gpus,
        )
        engines.start()
    except EngineFailed as exc:
        print(f"slotgate: {exc}", file=sys.stderr)  # noqa: T201 - start-up failure, one line
        # A bad flag or variable exits 2, as a bad setting does; an engine that fails, 1.
        raise SystemExit(2 if isinstance(exc, EngineMisconfigured) else 1) from None
    try:
        yield engines
    finally:
        engines.stop()


_EXAMPLE = '{"messages":[{"role":"user","content":"Say hello"}],"max_tokens":32,"stream":true}'


def _print_usage(settings: Settings, port: int) -> None:
    base = base_url(settings.host, port)
    at = settings.llama_server_url.replace(",", ", ")
    print(  # noqa: T201 - the banner a person starting the demo reads
        f"\nslotgate is starting on {base}, in front of llama.cpp at {at}\n"
        f"  OpenAI base URL:  {base}/v1   (any API key)\n"
        f"  pool:             curl {base}/admission\n"
        f"  try:              curl -N {base}/v1/chat/completions \\\n"
        "                      -H 'Content-Type: application/json' \\\n"
        f"                      -d '{_EXAMPLE}'\n",
        flush=True,
    )
