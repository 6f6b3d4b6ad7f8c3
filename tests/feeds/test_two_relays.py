"""Two relay processes on one Redis: same table, and a delete ends streams on both in 1 s.

The relays are real ``python -m relay serve`` processes; the "sandbox" is an aiohttp app in
the test process listening on 127.0.0.1 and 127.0.0.2 (same port), answering with the
address it was reached on, so a request shows which version of a route a relay used.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.feeds.helpers import (
    CLIENT_TIMEOUT,
    LiveStream,
    SandboxApp,
    delete,
    get,
    put,
    route,
    wait_until,
)
from tests.feeds.redisproc import RedisProcess
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 15.0


class RelayProcess:
    def __init__(self, directory: Path, redis_url: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.admin_port = free_port()
        self.config = directory / "relay.toml"
        self.config.write_text(
            f'[listen]\naddress = "127.0.0.1:{self.port}"\n'
            f'[admin]\naddress = "127.0.0.1:{self.admin_port}"\n'
            f'[routes]\nsource = "redis"\nredis_url = "{redis_url}"\n'
            "[process]\ndrain_timeout_s = 1\n"
        )
        self.log = directory / "relay.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relay", "serve", "--config", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, "RELAY_LOG_LEVEL": "INFO"},
            )

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        async def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"relay exited: {self.log.read_text()}")
            try:
                url = f"http://127.0.0.1:{self.admin_port}/readyz"
                async with session.get(url) as response:
                    return response.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_until(ready, START_TIMEOUT_S, "a relay process to be ready", interval=0.05)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
async def app() -> AsyncIterator[SandboxApp]:
    sandbox = SandboxApp()
    await sandbox.start(hosts=("127.0.0.1", "127.0.0.2"))
    try:
        yield sandbox
    finally:
        await sandbox.stop()


async def test_two_relays_converge_and_revoke_within_a_second(
    tmp_path: Path, redis_proc: RedisProcess, writer: aioredis.Redis, app: SandboxApp
) -> None:
    relays = [RelayProcess(tmp_path / f"relay{i}", redis_proc.url) for i in range(2)]
    try:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session:
            for relay in relays:
                relay.start()
            for relay in relays:
                await relay.wait_ready(session)

            # Publish, change, delete: routes in several transactions.
            ids = [f"a{i}" for i in range(40)]
            for start in range(0, 40, 10):
                await put(writer, *[route(sid) for sid in ids[start : start + 10]])
            await put(
                writer, *[route(f"a{i}", address="127.0.0.2", generation=1) for i in range(10)]
            )
            for i in range(30, 35):
                await delete(writer, f"a{i}")
            expected = {
                sid: (
                    (502, None) if 30 <= i < 35 else (200, "127.0.0.2" if i < 10 else "127.0.0.1")
                )
                for i, sid in enumerate(ids)
            }

            async def converged() -> bool:
                for relay in relays:
                    for sid, (status, body) in expected.items():
                        got_status, got_body, _ = await get(session, relay.port, sid, app.port)
                        if got_status != status or (body is not None and got_body != body):
                            return False
                return True

            took = await wait_until(converged, 5, "both relays to hold the same table", 0.05)

            # A live stream of one sandbox through each relay, then its route is deleted.
            streams = [await LiveStream.open(session, r.port, "a12", app.port) for r in relays]
            await asyncio.sleep(0.2)
            deleted_at = time.monotonic()
            await delete(writer, "a12")
            for stream in streams:
                await asyncio.wait_for(stream.ended.wait(), 2)
            ends = [stream.ended_at - deleted_at for stream in streams if stream.ended_at]
            for stream in streams:
                await stream.close()
            assert len(ends) == 2
            assert all(stream.truncated for stream in streams)
            assert max(ends) < 1.0, ends
            for relay in relays:
                status, _, _ = await get(session, relay.port, "a12", app.port)
                assert status == 502
            print(
                f"\nconverged {took * 1000:.0f} ms after the last write; streams ended "
                f"{', '.join(f'{e * 1000:.0f} ms' for e in ends)} after the delete"
            )
    finally:
        for relay in relays:
            relay.stop()
