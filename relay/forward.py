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
starting (decide, a pooled or dialled upstream), the request head and body, the upstream
connection's events, and the hand-over of a 101 to a WebSocket splice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relay.answer import DISCARD_LIMIT
from relay.core import failures
from relay.core.model import Forward, Framing, Kind, Reject, RequestHead
from relay.dial import DESCRIPTORS, DialError
from relay.finish import ANSWERED, CHUNKED, DONE, STREAMING, UPGRADED, State
from relay.flow import PAUSE_DIAL, PAUSE_UPSTREAM_FULL
from relay.respond import CRLF, LAST_CHUNK, Respond
from relay.response import ResponseReader
from relay.upstream_conn import UpstreamConnection
from relay.upstreams import PoolKey
from relay.websocket import Splice

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
DIALING = State.DIALING
UNFRAMED = Framing.NONE  # a request without a body, or a response body ending at close
MANAGEMENT = Kind.MANAGEMENT


class Exchange(Respond):
    __slots__ = ("_discarded", "_flood_rest", "_flood_waits", "_retried", "_reused", "_tail")

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

    def _pool_key(self, decision: Forward) -> PoolKey:
        key = decision.pool_key  # made with the decision (relay.core.decide)
        if key is None:  # the management upstream: an address of relay's configuration
            assert decision.kind is MANAGEMENT
            host, port = self.client.relay.management_address
            return PoolKey("", 0, host, port)
        return key

    async def _dial(self, key: PoolKey) -> None:
        relay = self.client.relay
        try:
            conn = await relay.pool.connect(key)
        except DialError as exc:
            self._dial_task = None
            if self.state is DIALING:
                self._dial_failed(exc)
            return
        except Exception as exc:  # a bug: answered, not left DIALING (and counted) for ever
            self._dial_task = None
            if self.state is DIALING:
                self.client.resume(PAUSE_DIAL)
                self.internal_error(exc)
            return
        self._dial_task = None
        if self.state is not DIALING:
            conn.close()  # revoked or the client left while dialling
            return
        self.client.resume(PAUSE_DIAL)
        self._attach(conn)

    def _dial_failed(self, exc: DialError) -> None:
        decision = self.decision
        assert isinstance(decision, Forward)
        self.client.resume(PAUSE_DIAL)
        reject = failures.unreachable(decision, exhausted=exc.exhausted)
        if exc.shortage == DESCRIPTORS:
            self.client.relay.make_room()  # for the next ones (relay.room)
        self.reason = f"dial: {exc}"
        self.answer(reject)

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

    # -- upstream side (Owner protocol) -----------------------------------------------------
    def upstream_data(self, data: bytes) -> None:
        reader = self.reader
        if reader is not None:
            if reader.at_chunk and self._whole_chunk(data):
                return
            rest = reader.feed(data)
            if reader.dense:
                # A flood of tiny chunks (relay.flow.FLOOD_SLICE): the rest of the read, if
                # any, in the next turn, the upstream unread meanwhile (libuv would read it
                # up to 32 times in a row).
                pending = self._flood_waits
                self._flood_rest += rest  # before scheduling: an unbound outbox runs it at once
                if not pending and self.upstream is not None:
                    self._flood_waits = True
                    self.upstream.pause_reading()
                    self.client.relay.outbox.later(self._flood_continue)

    def _flood_continue(self) -> None:
        self._flood_waits = False
        rest, self._flood_rest = self._flood_rest, b""
        if self.reader is None or self.state is not STREAMING or self.upstream is None:
            return  # cut or ended meanwhile: what was left of the read goes with it
        if rest:
            self.upstream_data(rest)
        if not self._flood_waits and self.upstream is not None and not self.client.write_paused:
            self.upstream.resume_reading()

    def _flood_now(self) -> None:
        """The upstream ended with part of its last read not fed yet (a flood's rest): feed it
        now, whole, as the read would have been (found by review: a response the read
        completed was cut)."""
        rest, self._flood_rest = self._flood_rest, b""
        reader = self.reader
        while rest and reader is not None and self.reader is reader and self.state is STREAMING:
            rest = reader.feed(rest)

    def upstream_eof(self) -> None:
        if self._flood_rest:
            self._flood_now()
        if self.state is not STREAMING:
            return
        reader = self.reader
        if (
            self.status
            and not self.response_complete
            and reader is not None
            and reader.body_until_close()
            # A Connect stream ends with its end-of-stream envelope: one that closes before it,
            # mid-envelope or between two, was cut, and ends with the "unavailable" frame (SPEC
            # §3; found by review: its held half-envelope went out in a body that looked whole).
            # A stream no longer followed (relay.core.streams: too many envelopes in a read)
            # has its end taken on trust, as before (found by review: its end envelope went
            # unseen, and a whole stream was cut). An end envelope over the hold limit passes
            # unheld: it ends the stream only once whole (found by fuzz/fuzz_upstream.py: a FIN
            # inside one made a torn envelope look like a clean end).
            and (
                self._tracker is None
                or (self._tracker.ended and self._tracker.at_boundary)
                or not self._tracker.following
            )
        ):
            reader.on_message_complete()  # a close-delimited body ends here (RFC 9112 §6.3)
            return
        if self._retry_on_a_fresh_connection():
            return
        self.reason = self.reason or "upstream_eof"
        self.cut(failures.closed_early(self.decision))

    def upstream_lost(self, exc: Exception | None) -> None:
        self.upstream = None
        if self._flood_rest:
            self._flood_now()
        if self.state is not STREAMING:
            return
        if not self.response_complete:
            if self._retry_on_a_fresh_connection():
                return
            self.reason = self.reason or ("upstream_reset" if exc else "upstream_eof")
            self.cut(failures.closed_early(self.decision))
        elif not self.request_complete:
            # The response is complete (an early answer, or one to HEAD) but the request body
            # is still arriving, with nowhere to go now: as in response_end, neither
            # connection can be kept, and the exchange ends.
            self.keep_alive = False
            self.request_complete = True
            self._finish()

    def _retry_on_a_fresh_connection(self) -> bool:
        """A pooled connection the upstream closed just as it was reused: send again, once.

        Only for idempotent requests without a body (RFC 9110 §9.2.2) that got no response
        byte; the race is between the upstream's idle close and relay noticing it. An
        upstream that began its answer took the request: a GET with side effects must not run
        twice (Go's transport does not retry then either; found by review).
        """
        decision = self.decision
        if (
            self._retried
            or not self._reused
            or self.status
            or (self.reader is not None and self.reader.began)
            or self._interim_sent  # a 1xx reached the client: it must not see it twice
            or not isinstance(decision, Forward)
            or not decision.replayable
        ):
            return False
        self._retried = True
        conn, self.upstream = self.upstream, None
        if conn is not None:
            conn.owner = None
            conn.close()
        self._drop_reader()  # closed with its connection; a fresh one comes with the next
        self.state = DIALING
        self.client.pause(PAUSE_DIAL)
        self._dial_task = self.client.relay.spawn(self._dial(self._pool_key(decision)))
        return True

    def upstream_pause_writing(self) -> None:
        self.client.pause(PAUSE_UPSTREAM_FULL)

    def upstream_resume_writing(self) -> None:
        self.client.resume(PAUSE_UPSTREAM_FULL)

    def response_upgrade(self, upstream_tail: bytes) -> None:
        decision = self.decision
        conn = self.upstream
        if self.status != 101 or conn is None or not isinstance(decision, Forward):
            self.response_malformed("upstream: unexpected upgrade")
            return
        self.flush()  # the 101 goes out before any spliced byte
        self.state = UPGRADED
        self.response_complete = True
        self._drop_reader()  # as in _finish: no cycle outlives the exchange
        conn.drop_reader()  # the connection carries WebSocket frames from here on
        relay = self.client.relay
        relay.unregister(self)
        relay.observer.exchange_done(self)
        splice = Splice(self.client, conn, decision, self._tail, upstream_tail)
        self.upstream = None
        self._tail = b""
        splice.start()
