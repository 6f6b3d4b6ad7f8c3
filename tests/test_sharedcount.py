"""relay.sharedcount: the workers' shared per-sandbox in-flight counts (the table without
sockets; a WorkerRelay in this process)."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.config_parse import parse
from relay.lifecycle import RUN_DIR_ENV, WORKER_ENV
from relay.runtime import Relay, WorkerRelay, _relay
from relay.sharedcount import CELL, SLOTS, SharedCounts, create, slots, zero_column
from tests.support.harness import DOMAIN, route, running_relay
from tests.support.rawhttp import request


def app_host(port: int | None, sandbox_id: str) -> str:
    return f"{port}-{sandbox_id}.{DOMAIN}"


def test_slots_are_the_same_in_every_process() -> None:
    """Python's hash() of a str differs per process (PYTHONHASHSEED): workers must agree."""
    code = "from relay.sharedcount import slots; print(slots('sbx-0123456789abcdef'))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, PYTHONHASHSEED=seed),
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {str(slots("sbx-0123456789abcdef"))}
    assert all(0 <= s < SLOTS for s in slots("sbx-0123456789abcdef"))


def _first_slot_twins() -> tuple[str, str]:
    """Two ids of the same length sharing their first slot (a birthday search, ~300 ids)."""
    seen: dict[int, str] = {}
    for n in range(100_000):
        sandbox_id = f"sbx{n:08d}"
        first = slots(sandbox_id)[0]
        if first in seen:
            return seen[first], sandbox_id
        seen[first] = sandbox_id
    raise AssertionError("no collision")


def test_the_two_slots_are_independent() -> None:
    # With a linear hash (zlib.crc32 under two seeds) same-length ids that share one slot
    # share the other too, and count-min gains nothing.
    a, b = _first_slot_twins()
    assert slots(a)[1] != slots(b)[1]


@pytest.fixture
def table(tmp_path: Path) -> Path:
    return create(tmp_path, 3)


def test_the_table_holds_a_column_per_worker(table: Path) -> None:
    assert table.stat().st_size == 3 * SLOTS * CELL
    assert table.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="no column 3"):
        SharedCounts(table, 3)


def test_a_filesystem_that_cannot_allocate_gets_a_sparse_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """posix_fallocate is refused by some filesystems (EOPNOTSUPP: ZFS before 2.2): the
    supervisor stopped at start with an OSError; the table is sparse there instead."""

    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    path = create(tmp_path, 2)
    assert path.stat().st_size == 2 * SLOTS * CELL
    w0, w1 = SharedCounts(path, 0), SharedCounts(path, 1)
    w0.add("box")
    assert w1.others("box") == 1


def test_each_worker_sees_the_others_counts(table: Path) -> None:
    w0, w1, w2 = (SharedCounts(table, i) for i in range(3))
    w0.add("box")
    w0.add("box")
    w1.add("box")
    assert (w0.others("box"), w1.others("box"), w2.others("box")) == (1, 2, 3)
    assert w0.own("box") == 2
    assert w2.others("other") == 0
    w0.take("box")
    assert w2.others("box") == 2
    for worker in (w0, w1, w2):
        worker.close()


def test_a_shared_slot_does_not_count_with_count_min(table: Path) -> None:
    a, b = _first_slot_twins()
    w0, w1 = SharedCounts(table, 0), SharedCounts(table, 1)
    w0.add(a)
    assert w1.others(a) == 1
    assert w1.others(b) == 0  # their first slots hold 1, their second slots differ
    w0.close()
    w1.close()


def test_a_count_never_goes_below_zero(table: Path) -> None:
    w0, w1 = SharedCounts(table, 0), SharedCounts(table, 1)
    w0.take("box")  # a uint32 would wrap to 4 billion: every request refused for good
    assert w1.others("box") == 0
    w0.add("box")
    assert w1.others("box") == 1
    w0.close()
    w1.close()


def test_a_dead_workers_column_is_zeroed(table: Path) -> None:
    w0, w1 = SharedCounts(table, 0), SharedCounts(table, 1)
    w0.add("box")
    w1.add("box")
    zero_column(table, 0)  # the supervisor, once worker 0 exited (killed by SIGKILL)
    assert w1.others("box") == 0
    assert w1.own("box") == 1  # its neighbour's column untouched
    w0.close()
    w1.close()


