"""``process.workers > 1``: supervisor, SO_REUSEPORT workers, restarts, merged metrics."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay import metrics, worker_notify, worker_processes
from relay.config import ConfigError
from relay.config_parse import load, parse
from relay.supervision import (
    BACKOFF_MAX_S,
    STABLE_S,
    next_failures,
    parse_notification,
    preflight,
    restart_delay,
    startup_exit_code,
    supervises,
    worker_env,
)
from relay.workers import Supervisor
from tests.support.certs import issue
from tests.support.harness import (
    DOMAIN,
    RelayProcess,
    config_data,
    route,
    serve_until_exit,
    tls_listener,
    to_toml,
    write_routes,
)
from tests.support.ops import get, value
from tests.support.ports import free_port
from tests.support.rawhttp import request


# -- pure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0.0), (1, 0.2), (2, 0.4), (3, 0.8), (10, BACKOFF_MAX_S)]
)
def test_restart_backoff(failures: int, delay: float) -> None:
    assert restart_delay(failures) == pytest.approx(delay)


def test_a_long_run_resets_the_failure_count() -> None:
    assert next_failures(5, STABLE_S + 1) == 1
    assert next_failures(5, 1.0) == 6


def test_parse_notification() -> None:
    assert parse_notification(b"READY=1\nSTATUS=a=b\ngarbage\n") == {"READY": "1", "STATUS": "a=b"}


def test_startup_exit_code() -> None:
    assert startup_exit_code(2) == 2  # a configuration error stays one
    assert startup_exit_code(1) == 1
    assert startup_exit_code(-9) == 1


def test_worker_env(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_PID": "1"}
    env = worker_env(base, 3, tmp_path, 15.0, 4321)
    assert env["NOTIFY_SOCKET"] == str(tmp_path / "notify.sock")  # the supervisor's, not systemd's
    assert env["WATCHDOG_USEC"] == "15000000"
    assert "WATCHDOG_PID" not in env
    assert env["RELAY_WORKER"] == "3"
    assert env["RELAY_SUPERVISOR"] == "4321"  # watched by the worker (lifecycle)
    assert env["PATH"] == "/bin"


def test_supervises_only_outside_a_worker() -> None:
    config = parse({"process": {"workers": 2}})
    assert supervises(config, {})
    assert not supervises(config, {"RELAY_WORKER": "0"})
    assert not supervises(parse({}), {})


def test_preflight_refuses_port_0(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(to_toml(config_data(tmp_path, {"process": {"workers": 2}})))
    with pytest.raises(ConfigError, match=r"^listen\.address\[0\]: port 0"):
        preflight(load(path))


# -- a real supervisor --------------------------------------------------------------------------
@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", ok)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def _readyz(relay: RelayProcess) -> tuple[int, dict[str, object]]:
    status, body = await get(relay.admin_port, "/readyz")
    return status, json.loads(body)


async def _metrics(relay: RelayProcess) -> str:
    return (await get(relay.admin_port, "/metrics"))[1].decode()


async def _wait_requests(relay: RelayProcess, count: int, timeout: float = 5.0) -> str:
    """Workers write their snapshots once a second: wait for them to add up."""
    deadline = time.monotonic() + timeout
    while True:
        text = await _metrics(relay)
        seen = value(text, "relay_requests_total", kind="app", status_class="2xx")
        if seen == count or time.monotonic() > deadline:
            assert seen == count
            return text
        await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_workers_restart_and_metrics_add_up(tmp_path: Path, upstream: TestServer) -> None:
    overrides = {"process": {"workers": 2, "drain_timeout_s": 2}}
    relay = RelayProcess(tmp_path, [route("workerbox", insecure=True)], overrides)
    relay.start(timeout=20)
    host = f"{upstream.port}-workerbox.{DOMAIN}"
    try:
        status, ready = await _readyz(relay)
        assert status == 200
        workers = ready["workers"]
        assert isinstance(workers, list)
        pids = [w["pid"] for w in workers]
        assert len(set(pids)) == 2
        assert relay.proc is not None
        assert relay.proc.pid not in pids
        # New connections spread over both workers' sockets (SO_REUSEPORT).
        for _ in range(20):
            assert (await request(relay.port, "GET", "/", host)).status == 200
        text = await _wait_requests(relay, 20)
        assert value(text, "relay_workers", state="running") == 2
        assert value(text, "relay_routes") == 1  # a gauge: max over workers, not a sum

        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        # Until the kernel has closed the dead worker's socket, connections hashed to it are
        # reset (an SO_REUSEPORT property, see docs/operations.md); the supervisor logs the
        # death once it reaped the process, by which time the socket is gone.
        deadline = time.monotonic() + 5
        while f"(pid {victim}) died" not in relay.output():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        for _ in range(10):  # the other worker keeps serving meanwhile
            assert (await request(relay.port, "GET", "/", host)).status == 200
        deadline = time.monotonic() + 10
        while True:
            status, ready = await _readyz(relay)
            workers = ready["workers"]
            assert isinstance(workers, list)
            new_pids = [w["pid"] for w in workers]
            if status == 200 and victim not in new_pids and None not in new_pids:
                break
            assert time.monotonic() < deadline, ready
            await asyncio.sleep(0.1)
        assert not _alive(victim)
        assert workers[0]["restarts"] == 1
        for _ in range(10):
            assert (await request(relay.port, "GET", "/", host)).status == 200
        # The killed worker's requests still count: totals never go backwards.
        text = await _wait_requests(relay, 40)
        assert value(text, "relay_worker_restarts_total") == 1
        assert value(text, "relay_workers", state="ready") == 2
        assert any(line.startswith("process_") for line in text.splitlines())

        routes = json.loads((await get(relay.admin_port, "/routes"))[1])
        assert routes["count"] == 1

        relay.proc.send_signal(signal.SIGHUP)  # forwarded: each worker reloads
        deadline = time.monotonic() + 5
        while relay.output().count("reload requested") < 3:  # supervisor + 2 workers
            assert time.monotonic() < deadline, relay.output()
            await asyncio.sleep(0.05)

        relay.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.proc.wait, 15) == 0
        for pid in new_pids:
            assert isinstance(pid, int)
            assert not _alive(pid)
    finally:
        relay.stop()
    output = relay.output()
    assert "[worker 0]" in output
    assert "[worker 1]" in output
    assert "restarting worker 0" in output


def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path: Path) -> None:
    # What only a worker checks: the compiled HTTP parsers (relay.startup.check_parsers, in
    # Relay.start). A port taken before the start no longer reaches the workers: the
    # supervisor claims each data port first (relay.workers.claim_ports).
    data = config_data(tmp_path, {"process": {"workers": 2}}, port=free_port())
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(data))
    result = serve_until_exit(config, env=dict(os.environ, AIOHTTP_NO_EXTENSIONS="1"))
    assert "pure-Python HTTP parser" in result.stderr
    assert result.returncode == 1, result.stderr
    assert "died: exit 1" in result.stderr
    assert "restarting" not in result.stderr


async def test_a_sighup_while_a_worker_restarts_does_not_kill_it(tmp_path: Path) -> None:
    """A worker still starting has no SIGHUP handler yet (the default action kills it): the
    supervisor forwards the reload to it once it is ready instead (SPEC §7: a reload drops
    nothing)."""
    relay = RelayProcess(tmp_path, [route("box", insecure=True)], {"process": {"workers": 2}})
    relay.start(timeout=20)
    try:
        _, body = await get(relay.admin_port, "/readyz")
        os.kill(json.loads(body)["workers"][0]["pid"], signal.SIGKILL)
        for _ in range(500):  # bounded: 5 s
            if relay.output().count("worker 0 started") >= 2:
                break
            await asyncio.sleep(0.01)
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)  # systemctl reload while worker 0 starts
        # Until the supervisor and both workers took the reload: worker 0 once it is ready, or
        # a death of its instead (bounded: 5 s).
        for _ in range(250):
            if relay.output().count("reload requested") >= 3:
                break
            await asyncio.sleep(0.02)
    finally:
        relay.stop()
    died = [line for line in relay.output().splitlines() if "died" in line]
    assert len(died) == 1, died  # the SIGKILL above, not the reload


async def slow_app(seconds: float, arrived: asyncio.Event | None = None) -> TestServer:
    """A started app that answers GET / after ``seconds``: an exchange a drain waits for;
    ``arrived`` is set when a request comes in."""

    async def slow(_request: web.Request) -> web.Response:
        if arrived is not None:
            arrived.set()
        await asyncio.sleep(seconds)
        return web.Response(text="done")

    app = web.Application()
    app.router.add_get("/", slow)
    upstream = TestServer(app, host="127.0.0.1")
    await upstream.start_server()
    return upstream


async def test_a_reloaded_drain_timeout_holds_for_the_supervisor_too(tmp_path: Path) -> None:
    """process.drain_timeout_s is reloadable (SPEC §7): the supervisor, which kills workers
    that outlive it, must use the reloaded value as the workers do."""

    arrived = asyncio.Event()
    # Past the old deadline, 0.1 + KILL_GRACE_S = 5.1 s from the SIGTERM, sent once it arrived.
    upstream = await slow_app(6, arrived)
    relay = RelayProcess(
        tmp_path, [route("box", insecure=True)], {"process": {"workers": 2, "drain_timeout_s": 0.1}}
    )
    relay.start(timeout=20)
    try:
        data = config_data(
            tmp_path, {"process": {"workers": 2, "drain_timeout_s": 30}}, port=relay.port
        )
        data["admin"]["address"] = f"127.0.0.1:{relay.admin_port}"
        (tmp_path / "relay.toml").write_text(to_toml(data))
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        for _ in range(100):  # bounded: 5 s
            if relay.output().count("process.drain_timeout_s") >= 2:
                break
            await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        host = f"{upstream.port}-box.{DOMAIN}"
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        await asyncio.wait_for(arrived.wait(), 5)
        relay.proc.send_signal(signal.SIGTERM)  # the old deadline: 0.1 + KILL_GRACE_S = 5.1 s
        answer = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        await asyncio.to_thread(relay.proc.wait, 15)
    finally:
        relay.stop()
        await upstream.close()
    assert answer.startswith(b"HTTP/1.1 200")


class _Running:
    """A worker's process as the supervisor sees it (pid, still running)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


