"""One request/response exchange: decide, then stream it through a pooled upstream.

An :class:`Exchange` is created per request by the client protocol and, once started, runs
entirely in callbacks: the request head is written upstream once, request body chunks are
re-framed and written as llhttp delivers them, and the response is framed by llhttp and each
chunk written to the client as it arrives (SPEC §4: no buffering, no decompression).
Backpressure is transport-level in both directions: a full client write buffer pauses
reading from the upstream and vice versa, so memory stays bounded whatever the peers do.

The response is read by a :class:`~relay.response.ResponseReader` (llhttp), which reports
its head, body and end; the exchange frames them for the client and coalesces what one
upstream read produces into one write.

A response already started cannot become an error answer. When such a response is cut (the
upstream broke, or the route was revoked), a Connect stream gets a well-formed
``unavailable`` end-of-stream envelope and a chunked terminator; any other body is left
without its terminator and the client connection closed, so the client sees the truncation.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING

from relay.core import failures, responses
from relay.core import headers as header_rules
from relay.core.answers import reason_phrase, render, serialise_response
from relay.core.model import Forward, Framing, Headers, Kind, Reason, Reject, RequestHead
from relay.core.streams import EnvelopeTracker, end_stream_frame
from relay.flow import PAUSE_DIAL, PAUSE_UPSTREAM_FULL
from relay.response import RESPONSE_HEAD_LIMIT, ResponseReader
from relay.upstreams import DialError, PoolKey, UpstreamConnection
from relay.websocket import Splice

if TYPE_CHECKING:
    from relay.flow import Client

# RESPONSE_HEAD_LIMIT lived here before relay.response; still importable from here.
__all__ = ["DISCARD_LIMIT", "RESPONSE_HEAD_LIMIT", "Exchange", "State"]

log = logging.getLogger("relay.forward")

CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
# A refused request's body is read and dropped up to this size so that the connection can be
# kept; past it the connection is closed after the answer.
DISCARD_LIMIT = 1 << 20
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})


class State(enum.Enum):
    NEW = "new"  # created, waiting behind a pipelined predecessor
    DIALING = "dialing"  # forwarded, waiting for an upstream connection
    STREAMING = "streaming"  # the upstream connection is attached
    ANSWERED = "answered"  # relay answered itself; the request body is being discarded
    UPGRADED = "upgraded"  # handed over to a WebSocket splice
    DONE = "done"


# Module names for the enum members an exchange tests about a dozen times per request: in
# Python 3.11 ``State.DONE`` is an attribute lookup through the Enum metaclass (~65 ns, where a
# global costs ~5 ns); together about 1 of the 15 µs relay spends per small GET (bench/micro.py).
NEW = State.NEW
DIALING = State.DIALING
STREAMING = State.STREAMING
ANSWERED = State.ANSWERED
UPGRADED = State.UPGRADED
DONE = State.DONE
CHUNKED = Framing.CHUNKED
UNFRAMED = Framing.NONE  # a request without a body, or a response body ending at close
MANAGEMENT = Kind.MANAGEMENT


class Exchange:
    __slots__ = (
        "_client_framing",
        "_dial_task",
        "_discarded",
        "_interim_sent",
        "_out",
        "_pending",
        "_retried",
        "_reused",
        "_tail",
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
        self._dial_task: asyncio.Task[None] | None = None
        # Response bytes produced while llhttp parses one upstream read, written to the client
        # in one writev when the read is done: a small response costs one syscall, not three.
        self._out: list[bytes] = []
        self._client_framing = UNFRAMED
        self._tracker: EnvelopeTracker | None = None
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
        conn = relay.pool.acquire(key)
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
        if decision.kind is MANAGEMENT:
            host, port = self.client.relay.management_address
            return PoolKey("", 0, host, port)
        assert decision.route is not None
        assert decision.target is not None
        route = decision.route
        return PoolKey(route.sandbox_id, route.generation, route.address, decision.target.port)

    async def _dial(self, key: PoolKey) -> None:
        relay = self.client.relay
        try:
            conn = await relay.pool.connect(key)
        except DialError as exc:
            self._dial_task = None
            if self.state is DIALING:
                self._dial_failed(exc)
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
        reject = failures.unreachable(decision)
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
        reader = self.reader
        if reader is None:
            self.reader = ResponseReader(self)
        else:
            reader.restart()  # sent again on a fresh connection (_retry_on_a_fresh_connection)
        if self.client.write_paused:
            conn.pause_reading()

    def flush(self) -> None:
        """Write what the response produced so far (one upstream read) in one writev."""
        out = self._out
        if out:
            self._out = []
            self.client.writelines(out)

    def answer(self, reject: Reject) -> None:
        """Answer the client ourselves (before any response byte was written)."""
        self.flush()  # an interim 100 Continue may be waiting
        self.state = ANSWERED
        self.client.relay.observer.refused(reject, self.client.peer)
        answer = render(reject, self.head.headers)
        self.status = answer.status
        self.reason = self.reason or reject.reason.label
        # Keep the connection only if the request body is (or will be) small enough to drop.
        keep = (
            self.keep_alive
            and not reject.reason.closes
            and not self.head.upgrade
            and self._discard_ok()
        )
        self.keep_alive = keep
        fields = (*answer.headers, (b"Content-Length", str(len(answer.body)).encode()))
        if not keep:
            fields = (*fields, (b"Connection", b"close"))
        # A response to HEAD has no content (RFC 9110 §9.3.2): bytes after the head would be
        # read as the start of the next response on a kept-alive connection.
        body = b"" if self.head.method == b"HEAD" else answer.body
        self.client.write(
            serialise_response(answer.status, reason_phrase(answer.status), fields) + body
        )
        self.bytes_out += len(body)
        self.response_complete = True
        self._pending = []
        if self.request_complete or not keep:
            self._finish()

    def _discard_ok(self) -> bool:
        if self.request_complete:
            return True
        cl = header_rules.index(self.head.headers).get(b"content-length")
        if cl is not None:
            try:
                return int(cl[0]) <= DISCARD_LIMIT
            except ValueError:
                return False
        return True  # chunked: dropped until the limit, then closed (see request_body)

    def _drop_reader(self) -> ResponseReader | None:
        """Break parser → reader → exchange, so all three are freed by reference counting."""
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.parser = None
        return reader

    def _finish(self) -> None:
        if self.state is DONE:
            return
        self.flush()  # before the next pipelined exchange writes anything
        reader = self._drop_reader()
        upgraded = self.state is UPGRADED
        self.state = DONE
        relay = self.client.relay
        relay.unregister(self)
        conn, self.upstream = self.upstream, None
        if conn is not None and not upgraded:
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
            assert conn is not None
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
            assert self.upstream is not None
            if decision.framing is CHUNKED:
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
        if self.upstream is not None:
            self.upstream.resume_reading()

    # -- upstream side (Owner protocol) -----------------------------------------------------
    def upstream_data(self, data: bytes) -> None:
        reader = self.reader
        if reader is not None:
            reader.feed(data)

    def upstream_eof(self) -> None:
        if self.state is not STREAMING:
            return
        reader = self.reader
        if (
            self.status
            and not self.response_complete
            and reader is not None
            and reader.body_until_close()
        ):
            reader.on_message_complete()  # a close-delimited body ends here (RFC 9112 §6.3)
            return
        if self._retry_on_a_fresh_connection():
            return
        self.reason = self.reason or "upstream_eof"
        self.cut(failures.closed_early(self.decision))

    def upstream_lost(self, exc: Exception | None) -> None:
        self.upstream = None
        if self.state is STREAMING and not self.response_complete:
            if self._retry_on_a_fresh_connection():
                return
            self.reason = self.reason or ("upstream_reset" if exc else "upstream_eof")
            self.cut(failures.closed_early(self.decision))

    def _retry_on_a_fresh_connection(self) -> bool:
        """A pooled connection the upstream closed just as it was reused: send again, once.

        Only for idempotent requests without a body (RFC 9110 §9.2.2) that got no response
        byte; the race is between the upstream's idle close and relay noticing it.
        """
        decision = self.decision
        reader = self.reader
        if (
            self._retried
            or not self._reused
            or self.status
            or self._interim_sent  # a 1xx reached the client: it must not see it twice
            or not isinstance(decision, Forward)
            or decision.framing is not UNFRAMED
            or decision.method not in _IDEMPOTENT
        ):
            return False
        self._retried = True
        conn, self.upstream = self.upstream, None
        if conn is not None:
            conn.owner = None
            conn.close()
        if reader is not None:
            reader.parser = None  # a fresh one comes with the fresh connection (_attach)
        self.state = DIALING
        self.client.pause(PAUSE_DIAL)
        self._dial_task = self.client.relay.spawn(self._dial(self._pool_key(decision)))
        return True

    def upstream_pause_writing(self) -> None:
        self.client.pause(PAUSE_UPSTREAM_FULL)

    def upstream_resume_writing(self) -> None:
        self.client.resume(PAUSE_UPSTREAM_FULL)

    # -- the upstream's response (events from the ResponseReader) ---------------------------
    def response_interim(self, status: int, reason: bytes, headers: Headers) -> None:
        # Interim responses (100 Continue, 103 Early Hints) pass through to HTTP/1.1 clients
        # (RFC 9110 §15.2).
        if self.head.version == "1.1":
            self._out.append(responses.interim_head(status, reason, headers))
            self._interim_sent = True

    def response_head(self, status: int, reason: bytes, headers: Headers, keep: bool) -> int:
        """The final head; returns the length of a body the reader may pass on unparsed."""
        self.status = status
        self.client.relay.observer.first_response_byte(self)  # metrics: time to first byte
        self._upstream_keepalive = keep
        decision = self.decision
        assert isinstance(decision, Forward)
        if status == 101:
            if not decision.websocket:
                self.status = 0
                self.response_malformed("upstream: unsolicited 101")
                return -1
            self._out.append(responses.upgrade_head(reason, headers))
            return -1
        plan = responses.plan_response(
            status,
            reason or reason_phrase(status),
            headers,
            self.head.method,
            self.head.version,
            self.keep_alive,
            decision.websocket,
        )
        self._client_framing = plan.framing
        self.keep_alive = plan.keep_alive
        if plan.connect_stream:
            self._tracker = EnvelopeTracker()
        self._out.append(plan.head)
        if plan.ends_at_head:
            # llhttp cannot be told that a response answers HEAD, so it would wait for the
            # announced body: the response ends here and the connection is not reused.
            self.response_complete = True
            self._upstream_keepalive = False
            if self.request_complete:
                self._finish()
        return plan.length

    def response_body(self, body: bytes) -> None:
        if self.response_complete:
            return
        tracker = self._tracker
        if tracker is not None:
            body = tracker.feed(body)
            if not body:
                return
        self.bytes_out += len(body)
        if self._client_framing is CHUNKED:
            self._out += (b"%x\r\n" % len(body), body, CRLF)
        else:
            self._out.append(body)

    def response_passed(self, body: bytes) -> None:
        self.bytes_out += len(body)
        self.client.write(body)  # no flush follows a read the reader passed on unparsed

    def response_end(self) -> None:
        if self.response_complete or self.state is not STREAMING or self.status == 101:
            return  # a 101 continues in response_upgrade(), once llhttp stops at the upgrade
        self.response_complete = True
        if self._client_framing is CHUNKED:
            self._out.append(LAST_CHUNK)
        if not self.request_complete:
            # The upstream answered before the request body ended (e.g. 413): the rest of the
            # body has nowhere to go, so neither connection can be kept.
            self.keep_alive = False
            self._upstream_keepalive = False
            self.request_complete = True
        self._finish()

    def response_malformed(self, why: str) -> None:
        """The upstream's response cannot be relayed: answered 502 if not started, else cut."""
        self.reason = why
        self.cut(failures.malformed(self.decision))

    def internal_error(self, exc: BaseException) -> None:
        log.error("internal error on an upstream connection", exc_info=exc)
        self.reason = "internal_error"
        self.cut(Reject(reason=Reason.INTERNAL))

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
        relay = self.client.relay
        relay.unregister(self)
        relay.observer.exchange_done(self)
        splice = Splice(self.client, conn, decision, self._tail, upstream_tail)
        self.upstream = None
        self._tail = b""
        splice.start()

    # -- ending early ---------------------------------------------------------------------------
    def revoke(self) -> None:
        """The route of this exchange's sandbox was revoked (SPEC §3)."""
        self.reason = "revoked"
        self.cut(failures.revoked(self.decision))

    def cut(self, reject: Reject) -> None:
        """End the exchange now: an answer if nothing was written yet, else a clean or
        visibly truncated end of the response."""
        if self.state in (DONE, ANSWERED, UPGRADED):
            return
        self.flush()  # what llhttp already released goes out first
        if self._dial_task is not None:
            self._dial_task.cancel()
            self._dial_task = None
            self.client.resume(PAUSE_DIAL)
        conn, self.upstream = self.upstream, None
        self._upstream_keepalive = False
        if conn is not None:
            conn.owner = None
            conn.close()
        self.client.resume(PAUSE_UPSTREAM_FULL)
        if not self.status:
            self.answer(reject)
            if self.head.upgrade or not self.request_complete:
                self.client.close()
            return
        tracker = self._tracker
        decision = self.decision
        if (
            tracker is not None
            and tracker.at_boundary  # a held, unfinished envelope is dropped
            and isinstance(decision, Forward)
            and decision.target is not None
        ):
            if tracker.ended:
                # The upstream's own end-of-stream envelope already went out: the Connect
                # stream is complete, only the chunked terminator is missing.
                self.client.write(LAST_CHUNK)
            else:
                frame = end_stream_frame(decision.target.sandbox_id)
                self.client.writelines([b"%x\r\n" % len(frame), frame, CRLF, LAST_CHUNK])
            self.response_complete = True
            if not self.request_complete:
                self.keep_alive = False
            self.request_complete = True
            self._finish()
            return
        # No clean end is possible: close without the terminator so the client sees it.
        self.keep_alive = False
        self.response_complete = False
        self._drop_reader()
        self.state = DONE
        relay = self.client.relay
        relay.unregister(self)
        relay.observer.exchange_done(self)
        self.client.exchange_cut(self)
