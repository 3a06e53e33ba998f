"""The status page in a real headless Chromium (Debian's, driven by Playwright): what it shows
of slots, the line, refusals and an upstream going away, and that with keys it shows nothing
before one. Screenshots go to the test's own directory (and to SLOTGATE_STATUS_SHOTS, a folder,
when set: that is how docs/status/*.png are made)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    chat,
    write_keys,
)
from tests.support.clock import Clock
from tests.support.router import children, hosted
from tests.support.standin import StandIn
from tests.support.tools import tool
from tests.support.valkey import Valkey

pytestmark = pytest.mark.browser

playwright = pytest.importorskip("playwright.async_api")
Page = playwright.Page

KEY = "sk-status-page-key"


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """Debian's Chromium (never a downloaded browser), headless."""
    chromium = tool("chromium", "chromium")
    async with playwright.async_playwright() as driver:
        launched = await driver.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            await launched.close()


async def shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    folder = os.environ.get("SLOTGATE_STATUS_SHOTS")
    if folder:
        shutil.copy(path, Path(folder) / path.name)


async def open_page(browser: Any, gate: RunningGate, **options: Any) -> Any:
    context = await browser.new_context(**options)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # The page's own errors and CSP refusals show on the console: none is expected.
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.errors = errors
    await page.goto(gate.url + "/status")
    return page


async def text(page: Any, selector: str, pattern: str) -> None:
    """Wait (up to 30 s, the machine may be slow) until `selector`'s text matches `pattern`."""
    await playwright.expect(page.locator(selector)).to_have_text(
        re.compile(pattern), timeout=30_000
    )


async def stream(
    client: httpx.AsyncClient,
    gate: RunningGate,
    started: asyncio.Event,
    body: dict[str, Any] | None = None,
    **headers: str,
) -> int:
    body = chat(stream=True) if body is None else body
    async with client.stream("POST", gate.url + CHAT, json=body, headers=headers) as r:
        async for _ in r.aiter_raw():
            started.set()
        return r.status_code


Opened = Callable[..., Awaitable[tuple[RunningGate, Any]]]


@pytest.fixture
def two_slots_open(start_gate: GateFactory, standin: StandIn, browser: Any) -> Opened:
    """Start slotgate with the given settings over a stand-in with two slots whose generations
    last (until `hurry()`), and open the page on it, showing them free."""

    async def start(**settings: Any) -> tuple[RunningGate, Any]:
        standin.total_slots, standin.tokens, standin.token_delay_s = 2, 2000, 0.05
        gate = await start_gate(**settings)
        page = await open_page(browser, gate, viewport={"width": 1100, "height": 900})
        await text(page, "#upstreams", r"0 busy, 2 free")
        return gate, page

    return start


