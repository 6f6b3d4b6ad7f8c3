"""The Redis route feed against a real redis-server: loading, following, rejecting, resyncing.

Each test runs an in-process relay (``Relay.start``) whose feed reads a private redis-server,
with a fake sandbox app on loopback behind it. Acceptance criteria of issue 4 are named in
each test's docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from relay import metric_snapshot, reload
from relay.config import in_networks
from relay.core.routes import Network, RouteTable
from relay.feeds import redis as redis_feed_module
from relay.feeds import redis_snapshot
from relay.feeds.redis import RedisFeed
from relay.feeds.redis_client import RedisTarget
from relay.runtime import Relay
from tests.feeds.helpers import (
    CLIENT_TIMEOUT,
    LiveStream,
    SandboxApp,
    delete,
    dumps,
    get,
    load_hash,
    put,
    redis_feed,
    relay_config,
    route,
    start_relay,
    wait_for,
    wait_until,
)
from tests.feeds.redisproc import RedisProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ALLOWED: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.fixture
async def app() -> Any:
    sandbox = SandboxApp()
    await sandbox.start()
    try:
        yield sandbox
    finally:
        await sandbox.stop()


@pytest.fixture
async def session() -> Any:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
        yield client


def port_of(relay: Relay) -> int:
    return relay.bound[0][1]


async def readyz(session: aiohttp.ClientSession, relay: Relay) -> int:
    assert relay.admin_bound is not None
    async with session.get(f"http://127.0.0.1:{relay.admin_bound[1]}/readyz") as response:
        return response.status


# -- loading and rejecting ---------------------------------------------------------------------


async def test_malformed_routes_are_rejected_alone(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    app: SandboxApp,
    session: aiohttp.ClientSession,
) -> None:
    """A malformed route in the hash and one in the stream are each rejected alone and
    counted; the rest apply."""
    good = [route(f"good{i}") for i in range(5)]
    await load_hash(writer, good)
    await writer.hset(
        "relay:routes",
        mapping={
            "badaddr": dumps(route("badaddr", address="8.8.8.8")),  # outside allowed_cidrs
            "notjson": "{nope",
            "mismatch": dumps(route("other")),  # value's sandbox_id differs from its field
        },
    )
    relay = await start_relay(relay_config(tmp_path, redis_proc.url))
    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        assert sorted(relay.table.routes) == [f"good{i}" for i in range(5)]
        assert relay.observer.route_errors == 3
        status, _, _ = await get(session, port_of(relay), "good3", app.port)
        assert status == 200

        # One good put, one bad put for an existing id (each with its hash change, as the
        # schema has it), and an unknown op, which makes the relay resync from the hash.
        async with writer.pipeline(transaction=True) as pipe:
            pipe.hset("relay:routes", "new1", dumps(route("new1")))
            pipe.xadd(
                "relay:routes:events", {"op": "put", "id": "new1", "route": dumps(route("new1"))}
            )
            bad = {**route("good1"), "colour": "blue"}
            pipe.hset("relay:routes", "good1", dumps(bad))
            pipe.xadd("relay:routes:events", {"op": "put", "id": "good1", "route": dumps(bad)})
            pipe.xadd("relay:routes:events", {"op": "rename", "id": "good2"})
            await pipe.execute()
        await wait_for(lambda: relay.table.get("new1") is not None, 3, "the good put")
        feed = relay.feed
        assert isinstance(feed, RedisFeed)
        await wait_for(lambda: feed.snapshots >= 2, 3, "the resync")
        assert relay.observer.route_errors >= 5
        # The malformed put removed good1 (so did the resync from the hash); good2 (unknown
        # op) and the other routes are as the hash has them.
        assert relay.table.get("new1") is not None
        assert relay.table.get("good1") is None
        assert relay.table.get("good2") is not None
        assert relay.table.get("good4") is not None
        status, _, _ = await get(session, port_of(relay), "new1", app.port)
        assert status == 200
    finally:
        await relay.stop()


async def test_not_ready_until_the_first_table(
    tmp_path: Path, redis_proc: RedisProcess, session: aiohttp.ClientSession, app: SandboxApp
) -> None:
    """Redis unreachable at start: the relay stays up, /readyz is 503 and sandbox requests
    get 503 (never 502) until the first full table arrives."""
    redis_proc.kill()
    relay = await start_relay(relay_config(tmp_path, redis_proc.url), backoff_cap_s=0.2)
    try:
        await asyncio.sleep(0.3)
        assert await readyz(session, relay) == 503
        status, body, headers = await get(session, port_of(relay), "nothere", app.port)
        assert status == 503
        assert json.loads(body)["message"] == "route cache is not ready"
        assert "Retry-After" in headers
        redis_proc.start()
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        assert await readyz(session, relay) == 200
        status, _, _ = await get(session, port_of(relay), "nothere", app.port)
        assert status == 502
    finally:
        await relay.stop()


# -- scale: a large snapshot, then a storm of paired updates ----------------------------------

PAIRS = 100  # pairs (pa<k>, pb<k>) always changed together, in one MULTI
SNAPSHOT = 10_000
UPDATES_PER_S = 1000
STORM_S = 3.0


def pairs_consistent(table: RouteTable) -> list[str]:
    """The pairs whose two routes differ in generation: half-applied transactions."""
    bad = []
    for k in range(PAIRS):
        a, b = table.get(f"pa{k}"), table.get(f"pb{k}")
        if (a is None) != (b is None) or (a and b and a.generation != b.generation):
            bad.append(f"pair {k}: {a!r} / {b!r}")
    return bad


async def test_snapshot_of_10000_then_1000_updates_per_second(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    app: SandboxApp,
    session: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot of 10,000 routes loads and serves; 1,000 route updates per second applied
    while requests flow: no request sees a half-applied table, and a revoked route is refused
    (and its live stream ended) within 1 s."""
    routes = [route(f"s{i}") for i in range(SNAPSHOT - 2 * PAIRS)]
    routes += [route(f"p{side}{k}") for k in range(PAIRS) for side in "ab"]
    await load_hash(writer, routes)
    started = time.monotonic()
    relay = await start_relay(relay_config(tmp_path, redis_proc.url))
    swaps: list[list[str]] = []  # the inconsistent pairs seen after each table swap

    def checked(original: Any) -> Any:
        def call(*args: Any) -> None:
            original(*args)
            swaps.append(pairs_consistent(relay.table))

        return call

    monkeypatch.setattr(relay, "apply_routes", checked(relay.apply_routes))
    monkeypatch.setattr(relay, "install_routes", checked(relay.install_routes))
    try:
        await wait_for(lambda: relay.feed_state.ready, 10, "the 10,000-route snapshot")
        load_s = time.monotonic() - started
        assert len(relay.table) == SNAPSHOT
        for sid in ("s0", "s4321", f"s{SNAPSHOT - 2 * PAIRS - 1}", "pa7", "pb99"):
            status, _, _ = await get(session, port_of(relay), sid, app.port)
            assert status == 200, sid

        victim = "s5000"
        stream = await LiveStream.open(session, port_of(relay), victim, app.port)
        statuses: list[int] = []
        stop = asyncio.Event()

        async def requests_flow() -> None:
            i = 0
            while not stop.is_set():
                status, _, _ = await get(session, port_of(relay), f"s{i % 4000}", app.port)
                statuses.append(status)
                i += 1

        async def refused() -> bool:
            status, _, _ = await get(session, port_of(relay), victim, app.port)
            return status == 502

        loop = asyncio.get_running_loop()
        flow = loop.create_task(requests_flow())
        # The control plane: a process of its own (see storm.py), 1,000 paired updates/s.
        storm = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.feeds.storm",
            redis_proc.url,
            str(PAIRS),
            str(UPDATES_PER_S),
            str(STORM_S),
            victim,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        try:
            assert storm.stdout is not None
            line = await asyncio.wait_for(storm.stdout.readline(), STORM_S + 10)
            deleted_at = json.loads(line)["deleted_at"]
            await wait_until(refused, 1.0, "the deleted route to be refused")
            refused_s = time.monotonic() - deleted_at
            await asyncio.wait_for(stream.ended.wait(), 1.0)
            result = json.loads(await asyncio.wait_for(storm.stdout.readline(), STORM_S + 10))
            assert await asyncio.wait_for(storm.wait(), 5) == 0
        finally:
            if storm.returncode is None:
                storm.kill()
                await storm.wait()
        sent, storm_s = int(result["sent"]), float(result["seconds"])
        stop.set()
        await flow
        await stream.close()
        assert stream.ended_at is not None
        stream_end_s = stream.ended_at - deleted_at

        # Every update arrived, and at no swap was any pair half-applied.
        last_gen = (sent - 1) // PAIRS + 1
        await wait_for(
            lambda: all(
                (r := relay.table.get(f"pa{k}")) is not None and r.generation >= last_gen - 1
                for k in range(PAIRS)
            ),
            3,
            "the last updates",
        )
        bad = [problem for swap in swaps for problem in swap]
        assert not bad, bad[:5]
        assert len(swaps) > 10
        assert sent / storm_s >= 0.8 * UPDATES_PER_S, f"only {sent / storm_s:.0f} updates/s"
        assert statuses
        assert set(statuses) == {200}, set(statuses)
        assert stream.truncated
        assert stream_end_s < 1.0
        assert refused_s < 1.0
        assert redis_feed(relay).gaps == 0
        print(
            f"\nsnapshot {SNAPSHOT} routes ready in {load_s:.2f}s; {sent} updates in "
            f"{storm_s:.2f}s ({sent / storm_s:.0f}/s) over {len(swaps)} swaps; "
            f"{len(statuses)} requests; delete refused after {refused_s * 1000:.0f} ms, "
            f"stream ended {stream_end_s * 1000:.0f} ms after the delete"
        )
    finally:
        await relay.stop()


