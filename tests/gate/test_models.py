"""One line per model: lanes found as llama-server's router finds models, each with its own
admission core, bounded in number, closed together."""

from __future__ import annotations

import pytest
from slotgate.errors import ShuttingDown
from slotgate.gate.admission import Admission
from slotgate.gate.models import Lane, Models


def models(limit: int = 8) -> Models:
    return Models(lambda: Admission(startup_wait_s=5), limit)


def test_a_model_is_found_by_its_id_or_any_alias() -> None:
    lanes = models()
    alpha = lanes.lane("alpha", ["a", "first"])
    assert alpha is not None
    assert lanes.find("alpha") is alpha
    assert lanes.find("a") is alpha
    assert lanes.find("first") is alpha
    assert lanes.find("Alpha") is None  # matched exactly, as the router does
    assert lanes.find("beta") is None


def test_an_id_wins_over_another_models_alias() -> None:
    lanes = models()
    alpha = lanes.lane("alpha", ["beta"])
    beta = lanes.lane("beta")
    assert lanes.find("beta") is beta
    assert lanes.find("alpha") is alpha


def test_aliases_follow_what_the_router_lists_last() -> None:
    lanes = models()
    alpha = lanes.lane("alpha", ["old"])
    assert lanes.lane("alpha", ["new"]) is alpha
    assert lanes.find("old") is None
    assert lanes.find("new") is alpha


async def test_each_model_has_its_own_slots_and_line() -> None:
    lanes = models()
    alpha, beta = lanes.lane("alpha"), lanes.lane("beta")
    assert alpha is not None
    assert beta is not None
    alpha.admission.add_pool("router#alpha").resize(1)
    beta.admission.add_pool("router#beta").resize(1)
    held = alpha.admission.enter()
    assert held.admitted
    waiting = alpha.admission.enter()
    assert not waiting.admitted
    assert beta.admission.enter().admitted  # alpha's line holds nobody of beta's
    assert alpha.running
    assert beta.running


def listed(lanes: Models, model: str, aliases: tuple[str, ...] = ()) -> Lane:
    """The lane of `model`, listed by a router."""
    lane = lanes.lane(model, aliases)
    assert lane is not None
    lane.states["http://router"] = "unloaded"
    return lane


def test_lanes_are_bounded_in_number() -> None:
    lanes = models(limit=2)
    listed(lanes, "a")
    listed(lanes, "b")
    assert lanes.lane("c") is None
    assert lanes.lane("a") is not None  # one it has stays found
    assert len(lanes) == 2


async def test_a_line_no_router_lists_any_more_makes_room_for_a_new_model() -> None:
    lanes = models(limit=2)
    listed(lanes, "a", ("a1",))
    gone = listed(lanes, "b", ("b1",))
    gone.states.clear()  # its file left the router's --models-dir
    # Without room made, a router that renames its models would be refused for good.
    c = lanes.lane("c")
    assert c is not None
    assert len(lanes) == 2
    assert lanes.find("b") is None
    assert lanes.find("b1") is None
    assert lanes.find("a1") is not None
    with pytest.raises(ShuttingDown):  # a request that found it just before is told
        gone.admission.enter()


async def test_a_line_that_still_holds_requests_keeps_its_place() -> None:
    lanes = models(limit=2)
    listed(lanes, "a")
    gone = listed(lanes, "b")
    gone.admission.add_pool("router#b")
    waiter = gone.admission.enter()  # waits for a load that will not come
    gone.states.clear()
    assert lanes.lane("c") is None
    assert lanes.find("b") is gone
    waiter.release()


async def test_closing_turns_every_lines_waiters_away_and_new_lanes_too() -> None:
    lanes = models()
    alpha = lanes.lane("alpha")
    assert alpha is not None
    alpha.admission.add_pool("router#alpha")  # unloaded: requests wait for its slots
    waiter = alpha.admission.enter()
    lanes.close()
    with pytest.raises(ShuttingDown):
        await waiter.wait()
    late = lanes.lane("late")
    assert late is not None
    with pytest.raises(ShuttingDown):
        late.admission.enter()


def test_a_lanes_state_is_the_best_of_its_routers() -> None:
    lanes = models()
    alpha = lanes.lane("alpha")
    assert alpha is not None
    assert alpha.state == "unloaded"
    alpha.states = {"http://a": "unloaded", "http://b": "loading"}
    assert alpha.state == "loading"
    alpha.states["http://a"] = "loaded"
    assert alpha.state == "loaded"
    alpha.states = {"http://a": "failed"}
    assert alpha.state == "failed"


def test_a_pause_holds_every_line_and_a_line_made_while_paused_starts_paused() -> None:
    lanes = models()
    alpha = lanes.lane("alpha")
    assert alpha is not None
    lanes.pause()
    beta = lanes.lane("beta")
    assert beta is not None
    assert lanes.paused
    assert alpha.admission.paused
    assert beta.admission.paused
    lanes.resume()
    assert not lanes.paused
    assert not alpha.admission.paused
    assert not beta.admission.paused
    assert lanes.lane("gamma") is not None
    gamma = lanes.find("gamma")
    assert gamma is not None
    assert not gamma.admission.paused


def test_aliases_listed_by_several_upstreams_are_each_found_until_theirs_leaves() -> None:
    lanes = models()
    alpha = lanes.lane("alpha", ["x"], "http://router-a")
    # A server of alpha without --alias, placed after: its listing adds none, takes none.
    assert lanes.lane("alpha", [], "http://server-b") is alpha
    assert lanes.find("x") is alpha
    lanes.lane("alpha", ["y"], "http://router-c")
    assert lanes.find("x") is alpha
    assert lanes.find("y") is alpha
    assert alpha is not None
    lanes.unlist(alpha, "http://router-a")
    assert lanes.find("x") is None
    assert lanes.find("y") is alpha


def test_a_model_not_running_is_expected_after_what_its_last_load_took() -> None:
    alpha = models().lane("alpha")
    assert alpha is not None
    assert alpha.load_eta_s(100.0) == 0.0  # no load seen: its time is not known
    alpha.load_s = 30.0
    assert alpha.load_eta_s(100.0) == 30.0
    alpha.loading_since = 90.0  # a load under way for 10 s
    assert alpha.load_eta_s(100.0) == 20.0
    assert alpha.load_eta_s(200.0) == 0.0  # overdue: no more than nothing
    alpha.admission.resize(2)
    assert alpha.load_eta_s(100.0) == 0.0  # running: no load to wait for
