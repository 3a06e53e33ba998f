"""A llama-server in router mode (started without a model: `--models-dir`, `--models-preset`):
the models it serves, each a pool in its model's lane (app/gate/models.py), followed from its
`GET /models` and each loaded model's `GET /props?model=ID`.

The router starts one child llama-server per model and forwards a request by its `model`; its
own `/props` (`"role": "router"`) has no slots. So slotgate reads `/models` for the ids, aliases
and states, and each running child's props through the router for its slots and context. A
model whose line has waiters is loaded (`POST /models/load`) when the router loads on demand,
as the router itself would on their first request; slotgate holds them until the child's slots
are known, so a child never gets more than its slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import orjson
from slotgate.errors import ExchangeFailed, ModelLoadFailed
from slotgate.gate.models import RUNNING, Lane, Models
from slotgate.gate.pool import Pool
from slotgate.gate.swaps import Demand, Plan, Swaps
from slotgate.upstreams.props import Props

if TYPE_CHECKING:
    from slotgate.upstreams.upstream import Upstream

log = logging.getLogger("slotgate.router")

#: A model whose load failed (its child exited) is asked to load again for its line at most
#: this often: a broken model file would fail every time, and each try costs the router a start.
FAILED_RELOAD_S = 5.0


class Server(Protocol):
    """What a router's follower asks of its upstream (an `Upstream`)."""

    @property
    def url(self) -> str: ...

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET of one of the router's control paths: its status and body."""
        ...

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """A POST of JSON to one of the router's control paths: its status and body."""
        ...

    def kv_budget_tokens(self, props: Props) -> int | None:
        """The KV budget of a server with these props (a running child), if one binds."""
        ...


class Child:
    """One model on one router: its pool in the model's lane and what the router says of it."""

    __slots__ = (
        "asked_at", "lane", "loaded_since", "loads", "model", "n_ctx", "pool", "read_at",
        "state", "stopped_at", "unload_asked_at", "waiting_since",
    )  # fmt: skip

    def __init__(self, model: str, lane: Lane, pool: Pool) -> None:
        self.model = model
        self.lane = lane
        self.pool = pool
        self.state = "unloaded"
        self.n_ctx: int | None = None
        #: When its props were last read (monotonic); None: not since it last loaded.
        self.read_at: float | None = None
        #: Loads slotgate asked of the router for this model, the last one when.
        self.loads = 0
        self.asked_at = 0.0
        self.unload_asked_at = 0.0
        #: Since when its line has had waiters, and since when it has been loaded (monotonic),
        #: as seen at each refresh: what the swap rule reads (app/gate/swaps.py).
        self.waiting_since: float | None = None
        self.loaded_since: float | None = None
        #: When it last stopped running: a line that just had the router waits from then on,
        #: behind lines that waited while it ran (or two lines would swap back and forth).
        self.stopped_at: float | None = None

    def demand(self, now: float) -> Demand:
        # A request that asked for it and did not wait counts as one waiting (Lane.wanted).
        queued = self.lane.admission.queued or int(self.lane.wanted)
        if not queued:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = now
        if self.state not in RUNNING:
            if self.loaded_since is not None:
                self.stopped_at = now
            self.loaded_since = None
        elif self.loaded_since is None:
            self.loaded_since = now
        waited_s = 0.0
        if self.waiting_since is not None:
            waited_s = now - max(self.waiting_since, self.stopped_at or self.waiting_since)
        return Demand(
            self.model, self.state, self.pool.active, queued, waited_s,
            0.0 if self.loaded_since is None else now - self.loaded_since,
        )  # fmt: skip