# -- outages -----------------------------------------------------------------------------------


async def test_redis_killed_then_stale_then_resynced(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    app: SandboxApp,
    session: aiohttp.ClientSession,
) -> None:
    """Redis killed while requests flow and a stream is open: no crash; cached routes keep
    serving until max_stale_s, then sandbox requests get 503 "route cache is stale" with
    Retry-After; Redis restarted on the same port: the relay resyncs and serves again."""
    max_stale_s = 1.0
    await load_hash(writer, [route(f"r{i}") for i in range(100)])
    await writer.save()  # dump.rdb: what the restarted server will come back with
    relay = await start_relay(
        relay_config(tmp_path, redis_proc.url, max_stale_s=max_stale_s),
        block_ms=200,  # last-good-read granularity: the stale clock starts within 0.2 s
        backoff_cap_s=0.3,
    )
    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        # A route published after the save: lost with the crash, so a resync must drop it.
        await put(writer, route("ephemeral"))
        await wait_for(lambda: relay.table.get("ephemeral") is not None, 2, "ephemeral")
        stream = await LiveStream.open(session, port_of(relay), "r1", app.port)
        samples: list[tuple[float, int, str, dict[str, str]]] = []
        stop = asyncio.Event()

        async def requests_flow() -> None:
            while not stop.is_set():
                status, body, headers = await get(session, port_of(relay), "r2", app.port)
                samples.append((time.monotonic(), status, body, headers))
                await asyncio.sleep(0.02)

        flow = asyncio.get_running_loop().create_task(requests_flow())
        await asyncio.sleep(0.2)
        killed_at = time.monotonic()
        redis_proc.kill()
        await wait_for(lambda: relay.feed_state.stale, max_stale_s + 2, "the cache to go stale")
        stale_after = time.monotonic() - killed_at
        await asyncio.sleep(0.3)
        assert await readyz(session, relay) == 503
        chunks_during_outage = stream.chunks

        restarted_at = time.monotonic()
        redis_proc.start()
        await wait_for(lambda: not relay.feed_state.stale, 5, "the feed to come back")
        resynced_after = time.monotonic() - restarted_at
        await asyncio.sleep(0.2)
        stop.set()
        await flow

        # Before the kill and for a while after it: served from the cache.
        early = [status for t, status, _, _ in samples if t < killed_at + max_stale_s - 0.3]
        assert early
        assert set(early) == {200}
        # Stale: 503 with the SPEC's body and a Retry-After.
        stale = [(b, h) for _, status, b, h in samples if status == 503]
        assert stale, "no request was refused while the cache was stale"
        body, headers = stale[0]
        assert json.loads(body) == {"code": 503, "message": "route cache is stale"}
        assert int(headers["Retry-After"]) > 0
        # Back: served again, without a restart of the relay.
        assert samples[-1][1] == 200
        assert await readyz(session, relay) == 200
        assert redis_feed(relay).snapshots >= 2
        # The resync read the hash as the restarted Redis has it: "ephemeral" is gone.
        assert relay.table.get("ephemeral") is None
        assert len(relay.table) == 100
        # The open stream was never cut: its route did not change.
        await asyncio.sleep(0.2)
        assert stream.ended_at is None
        assert stream.chunks > chunks_during_outage
        await stream.close()
        assert stale_after >= max_stale_s - 0.3
        print(
            f"\nstale {stale_after:.2f}s after the kill (max_stale_s={max_stale_s}); "
            f"resynced {resynced_after:.2f}s after the restart"
        )
    finally:
        await relay.stop()


