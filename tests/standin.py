"""A stand-in llama-server: real sockets, slow configurable token streams, and a count of how
many generations run at once, so tests can see what slotgate lets through."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

GENERATION_PATHS = (
    "/v1/chat/completions", "/chat/completions", "/completion", "/completions",
    "/v1/completions", "/infill", "/v1/responses", "/responses", "/v1/messages",
    "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
    "/v1/reranking", "/v1/audio/transcriptions",
)  # fmt: skip


@dataclass
class Seen:
    """One request as the stand-in received it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StandIn:
    """Behaviour knobs (set them from a test) and counters (read them after)."""

    total_slots: int = 2
    tokens: int = 5
    token_delay_s: float = 0.02
    loading: bool = False  # answer 503 "Loading model" everywhere, like llama-server does
    fault: str | None = None  # "die_midstream" | "hang" | "garbage" | "error_400"
    padding: int = 0  # extra bytes of content in every streamed chunk
    close_after_stream: bool = True  # close the connection after a stream, as llama-server does
    api_key: str | None = None  # /props wants it as a Bearer token, as with --api-key
    cors_origins: set[str] | None = None  # None: echo any Origin; else as --cors-origins
    shutdown_timeout_s: float = 60.0  # how long stop() lets running handlers finish
    verbose: bool = False  # add `__verbose` to answers, as llama-server --verbose does
    sent_bytes: int = 0  # streamed bytes handed to the socket so far
    tokens_predicted: tuple[int, float] = (0, 0.0)  # /metrics: tokens generated, seconds taken
    running: int = 0
    max_running: int = 0
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    open_connections: int = 0
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    model: str = "standin.gguf"  # /props model_path
    host: str = "127.0.0.1"  # any of 127.0.0.0/8: several stand-ins on one port, for DNS
    created: int = field(default_factory=lambda: int(time.time()))
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # llama-server takes big bodies
        app.router.add_get("/props", self._props)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        for path in GENERATION_PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        app.on_response_prepare.append(self._cors)
        # handler_cancellation: like llama-server, notice a client that left and stop working.
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.shutdown_timeout_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def hurry(self) -> None:
        """Let running and later generations finish at once: for a test that has seen what it
        held a slot for (the running stream reads the delay before each token)."""
        self.token_delay_s = 0.0

    def connections(self) -> int:
        """Connections open at the stand-in right now."""
        server = self._runner.server if self._runner else None
        return len(server.connections) if server is not None else 0

    # -- handlers -------------------------------------------------------------------------------

    def _record(self, request: web.Request, body: bytes) -> None:
        self.seen.append(
            Seen(
                request.method,
                request.path,
                request.rel_url.raw_query_string,
                dict(request.headers),
                body,
            )
        )

    def _loading(self) -> web.Response:
        return web.json_response(
            {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
            status=503,
        )

    async def _cors(self, request: web.Request, response: web.StreamResponse) -> None:
        """As llama-server does: every answer echoes the Origin (only an allowed one, when
        started with --cors-origins); a preflight allows the rest."""
        origin = request.headers.get("Origin")
        if origin is None:
            return
        allowed = self.cors_origins
        response.headers["Access-Control-Allow-Origin"] = (
            origin if allowed is None or origin in allowed else ",".join(sorted(allowed))
        )
        if request.method == "OPTIONS":
            response.headers["Access-Control-Allow-Credentials"] = "true"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = "*"

    async def _props(self, request: web.Request) -> web.Response:
        if self.loading:
            return self._loading()
        if self.api_key is not None and request.headers.get("Authorization") != (
            f"Bearer {self.api_key}"
        ):
            return web.json_response(
                {"error": {"code": 401, "message": "Invalid API Key",
                           "type": "authentication_error"}},
                status=401,
            )  # fmt: skip
        return web.json_response(
            {
                "total_slots": self.total_slots,
                "default_generation_settings": {"n_ctx": 1024, "params": {}},
                "model_path": self.model,
                "build_info": "standin",
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        if self.loading:
            return self._loading()
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {self.running}\n"
            "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed\n"
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            f"llamacpp:tokens_predicted_total {self.tokens_predicted[0]}\n"
            "# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens\n"
            "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
            f"llamacpp:tokens_predicted_seconds_total {self.tokens_predicted[1]}\n"
        )
        # llama-server sends when it started with its metrics.
        headers = {"Process-Start-Time-Unix": str(self.created)}
        return web.Response(text=text, content_type="text/plain", headers=headers)

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self._record(request, body)
        headers = {"X-Standin": "echo"}
        query = request.rel_url.raw_query_string
        answer = {"method": request.method, "path": request.path, "query": query,
                  "body": body.decode("utf-8", "replace")}  # fmt: skip
        return web.json_response(answer, headers=headers)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._record(request, body)
        if self.loading:
            return self._loading()
        if self.fault == "error_400":
            return web.json_response(
                {"error": {"code": 400, "message": "request (9999 tokens) exceeds the available "
                           "context size (1024 tokens), try increasing it",
                           "type": "exceed_context_size_error"}},
                status=400,
            )  # fmt: skip
        payload: dict[str, Any] = json.loads(body) if body and body[:1] == b"{" else {}
        self.running += 1
        self.started += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if payload.get("stream"):
                # Like llama-server, a malformed option falls back to its default.
                options = payload.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await self._stream(request, usage)
            return await self._complete()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self.finished += 1

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": 3, "completion_tokens": self.tokens,
                "total_tokens": 3 + self.tokens}  # fmt: skip

    async def _complete(self) -> web.Response:
        if self.fault == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.tokens * self.token_delay_s)
        if self.fault == "garbage":
            return web.Response(body=b"\x00\xffnot json", content_type="application/json")
        return web.json_response(
            {
                "choices": [{"finish_reason": "stop", "index": 0, "message": {
                    "role": "assistant", "content": "".join(f"t{i} " for i in range(self.tokens)),
                }}],
                "created": self.created,
                "model": "standin.gguf",
                "system_fingerprint": "b0-standin",
                "object": "chat.completion",
                "usage": self._usage(),
                "id": "chatcmpl-standin",
                "timings": {"predicted_n": self.tokens},
                **({"__verbose": {"stream": False}} if self.verbose else {}),
            }
        )  # fmt: skip

    async def _stream(self, request: web.Request, usage: bool) -> web.StreamResponse:
        """Events shaped as llama-server sends them: a role delta first, content deltas, a
        finish chunk carrying the timings, a usage chunk when asked for, then [DONE]."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        head = {"created": self.created, "id": "chatcmpl-standin", "model": "standin.gguf",
                "system_fingerprint": "b0-standin", "object": "chat.completion.chunk"}  # fmt: skip

        async def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            data = f"data: {json.dumps({'choices': choices, **head, **extra})}\n\n".encode()
            await response.write(data)
            self.sent_bytes += len(data)

        for i in range(self.tokens):
            if self.fault == "hang" and i == 1:
                await asyncio.sleep(3600)
            if self.fault == "die_midstream" and i == 2:
                assert request.transport is not None
                request.transport.abort()
                raise asyncio.CancelledError
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if i == 0:
                await event([{"finish_reason": None, "index": 0,
                              "delta": {"role": "assistant", "content": None}}])  # fmt: skip
            content = f"t{i} " + "x" * self.padding
            await event([{"finish_reason": None, "index": 0, "delta": {"content": content}}])
        extra: dict[str, Any] = {"__verbose": {"stream": True}} if self.verbose else {}
        await event([{"finish_reason": "stop", "index": 0, "delta": {}}],
                    timings={"predicted_n": self.tokens}, **extra)  # fmt: skip
        if usage:
            await event([], usage=self._usage())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        if self.close_after_stream and request.transport is not None:
            request.transport.close()  # though the head said nothing of it
        return response
