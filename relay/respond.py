"""The client's half of an exchange: what the client is sent, and how the exchange ends.

:class:`Respond` holds the methods of :class:`relay.forward.Exchange` that write to the
client: relay's own answer when it refuses a request; the upstream's response as the
:class:`~relay.response.ResponseReader` reports it (the head planned by
``relay.core.responses``, the body re-framed, what one upstream read produced coalesced into
one write); and the end of the exchange: complete (``_finish``: the upstream connection back
to its pool), or cut early, which gives a Connect stream a well-formed ``unavailable``
end-of-stream envelope and leaves any other started body visibly truncated.
``relay.forward`` keeps the other half: starting, dialling, and the request's bytes.

Why a base class and not an object of its own: both halves read and write the same fields on
every request; one object per request keeps the hot path to plain attribute reads. The
annotations below are those shared fields; ``Exchange`` owns their slots and sets them.
"""

from __future__ import annotations

import asyncio
import email.utils
import enum
import logging
import time
from typing import TYPE_CHECKING

from relay.core import failures, responses
from relay.core import headers as header_rules
from relay.core.answers import answer_bytes, reason_phrase, render
from relay.core.model import Forward, Framing, Headers, Reason, Reject, RequestHead
from relay.core.streams import EnvelopeTracker, end_stream_frame
from relay.flow import PAUSE_DIAL, PAUSE_UPSTREAM_FULL

if TYPE_CHECKING:
    from relay.flow import Client
    from relay.response import ResponseReader
    from relay.upstreams import UpstreamConnection

log = logging.getLogger("relay.forward")  # the exchange's logger, whichever half logs

CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
# A refused request's body is read and dropped up to this size so that the connection can be
# kept; past it the connection is closed after the answer.
DISCARD_LIMIT = 1 << 20
# The chunk-size lines of small chunks, made once: a stream's events arrive one at a time on a
# core that was idle, where formatting one with ``b"%x\r\n" % n`` cost ~6 µs and a lookup ~3
# (bench.micro --cold-ms; bench/README.md, "A ninth host"). ~47 KiB per process.
SMALL_CHUNK = 1024
CHUNK_HEADS = tuple(b"%x\r\n" % n for n in range(SMALL_CHUNK))
# The same lines the other way round, for a stream event passed on whole (_whole_chunk); 0 (the
# last chunk) is not in it.
CHUNK_SIZES = {head: n for n, head in enumerate(CHUNK_HEADS) if n}


_date: tuple[int, bytes] = (0, b"")  # the second http_date() last formatted, and its text


def http_date() -> bytes:
    """Now as an IMF-fixdate (RFC 9110 §5.6.7), for the Date of relay's own answers (§6.6.1),
    formatted once per second (~3 µs each), as nginx and aiohttp cache theirs."""
    global _date  # noqa: PLW0603 - one value per process, replaced whole
    now = int(time.time())
    if now != _date[0]:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


class State(enum.Enum):
    NEW = "new"  # created, waiting behind a pipelined predecessor
    DIALING = "dialing"  # forwarded, waiting for an upstream connection
    STREAMING = "streaming"  # the upstream connection is attached
    ANSWERED = "answered"  # relay answered itself; the request body is being discarded
    UPGRADED = "upgraded"  # handed over to a WebSocket splice
    DONE = "done"


# Module names for the enum members an exchange tests about a dozen times per request (the
# rest are in relay.forward, where they are used): in
# Python 3.11 ``State.DONE`` is an attribute lookup through the Enum metaclass (~65 ns, where a
# global costs ~5 ns); together about 1 of the 15 µs relay spends per small GET (bench/micro.py).
STREAMING = State.STREAMING
ANSWERED = State.ANSWERED
UPGRADED = State.UPGRADED
DONE = State.DONE
CHUNKED = Framing.CHUNKED
LENGTH = Framing.LENGTH