@pytest.mark.parametrize(
    "bad",
    [
        "[process]\nworkers = 2\ndrain_timeout_s = = 5\n",  # not TOML: ConfigError
        '[process]\nworkers = 2\n[listen]\naddress = "127.0.0.1:\u00b2"\n',  # ValueError
        "[process]\nworkers = 2\ndrain_timeout_s = 1" + "0" * 400 + "\n",  # OverflowError
    ],
    ids=["toml", "superscript-port", "huge-float"],
)
async def test_a_reload_of_a_broken_file_is_still_forwarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """Whatever the edited file holds, the supervisor forwards SIGHUP to ready workers (they
    report what is wrong), marks starting ones, keeps its drain timeout and tells systemd
    it is ready again once they have all reloaded."""
    path = tmp_path / "relay.toml"
    path.write_text("[process]\nworkers = 2\ndrain_timeout_s = 7\n")
    supervisor = Supervisor(load(path), "info")
    supervisor.workers[0].proc = _Running(111)  # type: ignore[assignment]
    supervisor.workers[0].ready = True
    supervisor.workers[1].proc = _Running(222)  # type: ignore[assignment]
    supervisor.all_ready.set()  # started earlier; worker 1 is being restarted
    sent: list[tuple[int, int]] = []
    notes: list[str] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(supervisor.notifier, "reloading", lambda: notes.append("RELOADING"))
    monkeypatch.setattr(supervisor.notifier, "ready", lambda _status: notes.append("READY"))
    path.write_text(bad)
    supervisor._on_reload_signal()
    assert sent == [(111, signal.SIGHUP)]
    assert supervisor.workers[1].reload_pending
    assert supervisor.config.process.drain_timeout_s == 7
    assert notes == ["RELOADING"]
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})  # reloaded
    supervisor._worker_says(supervisor.workers[1], {"READY": "1"})  # started: now SIGHUP
    assert sent[-1] == (222, signal.SIGHUP)
    assert notes == ["RELOADING"]
    supervisor._worker_says(supervisor.workers[1], {"READY": "1"})  # reloaded
    assert notes == ["RELOADING", "READY"]