async def test_the_page_shows_slots_the_line_refusals_and_an_upstream_going_away(
    two_slots_open: Opened,
    standin: StandIn,
    client: httpx.AsyncClient,
    browser: Any,
    tmp_path: Path,
) -> None:
    gate, page = await two_slots_open(max_queue=3)
    await text(page, "#state", r"1 of 1 upstreams ready")
    await text(page, "#waiting tbody", r"nobody waits")
    await shot(page, tmp_path, "status-at-rest")

    # Some seconds of quick requests, six at a time against two slots and a line of three:
    # admitted ones, and some refused, on the chart.
    standin.tokens, standin.token_delay_s = 3, 0.01
    loop = asyncio.get_running_loop()
    until = loop.time() + 6

    async def traffic() -> None:
        while loop.time() < until:
            await client.post(gate.url + CHAT, json=chat())

    await asyncio.gather(*(traffic() for _ in range(6)))
    await text(page, "#percentiles", r"slot hold p50 \d")
    standin.tokens, standin.token_delay_s = 2000, 0.05

    # Two slots held, three requests in line.
    holders = []
    for _ in range(2):
        started = asyncio.Event()
        holders.append(asyncio.create_task(stream(client, gate, started)))
        await started.wait()
    waiters = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": f"queued-{n}"})
        )
        for n in range(3)
    ]
    await gate.until(lambda: gate.service.admission.queued == 3)
    await text(page, "#upstreams", r"2 busy, 0 free")
    assert await page.locator("#upstreams .slot.busy").count() == 2
    await text(page, "#line-summary", r"^3 waiting \(limit 3\)")
    rows = page.locator("#waiting tbody tr")
    await playwright.expect(rows).to_have_count(3, timeout=30_000)
    for n in range(3):
        await text(page, f"#waiting tbody tr:nth-child({n + 1})", rf"^{n + 1}default.*queued-{n}")

    # A burst past the line's limit: 429s, counted on the chart's line.
    burst = await asyncio.gather(*(client.post(gate.url + CHAT, json=chat()) for _ in range(5)))
    assert {r.status_code for r in burst} == {429}
    await text(page, "#rates", r"429s [1-9]")
    assert await page.locator("#chart polyline.s-refused_429").count() == 1
    await shot(page, tmp_path, "status-under-load")

    # Its one upstream goes away (llama-server reloading its model): not ready, and why.
    standin.hurry()
    for waiter in waiters:
        assert (await waiter).status_code == 200
    for holder in holders:
        assert await holder == 200
    standin.loading = True
    await text(page, "#upstreams", r"NOT READY: .+")
    await text(page, "#state", r"0 of 1 upstreams ready")
    await shot(page, tmp_path, "status-upstream-down")

    # A phone, in dark mode.
    phone = await open_page(
        browser, gate, viewport={"width": 390, "height": 844}, color_scheme="dark"
    )
    await text(phone, "#upstreams", r"NOT READY")
    await shot(phone, tmp_path, "status-phone-dark")
    assert page.errors == []
    assert phone.errors == []


async def test_with_keys_the_page_shows_nothing_before_the_key_and_everything_after(
    start_gate: GateFactory, browser: Any, tmp_path: Path
) -> None:
    gate = await start_gate(api_keys=(KEY,))
    page = await open_page(browser, gate)
    await playwright.expect(page.locator("#key-form")).to_be_visible(timeout=30_000)
    await playwright.expect(page.locator("#board")).to_be_hidden()
    assert "slots busy" not in await page.locator("body").inner_text()
    await shot(page, tmp_path, "status-key-asked")

    await page.fill("#key", "not-the-key")
    await page.press("#key", "Enter")
    await text(page, "#key-error", r"not accepted")
    await playwright.expect(page.locator("#board")).to_be_hidden()

    await page.fill("#key", KEY)
    await page.press("#key", "Enter")
    await text(page, "#upstreams", r"0 busy, 2 free")
    # Kept for the tab, never put in a URL.
    assert await page.evaluate("sessionStorage.getItem('slotgate-key')") == KEY
    assert KEY not in page.url
    await page.reload()
    await text(page, "#upstreams", r"0 busy, 2 free")
    await playwright.expect(page.locator("#key-form")).to_be_hidden()
    # The 401 answers to the unkeyed and wrong tries are logged by the browser as failed
    # loads; the page's own script raised nothing.
    assert [e for e in page.errors if "401" not in e] == []


async def test_the_page_drains_pauses_and_cancels_through_the_operator_controls(
    two_slots_open: Opened, standin: StandIn, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    # Neither ADMIN_KEYS nor API_KEYS: the controls answer loopback clients, as this browser is.
    gate, page = await two_slots_open()
    name = gate.service.upstream.name

    await page.get_by_role("button", name=f"Drain {name}").click()
    await text(page, "#upstreams", r"DRAINING")
    assert gate.service.upstream.pool.draining
    await page.get_by_role("button", name=f"Restore {name}").click()
    await text(page, "#upstreams", rf"{re.escape(name)} ready")
    assert not gate.service.upstream.pool.draining

    await page.get_by_role("button", name="Pause admission").click()
    await text(page, "#state", r"PAUSED")
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "to-cancel"})
    )
    await text(page, "#waiting tbody", r"to-cancel")
    await shot(page, tmp_path, "status-paused")
    await (
        page.locator("#waiting tbody tr", has_text="to-cancel")
        .get_by_role("button", name="Cancel")
        .click()
    )
    answer = await waiter
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    await text(page, "#waiting tbody", r"nobody waits")
    await page.get_by_role("button", name="Resume admission").click()
    await text(page, "#state", r"^(?!.*PAUSED).*1 of 1 upstreams ready")
    standin.hurry()
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert page.errors == []


