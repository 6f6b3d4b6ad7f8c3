"""What relay tells operators: the JSON access log and counters.

One access-log line per exchange (SPEC §7), written by ``relay.accesslog``. A line carries the
path *without* its query (a signed URL's query holds a signature), never a header value, and
never a token: the fields are built here from relay's own decision, not copied from the
request. Counters are plain integers here; the Prometheus exposition reads them.

Why plain integers and not ``prometheus_client`` metric objects on the request path: a
pre-bound ``Counter.inc()`` costs about 0.45 µs and a ``Histogram.observe()`` 1 µs in one
process, and 1.5 µs / 2 µs in prometheus' multiprocess mode (mmap files), against 0.15 µs
for a ``collections.Counter`` increment; relay records four or five values per request.
``relay.metrics`` turns a snapshot of these tallies into Prometheus families at scrape time.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from relay.accesslog import ACCESS_LOG
from relay.core.answers import log_members
from relay.core.model import Forward, Reason, Reject, RequestHead
from relay.core.routes import RouteError

if TYPE_CHECKING:
    from relay.finish import Finish  # an Exchange, typed by the fields it is observed by
    from relay.websocket import Splice

log = logging.getLogger("relay")


# Upper bounds (seconds) of histogram buckets; +Inf is implied.
FIRST_BYTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONNECT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# Refusal reasons that are credential failures (relay_auth_failures_total).
AUTH_REASONS = frozenset(
    r.label
    for r in (Reason.ENVD_UNAUTHORIZED, Reason.TRAFFIC_TOKEN_MISSING, Reason.TRAFFIC_TOKEN_INVALID)
)


class Histogram:
    """Bucket counts (``le`` semantics, not cumulative) and the sum of observations."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


_STATUS_CLASSES = ("none", "1xx", "2xx", "3xx", "4xx", "5xx")
# The ``status`` label of ``status // 100`` for any status below 1000 (llhttp reads three
# digits; 0 is "no response"): the request tally counts by that index, labelled at scrape.
_CLASS_BY_HUNDRED = (*_STATUS_CLASSES, "none", "none", "none", "none")


