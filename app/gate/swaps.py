"""Model swaps planned, not suffered: which of a router's models to load, to hold (take no
new work, so that it empties) and to unload, when its lines want more models than it runs.

Standard library only; it reads numbers (`Demand`) and says what to do (`Plan`); the router's
follower (app/upstreams/router.py) does it. The rule, with `swap_after_s` its one parameter:

1. A model whose line has waiters and that the router does not run is *wanting*; the wanting
   are served in the order of their oldest waiter.
2. While the router runs fewer models than `max_instances`, a wanting model is loaded at once.
3. When it is full, an *idle* model (loaded, nothing running, nobody waiting) is held and
   unloaded to make room (slotgate names the victim, so that the router never evicts a busy
   one).
4. When every model it runs has work, they are kept loaded: a busy model is never evicted for
   a newcomer, so the router never ping-pongs between two lines. But once the wanting model's
   oldest waiter has waited `swap_after_s`, one model is *held*: it takes no new work, its
   running requests finish (none is cut), then it is unloaded and the wanting model loaded;
   all of that model's waiters then run together, as many at once as its slots.
5. The victim is the model that has been loaded at least `swap_after_s` (a model just loaded
   is never swapped out before its line has had that long) with the least waiting work (the
   fewest waiters; then the one loaded longest).

So a line waits at most about `swap_after_s` + the longest running request of the victim +
one unload and one load, per model ahead of it in rule 1's order; with two models behind a
`--models-max 1` router, each line gets the router at least every `2 x swap_after_s` plus the
swap times, and no swap happens while both lines are empty or only one has work.

No plan is made (nothing loaded, unloaded or newly held) while an operator has paused the gate
or drained the router: the follower skips it (app/upstreams/router.py), and the waiters'
clocks run on, so the rule picks up where the lines stand on resume or restore.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

#: States in which a model counts against the router's `max_instances`.
RUNNING_STATES = frozenset({"loaded", "sleeping", "loading", "downloading"})


@dataclass(frozen=True, slots=True)
class Demand:
    """One model on one router, as the plan reads it."""

    model: str
    #: The router's state for it (`loaded`, `loading`, `unloaded`, ... `failed`).
    state: str
    #: Requests of its line running on this router, and waiting in its line.
    active: int
    queued: int
    #: How long its oldest waiter has waited (0 with nobody waiting).
    waited_s: float = 0.0
    #: How long it has been loaded (0 when it is not).
    loaded_s: float = 0.0


@dataclass(slots=True)
class Plan:
    """What to do now: models to load, to unload, and to hold (no new work)."""

    load: list[str] = field(default_factory=list)
    unload: list[str] = field(default_factory=list)
    hold: set[str] = field(default_factory=set)


class Swaps:
    """The swap rule of one router (module docstring), with the holds it has started."""

    def __init__(self, swap_after_s: float) -> None:
        self.swap_after_s = swap_after_s
        #: Models held for a swap, until they are unloaded.
        self.held: set[str] = set()

    def plan(self, max_instances: int | None, demands: Iterable[Demand]) -> Plan:
        demands = list(demands)
        running = [d for d in demands if d.state in RUNNING_STATES]
        # A hold ends when the model is no longer running (unloaded, or its load failed).
        self.held &= {d.model for d in running}
        wanting = sorted(
            (d for d in demands if d.state not in RUNNING_STATES and d.queued > 0),
            key=lambda d: -d.waited_s,
        )
        plan = Plan(hold=set(self.held))
        free = len(wanting) if max_instances is None else max_instances - len(running)
        for demand in wanting[: max(free, 0)]:
            plan.load.append(demand.model)  # rule 2
        if free >= len(wanting):
            return plan
        first = wanting[max(free, 0)]
        loaded = [d for d in running if d.state in ("loaded", "sleeping")]
        # A held model empties: once nothing of its runs, it makes the room.
        emptied = [d for d in loaded if d.model in self.held and d.active == 0]
        if emptied:
            plan.unload.append(emptied[0].model)
            return plan
        if self.held:
            return plan  # a swap is under way: wait for it
        idle = [d for d in loaded if d.active == 0 and d.queued == 0]
        if idle:
            # Rule 3; held too, so that nothing is let in on it while it is unloaded.
            empty = min(idle, key=lambda d: -d.loaded_s).model
            self.held.add(empty)
            plan.hold.add(empty)
            plan.unload.append(empty)
            return plan
        if first.waited_s < self.swap_after_s:
            return plan  # rule 4: busy models stay loaded for now
        victims = [d for d in loaded if d.loaded_s >= self.swap_after_s]
        if not victims:
            return plan  # rule 5: none has had its time yet
        victim = min(victims, key=lambda d: (d.queued, -d.loaded_s))
        self.held.add(victim.model)
        plan.hold.add(victim.model)
        if victim.active == 0:
            plan.unload.append(victim.model)
        return plan


__all__ = ["RUNNING_STATES", "Demand", "Plan", "Swaps"]
