"""The type aliases every module shares: ASGI's callables and messages, and raw headers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: One header as it travels: a lower-case name and its raw value.
Header = tuple[bytes, bytes]
Headers = list[Header]
