"""One upstream's share of the admission core: its slots and its KV-cache budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotgate.gate.routing import stable_hash

if TYPE_CHECKING:
    from slotgate.gate.admission import Admission
    from slotgate.gate.ticket import Ticket


class Pool:
    """One upstream's slots and KV-cache budget in the fleet; its capacity is None while the
    upstream is not ready (starting, restarting, down), and then nothing is routed to it."""

    __slots__ = (
        "_admission", "active", "budget", "capacity", "committed", "key", "retired", "routed",
        "salt", "seen",
    )  # fmt: skip

    def __init__(self, admission: Admission, key: str) -> None:
        self._admission = admission
        self.key = key
        #: Its rendezvous identity: the same for the same upstream on every replica.
        self.salt = stable_hash(key)
        self.capacity: int | None = None
        #: Its last known capacity: what it likely has again once back.
        self.seen = 0
        self.active = 0
        #: The KV-cache tokens its slots share when that binds admission (else None), and what
        #: the requests it runs hold of them.
        self.budget: int | None = None
        self.committed = 0
        #: Grants by how the pool was chosen: its key's first choice, by load, or on a retry.
        self.routed = {"affinity": 0, "load": 0, "retry": 0}
        self.retired = False

    @property
    def free(self) -> int:
        return max((self.capacity or 0) - self.active, 0)

    @property
    def cold(self) -> bool:
        return self._admission.cold

    @property
    def awaiting_capacity(self) -> bool:
        """Somebody waits for this upstream's capacity (so it is worth reading often)."""
        return self.capacity is None and self._admission.awaiting_capacity

    def resize(self, capacity: int | None) -> None:
        """Follow the upstream's slot count; None means it is unknown (not ready).

        Growth admits waiters at once in FIFO order. On shrink, slots held above the new
        capacity retire as their holders release them: nobody is admitted to this pool until
        `active` is back under the ceiling.
        """
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if self.retired:
            capacity = None
        self.capacity = capacity
        if capacity is not None:
            self.seen = capacity
        self._admission._resized()
        self._admission._notify(self)

    def resize_budget(self, budget_tokens: int | None) -> None:
        """Follow the upstream's KV-cache budget; None (or 0) means it does not bind.

        Growth admits waiters at once in FIFO order; on shrink, tokens held above the new
        budget are returned as their holders finish. A cost above the budget is cut to it when
        granted here, so such a request runs alone rather than never.
        """
        # A budget that is not positive (a llama-server reporting n_ctx 0 or less) binds
        # nothing: taken as one, every cost cut to it would make the committed count negative.
        self.budget = budget_tokens if budget_tokens is not None and budget_tokens > 0 else None
        self._admission._rebudgeted(self)

    def retire(self) -> None:
        """The upstream is gone for good (its address left DNS): route nothing more to it; it
        leaves the fleet once its last request ends."""
        self.retired = True
        self.resize(None)
        self._admission._forget(self)

    def rename(self, key: str) -> None:
        """Its upstream is known by another URL now (an address of its name)."""
        self.key = key
        self.salt = stable_hash(key)
        self._admission._notify(self)

    def revive(self) -> None:
        """Its upstream is back before it left (its address returned while its last requests
        ran): route to it again from its next `resize`."""
        self.retired = False

    def charge(self, ticket: Ticket) -> int:
        """The tokens of this pool's budget that `ticket` takes."""
        budget = self.budget
        if budget is None:
            return ticket.cost
        if not ticket.costed:
            return budget
        return min(ticket.cost, budget)

    def fits(self, weight: int, charge: int) -> bool:
        """Room for `weight` slots and `charge` tokens now? The tokens always fit when nothing
        holds any (so that no request is stranded) or when the budget does not bind."""
        capacity = self.capacity
        if capacity is None or self.active + weight > capacity:
            return False
        budget = self.budget
        return budget is None or not self.committed or self.committed + charge <= budget

    def __repr__(self) -> str:
        return f"<Pool {self.key} capacity={self.capacity} active={self.active}>"
