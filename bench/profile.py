"""Profile relay (1 worker) under the small-GET workload with py-spy, next to nginx's CPU.

    python -m bench.profile                      # standalone: starts its own origins
    python -m bench.profile --cpu-only [--relay-src DIR]   # A/B: CPU per request only
    make bench PROFILE=1                         # after the main run, same stack

Same pinning as the benchmark (relay on core 1; wrk, origins and py-spy on core 0). Steps:

1. relay and nginx (1 worker each, access log on as in the main table) each get wrk c50 for
   a few seconds without the profiler: CPU per request from /proc/<pid>/stat, user and system
   separately (system time is the kernel's share: syscalls, loopback TCP).
2. Under one longer wrk run, ``py-spy record --native`` writes the flame graph SVG, a second
   recording writes raw collapsed stacks, and ``py-spy dump --native`` takes one snapshot.
3. ``strace -c`` counts the syscalls per request of relay and of nginx.
4. The collapsed stacks are summarised into the top functions by self and inclusive samples
   and into coarse buckets (relay's own code, llhttp parsing, uvloop, logging...).

py-spy stops the process at every sample (``--native`` needs it), which slows relay while it
records: the percentages are the useful output, not the throughput during the recording.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import workloads
from bench.procs import CLK_TCK, Proc, cpus_text
from bench.stack import BENCH, HOST_APP, LOAD_CPUS, Column, Stack
from bench.workloads import Durations

RESULTS = BENCH / "results"
PY_SPY = Path(sys.executable).parent / "py-spy"
RATE = 200

# Who a sample is charged to: the innermost frame of relay's own code or of the logging
# stack (skipping libc, uvloop and llhttp frames, which run on behalf of that code).
OWNERS = [
    ("access log (logging, json, observe.py)", re.compile(r"logging/|json/|relay/observe\.py")),
    ("relay/core (decide, headers, answers)", re.compile(r"relay/core/")),
    (
        "relay/forward.py, upstream_side.py, response.py",
        re.compile(r"relay/(forward|upstream_side|response)\.py"),
    ),
    (
        "relay/server.py, request_heads.py, pipelining.py",
        re.compile(r"relay/(server|request_heads|pipelining)\.py"),
    ),
    (
        "relay/upstreams.py, upstream_conn.py, dial.py",
        re.compile(r"relay/(upstreams|upstream_conn|dial)\.py"),
    ),
    ("relay/runtime.py, hub.py, inflight.py", re.compile(r"relay/(runtime|hub|inflight)\.py")),
]
LEAF_KINDS = [
    ("syscall", re.compile(r"\(libc\.so")),
    ("llhttp/httptools C", re.compile(r"llhttp|parser\.c")),
    ("uvloop/libuv C", re.compile(r"loop\.c|\((core|stream|linux|handle|poll)\.c")),
    ("GC", re.compile(r"gc_collect|gcmodule")),
]


def ticks(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_split(column: Column, proxy: Proc, seconds: int) -> dict[str, Any]:
    """wrk c50 for ``seconds``; the proxy's user and system CPU per request."""
    pids = proxy.tree()
    before = [ticks(p) for p in pids]
    data = workloads.small_get(column, proxy, 50, seconds)
    after = [ticks(p) for p in pids]
    user = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    system = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    n = data.get("requests") or 0
    return {
        "req_s": data.get("req_s"),
        "requests": n,
        "cpu_us_per_req": round((user + system) / n * 1e6, 2) if n else None,
        "user_us_per_req": round(user / n * 1e6, 2) if n else None,
        "system_us_per_req": round(system / n * 1e6, 2) if n else None,
        "foreign_cpu_pct": data.get("foreign_cpu_pct"),
        "error": data.get("error"),
    }