def _supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, notes: list[str]) -> Supervisor:
    """Two ready workers (pids 111, 222); signals and notifications recorded, not sent."""
    path = tmp_path / "relay.toml"
    path.write_text("[process]\nworkers = 2\n")
    supervisor = Supervisor(load(path), "info")
    for worker, pid in zip(supervisor.workers, (111, 222), strict=True):
        worker.proc = _Running(pid)  # type: ignore[assignment]
        worker.ready = True
    supervisor.all_ready.set()
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    monkeypatch.setattr(supervisor.notifier, "reloading", lambda: notes.append("RELOADING"))
    monkeypatch.setattr(supervisor.notifier, "ready", lambda _status: notes.append("READY"))
    monkeypatch.setattr(supervisor.notifier, "stopping", lambda _status: notes.append("STOPPING"))
    return supervisor


async def test_ready_after_a_reload_waits_for_every_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd keeps the unit "reloading" from RELOADING=1 to READY=1: `systemctl reload`
    followed by a request must meet the new settings in every worker, so READY=1 waits for
    each worker's own READY=1 after its reload. A status line is not a reload."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    supervisor._on_reload_signal()
    supervisor._worker_says(supervisor.workers[1], {"STATUS": "ready: 1 route(s)"})
    supervisor._worker_says(supervisor.workers[1], {"READY": "1"})
    assert notes == ["RELOADING"]
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})
    assert notes == ["RELOADING", "READY"]
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})  # not a second READY
    assert notes == ["RELOADING", "READY"]


async def test_a_reload_that_a_worker_never_finishes_ends_after_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    monkeypatch.setattr(worker_notify, "RELOAD_WAIT_S", 0.05)
    supervisor._on_reload_signal()
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})
    await asyncio.sleep(0.2)
    assert notes == ["RELOADING", "READY"]
    assert "1 worker(s) did not report" in caplog.text


