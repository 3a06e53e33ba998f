"""uvicorn's httptools protocol, with a bound on how much one request head may take.

uvicorn sets no limit on request headers, and httptools gathers a header's value whole before
handing it over: a client could make slotgate hold megabytes of one header in memory before
any check of slotgate's ran (20 MB were taken, then refused). This protocol counts the bytes
of each request head as they arrive and, past HEAD_LIMIT_BYTES, answers 431 in the API's error
shape and closes the connection. Heads under the limit reach the relay, whose own checks
(64 KiB in all, 8 KiB per line) answer with the request's id and in the route's shape.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import HeadersTooLarge, refusal, render

#: Well past the relay's 64 KiB, so that only a head the relay could never take ends here; and
#: counted per read, so a read that ends one head and starts the next counts whole.
HEAD_LIMIT_BYTES = 1024 * 1024


class BoundedHeadProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes the head being read may still take; None while a body is read.
        self._head_left: int | None = HEAD_LIMIT_BYTES

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_left is None or self.transport.is_closing():
            return
        self._head_left -= len(data)
        if self._head_left < 0:
            message = f"request head is over {HEAD_LIMIT_BYTES} bytes and still not complete"
            status, headers, body = render(refusal(HeadersTooLarge(message)), "openai")
            head = b"".join(b"%s: %s\r\n" % header for header in headers)
            self.transport.write(
                b"HTTP/1.1 %d Request Header Fields Too Large\r\n%sconnection: close\r\n\r\n%s"
                % (status, head, body)
            )
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._head_left = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_left = HEAD_LIMIT_BYTES
        super().on_message_complete()
