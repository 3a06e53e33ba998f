"""The admission core over several upstreams: one FIFO line, each request in one upstream,
routed by its affinity key within a load bound, else to the least loaded."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from slotgate.errors import AdmissionError, NotReady, TooLarge, refusal
from slotgate.gate.admission import Admission
from slotgate.gate.fairline import FairLine
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.pool import Pool
from slotgate.gate.routing import choose, score, stable_hash
from slotgate.gate.tenants import BATCH, Tenant
from slotgate.gate.ticket import Ticket


def fleet(*capacities: int | None, epsilon: float = 0.25, **policy: int) -> Admission:
    admission = Admission(QueuePolicy(**policy), epsilon=epsilon)
    for index, capacity in enumerate(capacities):
        admission.add_pool(f"http://10.0.0.{index + 1}:8080").resize(capacity)
    return admission


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def held(admission: Admission) -> list[int]:
    return [pool.active for pool in admission.pools]


def key_preferring(admission: Admission, index: int) -> int:
    """An affinity key whose first choice is the pool at `index`."""
    pools = admission.pools
    for n in range(10_000):
        key = stable_hash(f"conversation {n}")
        if max(pools, key=lambda pool: score(key, pool.salt)) is pools[index]:
            return key
    raise AssertionError("no key found")


async def test_the_fleets_capacity_is_the_sum_of_its_ready_upstreams() -> None:
    admission = fleet(2, 3, None)
    assert (admission.capacity, admission.largest) == (5, 3)
    assert admission.queue_limit == QueuePolicy().limit(5)
    admission.pools[2].resize(4)
    assert (admission.capacity, admission.largest) == (9, 4)
    assert admission.queue_limit == QueuePolicy().limit(9)


async def test_one_upstream_going_away_takes_only_its_share_and_its_holders_keep_theirs() -> None:
    admission = fleet(1, 1)
    a, b = admission.enter(), admission.enter()
    assert held(admission) == [1, 1]
    assert a.pool is not None
    assert b.pool is not None
    a.pool.resize(None)
    assert admission.capacity == 1
    assert admission.active == 2  # a still holds its slot until it ends or is sent back
    c = admission.enter()
    assert not c.admitted
    b.release()
    await asyncio.wait_for(c.wait(), 1)
    assert c.pool is b.pool
    a.release()
    c.release()
    assert held(admission) == [0, 0]


async def test_no_slot_stays_idle_while_the_head_of_the_line_fits_on_any_upstream() -> None:
    admission = fleet(1, 1, 1)
    tickets = [admission.enter() for _ in range(3)]
    assert all(t.admitted for t in tickets)
    assert held(admission) == [1, 1, 1]
    waiting = [admission.enter() for _ in range(3)]
    # Whichever upstream frees a slot, the head of the line gets it at once.
    for holder, waiter in zip(reversed(tickets), waiting, strict=True):
        holder.release()
        await settle()
        assert waiter.granted
        assert waiter.pool is holder.pool


async def test_grants_follow_arrival_order_across_upstreams() -> None:
    admission = fleet(1, 2, 3, max_queue=0)
    granted: list[int] = []
    holders = [admission.enter() for _ in range(6)]
    waiters = [admission.enter(affinity=stable_hash(str(n))) for n in range(100)]

    async def wait(ticket: Ticket) -> None:
        await ticket.wait()
        granted.append(ticket.seq)
        await asyncio.sleep(random.random() / 1000)
        ticket.release()

    tasks = [asyncio.create_task(wait(t)) for t in waiters]
    await settle()
    for holder in holders:
        holder.release()
    await asyncio.gather(*tasks)
    assert granted == sorted(granted)
    assert [t.seq for t in waiters] == granted
    assert held(admission) == [0, 0, 0]


async def test_a_request_runs_in_one_upstream_so_the_largest_bounds_its_weight() -> None:
    admission = fleet(2, 2)
    with pytest.raises(TooLarge):
        admission.enter(weight=3)
    two = admission.enter(weight=2)
    assert two.admitted
    assert sorted(held(admission)) == [0, 2]
    other = next(pool for pool in admission.pools if pool is not two.pool)
    other.resize(4)
    three = admission.enter(weight=3)
    assert three.admitted
    assert three.pool is other


async def test_a_heavy_head_waits_for_one_upstream_with_room_and_nobody_overtakes_it() -> None:
    admission = fleet(2, 2)
    full = [admission.enter() for _ in range(4)]
    # One request running on each upstream.
    for pool in admission.pools:
        next(t for t in full if t.pool is pool).release()
    a, b = (t for t in full if not t._released)
    assert held(admission) == [1, 1]
    pair = admission.enter(weight=2)
    light = admission.enter()
    assert not pair.admitted
    assert not light.granted  # a slot is free on both, but the head needs two on one
    a.release()
    await settle()
    assert pair.granted
    assert pair.pool is a.pool
    assert light.granted  # the other upstream's free slot, right after the head
    assert light.pool is b.pool
    for t in (b, pair, light):
        t.release()


async def test_a_key_keeps_its_upstream_while_that_upstream_has_room_and_is_not_overloaded() -> (
    None
):
    admission = fleet(4, 4, 4)
    key = key_preferring(admission, 1)
    first = admission.enter(affinity=key)
    assert first.pool is admission.pools[1]
    assert admission.pools[1].routed["affinity"] == 1
    first.release()
    # Turn after turn (one at a time), the same upstream.
    for _ in range(10):
        ticket = admission.enter(affinity=key)
        assert ticket.pool is admission.pools[1]
        ticket.release()
    assert admission.pools[1].routed["affinity"] == 11


async def test_a_hot_key_spills_to_its_next_choice_past_the_load_bound() -> None:
    admission = fleet(4, 4, 4, epsilon=0.25)
    key = key_preferring(admission, 0)
    tickets = [admission.enter(affinity=key) for _ in range(12)]
    counts = held(admission)
    assert sum(counts) == 12
    # Never above (1 + epsilon) x the average share, so the key's first choice took only part.
    assert counts[0] < 12
    assert all(count <= 4 for count in counts)
    assert sum(p.routed["load"] for p in admission.pools) > 0
    for ticket in tickets:
        ticket.release()


def test_the_bounded_load_holds_at_every_step_while_a_single_key_fills_the_fleet() -> None:
    class Candidate:
        def __init__(self, salt: int, capacity: int) -> None:
            self.salt, self.capacity, self.active = salt, capacity, 0

    pools = [Candidate(stable_hash(str(n)), capacity) for n, capacity in enumerate((8, 8, 16))]
    key = stable_hash("hot")
    for _ in range(24):
        chosen = choose(pools, 1, lambda p: p.active < p.capacity, key, 0.25)
        assert chosen is not None
        pool, _ = chosen
        total = sum(p.active for p in pools) + 1
        bound = -(-1.25 * total * pool.capacity // 32)
        assert pool.active + 1 <= max(bound, 1)
        pool.active += 1
    assert sum(p.active for p in pools) == 24


def test_keys_move_only_off_an_upstream_that_leaves() -> None:
    class Candidate:
        def __init__(self, name: str) -> None:
            self.salt, self.capacity, self.active = stable_hash(name), 100, 0

    pools = [Candidate(f"u{n}") for n in range(8)]
    keys = [stable_hash(f"k{n}") for n in range(2000)]

    def first(pools: list[Candidate], key: int) -> Candidate:
        chosen = choose(pools, 1, lambda p: True, key, 100.0)
        assert chosen is not None
        return chosen[0]

    before = {k: first(pools, k) for k in keys}
    gone = pools.pop(3)
    after = {k: first(pools, k) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved
    assert all(before[k] is gone for k in moved)
    # And each upstream is the first choice of about an eighth of the keys.
    shares = [sum(1 for k in keys if before[k] is p) for p in [*pools, gone]]
    assert all(150 < share < 350 for share in shares)


async def test_without_a_key_each_upstream_gets_work_in_proportion_to_its_slots() -> None:
    admission = fleet(1, 2, 4, 8)
    # One at a time (a light load): every upstream is idle at each arrival, and each takes
    # its share of the slots, not the largest one all.
    for _ in range(1500):
        admission.enter().release()
    shares = [pool.routed["load"] / 1500 for pool in admission.pools]
    for share, capacity in zip(shares, (1, 2, 4, 8), strict=True):
        assert share == pytest.approx(capacity / 15, rel=0.1), shares
    # Under load, the lowest share of its slots in use takes the next one, to the last slot.
    tickets = [admission.enter() for _ in range(15)]
    assert held(admission) == [1, 2, 4, 8]
    for ticket in tickets:
        ticket.release()


async def test_the_kv_budget_is_each_upstreams_own() -> None:
    admission = fleet(4, 4)
    for pool in admission.pools:
        pool.resize_budget(100)
    big = admission.enter(cost=80)
    other = admission.enter(cost=80)  # does not fit beside the first: the other upstream
    assert big.granted
    assert other.granted
    assert big.pool is not other.pool
    third = admission.enter(cost=80)
    assert not third.granted
    assert admission.snapshot().budget_tokens == 200
    assert admission.committed_tokens == 160
    other.release()
    await settle()
    assert third.granted
    for ticket in (big, third):
        ticket.release()
    assert admission.committed_tokens == 0


async def test_a_request_its_upstream_did_not_take_runs_next_elsewhere_keeping_its_turn() -> None:
    admission = fleet(1, 1)
    a, b = admission.enter(), admission.enter()
    c = admission.enter()  # waits: both upstreams are busy
    dead = a.pool
    assert dead is not None
    dead.resize(None)
    a.reroute(time.monotonic() + 5)
    assert a.position == 1  # ahead of c, which came later
    b.release()
    await a.wait()
    assert a.pool is b.pool
    assert b.pool is not None
    assert b.pool.routed["retry"] == 1
    assert not c.granted
    a.release()
    await c.wait()
    c.release()
    assert held(admission) == [0, 0]


async def test_a_request_sent_back_with_every_upstream_down_is_refused_past_its_deadline() -> None:
    admission = fleet(1)
    a = admission.enter()
    admission.pools[0].resize(None)
    a.reroute(time.monotonic() + 0.05)
    with pytest.raises(NotReady):
        await a.wait()
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_retired_upstream_takes_no_more_work_and_leaves_once_its_requests_end() -> None:
    admission = fleet(1, 1)
    a, b = admission.enter(), admission.enter()
    leaving = a.pool
    assert leaving is not None
    leaving.retire()
    assert leaving in admission.pools  # a still runs there
    c = admission.enter()
    assert not c.granted
    a.release()
    await settle()
    assert leaving not in admission.pools
    assert not c.granted  # its slot left with it
    b.release()
    await c.wait()
    c.release()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enter"), st.integers(1, 3), st.integers(0, 9)),
        st.tuples(st.just("release"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("resize"), st.integers(0, 2), st.sampled_from([None, 1, 2, 3])),
        st.tuples(st.just("reroute"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("budget"), st.integers(0, 2), st.sampled_from([None, 50, 100])),
    ),
    max_size=50,
)


@given(ops=_OPS)
def test_no_upstream_is_ever_above_its_slots_and_nobody_overtakes_under_any_sequence(
    ops: list[tuple[str, int, Any]],
) -> None:
    asyncio.run(_replay(ops))


async def _replay(ops: list[tuple[str, int, Any]]) -> None:
    admission = fleet(2, 1, 3, max_queue=0)
    pools: list[Pool] = admission.pools
    tickets: list[Ticket] = []
    ceilings = {id(pool): pool.capacity or 0 for pool in pools}
    for op, a, b in ops:
        before = {id(t) for t in tickets if t.granted}
        if op == "enter":
            with contextlib.suppress(AdmissionError):
                tickets.append(admission.enter(a, 30 * a, affinity=b or None))
        elif op == "release" and tickets:
            tickets[a % len(tickets)].release()
        elif op == "resize":
            pools[a].resize(b)
            if b is not None:
                ceilings[id(pools[a])] = b
        elif op == "reroute" and tickets:
            ticket = tickets[a % len(tickets)]
            if ticket.granted and not ticket._released:
                ticket.reroute(time.monotonic() + 60)
        elif op == "budget":
            pools[a].resize_budget(b)
        await settle()
        live = [t for t in tickets if t.granted and not t._released]
        for pool in pools:
            mine = [t for t in live if t.pool is pool]
            assert pool.active == sum(t.weight for t in mine)
            assert pool.committed == sum(t.charged for t in mine)
            new = [t for t in mine if id(t) not in before]
            if new and pool.capacity is not None:
                # Granted now: within its slots (older holders above a shrunk capacity aside).
                assert pool.active <= max(pool.capacity, ceilings[id(pool)])
                assert sum(t.weight for t in new) <= pool.capacity
        waiting = [
            t for t in tickets if t._future is not None and not t._future.done() and not t._released
        ]
        for t in live:
            if id(t) not in before:
                # Passed only where the one passed could never run.
                assert t.pool is not None
                capacity = t.pool.capacity or 0
                passed = [w for w in waiting if not w.rerouted and w.seq < t.seq]
                assert all(w.least > capacity for w in passed), "overtaken"
        assert admission.active == sum(t.weight for t in live)
        assert admission.queued == len(waiting)
    for ticket in tickets:
        ticket.release()
    await settle()
    assert held(admission) == [0, 0, 0]
    assert admission.committed_tokens == 0
    assert admission.queued == 0


async def test_a_keys_last_upstream_is_not_taken_from_the_waiter_at_the_head_that_needs_it() -> (
    None
):
    admission = fleet(2, 1, 3)
    key = key_preferring(admission, 2)
    first = admission.enter(affinity=key)
    assert first.pool is admission.pools[2]  # the key's last upstream is now the 3-slot one
    heavy = admission.enter(3)  # fits only there, once `first` ends
    assert not heavy.granted
    # Behind it, the key's next request may run only where the heavy one never can (the 2-slot
    # or the 1-slot upstream), not in the 2 free slots it waits to fill.
    light = admission.enter(affinity=key)
    assert light.pool in admission.pools[:2]
    first.release()
    light.release()
    await heavy.wait()
    assert heavy.pool is admission.pools[2]
    heavy.release()


async def test_a_key_follows_its_prompt_to_where_its_last_request_ran() -> None:
    admission = fleet(1, 1, 1)
    key = key_preferring(admission, 0)
    squatter = admission.enter(affinity=key)
    assert squatter.pool is admission.pools[0]
    spilled = admission.enter(affinity=key)
    assert spilled.pool is not admission.pools[0]  # its first choice was full
    where = spilled.pool
    spilled.release()
    squatter.release()
    # Its prompt is cached where it last ran now, not at its rendezvous first choice.
    follow = admission.enter(affinity=key)
    assert follow.pool is where
    follow.release()


async def test_each_conversation_under_one_key_goes_back_to_where_it_ran_last() -> None:
    admission = fleet(1, 1, 1)
    key = key_preferring(admission, 0)
    # Two conversations over one system prompt (one affinity key): the first takes the key's
    # first choice, the second spills.
    first = admission.enter(affinity=key, conversation=1)
    second = admission.enter(affinity=key, conversation=2)
    assert first.pool is admission.pools[0]
    assert second.pool is not admission.pools[0]
    where = second.pool
    first.release()
    second.release()
    # Their next turns: each where its own history is cached, not where the key ran last (the
    # second conversation's upstream).
    later_first = admission.enter(affinity=key, conversation=1)
    later_second = admission.enter(affinity=key, conversation=2)
    assert later_first.pool is admission.pools[0]
    assert later_second.pool is where
    # A new conversation under that key goes to its first choice, where the prompt start is.
    later_first.release()
    later_second.release()
    assert admission.enter(affinity=key, conversation=3).pool is admission.pools[0]


async def test_a_request_too_large_for_every_upstream_is_told_the_largest_ones_slots() -> None:
    admission = fleet(2, 2)
    with pytest.raises(TooLarge) as caught:
        admission.enter(weight=3)
    # Four slots in all, but a request runs in one upstream: two is what it can have.
    assert "needs 3 slots but llama-server has 2" in refusal(caught.value).message


async def test_a_heavy_waiter_is_told_to_retry_not_to_ask_less_while_its_upstream_restarts() -> (
    None
):
    admission = fleet(4, 2)
    holder = admission.enter(weight=4)
    heavy = admission.enter(weight=4)  # waits for the four-slot upstream
    admission.pools[0].resize(None)  # which restarts: it may well come back with four
    with pytest.raises(NotReady):  # a 503 with Retry-After, which clients retry
        await heavy.wait()
    admission.pools[0].resize(4)
    gone = admission.enter(weight=4)
    assert not gone.admitted  # the holder's four slots are still held
    admission.pools[0].retire()  # gone for good: no upstream will ever have four
    with pytest.raises(TooLarge):
        await gone.wait()
    holder.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_prompt_array_holds_as_many_slots_as_the_upstream_that_grants_it_has() -> None:
    admission = fleet(1, 3)
    arrays = [admission.enter(1, tasks=4) for _ in range(2)]
    assert all(t.granted for t in arrays)
    for ticket in arrays:
        assert ticket.pool is not None
        assert ticket.weight == min(4, ticket.pool.capacity or 0)
    assert held(admission) == [1, 3]
    for ticket in arrays:
        ticket.release()
    assert held(admission) == [0, 0]


async def test_light_requests_behind_a_heavy_head_run_at_once_where_the_head_can_never_run() -> (
    None
):
    admission = fleet(3, 1)
    big, small = admission.pools
    running = admission.enter(weight=2)
    assert running.pool is big  # one slot of the big upstream left
    head = admission.enter(weight=3)  # only the big upstream can ever run it
    lights = [admission.enter() for _ in range(3)]
    await settle()
    assert not head.granted
    # The small upstream is of no use to the head: the first light request runs there at once.
    assert lights[0].granted
    assert lights[0].pool is small
    # The big upstream's free slot is the head's: nobody behind it takes it.
    assert not lights[1].granted
    assert not lights[2].granted
    assert held(admission) == [2, 1]
    # The head runs as soon as its upstream has room, as without the light requests.
    running.release()
    assert head.granted
    assert head.pool is big
    # Among those that could use the same slots, first come first served.
    lights[0].release()
    assert lights[1].granted
    assert not lights[2].granted
    assert lights[1].pool is small
    for ticket in (head, lights[1]):
        ticket.release()
    await settle()
    assert lights[2].granted
    lights[2].release()
    assert held(admission) == [0, 0]
    assert admission.queued == 0


async def test_with_tenants_requests_behind_a_heavy_head_run_where_it_cannot_in_fair_order() -> (
    None
):
    admission = fleet(3, 1)
    small = admission.pools[1]
    # The heavy tenant's band is served first: its request is the head of the fair line.
    heavy, b, c = Tenant("heavy"), Tenant("b", band=BATCH), Tenant("c", band=BATCH)
    running = admission.enter(2, tenant=heavy)
    head = admission.enter(3, tenant=heavy)
    b_lights = [admission.enter(tenant=b) for _ in range(2)]
    c_light = admission.enter(tenant=c)
    assert isinstance(admission._line, FairLine)
    assert not head.granted
    assert b_lights[0].granted
    assert b_lights[0].pool is small
    assert held(admission) == [2, 1]  # the big upstream's free slot stays the head's
    # The small upstream's next turn is c's: b held the last one for a while.
    await b_lights[0].wait()
    await asyncio.sleep(0.05)
    b_lights[0].release()
    assert c_light.granted
    assert not b_lights[1].granted
    running.release()
    assert head.granted
    for ticket in (head, c_light):
        ticket.release()
    await settle()
    assert b_lights[1].granted
    b_lights[1].release()
    assert held(admission) == [0, 0]
    assert admission.queued == 0
    assert admission.tenant_counts("b") == (0, 0)


@pytest.mark.parametrize("seed", range(8))
async def test_random_work_of_tenants_over_a_mixed_fleet_keeps_every_count_and_limit(
    seed: int,
) -> None:
    rng = random.Random(seed)
    tenants = [
        Tenant(f"t{n}", band=rng.choice([BATCH, 1]), max_active=rng.choice([None, 2, 3]))
        for n in range(4)
    ]
    admission = fleet(3, 1, 2, max_queue=60)
    pools = admission.pools
    tickets: list[Ticket] = []
    for _ in range(1_500):
        action = rng.random()
        if action < 0.45:
            tenant = rng.choice(tenants)
            with contextlib.suppress(AdmissionError):
                weight = rng.choice([1, 1, 2, 3])
                tickets.append(admission.enter(weight, tenant=tenant, tasks=rng.choice([0, 4])))
        elif action < 0.9 and tickets:
            tickets.pop(rng.randrange(len(tickets))).release()
        elif action < 0.95:
            held_now = [t for t in tickets if t.granted and not t._released]
            if held_now:
                rng.choice(held_now).reroute(time.monotonic() + 5)
        else:
            rng.choice(pools).resize(rng.choice([1, 2, 3]))
        await settle()
        live = [t for t in tickets if not t._released and not (t._future and t._future.done()
                and not t.granted)]  # fmt: skip
        granted = [t for t in live if t.granted]
        waiting = [t for t in live if not t.granted]
        for pool in pools:
            assert pool.active == sum(t.weight for t in granted if t.pool is pool)
        assert admission.active == sum(t.weight for t in granted)
        assert admission.queued == len(waiting)
        fair = admission._line
        if not isinstance(fair, FairLine):
            continue
        assert fair.queued == len(waiting)
        for tenant in tenants:
            active, queued = admission.tenant_counts(tenant.name)
            assert queued == sum(1 for t in waiting if t.tenant.name == tenant.name)
            if tenant.max_active is not None:
                assert active <= tenant.max_active
    admission.close()  # every waiter turned away once, those granted out of turn included
    assert admission.queued == 0
    for ticket in tickets:
        ticket.release()
    await settle()
    assert (admission.active, admission.queued) == (0, 0)


async def test_with_tenants_an_upstream_that_grows_takes_every_waiter_it_has_room_for() -> None:
    # One upstream shrank under what it runs, so the fleet's sums say "full" while the other
    # grew by two slots: both waiters run on it at once, as they would without tenants.
    admission = fleet(2, 2)
    first, second = admission.pools
    running = [admission.enter(tenant=Tenant("a")) for _ in range(4)]
    assert held(admission) == [2, 2]
    waiters = [admission.enter(tenant=Tenant(name)) for name in ("b", "c")]
    assert isinstance(admission._line, FairLine)
    first.resize(1)
    second.resize(4)
    await settle()
    assert all(waiter.granted for waiter in waiters)
    assert held(admission) == [2, 4]
    for ticket in running + waiters:
        ticket.release()
