"""What one relayed request costs in counts, which a loaded machine does not blur: Python calls,
memory allocations and system calls per request.

    python -m bench.experiments.counts [--requests 2000] [--warm 300] [--top 25] [--no-strace]
                                       [--allocations-by-function] [--stream]
                                       [--unspecialized] [--opcodes]

CPU timings on a shared machine are noise; counts are not. This runs uvicorn in this process,
configured as `slotgate` runs it (app/cli.py), with slotgate's app on the like-for-like path
(`STREAM_UPSTREAM=false`, one upstream of 1,024 slots, no tenants, no budget, no Redis), in
front of the stand-in. A client in another process sends non-streamed chat requests (`--stream`:
streamed ones, the stand-in's 16 tokens written at once) one after the other on one keep-alive
connection (c=1). Three windows of `--requests` requests each, after
`--warm` to fill first-use caches:

- system calls: `strace -c -f` attached to this process for the window (all its threads);
- allocations: the object and raw allocators of CPython counted by a small C hook, compiled on
  the fly with the system's C compiler (skipped, with a note, without one);
- Python calls: `sys.setprofile` counting each function entered (Python and C), with the
  functions of slotgate's own code that run most often.

With `--unspecialized`, the attribute sites Python 3.11 left generic, run per request; with
`--opcodes`, the bytecode instructions each function runs per request (both by tracing a
further window of at most 300 requests).

Another tree's slotgate, for before and after: put its `.types` folder (a folder holding a
`slotgate/` package) first on PYTHONPATH, e.g.
`PYTHONPATH=/work/old789/.types:$PWD python -m bench.experiments.counts`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import uvicorn

from bench.contenders import REPO, configure_standin, start_standin
from bench.loadgen import chat_body, connect, fetch, request_bytes
from bench.loop import run_loop
from bench.procs import free_port, wait_until
from bench.scenarios import CHAT

#: Counts every allocation through CPython's object and raw allocators while on.
_HOOK = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NEXT(c) ((PyMemAllocatorEx *)(c))
static PyMemAllocatorEx obj_, mem_;
static unsigned long long count_;
static void *m_(void *c, size_t n) { count_++; return NEXT(c)->malloc(NEXT(c)->ctx, n); }
static void *c_(void *c, size_t k, size_t n) {
    count_++; return NEXT(c)->calloc(NEXT(c)->ctx, k, n); }
static void *r_(void *c, void *p, size_t n) {
    if (!p) count_++;
    return NEXT(c)->realloc(NEXT(c)->ctx, p, n); }
static void f_(void *c, void *p) { NEXT(c)->free(NEXT(c)->ctx, p); }
static PyObject *start(PyObject *s, PyObject *a) {
    PyMemAllocatorEx o = {&obj_, m_, c_, r_, f_}, m = {&mem_, m_, c_, r_, f_};
    PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &obj_); PyMem_GetAllocator(PYMEM_DOMAIN_MEM, &mem_);
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &o); PyMem_SetAllocator(PYMEM_DOMAIN_MEM, &m);
    count_ = 0; Py_RETURN_NONE; }
static PyObject *stop(PyObject *s, PyObject *a) {
    unsigned long long n = count_;
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &obj_); PyMem_SetAllocator(PYMEM_DOMAIN_MEM, &mem_);
    return PyLong_FromUnsignedLongLong(n); }
static PyObject *count(PyObject *s, PyObject *a) { return PyLong_FromUnsignedLongLong(count_); }
static PyMethodDef methods[] = {{"start", start, METH_NOARGS, 0},
    {"stop", stop, METH_NOARGS, 0}, {"count", count, METH_NOARGS, 0}, {0}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "alloccount", 0, -1, methods};
PyMODINIT_FUNC PyInit_alloccount(void) { return PyModule_Create(&module); }
"""


