"""The app slotgate's server calls: relayed requests to the proxy, the rest to FastAPI."""

from __future__ import annotations

from typing import Any

import pytest
from slotgate.asgi import Message, Receive, Scope, Send
from slotgate.controls import PREFIX
from slotgate.main import OWN_PATHS, create_app
from slotgate.proxy.front import Front
from slotgate.settings import Settings


class _App:
    """An ASGI app that records the scopes it was called with."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)


async def _nothing() -> Message:
    return {}


async def _ignore(message: Message) -> None:
    return None


@pytest.mark.parametrize(
    ("scope", "relayed"),
    [
        ({"type": "http", "path": "/v1/chat/completions"}, True),
        ({"type": "http", "path": "/props"}, True),
        ({"type": "http", "path": "/metrics"}, False),
        ({"type": "http", "path": "/readyz"}, False),
        ({"type": "http", "path": PREFIX + "pause"}, False),
        ({"type": "lifespan"}, False),
    ],
)
async def test_a_relayed_request_goes_to_the_proxy_and_anything_else_to_slotgates_own_app(
    scope: dict[str, Any], relayed: bool
) -> None:
    proxy, own = _App(), _App()
    await Front(proxy, own, OWN_PATHS, PREFIX)(scope, _nothing, _ignore)
    assert (proxy.scopes, own.scopes) == (([scope], []) if relayed else ([], [scope]))


def test_slotgates_app_is_served_through_its_front_with_its_own_proxy() -> None:
    from slotgate.cli import uvicorn_config

    app = create_app(Settings(_env_file=None, llama_server_url="http://127.0.0.1:9"))
    front = uvicorn_config(app, Settings(_env_file=None)).app
    assert isinstance(front, Front)
    assert (front.proxy, front.own) == (app.proxy, app)