async def test_trimmed_while_paused_resyncs(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stream trimmed below the relay's position while the relay is stopped from reading:
    it notices on its next read (still connected), resyncs, and ends with the right table."""
    await load_hash(writer, [route(f"t{i}") for i in range(10)])
    relay = await start_relay(relay_config(tmp_path, redis_proc.url))
    feed = redis_feed(relay)
    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        gate = asyncio.Event()
        gate.set()
        original = feed._read_to_end

        async def gated(*args: Any) -> Any:
            await gate.wait()
            return await original(*args)

        monkeypatch.setattr(feed, "_read_to_end", gated)
        gate.clear()
        await put(writer, route("u1"))  # wakes the relay, which then waits at the gate
        await asyncio.sleep(0.1)
        await put(writer, route("u2"), route("t0", generation=5))
        await delete(writer, "t1")
        await put(writer, route("u3"))
        await writer.xtrim("relay:routes:events", maxlen=1, approximate=False)
        assert feed.gaps == 0
        gate.set()
        await wait_for(lambda: feed.gaps == 1, 3, "the gap to be noticed")
        await wait_for(lambda: relay.table.get("u3") is not None, 3, "the resync")
        expected = sorted({f"t{i}" for i in range(10)} - {"t1"} | {"u1", "u2", "u3"})
        assert sorted(relay.table.routes) == expected
        route_t0 = relay.table.get("t0")
        assert route_t0 is not None
        assert route_t0.generation == 5
        assert feed.failures == 0  # noticed while connected, not by reconnecting
        counters = dict(
            (name, rows[0][1])
            for name, rows in metric_snapshot.snapshot(relay)["counters"].items()
            if rows
        )
        assert counters["relay_feed_gaps"] == 1
        assert counters["relay_feed_snapshots"] == 2
    finally:
        await relay.stop()


async def test_trimmed_faster_than_read_resyncs(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """Entries added and trimmed away in one transaction, before the relay could read them:
    the relay sees entries-added grow with nothing to read, resyncs, and ends right."""
    relay = await start_relay(relay_config(tmp_path, redis_proc.url))
    feed = redis_feed(relay)
    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        await put(writer, route("keep"), route("gone"))
        await wait_for(lambda: len(relay.table) == 2, 2, "the first puts")
        async with writer.pipeline(transaction=True) as pipe:
            for i in range(50):
                text = dumps(route(f"v{i}"))
                pipe.hset("relay:routes", f"v{i}", text)
                pipe.xadd("relay:routes:events", {"op": "put", "id": f"v{i}", "route": text})
            pipe.hdel("relay:routes", "gone")
            pipe.xadd("relay:routes:events", {"op": "delete", "id": "gone"})
            pipe.xtrim("relay:routes:events", maxlen=0, approximate=False)
            await pipe.execute()
        await wait_for(lambda: feed.gaps >= 1, 3, "the gap to be noticed")
        await wait_for(lambda: len(relay.table) == 51, 3, "the resync")
        assert relay.table.get("gone") is None
        assert relay.table.get("v49") is not None
        # And it keeps following after the resync.
        await put(writer, route("after"))
        await wait_for(lambda: relay.table.get("after") is not None, 2, "a put after the resync")
        assert feed.gaps == 1
    finally:
        await relay.stop()


async def test_sighup_resyncs(
    tmp_path: Path, writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """SIGHUP (Relay.reload) resyncs from the hash, picking up a change made without an
    event (which a control plane should never do, but an operator repairing data may)."""
    relay = await start_relay(relay_config(tmp_path, redis_proc.url), block_ms=100)
    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        await writer.hset("relay:routes", "quiet", dumps(route("quiet")))
        await asyncio.sleep(0.3)
        assert relay.table.get("quiet") is None
        relay.reload()
        await wait_for(lambda: relay.table.get("quiet") is not None, 2, "the resync")
    finally:
        await relay.stop()


class RecordingSink:
    """A StreamSink that only counts (for tests of the feed alone)."""

    def __init__(self) -> None:
        self.tables = 0
        self.batches = 0

    def install_routes(self, routes: dict[str, Any], source: str) -> None:
        self.tables += 1

    def reject_routes(self, errors: list[Any], source: str) -> None:
        pass

    def feed_failed(self, source: str, message: str) -> None:
        pass

    def apply_routes(self, puts: Any, deletes: Any, source: str) -> None:
        self.batches += 1

    def feed_broken(self, since: float) -> None:
        pass

    def feed_restored(self) -> None:
        pass


async def test_feed_stops_promptly_when_cancelled(
    writer: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    """Cancelling the feed while events stream in ends it at once, every time. (redis-py 8.1
    on Python 3.11 loses about half of such cancellations inside its socket-timeout block;
    a feed that ignored them hung ``Relay.stop()``.)"""
    stop = asyncio.Event()

    async def flood() -> None:
        n = 0
        while not stop.is_set():
            await put(writer, route(f"f{n % 50}", generation=n))
            n += 1

    loop = asyncio.get_running_loop()
    flooding = loop.create_task(flood())
    slow: list[float] = []
    try:
        for i in range(20):
            sink = RecordingSink()
            feed = RedisFeed(sink, RedisTarget(url=redis_proc.url, prefix="relay:"), ALLOWED)
            task = loop.create_task(feed.run())
            await wait_for(lambda: sink.batches > 0, 5, "the feed to follow")  # noqa: B023
            await asyncio.sleep(0.01 * (i % 7))
            cancelled_at = time.monotonic()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            if not done:
                slow.append(time.monotonic() - cancelled_at)
                task.cancel()
                await asyncio.wait({task}, timeout=5)
    finally:
        stop.set()
        await flooding
    assert not slow, f"{len(slow)} of 20 cancellations were ignored"


@pytest.mark.parametrize(
    ("change", "entry", "expected"),
    [
        pytest.param("delete", {"op": "del", "id": "rot"}, None, id="unknown-op"),
        pytest.param("rotate", {"op": "put", "route": "ROTATED"}, "rotated", id="no-id"),
    ],
)
async def test_an_entry_the_relay_cannot_apply_makes_it_resync(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    change: str,
    entry: dict[str, str],
    expected: str | None,
) -> None:
    """Found by review: the hash changed in one MULTI with an entry this relay cannot read (an
    op spelled "del", a put without its id), and the relay kept the old route and its tokens
    until an unrelated resync, where the hash, the truth (SPEC §3), no longer had them."""
    relay = await start_relay(relay_config(tmp_path, redis_proc.url), block_ms=100)
    try:
        await put(writer, route("rot"), route("kept"))
        await wait_for(lambda: relay.table.get("rot") is not None, 5, "the routes")
        rotated = dumps({**route("rot"), "envd_token": "rotated"})
        async with writer.pipeline(transaction=True) as pipe:
            if change == "delete":
                pipe.hdel("relay:routes", "rot")
            else:
                pipe.hset("relay:routes", "rot", rotated)
            pipe.xadd(
                "relay:routes:events",
                {k: rotated if v == "ROTATED" else v for k, v in entry.items()},
            )
            await pipe.execute()

        def applied() -> bool:
            current = relay.table.get("rot")
            return (current.envd_token if current else None) == expected

        await wait_for(applied, 2, "the hash's change")
        assert relay.table.get("kept") is not None
    finally:
        await relay.stop()


async def test_a_put_read_across_a_narrowing_reload_is_not_installed(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a SIGHUP that narrows upstream.allowed_cidrs while the feed awaits a
    read. The read's puts were checked against the old networks and applied after the reload
    had removed the routes outside the new ones (SPEC §3: an address inside allowed_cidrs)."""
    relay = await start_relay(relay_config(tmp_path, redis_proc.url), block_ms=3000)
    feed = relay.feed
    assert isinstance(feed, RedisFeed)
    outside: list[str] = []
    real_apply = relay.apply_routes

    def checked_apply(puts: Any, deletes: Any, source: str) -> None:
        real_apply(puts, deletes, source)
        outside.extend(
            sid
            for sid, r in relay.table.routes.items()
            if not in_networks(r.address, relay.allowed_cidrs)
        )

    real_read = RedisFeed._read_to_end
    armed: list[bool] = []

    async def read_with_reload(self: RedisFeed, client: Any, after: Any) -> Any:
        if armed and not armed[0]:
            armed[0] = True

            def sighup() -> None:  # what Relay.reload does with a narrowed config
                upstream = dataclasses.replace(
                    relay.config.upstream, allowed_cidrs=["127.0.0.1/32"]
                )
                reload.apply(relay, dataclasses.replace(relay.config, upstream=upstream))
                relay.feed.load()

            asyncio.get_running_loop().call_soon(sighup)  # while the read below is awaited
        return await real_read(self, client, after)

    try:
        await wait_for(lambda: relay.feed_state.ready, 5, "the first table")
        monkeypatch.setattr(relay, "apply_routes", checked_apply)
        monkeypatch.setattr(RedisFeed, "_read_to_end", read_with_reload)
        await asyncio.sleep(0.3)
        armed.append(False)
        await put(writer, route("outside", address="127.0.0.2"))
        await wait_for(lambda: bool(armed[0]) and feed.snapshots >= 2, 5, "the reload's resync")
        await asyncio.sleep(0.2)
        assert relay.table.get("outside") is None
        assert outside == []
    finally:
        await relay.stop()


async def test_entries_it_cannot_apply_resync_at_most_so_often(
    tmp_path: Path,
    writer: aioredis.Redis,
    redis_proc: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: each read that held an entry relay cannot apply reloaded the whole hash,
    so a control plane writing them steadily cost every relay a full resync per read. One per
    UNAPPLIED_RESYNC_S at most, and the last change still lands after the last entry."""
    # Read by the follow loop (relay.feeds.redis) and by a new feed's clock (redis_snapshot).
    for module in (redis_feed_module, redis_snapshot):
        monkeypatch.setattr(module, "UNAPPLIED_RESYNC_S", 0.5)
    relay = await start_relay(relay_config(tmp_path, redis_proc.url), block_ms=100)
    try:
        feed = relay.feed
        assert isinstance(feed, RedisFeed)
        await put(writer, route("rot"))
        await wait_for(lambda: relay.table.get("rot") is not None, 5, "the route")
        before = feed.snapshots
        started = time.monotonic()
        for i in range(20):  # 1 s of entries it cannot apply, the last with a token change
            async with writer.pipeline(transaction=True) as pipe:
                rotated = {**route("rot"), "envd_token": f"rotated-{i}"}
                pipe.hset("relay:routes", "rot", dumps(rotated))
                pipe.xadd("relay:routes:events", {"op": "touch", "id": "rot"})
                await pipe.execute()
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started

        def rotated_last() -> bool:
            current = relay.table.get("rot")
            return current is not None and current.envd_token == "rotated-19"

        await wait_for(rotated_last, 2, "the last change")
        assert feed.snapshots - before <= elapsed / 0.5 + 2, feed.snapshots - before
    finally:
        await relay.stop()
