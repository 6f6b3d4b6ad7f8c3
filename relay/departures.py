"""How relay learns that a client left: its FIN, or a reset while relay was not reading it.

:class:`Departures` takes the client's half-close as it is read (``eof_received``: the
connection ends once the running answer is written; a stream ends at once, README
"Half-closed clients wait"), and asks the kernel about a client relay has not read for a while
(``check_peer``, from ``relay.timers``): a reset or a hang-up ends the connection, a FIN ends a
stream, and a WebSocket client's frames still unread are passed on while its upstream takes
some. It is the top of the bases :class:`relay.server.ClientConnection` gets its ending from,
above :class:`relay.refusals.Refusals` and :class:`relay.closing.Closing`.
"""

from __future__ import annotations

import select
import termios

from relay.closing import ioctl_count, unsent
from relay.core.model import Reason, Reject
from relay.refusals import Refusals

# A WebSocket client gone (its FIN) with frames relay has not read yet, held back by a slow
# upstream: how long the upstream may take none of them before the splice ends anyway.
SPLICE_FIN_WAIT_S = 30.0


class Departures(Refusals):
    """The half of a client connection that notices the client's departure (see the module
    docstring)."""

    __slots__ = ()

    def eof_received(self) -> bool:
        # A client half-close ends the connection once the running response is written;
        # HTTP/1.1 gives a half-closed client no way to send another request.
        # Over TLS asyncio closes the connection at EOF whatever this returns (a half-closed
        # TLS stream cannot carry the rest of a response), so only plain TCP keeps it.
        self.relay.outbox.flush()  # uvloop closes the transport on False: held bytes first
        self._mid_message = False  # the client sends nothing more: no lingering needed
        if self.receiving is not None and not self.closing:
            # RFC 9112 §6.3/§8: a request body cut short by the client's FIN can never be
            # completed; the upstream would wait for the rest for ever.
            self._unparseable(
                Reject(
                    reason=Reason.BAD_REQUEST,
                    detail="Incomplete request body: the client closed its side",
                )
            )
        transport = self.transport
        if self.active is None or self.tls or transport is None or transport.is_closing():
            return False
        if self._lingering:
            return False  # the answer went out before the linger began
        self.client_eof = True
        # Requests already read are still answered, in order (a client may send its last
        # pipelined requests and half-close); then the connection closes. Not a stream
        # (chunked, no end in sight): it is not waited out for a client that has most likely
        # gone. TCP does not tell a close from a half-close, and the stream would hold its
        # upstream until an event's write found the client gone (envd pings a quiet watch
        # every 50 s). The JS SDK over plain HTTP, and a front proxy whose client left, end a
        # stream with a FIN; Go's server and nginx take it as an abort too (README,
        # "Half-closed clients wait"; found by review).
        if self.active.streaming():
            self.active.end_at_fin()  # a reset for an HTTP/1.0 client's (found by review)
            return False
        return True

    def drop_after_fin(self) -> None:
        """The client's FIN ended its stream (relay.respond, end_at_fin): every exchange ends
        now (client_closed), its upstream closed and its in-flight slot freed; the connection
        closes once what relay wrote is flushed, within the close's deadlines. Not at the
        close's end: a client that does not read never takes the rest, and the upstream was
        held until CLOSE_STALL_S (found by review)."""
        self._mid_message = False  # the client sends nothing more: no lingering needed
        self._end_exchanges()
        self.close()

    def check_peer(self) -> None:
        """relay has not read this client for ``PEER_CHECK_S`` (relay.timers): did it reset?

        A paused transport's socket is not watched by the event loop, so a client that gave
        up (a reset, or both directions shut) while its upstream stalled would hold both
        connections for as long as the upstream does. The kernel knows: a zero-timeout
        ``poll`` reports POLLERR or POLLHUP, which are always reported whatever the events
        asked. A FIN alone (POLLRDHUP) is not a departure: a client may half-close once its
        request is sent and still read the answer (eof_received); except during a stream,
        which a FIN ends whether relay reads the client or not (_fin_while_paused).
        """
        transport = self.transport
        if not self._paused or self.closing or transport is None or transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            poller = select.poll()
            # A WebSocket's client that half-closed has left too: relay ends a splice at the
            # client's FIN when it reads it (eof_received), but a paused one's FIN went unseen
            # and held the splice, its descriptors and its in-flight count for as long as the
            # upstream stayed silent (found by review). An HTTP client may half-close and
            # still read its answer: only a reset or a hang-up ends it, or a FIN during a
            # stream (eof_received; found by review: a stream with a pipelined request queued
            # behind it, the client paused, held its upstream after the client's FIN).
            poller.register(sock.fileno(), select.POLLRDHUP)
            events = poller.poll(0)
            revents = events[0][1] if events else 0
            if revents & (select.POLLERR | select.POLLHUP) or (
                revents
                and self.splice is not None
                and not self._frames_to_pass(revents, sock.fileno())
            ):
                self.abort()  # connection_lost follows: the exchange and its upstream end
                return
            if revents and self.splice is None and self._fin_while_paused(sock.fileno()):
                return
        self.relay.timers.paused(self)

    def _fin_while_paused(self, fd: int) -> bool:
        """The paused HTTP client sent its FIN (POLLRDHUP), which relay has not read: during a
        stream it ends the exchange now, as eof_received does (README, "Half-closed clients
        wait"); true when it did. Otherwise the half-close keeps its meaning: when nothing the
        client sent is left unread (the FIN is all that remains), the client is marked
        half-closed, so a response that turns out a stream is ended at its head, as for a
        FIN that was read; its requests are answered, and eof_received reads the FIN later."""
        active = self.active
        if active is not None and active.streaming():
            self.client_eof = True
            active.end_at_fin()
            return True
        # (Not over TLS: its EOF ends the connection anyway, and the socket's unread bytes
        # are records; nor with a sliced read's rest still to feed, relay.slices.)
        if not self.tls and not self._rest and not ioctl_count(fd, termios.FIONREAD):
            self.client_eof = True
        return False

    def _frames_to_pass(self, revents: int, fd: int) -> bool:
        """A WebSocket client that sent its FIN while relay held its frames back (its upstream
        slow) still has them passed on, the Close frame among them, while the upstream takes
        some within SPLICE_FIN_WAIT_S (found by review: cut at the first check, the upstream
        lost the tail). A reset, a hang-up, or nothing left unread ends it at once."""
        splice = self.splice
        if splice is None or revents & (select.POLLERR | select.POLLHUP):
            return False
        if not ioctl_count(fd, termios.FIONREAD):  # nothing left unread
            return False
        # What the upstream took: what relay passed on, less what still waits in its buffer.
        # (Not what relay passed on alone, which cannot move while the client is paused: the
        # next review found a splice cut while its upstream read steadily.)
        taken = splice.bytes_in - unsent(splice.upstream.transport)
        now = self.relay.timers.now()
        before, since = self._fin_progress
        if taken != before:
            self._fin_progress = (taken, now)
            return True
        return now - since < SPLICE_FIN_WAIT_S
