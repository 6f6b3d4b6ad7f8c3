"""relay at its descriptor limit (``RLIMIT_NOFILE``): a proxy holds two descriptors per proxied
connection, so running out of them is an ordinary production failure, not a crash.

The tests lower the soft limit of a real ``relay serve`` (``prlimit``, from outside: the
hard limit stays, so it can be raised again) to what it holds at rest, or one more, and
check that relay sheds the work it cannot take, stays quiet and up, and serves again once
descriptors are free; one starts relay with a low soft limit, which it raises; the last two
show idle keep-alive clients closed to make room for new ones (relay.room).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.harness import DOMAIN, RelayProcess, route
from tests.support.ops import get, value
from tests.support.rawhttp import Connection, request, request_bytes

NOFILE = resource.RLIMIT_NOFILE


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _settled_fds(pid: int) -> int:
    """The process's descriptor count once it stopped moving (the start-up's readiness
    probes and admin connections closed). The limit bounds descriptor numbers, not their
    count: the numbers in use must be 0 to count - 1 for count + k to leave k free."""
    last, same = -1, 0
    deadline = time.monotonic() + 5
    while same < 3:
        count = _open_fds(pid)
        same = same + 1 if count == last else 0
        last = count
        assert time.monotonic() < deadline, "descriptor count never settled"
        await asyncio.sleep(0.05)
    assert max(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) == last - 1, "a hole"
    return last


def _set_soft_limit(pid: int, soft: int) -> None:
    _, hard = resource.prlimit(pid, NOFILE)
    resource.prlimit(pid, NOFILE, (soft, hard))


@pytest.fixture
async def closing_upstream() -> AsyncIterator[int]:
    """An app that answers each request and closes, so that every request dials."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _worker_pids(relay: RelayProcess) -> list[int]:
    """The processes that serve the data port: the workers, or relay itself."""
    assert relay.proc is not None
    _, body = await get(relay.admin_port, "/readyz")
    workers = json.loads(body).get("workers")
    if not workers:
        return [relay.proc.pid]
    pids = [w["pid"] for w in workers]
    assert all(isinstance(pid, int) for pid in pids)
    return pids


GAUGES = ("relay_client_connections", "relay_active_exchanges", "relay_upstream_connections")


async def _settled_metrics(relay: RelayProcess, overloaded: int) -> str:
    """The metrics once every connection gauge is back at 0 and ``overloaded`` refusals were
    counted (workers write their snapshots once a second, and not while out of descriptors)."""
    deadline = time.monotonic() + 5
    while True:
        text = (await get(relay.admin_port, "/metrics"))[1].decode()
        seen = {name: value(text, name) for name in GAUGES}
        seen["overloaded"] = value(text, "relay_refusals_total", reason="overloaded")
        wanted = dict.fromkeys(GAUGES, 0.0) | {"overloaded": overloaded}
        if seen == wanted or time.monotonic() > deadline:
            assert seen == wanted
            return text
        await asyncio.sleep(0.1)


async def _dials_at_the_limit(relay: RelayProcess, host: str, workers: int) -> None:
    """The client's connection takes each worker's last descriptor, so the upstream's
    ``socket()`` fails with EMFILE: 503 overloaded, the connection closed, the gauges back at
    0, and 200 again once the limit is raised."""
    pids = await _worker_pids(relay)
    limits = {pid: resource.prlimit(pid, NOFILE)[0] for pid in pids}
    for pid in pids:  # one descriptor left: the client's
        _set_soft_limit(pid, await _settled_fds(pid) + 1)
    for _ in range(2 * workers):  # SO_REUSEPORT spreads connections over the workers
        conn = await Connection.open(relay.port)
        try:
            await conn.send(request_bytes("GET", "/", host))
            answer = await conn.read_response()
            assert answer.status == 503, answer
            assert answer.json() == {
                "code": 503,
                "message": "relay has too many open connections",
                "sandboxId": "box",
            }
            assert answer.header("Retry-After") == "1"
            assert await conn.closed_by_peer()  # shed: its descriptor is freed at once
        finally:
            await conn.close()
    for pid, soft in limits.items():
        _set_soft_limit(pid, soft)
    text = await _settled_metrics(relay, overloaded=2 * workers)
    assert value(text, "relay_refusals_total", reason="port_closed") == 0
    assert (await request(relay.port, "GET", "/", host)).status == 200


def _quiet(output: str, workers: int) -> None:
    assert "Traceback" not in output
    # One warning per process, not a line per request (hundreds a second at the limit).
    assert 1 <= output.count("upstream dials fail: too many open files") <= workers


