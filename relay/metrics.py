"""Prometheus exposition of relay's tallies (admin ``/metrics``, SPEC §7).

:func:`families` turns one or several snapshots (:mod:`relay.metric_snapshot`, which also
names every family) into metric families for a ``prometheus_client`` registry, which adds the
standard ``process_*`` and ``python_*`` ones.

With ``process.workers > 1`` every worker writes its snapshot to
``<run dir>/metrics/<pid>.json`` once a second (and when it exits), and the supervisor, which
serves the admin port, merges the files: counters and histograms are summed over every worker
that ever ran under this supervisor (so a worker that died, even by SIGKILL, still counts up
to its last write, and totals never go backwards: :func:`retire` folds a dead worker's file
into one), gauges only over live workers (summed, or
max/min where summing makes no sense, e.g. the route count). This is prometheus_client's
multiprocess mode in shape, with a snapshot file per worker instead of an mmap write per
increment. ``docs/operations.md`` has the operator's view.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

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

from relay.metric_snapshot import SPECS, Snapshot, Spec, snapshot

if TYPE_CHECKING:
    from relay.runtime import Relay

CONTENT_TYPE = CONTENT_TYPE_LATEST


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