class _Exiting(_Running):
    async def wait(self) -> int:
        return 1


async def test_a_worker_that_dies_while_reloading_counts_as_reloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its replacement starts with the new file: systemd is not kept waiting for it."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    supervisor._on_reload_signal()
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})
    restarted: list[int] = []

    async def restart(worker: worker_processes.Worker) -> None:
        restarted.append(worker.index)  # not a real process in this test

    monkeypatch.setattr(supervisor, "_start_worker", restart)
    dying = _Exiting(222)
    await supervisor._wait_worker(supervisor.workers[1], dying)  # type: ignore[arg-type]
    assert notes == ["RELOADING", "READY"]
    assert restarted == [1]


async def test_a_sighup_during_start_up_is_applied_but_not_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: before the supervisor's first READY=1, a reload is no systemd job;
    RELOADING=1 and a READY=1 from the reload (its 30 s timer included) would tell systemd
    the unit started while workers were still starting."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    supervisor.all_ready.clear()
    supervisor.workers[1].ready = False  # still starting
    monkeypatch.setattr(worker_notify, "RELOAD_WAIT_S", 0.05)
    supervisor._on_reload_signal()
    assert supervisor.workers[0].reloading
    assert supervisor.workers[1].reload_pending
    await asyncio.sleep(0.2)
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})
    assert notes == []


async def test_a_stop_during_a_reload_sends_no_ready_after_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a worker that exits while draining, or the reload's timer firing in
    the drain, sent READY=1 after STOPPING=1."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    monkeypatch.setattr(worker_notify, "RELOAD_WAIT_S", 0.05)
    supervisor._on_reload_signal()
    supervisor._on_stop_signal(signal.SIGTERM)
    supervisor.notifier.stopping("draining workers")
    dying = _Exiting(222)
    await supervisor._wait_worker(supervisor.workers[1], dying)  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert notes == ["RELOADING", "STOPPING"]


async def test_a_worker_waiting_to_restart_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It reads the new file when it starts: the reload is done when the running ones are."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    supervisor.workers[1].ready = False
    supervisor.workers[1].proc = None  # died, in its restart backoff
    supervisor._on_reload_signal()
    supervisor._worker_says(supervisor.workers[0], {"READY": "1"})
    assert notes == ["RELOADING", "READY"]


async def test_a_stop_does_not_wait_for_a_worker_in_its_restart_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: its waiter sleeps up to 10 s before the restart; a stop has nothing
    of it to drain, so it is cancelled, not waited for."""
    notes: list[str] = []
    supervisor = _supervisor(tmp_path, monkeypatch, notes)
    for worker in supervisor.workers:
        worker.waiter = supervisor._spawn(asyncio.sleep(10))
    supervisor.workers[1].proc = None  # died: sleeping in its backoff
    running = supervisor.workers[0].waiter
    assert running is not None
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, running.cancel)  # worker 0 exits once signalled
    started = time.monotonic()
    await supervisor._shutdown()
    assert time.monotonic() - started < 2.0


def _requests_total(directory: Path) -> float:
    snaps = list(metrics.read_snapshots(directory).values())
    out = {m.name: m for m in metrics.families(snaps, [])}
    return sum(s.value for s in out["relay_requests"].samples)


def _counted(pid: int, requests: int) -> dict[str, object]:
    return {"pid": pid, "counters": {"relay_requests": [[["app", "2xx"], requests]]}}


async def test_a_dead_workers_counts_are_kept_once_its_pid_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots were kept per pid for good: one more file per restart (a crash loop: one
    every 10 s, all read by every scrape), and a new worker given a dead one's pid overwrote
    its file, so relay_requests_total went backwards (found by review). The supervisor now
    folds a dead worker's counts into one file when it reaps it."""
    supervisor = _supervisor(tmp_path, monkeypatch, [])
    supervisor.run_dir = tmp_path
    directory = tmp_path / "metrics"
    directory.mkdir()
    metrics.write_snapshot(directory, _counted(111, 5))
    metrics.write_snapshot(directory, _counted(222, 100))
    supervisor.stop.set()  # no restart: only the reaping is under test
    for _ in range(2):  # pid 222 dies, comes back (reused), dies again
        await supervisor._wait_worker(supervisor.workers[1], _Exiting(222))  # type: ignore[arg-type]
        assert not (directory / "222.json").exists()
        metrics.write_snapshot(directory, _counted(222, 3))
    assert _requests_total(directory) == 5 + 100 + 3 + 3
    assert sorted(p.name for p in directory.iterdir()) == ["111.json", "222.json", "retired.json"]