def test_a_starting_worker_zeroes_its_own_column(table: Path) -> None:
    before = SharedCounts(table, 0)
    before.add("box")
    other = SharedCounts(table, 1)
    assert other.others("box") == 1
    before.close()
    SharedCounts(table, 0).close()  # its replacement, with what the dead one left
    assert other.others("box") == 0
    assert other.own("box") == 0
    other.close()


# -- a relay (one worker's share, in this process) ----------------------------------------------
async def _held_app() -> tuple[TestServer, list[asyncio.Event]]:
    """An app whose requests each wait for their own release."""
    waiting: list[asyncio.Event] = []

    async def held(_request: web.Request) -> web.Response:
        release = asyncio.Event()
        waiting.append(release)
        await release.wait()
        return web.Response(text="done")

    app = web.Application()
    app.router.add_get("/", held)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, waiting


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(250):  # bounded: 5 s
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached")


async def test_a_relay_counts_only_limited_exchanges_and_takes_back_what_it_added(
    tmp_path: Path,
) -> None:
    table = create(tmp_path, 2)
    sibling = SharedCounts(table, 1)  # what the other worker reads
    upstream, waiting = await _held_app()
    routes = [route("free", insecure=True), route("lim", insecure=True, max_connections=2)]
    try:
        own = SharedCounts(table, 0)
        make = functools.partial(WorkerRelay, shared=own)
        async with running_relay(tmp_path, routes, make=make) as under_test:
            port = under_test.port
            free = asyncio.ensure_future(request(port, "GET", "/", app_host(upstream.port, "free")))
            await _until(lambda: len(waiting) == 1)
            assert sibling.others("free") == 0  # no limit: the shared table is not touched
            limited = asyncio.ensure_future(
                request(port, "GET", "/", app_host(upstream.port, "lim"))
            )
            await _until(lambda: len(waiting) == 2)
            assert sibling.others("lim") == 1
            # The sibling's exchange counts here: 1 + 1 reaches the limit of 2.
            sibling.add("lim")
            refused = await request(port, "GET", "/", app_host(upstream.port, "lim"))
            assert refused.status == 429
            sibling.take("lim")
            # The limit is lifted while the exchange is in flight (no revocation, SPEC §3):
            # what it added still goes when it ends.
            under_test.set_routes([route("free", insecure=True), route("lim", insecure=True)])
            for release in waiting:
                release.set()
            assert (await free).status == 200
            assert (await limited).status == 200
            assert sibling.others("lim") == 0
    finally:
        await upstream.close()
        sibling.close()


def test_a_worker_gets_the_shared_count_and_a_single_relay_does_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = parse({})
    assert type(_relay(config, None, {})) is Relay
    env = {WORKER_ENV: "1", RUN_DIR_ENV: str(tmp_path)}
    # No table (a supervisor that made none): served, counted per worker, and said so.
    assert type(_relay(config, None, env)) is Relay
    assert "max_connections is counted in this worker alone" in caplog.text
    create(tmp_path, 2)
    assert type(_relay(config, None, env)) is WorkerRelay


async def test_exchanges_in_flight_when_a_limit_is_set_count_for_the_other_workers(
    tmp_path: Path,
) -> None:
    # SPEC §3: a route's max_connections may change without a revocation, so exchanges that
    # began while it had no limit are still in flight once it has one. A single relay counts
    # them (its live index); the other workers must too, or each lets `limit` more through.
    table = create(tmp_path, 2)
    sibling = SharedCounts(table, 1)
    upstream, waiting = await _held_app()
    try:
        own = SharedCounts(table, 0)
        make = functools.partial(WorkerRelay, shared=own)
        async with running_relay(tmp_path, [route("lim", insecure=True)], make=make) as under_test:
            port = under_test.port
            host = app_host(upstream.port, "lim")
            held = [asyncio.ensure_future(request(port, "GET", "/", host)) for _ in range(2)]
            await _until(lambda: len(waiting) == 2)
            assert sibling.others("lim") == 0  # no limit yet: not in the shared table
            under_test.set_routes([route("lim", insecure=True, max_connections=2)])
            assert sibling.others("lim") == 2
            for release in waiting:
                release.set()
            assert [(await h).status for h in held] == [200, 200]
            assert sibling.others("lim") == 0
    finally:
        await upstream.close()
        sibling.close()
