"""relay's hot path in-process, without sockets: user-space CPU per small GET.

    .venv/bin/python -m bench.micro [--requests 3000] [--rounds 15] [--relay-src DIR]
    .venv/bin/python -m bench.micro --compare DIR      # A/B: this tree vs DIR, interleaved
    .venv/bin/python -m bench.micro --cold-ms 10 [--compare DIR]   # latency on an idle core
    make bench-pyinstrument   # = --pyinstrument bench/results/micro-pyinstrument: call tree

Runs with relay's own venv (it imports relay). A real ``ClientConnection`` gets a request
through ``data_received`` from a fake transport; the exchange finds a pooled
``UpstreamConnection`` (fake transport too) and writes the request head to it; the driver then
feeds the upstream's response into ``data_received`` and checks that the client transport got
the response. Everything relay does per request runs — llhttp both ways, ``decide``, header
rules, the pool, the access log (to /dev/null) — except the syscalls and the event loop's
wake-ups, which ``make bench`` and ``bench.profile`` measure.

``--pyinstrument PREFIX`` profiles the same loop in this process with pyinstrument (a
statistical profiler that keeps whole Python call stacks, where py-spy on the live relay
mixes in the kernel and the event loop) and writes ``PREFIX.txt`` and ``PREFIX.html``.
pyinstrument is not one of relay's dependencies: ``make bench-pyinstrument`` installs it into
relay's venv first.

``--cold-ms MS`` measures latency instead of CPU: before each small GET the child sleeps MS
milliseconds, as a lightly loaded relay does between requests, and records how long after the
start of the client's read callback the request head reaches the upstream transport, and how
long after the upstream's read callback the response reaches the client transport, and, after
another MS idle, how long one event of a running Connect stream (a chunk holding one envelope,
as envd sends it) takes from the upstream's read callback to the client transport (medians per
round). On this VM an idle core makes every line of Python ~15-20x slower (caches and the core
itself go cold): a head written 4.6 µs after the read when hot is written ~100 µs after it
10 ms after the previous request, so at light load the order of relay's work, not its
total, decides the latency (see bench/README.md, "Cold requests").

Why: on this shared 2-core machine the loopback numbers swing by ±20% with the other
tenants' load, which hides a 5% improvement. Even CPU time swings (caches, the host), so an
A/B keeps one child process per tree alive, pinned to the same core, alternates short rounds
between them and compares the best rounds. Tied to relay's internal classes: adjust it when
they change.

This module is the command line, the measuring children and the A/B; the in-process harness
is ``bench.micro_drive``, the ``--cold-ms`` drive and report ``bench.micro_cold``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.micro_cold import drive_cold, report_cold
from bench.micro_drive import REQUEST, WORKLOADS, build, drive


def serve_rounds(args: argparse.Namespace) -> None:
    """Child mode: build once, then run one round per line read from stdin."""
    # Answers go to a copy of the real stdout; fd 1 becomes /dev/null before relay is
    # imported, so whatever relay writes to stdout (the access log) costs what it costs.
    answer = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    relay, upstreams = build(not args.no_access_log)
    for _, request, port in WORKLOADS:
        drive(relay, upstreams, request, port, 2000)  # warm-up
    print("ready", file=answer, flush=True)
    for line in sys.stdin:
        n = int(line)
        gc.collect()
        if args.cold_ms:
            values = drive_cold(relay, upstreams, n, args.cold_ms / 1000)
            print(" ".join(f"{v:.3f}" for v in values), file=answer, flush=True)
            continue
        values = [drive(relay, upstreams, request, port, n) * 1e6 for _, request, port in WORKLOADS]
        print(" ".join(f"{v:.3f}" for v in values), file=answer, flush=True)


class Child:
    """A measuring child process for one relay tree, pinned to one core."""

    def __init__(self, args: argparse.Namespace, src: str, cpu: int) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        if src:  # the working directory comes first on sys.path: start from a neutral one
            env["PYTHONPATH"] = f"{src}{os.pathsep}{root}"
        argv = ["taskset", "-c", str(cpu), sys.executable, "-m", "bench.micro", "--child"]
        if args.no_access_log:
            argv.append("--no-access-log")
        if args.cold_ms:
            argv += ["--cold-ms", str(args.cold_ms)]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tempfile.gettempdir() if src else root,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the micro-benchmark child did not start")

    def round(self, n: int) -> list[float]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return [float(v) for v in self.proc.stdout.readline().split()]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu", type=int, default=1, help="core the children run on")
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--relay-src", default="", help="measure this relay tree instead")
    parser.add_argument("--compare", default="", help="A/B: this tree vs DIR, interleaved")
    parser.add_argument("--pyinstrument", default="", help="profile in-process: PREFIX.{txt,html}")
    parser.add_argument(
        "--cold-ms", type=float, default=0.0, help="latency after MS idle (rounds of 100)"
    )
    parser.add_argument("--json", action="store_true", help="print the best rounds as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve_rounds(args)
        return 0
    if args.pyinstrument:
        return pyinstrument_profile(args)
    trees = [("this tree", str(Path(args.relay_src).resolve()) if args.relay_src else "")]
    if args.compare:
        trees.append(("compare", str(Path(args.compare).resolve())))
    if args.cold_ms and args.requests == 3000:
        args.requests = 100  # each request waits --cold-ms first
    children = {label: Child(args, src, args.cpu) for label, src in trees}
    runs: dict[str, list[list[float]]] = {label: [] for label in children}
    deadline = time.monotonic() + 120  # bounded whatever the machine does
    try:
        for _ in range(args.rounds):
            for label, proc in children.items():
                runs[label].append(proc.round(args.requests))
            if time.monotonic() > deadline:
                break
    finally:
        for proc in children.values():
            proc.close()
    if args.cold_ms:
        report_cold(args, runs)
        return 0
    best: dict[str, list[float]] = {}
    for label, items in runs.items():
        best[label] = [min(r[i] for r in items) for i in range(len(WORKLOADS))]
    if args.json:  # for bench.host's host-speed line: {tree: {workload: best µs}}
        document = {
            label: {name: round(b, 2) for (name, _, _), b in zip(WORKLOADS, values, strict=True)}
            for label, values in best.items()
        }
        print(json.dumps(document))
        return 0
    for label, items in runs.items():
        medians = [statistics.median(r[i] for r in items) for i in range(len(WORKLOADS))]
        print(
            f"{label:<10} "
            + ", ".join(
                f"{name}: {b:.1f} µs/req (median {m:.1f})"
                for (name, _, _), b, m in zip(WORKLOADS, best[label], medians, strict=True)
            )
        )
    print(
        f"(user-space CPU per request, no syscalls; best of {len(runs['this tree'])} "
        f"interleaved rounds of {args.requests} on cpu {args.cpu})"
    )
    if args.compare:
        for i, (name, _, _) in enumerate(WORKLOADS):
            ratio = best["compare"][i] / best["this tree"][i]
            print(f"  {name}: compare ÷ this tree = {ratio:.3f}")
    return 0


def pyinstrument_profile(args: argparse.Namespace) -> int:
    """Profile small GETs in this process with pyinstrument; text and HTML reports."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("pyinstrument is not installed: make bench-pyinstrument installs it", file=sys.stderr)
        return 2
    real_stdout = sys.stdout
    relay, upstreams = build(not args.no_access_log)  # points sys.stdout at /dev/null
    drive(relay, upstreams, REQUEST, 18081, 2000)  # warm-up
    profiler = Profiler(interval=0.0001)
    profiler.start()
    per_request = drive(relay, upstreams, REQUEST, 18081, args.requests * 10)
    profiler.stop()
    prefix = Path(args.pyinstrument)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = profiler.output_text(unicode=True, color=False, show_all=False)
    Path(f"{prefix}.txt").write_text(text)
    Path(f"{prefix}.html").write_text(profiler.output_html())
    print(text, file=real_stdout)
    print(
        f"{args.requests * 10} small GETs, {per_request * 1e6:.1f} µs each under the profiler; "
        f"reports: {prefix}.txt, {prefix}.html",
        file=real_stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
