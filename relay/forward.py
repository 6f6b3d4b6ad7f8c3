"""One request/response exchange: decide, then stream it through a pooled upstream.

An :class:`Exchange` is created per request by the client protocol and, once started, runs
entirely in callbacks: the request head is written upstream once, request body chunks are
re-framed and written as llhttp delivers them, and the response is framed by llhttp and each
chunk written to the client as it arrives (SPEC §4: no buffering, no decompression).
Backpressure is transport-level in both directions: a full client write buffer pauses
reading from the upstream and vice versa, so memory stays bounded whatever the peers do.

The response is read by a :class:`~relay.response.ResponseReader` (llhttp), which reports
its head, body and end; what the client is sent, and how an exchange ends or is cut, is the
other half of the class, :class:`relay.respond.Respond`. This module keeps the request's half:
starting (decide, then a pooled connection or a dial), the request head written on the
connection it is attached to, and the request body. The upstream's side (the dial, the
connection's events, the hand-over of a 101 to a WebSocket splice) is
:class:`relay.upstream_side.UpstreamSide`, the base between the two halves.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relay.answer import DISCARD_LIMIT
from relay.core.model import Forward, Framing, Reject, RequestHead
from relay.finish import ANSWERED, CHUNKED, DONE, STREAMING, State
from relay.flow import PAUSE_DIAL
from relay.respond import CRLF, LAST_CHUNK
from relay.response import ResponseReader
from relay.upstream_conn import UpstreamConnection
from relay.upstream_side import DIALING, UpstreamSide

if TYPE_CHECKING:
    import asyncio

    from relay.flow import Client

__all__ = ["DISCARD_LIMIT", "Exchange", "State"]

# A request relay could not send again (Forward.replayable) does not go on a pooled
# connection idle for longer than this: the app may close it at its idle timeout just as the
# request arrives, and only a replayable request is sent again then
# (_retry_on_a_fresh_connection). Apps' idle timeouts are 5 s (Node's keepAliveTimeout,
# uvicorn, hypercorn, Apache), 2 s (gunicorn) or longer (Go, nginx: 75 s). A fresh dial on
# loopback or a tap device is ~0.1 ms. E2B's own proxy dials for every request.
UNSAFE_REUSE_IDLE_S = 1.0
# Module names for enum members, as in relay.respond (an Enum attribute is a slow lookup).
NEW = State.NEW
UNFRAMED = Framing.NONE  # a request without a body, or a response body ending at close


class Exchange(UpstreamSide):
    __slots__ = ("_discarded",)

    def __init__(self, client: Client, head: RequestHead, *, keep_alive: bool) -> None:
        self.client = client
        self.head = head
        self.keep_alive = keep_alive
        self.state = NEW
        self.decision: Forward | Reject | None = None
        self.upstream: UpstreamConnection | None = None
        self.reader: ResponseReader | None = None  # from the first attach to the end
        self._pending: list[bytes] = []  # framed request body waiting for the upstream
        self._discarded = 0
        self._tail = b""  # bytes the client sent after a WebSocket handshake
        self._flood_rest = b""  # the rest of an upstream read of tiny chunks (upstream_data)
        self._flood_waits = False  # the upstream is unread until _flood_continue runs
        self._dial_task: asyncio.Task[None] | None = None
        # Response bytes produced while llhttp parses one upstream read, written to the client
        # in one writev when the read is done: a small response costs one syscall, not three.
        self._out: list[bytes] = []
        self._client_framing = UNFRAMED
        self._tracker = None
        self._upstream_keepalive = True
        self._reused = False
        self._retried = False
        self._interim_sent = False  # a 1xx was written to the client
        self.request_complete = False
        self.response_complete = False
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.reason = ""
        self.started_at = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Called when this exchange becomes the client's active one."""
        relay = self.client.relay
        decision = relay.decide(self.head)
        self.decision = decision
        if isinstance(decision, Reject):
            self._discarded += sum(map(len, self._pending))
            self._pending = []
            self.answer(decision)
            return
        key = self._pool_key(decision)
        conn = relay.pool.acquire(key, 0.0 if decision.replayable else UNSAFE_REUSE_IDLE_S)
        if conn is not None:
            # The request head goes upstream first, the bookkeeping after it: the upstream
            # starts on the request while relay registers the exchange. Nothing can run in
            # between (no await), so revocation still finds it. On an idle core every line of
            # Python before the write is latency (bench/README.md, "cold requests").
            self._attach(conn)
            relay.register(self)
            return
        relay.register(self)
        self.state = DIALING
        self.client.pause(PAUSE_DIAL)
        self._dial_task = relay.spawn(self._dial(key))

    def _attach(self, conn: UpstreamConnection) -> None:
        decision = self.decision
        assert isinstance(decision, Forward)
        self.upstream = conn
        conn.owner = self
        self._reused = conn.uses > 1
        self.state = STREAMING
        head = decision.wire
        if self._pending:
            parts = [head]
            for chunk in self._pending:
                if decision.framing is CHUNKED:
                    parts.extend((b"%x\r\n" % len(chunk), chunk, CRLF))
                else:
                    parts.append(chunk)
            conn.writelines(parts)
            self._pending = []
        else:
            conn.write(head)
        if self.request_complete and decision.framing is CHUNKED:
            conn.write(LAST_CHUNK)
        # The reader after the write: the response cannot arrive before this callback returns.
        reader = conn.reader
        if reader is None:
            reader = conn.reader = ResponseReader(self)
        else:
            reader.bind(self)  # a pooled connection: its parser reads the next response
        self.reader = reader
        if self.client.write_paused:
            conn.pause_reading()

    # -- request side (called by the client protocol) -----------------------------------------
    def request_body(self, chunk: bytes) -> None:
        self.bytes_in += len(chunk)
        state = self.state
        decision = self.decision
        if state is ANSWERED or state is DONE:
            self._discarded += len(chunk)
            if self._discarded > DISCARD_LIMIT:
                self.keep_alive = False
                self.client.close()
            return
        if state is STREAMING:
            conn = self.upstream
            if conn is None:
                return  # the upstream went after its complete response (see upstream_lost)
            assert isinstance(decision, Forward)
            if decision.framing is CHUNKED:
                conn.writelines([b"%x\r\n" % len(chunk), chunk, CRLF])
            else:
                conn.write(chunk)
        else:
            # Not attached yet (queued or dialling): raw chunks, framed when written.
            self._pending.append(chunk)

    def request_done(self) -> None:
        self.request_complete = True
        state = self.state
        if state is STREAMING:
            decision = self.decision
            assert isinstance(decision, Forward)
            if decision.framing is CHUNKED and self.upstream is not None:
                self.upstream.write(LAST_CHUNK)
            if self.response_complete:
                self._finish()
        elif state is ANSWERED:
            self._finish()

    def client_tail(self, tail: bytes) -> None:
        self._tail += tail

    def answered(self) -> bool:
        return self.state in (ANSWERED, DONE)

    def response_started(self) -> bool:
        return self.status != 0

    def client_lost(self) -> None:
        if self.state is DONE:
            return
        if self._dial_task is not None:
            self._dial_task.cancel()
        self.keep_alive = False
        self.reason = self.reason or "client_closed"
        conn = self.upstream
        if conn is not None:
            conn.owner = None
            conn.close()
        self.upstream = None
        self._drop_reader()
        self.state = DONE
        self.client.relay.unregister(self)
        self.client.relay.observer.exchange_done(self)

    def client_pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def client_resume_writing(self) -> None:
        if self.upstream is not None and not self._flood_waits:
            self.upstream.resume_reading()
