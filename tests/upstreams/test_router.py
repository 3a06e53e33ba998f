"""slotgate in front of a stand-in llama-server in router mode (several models, one child
each), over real sockets: one line per model, each child never above its slots, unknown models
refused in the router's words, unloaded models loaded for their waiters."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from slotgate.gate.admission import Admission
from slotgate.gate.models import MAX_MODELS, Lane, Models
from slotgate.status.waiting import waiting
from slotgate.upstreams.props import Props
from slotgate.upstreams.router import Router

from tests.conftest import (
    CHAT,
    GatesFor,
    MakeRouter,
    RunningGate,
    StartUpstreams,
    chat,
    hold_stream_of,
    line,
)
from tests.support.router import Routing, children, hosted
from tests.support.standin import StandIn
from tests.support.valkey import Valkey


async def test_a_router_is_ready_and_shows_each_models_line(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(3, "unloaded", ["b"])})
    gate = await gate_before(upstream)
    await gate.until(lambda: line(gate, "alpha").admission.capacity == 2)
    ready = await client.get(gate.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["models"] == {"listed": 2, "loaded": 1}
    view = (await client.get(gate.url + "/admission")).json()
    models = {m["model"]: m for m in view["models"]}
    assert models["alpha"]["state"] == "loaded"
    assert models["alpha"]["capacity"] == 2
    assert models["alpha"]["pools"][0]["model"] == "alpha"
    assert models["beta"]["state"] == "unloaded"
    assert models["beta"]["aliases"] == ["b"]
    assert models["beta"]["capacity"] is None


async def test_each_childs_requests_never_exceed_its_slots(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1)})
    for child in children(upstream).values():
        child.token_delay_s = 0.05  # long enough that admitted requests overlap
    gate = await gate_before(upstream)
    sent = [client.post(gate.url + CHAT, json=chat(model=model)) for model in ("alpha", "beta") * 6]
    answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * 12
    kids = children(upstream)
    assert kids["alpha"].max_running == 2
    assert kids["beta"].max_running == 1
    assert kids["alpha"].finished == kids["beta"].finished == 6


async def test_an_unknown_model_is_refused_at_once_in_the_routers_words(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    answer = await client.post(gate.url + CHAT, json=chat(model="gamma"))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == "model 'gamma' not found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    missing = await client.post(gate.url + CHAT, json=chat())
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "model name is missing from the request"
    assert children(upstream)["alpha"].started == 0


async def test_an_alias_finds_its_models_line(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, aliases=["a1"])})
    gate = await gate_before(upstream)
    await gate.until(lambda: gate.service.models.find("a1") is not None)
    answer = await client.post(gate.url + CHAT, json=chat(model="a1"))
    assert answer.status_code == 200
    assert children(upstream)["alpha"].finished == 1


async def test_a_request_for_an_unloaded_model_waits_while_it_loads_and_is_served(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, load_delay_s=0.3)
    gate = await gate_before(upstream)
    answers = await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(model="alpha")) for _ in range(5))
    )
    assert [a.status_code for a in answers] == [200] * 5
    assert upstream.routing is not None
    assert upstream.routing.loads == 1
    assert children(upstream)["alpha"].max_running == 2


async def test_a_stream_waiting_for_its_model_hears_its_place(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, load_delay_s=1.5)
    gate = await gate_before(upstream, keepalive_interval_s=0.2, stream_head_after_s=0)
    body = chat(stream=True, model="alpha")
    async with client.stream("POST", gate.url + CHAT, json=body) as response:
        assert response.status_code == 200
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert b": queued position=1" in raw
    assert raw.rstrip().endswith(b"data: [DONE]")


async def test_autoload_false_refuses_an_unloaded_model_as_the_router_does(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded"), "beta": hosted(2)})
    gate = await gate_before(upstream)
    await gate.until(lambda: line(gate, "beta").running)
    answer = await client.post(gate.url + CHAT + "?autoload=false", json=chat(model="alpha"))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model is not loaded"
    loaded = await client.post(gate.url + CHAT + "?autoload=false", json=chat(model="beta"))
    assert loaded.status_code == 200
    assert upstream.routing is not None
    assert upstream.routing.loads == 0


async def test_a_router_that_does_not_autoload_is_followed(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, models_autoload=False)
    gate = await gate_before(upstream)
    await gate.until(lambda: not line(gate, "alpha").autoload)
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model is not loaded"


async def test_metrics_carry_each_childs_series_with_its_model(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2), "gamma": hosted(2, "unloaded")})
    gate = await gate_before(upstream)
    await gate.until(lambda: len(gate.service.models) == 3)
    text = (await client.get(gate.url + "/metrics?source=llama-server")).text
    assert f'llamacpp:requests_processing{{upstream="{upstream.url}",model="alpha"}} 0' in text
    assert 'model="beta"' in text
    assert 'model="gamma"' not in text
    assert text.count("# TYPE llamacpp:requests_processing gauge") == 1
    own = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert 'slotgate_model_slots_capacity{model="alpha"} 2.0' in own
    assert 'slotgate_model_loaded{model="gamma"} 0.0' in own
    assert 'slotgate_model_queue_depth{model="beta"} 0.0' in own


async def test_the_waiters_of_a_model_whose_load_failed_are_told_its_exit_code_at_once(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    broken = hosted(2, "unloaded")
    broken.fails_with = 3
    upstream = await router({"alpha": broken}, load_delay_s=0.05)
    # A wait longer than the test's own bound: an answer means they were told, not timed out.
    gate = await gate_before(upstream, startup_wait_s=600)
    answers = await asyncio.wait_for(
        asyncio.gather(*(client.post(gate.url + CHAT, json=chat(model="alpha")) for _ in range(3))),
        timeout=30,
    )
    for answer in answers:
        assert answer.status_code == 503
        assert "retry-after" in answer.headers
        error = answer.json()["error"]
        assert error["code"] == "model_load_failed"
        assert error["message"].startswith("model 'alpha' failed to load (exit code 3)")
    assert line(gate, "alpha").admission.queued == 0
    view = (await client.get(gate.url + "/admission")).json()
    (alpha,) = view["models"]
    assert alpha["state"] == "failed"
    assert alpha["exit_codes"] == {upstream.url: 3}


async def test_a_full_router_swaps_whole_lines_and_cuts_no_request(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router(
        {"alpha": hosted(2), "beta": hosted(2, "unloaded")}, models_max=1, load_delay_s=0.1
    )
    # No line waits long enough to force a swap: beta's turn comes once alpha's line is empty.
    gate = await gate_before(upstream, model_swap_after_s=60, startup_wait_s=30)
    await gate.until(lambda: line(gate, "alpha").running)
    sent = [client.post(gate.url + CHAT, json=chat(model=m)) for m in ("alpha", "beta") * 10]
    answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * 20
    routing = upstream.routing
    assert routing is not None
    kids = children(upstream)
    # One swap for the whole of beta's line, made by emptying alpha, never by cutting it.
    assert routing.loads == 1
    assert routing.evictions == 0
    assert routing.peak_loaded == 1
    assert kids["alpha"].cancelled == kids["beta"].cancelled == 0
    assert kids["alpha"].max_running == kids["beta"].max_running == 2


async def test_a_busy_model_is_emptied_for_a_line_that_waited_its_bound(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    alpha = hosted(1)
    alpha.child.tokens = 40  # each alpha request holds its slot about 0.4 s
    upstream = await router({"alpha": alpha, "beta": hosted(1, "unloaded")}, models_max=1)
    gate = await gate_before(upstream, model_swap_after_s=0.3)
    await gate.until(lambda: line(gate, "alpha").running)
    # alpha's line never empties while beta waits: a steady stream of alpha requests.
    stop = asyncio.Event()

    async def alpha_stream() -> list[int]:
        codes = []
        while not stop.is_set():
            answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
            codes.append(answer.status_code)
        return codes

    feeders = [asyncio.create_task(alpha_stream()) for _ in range(3)]
    await gate.until(lambda: line(gate, "alpha").admission.queued > 0)
    asking = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="beta")))
    await gate.until(lambda: line(gate, "alpha").held)  # emptied for beta, not cut
    beta = await asking
    stop.set()
    codes = [code for feeder in await asyncio.gather(*feeders) for code in feeder]
    assert beta.status_code == 200
    assert set(codes) == {200}
    kids = children(upstream)
    assert kids["alpha"].cancelled == 0
    assert upstream.routing is not None
    assert upstream.routing.evictions == 0
    assert upstream.routing.unloads >= 1  # alpha, emptied for beta's line


async def test_servers_of_different_models_each_take_only_their_models_requests(
    router: MakeRouter, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    small = StandIn(total_slots=1, tokens=3, token_delay_s=0.01, model="small.gguf")
    small.aliases = ["small"]
    large = StandIn(total_slots=2, tokens=3, token_delay_s=0.05, model="large.gguf")
    routed = await router({"routed": hosted(1)})
    for upstream in (small, large):
        await upstream.start()
    try:
        gate = await gates_for([small, large, routed])
        lanes = gate.service.models
        await gate.until(
            lambda: all(
                (lane := lanes.find(name)) is not None and lane.running
                for name in ("small", "large.gguf", "routed")
            )
        )
        sent = [
            client.post(gate.url + CHAT, json=chat(model=model))
            for model in ("small", "large.gguf", "routed", "small.gguf") * 4
        ]
        answers = await asyncio.gather(*sent)
        assert [a.status_code for a in answers] == [200] * 16
        assert (small.finished, large.finished) == (8, 4)
        assert (small.max_running, large.max_running) == (1, 2)
        assert children(routed)["routed"].finished == 4
        unknown = await client.post(gate.url + CHAT, json=chat(model="medium"))
        assert unknown.status_code == 400
        view = (await client.get(gate.url + "/admission")).json()
        assert {m["model"] for m in view["models"]} == {"small.gguf", "large.gguf", "routed"}
    finally:
        for upstream in (small, large):
            await upstream.stop()


async def test_servers_of_one_model_are_not_routed_by_model(
    gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    upstreams = [StandIn(total_slots=1, tokens=3), StandIn(total_slots=1, tokens=3)]
    for upstream in upstreams:
        await upstream.start()
    try:
        gate = await gates_for(upstreams)
        await gate.until(lambda: gate.service.admission.capacity == 2)
        answer = await client.post(gate.url + CHAT, json=chat(model="anything"))
        assert answer.status_code == 200  # llama-server ignores `model`, and so does slotgate
        assert not gate.service.models.routed
        assert all(upstream.seen[0].path == CHAT for upstream in upstreams if upstream.seen)
    finally:
        for upstream in upstreams:
            await upstream.stop()


async def test_a_server_restarted_as_a_router_and_back_is_followed_as_each(
    start_upstreams: StartUpstreams, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = StandIn(total_slots=3, tokens=3)
    await start_upstreams(upstream)
    gate = await gates_for([upstream])
    await gate.until(lambda: gate.service.admission.capacity == 3)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    # Restarted with --models-dir: the same address now answers as a router.
    upstream.hosted = {"alpha": hosted(2)}
    upstream.routing = Routing(upstream, upstream.hosted)
    lanes = gate.service.models
    await gate.until(lambda: (found := lanes.find("alpha")) is not None and found.running)
    assert gate.service.admission.capacity is None  # the old server's slots are gone
    assert (await client.post(gate.url + CHAT, json=chat(model="alpha"))).status_code == 200
    assert children(upstream)["alpha"].finished == 1
    # And back to one model (-m): a request's model is not read again, as before any router.
    upstream.hosted = upstream.routing = None
    await gate.until(lambda: gate.service.admission.capacity == 3)
    for body in (chat(), chat(model="alpha"), chat(model="whatever")):
        assert (await client.post(gate.url + CHAT, json=body)).status_code == 200
    assert upstream.finished == 4


async def test_a_models_prompts_are_counted_by_its_child_against_its_budget(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    alpha = hosted(4)
    alpha.child.counts = True  # /apply-template and /tokenize, one token a word
    upstream = await router({"alpha": alpha, "beta": hosted(2)})
    gate = await gate_before(upstream, kv_budget_tokens=4096)
    assert line(gate, "alpha").admission.budget_tokens == 4096
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 200
    assert alpha.child.counted == 1
    assert upstream.routing is not None
    forwarded = [f for f in upstream.routing.forwarded if f[0] != "/props"]
    assert forwarded == [("/apply-template", "alpha"), ("/tokenize", "alpha"), (CHAT, "alpha")]


async def test_a_model_the_router_no_longer_lists_is_unknown_again_until_it_returns(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2)})
    gate = await gate_before(upstream)
    assert upstream.hosted is not None
    beta = upstream.hosted.pop("beta")  # its file removed from --models-dir
    await gate.until(lambda: not line(gate, "beta").states)
    answer = await client.post(gate.url + CHAT, json=chat(model="beta"))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model 'beta' not found"
    assert (await client.post(gate.url + CHAT, json=chat(model="alpha"))).status_code == 200
    upstream.hosted["beta"] = beta  # and put back
    await gate.until(lambda: line(gate, "beta").running)
    # One pool, not a dead one left beside the new one.
    assert [pool.capacity for pool in line(gate, "beta").admission.pools] == [2]
    assert (await client.post(gate.url + CHAT, json=chat(model="beta"))).status_code == 200


async def test_with_a_shared_line_each_models_line_is_kept_by_the_replica(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient, valkey: Valkey
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1, "unloaded")})
    for child in children(upstream).values():
        child.token_delay_s = 0.05  # long enough that admitted requests overlap
    gate = await gate_before(upstream, redis_url=valkey.url, redis_fleet="models")
    answers = await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(model=m)) for m in ("alpha", "beta") * 3)
    )
    assert [a.status_code for a in answers] == [200] * 6
    kids = children(upstream)
    assert (kids["alpha"].max_running, kids["beta"].max_running) == (2, 1)


async def test_a_models_listing_nested_too_deep_to_parse_does_not_stop_the_following(
    router: MakeRouter, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2)})
    assert upstream.routing is not None
    # Parsed by the standard library's json, this raises RecursionError, not ValueError.
    upstream.routing.listing = b"[" * 100_000
    gate = await gates_for([upstream])
    await gate.until(lambda: gate.service.upstream.router is not None)
    upstream.routing.listing = None
    await gate.until(
        lambda: (lane := gate.service.models.find("alpha")) is not None and lane.running
    )
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 200


async def test_a_model_past_the_lines_slotgate_keeps_is_refused_for_that_reason(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    listed = {f"m{i:02d}": hosted(1, "unloaded") for i in range(MAX_MODELS + 1)}
    upstream = await router(listed)
    gate = await gate_before(upstream)
    await gate.until(lambda: len(gate.service.models) == MAX_MODELS)
    last = f"m{MAX_MODELS:02d}"
    answer = await client.post(gate.url + CHAT, json=chat(model=last))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "model"
    # Not "not found": the router serves it; slotgate keeps no line for it.
    assert error["message"].startswith(f"model '{last}' is one of more than {MAX_MODELS}")
    unknown = await client.post(gate.url + CHAT, json=chat(model="gamma"))
    assert unknown.json()["error"]["message"] == "model 'gamma' not found"


async def test_a_child_that_dies_mid_stream_gives_its_slot_back(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1)})
    gate = await gate_before(upstream)
    child = children(upstream)["alpha"]
    child.tokens, child.fault = 5, "die_midstream"
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True, model="alpha")) as cut:
        raw = b"".join([chunk async for chunk in cut.aiter_raw()])
    assert b"data: [DONE]" not in raw
    child.fault = None
    await gate.until(lambda: line(gate, "alpha").admission.active == 0)
    assert (await client.post(gate.url + CHAT, json=chat(model="alpha"))).status_code == 200


async def test_a_load_that_never_ends_is_waited_for_no_longer_than_the_startup_wait(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, load_delay_s=3600)
    gate = await gate_before(upstream, startup_wait_s=0.5)
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 503
    assert "retry-after" in answer.headers
    assert line(gate, "alpha").admission.queued == 0
    assert line(gate, "alpha").state == "loading"


async def test_counting_a_waiting_prompt_never_makes_the_router_load_its_model(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    alpha, beta = hosted(2), hosted(2)
    beta.child.counts = True
    upstream = await router({"alpha": alpha, "beta": beta}, models_max=2)
    gate = await gate_before(upstream, kv_budget_tokens=4096, model_swap_after_s=3600)
    await gate.until(lambda: line(gate, "beta").admission.budget_tokens is not None)
    upstream.models_max = 1
    beta.state = "unloaded"  # unloaded for alpha; its line keeps the budget it read
    await gate.until(lambda: not line(gate, "beta").running)
    alpha.child.tokens, alpha.child.token_delay_s = 1000, 0.05
    started = asyncio.Event()
    holder = asyncio.create_task(
        hold_stream_of(client, gate, chat(stream=True, model="alpha"), started)
    )
    await started.wait()
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="beta")))
    # Counted (or not) before it waits: then it is listed among the waiting.
    await gate.until(lambda: len(waiting(gate.service.proxy.running.watches(), lambda _: 0.0)) == 1)
    # A count that loads beta (the router autoloads for any POST naming a model) would have
    # the router evict busy-now, idle-in-a-moment alpha behind slotgate's back: the swap that
    # slotgate's rule keeps from happening while alpha's line has work.
    assert beta.state == "unloaded"
    assert upstream.routing is not None
    assert upstream.routing.loads == 0  # listed loaded from the start: no load since
    alpha.child.hurry()
    await holder
    waiter.cancel()


async def test_without_a_startup_wait_a_request_for_an_unloaded_model_still_has_it_loaded(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2, "unloaded")})
    gate = await gate_before(upstream, startup_wait_s=0)
    refused = await client.post(gate.url + CHAT, json=chat(model="beta"))
    # Nothing waits (STARTUP_WAIT_S=0: 503 at once, as while llama-server starts) ...
    assert refused.status_code == 503
    assert "retry-after" in refused.headers
    # ... but the model is loaded for the retry, as the router itself would load it.
    await gate.until(lambda: line(gate, "beta").running)
    assert (await client.post(gate.url + CHAT, json=chat(model="beta"))).status_code == 200


async def test_a_model_id_with_quotes_and_newlines_cannot_forge_a_metrics_line(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    odd = 'a"b\\\nx{y="z"} 1\n# c'  # a file name the router lists as it is
    upstream = await router({odd: hosted(2), "beta": hosted(2)})
    gate = await gate_before(upstream)
    await gate.until(lambda: line(gate, odd).running)
    for source in ("llama-server", "slotgate"):
        text = (await client.get(gate.url + f"/metrics?source={source}")).text
        labelled = [
            sample.labels["model"]
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if "model" in sample.labels
        ]
        assert odd in labelled
        assert set(labelled) == {odd, "beta"}


async def fleet_of_two(
    start_upstreams: StartUpstreams, gates_for: GatesFor, startup_wait_s: float
) -> tuple[RunningGate, StandIn]:
    """slotgate before servers of two models, small.gguf and large.gguf, once both are in
    their lines; and the large one's stand-in."""
    small = StandIn(total_slots=1, tokens=3, model="small.gguf")
    large = StandIn(total_slots=2, tokens=3, model="large.gguf")
    await start_upstreams(small, large)
    gate = await gates_for([small, large], startup_wait_s=startup_wait_s)
    await gate.until(lambda: line_or_none(gate, "large.gguf") is not None)
    return gate, large


