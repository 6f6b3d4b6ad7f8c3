"""Pipelined requests, answered in order, and what a client connection does for its exchanges.

A client may send requests without waiting for answers (RFC 9112 §9.3.2); relay answers them in
the order they came. :class:`Pipelining` holds the methods of
:class:`relay.server.ClientConnection` that its exchanges call (:class:`relay.flow.Client`):
writes to the client through the relay's outbox; reading paused and resumed, each pause for a
reason of its own (a dial, a full upstream, a queue, an upgrade, a client that does not read);
and, when the active exchange finishes (``exchange_finished``), the next queued one started, in
a loop rather than by recursion, then a refusal that waited for the earlier answers, then the
close a half-closed client asked for, else the idle wait. A client that does not read relay's
answers is not read either (``_hold_unread``). An upgrade stops llhttp: the connection becomes
a WebSocket splice (``start_splice``) or closes after its answer (``_upgrade_requested``).

Why a base class: as :class:`relay.slices.Slices` (its base), these methods read and write the
fields of the one connection; the slots of the fields only this part sets are declared here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relay.flow import PAUSE_CLIENT_FULL, PAUSE_QUEUE, PAUSE_UPGRADE
from relay.slices import Slices

if TYPE_CHECKING:
    from relay.forward import Exchange
    from relay.websocket import Splice


class Pipelining(Slices):
    """The exchanges' half of a client connection (see the module docstring)."""

    __slots__ = ("_starting", "splice")

    _starting: bool  # exchange_finished is starting queued exchanges
    write_paused: bool  # the client's socket buffer is full (pause_writing)

    def _hold_unread(self) -> None:
        """While the client does not read relay's answers, relay does not read it either,
        unless a request body is on its way upstream (it flows under its upstream's own
        backpressure). What relay would read next can only be more requests, whose answers
        (relay's own, for requests it refuses, need no upstream) would pile up in a buffer
        the client does not drain: a client pipelining refused requests and never reading
        grew relay's memory without bound (found by review). Checked again whenever the
        active exchange changes or its request ends. Not while closing (a lingering close
        reads on) nor for a WebSocket (full duplex, under the upstream's backpressure)."""
        if self.closing or self.splice is not None:
            return
        active = self.active
        if self.write_paused and (active is None or active.request_complete):
            self.pause(PAUSE_CLIENT_FULL)
        else:
            self.resume(PAUSE_CLIENT_FULL)

    # -- flow control -------------------------------------------------------------------------
    def pause(self, reason: int) -> None:
        if not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self.relay.timers.paused(self)  # see check_peer
        self._paused |= reason

    def resume_all(self) -> None:
        self._paused = 0
        self.relay.timers.resumed(self)
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def resume(self, reason: int) -> None:
        if not self._paused & reason:
            return
        self._paused &= ~reason
        if not self._paused:
            if self._rest and not self.closing:
                # A rest put aside while requests queued or the client did not read
                # (relay.slices): fed next turn, before anything read after it.
                self._yield_turn()
                return
            self.relay.timers.resumed(self)
            if self.transport is not None and not self.closing:
                self.transport.resume_reading()

    # -- called by exchanges --------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.relay.outbox.write(self.transport, data)

    def writelines(self, parts: list[bytes]) -> None:
        if self.transport is not None:
            self.relay.outbox.writelines(self.transport, parts)

    def exchange_finished(self, exchange: object, *, keep_alive: bool) -> None:
        """The response of the active exchange is complete; start the next one or idle."""
        if exchange is not self.active:
            return
        self.active = None
        try:
            self._next_exchange(keep_alive)
        finally:
            if self.write_paused and not self._starting:
                self._hold_unread()  # for the exchange that runs now, if any (review)

    def _next_exchange(self, keep_alive: bool) -> None:
        # No parser and no refusal waiting: llhttp stopped at an upgrade. The connection ends
        # here unless that upgrade request is still queued behind this one (RFC 9112 §9.3.2:
        # pipelined requests are answered in order, a WebSocket handshake among them).
        if (
            not keep_alive
            or self.closing
            or (self.parser is None and self._refusal is None and not self.queue)
        ):
            self.close()
            return
        if self._starting:
            return  # finished within start() below: the loop there starts the next one
        if self.queue:
            # A loop, not a call per queued exchange: an exchange relay answers itself
            # finishes inside its own start(), and thousands of pipelined refusals would
            # otherwise nest start → answer → finish → start ... past the recursion limit.
            self._starting = True
            try:
                while self.queue and self.active is None and not self.closing:
                    self.active = self.queue.popleft()
                    if not self.queue:
                        self.resume(PAUSE_QUEUE)
                    self.active.start()
            finally:
                self._starting = False
            if self.active is not None or self.closing:
                return
        if self._refusal is not None:
            # every earlier request is answered: now the refusal
            self.refuse(self._refusal, head=self._refused_head)
            return
        if self.client_eof:
            self.close()  # every request the client sent before its FIN is answered
            return
        self.resume(PAUSE_QUEUE)
        if not self._in_head and not self.write_paused:
            # Not while relay itself does not read the client (_hold_unread): it may have
            # requests waiting unread; the wait starts once it drained (resume_writing).
            self.relay.timers.expect_idle(self)

    def start_splice(self, splice: Splice) -> None:
        self.splice = splice
        self.active = None
        self.relay.timers.forget(self)

    # -- internals ------------------------------------------------------------------------
    def _upgrading(self) -> Exchange | None:
        """The exchange of the upgrade request llhttp stopped at: the last one read (nothing
        is parsed after it), queued behind earlier ones or running."""
        return self.queue[-1] if self.queue else self.active

    def _upgrade_requested(self, tail: bytes) -> None:
        """llhttp stopped at an upgrade (WebSocket handshake, CONNECT, h2c...).

        The parser cannot go on, so the connection either becomes a WebSocket splice or
        closes after the answer; bytes already sent after the handshake wait for the splice.
        """
        exchange = self._upgrading()
        if exchange is None or exchange.answered():
            if exchange is None:
                self.close()
            self.closing = True
            return
        self.pause(PAUSE_UPGRADE)
        exchange.client_tail(tail)
