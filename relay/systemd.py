"""sd_notify(3) without libsystemd: readiness, stopping, reload, status and watchdog pings.

The protocol is one datagram per notification on the ``AF_UNIX`` socket named by
``$NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``), holding
newline-separated ``KEY=VALUE`` assignments (``READY=1``, ``STOPPING=1``, ``STATUS=…``,
``WATCHDOG=1``, ``RELOADING=1`` with ``MONOTONIC_USEC=…``). With ``NotifyAccess=main`` only
the main process may send, so a supervisor forwards its workers' readiness itself
(``relay.workers`` gives each worker a notify socket of its own, speaking this same protocol).

``$WATCHDOG_USEC`` is set when the unit has ``WatchdogSec=``; sd_watchdog_enabled(3) says to
ping at half of it and to ignore it when ``$WATCHDOG_PID`` names another process.

A notification is best effort: a full or missing socket is logged at debug level and
otherwise ignored, as libsystemd does; relay never blocks on systemd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("relay.systemd")


def notify_address(env: Mapping[str, str]) -> str | None:
    """The socket address to send to: a path, or an abstract name starting with NUL."""
    raw = env.get("NOTIFY_SOCKET", "")
    if not raw:
        return None
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # sd_notify(3) accepts only absolute paths and abstract names


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half the timeout), or None when not enabled."""
    raw = env.get("WATCHDOG_USEC", "")
    if not raw.isdigit() or int(raw) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(raw) / 2_000_000


def message(**fields: str | int) -> bytes:
    """``KEY=VALUE`` lines; a newline inside a value would start a new assignment."""
    lines = []
    for key, value in fields.items():
        text = str(value).replace("\n", " ")
        lines.append(f"{key}={text}")
    return "\n".join(lines).encode()


class Notifier:
    """Sends notifications to ``$NOTIFY_SOCKET``; every method is a no-op without one."""

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if env is None else env
        self.address = notify_address(env)
        self.watchdog_s = watchdog_interval_s(env, os.getpid() if pid is None else pid)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        if self.address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        try:
            self._sock.sendto(message(**fields), self.address)
        except OSError as exc:
            log.debug("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        if status:
            return self.send(READY=1, STATUS=status)
        return self.send(READY=1)

    def reloading(self) -> bool:
        # systemd >= 253 wants the monotonic time with RELOADING=1 (sd_notify(3)).
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING=1, MONOTONIC_USEC=now_us)

    def stopping(self, status: str = "") -> bool:
        if status:
            return self.send(STOPPING=1, STATUS=status)
        return self.send(STOPPING=1)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# -- signals before and after the event loop's handlers ----------------------------------------
# Held from relay serve's first line until the event loop's handlers take them.
HELD = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
_held: list[int] = []
_holding = False  # this process is relay serve's own, held from its first line


def hold_signals() -> None:
    """Remember SIGINT, SIGHUP and SIGTERM until the event loop's handlers are in place
    (``held``).

    Their default actions end the process: a ``systemctl reload`` or a logrotate hook in the
    first ~0.3 s of a start (module imports, ``Relay.start``) killed relay, with one worker or
    several, and systemd counts death by SIGHUP as a clean exit (found by review). A Ctrl-C
    there raised KeyboardInterrupt wherever the start was: a traceback and exit -2, not a
    stop's 0 (found by review). Called first thing by ``relay serve``, in the supervisor and
    in each worker alike.
    """
    global _holding  # noqa: PLW0603 - once per process, before anything else runs
    for sig in HELD:
        signal.signal(sig, _remember)
    _holding = True


def _remember(signum: int, _frame: object) -> None:
    _held.append(signum)


def held() -> list[int]:
    """The signals that came while held, in order, once; the loop's handlers now take them."""
    out = _held[:]
    _held.clear()
    return out


def release_signals() -> None:
    """Not serving after all (``main`` was given another command than argv named): the default
    actions again, and what came meanwhile delivered under them (found by review)."""
    global _holding  # noqa: PLW0603 - the hold ends for this process
    if not _holding:
        return
    _holding = False
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: KeyboardInterrupt
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for early in held():
        signal.raise_signal(early)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Every signal blocked in the calling thread for the block's length: a thread started in
    it inherits that mask and keeps it, so that signals stay the main thread's alone (see
    start_loop_threads; relay.accesswriter starts its writer threads in it too)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


async def start_loop_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Start libuv's threadpool now, with every signal blocked, which its threads keep (they
    inherit the mask of the thread that starts them): signals are then the main thread's
    alone, as relay.accesswriter makes them for its writer threads.

    uvloop starts the pool's 4 threads at the first ``create_server`` or ``getaddrinfo``, in
    every relay serve (the supervisor's too), with the main thread's mask: empty. While
    :func:`end_loop_handlers` blocks SIGTERM, SIGINT and SIGHUP in the main thread, the
    kernel gave one to a pool thread instead, where SIGTERM's default action ended relay as
    it exited (-15) and SIGINT raised KeyboardInterrupt in the main thread. Found by review:
    SIGTERM sent without pause to a loop of end_loop_handlers ended it at once with the pool
    started, never without it. First thing in relay serve's loop, before anything can start
    the pool; a signal meanwhile (well under 1 ms) waits, then goes to the main thread.

    The loop's default executor's threads (``asyncio.to_thread``: relay.netlink's, at start
    and at each reload with ``upstream.source_address``) are started later, one by one, so
    each blocks every signal itself as it starts.
    """
    with signals_blocked():
        await loop.getaddrinfo("127.0.0.1", 0)  # through the pool, which starts whole
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio", initializer=_deaf))


def _deaf() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())


def end_loop_handlers(
    loop: asyncio.AbstractEventLoop, sigs: tuple[signal.Signals, ...], *, ignore: bool
) -> None:
    """Take the event loop's handlers off ``sigs`` as relay ends, its drain over.

    ``ignore`` (a worker): each is ignored from then on. The supervisor's force signal for a
    second SIGTERM (or the terminal's next Ctrl-C) has nothing left to cut; their default
    actions killed the worker (SIGUSR1: exit -10), and the supervisor, seeing a worker die
    in the drain, exited 1 (found by review). In relay serve's own process (signals held
    from its first line) the held ones are ignored too: ``remove_signal_handler`` gives
    SIGINT back to Python's KeyboardInterrupt and SIGTERM and SIGHUP to their default
    actions, and a Ctrl-C in the last ~20 ms of a lone relay's or a supervisor's exit printed
    a traceback from the loop's close and exited -2 (found by review). Ignored, not held:
    Python puts the default actions back on the signals it handles as it finalizes.
    Blocked meanwhile: one arriving between the removal and SIG_IGN still took its default
    action (found when a fresh run's test hit that window); a blocked one pending at SIG_IGN
    is discarded. A relay run inside another program (a test) leaves its handlers alone.
    """
    quiet = {sig for sig in sigs if ignore or (_holding and sig in HELD)}
    if quiet:
        signal.pthread_sigmask(signal.SIG_BLOCK, quiet)
    try:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            if sig in quiet:
                signal.signal(sig, signal.SIG_IGN)
    finally:
        if quiet:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, quiet)
