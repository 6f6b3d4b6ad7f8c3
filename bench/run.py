"""``make bench``: relay side by side with direct and nginx on this machine's loopback.

    python -m bench.run [--quick] [--profile] [--columns direct,nginx-1w,relay-1w,...]

Starts the origins, then for each column (direct, nginx and relay with 1 and 2 workers) runs
every workload, writes ``bench/results/<date>-<host>.{json,md,png}``, refreshes the latest
table in ``bench/README.md``, and prints the table and PASS/FAIL per target. Every load is
bounded in count and time; all traffic stays on loopback. See bench/README.md.

This module runs the phases (start, interleave, idle connections, profile); what each phase
runs and which round it keeps is in ``bench.plan``, where the numbers go in ``bench.publish``,
what the run records about the host in ``bench.host``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report, workloads
from bench.host import git_commit, host_speed, host_speed_text, machine, stamp
from bench.plan import COLUMNS, Workload, best, interleaved_workloads
from bench.procs import Proc, core_busy, core_times, cpus_text
from bench.publish import RESULTS, log, publish, summary
from bench.stack import (
    LOAD_CPUS,
    ORIGIN_CPUS,
    PROXY_CPUS,
    ROOT,
    Column,
    Stack,
    busy_ports,
    signed_files_path,
)
from bench.workloads import Durations


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.durations = (
            Durations(
                get_s=2,
                auth_s=1,
                warmup_s=1,
                ws_s=1.0,
                transfer_reps=2,
                stream_reps=1,
                idle_http=1000,
                idle_ws=500,
            )
            if args.quick
            else Durations()
        )
        self.run_dir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        self.run_dir.chmod(0o755)  # nginx workers run as nobody and serve files from here
        self.relay_src_commit = git_commit(Path(args.relay_src or ROOT))
        self.host_speed: dict[str, float] | None = None
        if args.relay_src:
            # Snapshot the other tree now: it may be a live checkout that changes mid-run.
            snapshot = self.run_dir / "relay-src"
            shutil.copytree(
                Path(args.relay_src) / "relay",
                snapshot / "relay",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            os.environ["BENCH_RELAY_SRC"] = str(snapshot)
        self.stack = Stack(self.run_dir)
        self.results: report.Results = {}
        self.absent: dict[str, str] = {}
        self.pinning: dict[str, Any] = {}
        self.bugs: list[str] = []
        self.signed_path = ""
        self.quiet: dict[str, dict[str, float]] = {}
        self.profile: dict[str, Any] | None = None

    # -- helpers -------------------------------------------------------------------------
    def record(self, workload: str, column: Column, data: dict[str, Any]) -> None:
        self.results.setdefault(workload, {})[column.name] = data
        foreign = data.get("foreign_cpu_pct")
        noise = f"  [foreign CPU {foreign}%]" if foreign is not None and foreign > 10 else ""
        log(f"  {column.name:<9} {workload:<14} {summary(workload, data)}{noise}")

    def start(self, column: Column) -> Proc | None:
        proxy = self.stack.start_proxy(column)
        if proxy is not None:
            affinity = proxy.affinity()
            self.pinning[column.label] = {
                "cpus": cpus_text(PROXY_CPUS[column.workers]),
                "processes": len(affinity),
            }
            log(
                f"  pinned {column.label}: "
                + ", ".join(f"pid {p} → cpus {c}" for p, c in affinity.items())
            )
        workloads.OURS[:] = self.stack.pids()
        return proxy

    def stop(self, proxy: Proc | None) -> None:
        self.stack.stop(proxy)
        workloads.OURS[:] = self.stack.pids()

    def alive(self, column: Column, proxy: Proc | None, during: str) -> bool:
        if proxy is None or proxy.alive():
            return True
        err = (self.run_dir / f"{column.label}.err").read_text(errors="replace")[-2000:]
        self.bugs.append(f"{column.label} exited ({proxy.popen.returncode}) during {during}: {err}")
        log(f"  !! {column.label} died during {during}; stderr tail:\n{err}")
        return False

    def background(self, name: str) -> None:
        """CPU busy on each core while nothing of ours runs: other tenants add noise."""
        before = core_times()
        time.sleep(1.0)
        busy = core_busy(before, core_times())
        self.quiet[name] = busy
        noisy = any(v > 5.0 for v in busy.values())
        note = "  !! the machine is not quiet: numbers will be noisy" if noisy else ""
        log(f"== {name} (background load: {busy}){note}")

    # -- phases ----------------------------------------------------------------------------
    def interleaved(self, columns: list[Column], plan: list[Workload]) -> None:
        """Every proxy runs at once on its own port; each workload visits the columns in
        turn, ``reps`` rounds, and keeps each column's best rep."""
        proxies: dict[str, Proc | None] = {}
        try:
            for column in columns:
                try:
                    proxy = self.start(column)
                except RuntimeError as exc:  # e.g. a config the installed nginx refuses
                    self.absent[column.name] = f"did not start: {exc}"
                    log(f"  {column.name}: absent: {self.absent[column.name]}")
                    continue
                if column.kind == "relay" and column.workers > 1 and proxy is not None:
                    processes = len(proxy.tree())
                    if processes < column.workers:
                        self.absent[column.name] = (
                            f"relay serve with process.workers = {column.workers} started "
                            f"{processes} process: it does not start worker processes yet"
                        )
                        log(f"  {column.name}: absent: {self.absent[column.name]}")
                        self.stop(proxy)
                        continue
                proxies[column.label] = proxy
            live = [c for c in columns if c.label in proxies]
            for column in live:  # warm the pools and the allocator
                if column.kind != "floor":
                    workloads.small_get(column, proxies[column.label], 50, self.durations.warmup_s)
            for workload in plan:
                here = [c for c in live if c.kind != "floor" or workload.floor]
                reps: dict[str, list[dict[str, Any]]] = {c.label: [] for c in here}
                for _ in range(workload.reps):
                    for column in here:
                        proxy = proxies[column.label]
                        workloads.settle()
                        reps[column.label].append(workload.step(column, proxy))
                        if not self.alive(column, proxy, workload.name):
                            proxies[column.label] = self.start(column)
                for column in here:
                    self.record(workload.name, column, best(reps[column.label], workload.key))
        finally:
            for proxy in proxies.values():
                self.stop(proxy)

    def idle(self, column: Column) -> None:
        d = self.durations
        for workload, command, service, count in (
            ("idle_http", "hold-http", "app", d.idle_http),
            ("idle_ws", "hold-ws", "py", d.idle_ws),
        ):
            proxy = self.start(column)  # fresh, so earlier load does not hide growth
            assert proxy is not None
            try:
                workloads.small_get(column, proxy, 10, 1)  # warm: pools, allocator arenas
                data = workloads.hold(column, proxy, command, service, count, self.run_dir)
                self.record(workload, column, data)
                self.alive(column, proxy, workload)
            finally:
                self.stop(proxy)

    # -- the whole run ---------------------------------------------------------------------
    def execute(self) -> int:
        started = time.monotonic()
        wanted = self.args.columns.split(",") if self.args.columns else None
        columns = [c for c in COLUMNS if wanted is None or c.name in wanted]
        if self.stack.nginx is None:
            for c in columns:
                if c.kind == "nginx":
                    self.absent[c.name] = "nginx is not installed (apt-get install nginx failed)"
        if workloads.WRK is None:
            log("wrk is not installed: the small-GET and authorized-path workloads are absent")
        log(f"run directory (configs, logs): {self.run_dir}")
        log(
            f"pinning: load generator on cpu {cpus_text(LOAD_CPUS)}, origins on cpu "
            f"{cpus_text(ORIGIN_CPUS)}, 1-worker proxy on cpu {cpus_text(PROXY_CPUS[1])}, "
            f"2-worker proxy on cpus {cpus_text(PROXY_CPUS[2])}"
        )
        busy = busy_ports()
        if busy:
            log(f"!! in use by another process (a leftover bench or relay?): {', '.join(busy)}")
            return 2
        self.host_speed = host_speed(os.environ.get("BENCH_RELAY_SRC", ""))
        log(f"host speed: {host_speed_text(self.host_speed)}")
        try:
            self.stack.start_origins()
            for proc in self.stack.procs:
                self.pinning[proc.name] = {"cpus": cpus_text(proc.cpus)}
                log(f"  pinned {proc.name}: pid {proc.pid} → cpus {proc.affinity()[proc.pid]}")
            self.signed_path = signed_files_path()
            present = [c for c in columns if c.name not in self.absent]
            for name, reason in self.absent.items():
                log(f"  {name}: absent: {reason}")
            self.background("interleaved workloads")
            self.interleaved(
                present,
                interleaved_workloads(self.stack, self.durations, self.signed_path, self.quick),
            )
            present = [c for c in present if c.name not in self.absent]
            if not self.args.no_variants:
                self.background("variants: access log off")
                variants = [
                    Column(c.name, c.kind, c.workers, access_log=False)
                    for c in present
                    if c.workers == 1 and c.kind in ("nginx", "relay")
                ]
                get = Workload(
                    "get_c50_nolog",
                    lambda c, p: workloads.small_get(c, p, 50, self.durations.get_s),
                    1 if self.quick else 3,
                    "req_s",
                )
                self.interleaved(variants, [get])
            self.background("idle connections")
            relay_workers = {c.workers for c in present if c.kind == "relay"}
            for column in present:
                # nginx-2w only matters next to a relay-2w column
                if column.kind == "relay" or (
                    column.kind == "nginx" and column.workers in relay_workers
                ):
                    self.idle(column)
            if self.args.profile:
                from bench import profile

                self.background("profile: relay-1w under small GET c50")
                self.profile = profile.run(self.stack, stamp(), self.durations)
        finally:
            self.stack.stop_all()
        elapsed = time.monotonic() - started
        return self.write(columns, elapsed)

    def write(self, columns: list[Column], elapsed: float) -> int:
        present = [c.name for c in columns if c.name not in self.absent]
        name = stamp()
        # A --quick smoke run leaves bench/results alone: its files go to the run directory.
        results = self.run_dir if self.quick else RESULTS
        results.mkdir(parents=True, exist_ok=True)
        meta = machine()
        meta.update(
            {
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "duration_s": round(elapsed, 1),
                "quick": self.args.quick,
                "pinning": self.pinning,
                "absent": self.absent,
                "background_busy_pct": self.quiet,
                "relay_src": str(self.args.relay_src or ROOT),
                "relay_src_commit": self.relay_src_commit,
                "relay_commit": git_commit(ROOT),
                "host_speed": self.host_speed,
            }
        )
        document = {
            "meta": meta,
            "columns": present,
            "results": self.results,
            "targets": [t.__dict__ for t in report.targets(self.results, present)],
            "bugs": self.bugs,
            "profile": self.profile,
        }
        (results / f"{name}.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
        publish(document, results, name, readme=not self.quick)
        log(f"make bench took {elapsed:.0f} s")
        return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run, README untouched")
    parser.add_argument("--profile", action="store_true", help="also py-spy relay (small GET)")
    parser.add_argument("--columns", default="", help="comma-separated subset of the columns")
    parser.add_argument("--no-variants", action="store_true", help="skip the no-access-log runs")
    parser.add_argument(
        "--relay-src", default="", help="bench this relay source tree (sets BENCH_RELAY_SRC)"
    )
    parser.add_argument(
        "--report-only", default="", help="rebuild .md, .png and the README from a results JSON"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        path = Path(args.report_only)
        publish(json.loads(path.read_text()), path.parent, path.stem, readme=True)
        return 0
    if args.relay_src:
        args.relay_src = str(Path(args.relay_src).resolve())
    return Run(args).execute()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