async def test_a_dial_at_the_descriptor_limit_is_answered_503_and_recovers(
    tmp_path: Path, closing_upstream: int
) -> None:
    """Relay is overloaded (SPEC §5: 503 with Retry-After, as past
    ``listen.max_connections``), not the sandbox's port closed. Before, the client got 502
    "The sandbox is running but port is not open", which SDK 2.63 turns into
    SandboxUnreachableException, and which blamed the guest in the access log and metrics."""
    overrides = {"listen": {"max_connections": 1000}}
    relay = RelayProcess(tmp_path, [route("box", insecure=True)], overrides)
    relay.start()
    try:
        await _dials_at_the_limit(relay, f"{closing_upstream}-box.{DOMAIN}", workers=1)
    finally:
        relay.stop()
    _quiet(relay.output(), workers=1)


async def test_two_workers_and_their_supervisor_at_the_descriptor_limit(
    tmp_path: Path, closing_upstream: int
) -> None:
    """Each worker answers its dials 503, as one relay does. The supervisor's ``/metrics``
    reads the workers' snapshot files: with the scrape's connection on its last descriptor,
    the directory could not be listed, and aiohttp logged a traceback per scrape and answered
    500. Now a 503 and one line; and a snapshot that cannot be read fails the scrape instead
    of leaving that worker's counters out of the sums (totals that went backwards for one
    scrape read as a counter reset)."""
    overrides = {"process": {"workers": 2}, "listen": {"max_connections": 1000}}
    relay = RelayProcess(tmp_path, [route("box", insecure=True)], overrides)
    relay.start(timeout=20)
    try:
        await _dials_at_the_limit(relay, f"{closing_upstream}-box.{DOMAIN}", workers=2)
        assert relay.proc is not None
        pid = relay.proc.pid
        soft = resource.prlimit(pid, NOFILE)[0]
        _set_soft_limit(pid, await _settled_fds(pid) + 1)  # the scrape's connection's
        status, body = await get(relay.admin_port, "/metrics")
        assert status == 503
        assert json.loads(body)["code"] == 503
        _set_soft_limit(pid, soft)
        status, body = await get(relay.admin_port, "/metrics")
        assert status == 200
        assert value(body.decode(), "relay_workers", state="ready") == 2
    finally:
        relay.stop()
    output = relay.output()
    _quiet(output, workers=2)
    assert output.count("cannot read the workers' metrics") == 1


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_accepts_at_the_descriptor_limit_are_shed_quietly_and_resume(
    tmp_path: Path, closing_upstream: int
) -> None:
    """No descriptor left for an accept (``listen.max_connections`` far above what the limit
    allows): libuv's EMFILE trick (a spare descriptor closed, the pending connections accepted
    and closed, the spare taken again) sheds them. Checked: no log line per failed accept, no
    busy loop on a listening socket that stays readable, and accepts resume once descriptors
    are free. (A failure that libuv does pass on, ENFILE with the spare lost, makes uvloop
    close the listener for good: not reproducible here.)"""
    overrides = {"listen": {"max_connections": 10000}}
    relay = RelayProcess(tmp_path, [route("box", insecure=True)], overrides)
    relay.start()
    host = f"{closing_upstream}-box.{DOMAIN}"
    try:
        assert relay.proc is not None
        pid = relay.proc.pid
        soft = resource.prlimit(pid, NOFILE)[0]
        _set_soft_limit(pid, await _settled_fds(pid))
        logged = len(relay.output())
        cpu = _cpu_s(pid)
        for _ in range(20):
            conn = await Connection.open(relay.port)
            try:
                await conn.send(request_bytes("GET", "/", host))
                assert await conn.closed_by_peer()  # no answer: no descriptor to write it on
            finally:
                await conn.close()
        await asyncio.sleep(0.5)
        assert _cpu_s(pid) - cpu < 0.3  # 20 shed accepts and an idle half-second
        assert len(relay.output()) == logged
        _set_soft_limit(pid, soft)
        assert (await request(relay.port, "GET", "/", host)).status == 200
        await _settled_metrics(relay, overloaded=0)
    finally:
        relay.stop()
    assert "Traceback" not in relay.output()


def _soft_limit_of(relay: RelayProcess) -> int:
    assert relay.proc is not None
    return resource.prlimit(relay.proc.pid, NOFILE)[0]


def test_relay_raises_its_soft_open_file_limit_and_warns_when_the_hard_one_is_short(
    tmp_path: Path,
) -> None:
    """Started with the soft limit most shells and systemd give (1,024 there; 256 here) under
    a higher hard one, relay ran with it, and shed connections past ~(256 - 15) / 2 while
    ``listen.max_connections`` allowed far more. It raises its soft limit to the hard one now,
    as Go's runtime does; and says so once when even the hard one cannot hold
    ``max_connections``."""
    hard = resource.getrlimit(NOFILE)[1]
    roomy = RelayProcess(tmp_path / "roomy", [], {"listen": {"max_connections": 1000}})
    roomy.nofile = (256, hard)
    (tmp_path / "roomy").mkdir()
    roomy.start(until_ready=False)
    try:
        assert _soft_limit_of(roomy) == hard
    finally:
        roomy.stop()
    assert "open-file limit" not in roomy.output()

    short = RelayProcess(tmp_path / "short", [], {"listen": {"max_connections": 1000}})
    short.nofile = (256, 512)
    (tmp_path / "short").mkdir()
    short.start(until_ready=False)
    try:
        assert _soft_limit_of(short) == 512
    finally:
        short.stop()
    output = short.output()
    assert output.count("the open-file limit (512) is below the 2128") == 1, output


