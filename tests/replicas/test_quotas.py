"""Quotas for a fleet: the Redis script and the core's rule decide alike (one table of scenarios
against both), and two replicas sharing a real valkey-server count a tenant's requests and
tokens together."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from slotgate.errors import QuotaExceeded
from slotgate.gate.quotas import DAY_S, MAX_LIMIT, MINUTE_S, Quota, Standing, Windows
from slotgate.replicas.quotas import SharedWindows, parsed
from slotgate.settings import Settings

from tests.conftest import CHAT, RunningGate, chat, serve, write_keys
from tests.support.clock import Clock
from tests.support.standin import StandIn
from tests.support.valkey import Valkey

#: 10 s into tomorrow (UTC): the windows' keys expire after their day, so never in the past.
BASE = (time.time() // DAY_S + 1) * DAY_S + 10.0


@dataclass(frozen=True)
class Admit:
    """A request of `tenant` at `at` seconds past BASE: refused by `refused`, or admitted;
    either way standing as `standing` says."""

    at: float
    quota: Quota
    refused: str | None
    standing: Standing
    tenant: str = "chat"


@dataclass(frozen=True)
class Charge:
    at: float
    tokens: int
    tenant: str = "chat"


Step = Admit | Charge
RPM2 = Quota(requests_per_minute=2)
TPM100 = Quota(tokens_per_minute=100)
BOTH = Quota(tokens_per_minute=1000, tokens_per_day=150)
SCENARIOS: dict[str, list[Step]] = {
    "the third request of a minute is refused until the next minute": [
        Admit(0, RPM2, None, Standing(2, 1, 50.0, None, 0, 0.0)),
        Admit(1, RPM2, None, Standing(2, 0, 49.0, None, 0, 0.0)),
        Admit(2, RPM2, "requests_per_minute", Standing(2, 0, 48.0, None, 0, 0.0)),
        Admit(50.5, RPM2, None, Standing(2, 1, 59.5, None, 0, 0.0)),
    ],
    "tokens are charged at the end and checked at the next admission": [
        Admit(0, TPM100, None, Standing(None, 0, 0.0, 100, 100, 50.0)),
        Charge(1, 60),
        Admit(2, TPM100, None, Standing(None, 0, 0.0, 100, 40, 48.0)),
        Charge(3, 60),
        Admit(4, TPM100, "tokens_per_minute", Standing(None, 0, 0.0, 100, 0, 46.0)),
        Admit(51, TPM100, None, Standing(None, 0, 0.0, 100, 100, 59.0)),
    ],
    "a charge after its minute ended counts in the next": [
        Admit(0, TPM100, None, Standing(None, 0, 0.0, 100, 100, 50.0)),
        Charge(55, 100),
        Admit(56, TPM100, "tokens_per_minute", Standing(None, 0, 0.0, 100, 0, 54.0)),
    ],
    "the day's budget outlives the minute and frees at midnight UTC": [
        Admit(0, BOTH, None, Standing(None, 0, 0.0, 150, 150, DAY_S - 10.0)),
        Charge(1, 100),
        Admit(60, BOTH, None, Standing(None, 0, 0.0, 150, 50, DAY_S - 70.0)),
        Charge(61, 50),
        Admit(120, BOTH, "tokens_per_day", Standing(None, 0, 0.0, 150, 0, DAY_S - 130.0)),
        Admit(DAY_S - 10, BOTH, None, Standing(None, 0, 0.0, 150, 150, DAY_S)),
    ],
    "the minute binds while it has less left than the day": [
        Admit(0, BOTH, None, Standing(None, 0, 0.0, 150, 150, DAY_S - 10.0)),
        Admit(
            1,
            Quota(tokens_per_minute=100, tokens_per_day=1000),
            None,
            Standing(None, 0, 0.0, 100, 100, 49.0),
        ),
    ],
    "tenants count apart": [
        Admit(0, Quota(1), None, Standing(1, 0, 50.0, None, 0, 0.0)),
        Admit(0, Quota(1), None, Standing(1, 0, 50.0, None, 0, 0.0), tenant="jobs"),
        Admit(1, Quota(1), "requests_per_minute", Standing(1, 0, 49.0, None, 0, 0.0)),
    ],
}


def play_in_process(steps: list[Step]) -> None:
    clock = Clock(BASE)
    windows = Windows(clock)
    for step in steps:
        clock.now = BASE + step.at
        if isinstance(step, Charge):
            windows.charge(step.tenant, step.tokens)
            continue
        try:
            standing, refused = windows.admit_now(step.tenant, step.quota), None
        except QuotaExceeded as exc:
            standing, refused = exc.standing, exc.limit
        assert refused == step.refused, step
        assert standing == pytest.approx(step.standing), step


async def play_shared(valkey: Valkey, steps: list[Step]) -> None:
    shared = SharedWindows(valkey.url, f"parity-{time.monotonic_ns()}", timeout_s=5.0)
    try:
        for step in steps:
            now = BASE + step.at
            if isinstance(step, Charge):
                assert await shared.call(step.tenant, Quota(), step.tokens, now) == [b"charged"]
                continue
            refused, standing = parsed(await shared.call(step.tenant, step.quota, -1, now))
            assert refused == step.refused, step
            assert standing == pytest.approx(step.standing), step
    finally:
        await shared.aclose()


@pytest.mark.parametrize("steps", list(SCENARIOS.values()), ids=list(SCENARIOS))
async def test_the_core_and_the_redis_script_count_quotas_alike(
    valkey: Valkey, steps: list[Step]
) -> None:
    play_in_process(steps)
    await play_shared(valkey, steps)


# -- two replicas ------------------------------------------------------------------------------


@pytest.fixture
async def pair(
    standin: StandIn, valkey: Valkey, tmp_path: Path, served: list[RunningGate]
) -> tuple[RunningGate, RunningGate]:
    """Two slotgates sharing `valkey`, whose tenant `chat` (sk-chat) may send 3 requests and
    40 tokens a minute."""
    keys = write_keys(
        tmp_path, '[tenants.chat]\nkey = "sk-chat"\nrequests_per_minute = 3\n'
        "tokens_per_minute = 40\n",
    )  # fmt: skip
    gates = []
    for _ in range(2):
        gate = await serve(
            Settings(
                _env_file=None, llama_server_url=standin.url, props_refresh_interval_s=0.2,
                keepalive_interval_s=0, log_level="warning", redis_url=valkey.url,
                redis_fleet="quotas", redis_ttl_s=1.5, redis_timeout_s=1.0, api_keys_file=keys,
            )
        )  # fmt: skip
        served.append(gate)
        gates.append(gate)
    for gate in gates:
        await gate.until(lambda g=gate: g.service.gate.unready() is None)  # type: ignore[misc]
    return gates[0], gates[1]


async def a_minute_with_time_to_spare() -> None:
    """Wait, when the minute (Redis's clock is this machine's) ends within 15 s, for the next
    one: what the tests count must fall in one window."""
    left = MINUTE_S - time.time() % MINUTE_S
    if left < 15:
        await asyncio.sleep(left + 0.1)


async def post(client: httpx.AsyncClient, gate: RunningGate) -> httpx.Response:
    return await client.post(
        gate.url + CHAT, json=chat(), headers={"authorization": "Bearer sk-chat"}
    )


async def test_a_tenants_requests_per_minute_hold_across_two_replicas(
    pair: tuple[RunningGate, RunningGate], client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 1  # 4 tokens an answer: the token limit is not what refuses
    first, second = pair
    await a_minute_with_time_to_spare()
    answers = [await post(client, gate) for gate in (first, second, first, second)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    assert answers[3].json()["error"]["quota"] == "requests_per_minute"
    assert 0 < int(answers[3].headers["retry-after"]) <= MINUTE_S


async def test_tokens_used_through_one_replica_count_on_the_other(
    pair: tuple[RunningGate, RunningGate], client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 37  # 3 prompt + 37 completion: one answer uses the minute's 40
    first, second = pair
    await a_minute_with_time_to_spare()
    assert (await post(client, first)).status_code == 200
    # The charge reaches Redis after the answer, not before it.
    await first.until(lambda: first.service.ledger.pending == 0)  # type: ignore[attr-defined]
    refused = await post(client, second)
    assert refused.status_code == 429
    assert refused.json()["error"]["quota"] == "tokens_per_minute"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_with_redis_away_a_replica_counts_quotas_on_its_own(valkey: Valkey) -> None:
    local = Windows()
    shared = SharedWindows(valkey.url, "away", timeout_s=1.0, local=local)
    try:
        quota = Quota(requests_per_minute=1)
        await shared.admit("chat", quota)  # counted in Redis
        assert local.account("chat").requests == 0
        valkey.kill()
        # Not refused for Redis being away: this replica's own windows count from now on.
        await shared.admit("chat", quota)
        with pytest.raises(QuotaExceeded):
            await shared.admit("chat", quota)
        shared.charge("chat", 7)
        await asyncio.wait_for(until_charged(shared), 10)
        assert local.account("chat").minute_tokens == 7
    finally:
        await shared.aclose()


async def until_charged(shared: SharedWindows) -> None:
    while shared.pending:
        await asyncio.sleep(0.01)


async def test_the_largest_limits_a_keys_file_accepts_are_counted_exactly_in_redis(
    valkey: Valkey,
) -> None:
    # The script's numbers are doubles, written back with 14 digits: a limit past that came
    # back as "1e+14", which no replica could read (every request of the tenant failed).
    largest = Quota(MAX_LIMIT, MAX_LIMIT - 1, MAX_LIMIT)
    shared = SharedWindows(valkey.url, f"largest-{time.monotonic_ns()}", timeout_s=5.0)
    try:
        first = parsed(await shared.call("chat", largest, -1, BASE))
        await shared.call("chat", Quota(), 7, BASE + 1)
        second = parsed(await shared.call("chat", largest, -1, BASE + 2))
    finally:
        await shared.aclose()
    # Exactly, not approximately: a remaining count off by one is wrong.
    assert first == (
        None,
        Standing(MAX_LIMIT, MAX_LIMIT - 1, 50.0, MAX_LIMIT - 1, MAX_LIMIT - 1, 50.0),
    )
    assert second == (
        None, Standing(MAX_LIMIT, MAX_LIMIT - 2, 48.0, MAX_LIMIT - 1, MAX_LIMIT - 8, 48.0)
    )  # fmt: skip
