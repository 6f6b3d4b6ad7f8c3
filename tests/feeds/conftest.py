"""Fixtures for the route-feed tests: a private redis-server per test (see redisproc)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.feeds.redisproc import RedisProcess, running_redis


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    with running_redis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
async def writer(redis_proc: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    """The control plane's client (default user, full rights)."""
    client = aioredis.Redis.from_url(redis_proc.url, protocol=2)
    try:
        yield client
    finally:
        await client.aclose()
