"""The ASGI app slotgate's server calls: a relayed request goes straight to the Proxy
(app/proxy/relay.py); slotgate's own routes and the lifespan go to the FastAPI app (app/main.py).

It is compiled with the relay: the FastAPI app's class is interpreted code (it subclasses
FastAPI), and a coroutine of its in front of every relayed request would run interpreted
twice a request (started, and resumed once the answer comes) and hold a frame for as long as
the request waits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from slotgate.asgi import Receive, Scope, Send

App = Callable[[Scope, Receive, Send], Awaitable[None]]


class Front:
    """Which app answers a request: `proxy`, unless its path is one of `own_paths` or starts with
    `own_prefix` (slotgate's own routes, answered by `own`)."""

    __slots__ = ("_own_paths", "_own_prefix", "own", "proxy")

    def __init__(self, proxy: App, own: App, own_paths: frozenset[str], own_prefix: str) -> None:
        self.proxy = proxy
        self.own = own
        self._own_paths = own_paths
        self._own_prefix = own_prefix

    def relays(self, path: str) -> bool:
        """Is a request for `path` llama-server's (relayed), not slotgate's own?"""
        return path not in self._own_paths and not path.startswith(self._own_prefix)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.relays(scope["path"]):
            proxy = self.proxy
            await proxy(scope, receive, send)
            return
        own = self.own
        await own(scope, receive, send)


__all__ = ["Front"]
