"""relay's own answers on a client connection: refusals, the header timeout, parse errors, bugs.

:class:`Refusals` answers what cannot be served and then closes: a request relay could not
parse or admit (:meth:`Refusals.refuse`), a head that did not arrive within
``listen.header_timeout_s`` or the rest of a body relay only drops (``discarding``), a parse
error from llhttp, found in order behind earlier pipelined requests (RFC 9112 §9.3.2), and a
bug in a callback (logged, never told to the client). It is a base of
:class:`relay.server.ClientConnection` above :class:`relay.closing.Closing`, which declares the
fields they share and closes.
"""

from __future__ import annotations

import logging

import httptools

from relay.answer import refusal_bytes
from relay.closing import Closing
from relay.core.model import Reason, Reject, RequestHead
from relay.flow import PAUSE_CLIENT_FULL

log = logging.getLogger("relay.server")


class Refusals(Closing):
    """The refusing half of a client connection (see the module docstring)."""

    __slots__ = ()

    def refuse(self, reject: Reject, *, head: RequestHead | None = None) -> None:
        """Answer a request relay could not even parse or admit, then close.

        ``head``: the request's, when it was parsed (one past ``listen.max_connections``, a
        head past ``listen.max_header_bytes`` that llhttp read whole): its
        Origin gets CORS and a browser page load the HTML page (SPEC §5), and a HEAD gets no
        content (RFC 9110 §9.3.2), as for every other answer of relay's (found by review: a
        HEAD got the JSON body, a browser's fetch no Access-Control-Allow-Origin)."""
        self.closing = True
        head_only = head is not None and head.method == b"HEAD"
        self.write(refusal_bytes(self.relay.observer, reject, self.peer, head, head_only=head_only))
        self.close()

    def discarding(self) -> None:
        """The active request was answered by relay (a refusal, a failed dial) before its body
        ended, and the connection is kept: what is left of the body is only read and dropped.
        The client gets ``listen.header_timeout_s`` to send it, as it gets for a head, then
        ``head_timed_out`` closes. Without a deadline a client that announced a body and never
        sent it held the connection for ever, with no credential and no upstream: the header
        timeout's slowloris bound was sidestepped by one Content-Length (found by review).
        nginx bounds the discarding of a body too (``lingering_timeout``). Not once the
        connection closes (the body was too large to drop): the lingering close has its own
        deadline, and a head deadline there answered 408 after the FIN, a write that raised in
        the timers' sweep and ended it for every connection (found by review)."""
        if not self.closing:
            self._discarding = True  # its end (on_message_complete) ends the deadline
            self.relay.timers.expect_head(self)

    def head_timed_out(self) -> None:
        """``listen.header_timeout_s`` passed without a complete request head (slowloris), or
        without the rest of the body of a request relay answered itself (``discarding``)."""
        active = self.active
        if active is not None and active.answered() and not active.request_complete:
            self.close()  # a lingering close, itself bounded (CLOSE_GRACE_S, LINGER_TOTAL_S)
            return
        if self.active is not None or self._paused & PAUSE_CLIENT_FULL:
            # A pipelined head trickling in behind a long response: the response may run
            # for hours (a command stream), so only the head's own wait is restarted. So too
            # while relay itself does not read the client, which has not drained relay's
            # answers yet (found by review: a 408 for a head relay stopped reading).
            self.relay.timers.expect_head(self)
        elif self._head_raw or self._in_head:  # llhttp began a head: bytes were sent
            self.refuse(Reject(reason=Reason.HEADER_TIMEOUT), head=self._head_so_far())
        else:
            self.close()  # nothing was sent: just close

    def internal_error(self, exc: BaseException) -> None:
        """Log a bug with its traceback (never to the client) and end the connection."""
        log.error("internal error on a client connection", exc_info=exc)
        if self.active is None or not self.active.response_started():
            self.refuse(Reject(reason=Reason.INTERNAL))
        else:
            self.abort()

    def _parse_error(self, exc: Exception) -> None:
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            detail = "Invalid HTTP method"
        elif isinstance(exc, httptools.HttpParserInvalidURLError):
            detail = "Invalid request target"
        elif detail == "Pause on PRI/Upgrade":
            # llhttp stops at HTTP/2's connection preface (RFC 9113 §3.4, prior knowledge):
            # a version relay does not speak, said as for any other (RFC 9110 §15.6.6), not in
            # llhttp's words (found by review).
            self._unparseable(Reject(reason=Reason.BAD_VERSION))
            return
        reject = Reject(reason=Reason.BAD_REQUEST, detail=f"Malformed request: {detail}")
        self._unparseable(reject, self._head_so_far())

    def _head_so_far(self) -> RequestHead | None:
        """The refused head as far as llhttp read it, once its request line and a field were
        read: its Origin gets CORS, a browser page load the HTML page, and a HEAD no content
        (SPEC §5, RFC 9110 §9.3.2), as for relay's other answers. llhttp's refusals (Content-
        Length with Transfer-Encoding, RFC 9112 §6.1, and the other framing errors), a 431
        before the head's end (a browser's large Cookie) and a 408 went without them: a
        page's fetch could not read why, and a HEAD's client read the JSON body as the next
        response (found by review). llhttp stops at an error, so the fields after it are
        never seen."""
        parser = self.parser
        if parser is None or not self._in_head or not self._headers:
            return None
        return RequestHead(
            method=parser.get_method(),
            target=self._url,
            version=parser.get_http_version(),
            headers=tuple(self._headers),
        )

    def _unparseable(self, reject: Reject, head: RequestHead | None = None) -> None:
        """Nothing more can be parsed from this connection: refuse, in order, then close.

        Responses go out in request order (RFC 9112 §9.3.2): a refusal found while earlier
        pipelined requests are still being answered waits for them, so that it is never taken
        for the answer to one of them. ``head``: the refused request's, when llhttp parsed it
        whole (a 431 past ``max_header_bytes``), for refuse().
        """
        broken, self.receiving = self.receiving, None
        if self.closing:
            return  # already answered (at its head, in this same read) and closing
        active = self.active
        if active is not None and broken is active:
            # The active request's own body is malformed: it cannot be completed.
            if active.answered():
                self.close()  # its answer is written; let it flush
            elif active.response_started():
                self.abort()
            else:
                # The exchange answers (its upstream closed, then the connection): one
                # exchange, counted and logged once with its 400 and its request, and
                # rendered with its head (CORS). refuse() answered for the connection and the
                # exchange then ended as "client_closed" with status 0: two requests in
                # relay_requests, two access-log lines (found by review).
                self.closing = True
                active.cut(reject)
                self.close()
            return
        if broken is not None and broken in self.queue:
            self.queue.remove(broken)  # a queued request's body: it never started
        if active is None:
            self.refuse(reject, head=head)
            return
        self.parser = None
        self._refusal, self._refused_head = reject, head
