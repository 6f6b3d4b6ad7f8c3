"""The Redis feed over a slow link (found by review): a burst of stream entries whose reply takes
longer to arrive than the read timeout a hung Redis is told by.

Real redis-server, relay in-process, and between them ``ThrottledProxy``: a loopback TCP
forwarder that passes Redis's replies at a fixed rate (``rate``, which a test may change), or
holds them (``flowing`` cleared).
With ``max_stale_s = 2`` and ``block_ms = 200`` a read that takes longer than 1.2 s is taken
for a hung Redis (``RedisFeed._hang_grace``).
"""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

from tests.feeds.helpers import (
    delete,
    dumps,
    load_hash,
    put,
    relay_through_proxy,
    route,
    wait_for,
)
from tests.feeds.redisproc import RedisProcess

BURST = 2000  # ~190 bytes an entry on the wire: ~0.4 MB, ~2 s at RATE
RATE = 200_000  # bytes per second from Redis to relay


async def test_a_burst_slower_to_arrive_than_a_hang_is_followed_without_a_resync(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """2,000 puts and a delete in one transaction: read as one reply of up to 5,000 entries, it
    took ~2 s to arrive, the read timed out at 1.2 s, relay reconnected and reloaded the whole
    hash (over the same slow link), and a steady burst did so again and again. Now each read
    asks for as many entries as the link carries in a fraction of that timeout: no failure,
    no snapshot after the first, and the batch lands whole (the delete revokes ``r0``)."""
    await load_hash(writer, [route(f"r{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path, redis_proc.port, rate=RATE, max_stale_s=2, block_ms=200, backoff_cap_s=0.3
    ) as (relay, feed, _):
        await wait_for(lambda: feed.position is not None, 5, "following")
        await put(writer, *[route(f"b{i:05d}") for i in range(BURST)])
        await delete(writer, "r0")
        expected = BURST + 9
        await wait_for(
            lambda: len(relay.table) == expected or feed.failures > 0, 9, "the burst applied"
        )
        assert feed.failures == 0, "the burst was taken for a hung Redis"
        assert feed.snapshots == 1
        assert feed.gaps == 0
        assert relay.table.get("r0") is None
        assert not relay.feed_state.stale


async def churn(client: aioredis.Redis, name: str, count: int) -> None:
    """``count`` routes put and deleted again in one transaction: ``2 * count`` entries that
    leave the hash as it was (so a resync stays small)."""
    async with client.pipeline(transaction=True) as pipe:
        for i in range(count):
            text = dumps(route(f"{name}{i:05d}"))
            pipe.hset("relay:routes", f"{name}{i:05d}", text)
            pipe.xadd("relay:routes:events", {"op": "put", "id": f"{name}{i:05d}", "route": text})
        for i in range(count):
            pipe.hdel("relay:routes", f"{name}{i:05d}")
            pipe.xadd("relay:routes:events", {"op": "delete", "id": f"{name}{i:05d}"})
        await pipe.execute()


async def test_a_link_that_slows_down_costs_one_resync_not_one_per_burst(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """Reads on a fast link grow to the cap (500 entries here); the link then slows to 40 kB/s.
    The first burst read with that count takes longer than the read timeout (~1.5 s): one
    failure and a resync. The next burst must not do the same, nor any after it: the timeout
    sent the count back to where it starts."""
    await load_hash(writer, [route(f"r{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path,
        redis_proc.port,
        rate=50_000_000,
        max_stale_s=2,
        block_ms=200,
        backoff_cap_s=0.3,
        read_count=500,
    ) as (relay, feed, proxy):
        await wait_for(lambda: feed.position is not None, 5, "following")
        await churn(writer, "f", 1000)
        await wait_for(lambda: feed.events == 2000, 5, "the fast burst")
        assert feed._count == 500  # grown to the cap on the fast link
        proxy.rate = 40_000
        for burst in range(2):
            await churn(writer, f"s{burst}", 300)  # 600 entries, ~75 kB
            await put(writer, route(f"m{burst}"))
            done = burst + 11  # the ten routes and one marker a burst
            # Called within this iteration, so the late binding B023 warns of cannot bite.
            await wait_for(lambda: len(relay.table) == done, 5, "the burst")  # noqa: B023
        assert feed.failures == 1
        assert feed.snapshots == 2