async def test_with_a_shared_line_the_page_names_the_mode_and_the_replicas(
    start_gate: GateFactory, valkey: Valkey, browser: Any, tmp_path: Path
) -> None:
    shared = {"redis_url": valkey.url, "redis_fleet": "status", "redis_timeout_s": 1.0}
    first = await start_gate(**shared)
    await start_gate(**shared)
    page = await open_page(browser, first)
    await text(page, "#replicas", r"^mode shared · 2 replicas · fleet \d+ of \d+ slots busy")
    # Redis goes away: the page says the line is kept apart, and why.
    valkey.kill()
    await text(page, "#replicas", r"^mode degraded \(Redis away: .+\)")
    await text(page, "#state", r"shared line DEGRADED")
    await shot(page, tmp_path, "status-replicas-degraded")


async def test_behind_a_router_the_page_shows_each_models_state_line_and_slots(
    router: MakeRouter,
    gate_before: GatesFor,
    client: httpx.AsyncClient,
    browser: Any,
    tmp_path: Path,
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1, "unloaded", ["b"])})
    alpha_child = children(upstream)["alpha"]
    alpha_child.tokens, alpha_child.token_delay_s = 2000, 0.05
    gate = await gate_before(upstream)
    alpha = gate.service.models.find("alpha")
    assert alpha is not None
    await gate.until(lambda: alpha.admission.capacity == 2)
    page = await open_page(browser, gate, viewport={"width": 1100, "height": 900})
    await text(page, "#models", r"alpha.*loaded.*0 busy, 2 free")
    await text(page, "#models", r"beta \(b\).*unloaded.*no slots while unloaded")
    await text(page, "#state", r"1 of 2 models loaded · 0 of 2 slots busy")

    # Both of alpha's slots held, one request in its line.
    holders = []
    for _ in range(2):
        started = asyncio.Event()
        body = chat(model="alpha", stream=True)
        holders.append(asyncio.create_task(stream(client, gate, started, body)))
        await started.wait()
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(model="alpha"), headers={"x-request-id": "for-a"})
    )
    await gate.until(lambda: alpha.admission.queued == 1)
    await text(page, "#models", r"alpha.*1 waiting.*2 busy, 0 free")
    assert await page.locator("#models .slot.busy").count() == 2
    await text(page, "#waiting tbody tr", r"alpha.*for-a")
    await text(page, "#line-summary", r"^1 waiting")
    await text(page, "#state", r"2 of 2 slots busy · 1 waiting")
    await shot(page, tmp_path, "status-models")

    # The router drained: every model's pool says so.
    name = gate.service.upstream.name
    await page.get_by_role("button", name=f"Drain {name}").click()
    await text(page, "#models", r"alpha.*DRAINING: 2 running finish")
    await text(
        page, "#state", r"1 of 1 upstreams ready · 1 drained · .* 2 slots busy \(0 in rotation\)"
    )
    await shot(page, tmp_path, "status-models-drained")
    await page.get_by_role("button", name=f"Restore {name}").click()
    await text(page, "#models", r"^(?!.*DRAINING)")
    alpha_child.hurry()
    assert (await waiter).status_code == 200
    for holder in holders:
        assert await holder == 200
    assert page.errors == []


async def test_the_tenants_table_shows_what_is_left_of_a_tenants_quota(
    start_gate: GateFactory, browser: Any, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    keys = write_keys(
        tmp_path, f'[tenants.chat]\nkey = "{KEY}"\nrequests_per_minute = 60\n'
        '[tenants.free]\nkey = "sk-free"\n',
    )  # fmt: skip
    gate = await start_gate(api_keys_file=keys)
    gate.service.quotas.clock = Clock()  # a minute that does not turn over during the test
    answer = await client.post(
        gate.url + CHAT, json=chat(), headers={"authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 200
    page = await open_page(browser, gate)
    await page.fill("#key", KEY)
    await page.press("#key", "Enter")
    await text(
        page, "#tenants tbody tr:first-child td:first-child", r"^chat59 of 60 requests/min left$"
    )
    await text(page, "#tenants tbody tr:nth-child(2) td:first-child", r"^free$")
