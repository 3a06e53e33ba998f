"""The fleet's edges: discovery that fails in odd ways, and llama-server's metrics from
several upstreams merged into one valid exposition."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from pydantic import ValidationError
from slotgate.admission import Admission
from slotgate.fleet import Fleet
from slotgate.settings import Settings


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def settings_for(url: str) -> Settings:
    return Settings(
        _env_file=None, llama_server_url=url, props_refresh_interval=0.05, log_level="warning"
    )


def test_a_host_name_that_cannot_be_encoded_is_refused_at_start_naming_the_setting() -> None:
    # "x..y" has an empty label: encoding it for DNS or the Host header fails (UnicodeError).
    for url in ("http://x..y:9", "http://127.0.0.1:8080,http://" + "a" * 64 + ".test"):
        with pytest.raises(ValidationError, match="host name that cannot be looked up"):
            settings_for(url)


async def test_discovery_goes_on_after_the_resolver_fails_with_something_other_than_oserror() -> (
    None
):
    calls = 0

    async def resolver(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise UnicodeError("label empty or too long")
        return ["127.0.0.1", "127.0.0.2"]

    settings = settings_for("http://llama.fleet.test:9")
    fleet = Fleet(settings, Admission(settings.queue_policy), resolver)
    await fleet.start()
    try:
        await until(lambda: len(fleet.upstreams) == 2)
    finally:
        await fleet.close()
