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
paced row), ``closed`` (small GET c50, wrk's closed loop), ``stream`` (the Connect stream,
3 streams of 1,000 events per round; added latency = the column's minus direct's median), and
``upload`` / ``download`` (64 MiB transfers, 5 timed per round after an untimed warm-up, as
the bench; MiB/s and its ratio to direct's median).
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

PACED_DELAY_MS = 10  # as bench/plan.py: 50 connections pausing 10 ms on average, ~5k req/s
KNOWN = {
    "direct": Column("direct", "direct"),
    "nginx-1w": Column("nginx-1w", "nginx"),
    "relay-1w": Column("relay-1w", "relay"),
    "floor-1w": Column("floor-1w", "floor"),
}


TRANSFERS = ("upload", "download")


def measure(
    workload: str, column: Column, proxy: Proc | None, seconds: int, stack: Stack
) -> dict[str, Any]:
    """One round: p50 and p99 in µs (event latency for the stream), or MiB/s of a transfer,
    plus what the bench meter adds (CPU per request, foreign CPU)."""
    if workload in TRANSFERS:
        reps = workloads.Durations().transfer_reps
        args = ["--reps", str(reps)]
        if workload == "download":  # from the nginx origin's file, checked as the bench does
            args += ["--size", str(stack.blob_size), "--crc", str(stack.blob_crc)]
        service = "py" if workload == "upload" else "app"
        data = workloads.client(column, proxy, workload, service, *args)
        if "error" in data:
            raise RuntimeError(f"{column.name}: {data['error']}")
        cpu = data.get("proxy_cpu_s")
        return {
            "mib_s": data.get("mib_s"),
            # The proxy's CPU per 64 MiB transfer (the client's untimed first one included):
            # steadier than MiB/s, which follows whatever else the two cores run.
            "cpu_ms": None if cpu is None else cpu * 1000 / (reps + 1),
            "foreign": data.get("foreign_cpu_pct"),
        }
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


def transfer_summary(results: dict[str, list[dict[str, Any]]]) -> None:
    direct = results.get("direct")
    base = statistics.median(r["mib_s"] for r in direct) if direct else None
    for name, rounds in results.items():
        rates = [r["mib_s"] for r in rounds]
        median = statistics.median(rates)
        ratio = f"  {median / base:.2f}x direct" if base else ""
        cpus = [r["cpu_ms"] for r in rounds if r["cpu_ms"] is not None]
        cpu = f"  proxy CPU {statistics.median(cpus):.1f} ms/transfer" if cpus else ""
        print(
            f"  {name:<16} {median:,.0f} MiB/s (rounds {min(rates):,.0f}-{max(rates):,.0f})"
            f"{ratio}{cpu}"
        )


def label(column: Column) -> str:
    return f"{column.name}@compare" if column.src else column.name


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("paced", "closed", "stream", *TRANSFERS))
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
    if args.workload not in ("stream", "upload") and KNOWN["floor-1w"] in columns:
        parser.error("floor-1w forwards to the Python origin only: use it with stream or upload")
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
                got = measure(args.workload, column, proxies.get(name), args.seconds, stack)
                results[name].append(got)
                if args.workload in TRANSFERS:
                    cpu = f"  proxy CPU {got['cpu_ms']:.1f} ms/transfer" if got["cpu_ms"] else ""
                    print(
                        f"round {number}  {name:<16} {got['mib_s']:>7,.0f} MiB/s{cpu}"
                        f"  foreign CPU {got['foreign']}%",
                        flush=True,
                    )
                    continue
                req_s = f"{got['req_s']:>9,.0f} req/s" if got["req_s"] else ""
                print(
                    f"round {number}  {name:<16} p50 {got['p50']:>6,.0f} µs"
                    f"  p99 {got['p99']:>6,.0f} µs  {req_s}  foreign CPU {got['foreign']}%",
                    flush=True,
                )
    finally:
        stack.stop_all()
    print(f"\nmedians of {args.rounds} interleaved rounds ({args.workload}):")
    if args.workload in TRANSFERS:
        transfer_summary(results)
        return 0
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
