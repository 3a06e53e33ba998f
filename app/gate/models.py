"""One line per model: the models llama-server routers serve, each a `Lane` with an admission
core of its own (its pools, KV budgets, hold clock and bounded line), found by id or alias.

Standard library only; it knows nothing of HTTP or of how the models were learned (a router's
`/models`, app/upstreams/router.py). While no upstream is a router, `Models.routed` is False
and the request path never looks here: one model costs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from slotgate.gate.admission import Admission
from slotgate.gate.entry import Local
from slotgate.gate.pool import Pool
from slotgate.gate.tenants import Tenant

#: A router's states for a model (`GET /models` `status.value`), and `failed` for a load that
#: exited (`status.failed`, with its `exit_code`).
STATES = frozenset({"unloaded", "loading", "loaded", "sleeping", "downloading", "failed"})
#: States in which a model has a running child server with known slots.
RUNNING = frozenset({"loaded", "sleeping"})


@dataclass(eq=False, slots=True)
class Lane:
    """One model's line: its admission core, the way into it, and what its routers say."""

    #: Its id on the routers (their `/models` `id`, a file name without `.gguf`).
    model: str
    admission: Admission
    gate: Local
    #: Every alias any upstream lists for it (`named`, by upstream URL).
    aliases: frozenset[str] = frozenset()
    named: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Some router serving it loads it on demand (`models_autoload`, its default).
    autoload: bool = True
    #: A request asked for it while it was not running (with `?autoload=true` where its
    #: routers do not load on demand, or without waiting for it: STARTUP_WAIT_S=0): the next
    #: look loads it, as the router would for that request, waiters or none.
    wanted: bool = False
    #: The routers (by URL) holding it for a swap: no new work there until it is unloaded
    #: (app/gate/swaps.py).
    holds: set[str] = field(default_factory=set)
    #: Its state on each router serving it, and a failed load's exit code, by router URL.
    states: dict[str, str] = field(default_factory=dict)
    exit_codes: dict[str, int] = field(default_factory=dict)
    #: How long its last load took, from slotgate asking a router for it to its slots known
    #: (seconds); None until one was seen. What a deadline adds for a model not running.
    load_s: float | None = None
    #: Since when (monotonic) a load slotgate asked for has been under way; None: none is.
    loading_since: float | None = None

    def load_eta_s(self, now: float) -> float:
        """How long until its slots should be known: nothing once it runs; else what its last
        load took, less what a load under way has taken already (0 before any load was seen:
        a first load's time is not known)."""
        if self.running or self.load_s is None:
            return 0.0
        if self.loading_since is None:
            return self.load_s
        return max(self.load_s - (now - self.loading_since), 0.0)

    @property
    def state(self) -> str:
        """The best of its routers' states: loaded anywhere is loaded."""
        for state in ("loaded", "sleeping", "loading", "downloading", "unloaded"):
            if state in self.states.values():
                return state
        return "failed" if self.states else "unloaded"

    @property
    def held(self) -> bool:
        """Held for a swap on some router (each router holds its own child alone)."""
        return bool(self.holds)

    @property
    def running(self) -> bool:
        """A router has it loaded (its slots are known there)."""
        return self.admission.capacity is not None


#: The most models slotgate keeps a line for: models are few, but what a router lists is not
#: slotgate's to trust without a bound (every line is memory, every model a metrics label).
MAX_MODELS = 64