async def test_a_server_restarted_with_another_model_leaves_its_old_models_line(
    start_upstreams: StartUpstreams, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    gate, large = await fleet_of_two(start_upstreams, gates_for, 2)
    lanes = gate.service.models
    # Restarted with another model (-m medium.gguf): loading, then ready again.
    large.loading = True
    await gate.until(lambda: not gate.service.fleet.upstreams[1].ready)
    waiting = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="large.gguf")))
    await gate.until(lambda: line(gate, "large.gguf").admission.queued == 1)
    large.model, large.loading = "medium.gguf", False
    await gate.until(lambda: (lane := lanes.find("medium.gguf")) is not None and lane.running)
    # A request for the old model never goes to the server that now serves another: not the
    # one that waited for its return, not one sent since.
    assert (await waiting).status_code == 503
    answer = await client.post(gate.url + CHAT, json=chat(model="large.gguf"))
    assert answer.status_code == 400
    assert (await client.post(gate.url + CHAT, json=chat(model="medium.gguf"))).status_code == 200
    assert large.finished == 1


async def test_a_server_of_a_fleet_restarted_as_a_router_no_longer_serves_its_old_model(
    start_upstreams: StartUpstreams, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    gate, large = await fleet_of_two(start_upstreams, gates_for, 30)
    large.hosted = {"alpha": hosted(2)}
    large.routing = Routing(large, large.hosted)
    await gate.until(lambda: (alpha := line_or_none(gate, "alpha")) is not None and alpha.running)
    assert not line(gate, "large.gguf").states  # served nowhere now
    answer = await asyncio.wait_for(
        client.post(gate.url + CHAT, json=chat(model="large.gguf")), timeout=10
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model 'large.gguf' not found"


def line_or_none(gate: RunningGate, model: str) -> Lane | None:
    found = gate.service.models.find(model)
    return found if found is not None and found.running else None


async def test_a_hold_on_one_router_is_shown_while_another_serves_the_same_model() -> None:
    lanes = Models(lambda: Admission(startup_wait_s=30))

    class Listing:
        """A router that lists `listed` (model: state), every child with two slots."""

        def __init__(self, url: str, listed: dict[str, str]) -> None:
            self.url = url
            self.listed = listed

        async def get(self, path: str) -> tuple[int, bytes]:
            if path == "/models":
                data = [{"id": m, "status": {"value": v}} for m, v in self.listed.items()]
                return 200, json.dumps({"data": data}).encode()
            return 200, json.dumps({"total_slots": 2}).encode()

        async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
            return 200, b'{"success": true}'

        def kv_budget_tokens(self, props: Props) -> int | None:
            return None

    def follower(url: str, listed: dict[str, str]) -> Router:
        return Router(Listing(url, listed), lanes, lambda pool: None)

    full = follower("http://a", {"alpha": "loaded", "beta": "unloaded"})
    roomy = follower("http://b", {"alpha": "loaded"})
    await full.refresh({"max_instances": 1})
    await roomy.refresh({"max_instances": 4})
    beta = lanes.find("beta")
    assert beta is not None
    waiter = beta.admission.enter()  # beta waits: the full router empties idle alpha for it
    await full.refresh({"max_instances": 1})
    alpha = lanes.find("alpha")
    assert alpha is not None
    assert alpha.held
    await roomy.refresh({"max_instances": 4})  # nothing held there ...
    assert alpha.held  # ... but still on the full router
    waiter.release()
