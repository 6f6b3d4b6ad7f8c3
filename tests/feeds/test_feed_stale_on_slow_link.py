"""The stale clock while the Redis feed follows a burst over a slow link (SPEC §3: cached routes
serve until the feed has been behind for ``routes.max_stale_s``): a link that hangs in the
middle of a burst, and a catch-up that takes longer than max_stale_s.

Real redis-server, relay in-process, and between them ``ThrottledProxy``: a loopback TCP
forwarder that passes Redis's replies at a fixed rate, or holds them (``flowing`` cleared).
With ``max_stale_s = 1`` and ``block_ms = 200`` a read that takes longer than 1.2 s is taken
for a hung Redis (``RedisFeed._hang_grace``).
"""

from __future__ import annotations

import time
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

BURST = 1000  # ~190 bytes an entry on the wire: ~0.2 MB
RATE = 200_000  # bytes per second from Redis to relay


async def test_a_link_that_hangs_during_a_burst_makes_the_cache_stale_in_time(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """A burst, and the link stops passing bytes half-way: still noticed, and the cache
    stale within max_stale_s (1 s here) of the last good read (SPEC §3), as for an idle feed."""
    await load_hash(writer, [route(f"r{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path, redis_proc.port, rate=RATE, max_stale_s=1, block_ms=200, backoff_cap_s=0.3
    ) as (relay, feed, proxy):
        await wait_for(lambda: feed.position is not None, 5, "following")
        await put(writer, *[route(f"b{i:05d}") for i in range(BURST)])
        # Reads of the burst under way: the first (100 entries) was full, more follow.
        await wait_for(lambda: feed._lagging, 3, "the catch-up under way")
        proxy.flowing.clear()
        assert len(relay.table) == 10  # not applied yet: the link hangs in the middle
        hung = time.monotonic()
        await wait_for(lambda: feed.failures >= 1, 4, "the hang noticed")
        # Noticed within the 1.2 s read timeout (0.8 s of slack for a busy machine), by when
        # max_stale_s has passed since the catch-up began: stale.
        assert time.monotonic() - hung < 2.0
        assert relay.feed_state.stale
        proxy.flowing.set()
        await wait_for(lambda: len(relay.table) == BURST + 10, 10, "the resync")
        assert not relay.feed_state.stale


async def test_a_catch_up_longer_than_max_stale_makes_the_cache_stale_until_applied(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """1,000 puts and a delete take ~2 s to arrive at 100 kB/s, in reads that each complete,
    and nothing is applied before the last: the table is as old as the wake-up that began the
    catch-up, so the cache is stale once max_stale_s (1 s) has passed since then, and fresh
    again when the batch lands. Before, the reads kept the cache fresh while the table fell
    behind (a sustained burst on a slower link: minutes, a revoked route serving all along)."""
    await load_hash(writer, [route(f"r{i}") for i in range(10)])
    async with relay_through_proxy(
        tmp_path, redis_proc.port, rate=100_000, max_stale_s=1, block_ms=200, backoff_cap_s=0.3
    ) as (relay, feed, _):
        await wait_for(lambda: feed.position is not None, 5, "following")
        await put(writer, *[route(f"b{i:05d}") for i in range(BURST)])
        await delete(writer, "r0")
        await wait_for(lambda: relay.feed_state.stale, 3, "a stale cache during the catch-up")
        assert relay.table.get("r0") is not None  # the delete has not landed yet
        await wait_for(lambda: not relay.feed_state.stale, 5, "the batch applied")
        assert relay.table.get("r0") is None
        assert len(relay.table) == BURST + 9
        assert feed.failures == 0
        assert feed.snapshots == 1
