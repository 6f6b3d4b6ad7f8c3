"""relay's own answer to a request, instead of an upstream's.

:class:`Answer` writes relay's answer for a :class:`~relay.core.model.Reject` (rendered by the
pure ``relay.core.answers``): a request refused, or an exchange cut before any response byte
was written (``relay.respond``). It decides whether the client connection can be kept: only
when the rest of the request body can be read and dropped (within ``DISCARD_LIMIT``), and not
when the client waits for a ``100 Continue`` that a refusal never sends. ``http_date`` is the
Date of relay's own answers, and of an upstream response that has none.

A base of :class:`relay.forward.Exchange`, between :class:`relay.finish.Finish` (the fields,
and the end) and :class:`relay.respond.Respond` (the upstream's response).
"""

from __future__ import annotations

import email.utils
import time
from typing import TYPE_CHECKING

from relay.core import headers as header_rules
from relay.core.answers import answer_bytes, render
from relay.core.model import Reject, RequestHead
from relay.finish import ANSWERED, Finish

if TYPE_CHECKING:
    from relay.observe import Observer

# A refused request's body is read and dropped up to this size so that the connection can be
# kept; past it the connection is closed after the answer.
DISCARD_LIMIT = 1 << 20

_date: tuple[int, bytes] = (0, b"")  # the second http_date() last formatted, and its text


def http_date() -> bytes:
    """Now as an IMF-fixdate (RFC 9110 §5.6.7), for the Date of relay's own answers (§6.6.1),
    formatted once per second (~3 µs each), as nginx and aiohttp cache theirs."""
    global _date  # noqa: PLW0603 - one value per process, replaced whole
    now = int(time.time())
    if now != _date[0]:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


def refusal_bytes(
    observer: Observer, reject: Reject, peer: str, head: RequestHead | None, *, head_only: bool
) -> bytes:
    """A connection's refusal, counted and rendered, closing (``relay.refusals``, and the TLS
    listener's plain-HTTP 400, ``relay.handshake``): the head's Origin gets CORS, a HEAD only
    the head (RFC 9110 §9.3.2), and the access log the body's size as sent."""
    answer = render(reject, head.headers if head is not None else ())
    observer.connection_refused(reject, peer, head, 0 if head_only else len(answer.body))
    return answer_bytes(answer, close=True, head_only=head_only, date=http_date())


class Answer(Finish):
    """Relay's own answers (see the module docstring)."""

    __slots__ = ()

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