def _alloc_hook() -> ModuleType | None:
    """The allocation counter, compiled into a temporary folder; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="alloccount-"))
    source = folder / "alloccount.c"
    source.write_text(_HOOK)
    target = folder / f"alloccount{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    command = [compiler, "-shared", "-fPIC", "-O2", f"-I{include}", str(source), "-o", str(target)]
    if subprocess.run(command, capture_output=True, check=False).returncode != 0:
        return None
    spec = importlib.util.spec_from_file_location("alloccount", target)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _client(port: int, stream: bool) -> None:
    """Read a count from stdin, send that many requests one after the other, say so; repeat."""
    (exchange,) = await connect(port, 1)
    raw = request_bytes(port, CHAT, chat_body(stream=stream))
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        for _ in range(int(line)):
            status, _ = await fetch(exchange, raw)
            if status != 200:
                raise SystemExit(f"status {status}")
        print("done", flush=True)


class _Driver:
    def __init__(self, port: int, stream: bool) -> None:
        self.port = port
        self.stream = stream
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> _Driver:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.experiments.counts", "--client", str(self.port),
            *(["--stream"] if self.stream else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
        )  # fmt: skip
        return self

    async def send(self, count: int) -> None:
        process = self.process
        assert process is not None
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.write(f"{count}\n".encode())
        await process.stdin.drain()
        if await process.stdout.readline() != b"done\n":
            raise RuntimeError("the client failed")

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None
        assert self.process.stdin is not None
        self.process.stdin.close()
        await self.process.wait()


def _strace(pid: int, output: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid), "-o", str(output)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    # strace says "Process N attached" for each thread before it traces anything.
    process.stderr.readline()
    time.sleep(0.3)
    return process


def _syscalls(summary: str, requests: int) -> list[tuple[str, float]]:
    rows = []
    for line in summary.splitlines():
        parts = line.split()
        # "% time seconds usecs/call calls [errors] syscall"
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            rows.append((parts[-1], int(parts[3]) / requests))
    return sorted(rows, key=lambda row: -row[1])


async def _measure(server: uvicorn.Server, args: argparse.Namespace) -> None:
    await asyncio.to_thread(wait_until, lambda: server.started, 30, "uvicorn started")
    n = args.requests
    async with _Driver(server.config.port, args.stream) as client:
        await client.send(args.warm)
        if args.stream:
            # The first event stream's connection is held aside for STREAM_PROBE_S, to learn
            # whether the upstream keeps such connections (app/upstreams/reuse.py); until
            # then each stream's connection is closed and replaced. Counted past that.
            await asyncio.sleep(1.5)
            await client.send(args.warm)

        if not args.no_strace and shutil.which("strace"):
            output = Path(tempfile.mkdtemp(prefix="counts-")) / "strace.txt"
            tracer = await asyncio.to_thread(_strace, os.getpid(), output)
            await client.send(n)
            tracer.send_signal(signal.SIGINT)
            await asyncio.to_thread(tracer.wait)
            rows = _syscalls(output.read_text(), n)
            total = sum(per for _, per in rows)
            detail = ", ".join(f"{name} {per:.2f}" for name, per in rows if per >= 0.005)
            print(f"system calls per request: {total:.2f} ({detail})")
        else:
            print("system calls per request: skipped (no strace, or --no-strace)")

        hook = _alloc_hook()
        if hook is not None:
            hook.start()
            await client.send(n)
            allocations = hook.stop()
            print(f"allocations per request: {allocations / n:.1f}")
            if args.allocations_by_function:
                await _allocations_by_function(client, hook, n, args.top)
        else:
            print("allocations per request: skipped (no C compiler)")

        calls: collections.Counter[Any] = collections.Counter()
        builtins: collections.Counter[str] = collections.Counter()
        total_calls = 0

        def profile(frame: FrameType, event: str, arg: object) -> None:
            nonlocal total_calls
            if event == "call":
                total_calls += 1
                calls[frame.f_code] += 1
            elif event == "c_call":
                total_calls += 1
                builtins[getattr(arg, "__qualname__", str(arg))] += 1

        sys.setprofile(profile)
        await client.send(n)
        sys.setprofile(None)
        print(f"function calls per request (Python and C): {total_calls / n:.1f}")
        _print_own(calls, n, args.top)
        print("C functions called from Python, most often first:")
        for name, count in builtins.most_common(args.top):
            print(f"  {count / n:5.2f}  {name}")
        if args.unspecialized:
            await _print_unspecialized(client, calls, n, args.top)
        if args.opcodes:
            await _print_opcodes(client, n, args.top)
    server.should_exit = True


async def _allocations_by_function(client: _Driver, hook: Any, n: int, top: int) -> None:
    """Each allocation charged to the function running when it was made (a C function to
    itself, named after its caller): the profiler's own allocations are left out."""
    where: collections.Counter[str] = collections.Counter()
    last = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal last
        made = hook.count() - last
        if made:
            if event == "c_return" or event == "c_exception":
                name = f"{getattr(arg, '__qualname__', arg)} (C, from {frame.f_code.co_qualname})"
            elif event == "call":  # the caller ran until now (and made the frame)
                back = frame.f_back
                name = back.f_code.co_qualname if back is not None else "?"
                name += f" {Path(back.f_code.co_filename).name}" if back is not None else ""
            else:
                name = f"{frame.f_code.co_qualname} {Path(frame.f_code.co_filename).name}"
            where[name] += made
        last = hook.count()

    hook.start()
    sys.setprofile(profile)
    await client.send(n)
    sys.setprofile(None)
    hook.stop()
    print("allocations per request by function (exclusive):")
    for name, made in where.most_common(top):
        print(f"  {made / n:6.2f}  {name}")


def _print_own(calls: collections.Counter[Any], n: int, top: int) -> None:
    """The functions of slotgate's own code that ran, most often first."""
    app_dir = str(Path(sys.modules["slotgate"].__file__ or "").resolve().parent)
    own = [
        (code, count)
        for code, count in calls.items()
        if str(Path(code.co_filename).resolve()).startswith(app_dir)
    ]
    print(f"of slotgate's own code (Python functions): {sum(c for _, c in own) / n:.1f}")
    for code, count in sorted(own, key=lambda item: -item[1])[:top]:
        where = Path(code.co_filename).resolve().relative_to(Path(app_dir).parent)
        print(f"  {count / n:5.2f}  {where}:{code.co_firstlineno} {code.co_qualname}")


