"""Dense client reads: a turn of the event loop for the others, and then reads in slices.

llhttp calls Python once per request head and once per body piece. A chunked body of 1-byte
chunks is ~43,000 pieces per 256 KiB read, and libuv reads a socket that fills its buffer up
to 32 times in a row before it polls the others: one client uploading such a body held the
loop for 0.6-7 s at a time, every other client waiting (measured on loopback; README,
"Decisions"). Two measures bound it:

- **A turn for the others.** A read from which llhttp delivered more than
  :data:`~relay.flow.YIELD_EVENTS` heads and body pieces pauses the client until the loop's
  next turn (:meth:`Slices._yield_turn`); from then on the connection is *sliced*.
- **Slices.** A sliced connection's reads over :data:`~relay.flow.FLOOD_SLICE` bytes are fed
  to llhttp a slice at a time, each twice the last up to :data:`~relay.flow.FLOOD_SLICE_MAX`;
  after a dense slice the rest of the read waits for the next turn (:attr:`Slices._rest`),
  the client unread meanwhile. So is a read over FLOOD_SLICE bytes that begins as a flood
  does (:func:`relay.flow.flood_ahead`), before any dense read. An ordinary connection, whose
  reads are a few pieces each, is never sliced and pays ~5-10 µs per large read for that test;
  a sliced one stays sliced (a flood need not start a message).

What the slices change must be invisible: the rest of a read is fed before any later read
(``data_received`` appends to it: the TLS hand-over feeds its early reads in a row), an
upgrade within a slice takes the rest of the read as the bytes after its handshake, a refusal
or an upgrade in a slice drops or keeps the rest as it would a whole read's, and the client's
FIN is taken only after the rest (:meth:`Slices.eof_received`). ``tests/test_request_slices.py``
compares slicing with feeding whole reads.

Why a base class: as :class:`relay.bodies.RequestBodies` (its base), these methods read and
write the fields of the one connection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.bodies import RequestBodies
from relay.flow import (
    FLOOD_SLICE,
    FLOOD_SLICE_MAX,
    PAUSE_CLIENT_FULL,
    PAUSE_QUEUE,
    PAUSE_YIELD,
    slice_bounds,
)

if TYPE_CHECKING:
    from relay.websocket import Splice


class Slices(RequestBodies):
    """The dense-read half of a client connection (see the module docstring)."""

    __slots__ = ("_again", "_dense", "_feeding_rest", "_rest", "_sliced", "_slicing", "_yielding")

    _rest: bytes  # the rest of a sliced read, fed in the loop's next turn
    _sliced: bool  # a read of this connection was dense: its large reads are sliced
    _slicing: tuple[bytes, int] | None  # the read being sliced, and where the slice fed ends
    _dense: bool  # the slice just fed was dense
    _yielding: bool  # the client is paused until _yielded runs
    _feeding_rest: bool  # _yielded is running
    _again: bool  # it was called again meanwhile: another rest to feed
    _paused: int  # ClientConnection's: the reasons it is not read (relay.flow)
    splice: Splice | None  # Pipelining's (relay.pipelining)

    @property
    def unparsed(self) -> bool:
        """A rest of a read waits for the loop's next turn."""
        return bool(self._rest)

    def pause(self, reason: int) -> None:
        raise NotImplementedError  # Pipelining's (relay.pipelining)

    def resume(self, reason: int) -> None:
        raise NotImplementedError  # Pipelining's (relay.pipelining)

    def _dense_read(self) -> None:
        """llhttp delivered more than YIELD_EVENTS heads and pieces from the read just fed."""
        self._sliced = True
        if self._slicing is not None:
            self._dense = True  # _slices yields once it has put the rest aside
        else:
            self._yield_turn()

    def _slices(self, data: bytes) -> None:
        """Feed a read of a sliced connection a slice at a time (the module docstring)."""
        size = len(data)
        for start, end in slice_bounds(size, FLOOD_SLICE, FLOOD_SLICE_MAX):
            self._slicing = (data, end)
            self._dense = False
            try:
                self.data_received(data[start:end])
            finally:
                self._slicing = None
            if end >= size:
                break
            if self.parser is None or self.closing or self.splice is not None:
                # Refused, closing, or upgraded (whose tail took the rest, _upgrade_tail):
                # llhttp would not have read the rest of a whole read either.
                return
            if self._paused & (PAUSE_QUEUE | PAUSE_CLIENT_FULL):
                # Requests wait behind the active exchange, or the client does not read
                # relay's answers: the rest waits, unparsed, until that is over (resume). Fed
                # on, a read of pipelined heads became thousands of queued exchanges or of
                # relay's own answers in a buffer the client does not drain (found by review:
                # ~2.5 MB per connection for 128 KiB of 45-byte requests).
                self._rest = data[end:]
                return
            if self._dense:
                # Before the Content-Length case below, which would feed the rest now (found by
                # review: dense slices each ending in a short body were one read's work).
                self._rest = data[end:]  # before _yield_turn: an unbound outbox runs it now
                self._yield_turn()
                return
            if self._body_left:
                # A Content-Length body from here on: passed as read, without llhttp.
                self.data_received(data[end:])
                return
        if self._dense:
            self._yield_turn()

    def _upgrade_tail(self) -> bytes:
        """The rest of the read being sliced, for an upgrade in its current slice: the bytes
        after a handshake are the WebSocket's, whichever slice the handshake ended in."""
        slicing = self._slicing
        if slicing is None:
            return b""
        data, end = slicing
        self._slicing = (data, len(data))
        return data[end:]

    def _yield_turn(self) -> None:
        """Pause the client until the loop's next turn, then feed what was put aside."""
        if self._yielding or self.closing:
            return
        self._yielding = True
        self.pause(PAUSE_YIELD)
        self.relay.outbox.later(self._yielded)

    def _yielded(self) -> None:
        if self._feeding_rest:
            # Called from within itself: an unbound outbox (tests, a stopping relay) runs
            # later() at once. The loop below feeds the next rest, without nesting deeper
            # (found by review: a 2 MiB read of tiny chunks reached the recursion limit).
            self._again = True
            return
        self._feeding_rest = True
        try:
            self._again = True
            while self._again:
                self._again = self._yielding = False
                rest, self._rest = self._rest, b""
                if rest and not self.closing:
                    self.data_received(rest)  # may put a rest aside and yield again
        except Exception as exc:  # what data_received does with a callback's exception
            self._rest = b""
            self.internal_error(exc)
        finally:
            self._feeding_rest = False
            if not self._yielding:
                self.resume(PAUSE_YIELD)  # never left paused (found by review)

    def eof_received(self) -> bool:
        # The client's FIN comes after the bytes it sent before it: what is put aside is fed
        # first, now (the TLS hand-over reports an early FIN right after its early reads).
        while self._rest and not self.closing:
            rest, self._rest = self._rest, b""
            self.data_received(rest)
        self._rest = b""
        return super().eof_received()