class Router:
    """What one router serves. Its `refresh` runs in its upstream's follower, after `/props`
    said `"role": "router"`."""

    def __init__(
        self,
        server: Server,
        models: Models,
        adopt: Callable[[Pool], None],
        swap_after_s: float = 10.0,
        refresh_s: float = 10.0,
    ) -> None:
        #: The router's URL when it showed itself one: what its models' lines know it by.
        self.url = server.url
        self._server = server
        self._models = models
        self._adopt = adopt
        #: `--models-max` (`max_instances` in its props): how many children run at once.
        self.max_instances: int | None = None
        #: `--models-autoload` (on by default): a request for an unloaded model loads it.
        self.autoload = True
        self.children: dict[str, Child] = {}
        self.swaps = Swaps(swap_after_s)
        # A running child's props are read this often, even while another model's line makes
        # the router be read faster: each read wakes the child's waiting readers, which is
        # what keeps llama-server from noticing clients that left (docs/models.md).
        self._refresh_s = refresh_s
        #: Unloads slotgate asked of the router to make room (the swap rule's).
        self.unloads = 0
        #: An operator drained the router's upstream: every child's pool is drained (what runs
        #: finishes, nothing new goes there), and no model is loaded or unloaded for a line.
        self.draining = False

    @property
    def awaiting(self) -> bool:
        """A line waits for one of its models (so it is worth reading often)."""
        return any(child.pool.awaiting_capacity for child in self.children.values())

    def drain(self) -> None:
        """Out of rotation: every model's pool here, and each new one until `restore`."""
        self.draining = True
        for child in self.children.values():
            child.pool.drain()

    def restore(self) -> None:
        self.draining = False
        for child in self.children.values():
            child.pool.restore()

    async def refresh(self, props: dict[str, Any]) -> None:
        """Follow the router: its props (already read), its models, each running child's slots;
        and load the models whose lines wait."""
        instances = props.get("max_instances")
        self.max_instances = instances if isinstance(instances, int) and instances > 0 else None
        self.autoload = props.get("models_autoload") is not False
        status, body = await self._server.get("/models")
        if status != 200:
            raise ValueError(f"/models answered {status}")
        # orjson: a nesting too deep is a ValueError, not a RecursionError that would end the
        # follower (the router's answers are not slotgate's to trust).
        listed = orjson.loads(body)
        data = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(data, list):
            raise ValueError("/models did not list its models under data")  # noqa: TRY004 - bad data
        seen: dict[str, Child] = {}
        past: list[str] = []
        for entry in data:
            child = self._child(entry, past)
            if child is not None:
                seen[child.model] = child
        self._models.passed_over(self.url, past)
        for model in self.children.keys() - seen.keys():
            child = self.children.pop(model)
            log.info("model left the router: %s url=%s", model, self.url)
            child.lane.states.pop(self.url, None)
            child.lane.holds.discard(self.url)
            self._models.unlist(child.lane, self.url)
            # Retired, not only emptied: should it come back, it comes with a pool of its own.
            child.pool.retire()
        now = time.monotonic()
        held = set(self.swaps.held)
        demands = [c.demand(now) for c in seen.values()]
        if self.draining or self._models.paused:
            # Nothing loaded or unloaded for lines that cannot be served here now: a drained
            # router takes no new work, and a paused gate grants no one (a load would only
            # take the router's memory from what it runs, a swap cut nothing but gain
            # nothing). Holds under way stay; the rule picks up again on restore or resume,
            # its waiters' clocks having run meanwhile.
            plan = Plan(hold=set(self.swaps.held))
        else:
            plan = self.swaps.plan(self.max_instances, demands)
        for model in self.swaps.held - held:
            log.info(
                "holding model for a swap: %s (no new work; its running requests finish) url=%s",
                model, self.url,
            )  # fmt: skip
        for child in seen.values():
            # Holds first, before any await can let a request in on a model being emptied.
            if child.model in plan.hold:
                child.lane.holds.add(self.url)
                child.read_at = None
                child.pool.resize(None)
            else:
                child.lane.holds.discard(self.url)
        for child in seen.values():
            await self._follow(child, plan, now)
        for model in plan.unload:
            child = seen[model]
            if child.pool.active:
                continue  # let in before its hold: unloaded once it is empty
            # The router lists a model as loaded until its child has stopped: ask once.
            if now - child.unload_asked_at >= FAILED_RELOAD_S:
                child.unload_asked_at = now
                await self._unload(child)
        if not self._models.closed:
            for model in plan.load:
                child = seen[model]
                if not (self.autoload or child.lane.wanted):
                    continue
                if child.state == "unloaded" or now - child.asked_at >= FAILED_RELOAD_S:
                    child.lane.wanted = False
                    await self._load(child)

    def _child(self, entry: Any, past: list[str]) -> Child | None:
        if not isinstance(entry, dict) or not isinstance(model := entry.get("id"), str):
            return None
        aliases = entry.get("aliases")
        names = [a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else []
        status = entry.get("status")
        status = status if isinstance(status, dict) else {}
        state = status.get("value")
        state = state if isinstance(state, str) else "unloaded"
        child = self.children.get(model)
        lane = self._models.lane(model, names, self.url)
        if lane is None:
            past += (model, *names)  # past MAX_MODELS: refused, in words that say so
            return None
        if child is None:
            pool = lane.admission.add_pool(f"{self.url}#{model}")
            self._adopt(pool)
            if self.draining:
                pool.drain()
            child = self.children[model] = Child(model, lane, pool)
            log.info("model on the router: %s (%s) url=%s", model, state, self.url)
        code = None
        if status.get("failed") is True:
            state = "failed"
            lane.loading_since = None  # no load under way to time
            code = status.get("exit_code")
            code = code if isinstance(code, int) and not isinstance(code, bool) else None
            if code is not None:
                lane.exit_codes[self.url] = code
        else:
            lane.exit_codes.pop(self.url, None)
        failed_now = state == "failed" and child.state != "failed"
        child.state = state
        lane.states[self.url] = state
        if failed_now and lane.state == "failed" and not lane.running:
            # As the router answers its own waiters when a load fails: none of them waits out
            # STARTUP_WAIT_S for a model no router has. The next request asks for it again.
            log.warning("model failed to load: %s exit_code=%s url=%s", model, code, self.url)
            lane.admission.turn_away(lambda: ModelLoadFailed(model, code))
        lane.autoload = self.autoload
        return child

    async def _follow(self, child: Child, plan: Plan, now: float) -> None:
        pool = child.pool
        if child.state not in RUNNING or child.model in plan.hold:
            # Not running, or held for a swap (done already): its line takes no new work here.
            child.read_at = None
            pool.resize(None)
            return
        if child.read_at is not None and now - child.read_at < self._refresh_s:
            return
        child.read_at = now
        # The child's own props, through the router; never a load of its own making.
        try:
            target = f"/props?model={quote(child.model, safe='')}&autoload=false"
            status, body = await self._server.get(target)
            props = Props.parse(orjson.loads(body)) if status == 200 else None
        except (ValueError, ExchangeFailed, TimeoutError) as exc:
            log.info("cannot read %s's props: %s url=%s", child.model, exc, self.url)
            props = None
        if props is None:
            child.read_at = None
            pool.resize(None)
            return
        child.n_ctx = props.n_ctx
        # The budget first: the resize lets in whoever waited, weighed by the budget too.
        pool.resize_budget(self._server.kv_budget_tokens(props))
        lane = child.lane
        if lane.loading_since is not None and pool.capacity is None:
            # The load it asked for is done: what the next deadline for this model reckons with.
            lane.load_s = time.monotonic() - lane.loading_since
            lane.loading_since = None
        if pool.capacity != props.total_slots:
            log.info(
                "model ready: %s total_slots=%d n_ctx=%s url=%s",
                child.model, props.total_slots, props.n_ctx, self.url,
            )  # fmt: skip
        pool.resize(props.total_slots)
        child.lane.wanted = False

    async def _load(self, child: Child) -> None:
        """Ask the router to load a model whose line waits (as a request would have)."""
        child.loads += 1
        child.asked_at = time.monotonic()
        log.info("loading model for its line: %s url=%s", child.model, self.url)
        if await self._ask("load", child.model):
            child.state = child.lane.states[self.url] = "loading"
            if child.lane.loading_since is None:
                child.lane.loading_since = child.asked_at

    async def _unload(self, child: Child) -> None:
        """Ask the router to unload a model, to make room for another line (the swap rule)."""
        self.unloads += 1
        log.info("unloading model to make room: %s url=%s", child.model, self.url)
        await self._ask("unload", child.model)

    async def _ask(self, action: str, model: str) -> bool:
        """`POST /models/{action}` for `model`: did the router take it? A refusal is logged."""
        try:
            status, body = await self._server.post(f"/models/{action}", {"model": model})
        except (ExchangeFailed, TimeoutError) as exc:
            log.warning("cannot %s %s: %s url=%s", action, model, exc, self.url)
            return False
        if status != 200:
            text = body[:200].decode("utf-8", "replace")
            log.warning("%sing %s answered %d: %s url=%s", action, model, status, text, self.url)
        return status == 200

    def metrics_targets(self) -> list[tuple[str, str]]:
        """(model, path) of every running child's `/metrics` (the router's own is a 400)."""
        return [
            (model, f"/metrics?model={quote(model, safe='')}&autoload=false")
            for model, child in self.children.items()
            if child.state in RUNNING
        ]

    def lost(self) -> None:
        """The router does not answer: no child's slots are known until it does again."""
        for child in self.children.values():
            child.read_at = None
            child.pool.resize(None)

    def close(self) -> None:
        """The router's upstream leaves: its children's slots are gone."""
        self._models.passed_over(self.url, ())
        for child in self.children.values():
            child.lane.states.pop(self.url, None)
            child.lane.holds.discard(self.url)
            self._models.unlist(child.lane, self.url)
            child.pool.retire()


async def served_names(upstream: Upstream) -> tuple[str, ...]:
    """The names a server of one model answers to: its `/v1/models` id, then its aliases;
    else its /props model. What a request's `model` is matched against when upstreams serve
    different models (app/upstreams/fleet.py)."""
    props = upstream.props
    fallback = (props.model,) if props is not None and props.model else ()
    try:
        status, body = await upstream.get("/v1/models")
        data = orjson.loads(body).get("data") if status == 200 else None
    except (ExchangeFailed, TimeoutError, ValueError, AttributeError):
        return fallback
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        return fallback
    aliases = first.get("aliases")
    names = [a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else []
    return (first["id"], *names)


__all__ = ["Child", "Router", "Server", "served_names"]
