"""Prometheus exposition of relay's tallies (admin ``/metrics``, SPEC §7).

The request path only bumps plain integers in :class:`relay.observe.Observer` (see there for
the cost argument). At scrape time :func:`snapshot` reads them, plus gauges computed from the
live relay (connections, streams, WebSockets, routes, feed freshness), into a JSON-able
:data:`Snapshot`; :func:`families` turns one or several snapshots into metric families for a
``prometheus_client`` registry, which adds the standard ``process_*`` and ``python_*`` ones.

With ``process.workers > 1`` every worker writes its snapshot to
``<run dir>/metrics/<pid>.json`` once a second (and when it exits), and the supervisor, which
serves the admin port, merges the files: counters and histograms are summed over every worker
that ever ran under this supervisor (so a worker that died, even by SIGKILL, still counts up
to its last write, and totals never go backwards: :func:`retire` folds a dead worker's file
into one), gauges only over live workers (summed, or
max/min where summing makes no sense, e.g. the route count). This is prometheus_client's
multiprocess mode in shape, with a snapshot file per worker instead of an mmap write per
increment. ``docs/operations.md`` has the operator's view.

Every label value comes from a closed set (kind, status class, refusal reason, direction,
feed source, result, side): never a sandbox id, an address or anything from a request.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from relay import __version__
from relay.accesslog import ACCESS_LOG
from relay.observe import AUTH_REASONS, CONNECT_BUCKETS, FIRST_BYTE_BUCKETS, Histogram

if TYPE_CHECKING:
    from relay.runtime import Relay

CONTENT_TYPE = CONTENT_TYPE_LATEST
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
    "relay_access_log_dropped_lines": Spec(
        "counter",
        "Access-log lines dropped: standard output did not take them in time (8 MiB waiting, "
        "or still stalled at exit) or a write failed",
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
            "relay_access_log_dropped_lines": [[[], ACCESS_LOG.dropped]],
        },
        "histograms": {
            "relay_first_byte_seconds": [
                _histogram([kind], h) for kind, h in sorted(obs.first_byte.items())
            ],
            "relay_upstream_connect_seconds": [_histogram([], obs.connect)],
        },
        "gauges": gauges,
    }


def _merge_values(values: list[float], how: str) -> float:
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return sum(values)


def families(snapshots: Sequence[Snapshot], live: Sequence[Snapshot]) -> Iterator[Metric]:
    """Metric families summed over ``snapshots`` (counters, histograms) and merged over
    ``live`` (gauges). One process passes its own snapshot as both."""
    for name, spec in SPECS.items():
        if spec.kind == "counter":
            counter = CounterMetricFamily(name, spec.help, labels=spec.labels)
            for key, total in sorted(_counter_sums(snapshots, name).items()):
                counter.add_metric(list(key), total)
            yield counter
        elif spec.kind == "histogram":
            histogram = HistogramMetricFamily(name, spec.help, labels=spec.labels)
            for key, (counts, total) in sorted(_histogram_sums(snapshots, name).items()):
                histogram.add_metric(list(key), _cumulative(spec.buckets, counts), total)
            yield histogram
        else:
            seen: dict[tuple[str, ...], list[float]] = {}
            for snap in live:
                for labels, value in snap.get("gauges", {}).get(name, ()):
                    seen.setdefault(tuple(labels), []).append(value)
            gauge = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            for key, values in sorted(seen.items()):
                gauge.add_metric(list(key), _merge_values(values, spec.merge))
            yield gauge


def _counter_sums(snapshots: Iterable[Snapshot], name: str) -> dict[tuple[str, ...], float]:
    sums: dict[tuple[str, ...], float] = {}
    for snap in snapshots:
        for labels, value in snap.get("counters", {}).get(name, ()):
            key = tuple(labels)
            sums[key] = sums.get(key, 0) + value
    return sums


def _histogram_sums(
    snapshots: Iterable[Snapshot], name: str
) -> dict[tuple[str, ...], tuple[list[int], float]]:
    merged: dict[tuple[str, ...], tuple[list[int], float]] = {}
    for snap in snapshots:
        for labels, counts, total in snap.get("histograms", {}).get(name, ()):
            key = tuple(labels)
            have = merged.get(key)
            if have is None:
                merged[key] = (list(counts), total)
            else:
                merged[key] = (
                    [a + b for a, b in zip(have[0], counts, strict=True)],
                    have[1] + total,
                )
    return merged


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
        running += count
        out.append((bound, running))
    return out


class RelayCollector(Collector):
    """One process's metrics, read from the live relay at scrape time."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        snap = snapshot(self.relay)
        return families([snap], [snap])