async def test_a_worker_killed_between_writing_and_renaming_its_snapshot_is_retired_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGKILLed (the OOM killer, the supervisor's watchdog or drain deadline) after
    metrics.write_snapshot wrote its temporary file but before the rename leaves that file,
    whole and a second newer than its snapshot. metrics.retire read only the snapshot and left
    the temporary file in the directory for good, one per such death."""
    supervisor = _supervisor(tmp_path, monkeypatch, [])
    supervisor.run_dir = tmp_path
    directory = tmp_path / "metrics"
    directory.mkdir()
    metrics.write_snapshot(directory, _counted(222, 100))
    (directory / ".222.json.tmp").write_text(json.dumps(_counted(222, 130)))
    supervisor.stop.set()  # no restart: only the reaping is under test
    await supervisor._wait_worker(supervisor.workers[1], _Exiting(222))  # type: ignore[arg-type]
    assert _requests_total(directory) == 130
    assert [p.name for p in directory.iterdir()] == ["retired.json"]


async def test_a_torn_temporary_snapshot_of_a_dead_worker_is_dropped_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed in the middle of the write, the temporary file is cut short: the snapshot before
    it is what the worker counted, and the torn file goes with it."""
    supervisor = _supervisor(tmp_path, monkeypatch, [])
    supervisor.run_dir = tmp_path
    directory = tmp_path / "metrics"
    directory.mkdir()
    metrics.write_snapshot(directory, _counted(222, 100))
    (directory / ".222.json.tmp").write_text(json.dumps(_counted(222, 130))[:-1])
    supervisor.stop.set()
    await supervisor._wait_worker(supervisor.workers[1], _Exiting(222))  # type: ignore[arg-type]
    assert _requests_total(directory) == 100
    assert [p.name for p in directory.iterdir()] == ["retired.json"]


# -- a restarted worker runs what its siblings run (relay.lifecycle.save_effective_config) ----
async def _ready_pids(relay: RelayProcess, within: float, exclude: int = 0) -> list[int] | None:
    deadline = time.monotonic() + within
    while True:
        status, body = await get(relay.admin_port, "/readyz")
        pids = [w["pid"] for w in json.loads(body)["workers"]]
        if status == 200 and None not in pids and exclude not in pids:
            return pids
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)


async def _reload_then_restart_one(relay: RelayProcess, refused: str = "") -> bool:
    """SIGHUP (``refused``: the reload counter each worker must count as an error), then
    SIGKILL one worker: whether its replacement became ready."""
    assert relay.proc is not None
    relay.proc.send_signal(signal.SIGHUP)
    await asyncio.sleep(1.5)
    if refused:
        text = await _metrics(relay)
        assert value(text, refused, result="error") == 2  # one per worker
    pids = await _ready_pids(relay, 15)
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    return await _ready_pids(relay, 8, exclude=pids[0]) is not None


async def test_a_restarted_worker_keeps_the_running_routes_file(
    tmp_path: Path, upstream: TestServer
) -> None:
    """routes.file is restart-only: after a SIGHUP every worker keeps serving the old file,
    the restarted one too (found by review: it read the new file, and half the requests got
    502)."""
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], {"process": {"workers": 2}})
    relay.start(timeout=20)
    try:
        write_routes(tmp_path / "other.json", [route("sbxb", insecure=True)])
        config_file = tmp_path / "relay.toml"
        text = config_file.read_text()
        config_file.write_text(text.replace(str(tmp_path / "routes.json"), "other.json"))
        assert await _reload_then_restart_one(relay), relay.output()[-3000:]
        host = f"{upstream.port}-sbxa.{DOMAIN}"
        statuses = {(await request(relay.port, "GET", "/", host)).status for _ in range(40)}
    finally:
        relay.stop()
    assert statuses == {200}, relay.output()[-2000:]


async def test_a_worker_restarted_after_a_refused_reload_comes_back(tmp_path: Path) -> None:
    """The file broke and the reload was refused (both workers keep running, counted); a
    worker that dies then starts with the running configuration instead of failing on the
    file until someone mends it (found by review)."""
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], {"process": {"workers": 2}})
    relay.start(timeout=20)
    try:
        config_file = tmp_path / "relay.toml"
        config_file.write_text(config_file.read_text() + "\nbogus_key = 1\n")
        back = await _reload_then_restart_one(relay, "relay_reloads_total")
    finally:
        relay.stop()
    assert back, relay.output()[-3000:]


def _half_written_renewal(directory: Path, cert_file: Path) -> None:
    directory.mkdir()
    cert_file.write_bytes(issue(directory, [f"*.{DOMAIN}"]).cert_file.read_bytes())


