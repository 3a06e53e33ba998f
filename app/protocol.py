"""uvicorn's httptools protocol, with a bound on the bytes of a request that are not its body.

uvicorn sets no limit on request headers, and httptools gathers a header's value whole before
handing it over: a client could make slotgate hold megabytes of one header in memory before
any check of slotgate's ran (20 MB were taken, then refused), and the same through the
trailers after a chunked body. This protocol counts every byte of a request that is not body
(request line, headers, chunk framing, trailers) as it arrives and, past HEAD_LIMIT_BYTES,
answers 431 in the API's error shape. It then reads and drops what the client still sends for
LINGER_S before it closes: closed at once, the unread bytes would make the kernel reset the
connection, and the 431 would be lost with it. Heads under the limit reach the relay, whose
own checks (64 KiB in all, 8 KiB per line) answer with the request's id in the route's shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import HeadersTooLarge, refusal, render

#: A read that ends one request and starts the next is counted whole against the next: reads
#: are at most 256 KiB, so this leaves any head the relay accepts (64 KiB) room to spare,
#: and bounds what httptools gathers, at a cost that grows with the square of a value's size.
HEAD_LIMIT_BYTES = 384 * 1024
LINGER_S = 1.0


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes other than body the request being read may still take; None once refused.
        self._head_left: int | None = HEAD_LIMIT_BYTES

    def data_received(self, data: bytes) -> None:
        if self._head_left is None:
            return  # refused: what still arrives is dropped until the close
        super().data_received(data)
        if self.transport.is_closing():
            return
        self._head_left -= len(data)  # the body in it was credited back by on_body
        if self._head_left < 0:
            self._refuse()

    def on_body(self, body: bytes) -> None:
        if self._head_left is not None:
            self._head_left += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._head_left is not None:
            self._head_left = HEAD_LIMIT_BYTES
        super().on_message_complete()

    def _refuse(self) -> None:
        self._head_left = None
        message = f"request head is over {HEAD_LIMIT_BYTES} bytes and still not complete"
        status, headers, body = render(refusal(HeadersTooLarge(message)), "openai")
        head = b"".join(b"%s: %s\r\n" % header for header in headers)
        self.transport.write(
            b"HTTP/1.1 %d Request Header Fields Too Large\r\n%sconnection: close\r\n\r\n%s"
            % (status, head, body)
        )
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
