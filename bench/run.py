"""``make bench``: relay side by side with direct and nginx on this machine's loopback.

    python -m bench.run [--quick] [--profile] [--columns direct,nginx-1w,relay-1w,...]

Starts the origins, then for each column (direct, nginx and relay with 1 and 2 workers) runs
every workload, writes ``bench/results/<date>-<host>.{json,md,png}``, refreshes the latest
table in ``bench/README.md``, and prints the table and PASS/FAIL per target. Every load is
bounded in count and time; all traffic stays on loopback. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import report, workloads
from bench.procs import Proc, core_busy, core_times, cpus_text
from bench.stack import (
    BENCH,
    HOST_ENVD,
    LOAD_CPUS,
    ORIGIN_CPUS,
    PRODUCT_BIN,
    PROXY_CPUS,
    ROOT,
    Column,
    Stack,
    busy_ports,
    signed_files_path,
)
from bench.workloads import Durations

RESULTS = BENCH / "results"
README = BENCH / "README.md"
LATEST_START = "<!-- bench:latest:start (written by bench/run.py) -->"
LATEST_END = "<!-- bench:latest:end -->"
PACED_DELAY_MS = 10  # mean pause per connection: 50 connections ≈ 5k req/s in all

COLUMNS = [
    Column("direct", "direct"),
    Column("nginx-1w", "nginx", 1),
    Column("relay-1w", "relay", 1),
    Column("nginx-2w", "nginx", 2),
    Column("relay-2w", "relay", 2),
    # Not a proxy: bench/floor.py, a bare uvloop byte forwarder on relay's core, run on the
    # workloads of the Python origin only. It shows how much of relay's latency is relay's own
    # work and how much the price of CPython + uvloop on this machine.
    Column("floor-1w", "floor"),
]


def log(message: str) -> None:
    print(message, flush=True)


def summary(workload: str, data: dict[str, Any]) -> str:
    if "error" in data:
        return f"ERROR {data['error']}"
    if "absent" in data:
        return f"absent: {data['absent']}"
    parts = []
    if "req_s" in data:
        lat = data["latency_us"]
        parts.append(
            f"{data['req_s']:>9,.0f} req/s  p50 {lat['p50']:>6,} µs  p99 {lat['p99']:>6,} µs"
        )
    if "mib_s" in data:
        parts.append(f"{data['mib_s']:,.0f} MiB/s (runs {data['mib_s_runs']})")
    if "first_event_us" in data:
        lat = data["latency_us"]
        parts.append(
            f"event p50 {lat['p50']:,.0f} µs p99 {lat['p99']:,.0f} µs, "
            f"first event {data['first_event_us']:,.0f} µs"
        )
    if "round_trips_s" in data:
        parts.append(f"{data['round_trips_s']:,.0f} round trips/s")
    if "kib_per_conn" in data:
        parts.append(
            f"{data['held']:,} held, RSS {data['rss_before_kib']:,} → {data['rss_after_kib']:,} "
            f"KiB = {data['kib_per_conn']} KiB/conn"
        )
    if "proxy_cpu_us_per_req" in data:
        parts.append(f"proxy CPU {data['proxy_cpu_us_per_req']} µs/req")
    if "cores_busy_pct" in data:
        parts.append("busy " + " ".join(f"{k} {v}%" for k, v in data["cores_busy_pct"].items()))
    return "  ".join(parts) or json.dumps(data)


Step = Callable[[Column, Proc | None], dict[str, Any]]


@dataclass
class Workload:
    """One workload, repeated ``reps`` times with the columns visited in turn."""

    name: str
    step: Step
    reps: int
    key: str  # the rep kept: the best by this path ("-path": the lowest)
    floor: bool = False  # the floor column (bench/floor.py) can run it: the Python origin's


def best(reps: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The kept rep: an error anywhere wins (errors are findings, not noise); else the best.

    Other tenants of the machine only ever slow a run down, so the best of a few interleaved
    reps is the estimate least disturbed by them."""
    for rep in reps:
        if "error" in rep or "absent" in rep:
            return dict(rep, reps=len(reps))
    sign = -1.0 if key.startswith("-") else 1.0
    path = key.lstrip("-")

    def score(rep: dict[str, Any]) -> float:
        v = report.dig(rep, path)
        return float("-inf") if v is None else sign * v

    chosen = max(reps, key=score)
    out = dict(chosen)
    out["reps"] = [
        {path: report.dig(r, path), "foreign_cpu_pct": r.get("foreign_cpu_pct")} for r in reps
    ]
    return out


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
    def workloads(self) -> list[Workload]:
        d = self.durations
        token = f"X-Access-Token: {self.stack.values['ENVD_TOKEN']}"
        reps = 1 if self.quick else 3

        def get(conns: int, delay_ms: int = 0) -> Step:
            return lambda c, p: workloads.small_get(c, p, conns, d.get_s, delay_ms)

        def envd(path: str, headers: str) -> Step:
            return lambda c, p: workloads.wrk(
                c,
                p,
                service="envd",
                host=HOST_ENVD,
                path=path,
                connections=50,
                duration_s=d.auth_s,
                headers=headers,
            )

        def client(command: str, service: str, *args: str) -> Step:
            return lambda c, p: workloads.client(c, p, command, service, *args)

        transfer = ("--reps", str(d.transfer_reps))
        ws = ("--duration-s", str(d.ws_s), "--connections")
        return [
            # c50 carries the targets: one round more than the other levels.
            Workload("get_c10", get(10), max(1, reps - 1), "req_s"),
            Workload("get_c50", get(50), reps, "req_s"),
            # The same 50 connections paced at ~5k req/s (each waits PACED_DELAY_MS on average
            # between requests, about a fifth of what one relay worker serves): every column is
            # below saturation, so p99 is what the proxy adds, not queueing behind a saturated
            # core as in the closed-loop rows.
            Workload("get_c50_paced", get(50, PACED_DELAY_MS), reps, "-latency_us.p99"),
            Workload("get_c200", get(200), max(1, reps - 1), "req_s"),
            Workload("auth_token", envd("/small", token), max(1, reps - 1), "req_s"),
            Workload("auth_signed", envd(self.signed_path, ""), max(1, reps - 1), "req_s"),
            Workload(
                "download",
                client(
                    "download",
                    "app",
                    *transfer,
                    "--size",
                    str(self.stack.blob_size),
                    "--crc",
                    str(self.stack.blob_crc),
                ),
                # A round more than upload: the download's direct column shares core 0 with
                # nothing of relay's, so another tenant's burst during one column's round
                # swung the ratio 0.65-1.03x between runs (bench/README.md, "A sixth host").
                reps,
                "mib_s",
            ),
            Workload(
                "upload", client("upload", "py", *transfer), max(1, reps - 1), "mib_s", floor=True
            ),
            # Two rounds more than the rest: one event at a time is a wake-up on an idle core
            # per hop, and a run's best of 3 put relay 25 µs above nginx at p50 where eight
            # interleaved rounds by hand right after gave the same medians (bench/README.md,
            # "A seventh host"). Each round is ~3.5 s per column.
            Workload(
                "stream",
                client("stream", "py", "--reps", str(d.stream_reps)),
                reps + 2,
                "-latency_us.p99",
                floor=True,
            ),
            # One connection is one round trip at a time, each two wake-ups across the cores:
            # interleaved rounds by hand scattered 5.9k-7.5k rt/s for relay, nginx and the
            # floor alike (medians within 5%), so c1 keeps the best of more rounds than c50.
            *(
                Workload(
                    f"ws_c{conns}",
                    client("ws-echo", "py", *ws, str(conns)),
                    rounds,
                    "round_trips_s",
                    floor=True,
                )
                for conns, rounds in ((1, reps + 1), (50, max(1, reps - 1)))
            ),
        ]

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
            self.interleaved(present, self.workloads())
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