async def test_a_worker_restarted_after_a_refused_tls_pair_serves_the_running_one(
    tmp_path: Path,
) -> None:
    """A renewal half written (the new certificate over the old one, not yet its key) is
    refused by the reload, and the workers keep serving the pair they loaded; a worker that
    dies then starts with those bytes (saved in the run directory), not the files."""
    overrides, _ = tls_listener(tmp_path)
    overrides["process"] = {"workers": 2}
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], overrides)
    relay.start(timeout=20)
    try:
        _half_written_renewal(tmp_path / "other", Path(overrides["listen"]["tls_cert"]))
        back = await _reload_then_restart_one(relay, "relay_tls_reloads_total")
    finally:
        relay.stop()
    assert back, relay.output()[-3000:]


async def test_a_worker_restarted_after_the_certificate_expired_comes_back(
    tmp_path: Path,
) -> None:
    """Its siblings serve the pair whatever its dates now (they were checked when it was
    loaded); a worker that dies after the certificate expired must come back and serve the
    same, not fail its start on the date check and leave relay a worker short for good."""
    lifetime_s = 6.0  # long enough for a slow start (~1.3 s here, 4x that on a loaded CI machine)
    expires = time.monotonic() + lifetime_s
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"], not_after_days=lifetime_s / 86400)
    overrides: dict[str, Any] = {
        "listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)},
        "process": {"workers": 2},
    }
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], overrides)
    relay.start(timeout=lifetime_s)
    try:
        pids = await _ready_pids(relay, lifetime_s)
        assert pids
        # (notAfter is whole seconds, cut down: it is past once expires is.)
        await asyncio.sleep(max(0.0, expires - time.monotonic()) + 0.5)
        os.kill(pids[0], signal.SIGKILL)
        back = await _ready_pids(relay, 8, exclude=pids[0])
    finally:
        relay.stop()
    assert back is not None, relay.output()[-3000:]


class _Exited:
    pid = 222
    returncode = -9

    async def wait(self) -> int:
        return -9


class _Spawned(_Running):
    async def wait(self) -> int:
        await asyncio.sleep(3600)
        return 0


async def test_a_worker_whose_restart_fails_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: when spawning a dead worker's replacement failed once (fork or exec:
    EAGAIN under TasksMax, ENOMEM, EMFILE), the waiter ended silently and the supervisor ran a
    worker short for good."""
    path = tmp_path / "relay.toml"
    path.write_text("[process]\nworkers = 2\n")
    supervisor = Supervisor(load(path), "info")
    supervisor.all_ready.set()
    monkeypatch.setattr(worker_processes, "restart_delay", lambda failures: 0.01)
    attempts: list[int] = []

    async def spawn(*args: object, **kwargs: object) -> _Spawned:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return _Spawned(333)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
    victim = supervisor.workers[1]
    waiter = asyncio.ensure_future(supervisor._wait_worker(victim, _Exited()))  # type: ignore[arg-type]
    try:
        for _ in range(200):  # 2 s at most
            if victim.proc is not None and victim.proc.pid == 333:
                break
            await asyncio.sleep(0.01)
    finally:
        waiter.cancel()
        for worker in supervisor.workers:
            if worker.waiter is not None:
                worker.waiter.cancel()
        await asyncio.gather(waiter, *supervisor._tasks, return_exceptions=True)
    assert attempts == [0, 1]
    assert victim.proc is not None
    assert victim.proc.pid == 333
    assert victim.restarts == 1


def test_the_restart_delay_is_capped_for_any_count() -> None:
    """Found by review: past ~1,024 failures 2 ** (n - 1) overflowed a float, and the waiter
    that restarts the worker died."""
    assert restart_delay(1100) == BACKOFF_MAX_S
    assert restart_delay(10**6) == BACKOFF_MAX_S


# -- the exit code of a drain (SPEC §7) ---------------------------------------------------------
async def test_a_worker_that_dies_during_the_drain_makes_the_exit_code_1(tmp_path: Path) -> None:
    """SPEC §7's exit 0 is for a drain that ran its course. A worker that dies in it (here
    SIGKILL, as the OOM killer does) cut its exchanges short without one: a single relay
    dying so exits non-zero, and systemd should record the stop as failed. It exited 0."""

    upstream = await slow_app(5)
    relay = RelayProcess(
        tmp_path, [route("box", insecure=True)], {"process": {"workers": 2, "drain_timeout_s": 1.5}}
    )
    relay.start(timeout=20)
    try:
        assert relay.proc is not None
        pids = await _ready_pids(relay, 10)
        assert pids
        host = f"{upstream.port}-box.{DOMAIN}"
        writers = []
        for _ in range(6):  # over both workers, most likely (SO_REUSEPORT)
            _, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            writers.append(writer)
        await asyncio.sleep(0.3)
        relay.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        draining = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        assert draining  # a worker holding an exchange drains for up to 1.5 s
        os.kill(draining[0], signal.SIGKILL)
        code = await asyncio.to_thread(relay.proc.wait, 15)
        for writer in writers:
            writer.close()
    finally:
        relay.stop()
        await upstream.close()
    assert code == 1, relay.output()
    assert "exit -9" in relay.output()


def _catches(pid: int, sig: signal.Signals) -> bool | None:
    """Whether ``pid`` has a handler for ``sig`` (SigCgt); None once it is gone or a zombie."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    return bool(int(fields["SigCgt"], 16) >> (sig - 1) & 1)


