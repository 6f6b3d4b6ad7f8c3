"""A TLS listener accepts TCP first: admission before any TLS work, then the handshake.

With ``create_server(ssl=...)`` relay's protocol saw a connection only once its handshake was
done, which left two gaps that a production proxy does not have (nginx and Envoy filter by
address and count connections at accept):

* ``listen.allowed_clients`` was checked after the handshake, so a client the operator shut
  out could still make relay run handshakes, the costly part of a TLS connection;
* connections in their handshake did not count against ``listen.max_connections``, so
  clients that connect and stall each held a socket and an SSL object for up to
  ``header_timeout_s``, without bound.

So the listener is plain TCP and :class:`TlsAccept` its protocol. At accept:

* a peer outside ``allowed_clients`` is reset at once, as on a plain listener;
* when ``listen.max_connections`` connections are already in their handshake, the new one is
  reset too (SPEC §5a: "under extreme load it may also stop accepting"): answering it 503
  would take the very handshake that the limit is there to bound;
* otherwise it joins ``Relay.handshakes`` (which :meth:`Relay.admit` counts with the
  established connections, so past the limit a finished handshake gets the 503 that a plain
  connection gets) and ``loop.start_tls`` runs its handshake, bounded by
  ``listen.header_timeout_s`` as before.

``start_tls`` is a coroutine, and its first step (which hands the socket to the TLS protocol)
runs here, inside ``connection_made``, not in a task: uvloop starts reading an accepted socket
as soon as ``connection_made`` returns, and a task's first step runs only after the next poll,
so a ClientHello sent at once went to this plain protocol and was lost (the handshake then
timed out; seen in the tests). The rest of ``start_tls`` is driven from its waiter's
done-callback.

Between the TCP transport and the TLS protocol, :class:`FirstBytes` reads the handshake's
bytes (and keeps those that come before the TLS protocol's own ``connection_made``):

* a plain HTTP request (a client given ``http://`` for relay's ``https://``) is answered
  400, as nginx answers "The plain HTTP request was sent to HTTPS port", where the handshake
  would only have failed on it and closed the connection without a word ("connection reset"
  to curl and the SDKs). Every other connection goes to the TLS protocol at its first byte;
* a handshake that fails on the bytes it is fed sends OpenSSL's alert before the close
  (``relay.tls.AlertingObject``), which asyncio's and uvloop's TLS protocol drop.

A handshake that ends without a connection counts once in
``relay_tls_handshake_failures_total{reason}`` (:func:`failure_reason`), which costs nothing
to a handshake that succeeds; the plain-HTTP 400 counts as its refusal only, and a
connection that relay's stop ends, or that admission resets before any handshake, not at all.

When the handshake is done the :class:`~relay.server.ClientConnection` takes the TLS
transport as if it had been accepted with it. ``start_tls`` never calls ``connection_made``,
and events for the TLS transport's protocol could come before the handover, so this protocol
stands in until then and hands over what arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, cast

from relay.answer import refusal_bytes
from relay.closing import CLOSE_STALL_S
from relay.core.model import Reason, Reject
from relay.core.policy import plain_http_request
from relay.server import ClientConnection
from relay.tls import Feed

if TYPE_CHECKING:
    from relay.runtime import Relay

_Start = Coroutine[Any, Any, asyncio.Transport | None]


def failure_reason(exc: BaseException | None) -> str:
    """The ``reason`` of a failed handshake (relay_tls_handshake_failures_total), from what
    ended ``start_tls`` (uvloop 0.23's ``SSLProtocol``, as asyncio's): a closed set.

    * ``timeout``: ``header_timeout_s`` from accept ran out (SPEC §5a); the TLS protocol
      ends the handshake with ``ConnectionAbortedError("SSL handshake is taking longer than
      …")``, which nothing else in its path raises (relay's own stop comes as a close).
    * ``closed``: the client left first: a FIN (``ConnectionResetError``, or a wake-up without
      an error when it came before the TLS protocol had started: ``exc`` None), a reset, or
      an ``SSLEOFError`` (a truncated handshake). Port checks and load balancers' TCP probes
      land here.
    * ``protocol``: OpenSSL refused what it read (RFC 8446 §6.2's alerts: no shared version
      or cipher suite, an unexpected message, bytes that are not TLS): old clients,
      scanners, a client that rejects relay's certificate chain (its alert).
    * ``error``: anything else, relay's side (``start_tls`` failing at its first step).
    """
    if exc is None or isinstance(exc, ssl.SSLEOFError):
        return "closed"
    if isinstance(exc, ssl.SSLError):
        return "protocol"
    if isinstance(exc, ConnectionAbortedError):
        return "timeout"
    if isinstance(exc, OSError):  # ConnectionResetError, BrokenPipeError, ECONNRESET
        return "closed"
    return "error"


class TlsAccept(asyncio.Protocol):
    """One accepted TCP connection of a TLS listener, until its handshake is done."""

    __slots__ = (
        "_accepted",
        "_early",
        "_eof",
        "_first",
        "_lost",
        "_raw",
        "_start",
        "conn",
        "relay",
    )

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.conn: ClientConnection | None = None  # set once the TLS transport is handed over
        self._raw: asyncio.Transport | None = None
        self._first: FirstBytes | None = None  # the TCP transport's protocol in the handshake
        self._start: _Start | None = None
        self._early: list[bytes] = []
        self._eof = False
        self._lost: tuple[Exception | None] | None = None
        self._accepted = 0.0  # time.monotonic() at accept: the first head's deadline runs from it

    # -- the TCP connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = cast("asyncio.Transport", transport)
        relay = self.relay
        peer = raw.get_extra_info("peername")
        if relay.stopped or not relay.allowed(peer[0] if isinstance(peer, tuple) else ""):
            raw.abort()
            if not relay.stopped:
                relay.observer.connections_reset["not_allowed"] += 1
            return
        shaking = len(relay.handshakes)
        if shaking >= relay.config.listen.max_connections:
            raw.abort()
            relay.observer.connections_reset["handshakes_full"] += 1
            return
        if shaking + len(relay.connections) + relay.pool.opened >= relay.room_mark:
            relay.make_room()  # near the open-file limit (relay.room)
        assert relay.tls is not None
        self._accepted = time.monotonic()
        start = asyncio.get_running_loop().start_tls(
            raw,
            self,
            relay.tls.listener,
            server_side=True,
            # SPEC §5a: header_timeout_s runs from accept, so it bounds the handshake too
            # (asyncio's default is 60 s).
            ssl_handshake_timeout=relay.config.listen.header_timeout_s,
            # A closing connection's last answer may take a paused reader up to CLOSE_STALL_S
            # without progress (relay.closing); the TLS layer's own 30 s total cut it first.
            ssl_shutdown_timeout=CLOSE_STALL_S,
        )
        self._raw, self._start = raw, start
        relay.handshakes.add(self)
        try:
            waiter = start.send(None)  # the first step, now: see the module's docstring
        except Exception as exc:  # StopIteration too: start_tls always waits for its handshake
            self._failed(exc)  # counted as error (relay.handshake.failure_reason)
            return
        waiter.add_done_callback(self._handshaken)
        # start_tls made its TLS protocol the transport's; the handshake's bytes go through
        # FirstBytes on their way to it. Reading resumes only after this returns.
        tls = cast("asyncio.BufferedProtocol", raw.get_protocol())
        self._first = first = FirstBytes(raw, tls, relay)
        raw.set_protocol(first)
        # After the TLS protocol's connection_made, which start_tls scheduled just now
        # (call_soon runs callbacks in order): bytes fed before it would wait in its BIO and
        # the handshake run on them from connection_made, where a failure's alert is lost.
        asyncio.get_running_loop().call_soon(first.started)

    def abort(self) -> None:
        """Relay stops: the handshake ends, and so does the connection."""
        if self._raw is not None:
            self._raw.abort()

    def _handshaken(self, _waiter: object) -> None:
        start = self._start
        assert start is not None
        try:
            start.send(None)  # start_tls returns its transport, or raises what ended it
        except StopIteration as done:
            self._hand_over(done.value)
        except Exception as exc:  # a failed or timed-out handshake, a reset: nothing to answer
            self._failed(exc)
        else:  # start_tls awaits only its waiter
            self._failed(RuntimeError())

    def _failed(self, exc: BaseException | None) -> None:
        self._count_failure(exc)
        self.relay.handshakes.discard(self)
        self._first = None  # the transport keeps it as its protocol until its loss
        start, self._start = self._start, None
        if start is not None:
            with contextlib.suppress(Exception):  # RuntimeError if it ignored GeneratorExit
                start.close()
        if self._raw is not None:
            self._raw.abort()

    def _count_failure(self, exc: BaseException | None) -> None:
        """Once per connection, at its failure only: the plain-HTTP 400 counted already
        (``relay_refusals_total{reason="plain_http"}``), and relay's stop is no failure."""
        first = self._first
        if self.relay.stopped or (first is not None and first.refused):
            return
        self.relay.observer.tls_handshake_failures[failure_reason(exc)] += 1

    def _hand_over(self, transport: asyncio.Transport | None) -> None:
        self.relay.handshakes.discard(self)
        self._start = None
        if transport is None or transport.is_closing():
            # Lost on the way (a close during the handshake wakes start_tls without an
            # error): there is no connection left to admit. A failure: a client that leaves
            # right after its Finished is handed over first (uvloop reads the FIN in a later
            # turn of the loop than the waiter's callback; tests/test_tls_handshake_metrics).
            self._count_failure(None)
            if self._raw is not None:
                self._raw.abort()
            return
        if self._first is not None:
            self._first.shaken()  # the TLS protocol reads the socket itself from now on
            self._first = None
        conn = ClientConnection(self.relay, tls=True)
        conn.below = self._raw  # what the TLS layer already encrypted waits there (relay.closing)
        self.conn = conn
        transport.set_protocol(conn)
        conn.connection_made(transport)
        # SPEC §5a: header_timeout_s runs from accept, and the handshake took part of it (found
        # by review: the head's wait began afresh here, so a slow client had up to twice it).
        conn.first_head_by(self._accepted + self.relay.config.listen.header_timeout_s)
        early, self._early = self._early, []
        try:
            for data in early:
                conn.data_received(data)
        finally:
            # Even if relay's own code raised on the early bytes (a bug: it reaches the loop's
            # exception handler), the connection learns of its EOF and its loss, or it would
            # hold its slot in Relay.connections for ever.
            if self._eof and not conn.eof_received():
                transport.close()
            if self._lost is not None:
                conn.connection_lost(self._lost[0])

    # -- the TLS transport's protocol until the handover: what came before it
    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.data_received(data)
        else:
            self._early.append(data)

    def eof_received(self) -> bool | None:
        if self.conn is not None:
            return self.conn.eof_received()
        self._eof = True
        return True  # kept open until the handover decides (the connection's own rule)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.connection_lost(exc)
        else:
            self._lost = (exc,)


class FirstBytes(asyncio.Protocol):
    """A TLS listener's TCP transport's protocol during the handshake: its first bytes tell
    a plain HTTP request line, answered 400 (SPEC §5, ``Reason.PLAIN_HTTP``), from anything
    else, which goes to the TLS protocol with the bytes read so far at the first byte that
    tells; then every read is fed to the TLS protocol, so that a failing handshake can send
    its alert (``relay.tls.AlertingObject``), until ``TlsAccept`` hands the transport over.

    A TLS client costs this object, two ``set_protocol`` calls and a copy of each read of
    its handshake (typically two: the ClientHello and the Finished) into the TLS protocol's
    buffer, ~3.5 µs (measured; AlertingObject's ~1 µs more), against ~205-270 µs for the
    server side of a TLS 1.3 handshake with a P-256 key: uvloop cannot show a protocol a
    socket's bytes without handing them over. Once the handshake is done the TLS protocol
    reads the socket itself, as before.
    The handshake's timeout (``header_timeout_s`` from accept) runs in the TLS protocol from
    its start, before any byte, so it bounds this wait as well, and the lingering after a
    400: the connection stays in ``Relay.handshakes`` (counted against
    ``listen.max_connections``) until the TCP connection is lost, which this protocol always
    passes on to the TLS protocol (its loss ends ``start_tls``).
    """

    __slots__ = ("_early", "_plain", "_raw", "_relay", "_seen", "_tls")

    def __init__(self, raw: asyncio.Transport, tls: asyncio.BufferedProtocol, relay: Relay):
        self._raw = raw
        self._tls = tls
        self._relay = relay
        self._seen = b""
        self._plain: bool | None = None  # None until the first bytes tell
        # Bytes read before the TLS protocol started (uvloop reads an accepted socket as
        # soon as connection_made returns, start_tls's pause notwithstanding); None after.
        self._early: bytes | None = b""

    def started(self) -> None:
        """The TLS protocol's connection_made has run: it can take bytes now."""
        early, self._early = self._early, None
        if early and not self._raw.is_closing():
            self._raw.resume_reading()
            self.data_received(early)

    def data_received(self, data: bytes) -> None:
        if self._early is not None:
            self._early += data
            self._raw.pause_reading()  # until started(), in this loop's turn or the next
            return
        plain = self._plain
        if plain is False:
            self._feed(data)
            return
        if plain:
            return  # what follows a refused request is dropped until the client's FIN
        seen = self._seen + data if self._seen else data
        plain = plain_http_request(seen)
        if plain is None:
            self._seen = seen  # at most METHOD_MAX bytes
            return
        self._plain, self._seen = plain, b""
        if plain:
            self._answer(head_only=seen.startswith(b"HEAD "))
        else:
            self._feed(seen)

    def eof_received(self) -> bool | None:
        if self._plain:
            return False  # the answer and its FIN went first: close
        if self._plain is None:
            self._plain = False
            self._feed(self._seen)
        return self._tls.eof_received()  # a handshake's EOF, as before

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls.connection_lost(exc)  # wakes start_tls (TlsAccept._handshaken)

    def pause_writing(self) -> None:
        self._tls.pause_writing()

    def resume_writing(self) -> None:
        self._tls.resume_writing()

    @property
    def refused(self) -> bool:
        """A plain HTTP request was answered 400 (counted as that refusal)."""
        return bool(self._plain)

    def shaken(self) -> None:
        """The handshake is done: the TLS protocol takes the transport."""
        if not self._raw.is_closing():
            self._raw.set_protocol(self._tls)

    def _feed(self, data: bytes) -> None:
        """Give the TLS protocol the bytes it would have read itself (BufferedProtocol)."""
        raw, tls = self._raw, self._tls
        view = memoryview(data)
        outer, Feed.send = Feed.send, raw.write  # a failure's alert goes there (relay.tls)
        try:
            while view and not raw.is_closing():
                buffer = memoryview(tls.get_buffer(len(view)))  # a memoryview: typed as Buffer
                size = min(len(buffer), len(view))
                buffer[:size] = view[:size]
                tls.buffer_updated(size)
                view = view[size:]
        finally:
            Feed.send = outer  # None: no feed runs inside another

    def _answer(self, *, head_only: bool) -> None:
        """The 400 (its head only to a HEAD: RFC 9110 §9.3.2), then a FIN; what the client
        still sends is read and dropped until its own FIN, so that the close sends no reset
        that could destroy the answer (RFC 9112 §9.6, as ClientConnection.close lingers)."""
        reject = Reject(reason=Reason.PLAIN_HTTP)
        peer = self._raw.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else ""
        self._raw.write(
            refusal_bytes(self._relay.observer, reject, address, None, head_only=head_only)
        )
        self._raw.write_eof()
