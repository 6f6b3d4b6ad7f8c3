"""``process.workers > 1``: a supervisor and that many worker processes (SPEC §6).

Each worker is a full ``relay serve`` started with ``$RELAY_WORKER`` set: it binds the data
listeners itself with ``SO_REUSEPORT`` (the kernel spreads new connections over the workers'
sockets), runs its own route feed, and drains on SIGTERM like a single relay. Workers are
spawned (a fresh interpreter each), not forked from a process that already runs an event loop.

The supervisor owns what there must be one of:

- **systemd**: it is the main process (``NotifyAccess=main``). Workers speak sd_notify to the
  supervisor's own datagram socket (sender identified by ``SCM_CREDENTIALS``); ``READY=1``
  goes to systemd once every worker has said ``READY=1``. Workers also ping a watchdog there;
  a worker silent for :data:`WORKER_WATCHDOG_S` is killed and restarted.
- **signals**: SIGTERM/SIGINT are forwarded to every worker (each drains for up to
  ``process.drain_timeout_s``; stragglers are killed a little after that), SIGHUP too (each
  worker reloads).
- **the admin port**: ``/readyz`` asks every worker's ``/readyz`` (over a Unix socket in the run
  directory) and is 200 only when all are; ``/routes`` is one worker's (all follow the same
  feed); ``/metrics`` merges the workers' snapshot files (``relay.metrics``) and adds the
  supervisor's own ``process_*``/``python_*`` families (handlers in :mod:`relay.admin`).
- **the shared in-flight table** (``relay.sharedcount``): created before the workers, so that
  a route's ``max_connections`` counts every worker's exchanges; a dead worker's column is
  zeroed before its restart.
- **restarts**: a worker that exits while relay is not stopping is restarted after
  :func:`relay.supervision.restart_delay` (exponential backoff, reset once a worker has run
  for ``STABLE_S``). A worker that dies before all workers were first ready stops the whole
  relay instead (exit 2 for a configuration error, else 1): a broken start would only loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from relay import admin, metrics, sharedcount, systemd
from relay.addresses import split_address
from relay.config import Config
from relay.config_parse import load
from relay.lifecycle import WORKER_FORCE_SIGNAL, admin_socket
from relay.startup import binding
from relay.supervision import (
    NOTIFY_SOCKET,
    next_failures,
    parse_notification,
    preflight,
    restart_delay,
    startup_exit_code,
    worker_env,
)
from relay.systemd import Notifier

log = logging.getLogger("relay.workers")
# sun_path holds 108 bytes on Linux, the last a NUL: a longer socket path cannot be bound.
UNIX_PATH_MAX = 107


def _run_dir(base: str | None, workers: int) -> Path:
    """The supervisor's private directory (0700): under ``base`` ($RUNTIME_DIRECTORY, else
    $TMPDIR, else /tmp), unless the sockets in it would be too long to bind there (a long
    $TMPDIR crashed the supervisor with "AF_UNIX path too long", found by review): then
    under /tmp, and the log says so."""
    run_dir = Path(tempfile.mkdtemp(prefix="relay-", dir=base))
    sockets = (admin_socket(run_dir, workers - 1), run_dir / NOTIFY_SOCKET)
    if max(len(os.fsencode(path)) for path in sockets) <= UNIX_PATH_MAX:
        return run_dir
    run_dir.rmdir()
    short = Path(tempfile.mkdtemp(prefix="relay-", dir="/tmp"))
    log.warning(
        "run directory %s: its socket paths would be too long (over %d bytes); using %s",
        run_dir.parent,
        UNIX_PATH_MAX,
        short,
    )
    return short


WORKER_WATCHDOG_S = 30.0  # a ready worker that has not pinged for this long is killed
KILL_GRACE_S = 5.0  # after drain_timeout_s, before stragglers get SIGKILL
# After a SIGHUP, READY=1 goes to systemd once every worker has reloaded (said READY=1 again),
# or after this long with a warning: a worker's reload is a few file reads, and one that never
# answers is the watchdog's to kill, not a reason to leave the unit "reloading" for ever.
RELOAD_WAIT_S = 30.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


# -- the supervisor ---------------------------------------------------------------------------
@dataclass
class Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    ready: bool = False
    last_ping: float = 0.0
    failures: int = 0
    restarts: int = 0
    status: str = ""
    reload_pending: bool = False  # a SIGHUP came before it was ready: sent once it is
    reloading: bool = False  # sent SIGHUP; READY=1 from it means the reload is done
    served: bool = False  # said READY=1 since it was started: it may hold exchanges
    waiter: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        if self.proc is None or self.proc.returncode is not None:
            return None
        return self.proc.pid


class Supervisor:
    def __init__(self, config: Config, log_level: str) -> None:
        self.config = config
        self.log_level = log_level
        self.notifier = Notifier()
        self.workers = [Worker(i) for i in range(config.process.workers)]
        self.run_dir = Path()
        self.inflight: Path | None = None  # the workers' in-flight counts (relay.sharedcount)
        self.draining = False
        self.stop = asyncio.Event()
        self.all_ready = asyncio.Event()
        self.startup_failed: int | None = None
        # A worker ended the drain other than by exiting 0 (it crashed, or was killed): exit 1.
        self.drain_failed = False
        self._sock: socket.socket | None = None
        self._admin: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.admin_bound: tuple[str, int] | None = None
        self._reload_wait: asyncio.TimerHandle | None = None  # systemd waits for READY=1

    # -- run --------------------------------------------------------------------------------
    async def run(self) -> int:
        base = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
        self.run_dir = _run_dir(base, len(self.workers))
        (self.run_dir / "metrics").mkdir()
        try:
            self.inflight = sharedcount.create(self.run_dir, len(self.workers))
            return await self._run()
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        self._open_notify_socket()
        await self._start_admin()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        for early in systemd.held():  # what came before the handlers (systemd.hold_signals)
            if early == signal.SIGHUP:
                loop.call_soon(self._on_reload_signal)
            else:
                loop.call_soon(self._on_stop_signal, signal.Signals(early))
        if self.notifier.watchdog_s:
            self._spawn(self._watchdog(self.notifier.watchdog_s))
        self.notifier.status(f"starting {len(self.workers)} workers")
        claim_ports(self.config)
        for worker in self.workers:
            try:
                await self._start_worker(worker)
            except OSError as exc:
                # fork or exec failed (the interpreter gone while a virtualenv is replaced,
                # EAGAIN under TasksMax): a broken start, as a worker dying before all were
                # ready; it was a traceback (found by review). Exit 1: it may pass next time.
                log.error(
                    "worker %d could not be started (%s): %s", worker.index, sys.executable, exc
                )
                self.startup_failed = 1
                self.stop.set()
                break
        self._spawn(self._monitor())
        started = asyncio.ensure_future(self.all_ready.wait())
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        stopped.cancel()
        if self.startup_failed is None and not self.stop.is_set():
            self.notifier.ready(self._status())
            log.info("all %d workers ready", len(self.workers))
            await self.stop.wait()
        await self._shutdown()
        if self.startup_failed is not None:
            return self.startup_failed
        # SPEC §7's exit 0 is for a drain that ran its course. A worker that crashed or was
        # killed in it cut its exchanges without one; a single relay would exit non-zero
        # then, and systemd should record the stop as failed (found by review: it was 0).
        return 1 if self.drain_failed else 0

    async def _shutdown(self) -> None:
        self.draining = True
        self.notifier.stopping("draining workers")
        self._signal_all(signal.SIGTERM)
        deadline = self.config.process.drain_timeout_s + KILL_GRACE_S
        for worker in self.workers:
            if worker.pid is None and worker.waiter is not None:
                worker.waiter.cancel()  # waiting to be restarted: nothing to drain
        waiters = [w.waiter for w in self.workers if w.waiter is not None]
        if waiters:
            _, pending = await asyncio.wait(waiters, timeout=deadline)
            if pending:
                log.error("%d worker(s) did not stop in time: killing them", len(pending))
                self._signal_all(signal.SIGKILL)
                await asyncio.wait(pending, timeout=5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        systemd.end_loop_handlers(
            loop, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP), ignore=False
        )
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
        if self._admin is not None:
            await self._admin.cleanup()
        self.notifier.status("stopped")
        self.notifier.close()
        log.info("supervisor stopped")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- workers ----------------------------------------------------------------------------
    async def _start_worker(self, worker: Worker) -> None:
        assert self.config.source is not None
        env = worker_env(os.environ, worker.index, self.run_dir, WORKER_WATCHDOG_S / 2, os.getpid())
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "relay",
            "serve",
            "--config",
            str(self.config.source),
            "--log-level",
            self.log_level,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
        )
        worker.started_at = worker.last_ping = time.monotonic()
        worker.ready = worker.served = False
        worker.status = "starting"
        log.info("worker %d started: pid %d", worker.index, worker.proc.pid)
        worker.waiter = self._spawn(self._wait_worker(worker, worker.proc))

    async def _wait_worker(self, worker: Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        try:
            metrics.retire(self.run_dir / "metrics", proc.pid)
        except OSError as exc:  # a full or read-only run directory: its counts are lost
            log.warning("cannot keep the metrics of worker %d: %s", worker.index, exc)
        try:
            if self.inflight is not None:
                # What it had in flight ended with it (a SIGKILL ran no unregister): its siblings
                # must not keep counting it against max_connections. Its replacement zeroes
                # the column too, when it starts.
                sharedcount.zero_column(self.inflight, worker.index)
        except OSError as exc:
            log.warning("cannot clear the in-flight counts of worker %d: %s", worker.index, exc)
        ran_for = time.monotonic() - worker.started_at
        worker.ready = False
        # A SIGHUP it had not applied: its replacement gets one once ready (it starts with
        # what its siblings saved, which may be from before their reload). systemd is not
        # kept waiting for a worker that is not running (_reloaded).
        missed = worker.reloading or worker.reload_pending
        worker.reloading = worker.reload_pending = False
        if missed:
            self._reloaded()
        if self.draining or self.stop.is_set():
            # One that never said READY=1 (a stop during its start: our SIGTERM may come before
            # it holds signals) had nothing to drain.
            if code == 0 or not worker.served:
                log.info("worker %d (pid %d) exited: %s", worker.index, proc.pid, code)
            else:
                self.drain_failed = True
                log.error(
                    "worker %d (pid %d) died during the drain: exit %s",
                    worker.index,
                    proc.pid,
                    code,
                )
            return
        log.error("worker %d (pid %d) died: exit %s", worker.index, proc.pid, code)
        if not self.all_ready.is_set():
            self.startup_failed = startup_exit_code(code)
            self.stop.set()
            return
        worker.failures = next_failures(worker.failures, ran_for)
        worker.reload_pending = worker.reload_pending or missed
        while True:
            delay = restart_delay(worker.failures)
            log.info("restarting worker %d in %.1fs", worker.index, delay)
            await asyncio.sleep(delay)
            if self.draining or self.stop.is_set():
                return
            try:
                await self._start_worker(worker)
            except OSError as exc:
                # fork or exec failed (EAGAIN under TasksMax, ENOMEM, EMFILE: what workers die
                # of too): tried again with the backoff, not left one worker short for good
                # without a word (found by review).
                log.error("worker %d could not be started: %s", worker.index, exc)
                worker.failures += 1
                continue
            worker.restarts += 1
            return

    def _signal_all(self, sig: signal.Signals) -> None:
        for worker in self.workers:
            self._signal(worker, sig)

    @staticmethod
    def _signal(worker: Worker, sig: signal.Signals) -> None:
        if worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sig)

    async def _monitor(self) -> None:
        """Kill a ready worker whose event loop stopped pinging (its restart follows)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for worker in self.workers:
                pid = worker.pid
                if pid is not None and worker.ready and now - worker.last_ping > WORKER_WATCHDOG_S:
                    log.error("worker %d (pid %d) stopped answering: killing it", worker.index, pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    # -- notifications from workers ------------------------------------------------------
    def _open_notify_socket(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(str(self.run_dir / NOTIFY_SOCKET))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_notify)

    def _on_notify(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, ancdata, _flags, _addr = self._sock.recvmsg(
                    4096, socket.CMSG_SPACE(_CREDENTIALS.size)
                )
            except (BlockingIOError, InterruptedError):
                return
            pid = None
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _CREDENTIALS.unpack(cdata[: _CREDENTIALS.size])[0]
            worker = next((w for w in self.workers if w.pid is not None and w.pid == pid), None)
            if worker is not None:
                self._worker_says(worker, parse_notification(data))

    def _worker_says(self, worker: Worker, fields: dict[str, str]) -> None:
        worker.last_ping = time.monotonic()
        if "STATUS" in fields:
            worker.status = fields["STATUS"]
        ready = fields.get("READY") == "1"
        if ready and worker.ready and worker.reloading:
            worker.reloading = False
            self._reloaded()
        elif ready and not worker.ready:
            worker.ready = worker.served = True
            log.info("worker %d (pid %s) ready", worker.index, worker.pid)
            if worker.reload_pending:
                worker.reload_pending = False
                worker.reloading = True
                self._signal(worker, signal.SIGHUP)
            if all(w.ready for w in self.workers) and not self.all_ready.is_set():
                self.all_ready.set()
            self.notifier.status(self._status())
        if fields.get("STOPPING") == "1":
            worker.ready = False

    def _status(self) -> str:
        ready = sum(1 for w in self.workers if w.ready)
        return f"{ready}/{len(self.workers)} workers ready"

    # -- signals ----------------------------------------------------------------------------
    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            # A second signal: the workers cut their drains short (their own second SIGINT
            # may be the terminal's, see WORKER_FORCE_SIGNAL).
            self._signal_all(WORKER_FORCE_SIGNAL)
        self.draining = True
        self.stop.set()

    def _on_reload_signal(self) -> None:
        if self.draining:
            log.info("SIGHUP ignored: relay is draining")
            return
        log.info("reload requested: forwarding SIGHUP to the workers")
        # systemd hears of a reload only once it has heard READY=1 and until STOPPING=1: a
        # SIGHUP during start-up is applied, but not announced or waited for (one during a
        # drain is ignored, above).
        announce = self.all_ready.is_set() and not self.stop.is_set()
        if announce:
            self.notifier.reloading()
        self._reload_own_settings()
        for worker in self.workers:
            if worker.ready:
                worker.reloading = True
                self._signal(worker, signal.SIGHUP)
            else:
                # A worker still starting has not installed its handler yet: SIGHUP's default
                # action would kill it. It gets the signal once it says READY; so does one
                # waiting to be restarted, which starts with what its siblings run.
                worker.reload_pending = True
        if not announce:
            return
        if self._reload_wait is not None:
            self._reload_wait.cancel()
        loop = asyncio.get_running_loop()
        self._reload_wait = loop.call_later(RELOAD_WAIT_S, self._reloaded, True)
        self._reloaded()

    def _reloaded(self, timed_out: bool = False) -> None:
        """READY=1 to systemd once no worker is still reloading (RELOADING=1 went at SIGHUP).

        A worker that is not running (it died meanwhile, or waits to be restarted) is not
        waited for: its replacement reloads once it is ready. (Two SIGHUPs in a row may be
        coalesced by a worker into one reload; the first READY=1 then ends the wait for both.)"""
        if self._reload_wait is None:
            return
        stopping = self.stop.is_set()  # STOPPING=1 ends the reload for systemd: no READY=1
        busy = [w for w in self.workers if (w.reloading or w.reload_pending) and w.pid is not None]
        if busy and not (timed_out or stopping):
            return
        self._reload_wait.cancel()
        self._reload_wait = None
        if stopping:
            return
        if busy:
            log.warning(
                "reload: %d worker(s) did not report within %.0fs", len(busy), RELOAD_WAIT_S
            )
        self.notifier.ready(self._status())

    def _reload_own_settings(self) -> None:
        """The one reloadable setting the supervisor uses itself: how long a drain may take
        before stragglers are killed (``process.drain_timeout_s``, reloadable per SPEC §7).
        A file that does not load leaves it unchanged; the workers report why."""
        if self.config.source is None:
            return
        try:
            new = load(self.config.source)
        except Exception as exc:  # whatever the file holds, SIGHUP is still forwarded
            log.warning("reload: process.drain_timeout_s unchanged: %s", exc)
            return
        drain = new.process.drain_timeout_s
        process = dataclasses.replace(self.config.process, drain_timeout_s=drain)
        self.config = dataclasses.replace(self.config, process=process)

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    # -- admin ------------------------------------------------------------------------------
    async def _start_admin(self) -> None:
        app = web.Application()
        admin.add_supervisor_routes(app, self)
        runner = admin.runner(app)
        await runner.setup()
        parsed = split_address(self.config.admin.address)
        assert parsed is not None
        site = web.TCPSite(runner, parsed[0], parsed[1], reuse_address=True)
        with binding("admin.address", parsed[0], parsed[1]):
            await site.start()
        self._admin = runner
        server = site._server
        if server is not None and server.sockets:  # type: ignore[attr-defined]
            name = server.sockets[0].getsockname()  # type: ignore[attr-defined]
            self.admin_bound = (name[0], name[1])

    def live_pids(self) -> set[int]:
        return {w.pid for w in self.workers if w.pid is not None}


def claim_ports(config: Config) -> None:
    """Each data address binds for a listener that does not share its port, and is let go.

    Workers bind with SO_REUSEPORT, which the kernel grants to every socket of the same user
    that asks for it: a port another relay's workers listen on was joined silently, both
    relays serving it with their own configuration and route table, where a single relay
    stops with "Address already in use" (found by review). Bound here without it (SO_REUSEADDR
    as the workers have, which lets no second listener in), the port must be free. Not
    listened on, so no client connects to a socket that closes at once."""
    for address in config.listen.addresses:
        parsed = split_address(address)
        assert parsed is not None  # validated with the config
        host, port = parsed
        with binding("listen.address", host, port):
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _name, sockaddr in infos:
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:  # as asyncio binds it: v6 only
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    probe.bind(sockaddr)


def supervise(config: Config, log_level: str) -> int:
    """Run the supervisor until SIGTERM; the process's exit code."""
    import uvloop  # noqa: PLC0415

    preflight(config)
    return uvloop.run(Supervisor(config, log_level).run())
