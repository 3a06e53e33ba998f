"""The stand-in upstream and the servers compared in front of it: nginx, LiteLLM, slotgate."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import http_json, wait_http
from bench.procs import CLIENT_CORE, SERVER_CORE, Server, free_port, spawn

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LITELLM_VENV = BENCH / ".venv-litellm"
#: The checkout whose app/ is measured (`--slotgate-tree`), first on slotgate's import path.
slotgate_tree = REPO


@dataclass(frozen=True)
class Contender:
    """One way to reach the stand-in; `slots` is the capacity slotgate reads from /props."""

    name: str
    kind: str  # direct | nginx | litellm | uvicorn | uvicorn-relay | slotgate
    slots: int | None = None
    note: str = ""
    env: tuple[tuple[str, str], ...] = ()


def start_standin(logs: Path, extra_ports: int = 0, name: str = "standin") -> Server:
    """The stand-in on the load generator's core; `extra_ports` more upstreams in the same
    process, listed in `server.extra_ports`, each with its own slots and counters."""
    ports: list[int] = []
    while len(ports) < 1 + extra_ports:
        if (port := free_port()) not in ports:
            ports.append(port)
    command = [sys.executable, "-m", "tests.support.standin"]
    for each in ports:
        command += ["--port", str(each)]
    server = spawn(name, command, ports[0], CLIENT_CORE, logs, cwd=REPO)
    server.extra_ports = ports[1:]
    for each in ports:
        wait_http(each, "/props", 20, lambda status: status == 200)
    return server


def configure_standin(standin: Server, **values: object) -> None:
    status, _ = http_json(standin.port, "/_bench/config", values)
    if status != 200:
        raise RuntimeError(f"stand-in refused its configuration: {status}")


def standin_stats(standin: Server) -> dict[str, object]:
    _, stats = http_json(standin.port, "/_bench/stats")
    assert isinstance(stats, dict)
    return stats


def start(contender: Contender, standin: Server, logs: Path) -> Server:
    """Start one contender on the server core, in front of the stand-in, and wait until ready."""
    if contender.kind == "direct":
        return standin
    if contender.kind == "nginx":
        return start_nginx(standin.port, logs)
    if contender.kind == "litellm":
        return _litellm(standin.port, logs)
    if contender.kind == "uvicorn":
        return start_floor(logs, answer=True)
    if contender.kind == "uvicorn-relay":
        return start_floor(logs, answer=True, relay_to=standin.port)
    if contender.slots is not None:
        configure_standin(standin, slots=contender.slots)
    url = f"http://127.0.0.1:{standin.port}"
    return start_slotgate(contender.name, url, logs, dict(contender.env))


def start_floor(logs: Path, *, answer: bool, relay_to: int | None = None) -> Server:
    """bench/floor.py on the server core: bare uvicorn, answering at once or holding, or
    relaying to the stand-in on port `relay_to`."""
    port = free_port()
    command = [sys.executable, "-m", "bench.floor", "--port", str(port)]
    if relay_to is not None:
        command += ["--relay", str(relay_to)]
    elif answer:
        command.append("--answer")
    name = "uvicorn-relay" if relay_to else "uvicorn-bare" if answer else "uvicorn-floor"
    return await_ready(spawn(name, command, port, SERVER_CORE, logs, cwd=REPO), "/readyz", 30)


def start_slotgate(
    name: str,
    upstream_url: str,
    logs: Path,
    env: dict[str, str] | None = None,
    core: int | None = SERVER_CORE,
) -> Server:
    port = free_port()
    script = Path(sys.executable).with_name("slotgate")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "slotgate"]
    values = {
        "LLAMA_SERVER_URL": upstream_url,
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "LOG_LEVEL": "warning",
        "PYTHONPATH": str(slotgate_tree),
    }
    values.update(env or {})
    # Settings also read ./.env: run from the log folder, where none can be.
    return await_ready(spawn(name, command, port, core, logs, env=values, cwd=logs), "/readyz", 30)


async def start_slotgate_over(
    upstream_url: str, logs: Path, env: dict[str, str] | None = None
) -> Server:
    """slotgate, free on every core, in front of a stand-in that this process runs: waited for
    in a thread, so that the stand-in goes on answering meanwhile. The slotgate measured is
    the one this Python imports (its PYTHONPATH is passed on)."""
    values = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **(env or {})}
    return await asyncio.to_thread(start_slotgate, "slotgate", upstream_url, logs, values, None)


def await_ready(server: Server, path: str, timeout_s: float) -> Server:
    """`server` once `path` answers 200; stopped, and its log's tail raised, if it never does."""
    try:
        wait_http(server.port, path, timeout_s, lambda status: status == 200)
    except TimeoutError:
        server.stop()
        raise RuntimeError(f"{server.name} did not become ready:\n{server.tail()}") from None
    return server


# -- nginx --

_NGINX_CONF = """
{user}
worker_processes 1;
worker_rlimit_nofile 65536;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    upstream standin {{
        {balance}
        {servers}
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://standin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def start_nginx(
    upstream: int | list[int],
    logs: Path,
    balance: str = "",
    core: int | None = SERVER_CORE,
    name: str = "nginx",
) -> Server:
    """nginx in front of one upstream port, or several with a `balance` method (`least_conn`)."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed")
    port = free_port()
    work = logs / name
    work.mkdir(exist_ok=True)
    user = "user root;" if os.geteuid() == 0 else ""
    conf = work / "nginx.conf"
    ports = [upstream] if isinstance(upstream, int) else upstream
    servers = " ".join(f"server 127.0.0.1:{each};" for each in ports)
    method = f"{balance};" if balance else ""
    conf.write_text(
        _NGINX_CONF.format(user=user, work=work, servers=servers, balance=method, port=port)
    )
    command = [binary, "-c", str(conf), "-p", str(work), "-g", "daemon off;"]
    return await_ready(spawn(name, command, port, core, logs), "/props", 20)


# -- LiteLLM --

_LITELLM_CONF = """
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: http://127.0.0.1:{upstream}/v1
      api_key: sk-bench
litellm_settings:
  telemetry: false
  drop_params: true
"""


def litellm_binary() -> Path | None:
    binary = LITELLM_VENV / "bin" / "litellm"
    return binary if binary.exists() else None


def _litellm(upstream: int, logs: Path) -> Server:
    binary = litellm_binary()
    if binary is None:
        raise RuntimeError("LiteLLM is not installed (bench/.venv-litellm)")
    port = free_port()
    conf = logs / "litellm.yaml"
    conf.write_text(_LITELLM_CONF.format(upstream=upstream))
    env = {
        # No network here: use the cost map shipped in the package instead of fetching one.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_ADMIN_UI": "True",
        # slotgate runs open here too (no API_KEYS), so LiteLLM is run without a master key.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        "PYTHONPATH": "",
    }
    command = [
        str(binary),
        "--config",
        str(conf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    server = spawn("litellm", command, port, SERVER_CORE, logs, env=env, cwd=logs)
    return await_ready(server, "/health/liveliness", 120)
