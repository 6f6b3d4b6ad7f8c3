"""What relay exports to Prometheus (SPEC §7), and one relay's values of it as plain data.

The request path only bumps plain integers in :class:`relay.observe.Observer` (see there for
the cost argument). :data:`SPECS` names every family (kind, help, labels, how a gauge merges
across workers, histogram buckets). :func:`snapshot` reads the tallies, plus gauges computed
from the live relay (connections, streams, WebSockets, routes, feed freshness), into a
JSON-able :data:`Snapshot`, at scrape time or, in a worker, once a second for its supervisor;
:mod:`relay.metrics` turns snapshots into families and keeps the workers' snapshot files.

Every label value comes from a closed set (kind, status class, refusal reason, direction,
feed source, result, side): never a sandbox id, an address or anything from a request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay import __version__, errorlog
from relay.accesslog import ACCESS_LOG
from relay.observe import AUTH_REASONS, CONNECT_BUCKETS, FIRST_BYTE_BUCKETS, Histogram

if TYPE_CHECKING:
    from relay.runtime import Relay

# {"pid": int, "counters"|"gauges": {name: [[labels, value]]},
#  "histograms": {name: [[labels, bucket counts, sum]]}}
Snapshot = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    merge: str = "sum"  # gauges across workers: sum | max | min
    buckets: tuple[float, ...] = ()


SPECS: dict[str, Spec] = {
    "relay_requests": Spec(
        "counter",
        "Requests, by kind (envd, app, management; refused: answered by relay itself; "
        "abandoned: pipelined, its client left before relay got to it) and status class "
        "(none: no answer)",
        ("kind", "status_class"),
    ),
    "relay_refusals": Spec("counter", "Answers relay made itself, by reason", ("reason",)),
    "relay_auth_failures": Spec(
        "counter", "Requests refused for a missing or wrong credential, by reason", ("reason",)
    ),
    "relay_bytes": Spec(
        "counter",
        "Body bytes (in: read from clients, bodies relay dropped included; out: written to "
        "clients, relay's own answers included), counted when the exchange or WebSocket ends",
        ("direction",),
    ),
    "relay_first_byte_seconds": Spec(
        "histogram",
        "Time from a complete request head to the upstream's response head, by kind",
        ("kind",),
        buckets=FIRST_BYTE_BUCKETS,
    ),
    "relay_upstream_connect_seconds": Spec(
        "histogram", "Duration of successful upstream TCP connects", buckets=CONNECT_BUCKETS
    ),
    "relay_upstream_connect_errors": Spec(
        "counter",
        "Upstream dials that failed after their retries (refused, timeout, error)",
        ("reason",),
    ),
    "relay_idle_connections_shed": Spec(
        "counter",
        "Idle keep-alive connections closed to make room near the open-file limit, by side "
        "(client, upstream)",
        ("side",),
    ),
    "relay_websocket_sessions": Spec("counter", "WebSocket sessions that ended"),
    "relay_revocations": Spec("counter", "Routes revoked (removed or changed identity)"),
    "relay_revoked_exchanges": Spec(
        "counter", "In-flight exchanges and WebSockets ended by a revocation"
    ),
    "relay_route_rejections": Spec(
        "counter", "Routes rejected by validation, by feed source", ("source",)
    ),
    "relay_feed_errors": Spec("counter", "Route feed failures, by source", ("source",)),
    "relay_feed_snapshots": Spec(
        "counter", "Full route tables loaded by the Redis feed (start, reconnect, gap, SIGHUP)"
    ),
    "relay_feed_gaps": Spec(
        "counter", "Redis feed resyncs because unread stream entries were trimmed away"
    ),
    "relay_feed_events": Spec("counter", "Route stream entries applied by the Redis feed"),
    "relay_reloads": Spec("counter", "Configuration reloads (SIGHUP), by result", ("result",)),
    "relay_tls_reloads": Spec(
        "counter", "TLS certificate reloads (SIGHUP), by result", ("result",)
    ),
    "relay_tls_handshake_failures": Spec(
        "counter",
        "TLS handshakes that ended without a connection, by reason (timeout: "
        "header_timeout_s from accept; closed: the client left or reset; protocol: an SSL "
        "error such as no shared version or cipher, or bytes that are not TLS; error: "
        "relay's side). The plain-HTTP 400 counts in relay_refusals_total only",
        ("reason",),
    ),
    "relay_connections_reset": Spec(
        "counter",
        "Client connections reset at accept, before any HTTP, by reason (not_allowed: outside "
        "listen.allowed_clients; handshakes_full: a TLS listener with listen.max_connections "
        "handshakes in flight). Not relay's own stop",
        ("reason",),
    ),
    "relay_access_log_dropped_lines": Spec(
        "counter",
        "Access-log lines dropped: standard output did not take them in time (8 MiB waiting, "
        "or still stalled at exit) or a write failed",
    ),
    "relay_log_dropped_lines": Spec(
        "counter",
        "Diagnostic log lines dropped: standard error did not take them in time (1 MiB "
        "waiting, or still stalled at exit) or a write failed",
    ),
    "relay_client_connections": Spec("gauge", "Open client connections"),
    "relay_active_exchanges": Spec(
        "gauge", "Client connections with a request or stream in flight (WebSockets excluded)"
    ),
    "relay_active_websockets": Spec("gauge", "WebSocket sessions open"),
    "relay_upstream_connections": Spec("gauge", "Open upstream connections, idle or in use"),
    "relay_routes": Spec("gauge", "Routes in the table", merge="max"),
    "relay_feed_ready": Spec(
        "gauge", "1 while the route table is ready and not stale", merge="min"
    ),
    "relay_feed_stale": Spec("gauge", "1 while the route cache is stale", merge="max"),
    "relay_feed_staleness_seconds": Spec(
        "gauge",
        "Seconds since the route feed started failing (0 while it is healthy)",
        merge="max",
    ),
    "relay_draining": Spec("gauge", "1 while relay is draining for shutdown", merge="max"),
    "relay_tls_certificate_expiry_timestamp_seconds": Spec(
        "gauge", "notAfter of the served certificate (Unix time)", merge="min"
    ),
    "relay_build_info": Spec("gauge", "relay's version", ("version",), merge="max"),
}


def _pairs(counter: Iterable[tuple[Any, int]]) -> list[list[Any]]:
    return [[list(k) if isinstance(k, tuple) else [k], v] for k, v in counter]


def _histogram(labels: list[str], h: Histogram) -> list[Any]:
    return [labels, list(h.counts), h.total]


def snapshot(relay: Relay) -> Snapshot:
    """The relay's tallies and current gauges as plain data."""
    obs = relay.observer
    now = time.monotonic()
    connections = relay.connections
    active = sum(1 for c in connections if c.active is not None and c.splice is None)
    websockets = sum(1 for c in connections if c.splice is not None)
    feed = relay.feed_state
    since = obs.feed_failing_since
    gauges: dict[str, list[list[Any]]] = {
        "relay_client_connections": [[[], len(connections)]],
        "relay_active_exchanges": [[[], active]],
        "relay_active_websockets": [[[], websockets]],
        "relay_upstream_connections": [[[], relay.pool.opened]],
        "relay_routes": [[[], len(relay.table)]],
        "relay_feed_ready": [[[], int(feed.ready and not feed.stale)]],
        "relay_feed_stale": [[[], int(feed.stale)]],
        "relay_feed_staleness_seconds": [[[], round(now - since, 3) if since else 0.0]],
        "relay_draining": [[[], int(relay.draining)]],
        "relay_build_info": [[[__version__], 1]],
    }
    if relay.tls is not None:
        expiry = relay.tls.info.not_after.timestamp()
        gauges["relay_tls_certificate_expiry_timestamp_seconds"] = [[[], expiry]]
    return {
        "pid": os.getpid(),
        "counters": {
            "relay_requests": _pairs(obs.requests.items()),
            "relay_refusals": _pairs(obs.refusals.items()),
            "relay_auth_failures": _pairs(
                (r, n) for r, n in obs.refusals.items() if r in AUTH_REASONS
            ),
            "relay_bytes": [[["in"], obs.bytes_in], [["out"], obs.bytes_out]],
            "relay_upstream_connect_errors": _pairs(obs.connect_errors.items()),
            "relay_idle_connections_shed": _pairs(obs.shed_idle.items()),
            "relay_websocket_sessions": [[[], obs.websockets_closed]],
            "relay_revocations": [[[], obs.revocations]],
            "relay_revoked_exchanges": [[[], obs.revoked_exchanges]],
            "relay_route_rejections": _pairs(obs.route_rejections.items()),
            "relay_feed_errors": _pairs(obs.feed_failures.items()),
            # The file feed has none of these: they stay 0.
            "relay_feed_snapshots": [[[], getattr(relay.feed, "snapshots", 0)]],
            "relay_feed_gaps": [[[], getattr(relay.feed, "gaps", 0)]],
            "relay_feed_events": [[[], getattr(relay.feed, "events", 0)]],
            "relay_reloads": _pairs(obs.reloads.items()),
            "relay_tls_reloads": _pairs(obs.tls_reloads.items()),
            "relay_tls_handshake_failures": _pairs(obs.tls_handshake_failures.items()),
            "relay_connections_reset": _pairs(obs.connections_reset.items()),
            "relay_access_log_dropped_lines": [[[], ACCESS_LOG.dropped]],
            "relay_log_dropped_lines": [[[], errorlog.dropped()]],
        },
        "histograms": {
            "relay_first_byte_seconds": [
                _histogram([kind], h) for kind, h in sorted(obs.first_byte.items())
            ],
            "relay_upstream_connect_seconds": [_histogram([], obs.connect)],
        },
        "gauges": gauges,
    }
