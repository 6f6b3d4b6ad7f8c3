"""One relay process from start to exit: start → ready → (SIGHUP reloads) → SIGTERM → drain.

The same sequence runs in a single-process relay and in each worker of a supervisor
(``relay.workers``); a worker only differs in where it reports to:

- sd_notify: ``READY=1`` once the data listeners accept and the route table is ready
  (``/readyz`` would answer 200), ``RELOADING=1``/``READY=1`` around a SIGHUP,
  ``STOPPING=1`` when the drain starts, ``STATUS=`` lines, and ``WATCHDOG=1`` at half of
  ``$WATCHDOG_USEC``. A worker's ``$NOTIFY_SOCKET`` is its supervisor's, not systemd's.
- admin: a worker serves its admin app on a Unix socket in the supervisor's run directory
  (the supervisor owns ``admin.address``) and writes its metrics snapshot there every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay import metric_snapshot, metrics, systemd
from relay.drain import drain
from relay.startup import check_open_files
from relay.systemd import Notifier
from relay.worker_config import Saved, load_saved, save

if TYPE_CHECKING:
    from relay.runtime import Relay

log = logging.getLogger("relay")

WORKER_ENV = "RELAY_WORKER"  # the worker's index, set by the supervisor
# The supervisor's "cut the drain short" to its workers. Not a second SIGINT or SIGTERM: a
# terminal's Ctrl-C reaches the whole process group, so a worker already drains on the
# terminal's SIGINT when the supervisor's SIGTERM arrives, and took that for a second signal
# (found by review: one Ctrl-C ended every stream at once).
WORKER_FORCE_SIGNAL = signal.SIGUSR1
RUN_DIR_ENV = "RELAY_RUN_DIR"  # the supervisor's private directory
SUPERVISOR_ENV = "RELAY_SUPERVISOR"  # the supervisor's pid
SUPERVISOR_CHECK_S = 1.0
SNAPSHOT_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    index: int
    run_dir: Path
    supervisor: int | None = None  # its pid; None when not told (then not watched)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv | None:
        index, run_dir = env.get(WORKER_ENV, ""), env.get(RUN_DIR_ENV, "")
        if not index.isdigit() or not run_dir:
            return None
        supervisor = env.get(SUPERVISOR_ENV, "")
        return cls(int(index), Path(run_dir), int(supervisor) if supervisor.isdigit() else None)

    @property
    def admin_socket(self) -> Path:
        return admin_socket(self.run_dir, self.index)

    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / "metrics"


def admin_socket(run_dir: Path, index: int) -> Path:
    return run_dir / f"worker-{index}.sock"


def effective_config(env: Mapping[str, str], config_file: str) -> Saved | None:
    """In a worker its supervisor restarted: what its siblings run (``relay.worker_config``).
    None in a single relay, and in a worker started before any sibling saved."""
    worker = WorkerEnv.from_env(env)
    return None if worker is None else load_saved(worker.run_dir, config_file)


def _save(run_dir: Path, relay: Relay) -> None:
    save(run_dir, relay.config, relay.tls.pem if relay.tls is not None else None)


def status_line(relay: Relay) -> str:
    if relay.draining:
        return f"draining: {len(relay.connections)} connection(s) open"
    feed = relay.feed_state
    state = "stale routes" if feed.stale else "ready" if feed.ready else "waiting for routes"
    websockets = sum(1 for c in relay.connections if c.splice is not None)
    return (
        f"{state}: {len(relay.table)} route(s), {len(relay.connections)} connection(s), "
        f"{websockets} WebSocket(s)"
    )


class Lifecycle:
    def __init__(self, relay: Relay, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.relay = relay
        self.notifier = Notifier(env)
        self.worker = WorkerEnv.from_env(env)
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.announced = False  # READY=1 was sent: later reloads say RELOADING=1, then READY=1

    async def run(self) -> None:
        relay = self.relay
        if self.worker is not None:
            relay.admin_socket = str(self.worker.admin_socket)
            self.worker.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.notifier.status("starting")
        await relay.start()
        check_open_files(relay.config.listen.max_connections)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_stop_signal)
        loop.add_signal_handler(signal.SIGINT, self.on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self.on_reload_signal)
        if self.worker is not None:
            loop.add_signal_handler(WORKER_FORCE_SIGNAL, self.on_force_signal)
        for sig in systemd.held():  # what came before the handlers (relay.systemd.hold_signals)
            loop.call_soon(self.on_reload_signal if sig == signal.SIGHUP else self.on_stop_signal)
        self._spawn(self._announce())
        if self.notifier.watchdog_s:
            self._spawn(self._watchdog(self.notifier.watchdog_s))
        if self.worker is not None:
            self._spawn(self._snapshots(self.worker.metrics_dir))
            if self.worker.supervisor is not None:
                self._spawn(self._watch_supervisor(self.worker.supervisor))
        if self.worker is not None:
            _save(self.worker.run_dir, relay)
        try:
            await self.stop.wait()
        finally:
            # The handlers stay until the drain is over: a second SIGTERM or SIGINT cuts it
            # short, and a SIGHUP (`systemctl reload`, a logrotate hook during a stop) is
            # ignored. Without them SIGHUP's and SIGINT's default actions killed relay in the
            # middle of its drain (found by review).
            try:
                await self._shutdown()
            finally:
                sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, WORKER_FORCE_SIGNAL)
                systemd.end_loop_handlers(loop, sigs, ignore=self.worker is not None)

    def on_stop_signal(self) -> None:
        # A second signal cuts the drain short; in a worker only the supervisor's says so.
        if self.stop.is_set() and self.worker is None:
            self.force.set()
        self.stop.set()

    def on_force_signal(self) -> None:
        self.force.set()
        self.stop.set()

    def on_reload_signal(self) -> None:
        if self.stop.is_set():
            log.info("SIGHUP ignored: relay is draining")
            return
        # Before the first READY=1 (the route table not ready yet) a reload is applied but not
        # announced: its READY=1 told systemd relay was up while /readyz was 503 (SPEC §7;
        # found by review). The supervisor does the same for its workers.
        announced = self.announced
        if announced:
            self.notifier.reloading()
        try:
            self.relay.reload()
            if self.worker is not None:
                _save(self.worker.run_dir, self.relay)
        finally:
            if announced:
                self.notifier.ready(status_line(self.relay))

    async def _shutdown(self) -> None:
        relay = self.relay
        timeout = relay.config.process.drain_timeout_s
        log.info("draining: up to %gs for %d connection(s)", timeout, len(relay.connections))
        self.notifier.stopping(f"draining: {len(relay.connections)} connection(s) open")
        try:
            ended = await drain(relay, timeout, force=self.force, report=self.notifier.status)
            if ended:
                log.info("drain timeout: ended %d exchange(s) and WebSocket(s)", ended)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            try:
                await relay.stop()
            finally:
                # After the stop: its access-log lines dropped at exit count too.
                if self.worker is not None:
                    with contextlib.suppress(OSError):
                        metrics.write_snapshot(
                            self.worker.metrics_dir, metric_snapshot.snapshot(relay)
                        )
            self.notifier.status("stopped")
            self.notifier.close()
            log.info("stopped")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def _announce(self) -> None:
        """READY=1 once the table is ready (listeners are bound by then), then STATUS=."""
        relay = self.relay
        while not relay.ready():
            if relay.draining:
                return
            await asyncio.sleep(0.05)
        line = status_line(relay)
        self.announced = True
        self.notifier.ready(line)
        log.info("ready: %s", line)
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            new = status_line(relay)
            if new != line:
                self.notifier.status(new)
                line = new

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    async def _watch_supervisor(self, pid: int) -> None:
        """Drain as on SIGTERM once the supervisor is gone (its child no more: reparented).

        A supervisor killed outright (SIGKILL, the OOM killer, a crash) left its workers
        serving as orphans: the data port held through SO_REUSEPORT with that start's
        configuration, no admin port, no restarts, no signal forwarded, and a relay started
        again on the port shared its connections with them for good (found by review).
        gunicorn's workers watch their parent the same way. A poll, not PR_SET_PDEATHSIG,
        which a worker sets only after its start, when the supervisor may be gone already."""
        while True:
            await asyncio.sleep(SUPERVISOR_CHECK_S)
            if os.getppid() != pid:
                break
        log.error("the supervisor (pid %d) is gone: draining", pid)
        self.on_stop_signal()

    async def _snapshots(self, directory: Path) -> None:
        while True:
            try:
                metrics.write_snapshot(directory, metric_snapshot.snapshot(self.relay))
            except OSError as exc:
                log.warning("cannot write the metrics snapshot: %s", exc)
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
