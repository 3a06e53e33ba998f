"""The swap rule (app/gate/swaps.py): loads while the router has room, idle models make room,
busy ones stay loaded until a line has waited its bound, then one empties and is swapped."""

from __future__ import annotations

from slotgate.gate.swaps import Demand, Swaps


def loaded(model: str, active: int = 0, queued: int = 0, loaded_s: float = 60.0) -> Demand:
    return Demand(model, "loaded", active, queued, 0.0, loaded_s)


def wanting(model: str, queued: int = 1, waited_s: float = 0.0) -> Demand:
    return Demand(model, "unloaded", 0, queued, waited_s)


def test_a_waiting_model_is_loaded_while_the_router_has_room() -> None:
    plan = Swaps(10).plan(2, [loaded("a", active=2), wanting("b")])
    assert plan.load == ["b"]
    assert not plan.unload
    assert not plan.hold


def test_without_a_known_limit_every_waiting_model_is_loaded() -> None:
    plan = Swaps(10).plan(None, [wanting("a", waited_s=1), wanting("b", waited_s=2)])
    assert plan.load == ["b", "a"]  # the longest wait first


def test_a_model_nobody_waits_for_is_never_loaded() -> None:
    plan = Swaps(10).plan(1, [loaded("a"), wanting("b", queued=0)])
    assert (plan.load, plan.unload, plan.hold) == ([], [], set())


def test_a_full_router_unloads_an_idle_model_to_make_room() -> None:
    swaps = Swaps(10)
    plan = swaps.plan(2, [loaded("a", active=1), loaded("b"), wanting("c")])
    assert plan.unload == ["b"]
    assert plan.hold == {"b"}  # nothing is let in on it while it is unloaded
    assert not plan.load  # loaded at the next look, once the room is there
    plan = swaps.plan(2, [loaded("a", active=1), Demand("b", "unloaded", 0, 0), wanting("c")])
    assert plan.load == ["c"]
    assert not plan.hold


def test_busy_models_stay_loaded_until_the_wait_reaches_its_bound() -> None:
    swaps = Swaps(10)
    plan = swaps.plan(1, [loaded("a", active=2, queued=5), wanting("b", queued=3, waited_s=9.9)])
    assert (plan.load, plan.unload, plan.hold) == ([], [], set())


def test_past_the_bound_a_busy_model_is_held_then_unloaded_once_empty() -> None:
    swaps = Swaps(10)
    plan = swaps.plan(1, [loaded("a", active=2, queued=5), wanting("b", waited_s=10)])
    assert plan.hold == {"a"}
    assert not plan.unload  # its two running requests finish first: none is cut
    # Still running one: still held, nothing unloaded, even as its own line grows.
    plan = swaps.plan(1, [loaded("a", active=1, queued=9), wanting("b", waited_s=12)])
    assert plan.hold == {"a"}
    assert not plan.unload
    plan = swaps.plan(1, [loaded("a", active=0, queued=9), wanting("b", waited_s=13)])
    assert plan.unload == ["a"]
    # Unloaded: the hold ends, and the waiting model loads.
    plan = swaps.plan(1, [Demand("a", "unloaded", 0, 9, 1.0), wanting("b", waited_s=14)])
    assert plan.hold == set()
    assert plan.load == ["b"]


def test_a_model_just_loaded_is_not_swapped_out_before_its_time() -> None:
    swaps = Swaps(10)
    fresh = loaded("b", active=2, loaded_s=3)
    plan = swaps.plan(1, [fresh, wanting("a", queued=9, waited_s=40)])
    assert not plan.hold
    plan = swaps.plan(1, [loaded("b", active=2, loaded_s=10), wanting("a", waited_s=47)])
    assert plan.hold == {"b"}


def test_the_victim_is_the_model_with_the_least_waiting_work() -> None:
    swaps = Swaps(10)
    demands = [
        loaded("a", active=1, queued=4),
        loaded("b", active=1, queued=1),
        wanting("c", waited_s=11),
    ]
    assert swaps.plan(2, demands).hold == {"b"}


def test_a_swap_under_way_starts_no_second_one() -> None:
    swaps = Swaps(10)
    demands = [loaded("a", active=1), loaded("b", active=1), wanting("c", waited_s=11)]
    assert len(swaps.plan(2, demands).hold) == 1
    demands.append(wanting("d", waited_s=30))
    assert len(swaps.plan(2, demands).hold) == 1


def test_a_loading_model_counts_against_the_limit() -> None:
    plan = Swaps(10).plan(1, [Demand("a", "loading", 0, 3, 1.0), wanting("b", waited_s=1)])
    assert not plan.load
    assert not plan.unload