def publish(document: dict[str, Any], results: Path, name: str, *, readme: bool) -> None:
    """The .md table and the .png chart next to the JSON; the README's latest section."""
    meta, present, data = document["meta"], document["columns"], document["results"]
    found = report.targets(data, present)
    header = (
        f"Run {meta['date']} on `{meta['host']}` ({meta['cpu']}, {meta['cores']} cores, "
        f"{meta['memory_gib']} GiB, kernel {meta['kernel']}, Python {meta['python']}), "
        f"nginx {meta['nginx']}, {meta['wrk']}; bench at {meta['relay_commit']}; relay from "
        f"`{meta['relay_src']}` at {meta.get('relay_src_commit', meta['relay_commit'])}; "
        f"took {meta['duration_s']:.0f} s. Host speed: {host_speed_text(meta.get('host_speed'))}. "
        f"Raw numbers: `results/{name}.json`."
    )
    absent_text = "\n".join(f"- `{k}` absent: {v}" for k, v in meta["absent"].items())
    md = "\n\n".join(
        part
        for part in (
            header,
            report.markdown_table(data, present),
            absent_text,
            "Targets (issue 7):\n\n```\n" + report.targets_text(found) + "\n```",
        )
        if part
    )
    (results / f"{name}.md").write_text(md + "\n")
    png = results / f"{name}.png"
    title = f"relay ratios, {meta['host']} {meta['date'][:10]} ({meta['cores']} cores)"
    charted = report.chart(data, present, png, title)
    if readme:
        update_readme(md, f"results/{name}.png" if charted else None)
    log("")
    log(md)
    log("")
    log(f"results: {results / name}.json, .md{', .png' if charted else ''}")


