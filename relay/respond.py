"""The upstream's response written to the client, and an exchange cut short.

:class:`Respond` holds the methods of :class:`relay.forward.Exchange` that relay the
upstream's response as the :class:`~relay.response.ResponseReader` reports it: the head
planned by ``relay.core.responses``, the body re-framed (chunked, or passed on as read), what
one upstream read produced coalesced into one write, and the response's end, which finishes
the exchange (``relay.finish``). It also cuts an exchange short (revoked, relay stopping, a
malformed response, a bug): relay's own answer if nothing was written yet (``relay.answer``),
else a Connect stream gets a well-formed ``unavailable`` end-of-stream envelope and any other
started body is left visibly truncated. ``relay.forward`` keeps the request's half (starting,
the request's bytes), ``relay.upstream_side`` the upstream's (dialling, its reads and loss).

Why a base class and not an object of its own: both halves read and write the same fields on
every request; one object per request keeps the hot path to plain attribute reads. The fields
are declared in :class:`relay.finish.Finish`; ``Exchange`` sets them.
"""

from __future__ import annotations

import logging

from relay.answer import Answer, http_date
from relay.core import failures, responses
from relay.core import headers as header_rules
from relay.core.answers import reason_phrase
from relay.core.model import Forward, Framing, Headers, Reason, Reject
from relay.core.streams import EnvelopeTracker, end_stream_frame
from relay.finish import ANSWERED, CHUNKED, DONE, LENGTH, STREAMING, UPGRADED
from relay.flow import PAUSE_DIAL

log = logging.getLogger("relay.forward")  # the exchange's logger, whichever half logs

CRLF = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
# The chunk-size lines of small chunks, made once: a stream's events arrive one at a time on a
# core that was idle, where formatting one with ``b"%x\r\n" % n`` cost ~6 µs and a lookup ~3
# (bench.micro --cold-ms; bench/README.md, "A ninth host"). ~47 KiB per process.
SMALL_CHUNK = 1024
CHUNK_HEADS = tuple(b"%x\r\n" % n for n in range(SMALL_CHUNK))
# The same lines the other way round, for a stream event passed on whole (_whole_chunk); 0 (the
# last chunk) is not in it.
CHUNK_SIZES = {head: n for n, head in enumerate(CHUNK_HEADS) if n}


class Respond(Answer):
    """The upstream's response to the client, and cuts (see the module docstring)."""

    __slots__ = ()

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
        client is taken as gone (departures.Departures.eof_received), and the exchange ends. Not
        while the rest of that read waits to be fed (a flood of tiny chunks, relay.upstream_side's
        _flood_continue, scheduled after this check): the check follows it (found by review:
        a whole answer of tiny chunks in one read was cut after its first slice)."""
        if self.state is STREAMING and self.streaming():
            if self._flood_waits:
                self.client.relay.outbox.later(self._end_stream_after_fin)  # bounded: the read
                return
            self.end_at_fin()

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
