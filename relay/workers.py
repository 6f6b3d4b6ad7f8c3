"""``process.workers > 1``: a supervisor and that many worker processes (SPEC §6).

Each worker is a full ``relay serve`` started with ``$RELAY_WORKER`` set: it binds the data
listeners itself with ``SO_REUSEPORT`` (the kernel spreads new connections over the workers'
sockets), runs its own route feed, and drains on SIGTERM like a single relay. Workers are
spawned (a fresh interpreter each), not forked from a process that already runs an event loop.

The supervisor owns what there must be one of:

- **systemd**: it is the main process (``NotifyAccess=main``). Workers speak sd_notify to the
  supervisor's own datagram socket (sender identified by ``SCM_CREDENTIALS``); ``READY=1``
  goes to systemd once every worker has said ``READY=1``. Workers also ping a watchdog there;
  a worker silent for :data:`relay.worker_processes.WORKER_WATCHDOG_S` is killed and restarted.
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

This module has the supervisor's run from start to exit (the run directory, the ports
claimed, the admin app, the stop signals and the drain) and its entry point,
:func:`supervise`. :class:`Supervisor` gets the rest from two bases:
:mod:`relay.worker_notify` (sd_notify from the workers and to systemd, SIGHUP's reload round)
and below it :mod:`relay.worker_processes` (starting, reaping, restarting, signalling and
killing workers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from relay import admin, sharedcount, systemd
from relay.addresses import split_address
from relay.config import Config
from relay.lifecycle import WORKER_FORCE_SIGNAL, admin_socket
from relay.startup import binding
from relay.supervision import NOTIFY_SOCKET, preflight
from relay.systemd import Notifier
from relay.worker_notify import Notifications
from relay.worker_processes import Worker

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


KILL_GRACE_S = 5.0  # after drain_timeout_s, before stragglers get SIGKILL


class Supervisor(Notifications):
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
        await systemd.start_loop_threads(asyncio.get_running_loop())  # first: it says why
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

    # -- signals ----------------------------------------------------------------------------
    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            # A second signal: the workers cut their drains short (their own second SIGINT
            # may be the terminal's, see WORKER_FORCE_SIGNAL).
            self._signal_all(WORKER_FORCE_SIGNAL)
        self.draining = True
        self.stop.set()

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