async def _print_unspecialized(
    client: _Driver, calls: collections.Counter[Any], n: int, top: int
) -> None:
    """The attribute sites that Python 3.11 could not specialize, in every Python function run
    per request (slotgate's, uvicorn's, asyncio's), with how often each runs: such a site looks
    its name up the generic way (`PyObject_GetAttr`, a few hundred instructions) each time. A
    site that failed to specialize stays `*_ADAPTIVE` (a property, a class attribute read
    through an instance, an attribute of a class or an enum member), as does one never run,
    so each is counted by tracing its instructions over a further window (tracing runs them
    unspecialized, after the state was read). A site that two types share flips between
    specializations instead, which this cannot see."""
    import dis

    generic: dict[tuple[Any, int], str] = {}
    for code, count in calls.items():
        if count < n / 2:
            continue
        for instruction in dis.get_instructions(code, adaptive=True):
            name = instruction.opname
            if name.endswith("_ADAPTIVE") and ("ATTR" in name or "METHOD" in name):
                line = instruction.positions.lineno if instruction.positions else "?"
                where = f"{Path(code.co_filename).name}:{line} {code.co_qualname}"
                generic[code, instruction.offset] = f"{where} {name} {instruction.argval}"
    window = min(n, 300)
    ran = await _traced(client, window, {code for code, _ in generic})
    sites = [(ran[key] / window, site) for key, site in generic.items() if ran[key]]
    print(f"attribute lookups left generic per request: {sum(c for c, _ in sites):.1f}")
    for count, site in sorted(sites, reverse=True)[:top]:
        print(f"  {count:5.2f}  {site}")


async def _traced(
    client: _Driver, window: int, codes: set[Any] | None
) -> collections.Counter[tuple[Any, int]]:
    """Each bytecode instruction run over `window` requests, by (code, offset), in the
    functions of `codes` (None: every one)."""
    ran: collections.Counter[tuple[Any, int]] = collections.Counter()

    def opcodes(frame: FrameType, event: str, arg: object) -> Any:
        if event == "opcode":
            ran[frame.f_code, frame.f_lasti] += 1
        return opcodes

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if codes is not None and frame.f_code not in codes:
            return None
        frame.f_trace_opcodes = True
        return opcodes

    sys.settrace(trace)
    await client.send(window)
    sys.settrace(None)
    return ran


async def _print_opcodes(client: _Driver, n: int, top: int) -> None:
    """Bytecode instructions run per request, by function (every Python function: slotgate's,
    uvicorn's, asyncio's): the interpreter's loop is a third of a relayed request's
    instructions, and it goes where the bytecode is."""
    window = min(n, 300)
    ran: collections.Counter[Any] = collections.Counter()
    for (code, _), count in (await _traced(client, window, None)).items():
        ran[code] += count
    print(f"bytecode instructions per request: {sum(ran.values()) / window:.0f}")
    for code, count in ran.most_common(top):
        where = f"{Path(code.co_filename).parent.name}/{Path(code.co_filename).name}"
        print(f"  {count / window:6.1f}  {where}:{code.co_firstlineno} {code.co_qualname}")


def _run(args: argparse.Namespace, upstream: int) -> None:
    from slotgate.cli import uvicorn_config
    from slotgate.main import create_app
    from slotgate.settings import Settings

    settings = Settings(
        llama_server_url=f"http://127.0.0.1:{upstream}", port=free_port(), log_level="warning",
        stream_upstream=False,
    )  # fmt: skip
    print(f"slotgate from {Path(sys.modules['slotgate'].__file__ or '').parent}")
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))

    async def both() -> None:
        serving = asyncio.ensure_future(server.serve())
        try:
            await _measure(server, args)
        finally:
            server.should_exit = True
            await serving

    run_loop(both())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per window")
    parser.add_argument("--warm", type=int, default=300)
    parser.add_argument("--top", type=int, default=25, help="slotgate functions listed")
    parser.add_argument("--no-strace", action="store_true")
    parser.add_argument(
        "--allocations-by-function", action="store_true", help="split them by function"
    )
    parser.add_argument(
        "--stream", action="store_true", help="streamed chats (the stand-in's 16 tokens at once)"
    )
    parser.add_argument(
        "--unspecialized", action="store_true", help="list the attribute sites left generic"
    )
    parser.add_argument(
        "--opcodes", action="store_true", help="bytecode instructions run, by function"
    )
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        run_loop(_client(args.client, args.stream))
        return 0
    logs = REPO / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    standin = start_standin(logs)
    try:
        configure_standin(standin, slots=1024)
        _run(args, standin.port)
    finally:
        standin.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
