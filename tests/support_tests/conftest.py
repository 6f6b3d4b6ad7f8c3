"""Fixtures: each test gets fresh fakes on loopback, closed afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support.fake_app import FakeApp
from tests.support.fake_envd import FakeEnvd

TOKEN = "3f9a1c0b7e2d4a6f8b1c3d5e7f90a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4"


@pytest.fixture
async def envd() -> AsyncIterator[FakeEnvd]:
    """envd without an access token, as behind a relay doing gateway auth."""
    async with FakeEnvd() as fake:
        yield fake


@pytest.fixture
async def secure_envd() -> AsyncIterator[FakeEnvd]:
    """envd that checks its own access token."""
    async with FakeEnvd(access_token=TOKEN) as fake:
        yield fake


@pytest.fixture
async def app() -> AsyncIterator[FakeApp]:
    async with FakeApp() as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # No transparent decompression: tests look at what the fake really sent.
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session
