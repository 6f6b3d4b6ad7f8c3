"""Under load, small writes gathered over one turn of the event loop and sent at its end.

Why: at saturation one turn of relay's loop serves many sockets (~25 requests per
``epoll_pwait`` at 40k req/s). Written one by one as each callback produced them, the small
writes woke the processes on the other core again and again: 0.25-0.3 wake-up interrupts
(IPIs, each a VM exit on these hosts) per request against nginx's 0.02-0.07, and 20-25% idle
time on the load's core. Sent together once the turn's callbacks are done, they wake it about
once per turn: 0.06 IPIs per request, CPU per small GET 23.9 → 22.7 µs (system time
13.3 → 10.5 µs; nginx's: 11.0), ~6% more requests per second (bench/README.md, "Writes per
turn").

Only under load: a write that is held waits for the rest of the turn and one more pass of
the loop, which on a quiet relay is pure latency (a stream event one at a time: +19 µs at
p50, +94 µs at p99 in `make bench` when every write was held). So a turn holds writes only
when the turn before it had :data:`BUSY` writes or more; a quiet loop writes at once, as
before.

The rules that keep the deferral invisible to the HTTP exchanges:

* Writes keep their order: one FIFO for all transports, and a write that is not held (a
  large one) first sends everything held before it.
* Large writes (a bulk body's 256 KiB reads) go out at once: a transfer's flow control
  (``pause_writing`` at the transport's high-water mark) works as before, and the bytes held
  are bounded by :data:`MAX_HELD`.
* Whoever closes, aborts or half-closes a connection flushes first
  (``ClientConnection``/``UpstreamConnection``), so bytes written before a close go out
  before it, as they did when every write went straight to the transport.
* Unbound (no running loop: unit tests of the protocols) every write goes straight through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

SMALL = 16 * 1024  # larger writes are not held
MAX_HELD = 256 * 1024  # more than this held in one turn: sent at once
BUSY = 4  # writes in one turn from which the next turn holds its small writes


class Writable(Protocol):
    def write(self, data: bytes) -> None: ...
    def writelines(self, parts: list[bytes]) -> None: ...
    def is_closing(self) -> bool: ...


class Outbox:
    """One per event loop (``Relay.outbox``): :meth:`bind` it to ``loop.call_soon``."""

    __slots__ = ("_busy", "_held", "_holding", "_items", "_schedule", "_scheduled", "_writes")

    def __init__(self) -> None:
        self._items: list[tuple[Writable, bytes | list[bytes]]] = []
        self._held = 0  # bytes held
        self._writes = 0  # writes in this turn, held or not
        self._holding = False  # the last turn was busy: hold small writes in this one
        self._scheduled = False
        self._schedule: Callable[[Callable[[], None]], object] | None = None
        self._busy = BUSY

    def bind(self, schedule: Callable[[Callable[[], None]], object], *, busy: int = BUSY) -> None:
        """Count writes per turn, and hold small ones under load, until ``schedule``'s
        callback runs (``loop.call_soon``: after the I/O callbacks of the current turn).
        ``busy=0`` holds every small write (tests and the fuzz harness)."""
        self._schedule = schedule
        self._busy = busy
        self._holding = busy <= 0

    def later(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the loop's next pass (``loop.call_soon`` as bound); unbound,
        at once."""
        if self._schedule is None:
            callback()
        else:
            self._schedule(callback)

    def unbind(self) -> None:
        self.flush()
        self._schedule = None
        self._scheduled = False
        self._holding = False

    @property
    def holding(self) -> bool:
        return self._holding

    def write(self, transport: Writable, data: bytes) -> None:
        if self._holding and len(data) <= SMALL:
            self._hold(transport, data, len(data))
            return
        if self._items:
            self.flush()
        transport.write(data)
        # _count(), inline: this is every quiet write's path (a stream event's, after 1 ms
        # idle, pays ~1 µs per Python call; bench/README.md, "An eleventh host").
        self._writes += 1
        if not self._scheduled and self._schedule is not None:
            self._scheduled = True
            self._schedule(self.end_turn)

    def writelines(self, transport: Writable, parts: list[bytes]) -> None:
        if self._holding:
            size = sum(map(len, parts))
            if size <= SMALL:
                self._hold(transport, parts, size)
                return
        if self._items:
            self.flush()
        transport.writelines(parts)
        self._count()

    def _count(self) -> None:
        # After the write: on a quiet loop nothing but the write itself is on its latency.
        self._writes += 1
        if not self._scheduled and self._schedule is not None:
            self._scheduled = True
            self._schedule(self.end_turn)

    def _hold(self, transport: Writable, data: bytes | list[bytes], size: int) -> None:
        self._items.append((transport, data))
        self._held += size
        self._count()
        if self._held > MAX_HELD:
            self.flush()

    def end_turn(self) -> None:
        """The loop's turn is over: the callback given to ``schedule``. Code that drives
        relay's protocols without a loop (``bench.micro``, the fuzz harness) binds a no-op
        ``schedule`` and calls this itself after each callback."""
        self._scheduled = False
        self._holding = self._writes >= self._busy
        self._writes = 0
        self.flush()

    def flush(self) -> None:
        """Send everything held, in order. A transport already closing gets nothing: it was
        aborted (its buffer is discarded too) or closed by its peer."""
        items = self._items
        if not items:
            return
        self._items = []
        self._held = 0
        for transport, data in items:
            if transport.is_closing():
                continue
            if isinstance(data, list):
                transport.writelines(data)
            else:
                transport.write(data)
