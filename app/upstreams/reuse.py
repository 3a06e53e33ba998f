"""llama-server's connection reuse policy on top of the generic client (app/upstreams/client.py):
whether a connection that carried an event stream may be pooled (learned by a probe), and
spare connections opened ahead of need so a handed-on slot does not wait for a handshake.
"""

from __future__ import annotations

import asyncio

from slotgate.errors import ConnectFailed
from slotgate.upstreams.client import Client
from slotgate.upstreams.connection import Connection

#: Connections opened ahead of need after an exchange whose connection cannot be reused.
WARM_CONNECTIONS = 2
#: How long the first connections that carried an event stream are held aside, to learn
#: whether the upstream closes them (see UpstreamClient._reuse).
STREAM_PROBE_S = 1.0


class UpstreamClient(Client):
    """The client slotgate talks to llama-server with."""

    def _started(self) -> None:
        self._warming: set[asyncio.Task[None]] = set()
        self._probe: tuple[Connection, asyncio.TimerHandle] | None = None
        #: Does the upstream keep a connection open after an event stream? None until seen.
        self.keeps_streams: bool | None = None

    def relearn(self) -> None:
        """The upstream went away: whatever answers next may be another build."""
        self.keeps_streams = None

    # -- after a stream ------------------------------------------------------------------------

    def _reuse(self, conn: Connection, *, stream: bool) -> None:
        """Pool a connection whose response ended cleanly; after an event stream, only if the
        upstream keeps such connections open.

        llama-server (the builds measured) closes the connection after every streamed answer
        although its head says Keep-Alive; pooled, such a connection would fail the next
        request sent down it, typically the waiter just handed the slot, and a POST cannot
        be retried safely. Other upstreams keep it, and reusing it saves a TCP handshake per
        request. Which one this is, is learned from the first stream: its connection is held
        aside for STREAM_PROBE_S, never used, and the upstream either closes it (stream
        connections are closed from then on) or leaves it open (pooled from then on). A
        pooled one later found closed by the upstream revokes that (see _closed_while_idle).
        """
        if not stream:
            self._give_back(conn)
            return
        if conn.is_closed():
            self.keeps_streams = False
        elif self.keeps_streams and not self._closed:
            conn.carried_stream = True
            self._give_back(conn)
            return
        elif self.keeps_streams is None and self._probe is None and not self._closed:
            timer = asyncio.get_running_loop().call_later(STREAM_PROBE_S, self._probed)
            self._probe = conn, timer
            conn.on_lost = self._closed_after_stream
            self._replace()
            return
        conn.close()
        self._replace()

    def _probed(self) -> None:
        assert self._probe is not None  # noqa: S101 - the timer is cancelled with the probe
        conn, _ = self._probe
        self._probe = None
        conn.on_lost = None
        # The kernel's word, not the loop's: after a stall, uvloop runs due timers before it
        # reads the socket, so a close that arrived in time may not have been seen yet.
        if conn.peer_closed():
            self.keeps_streams = False
        elif self.keeps_streams is None:
            self.keeps_streams = True
        if self.keeps_streams:
            conn.carried_stream = True
            self._give_back(conn)
            conn.idle_since -= STREAM_PROBE_S  # idle at the upstream since its stream ended
        else:
            conn.close()

    def _closed_after_stream(self) -> None:
        if self._probe is not None:
            self._probe[1].cancel()
            self._probe = None
            self.keeps_streams = False

    def _closed_while_idle(self, conn: Connection, now: float) -> None:
        if conn.carried_stream and not conn.poisoned and now - conn.idle_since < self._keepalive_s:
            # Pooled after a stream, and closed before it idled out: this upstream closes
            # after streams after all (it was restarted as another build).
            self.keeps_streams = False

    def _unreachable(self) -> None:
        self.relearn()

    # -- warm spares ---------------------------------------------------------------------------

    def _replace(self) -> None:
        """Open a replacement now, off the critical path, so the next request (typically the
        waiter just handed this slot) does not wait for a TCP handshake."""
        if self._closed or len(self._idle) + len(self._warming) >= WARM_CONNECTIONS:
            return
        task = asyncio.ensure_future(self._warm())
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self) -> None:
        try:
            conn = await self._connect()
        except ConnectFailed:
            return  # the next request will find out, and say so
        self._give_back(conn)

    def close(self) -> None:
        self._closed = True
        for task in self._warming:
            task.cancel()
        if self._probe is not None:
            conn, timer = self._probe
            self._probe = None
            timer.cancel()
            conn.on_lost = None
            conn.close()
        super().close()
