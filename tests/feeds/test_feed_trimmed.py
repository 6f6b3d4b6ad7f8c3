"""Stream entries trimmed away while the link to Redis stood still (found by review: an open
question). A relay that does not notice misses the deletes among them, and a revoked route
keeps serving (SPEC §3: it resyncs from the hash when entries it has not read were trimmed
away, even while connected, and after every reconnect).

Real redis-server, relay in-process, and between them ``ThrottledProxy``, a loopback TCP
forwarder whose replies are held while ``flowing`` is cleared.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis.asyncio as aioredis

from tests.feeds.helpers import (
    delete,
    load_hash,
    put,
    relay_through_proxy,
    route,
    wait_for,
)
from tests.feeds.redisproc import RedisProcess

RATE = 200_000  # bytes per second from Redis to relay while the link moves


async def test_entries_trimmed_while_the_link_stood_still_resync(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """Replies held for 0.5 s (less than the 5.2 s hang timeout of max_stale_s = 10): a put wakes
    relay, whose wake-up waits in the link while a delete follows and the stream is trimmed to
    one entry. When the link moves again relay reads one entry where three were added, resyncs
    while still connected, and the deleted route is gone: a missed delete would keep a revoked
    sandbox reachable."""
    await load_hash(writer, [route(f"t{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path, redis_proc.port, rate=RATE, max_stale_s=10, block_ms=200
    ) as (relay, feed, proxy):
        await wait_for(lambda: feed.position is not None, 5, "following")
        proxy.flowing.clear()
        await put(writer, route("u1"))
        await delete(writer, "t1")
        await put(writer, route("u2"))
        await writer.xtrim("relay:routes:events", maxlen=1, approximate=False)
        await asyncio.sleep(0.5)
        assert relay.table.get("t1") is not None  # nothing passed yet
        proxy.flowing.set()
        await wait_for(lambda: feed.gaps == 1, 3, "the gap to be noticed")
        await wait_for(lambda: feed.snapshots == 2, 3, "the resync")
        assert relay.table.get("t1") is None
        assert sorted(relay.table.routes) == sorted(
            {f"t{i}" for i in range(10)} - {"t1"} | {"u1", "u2"}
        )
        assert feed.failures == 0


async def test_entries_trimmed_while_relay_was_away_resync(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """Replies held past the hang timeout (1.2 s): relay gives the link up and keeps trying to
    reconnect through it while a delete is published and the stream trimmed to nothing. When
    the link moves again it reconnects and reloads the hash (SPEC §3: always, after a
    reconnect); the deleted route is gone."""
    await load_hash(writer, [route(f"t{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path, redis_proc.port, rate=RATE, max_stale_s=2, block_ms=200, backoff_cap_s=0.3
    ) as (relay, feed, proxy):
        await wait_for(lambda: feed.position is not None, 5, "following")
        proxy.flowing.clear()
        await delete(writer, "t1")
        await put(writer, route("u1"))
        await writer.xtrim("relay:routes:events", maxlen=0, approximate=False)
        await wait_for(lambda: feed.failures >= 1, 3, "the link given up")
        assert relay.table.get("t1") is not None  # nothing passed yet
        proxy.flowing.set()
        await wait_for(lambda: relay.table.get("u1") is not None, 5, "the resync")
        assert relay.table.get("t1") is None
        assert not relay.feed_state.stale
