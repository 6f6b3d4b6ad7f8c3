"""Loopback pieces shared by the route-feed tests: an in-process relay on a real Redis, a fake
sandbox app that answers and streams slowly, and a client that watches a stream end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from relay.config import Config
from relay.config_parse import parse
from relay.feeds.redis import RedisFeed
from relay.feeds.redis_client import publish_delete, publish_puts
from relay.runtime import Relay

STREAM_CHUNK_INTERVAL_S = 0.05
STREAM_MAX_S = 30.0  # a stream nobody revokes ends by itself: every loop is bounded
# No request in these tests may hang: a stuck exchange fails the test within seconds.
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=10)


def relay_config(tmp_path: Path, redis_url: str, **routes: Any) -> Config:
    return parse(
        {
            "listen": {"address": "127.0.0.1:0"},
            "admin": {"address": "127.0.0.1:0"},
            "routes": {"source": "redis", "redis_url": redis_url, **routes},
        },
        tmp_path,
    )


def route(sandbox_id: str, *, address: str = "127.0.0.1", generation: int = 0) -> dict[str, Any]:
    return {
        "sandbox_id": sandbox_id,
        "address": address,
        "envd_token": f"tok-{sandbox_id}",
        "generation": generation,
    }


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


async def put(client: aioredis.Redis, *routes: dict[str, Any], prefix: str = "relay:") -> None:
    """What ``relay routes put`` does: HSET + XADD for every route in one MULTI/EXEC."""
    await publish_puts(client, prefix, [(r["sandbox_id"], dumps(r)) for r in routes], None)


async def delete(client: aioredis.Redis, sandbox_id: str, prefix: str = "relay:") -> None:
    await publish_delete(client, prefix, sandbox_id, None)


async def load_hash(client: aioredis.Redis, routes: list[dict[str, Any]]) -> None:
    """Fill the routes hash directly (a snapshot, no events), 1,000 fields per command."""
    for start in range(0, len(routes), 1000):
        part = routes[start : start + 1000]
        await client.hset("relay:routes", mapping={r["sandbox_id"]: dumps(r) for r in part})


async def wait_for(
    condition: Callable[[], bool], limit_s: float, what: str, interval: float = 0.005
) -> float:
    """Poll until ``condition()``; the time it took. Fails the test after ``limit_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"timed out after {limit_s}s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def wait_until(
    probe: Callable[[], Awaitable[bool]], limit_s: float, what: str, interval: float = 0.005
) -> float:
    start = time.monotonic()
    while not await probe():
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"timed out after {limit_s}s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def start_relay(config: Config, **feed_settings: Any) -> Relay:
    """An in-process relay; ``feed_settings`` tune its RedisFeed (block_ms, backoff_cap_s)."""
    relay = Relay(config)
    feed = relay.feed
    assert isinstance(feed, RedisFeed)
    for name, value in feed_settings.items():
        assert hasattr(feed, name), name
        setattr(feed, name, value)
    await relay.start()
    return relay


def redis_feed(relay: Relay) -> RedisFeed:
    feed = relay.feed
    assert isinstance(feed, RedisFeed)
    return feed


# -- a slow link to Redis ----------------------------------------------------------------