async def test_a_second_sigterm_after_a_workers_drain_does_not_fail_the_stop(
    tmp_path: Path,
) -> None:
    """A second SIGTERM makes the supervisor send its workers WORKER_FORCE_SIGNAL (SIGUSR1). A
    worker whose drain was over had already removed its handler and was exiting: SIGUSR1's
    default action killed it (exit -10), and the supervisor reported "died during the drain"
    and exited 1, though every drain had run its course (SPEC §7: exit 0)."""
    relay = RelayProcess(
        tmp_path, [route("box", insecure=True)], {"process": {"workers": 2, "drain_timeout_s": 3}}
    )
    relay.start(timeout=20)
    try:
        assert relay.proc is not None
        pids = await _ready_pids(relay, 10)
        assert pids
        relay.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        # The workers hold no connection: each ends its drain at once, then exits. The second
        # SIGTERM goes in between, once one has dropped its handler (polled, bounded).
        while time.monotonic() < deadline:
            if any(_catches(pid, signal.SIGUSR1) is False for pid in pids):
                relay.proc.send_signal(signal.SIGTERM)
                break
            await asyncio.sleep(0.0002)
        else:
            pytest.fail("no worker ended its drain")
        code = await asyncio.to_thread(relay.proc.wait, 15)
    finally:
        relay.stop()
    assert "died during the drain" not in relay.output()
    assert code == 0, relay.output()


async def test_workers_whose_supervisor_died_drain_and_exit(tmp_path: Path) -> None:
    """A supervisor killed outright (SIGKILL, the OOM killer, a crash) left its workers running
    as orphans: they kept the data port (SO_REUSEPORT) with the configuration of that start,
    no admin port, no restarts, no signals forwarded, and a new relay started on the same
    port shared its connections with them for good. A worker now notices its supervisor is
    gone (within a second) and drains as on SIGTERM: an exchange in flight is answered, and
    the worker exits."""
    upstream = await slow_app(1.5)
    relay = RelayProcess(
        tmp_path, [route("box", insecure=True)], {"process": {"workers": 2, "drain_timeout_s": 10}}
    )
    relay.start(timeout=20)
    try:
        assert relay.proc is not None
        pids = await _ready_pids(relay, 10)
        assert pids
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        host = f"{upstream.port}-box.{DOMAIN}"
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await asyncio.sleep(0.3)
        relay.proc.kill()
        relay.proc.wait(5)
        answer = await asyncio.wait_for(reader.read(), 10)  # the drain lets it finish
        writer.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not any(_alive(pid) for pid in pids):
                break
            await asyncio.sleep(0.1)
        orphans = [pid for pid in pids if _alive(pid)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
    finally:
        relay.stop()
        await upstream.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert not orphans, relay.output()
    assert "the supervisor (pid" in relay.output()


# -- per-sandbox max_connections across workers (relay.sharedcount) ----------------------------
class _Held:
    """An app whose requests wait until released: exchanges that stay in flight."""

    def __init__(self) -> None:
        self.arrived = 0
        self.release = asyncio.Event()
        self.server: TestServer | None = None

    async def start(self) -> int:
        async def held(_request: web.Request) -> web.Response:
            self.arrived += 1
            await self.release.wait()
            return web.Response(text="done")

        app = web.Application()
        app.router.add_get("/{tail:.*}", held)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        assert self.server.port is not None
        return self.server.port

    async def close(self) -> None:
        self.release.set()
        if self.server is not None:
            await self.server.close()


def _limited_relay(tmp_path: Path) -> RelayProcess:
    run = tmp_path / "run"  # the supervisor's run directory goes under it: workers' sockets
    run.mkdir()
    return RelayProcess(
        tmp_path,
        [route("limited", insecure=True, max_connections=1)],
        {"process": {"workers": 2, "drain_timeout_s": 1}},
        env=dict(os.environ, RUNTIME_DIRECTORY=str(run)),
    )


async def _worker_refusals(relay: RelayProcess) -> list[float]:
    """Each worker's own count of 429s, asked on its admin socket (not the merged one)."""
    (run_dir,) = (relay.tmp_path / "run").glob("relay-*")
    counts = []
    for index in range(2):
        connector = aiohttp.UnixConnector(path=str(run_dir / f"worker-{index}.sock"))
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get("http://worker/metrics") as response,
        ):
            text = await response.text()
        counts.append(value(text, "relay_refusals_total", reason="sandbox_limit"))
    return counts


LIMIT_BODY = "The sandbox has too many concurrent incoming connections (limit: 1)"