STRACE_LINE = re.compile(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$")


def syscalls(column: Column, proxy: Proc, run_dir: Path, seconds: int = 3) -> dict[str, Any]:
    """``strace -c`` on the proxy's processes during a wrk c50 run: syscalls per request.

    strace slows the proxy a lot; the counts per request are what matter."""
    strace = shutil.which("strace")
    if strace is None:
        return {"absent": "strace is not installed"}
    out_file = run_dir / f"{column.name}.strace"
    argv = [strace, "-c", "-f", "-o", str(out_file)]
    for pid in proxy.tree():
        argv += ["-p", str(pid)]
    tracer = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached
    data = workloads.small_get(column, proxy, 50, seconds)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    requests = data.get("requests") or 0
    counts: dict[str, float] = {}
    if out_file.exists() and requests:
        for line in out_file.read_text().splitlines():
            match = STRACE_LINE.match(line)
            if match and match.group(2) != "total":
                per_req = int(match.group(1)) / requests
                if per_req >= 0.01:
                    counts[match.group(2)] = round(per_req, 2)
    counts["total"] = round(sum(counts.values()), 2)
    return {"requests": requests, "per_request": counts}


def frame_name(frame: str) -> str:
    """``func (file:line)`` → ``func (file)``: lines of one function add up."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def summarise(raw: Path, top: int = 25) -> dict[str, Any]:
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    owners: Counter[str] = Counter()
    owner_kinds: Counter[tuple[str, str]] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";")]
        total += count
        leaf = frames[-1]
        self_counts[leaf] += count
        for name in set(frames):
            if "relay/" in name and "__main__" not in name:
                incl_counts[name] += count
        owner = "event loop (outside relay code)"
        for frame in reversed(frames):
            found = next((label for label, p in OWNERS if p.search(frame)), None)
            if found:
                owner = found
                break
        kind = next((label for label, p in LEAF_KINDS if p.search(leaf)), "Python / other C")
        owners[owner] += count
        owner_kinds[(owner, kind)] += count

    def pct(counter: Counter[str], n: int) -> list[dict[str, Any]]:
        return [
            {"function": name, "samples": c, "pct": round(100 * c / max(1, total), 1)}
            for name, c in counter.most_common(n)
        ]

    by_owner = []
    for name, c in owners.most_common():
        kinds = {
            kind: round(100 * n / total, 1)
            for (o, kind), n in owner_kinds.most_common()
            if o == name
        }
        by_owner.append({"owner": name, "pct": round(100 * c / total, 1), "leaf_kinds": kinds})
    return {
        "samples": total,
        "self": pct(self_counts, top),
        "inclusive_relay": pct(incl_counts, top),
        "owners": by_owner,
    }


def text_report(summary: dict[str, Any], cpu: dict[str, Any], sys_: dict[str, Any]) -> str:
    lines = ["CPU per request without the profiler (wrk c50, same pinning):"]
    for name, data in cpu.items():
        lines.append(
            f"  {name:<9} {data.get('req_s') or 0:>9,.0f} req/s  "
            f"{data.get('cpu_us_per_req')} µs/req (user {data.get('user_us_per_req')}, "
            f"system {data.get('system_us_per_req')})"
        )
    lines.append("\nSyscalls per request (strace -c, wrk c50):")
    for name, data in sys_.items():
        counts = data.get("per_request", {})
        lines.append(f"  {name:<9} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    lines.append(f"\npy-spy samples: {summary['samples']} at {RATE} Hz (--native)\n")
    lines.append("Where the samples go (innermost relay/logging frame; leaf kind in brackets):")
    for owner in summary["owners"]:
        kinds = ", ".join(f"{k} {v}%" for k, v in owner["leaf_kinds"].items())
        lines.append(f"  {owner['pct']:5.1f}%  {owner['owner']}  [{kinds}]")
    lines.append("\nTop self (leaf) frames:")
    lines += [f"  {b['pct']:5.1f}%  {b['function']}" for b in summary["self"]]
    lines.append("\nTop inclusive (relay functions, callees included):")
    lines += [f"  {b['pct']:5.1f}%  {b['function']}" for b in summary["inclusive_relay"]]
    return "\n".join(lines)


def run(stack: Stack, name: str, durations: Durations) -> dict[str, Any]:
    """Profile relay-1w; ``stack`` has the origins running."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    if workloads.WRK is None or not PY_SPY.exists():
        return {"absent": "wrk or py-spy is not installed"}
    relay_col, nginx_col = Column("relay-1w", "relay", 1), Column("nginx-1w", "nginx", 1)
    cpu: dict[str, Any] = {}
    sys_: dict[str, Any] = {}
    for column in (relay_col, nginx_col) if stack.nginx else (relay_col,):
        proxy = stack.start_proxy(column)
        assert proxy is not None
        workloads.OURS[:] = stack.pids()
        try:
            workloads.small_get(column, proxy, 50, durations.warmup_s)
            cpu[column.name] = cpu_split(column, proxy, durations.get_s)
            sys_[column.name] = syscalls(column, proxy, stack.run_dir)
        finally:
            stack.stop(proxy)
    out["cpu_without_profiler"] = cpu
    out["syscalls"] = sys_
    proxy = stack.start_proxy(relay_col)
    assert proxy is not None
    svg = RESULTS / f"{name}-relay-get-c50.svg"
    raw = Path(tempfile.mkstemp(prefix="relay-pyspy-", suffix=".txt")[1])
    record_s = 8
    try:
        workloads.small_get(relay_col, proxy, 50, durations.warmup_s)
        load = subprocess.Popen(
            [
                "taskset",
                "-c",
                cpus_text(LOAD_CPUS),
                str(workloads.WRK),
                "-t1",
                "-c50",
                f"-d{2 * record_s + 8}s",
                "-H",
                f"Host: {HOST_APP}",
                f"http://{relay_col.address('app')}/small",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(1.0)
        spy = ["taskset", "-c", cpus_text(LOAD_CPUS), str(PY_SPY)]
        common = ["--pid", str(proxy.pid), "--native", "--rate", str(RATE)]
        dump = subprocess.run(
            [*spy, "dump", "--pid", str(proxy.pid), "--native"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        subprocess.run(
            [*spy, "record", *common, "--duration", str(record_s), "-o", str(svg)],
            capture_output=True,
            timeout=record_s + 30,
            check=False,
        )
        subprocess.run(
            [
                *spy,
                "record",
                *common,
                "--duration",
                str(record_s),
                "--format",
                "raw",
                "-o",
                str(raw),
            ],
            capture_output=True,
            timeout=record_s + 30,
            check=False,
        )
        wrk_out, _ = load.communicate(timeout=2 * record_s + 40)
    finally:
        stack.stop(proxy)
    summary = summarise(raw)
    raw.unlink(missing_ok=True)
    report = text_report(summary, cpu, sys_)
    report += "\n\npy-spy dump --native (one snapshot under load):\n" + dump.stdout
    report += "\nwrk during the recording (slowed by py-spy):\n" + wrk_out
    text = RESULTS / f"{name}-relay-get-c50-profile.txt"
    text.write_text(report + "\n")
    print(report.split("\n\npy-spy dump")[0], flush=True)
    out.update(summary)
    out["flamegraph"] = str(svg.relative_to(BENCH)) if svg.exists() else None
    out["text"] = str(text.relative_to(BENCH))
    return out


def cpu_only(stack: Stack, durations: Durations, reps: int, compare: str = "") -> dict[str, Any]:
    """A/B helper: relay's (and nginx's) CPU per small GET, best of ``reps`` interleaved
    runs, without the profiler. ``compare``: a second relay source tree measured in the same
    rounds (on its own port, same core), so that machine noise hits both alike."""
    columns = [Column("relay-1w", "relay", 1)]
    if compare:
        columns.append(Column("relay-1w@compare", "relay", 1, src=compare))
    if stack.nginx:
        columns.append(Column("nginx-1w", "nginx", 1))
    procs = {c.name: stack.start_proxy(c) for c in columns}
    workloads.OURS[:] = stack.pids()
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in columns}
    try:
        for column in columns:
            proc = procs[column.name]
            assert proc is not None
            workloads.small_get(column, proc, 50, durations.warmup_s)
        for _ in range(reps):
            for column in columns:
                proc = procs[column.name]
                assert proc is not None
                runs[column.name].append(cpu_split(column, proc, durations.get_s))
    finally:
        for proc in procs.values():
            stack.stop(proc)
    out = {}
    for name, items in runs.items():
        good = [r for r in items if r.get("cpu_us_per_req")]
        best = min(good, key=lambda r: r["cpu_us_per_req"]) if good else items[0]
        out[name] = dict(best, runs=[r.get("cpu_us_per_req") for r in items])
        print(
            f"{name:<16} best {best.get('cpu_us_per_req')} µs/req "
            f"(user {best.get('user_us_per_req')}, system {best.get('system_us_per_req')}), "
            f"{best.get('req_s') or 0:,.0f} req/s; runs {out[name]['runs']}",
            flush=True,
        )
    return out


def main(argv: list[str]) -> int:
    import argparse
    import datetime
    import os
    import socket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-only", action="store_true", help="CPU per request, no py-spy")
    parser.add_argument("--reps", type=int, default=3, help="with --cpu-only")
    parser.add_argument("--relay-src", default="", help="profile this relay source tree")
    parser.add_argument("--compare", default="", help="with --cpu-only: A/B against this tree")
    args = parser.parse_args(argv)
    if args.relay_src:
        os.environ["BENCH_RELAY_SRC"] = str(Path(args.relay_src).resolve())
    run_dir = Path(tempfile.mkdtemp(prefix="relay-bench-profile-"))
    run_dir.chmod(0o755)
    stack = Stack(run_dir)
    try:
        stack.start_origins()
        if args.cpu_only:
            compare = str(Path(args.compare).resolve()) if args.compare else ""
            cpu_only(stack, Durations(), args.reps, compare)
            return 0
        name = f"{datetime.date.today().isoformat()}-{socket.gethostname()}"
        result = run(stack, name, Durations())
    finally:
        stack.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps({k: result.get(k) for k in ("flamegraph", "text")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
