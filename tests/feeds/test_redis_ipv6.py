"""The Redis route feed over IPv6: a redis-server on ``[::1]`` (``redis://[::1]:port``) and
routes whose address is ``::1``, on a sandbox app listening on 127.0.0.1 and ::1 at one port
(it answers with the address it was reached on). Skipped, saying why, without an IPv6
loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from relay.config_parse import parse
from tests.feeds.helpers import (
    CLIENT_TIMEOUT,
    LiveStream,
    SandboxApp,
    get,
    put,
    redis_feed,
    route,
    start_relay,
    wait_for,
    wait_until,
)
from tests.feeds.redisproc import RedisProcess, running_redis
from tests.support.ipv6 import no_ipv6_loopback

_NO_IPV6 = no_ipv6_loopback()
pytestmark = pytest.mark.skipif(_NO_IPV6 is not None, reason=f"no IPv6 loopback: {_NO_IPV6}")


@pytest.fixture
def redis_v6(tmp_path: Path) -> Iterator[RedisProcess]:
    with running_redis(tmp_path / "redis", host="::1") as server:
        yield server


@pytest.fixture
async def app() -> AsyncIterator[SandboxApp]:
    sandbox = SandboxApp()
    await sandbox.start(hosts=("127.0.0.1", "::1"))
    try:
        yield sandbox
    finally:
        await sandbox.stop()


async def test_ipv6_routes_from_a_redis_on_ipv6(
    tmp_path: Path, redis_v6: RedisProcess, app: SandboxApp
) -> None:
    """A route at ``0:0::1`` is ``::1`` (one address, one pool); publishing it again as ``::1``
    is identical and revokes nothing (SPEC §3); moving it to 127.0.0.1 revokes its stream
    within a second and the next request reaches the new address."""
    assert redis_v6.url.startswith("redis://[::1]:")
    writer = aioredis.Redis.from_url(redis_v6.url, protocol=2)
    config = parse(
        {
            "listen": {"address": "127.0.0.1:0"},
            "admin": {"address": "127.0.0.1:0"},
            "routes": {"source": "redis", "redis_url": redis_v6.url},
            "upstream": {"allowed_cidrs": ["127.0.0.0/8", "::1/128"]},
        },
        tmp_path,
    )
    relay = await start_relay(config)
    feed = redis_feed(relay)
    try:
        await put(writer, route("sbxv6", address="0:0::1"))
        port = relay.bound[0][1]
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:

            async def answers(status: int, body: str) -> bool:
                got = await get(session, port, "sbxv6", app.port)
                return got[:2] == (status, body)

            await wait_until(lambda: answers(200, "::1"), 5, "the route at ::1", 0.02)
            route_now = relay.table.get("sbxv6")
            assert route_now is not None
            assert route_now.address == "::1"

            stream = await LiveStream.open(session, port, "sbxv6", app.port)
            try:
                applied = feed.events
                await put(writer, route("sbxv6", address="::1"))  # the same route
                await wait_for(lambda: feed.events > applied, 5, "the same route applied")
                before = stream.chunks
                await wait_for(lambda: stream.chunks > before, 5, "the stream going on")
                assert stream.ended_at is None

                await put(writer, route("sbxv6", address="127.0.0.1"))
                await asyncio.wait_for(stream.ended.wait(), 1.5)
                assert stream.truncated
            finally:
                await stream.close()
            assert await answers(200, "127.0.0.1")
    finally:
        await relay.stop()
        await writer.aclose()
