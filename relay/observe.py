"""What relay tells operators: the JSON access log and counters.

One access-log line per exchange (SPEC §7) on the ``relay.access`` logger. A line carries the
path *without* its query (a signed URL's query holds a signature), never a header value, and
never a token: the fields are built here from relay's own decision, not copied from the
request. Counters are plain integers here; the Prometheus exposition reads them.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from relay.core.model import Forward, Reject
from relay.core.routes import RouteError

if TYPE_CHECKING:
    from relay.forward import Exchange
    from relay.websocket import Splice

access_log = logging.getLogger("relay.access")
log = logging.getLogger("relay")


class Observer:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (kind, status class)
        self.refusals: Counter[str] = Counter()  # reason label
        self.route_errors = 0
        self.feed_errors = 0
        self.revocations = 0
        self.websockets_closed = 0

    def refused(self, reject: Reject, peer: str) -> None:
        self.refusals[reject.reason.label] += 1

    def exchange_done(self, exchange: Exchange) -> None:
        decision = exchange.decision
        kind = decision.kind.value if isinstance(decision, Forward) else "refused"
        status = exchange.status
        self.requests[(kind, f"{status // 100}xx" if status else "none")] += 1
        if not access_log.isEnabledFor(logging.INFO):
            return
        target = decision.target if isinstance(decision, Forward) else None
        sandbox_id = target.sandbox_id if target else None
        if isinstance(decision, Reject):
            sandbox_id = decision.sandbox_id
        head = exchange.head
        path = decision.log_path if isinstance(decision, Forward) else _path_only(head.target)
        access_log.info(
            json.dumps(
                {
                    "time": round(time.time(), 3),
                    "client": exchange.client.peer,
                    "sandbox_id": sandbox_id,
                    "port": target.port if target else None,
                    "method": head.method.decode("latin-1"),
                    "path": path,
                    "status": status,
                    "bytes_in": exchange.bytes_in,
                    "bytes_out": exchange.bytes_out,
                    "duration_ms": round((time.monotonic() - exchange.started_at) * 1000, 2),
                    "reason": exchange.reason or None,
                },
                separators=(",", ":"),
            )
        )

    def splice_done(self, splice: Splice) -> None:
        self.websockets_closed += 1
        if not access_log.isEnabledFor(logging.INFO):
            return
        target = splice.decision.target
        access_log.info(
            json.dumps(
                {
                    "time": round(time.time(), 3),
                    "client": splice.client.peer,
                    "sandbox_id": target.sandbox_id if target else None,
                    "port": target.port if target else None,
                    "method": "WEBSOCKET",
                    "path": splice.decision.log_path,
                    "status": 101,
                    "bytes_in": splice.bytes_in,
                    "bytes_out": splice.bytes_out,
                    "duration_ms": round((time.monotonic() - splice.started_at) * 1000, 2),
                    "reason": splice.reason or None,
                },
                separators=(",", ":"),
            )
        )

    def rejected_routes(self, source: str, errors: list[RouteError]) -> None:
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
        log.error("route feed error: source=%s %s", source, message)

    def revoked(self, sandbox_ids: frozenset[str], ended: int) -> None:
        self.revocations += len(sandbox_ids)
        if sandbox_ids:
            log.info("revoked %d route(s), ended %d live exchange(s)", len(sandbox_ids), ended)


def _path_only(target: bytes) -> str:
    return target.partition(b"?")[0].decode("latin-1")