async def _answer(relay: RelayProcess, target: str, host: str) -> str:
    """A 429's message (SPEC §5), else what came instead: "in flight" when none in 2 s."""
    try:
        response = await request(relay.port, "GET", target, host, timeout=2)
    except TimeoutError:
        return "in flight"
    if response.status != 429:
        return str(response.status)
    return str(json.loads(response.body)["message"])


async def _one_held(relay: RelayProcess, app: _Held, host: str) -> asyncio.Future[Any]:
    """A request the app holds: in flight to the limited sandbox, in one worker."""
    held = asyncio.ensure_future(request(relay.port, "GET", "/", host, timeout=15))
    for _ in range(250):  # bounded: 5 s
        if app.arrived:
            break
        await asyncio.sleep(0.02)
    assert app.arrived == 1
    return held


async def test_max_connections_counts_the_exchanges_of_every_worker(tmp_path: Path) -> None:
    """SPEC §5a: max_connections counts in-flight exchanges to the sandbox, whichever worker
    holds them (found by review: with 2 workers and a limit of 1, 2 were in flight)."""
    app = _Held()
    port = await app.start()
    relay = _limited_relay(tmp_path)
    relay.start(timeout=20)
    host = f"{port}-limited.{DOMAIN}"
    try:
        first = await _one_held(relay, app, host)
        # New connections each, spread by SO_REUSEPORT over both workers' sockets.
        answers = await asyncio.gather(*(_answer(relay, f"/{i}", host) for i in range(24)))
        assert (app.arrived, answers) == (1, [LIMIT_BODY] * 24)
        refusals = await _worker_refusals(relay)
        assert sum(refusals) == 24
        assert all(refusals), refusals  # both workers refused: each saw the other's exchange
        app.release.set()
        assert (await first).status == 200
        # Nothing stays counted once it ended: one at a time, every worker lets one through.
        app.release = asyncio.Event()
        app.release.set()
        statuses = [(await request(relay.port, "GET", "/", host)).status for _ in range(12)]
        assert statuses == [200] * 12
        assert sum(await _worker_refusals(relay)) == 24
    finally:
        relay.stop()
        await app.close()


async def test_a_killed_workers_exchange_does_not_stay_counted(tmp_path: Path) -> None:
    """A worker killed by SIGKILL while an exchange to a limited sandbox is in flight never
    takes it off the shared count itself: the supervisor clears what it held."""
    app = _Held()
    port = await app.start()
    relay = _limited_relay(tmp_path)
    relay.start(timeout=20)
    host = f"{port}-limited.{DOMAIN}"
    try:
        held = await _one_held(relay, app, host)
        # Which worker holds it: the other one refuses everything it gets.
        answers = await asyncio.gather(*(_answer(relay, "/", host) for _ in range(16)))
        assert answers == [LIMIT_BODY] * 16
        refusals = await _worker_refusals(relay)
        assert all(refusals), refusals
        _, body = await get(relay.admin_port, "/readyz")
        pids = [w["pid"] for w in json.loads(body)["workers"]]
        (run_dir,) = (relay.tmp_path / "run").glob("relay-*")
        table = (run_dir / "inflight.bin").read_bytes()
        column = len(table) // 2
        holder = 0 if any(table[:column]) else 1
        assert any(table[holder * column : (holder + 1) * column])
        os.kill(pids[holder], signal.SIGKILL)
        await asyncio.gather(held, return_exceptions=True)  # cut with its worker
        assert await _ready_pids(relay, 15, exclude=pids[holder]) is not None
        app.release.set()
        statuses = [(await request(relay.port, "GET", "/", host)).status for _ in range(12)]
        assert statuses == [200] * 12
    finally:
        relay.stop()
        await app.close()


async def test_workers_start_under_a_temporary_directory_too_long_for_a_socket(
    tmp_path: Path,
) -> None:
    """The supervisor's run directory holds Unix sockets (notify.sock, worker-N.sock), whose
    paths the kernel caps at 107 bytes. Outside systemd it is made under $TMPDIR: a long one
    (a CI runner's or a nested build's) crashed the supervisor with "AF_UNIX path too long"
    and a traceback, exit 1, which Restart=on-failure repeats for ever (found by review)."""
    long_tmp = tmp_path / ("t" * (120 - len(str(tmp_path))))
    long_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RUNTIME_DIRECTORY"}
    env["TMPDIR"] = str(long_tmp)
    relay = RelayProcess(
        tmp_path, [route("box", insecure=True)], {"process": {"workers": 2}}, env=env
    )
    relay.start(timeout=20)
    try:
        status, body = await _readyz(relay)
        assert status == 200, body
    finally:
        relay.stop()
    assert "Traceback" not in relay.output()
    assert "too long" in relay.output()  # said, with the directory used instead
