"""Which upstream a request goes to, among those with room: its cache affinity first, load second.

Standard library only. The affinity key picks an upstream by rendezvous hashing, so each key
keeps its upstream while upstreams come and go (only the keys of one that leaves move); the
bounded-load rule (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads")
passes an upstream over when it is already loaded above (1 + epsilon) times the fleet's
average, so that one hot key cannot pile work onto one server while the others idle.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

#: Routing by affinity, or by load alone.
ROUTINGS = ("affinity", "least-loaded")
#: How much of a prompt's start makes its affinity key: enough to tell system prompts and
#: first turns apart, short enough that every turn of a conversation starts the same way.
AFFINITY_PREFIX_CHARS = 512

_MASK = (1 << 64) - 1
#: Mixed with a request's arrival number, a draw that is the same on every replica. (Not a
#: low-discrepancy sequence: the slot each draw picks changes what the next one finds free, and
#: successive golden-ratio points then favour some upstreams over others.)
_SPREAD = 0x9E3779B97F4A7C15


class Candidate(Protocol):
    """What routing reads of an upstream's pool."""

    @property
    def salt(self) -> int: ...
    @property
    def capacity(self) -> int | None: ...
    @property
    def active(self) -> int: ...


P = TypeVar("P", bound=Candidate)


def stable_hash(text: str | bytes) -> int:
    """A 64-bit hash that is the same in every process and on every replica (`hash()` of a str
    is salted per process)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def score(key: int, salt: int) -> int:
    """The rendezvous score of an upstream for a key: splitmix64's finaliser of both mixed."""
    z = (key ^ salt) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def choose(
    pools: Sequence[P],
    weight: int,
    fits: Callable[[P], bool],
    key: int | None,
    epsilon: float,
    last: P | None = None,
    spread: int = 0,
) -> tuple[P, bool] | None:
    """The pool for a request of `weight` slots, and whether it is its key's first choice; None
    when no ready pool has room for it (`fits`).

    With a key: the pool that ran the key's last request (`last`, where its prompt is cached
    now), then the pools in the key's rendezvous order, skipping any without room or loaded
    above (1 + epsilon) times the fleet's average share of its capacity once this request is
    counted. Without one, or when every pool with room is loaded beyond that: a pool with room
    in proportion to its free slots, drawn by hashing `spread` (the request's arrival number).
    """
    ready = [pool for pool in pools if pool.capacity]
    if key is not None and len(ready) > 1:
        total_capacity = 0
        total_active = weight
        for pool in ready:
            total_capacity += pool.capacity or 0
            total_active += pool.active
        load = total_active * (1 + epsilon) / total_capacity

        def within(pool: P) -> bool:
            return pool.active + weight <= math.ceil(load * (pool.capacity or 0)) and fits(pool)

        # The key's last pool first: most requests are a conversation's next turn, and then no
        # ranking needs computing.
        # Only among `pools`: a backfill offers the few upstreams the line's head can never
        # use, and the key's last one may be the head's.
        if last is not None and last.capacity and any(p is last for p in ready) and within(last):
            return last, True
        ranked = sorted(ready, key=lambda pool: score(key, pool.salt), reverse=True)
        for rank, pool in enumerate(ranked):
            if pool is not last and within(pool):
                return pool, rank == 0 and last is None
    # Without a key: one free slot of the fleet, each as likely as any other (an upstream with
    # more free slots more often), drawn by hashing `spread`. By symmetry
    # every slot is then as busy as every other: each upstream's share of the work follows its
    # share of the slots at any load, with no state to keep.
    room: list[P] = [pool for pool in ready if fits(pool)]
    if not room:
        return None
    chosen = room[0]
    if len(room) > 1:
        total = 0
        for pool in room:
            total += (pool.capacity or 0) - pool.active
        point = score(spread, _SPREAD) / 2**64 * total
        for pool in room:
            point -= (pool.capacity or 0) - pool.active
            if point < 0:
                chosen = pool
                break
    return chosen, key is not None and len(ready) == 1
