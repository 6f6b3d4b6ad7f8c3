"""The supervisor's workers as processes: started, waited for, restarted, signalled, killed.

:class:`Worker` is what the supervisor knows of one worker. :class:`Processes`, the base of
:class:`relay.workers.Supervisor`, starts a worker (``relay serve`` with ``$RELAY_WORKER``,
:func:`relay.supervision.worker_env`), waits for its exit and reaps what it leaves (its
metrics snapshot, its column of the shared in-flight table), restarts it after
:func:`relay.supervision.restart_delay` or, before all were first ready, stops the relay;
sends signals, and kills a ready worker whose event loop stopped pinging for
:data:`WORKER_WATCHDOG_S`. What workers say over sd_notify, and the reload round, are
:mod:`relay.worker_notify`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay import metrics, sharedcount
from relay.supervision import next_failures, restart_delay, startup_exit_code, worker_env

if TYPE_CHECKING:
    from relay.config import Config

log = logging.getLogger("relay.workers")

WORKER_WATCHDOG_S = 30.0  # a ready worker that has not pinged for this long is killed


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


class Processes:
    """The process half of the supervisor (see the module docstring). ``Supervisor`` sets
    these fields in its ``__init__``."""

    config: Config
    log_level: str
    workers: list[Worker]
    run_dir: Path
    inflight: Path | None
    draining: bool
    stop: asyncio.Event
    all_ready: asyncio.Event
    startup_failed: int | None
    drain_failed: bool
    _tasks: set[asyncio.Task[Any]]

    if TYPE_CHECKING:
        # A worker that dies while reloading ends the wait for it: relay.worker_notify's,
        # declared for the type checker only, so no stub sits in the lookup.
        def _reloaded(self, timed_out: bool = False) -> None: ...

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