class Models:
    """The lanes by model id and alias, as llama-server's router matches them: an id first,
    then an alias, exactly (case and all)."""

    def __init__(self, make: Callable[[], Admission], limit: int = MAX_MODELS) -> None:
        self._make = make
        self._limit = limit
        #: Some upstream is a router: a gated request finds its line here by its model.
        self.routed = False
        self._lanes: dict[str, Lane] = {}
        self._aliases: dict[str, Lane] = {}
        #: The names (ids and aliases) of models each upstream lists past the limit, by its
        #: URL: read only to word a refusal.
        self._past: dict[str, frozenset[str]] = {}
        self.closed = False
        #: An operator paused admission: every line, and each made until `resume`, grants no
        #: one (the request path reaches a line only through this, so none can miss it).
        self.paused = False

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes.values())

    def __len__(self) -> int:
        return len(self._lanes)

    def find(self, name: str) -> Lane | None:
        """The lane of the model with this id, else with this alias; None if none serves it."""
        lane = self._lanes.get(name)
        return lane if lane is not None else self._aliases.get(name)

    @property
    def limit(self) -> int:
        return self._limit

    def passed_over(self, url: str, names: Iterable[str]) -> None:
        """The models the upstream at `url` lists that got no line (past the limit), as it
        last listed them."""
        past = frozenset(names)
        if past:
            self._past[url] = past
        else:
            self._past.pop(url, None)

    def past(self, name: str) -> bool:
        """An upstream serves a model of that name, but it has no line (past the limit)."""
        return any(name in names for names in self._past.values())

    def lane(self, model: str, aliases: Iterable[str] = (), source: str = "") -> Lane | None:
        """The lane of `model` (made on first sight), with the aliases `source` (an upstream's
        URL) last listed for it beside those of the others; None once MAX_MODELS lines exist,
        this is not one of them and none can be forgotten."""
        lane = self._lanes.get(model)
        if lane is None:
            if len(self._lanes) >= self._limit and not self._forget_one():
                return None
            admission = self._make()
            if self.closed:
                admission.close()
            elif self.paused:
                admission.pause()
            lane = self._lanes[model] = Lane(model, admission, Local(admission))
        names = frozenset(aliases) - {model}
        if lane.named.get(source) != names:
            lane.named[source] = names
            self._realias(lane)
        return lane

    def unlist(self, lane: Lane, source: str) -> None:
        """The upstream at `source` lists the model no more: its aliases go with it."""
        if lane.named.pop(source, None):
            self._realias(lane)

    def _realias(self, lane: Lane) -> None:
        # Several upstreams may name one model differently (routers with other --alias
        # presets, a server of one model with none): a request may use any of the names.
        names = frozenset().union(*lane.named.values())
        if names != lane.aliases:
            lane.aliases = names
            self._aliases = {a: x for x in self._lanes.values() for a in x.aliases}

    def _forget_one(self) -> bool:
        """Make room: drop a line no upstream lists any more and nothing holds or waits in
        (a router whose models were renamed or replaced), else none. Its core is closed, so a
        request that found it just before is told (503), not left waiting in a dead line."""
        for model, lane in self._lanes.items():
            admission = lane.admission
            if not lane.states and not admission.active and not admission.queued:
                del self._lanes[model]
                admission.close()
                self._aliases = {a: x for x in self._lanes.values() for a in x.aliases}
                return True
        return False

    def unplace(self, pool: Pool, source: str) -> None:
        """The upstream at `source` no longer serves the model of the line `pool` is in (it
        came back serving another, or as a router): the pool retires, the line forgets it."""
        for lane in self._lanes.values():
            if pool in lane.admission.pools:
                lane.states.pop(source, None)
                lane.exit_codes.pop(source, None)
                self.unlist(lane, source)
        pool.retire()

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants: every line's weights and limits from now on."""
        tenants = tuple(tenants)
        for lane in self._lanes.values():
            lane.gate.retune(tenants)

    def pause(self) -> None:
        """An operator holds admission: no line grants anyone until `resume`."""
        self.paused = True
        for lane in self._lanes.values():
            lane.admission.pause()

    def resume(self) -> None:
        """Every line moves again, each in its own order."""
        self.paused = False
        for lane in self._lanes.values():
            lane.admission.resume()

    def close(self) -> None:
        """Shutdown: every line turns its waiters away and takes no one new."""
        self.closed = True
        for lane in self._lanes.values():
            lane.admission.close()


__all__ = ["MAX_MODELS", "RUNNING", "STATES", "Lane", "Models"]