def registry_for(collector: Collector) -> CollectorRegistry:
    """A registry with relay's families and the standard process/platform/gc collectors."""
    registry = CollectorRegistry(auto_describe=False)
    for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(standard)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


# -- several workers --------------------------------------------------------------------------
def write_snapshot(directory: Path, snap: Snapshot, name: str = "") -> None:
    """Atomically replace this process's snapshot file (or ``name``)."""
    name = name or f"{snap['pid']}.json"
    path = directory / name
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps(snap, separators=(",", ":")))
    os.replace(tmp, path)


RETIRED = "retired.json"  # the counters and histograms of every worker that has exited


def retire(directory: Path, pid: int) -> None:
    """A worker has exited: fold its last snapshot's counters and histograms into
    :data:`RETIRED` and delete its file (its gauges died with it).

    Kept per pid, the files of dead workers grew by one per restart (a crash-looping worker:
    one every 10 s, each read by every scrape), and a new worker given a dead one's pid (the
    kernel reuses pids) overwrote that file, so the totals went backwards (found by review).
    The supervisor calls this after the worker's exit, so nothing writes either file meanwhile.
    """
    path = directory / f"{pid}.json"
    # Killed between write_snapshot's write and its rename, a worker left its newest snapshot
    # whole in the temporary file; killed during the write, a torn one that does not parse.
    # Either way the file goes with the worker, or it would stay for good (found by review).
    tmp = directory / f".{pid}.json.tmp"
    found = read_snapshots(directory)
    newest = _read(tmp)
    last = newest if newest is not None and newest["pid"] == pid else found.get(pid)
    if last is not None:
        folded = [s for s in (found.get(0), last) if s is not None]
        retired: Snapshot = {
            "pid": 0,
            "counters": {
                name: [[list(k), v] for k, v in sorted(_counter_sums(folded, name).items())]
                for name, spec in SPECS.items()
                if spec.kind == "counter"
            },
            "histograms": {
                name: [
                    [list(k), c, t] for k, (c, t) in sorted(_histogram_sums(folded, name).items())
                ]
                for name, spec in SPECS.items()
                if spec.kind == "histogram"
            },
            "gauges": {},
        }
        write_snapshot(directory, retired, name=RETIRED)
    path.unlink(missing_ok=True)
    tmp.unlink(missing_ok=True)


def read_snapshots(directory: Path) -> dict[int, Snapshot]:
    out: dict[int, Snapshot] = {}
    for path in directory.glob("*.json"):
        snap = _read(path)
        if snap is not None:
            out[snap["pid"]] = snap
    return out


def _read(path: Path) -> Snapshot | None:
    """A snapshot file's content; None when it is gone (retired since the directory was
    listed) or torn. Any other error (EMFILE: the supervisor at its descriptor limit) is
    raised: read as missing, that worker's counters left the sums, which went backwards
    (a counter reset to Prometheus), and ``retire`` deleted a dead worker's file unfolded."""
    try:
        snap = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # torn by a crash (a temporary file): the next scrape reads it
    if isinstance(snap, dict) and isinstance(snap.get("pid"), int) and well_formed(snap):
        return snap
    return None


def well_formed(snap: Snapshot) -> bool:
    """Whether every series in ``snap`` has the shape :func:`families` reads, so that one odd
    file (another version's, or written by hand) costs that file's series, not the scrape."""
    for section in ("counters", "gauges", "histograms"):
        series = snap.get(section, {})
        if not isinstance(series, dict):
            return False
        for name, items in series.items():
            spec = SPECS.get(name)
            if spec is None:
                continue  # families() reads only the names it knows
            if not isinstance(items, list) or not all(_point(spec, i, section) for i in items):
                return False
    return True


def _number(value: object) -> bool:
    """A value the exposition can write: a float, or an int a float can hold (json.loads
    makes ints of any size; float() of 10**400 raises)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) < 2**63)


def _label(value: object) -> bool:
    """A label value the exposition can encode (json.loads admits a lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _point(spec: Spec, item: object, section: str) -> bool:
    if not isinstance(item, list) or not item or not isinstance(item[0], list):
        return False
    labels = item[0]
    if len(labels) != len(spec.labels) or not all(_label(v) for v in labels):
        return False
    if section != "histograms":
        return spec.kind != "histogram" and len(item) == 2 and _number(item[1])
    counts = item[1] if len(item) == 3 else None
    return (
        spec.kind == "histogram"
        and isinstance(counts, list)
        and len(counts) == len(spec.buckets) + 1
        and all(isinstance(c, int) and _number(c) for c in counts)
        and _number(item[2])
    )
