"""The stand-in's router mode: llama-server started without a model (`--models-dir`), one
child per model, each request forwarded by its `model` (the body's for a POST, `?model=` for a
GET), as llama.cpp's tools/server/server-models.cpp does.

A child is a `StandIn` that never listens: the router's connection serves a request with the
child's knobs and counters. What it copies of the real router: `/props` (`"role": "router"`,
`max_instances`, `models_autoload`) and `/props?model=ID` (the child's), `GET /models` (ids,
aliases, `status.value`, failed loads with `exit_code`), `POST /models/load`, `/metrics` a 400
without `?model=`, the errors of `router_validate_model`, a load that takes `load_delay_s`, and
`--models-max`: a load past it evicts the least recently used idle child first (a busy one is
waited for, as llama.cpp's scheduler does).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

if TYPE_CHECKING:
    from tests.support.standin import Connection, StandIn

#: How often a load that waits for an idle child to evict looks again.
_EVICT_POLL_S = 0.01


def _invalid(message: str) -> dict[str, Any]:
    return {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


@dataclass(eq=False)
class Hosted:
    """One model of a router: its child and its state."""

    child: StandIn
    aliases: list[str] = field(default_factory=list)
    #: unloaded | loading | loaded (| failed, with `exit_code`)
    state: str = "unloaded"
    exit_code: int | None = None
    #: A load fails (the child exits with this code) instead of loading.
    fails_with: int | None = None
    used: float = 0.0
    #: Requests waiting for it to load, each called once it has (or has failed).
    waiters: list[Any] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.state == "loaded"


class Routing:
    """A router's models and its scheduler (one per router stand-in)."""

    def __init__(self, standin: StandIn, hosted: dict[str, Hosted]) -> None:
        self.standin = standin
        self.hosted = hosted
        self.loads = 0
        #: Children the router evicted for a load, and those unloaded when asked to.
        self.evictions = 0
        self.unloads = 0
        #: The most children loaded at once.
        self.peak_loaded = 0
        #: (path, model) of every request forwarded to a child, in order.
        self.forwarded: list[tuple[str, str]] = []
        #: What `GET /models` answers instead of the listing (a hostile or broken router).
        self.listing: bytes | None = None

    def find(self, name: str) -> tuple[str, Hosted] | None:
        if name in self.hosted:
            return name, self.hosted[name]
        for model, hosted in self.hosted.items():
            if name in hosted.aliases:
                return model, hosted
        return None

    def models(self) -> dict[str, Any]:
        data = []
        for model, hosted in self.hosted.items():
            status: dict[str, Any] = {"value": hosted.state, "args": []}
            if hosted.state == "failed":
                status = {"value": "unloaded", "args": [], "failed": True,
                          "exit_code": hosted.exit_code}  # fmt: skip
            data.append({"id": model, "aliases": hosted.aliases, "tags": [], "object": "model",
                         "owned_by": "llamacpp", "created": 0, "status": status})  # fmt: skip
        return {"data": data, "object": "list"}

    def props(self) -> dict[str, Any]:
        standin = self.standin
        return {
            "role": "router", "max_instances": standin.models_max,
            "models_autoload": standin.models_autoload, "model_alias": "llama-server",
            "model_path": "none", "default_generation_settings": {"params": None, "n_ctx": 0},
            "build_info": "standin",
        }  # fmt: skip

    def load(self, model: str) -> None:
        """Start loading `model` (evicting first if the router is full)."""
        hosted = self.hosted[model]
        if hosted.state in ("loading", "loaded"):
            return
        hosted.state = "loading"
        asyncio.get_running_loop().call_soon(self._make_room, model)

    def _full(self) -> bool:
        running = [h for h in self.hosted.values() if h.state in ("loaded", "loading")]
        return len(running) >= self.standin.models_max

    def _idle(self) -> list[Hosted]:
        return [h for h in self.hosted.values() if h.state == "loaded" and h.child.running == 0]

    def _make_room(self, model: str) -> None:
        busy = [h for h in self.hosted.values() if h.state in ("loaded", "loading")]
        if len(busy) > self.standin.models_max:
            idle = self._idle()
            if not idle:
                asyncio.get_running_loop().call_later(_EVICT_POLL_S, self._make_room, model)
                return
            victim = min(idle, key=lambda h: h.used)
            victim.state = "unloaded"
            self.evictions += 1
        asyncio.get_running_loop().call_later(self.standin.load_delay_s, self._loaded, model)

    def _loaded(self, model: str) -> None:
        hosted = self.hosted[model]
        if hosted.fails_with is not None:
            hosted.state, hosted.exit_code = "failed", hosted.fails_with
        else:
            hosted.state = "loaded"
            self.loads += 1
            loaded = sum(1 for h in self.hosted.values() if h.state == "loaded")
            self.peak_loaded = max(self.peak_loaded, loaded)
        waiters, hosted.waiters = hosted.waiters, []
        for waiter in waiters:
            waiter()

    def handle(
        self, conn: Connection, method: str, path: str, query: bytes, lower: bytes, raw: bytes,
        body: bytes, target: bytes,
    ) -> bool:  # fmt: skip
        """Serve a request as the router: True if answered (or deferred) here; False to serve
        it on `conn.standin`, set to the child of its model."""
        params = parse_qs(query.decode("latin-1"))
        name = (params.get("model") or [""])[-1]
        if path == "/models" and method == "GET":
            if self.listing is not None:
                from tests.support.standin import head

                listing = self.listing
                conn._send(head(200, b"application/json", len(listing), conn.cors) + listing)
            else:
                conn._json(self.models())
            return True
        if path == "/models/load" and method == "POST":
            found = self.find(str(_field(body, "model")))
            if found is None:
                conn._json({"error": {"code": 404, "message": "model is not found",
                                      "type": "not_found_error"}}, 404)  # fmt: skip
            elif found[1].running:
                conn._json(_invalid("model is already running"), 400)
            elif self._full() and not self._idle():
                # llama.cpp evicts only an idle model: a load into a full router fails.
                conn._json({"error": {"code": 500, "message": "model limit reached, try again "
                                      "later", "type": "server_error"}}, 500)  # fmt: skip
            else:
                self.load(found[0])
                conn._json({"success": True})
            return True
        if path == "/models/unload" and method == "POST":
            found = self.find(str(_field(body, "model")))
            if found is None:
                conn._json(_invalid("model is not found"), 400)
            elif found[1].state not in ("loaded", "loading"):
                conn._json(_invalid("model is not running"), 400)
            else:
                found[1].state = "unloaded"
                self.unloads += 1
                conn._json({"success": True})
            return True
        if path == "/health":
            conn._json({"status": "ok"})
            return True
        if path == "/props" and not name:
            conn._json(self.props())
            return True
        if method == "POST":
            name = str(_field(body, "model") or "")
        elif path not in ("/props", "/metrics", "/slots"):
            return False  # e.g. /v1/models: the router answers with all of its models
        if not name:
            conn._json(_invalid("model name is missing from the request"), 400)
            return True
        found = self.find(name)
        if found is None:
            conn._json(_invalid(f"model '{name}' not found"), 400)
            return True
        model, hosted = found
        said = params.get("autoload")
        autoload = said[-1] in ("true", "1") if said else self.standin.models_autoload
        if not autoload and not hosted.running:
            conn._json(_invalid("model is not loaded"), 400)
            return True
        if not hosted.running:
            conn.held = True
            self.load(model)

            def resume() -> None:
                conn.held = False
                if conn.transport is None:
                    return
                if not hosted.running:
                    conn._json(_invalid(f"model '{model}' failed to load"), 500)
                else:
                    conn._handle(method, target, lower, raw, body)
                if conn.buffer and not conn.busy and not conn.held:
                    conn._parse()

            hosted.waiters.append(resume)
            return True
        if method == "POST":
            hosted.used = time.monotonic()
        self.forwarded.append((path, model))
        conn.standin = hosted.child
        return False


def _field(body: bytes, name: str) -> Any:
    import json
    import re

    if body.startswith(b"--"):  # a form: llama-server reads its fields as a JSON object's
        field = re.search(
            rb'name="' + name.encode() + rb'"\r\n(?:[^\r\n]+\r\n)*\r\n(.*?)\r\n--', body, re.S
        )
        return None if field is None else field.group(1).decode()
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get(name) if isinstance(value, dict) else None


def hosted(slots: int = 2, state: str = "loaded", aliases: list[str] | None = None) -> Hosted:
    """A model for a router stand-in: a child of `slots` slots, three quick tokens an answer."""
    from tests.support.standin import StandIn

    child = StandIn(total_slots=slots, tokens=3, token_delay_s=0.01)
    return Hosted(child, aliases or [], state)


def children(upstream: StandIn) -> dict[str, StandIn]:
    """A router stand-in's children, by model id."""
    assert upstream.hosted is not None
    return {model: h.child for model, h in upstream.hosted.items()}