class Respond:
    """The client-facing methods of an exchange (see the module docstring)."""

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
    _flood_waits: bool  # the rest of an upstream read is fed in the next pass (relay.forward)

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
        head_only = self.head.method == b"HEAD"
        self.client.write(
            answer_bytes(
                answer,
                close=not keep,
                head_only=head_only,
                version=self.head.version,
                date=http_date(),
            )
        )
        self.bytes_out += 0 if head_only else len(answer.body)
        self.response_complete = True
        self._pending = []
        if self.request_complete or not keep:
            self._finish()
        else:
            # No longer in flight to its sandbox (max_connections), as in _drop_rest: a 502
            # before the body's end (nothing listening) kept counting while the client sent
            # the rest, and the sandbox's next request got 429 (found by review).
            self.client.relay.unregister(self)
            self.client.discarding()  # the rest of the body is dropped, within a deadline

    def _discard_ok(self, *, unsized: bool = True) -> bool:
        """The rest of the request body can be read and dropped, the connection kept;
        ``unsized``: the answer for a chunked body, whose size is known only at its end."""
        if self.request_complete:
            return True
        if self._expects_continue():
            return False
        cl = header_rules.index(self.head.headers).get(b"content-length")
        if cl is not None:
            try:
                return int(cl[0]) <= DISCARD_LIMIT
            except ValueError:
                return False
        return unsized  # chunked: dropped until the limit, then closed (see request_body)

    def _expects_continue(self) -> bool:
        """The client asked ``Expect: 100-continue``: it may hold its body back for a 100 that
        relay's refusal does not send. Kept, the connection is ambiguous: a client may skip the
        body and send its next request (older Go transports and OkHttp did: OkHttp issue
        #3252), which would be dropped as that body. Go's net/http server (E2B's proxy) closes
        after answering such a request whose body it has not read to its end
        (closeAfterReply), whether or not some of it came; so does relay (found by review: the
        next request went unanswered)."""
        if self.head.version != "1.1":
            return False  # RFC 9110 §10.1.1: the expectation is ignored from HTTP/1.0 clients
        expect = header_rules.index(self.head.headers).get(b"expect")
        return expect is not None and any(b"100-continue" in v.lower() for v in expect)

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
                return self._unrelayable("upstream: unsolicited 101")
            if not header_rules.accepts_websocket(headers):
                return self._unrelayable("upstream: 101 without Upgrade: websocket")
            self._out.append(responses.upgrade_head(reason, headers))
            return -1
        plan = responses.plan_response(
            status,
            reason or reason_phrase(status),
            headers,
            self.head.method,
            self.head.version,
            # An answer before the request body ended is kept only when the rest of the body
            # can be dropped (_drop_rest), else the head says the connection closes (RFC 9112
            # §9.6, RFC 9110 §10.1.1; Go's server too, past 256 KiB unread). Found by review:
            # a client told nothing took it for a kept one; then, every head sent before the
            # body's end said close, and an upstream reading the body as it answered lost the
            # connection. Not a chunked body: it may go past the limit after a head that said
            # the connection is kept.
            self.keep_alive and (self.request_complete or self._discard_ok(unsized=False)),
            decision.websocket,
        )
        if plan.unrelayable:
            return self._unrelayable(plan.unrelayable)
        self._client_framing = plan.framing
        self.keep_alive = plan.keep_alive
        if (
            self.client.client_eof
            and plan.framing is not LENGTH
            and not plan.ends_at_head
            and status not in (204, 304)
        ):
            # A stream for a client that sent its FIN (streaming()): chunked, or unframed to
            # an HTTP/1.0 client (found by review: that one was still waited out). Checked
            # once this read is done: a whole answer in the head's read is no stream, and is
            # written (found by review: closed here, it was dropped, and counted as served).
            self.client.relay.outbox.later(self._end_stream_after_fin)
        if plan.connect_stream:
            self._tracker = EnvelopeTracker()
        # An upstream without a Date (RFC 9110 §6.6.1) gets relay's: one test per response.
        self._out.append(
            responses.with_date(plan.head, http_date()) if plan.dateless else plan.head
        )
        if plan.ends_at_head:
            # llhttp cannot be told that a response answers HEAD, so it would wait for the
            # announced body: the response ends here and the connection is not reused.
            self.response_complete = True
            self._upstream_keepalive = False
            if self.request_complete:
                self._finish()
            elif self.keep_alive:
                self._drop_rest()
        return plan.length

    def _end_stream_after_fin(self) -> None:
        """The half-closed client's response is still a stream after its head's read: the
        client is taken as gone (closing.Closing.eof_received), and the exchange ends. Not
        while the rest of that read waits to be fed (a flood of tiny chunks, relay.forward's
        _flood_continue, scheduled after this check): the check follows it (found by review:
        a whole answer of tiny chunks in one read was cut after its first slice)."""
        if self.state is STREAMING and self.streaming():
            if self._flood_waits:
                self.client.relay.outbox.later(self._end_stream_after_fin)  # bounded: the read
                return
            self.end_at_fin()

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

    def _unrelayable(self, why: str) -> int:
        """A head relay will not pass on: nothing was written, so the client gets a 502."""
        self.status = 0
        self.response_malformed(why)
        return -1

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
            n = len(body)
            self._out += (CHUNK_HEADS[n] if n < SMALL_CHUNK else b"%x\r\n" % n, body, CRLF)
        else:
            self._out.append(body)

    def _whole_chunk(self, data: bytes) -> bool:
        """One stream event passed on as it came, without llhttp; False: parse ``data``.

        Only while llhttp waits at a chunk-size line (``ResponseReader.at_chunk``), and only
        for a read that is exactly one whole chunk of under 1 KiB whose size line is the one
        relay would write (lowercase hex, no extension): envd writes each event in one write,
        so this is the usual stream read. llhttp would report it as one ``on_body`` and be
        back at a chunk-size line; relay would frame that body into these very bytes. So the
        read is written as is and llhttp is left where it would be. Why: an event arrives on a
        core that was idle, where every Python call before the write costs many times its
        hot time; the parsed path (reader, llhttp and its callbacks, the tracker, a writev of
        three pieces) took 7.8 µs at best after 1 ms idle, this 5.6 (bench.micro --cold-ms 1),
        and on loopback the added latency per event fell by 4-5 µs at p50 and 12-25 µs at p99
        (bench/README.md, "An eleventh host").
        """
        end = data.find(b"\n", 1, 5)
        if end < 0:
            return False
        size = CHUNK_SIZES.get(data[: end + 1])
        if (
            size is None
            or len(data) != end + 3 + size
            or not data.endswith(CRLF)
            or self.response_complete
            or self._client_framing is not CHUNKED
        ):
            return False
        tracker = self._tracker
        if tracker is not None and not tracker.whole(data, end + 1, end + 1 + size):
            return False
        self.bytes_out += size
        self.client.write(data)
        return True

    def response_passed(self, body: bytes) -> None:
        self.bytes_out += len(body)
        self.client.write(body)  # no flush follows a read the reader passed on unparsed

    def response_end(self) -> None:
        if self.response_complete or self.state is not STREAMING or self.status == 101:
            return  # a 101 continues in response_upgrade(), once llhttp stops at the upgrade
        self.response_complete = True
        if self._client_framing is CHUNKED:
            tracker = self._tracker
            if tracker is not None and tracker.holding:
                rest = tracker.rest()  # a clean end: bytes held for a clean cut go out
                self.bytes_out += len(rest)
                self._out += (b"%x\r\n" % len(rest), rest, CRLF)
            self._out.append(LAST_CHUNK)
        if not self.request_complete:
            if self.keep_alive:
                self._drop_rest()  # its head said the connection is kept (response_head)
                return
            # The upstream answered before the request body ended (e.g. 413): the rest of the
            # body, past what is dropped, has nowhere to go, so neither connection is kept.
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

    # -- ending early ---------------------------------------------------------------------------
    def revoke(self, answer: Reason) -> bool:
        """The route of this exchange's sandbox was revoked (SPEC §3), or relay stops
        (``Reason.DRAINING``). An exchange relay already answered (reading and dropping the
        rest of a refused body) keeps its own reason for the access log and is not counted."""
        if self.state in (DONE, ANSWERED, UPGRADED):
            return False
        self.reason = "draining" if answer is Reason.DRAINING else "revoked"
        self.cut(failures.revoked(self.decision, answer))
        return True

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
        self._let_go_of_upstream()
        if not self.status:
            closes = self.head.upgrade or not self.request_complete
            if closes:
                # The rest of the request has nowhere to go: the answer says the connection
                # ends (RFC 9112 §9.6), as relay's other closing answers do (found by review:
                # it was closed after an answer that kept it).
                self.keep_alive = False
            self.answer(reject)
            if closes:
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
        if self._client_framing is Framing.NONE:
            # A close-delimited body (an HTTP/1.0 client) is complete at an orderly close
            # unless "an error was indicated by the underlying connection" (RFC 9112 §8): only
            # a reset tells the client it was cut (found by review: a FIN made it whole).
            self.client.abort()
        self.client.exchange_cut(self)
