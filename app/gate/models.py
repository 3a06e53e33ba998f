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
    aliases: frozenset[str] = frozenset()
    #: Some router serving it loads it on demand (`models_autoload`, its default).
    autoload: bool = True
    #: A request asked for it to be loaded (`?autoload=true`) though its routers do not load
    #: on demand: the next look loads it, as the router would for that request.
    wanted: bool = False
    #: Held for a swap on some router: no new work there until it is unloaded
    #: (app/gate/swaps.py).
    held: bool = False
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
        self.closed = False

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._lanes.values())

    def __len__(self) -> int:
        return len(self._lanes)

    def find(self, name: str) -> Lane | None:
        """The lane of the model with this id, else with this alias; None if none serves it."""
        lane = self._lanes.get(name)
        return lane if lane is not None else self._aliases.get(name)

    def lane(self, model: str, aliases: Iterable[str] = ()) -> Lane | None:
        """The lane of `model` (made on first sight), its aliases as last listed; None once
        MAX_MODELS lines exist and this is not one of them."""
        lane = self._lanes.get(model)
        if lane is None:
            if len(self._lanes) >= self._limit:
                return None
            admission = self._make()
            if self.closed:
                admission.close()
            lane = self._lanes[model] = Lane(model, admission, Local(admission))
        names = frozenset(aliases) - {model}
        if names != lane.aliases:
            lane.aliases = names
            self._aliases = {a: x for x in self._lanes.values() for a in x.aliases}
        return lane

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants: every line's weights and limits from now on."""
        tenants = tuple(tenants)
        for lane in self._lanes.values():
            lane.gate.retune(tenants)

    def close(self) -> None:
        """Shutdown: every line turns its waiters away and takes no one new."""
        self.closed = True
        for lane in self._lanes.values():
            lane.admission.close()


__all__ = ["MAX_MODELS", "RUNNING", "STATES", "Lane", "Models"]