def host_speed(relay_src: str) -> dict[str, float] | None:
    """relay's in-process CPU per request (``bench.micro``, no sockets) on the 1-worker core.

    The same code costs 2.5x more on some hosts than on others (bench/README.md, "A slower
    host"), and CPython suffers more than nginx: this line says which kind of host a run was
    made on, so runs on different hosts are not read as a change in relay.
    """
    argv = [str(PRODUCT_BIN / "python"), "-m", "bench.micro", "--json", "--rounds", "8"]
    argv += ["--requests", "3000", "--cpu", str(PROXY_CPUS[1][0])]
    if relay_src:
        argv += ["--relay-src", relay_src]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, check=True, timeout=120, cwd=ROOT
        ).stdout
        best: dict[str, float] = json.loads(out)["this tree"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None
    return best


def host_speed_text(speed: dict[str, float] | None) -> str:
    if not speed or "small GET" not in speed:
        return "not measured"
    return (
        f"relay's in-process small GET {speed['small GET']:.1f} µs of user CPU (`bench.micro`; "
        f'other hosts\' values: bench/README.md, "Hosts")'
    )


def stamp() -> str:
    return f"{datetime.date.today().isoformat()}-{socket.gethostname()}"


def machine() -> dict[str, Any]:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    nginx = "absent"
    if shutil.which("nginx"):
        out = subprocess.run(["nginx", "-v"], capture_output=True, text=True, check=False).stderr
        nginx = out.strip().rpartition("/")[2]
    wrk = "wrk absent"
    if shutil.which("wrk"):
        out = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False).stdout
        wrk = " ".join(out.split()[:2])
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": nginx,
        "wrk": wrk,
    }


def git_commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--", "relay"],
        capture_output=True,
        text=True,
        check=False,
    )
    mark = " (+ uncommitted changes under relay/)" if dirty.stdout.strip() else ""
    return (out.stdout.strip()[:60] or "unknown") + mark


def update_readme(md: str, png: str | None) -> None:
    """The latest table and chart, in bench/README.md and in the project README's
    performance section (paths there are relative to the repository root)."""
    for readme, prefix in ((README, ""), (BENCH.parent / "README.md", "bench/")):
        if not readme.exists():
            continue
        text = readme.read_text()
        if LATEST_START not in text or LATEST_END not in text:
            continue
        table = md.replace("`results/", f"`{prefix}results/")
        body = table + (f"\n\n![relay ratios]({prefix}{png})" if png else "")

        def block(_: re.Match[str], body: str = body) -> str:
            return f"{LATEST_START}\n{body}\n{LATEST_END}"  # a function: no escapes in body

        new = re.sub(
            re.escape(LATEST_START) + ".*?" + re.escape(LATEST_END),
            block,
            text,
            flags=re.DOTALL,
        )
        readme.write_text(new)


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
