"""What workers tell the supervisor over sd_notify, and what it tells systemd; SIGHUP's round.

Workers speak sd_notify to the supervisor's own datagram socket, the sender identified by
``SCM_CREDENTIALS`` (:class:`Notifications`, a base of :class:`relay.workers.Supervisor`):
``READY=1`` (the supervisor's own goes to systemd once every worker has said it), ``STATUS``,
``STOPPING=1``, and any message as a watchdog ping. SIGHUP is forwarded to the ready workers
(one still starting gets it once ready) and announced to systemd as a reload, which ends with
``READY=1`` once every running worker has reloaded, or after :data:`RELOAD_WAIT_S`; the
supervisor itself rereads ``process.drain_timeout_s``. It also pings systemd's watchdog.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import struct
import time
from typing import TYPE_CHECKING

from relay.config_parse import load
from relay.supervision import NOTIFY_SOCKET, parse_notification
from relay.worker_processes import Processes

if TYPE_CHECKING:
    from relay.systemd import Notifier
    from relay.worker_processes import Worker

log = logging.getLogger("relay.workers")

# After a SIGHUP, READY=1 goes to systemd once every worker has reloaded (said READY=1 again),
# or after this long with a warning: a worker's reload is a few file reads, and one that never
# answers is the watchdog's to kill, not a reason to leave the unit "reloading" for ever.
RELOAD_WAIT_S = 30.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Notifications(Processes):
    """The notification half of the supervisor (see the module docstring)."""

    notifier: Notifier
    _sock: socket.socket | None
    _reload_wait: asyncio.TimerHandle | None

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

    # -- SIGHUP ---------------------------------------------------------------------------
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
