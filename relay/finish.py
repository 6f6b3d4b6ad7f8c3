"""The end of an exchange, and the fields all of its stages share.

:class:`Finish` is the base of :class:`relay.forward.Exchange` (through
:class:`relay.respond.Respond` and :class:`relay.answer.Answer`). It declares the fields that
every stage of an exchange reads and writes, and ends the exchange: complete (``_finish``: the
upstream connection back to its pool, or closed when it cannot be reused, and the client
connection told it may go on), or with the rest of a request body dropped after the response
ended first (``_drop_rest``), or at the client's FIN during a stream (``end_at_fin``). What
the client is sent comes before: relay's own answer (``relay.answer``) or the upstream's
response (``relay.respond``), which also cuts an exchange short.

Why base classes and not objects of their own: all stages read and write the same fields on
every request; one object per request keeps the hot path to plain attribute reads, and a
method is found on the exchange's class whichever module defines it. The annotations below
are those shared fields; ``Exchange`` sets them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from relay.core.model import Forward, Framing, Reject, RequestHead
from relay.flow import PAUSE_UPSTREAM_FULL

if TYPE_CHECKING:
    import asyncio

    from relay.core.model import Reason
    from relay.core.streams import EnvelopeTracker
    from relay.flow import Client
    from relay.response import ResponseReader
    from relay.upstream_conn import UpstreamConnection


class State(enum.Enum):
    NEW = "new"  # created, waiting behind a pipelined predecessor
    DIALING = "dialing"  # forwarded, waiting for an upstream connection
    STREAMING = "streaming"  # the upstream connection is attached
    ANSWERED = "answered"  # relay answered itself; the request body is being discarded
    UPGRADED = "upgraded"  # handed over to a WebSocket splice
    DONE = "done"


# Module names for the enum members an exchange tests about a dozen times per request (the
# rest are in relay.forward and relay.upstream_side, where they are used): in
# Python 3.11 ``State.DONE`` is an attribute lookup through the Enum metaclass (~65 ns, where a
# global costs ~5 ns); together about 1 of the 15 µs relay spends per small GET (bench/micro.py).
STREAMING = State.STREAMING
ANSWERED = State.ANSWERED
UPGRADED = State.UPGRADED
DONE = State.DONE
CHUNKED = Framing.CHUNKED
LENGTH = Framing.LENGTH


class Finish:
    """The fields of an exchange, and how it ends (see the module docstring)."""

    # The fields both halves use (Exchange sets them in __init__ and adds its own).
    __slots__ = (
        "_client_framing",
        "_dial_task",
        "_interim_sent",
        "_out",
        "_pending",
        "_tracker",
        "_upstream_keepalive",
        "bytes_in",
        "bytes_out",
        "client",
        "decision",
        "head",
        "keep_alive",
        "reader",
        "reason",
        "request_complete",
        "response_complete",
        "started_at",
        "state",
        "status",
        "upstream",
    )

    client: Client
    head: RequestHead
    decision: Forward | Reject | None
    state: State
    keep_alive: bool
    request_complete: bool
    response_complete: bool
    status: int
    reason: str
    bytes_in: int
    bytes_out: int
    started_at: float  # time.monotonic() when the request head was read
    upstream: UpstreamConnection | None
    reader: ResponseReader | None
    _out: list[bytes]  # response bytes of the current upstream read, written by flush()
    _pending: list[bytes]  # request body read before the upstream was attached
    _client_framing: Framing
    _tracker: EnvelopeTracker | None  # set for a Connect stream (clean end when cut)
    _interim_sent: bool
    _upstream_keepalive: bool
    _dial_task: asyncio.Task[None] | None
    _flood_waits: bool  # the rest of an upstream read is fed in the next pass (relay.upstream_side)

    if TYPE_CHECKING:
        # An exchange is registered as in flight (relay.runtime.Live), which a revocation
        # ends: Respond.revoke. Declared for the type checker only: nothing at run time.
        def revoke(self, answer: Reason) -> bool: ...

    def streaming(self) -> bool:
        """A response of unknown length is under way: a stream. Chunked to the client, or to
        an HTTP/1.0 client unframed, to the close (RFC 9112 §6.3). A response without a body
        (HEAD, 204, 304, relay's own answers) is complete before anything else runs."""
        return (
            self._client_framing is not LENGTH and bool(self.status) and not self.response_complete
        )

    def flush(self) -> None:
        """Write what the response produced so far (one upstream read) in one writev."""
        out = self._out
        if out:
            self._out = []
            self.client.writelines(out)

    def _drop_reader(self) -> ResponseReader | None:
        """Break reader → exchange, so the exchange is freed by reference counting.

        The reader and its parser stay with the upstream connection for its next exchange;
        the connection breaks reader ↔ parser when it closes (UpstreamConnection.close).
        """
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.unbind()
        return reader

    def _finish(self) -> None:
        if self.state is DONE:
            return
        relay = self.client.relay
        # No longer in flight before the client can see the end: with workers, its next
        # request may reach another worker at once, which reads this one's count from the
        # shared table (relay.sharedcount) and answered 429 while it was still there.
        relay.unregister(self)
        if self._out:
            self.flush()  # before the next pipelined exchange writes anything
        reader = self._drop_reader()
        upgraded = self.state is UPGRADED
        self.state = DONE
        conn, self.upstream = self.upstream, None
        if conn is not None and not upgraded:
            if conn.write_paused:
                # The upstream answered without reading the request (its buffer is full):
                # not reused with those bytes in front of the next request, and the client,
                # paused for that buffer, is read again (the connection's resume_writing
                # will not come to this exchange any more).
                reusable = False
                self.client.resume(PAUSE_UPSTREAM_FULL)
            else:
                reusable = (
                    self._upstream_keepalive
                    and self.response_complete
                    and self.request_complete
                    and self.head.method != b"HEAD"
                    and not (isinstance(self.decision, Forward) and self.decision.websocket)
                )
            if reusable and reader is not None and reader.feeding:
                conn.owner = None
                reader.release_after_feed(conn, relay.pool)  # see ResponseReader._release
            elif reusable:
                relay.pool.release(conn)
            else:
                conn.owner = None
                conn.close()
        relay.observer.exchange_done(self)
        if not upgraded:
            keep = self.keep_alive and self.request_complete
            self.client.exchange_finished(self, keep_alive=keep)

    def end_at_fin(self) -> None:
        """The client sent its FIN during this stream: the client connection ends, and with
        it the exchange (client_closed). A close-delimited body (an HTTP/1.0 client) is
        complete at an orderly close (RFC 9112 §8), and a half-closed client may still read:
        a reset tells it the answer was cut, as for any cut (cut; found by review: the part
        written read as the whole answer). A chunked one lacks its last chunk: a close, the
        exchanges ended first (Closing.drop_after_fin)."""
        if self._client_framing is Framing.NONE:
            self.client.abort()
        else:
            self.client.drop_after_fin()

    def _drop_rest(self) -> None:
        """The response ended before the request body: the rest of the body has nowhere to
        go, so it is read and dropped as after relay's own answers (within DISCARD_LIMIT and
        ``listen.header_timeout_s``) and the client connection is kept, as nginx discards it;
        the upstream connection, which has part of a body, is closed."""
        # No longer in flight to its sandbox (max_connections), before the client sees the
        # response's end (see _finish).
        self.client.relay.unregister(self)
        self.flush()
        self.state = ANSWERED
        self._let_go_of_upstream()
        self.client.discarding()

    def _let_go_of_upstream(self) -> None:
        """Close the upstream connection, which holds part of this exchange (never reused),
        and read the client again if it was paused for that connection's full buffer."""
        conn, self.upstream = self.upstream, None
        self._upstream_keepalive = False
        if conn is not None:
            conn.owner = None
            conn.close()
        self.client.resume(PAUSE_UPSTREAM_FULL)
