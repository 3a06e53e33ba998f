"""A TCP relay between one replica and Valkey that a test can cut: a network partition of that
replica alone, the others still reaching Valkey."""

from __future__ import annotations

import asyncio
import contextlib


class Partition:
    """Relays 127.0.0.1:`port` to Valkey at `target_port`. `cut()` drops every byte both ways
    and leaves the connections open, as a partition does (nothing is refused or reset, so
    the replica learns of it only by its calls timing out); `heal()` relays again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._healed = asyncio.Event()
        self._healed.set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self.cut_off = True
        self._healed.clear()

    def heal(self) -> None:
        self.cut_off = False
        self._healed.set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self.heal()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A connection made while cut hangs (its connect times out in the replica) until healed.
        await self._healed.wait()
        try:
            far_reader, far_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, far_writer}
        try:
            await asyncio.gather(self._pipe(reader, far_writer), self._pipe(far_reader, writer))
        finally:
            for w in (writer, far_writer):
                self._writers.discard(w)
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self.cut_off:
                    continue  # lost on the way
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()