class ThrottledProxy:
    """A TCP proxy to Redis whose replies arrive at ``rate`` bytes per second: a table that takes
    longer to arrive than the read timeout a hang is noticed by (a large fleet, a slow link)."""

    def __init__(self, upstream_port: int, rate: int) -> None:
        self.upstream_port = upstream_port
        self.rate = rate
        self.server: asyncio.Server | None = None
        self.flowing = asyncio.Event()  # cleared: Redis's replies stop (a black hole)
        self.flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every open connection
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def stop(self) -> None:
        """Closes every connection and waits for its handler (bounded): a handler left to be
        cancelled with the loop is reported as an error by asyncio's streams on 3.11."""
        if self.server is not None:
            self.server.close()
        self.flowing.set()
        for writer in list(self._writers):
            writer.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self.upstream_port
                )
            except OSError:
                return
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pipe(reader, up_writer, slow=False), self._pipe(up_reader, writer, slow=True)
            )
        finally:
            for end in (writer, up_writer):
                if end is not None:
                    end.close()
                    self._writers.discard(end)
            self._handlers.discard(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, slow: bool
    ) -> None:
        """Replies (``slow``) pass in slices of ``rate / 50`` bytes every 20 ms, sliced as they
        are written, so that a change of ``rate`` applies from the next slice on."""
        try:
            while data := await src.read(65536):
                sent = 0
                while sent < len(data):
                    if slow:
                        await self.flowing.wait()
                    if dst.is_closing():  # closed while held (stop); uvloop raises on a write
                        return
                    size = max(1, self.rate // 50) if slow else len(data)
                    dst.write(data[sent : sent + size])
                    sent += size
                    await dst.drain()
                    if slow:
                        await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()


# -- a fake sandbox app ---------------------------------------------------------------------


class SandboxApp:
    """Answers ``GET /`` with the address it was reached on; ``GET /stream`` streams a
    chunk every 50 ms (chunked) for up to 30 s."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        app = web.Application()
        app.router.add_get("/", self._hello)
        app.router.add_get("/stream", self._stream)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        for host in hosts:
            site = web.TCPSite(self.runner, host, self.port)
            await site.start()
            if not self.port:
                server = site._server
                assert server is not None
                self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _hello(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        return web.Response(text=sockname[0] if sockname else "?")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        deadline = time.monotonic() + STREAM_MAX_S
        with_error = (ConnectionError, asyncio.CancelledError)
        try:
            while time.monotonic() < deadline:
                await response.write(b"tick\n")
                await asyncio.sleep(STREAM_CHUNK_INTERVAL_S)
        except with_error:
            return response
        await response.write_eof()
        return response


def sandbox_headers(sandbox_id: str, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


async def get(
    session: aiohttp.ClientSession, relay_port: int, sandbox_id: str, app_port: int
) -> tuple[int, str, dict[str, str]]:
    async with session.get(
        f"http://127.0.0.1:{relay_port}/", headers=sandbox_headers(sandbox_id, app_port)
    ) as response:
        return response.status, await response.text(), dict(response.headers)


@dataclass
class LiveStream:
    """A slow stream through a relay; records when and how it ended."""

    chunks: int = 0
    ended_at: float | None = None
    truncated: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def _run(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
        try:
            async with session.get(url, headers=headers) as response:
                assert response.status == 200, response.status
                async for _chunk in response.content.iter_any():
                    self.chunks += 1
                    self.started.set()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            self.truncated = True
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.ended.set()

    @classmethod
    async def open(
        cls, session: aiohttp.ClientSession, relay_port: int, sandbox_id: str, app_port: int
    ) -> LiveStream:
        stream = cls()
        url = f"http://127.0.0.1:{relay_port}/stream"
        stream.task = asyncio.get_running_loop().create_task(
            stream._run(session, url, sandbox_headers(sandbox_id, app_port))
        )
        await asyncio.wait_for(stream.started.wait(), 5)
        assert stream.ended_at is None, "the stream ended before it started"
        return stream

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


@contextlib.asynccontextmanager
async def relay_through_proxy(
    tmp_path: Path, redis_port: int, *, rate: int, max_stale_s: float, **feed_settings: Any
) -> AsyncIterator[tuple[Relay, RedisFeed, ThrottledProxy]]:
    """An in-process relay whose Redis replies pass through a :class:`ThrottledProxy` at
    ``rate``; ``feed_settings`` tune its RedisFeed (``start_relay``). At the end the link
    flows again, then the relay stops, then the proxy."""
    proxy = ThrottledProxy(redis_port, rate=rate)
    proxy_port = await proxy.start()
    try:
        url = f"redis://127.0.0.1:{proxy_port}"
        relay = await start_relay(
            relay_config(tmp_path, url, max_stale_s=max_stale_s), **feed_settings
        )
        try:
            yield relay, redis_feed(relay), proxy
        finally:
            proxy.flowing.set()
            await relay.stop()
    finally:
        await proxy.stop()