class HoldingUpstream:
    """A keep-alive app: ``GET /hold`` is answered once ``release`` is set, anything else at
    once; its connections stay open for the next request (one pooled connection serves all
    the short ones)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> HoldingUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /hold "):
                    self.held.set()
                    await self.release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        writer.close()


async def _status(conn: Connection, host: str, target: str = "/") -> int:
    """The status of one request on ``conn``; 0 when relay closed it without an answer."""
    try:
        await conn.send(request_bytes("GET", target, host))
        return (await conn.read_response()).status
    except (ConnectionResetError, BrokenPipeError):
        return 0


SHED = "relay_idle_connections_shed_total"


async def test_idle_keep_alive_clients_make_room_for_new_ones_at_the_descriptor_limit(
    tmp_path: Path,
) -> None:
    """Each idle keep-alive client holds a descriptor for up to ``listen.idle_timeout_s``.
    At the limit libuv shed every new accept (a close, no answer) while they held theirs: with
    128 descriptors the 110th client or so got nothing. Past relay.room's mark (64 here) each
    accept closes up to 32 of the longest idle, as nginx does; a client whose request is in
    flight, or whose head has begun, is never among them."""
    overrides = {"listen": {"max_connections": 1000}}
    async with HoldingUpstream() as app:
        relay = RelayProcess(tmp_path, [route("box", insecure=True)], overrides)
        relay.nofile = (128, 128)
        relay.start()
        host = f"{app.port}-box.{DOMAIN}"
        clients: list[Connection] = []
        try:
            busy = await Connection.open(relay.port)  # the oldest: its request stays in flight
            clients.append(busy)
            await busy.send(request_bytes("GET", "/hold", host))
            await asyncio.wait_for(app.held.wait(), 5)
            begun = await Connection.open(relay.port)  # a head begun, not finished
            clients.append(begun)
            await begun.send(f"GET / HTTP/1.1\r\nHost: {host}\r\n".encode())
            statuses = []
            for _ in range(150):
                conn = await Connection.open(relay.port)
                clients.append(conn)
                statuses.append(await _status(conn, host))
            assert statuses == [200] * 150, statuses
            assert await clients[2].closed_by_peer()  # the longest idle went first
            assert await _status(clients[-1], host) == 200  # the newest is kept alive
            app.release.set()
            answer = await busy.read_response()
            assert answer.status == 200
            assert answer.body == b"ok"
            await begun.send(b"\r\n")
            assert (await begun.read_response()).status == 200
            text = (await get(relay.admin_port, "/metrics"))[1].decode()
            assert value(text, SHED, side="client") >= 150 - 64
            assert value(text, "relay_client_connections") < 128
        finally:
            for conn in clients:
                await conn.close()
            relay.stop()
    assert "Traceback" not in relay.output()


async def test_a_dial_out_of_descriptors_closes_idle_clients_for_the_next_requests(
    tmp_path: Path, closing_upstream: int
) -> None:
    """The limit lowered under a running relay (its mark was set at start): the dial that
    fails with EMFILE is answered 503 and closes the idle keep-alive clients, so that the
    next request is served. Before, every request got 503 until the idle ones timed out."""
    overrides = {"listen": {"max_connections": 1000}}
    relay = RelayProcess(tmp_path, [route("box", insecure=True)], overrides)
    relay.start()
    host = f"{closing_upstream}-box.{DOMAIN}"  # every request dials: no pooled connection
    idle: list[Connection] = []
    try:
        for _ in range(10):
            conn = await Connection.open(relay.port)
            idle.append(conn)
            assert await _status(conn, host) == 200
        assert relay.proc is not None
        pid = relay.proc.pid
        soft = resource.prlimit(pid, NOFILE)[0]
        _set_soft_limit(pid, await _settled_fds(pid) + 1)  # the next client's
        for expected in (503, 200):
            conn = await Connection.open(relay.port)
            try:
                assert await _status(conn, host) == expected
            finally:
                await conn.close()
            # Their descriptors are free once they see the close (the FIN goes with it).
            assert all([await conn.closed_by_peer() for conn in idle])
        _set_soft_limit(pid, soft)
        text = (await get(relay.admin_port, "/metrics"))[1].decode()
        assert value(text, SHED, side="client") == 10
    finally:
        for conn in idle:
            await conn.close()
        relay.stop()
    assert "Traceback" not in relay.output()
