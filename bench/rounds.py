"""Interleaved rounds of one workload across columns: the by-hand check behind a bench miss.

    bench/.venv/bin/python -m bench.rounds paced [--rounds 6] [--seconds 3]
    bench/.venv/bin/python -m bench.rounds closed --columns direct,nginx-1w,relay-1w
    bench/.venv/bin/python -m bench.rounds stream [--compare DIR]

``make bench`` keeps each column's best round of a workload; when a latency target misses by
less than the rounds scatter, the question is whether the miss is relay or the run. This runs
one workload for N rounds, visiting the columns in turn each round (so another tenant's burst
hits them alike), with the bench's own origins, nginx config and pinning, and prints every
round and each column's median p50 / p99. ``--compare DIR`` adds a relay-1w of another source
tree (a folder holding a ``relay/`` package), as ``bench.profile --compare`` does.

Workloads: ``paced`` (small GET, 50 connections each pausing a random 1-19 ms, as the bench's
paced row), ``closed`` (small GET c50, wrk's closed loop) and ``stream`` (the Connect stream,
3 streams of 1,000 events per round; added latency = the column's minus direct's median).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import workloads
from bench.procs import Proc
from bench.stack import Column, Stack

PACED_DELAY_MS = 10  # as bench/run.py: 50 connections pausing 10 ms on average, ~5k req/s
KNOWN = {
    "direct": Column("direct", "direct"),
    "nginx-1w": Column("nginx-1w", "nginx"),
    "relay-1w": Column("relay-1w", "relay"),
    "floor-1w": Column("floor-1w", "floor"),
}


def measure(workload: str, column: Column, proxy: Proc | None, seconds: int) -> dict[str, Any]:
    """One round: p50 and p99 in µs (event latency for the stream), plus what the bench meter
    adds (CPU per request, foreign CPU)."""
    if workload == "stream":
        data = workloads.client(column, proxy, "stream", "py", "--reps", "1")
        latency = data.get("latency_us", {})
    else:
        delay = PACED_DELAY_MS if workload == "paced" else 0
        data = workloads.small_get(column, proxy, 50, seconds, delay)
        latency = data.get("latency_us", {})
    if "error" in data:
        raise RuntimeError(f"{column.name}: {data['error']}")
    return {
        "p50": latency.get("p50"),
        "p99": latency.get("p99"),
        "req_s": data.get("req_s"),
        "foreign": data.get("foreign_cpu_pct"),
    }


def label(column: Column) -> str:
    return f"{column.name}@compare" if column.src else column.name


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("paced", "closed", "stream"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=int, default=3, help="per round (small GET)")
    parser.add_argument("--columns", default="direct,nginx-1w,relay-1w")
    parser.add_argument("--compare", default="", help="also relay-1w from this source tree")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 30 or not 1 <= args.seconds <= 10:
        parser.error("--rounds 1-30 and --seconds 1-10 (every load loop is bounded)")
    try:
        columns = [KNOWN[name] for name in args.columns.split(",")]
    except KeyError as exc:
        parser.error(f"unknown column {exc}; known: {', '.join(KNOWN)}")
    if args.workload != "stream" and KNOWN["floor-1w"] in columns:
        parser.error("floor-1w forwards to the Python origin only: use it with stream")
    if args.compare:
        columns.append(Column("relay-1w", "relay", src=str(Path(args.compare).resolve())))
    run_dir = Path(tempfile.mkdtemp(prefix="relay-rounds-"))
    run_dir.chmod(0o755)  # nginx workers run as nobody and serve files from here
    stack = Stack(run_dir)
    results: dict[str, list[dict[str, Any]]] = {label(c): [] for c in columns}
    try:
        stack.start_origins()
        proxies = {label(c): stack.start_proxy(c) for c in columns if c.kind != "direct"}
        workloads.OURS[:] = stack.pids()
        for number in range(args.rounds):
            for column in columns:
                name = label(column)
                got = measure(args.workload, column, proxies.get(name), args.seconds)
                results[name].append(got)
                req_s = f"{got['req_s']:>9,.0f} req/s" if got["req_s"] else ""
                print(
                    f"round {number}  {name:<16} p50 {got['p50']:>6,.0f} µs"
                    f"  p99 {got['p99']:>6,.0f} µs  {req_s}  foreign CPU {got['foreign']}%",
                    flush=True,
                )
    finally:
        stack.stop_all()
    print(f"\nmedians of {args.rounds} interleaved rounds ({args.workload}):")
    base = results.get("direct")
    for name, rounds in results.items():
        p50 = statistics.median(r["p50"] for r in rounds)
        p99 = statistics.median(r["p99"] for r in rounds)
        added = ""
        if base and name != "direct":
            added = (
                f"  added over direct: p50 +{p50 - statistics.median(r['p50'] for r in base):.0f}"
                f"  p99 +{p99 - statistics.median(r['p99'] for r in base):.0f}"
            )
        low = min(r["p99"] for r in rounds)
        high = max(r["p99"] for r in rounds)
        spread = f"p99 over the rounds {low:,.0f}-{high:,.0f}"
        print(f"  {name:<16} p50 {p50:,.0f} µs  p99 {p99:,.0f} µs  ({spread}){added}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