class Observer:
    def __init__(self) -> None:
        # kind → requests by status // 100 (_CLASS_BY_HUNDRED), read as ``requests``: one
        # list index per request instead of a label tuple, its hash and a Counter update.
        self._tally: dict[str, list[int]] = {}
        self.refusals: Counter[str] = Counter()  # reason label
        self.route_errors = 0
        self.feed_errors = 0
        self.revocations = 0
        self.websockets_closed = 0
        # Added for the Prometheus exposition (relay.metrics); labels are bounded sets.
        # Body bytes each way as the access log counts them: read from clients (a refused
        # request's dropped body too) and written to them (relay's own answers too).
        self.bytes_in = 0
        self.bytes_out = 0
        self.first_byte: dict[str, Histogram] = {}  # kind → time to the response head
        self.connect = Histogram(CONNECT_BUCKETS)  # one successful upstream TCP connect
        self.connect_errors: Counter[str] = Counter()  # refused | timeout | error
        self.route_rejections: Counter[str] = Counter()  # source
        self.feed_failures: Counter[str] = Counter()  # source
        self.revoked_exchanges = 0
        self.shed_idle: Counter[str] = Counter()  # client | upstream (relay.room)
        self.reloads: Counter[str] = Counter()  # ok | error
        self.tls_reloads: Counter[str] = Counter()  # ok | error
        # timeout | closed | protocol | error (relay.handshake.failure_reason)
        self.tls_handshake_failures: Counter[str] = Counter()
        # not_allowed | handshakes_full: connections reset at accept, before any HTTP
        # (relay.hub.admit, relay.handshake.TlsAccept); a 503 past max_connections is a refusal
        self.connections_reset: Counter[str] = Counter()
        self.feed_failing_since: float | None = None  # monotonic; None while the feed is fine

    @property
    def requests(self) -> Counter[tuple[str, str]]:
        """Requests per (kind, status class), for the exposition (relay.metrics)."""
        out: Counter[tuple[str, str]] = Counter()
        for kind, counts in self._tally.items():
            for hundred, count in enumerate(counts):
                if count:
                    out[(kind, _CLASS_BY_HUNDRED[hundred])] += count
        return out

    def _count(self, kind: str, status: int) -> None:
        counts = self._tally.get(kind)
        if counts is None:
            counts = self._tally[kind] = [0] * len(_CLASS_BY_HUNDRED)
        counts[status // 100 if 0 <= status < 1000 else 0] += 1

    def refused(self, reject: Reject, peer: str) -> None:
        self.refusals[reject.reason.label] += 1

    def connection_refused(
        self, reject: Reject, peer: str, head: RequestHead | None = None, sent: int = 0
    ) -> None:
        """A refusal with no exchange (unparseable request, 431, slow head, overload).
        ``head``: the request's when it was parsed (an overload, a whole head past the
        limit), whose method and path its line shows (docs/operations.md: null only for a
        request refused before it could be parsed; found by review). ``sent``: the answer's
        body bytes, its line's bytes_out as for an exchange's refusal (it was 0)."""
        self.refused(reject, peer)
        self._count("refused", reject.status)
        self.bytes_out += sent  # relay's own answer, as an exchange's refusal counts its own
        if ACCESS_LOG.enabled:
            ACCESS_LOG.write(
                time=time.time(),
                client=peer,
                sandbox_id=None,
                port=None,
                method=None if head is None else head.method.decode("latin-1"),
                path=None if head is None else _path_only(head.target),
                status=reject.status,
                bytes_in=0,
                bytes_out=sent,
                duration_ms=None,
                reason=reject.reason.label,
            )

    def first_response_byte(self, exchange: Finish) -> None:
        """The upstream's final response head arrived (``Exchange.response_head``)."""
        decision = exchange.decision
        if not isinstance(decision, Forward):
            return
        kind = decision.kind._value_  # a member's value, without the Enum descriptor
        histogram = self.first_byte.get(kind)
        if histogram is None:
            histogram = self.first_byte[kind] = Histogram(FIRST_BYTE_BUCKETS)
        # Histogram.observe spelled out: one call less on every response.
        seconds = time.monotonic() - exchange.started_at
        histogram.counts[bisect.bisect_left(FIRST_BYTE_BUCKETS, seconds)] += 1
        histogram.total += seconds

    def dial_done(self, seconds: float) -> None:
        self.connect.observe(seconds)

    def dial_failed(self, reason: str) -> None:
        self.connect_errors[reason] += 1

    def idle_shed(self, clients: int, upstreams: int) -> None:
        self.shed_idle["client"] += clients
        self.shed_idle["upstream"] += upstreams

    def routes_installed(self, source: str, count: int) -> None:
        self.feed_failing_since = None

    def exchange_done(self, exchange: Finish) -> None:
        # On the path of every request: each value is read once, and the usual line takes
        # AccessLog.served, which has no conditionals (relay.accesslog).
        decision = exchange.decision
        status = exchange.status
        bytes_in = exchange.bytes_in
        bytes_out = exchange.bytes_out
        members: str | None
        if isinstance(decision, Forward):
            kind = decision.kind._value_
            members = decision.log_fields  # made once with the (often remembered) decision
        else:
            # No decision: a pipelined request whose client left before relay got to it.
            # relay refused nothing (found by review: counted as "refused", an alert on
            # refusals fired on clients that gave up).
            kind = "refused" if decision is not None else "abandoned"
            members = None  # made below, only for a line
        counts = self._tally.get(kind)  # _count, spelled out
        if counts is None:
            counts = self._tally[kind] = [0] * len(_CLASS_BY_HUNDRED)
        counts[status // 100 if 0 <= status < 1000 else 0] += 1
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        access = ACCESS_LOG
        if not access.buffering and not access.enabled:
            return
        if members is None:
            head = exchange.head
            named = decision.named if isinstance(decision, Reject) else None
            members = log_members(
                named.sandbox_id
                if named is not None
                else (decision.sandbox_id if isinstance(decision, Reject) else None),
                named.port if named is not None else None,
                head.method.decode("latin-1"),
                _path_only(head.target),
            )
        duration_ms = (time.monotonic() - exchange.started_at) * 1000
        if exchange.reason:
            access.write_line(
                time.time(),
                exchange.client.peer,
                members,
                status,
                bytes_in,
                bytes_out,
                duration_ms,
                exchange.reason,
            )
        else:
            access.served(
                time.time(), exchange.client.peer, members, status, bytes_in, bytes_out, duration_ms
            )

    def splice_done(self, splice: Splice) -> None:
        self.websockets_closed += 1
        self.bytes_in += splice.bytes_in
        self.bytes_out += splice.bytes_out
        if not ACCESS_LOG.enabled:
            return
        target = splice.decision.target
        ACCESS_LOG.write(
            time=time.time(),
            client=splice.client.peer,
            sandbox_id=target.sandbox_id if target else None,
            port=target.port if target else None,
            method="WEBSOCKET",
            path=splice.decision.log_path,
            status=101,
            bytes_in=splice.bytes_in,
            bytes_out=splice.bytes_out,
            duration_ms=(time.monotonic() - splice.started_at) * 1000,
            reason=splice.reason or None,
        )

    def rejected_routes(self, source: str, errors: list[RouteError]) -> None:
        self.route_rejections[source] += len(errors)
        for error in errors:
            self.route_errors += 1
            log.warning(
                "route rejected: source=%s sandbox_id=%s reason=%s",
                source,
                error.sandbox_id or "?",
                error.reason,
            )

    def feed_error(self, source: str, message: str) -> None:
        self.feed_errors += 1
        self.feed_failures[source] += 1
        if self.feed_failing_since is None:
            self.feed_failing_since = time.monotonic()
        log.error("route feed error: source=%s %s", source, message)

    def revoked(self, sandbox_ids: frozenset[str], ended: int) -> None:
        self.revocations += len(sandbox_ids)
        self.revoked_exchanges += ended
        if sandbox_ids:
            log.info("revoked %d route(s), ended %d live exchange(s)", len(sandbox_ids), ended)


def _path_only(target: bytes) -> str:
    """A refused request's target for its log line (SPEC §7: no credential): without its
    query or fragment (a browser sends none; one sent, an OAuth ``#access_token=``, is
    refused), and an absolute-form target (refused too) without its userinfo, RFC 3986
    §3.2.1's "user:password" (found by review: both were logged as sent). Everything up to
    the last "@" goes, before the query is cut: a password with a "?" or "/" its client did
    not percent-encode (llhttp takes both) had its start logged, cut there as if a query or
    the path began (found by the next review). An "@" in such a target's path takes the host
    with it: the form is refused anyway, and a line without it leaks nothing."""
    path = target
    if not path.startswith(b"/"):
        scheme, sep, rest = path.partition(b"://")
        if not sep:  # authority-form (CONNECT), where llhttp takes a userinfo too
            scheme, rest = b"", path
        path = scheme + sep + rest.rpartition(b"@")[2]
    return path.partition(b"?")[0].partition(b"#")[0].decode("latin-1")
