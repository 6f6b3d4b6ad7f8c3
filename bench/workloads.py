"""The workloads: each runs a load generator pinned to core 0 against one column and returns
a JSON-able dict. CPU per request is the proxy's utime+stime delta (all its processes) over
the run divided by the requests completed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import (
    CLK_TCK,
    Proc,
    core_busy,
    core_times,
    cpu_seconds,
    cpus_text,
    rss_kib,
    tool_env,
)
from bench.stack import BENCH, HOST_APP, HOST_ENVD, HOST_PY, LOAD_CPUS, ROOT, Column

WRK = shutil.which("wrk")
LUA = BENCH / "wrk" / "report.lua"


@dataclass
class Durations:
    """Seconds per measured run; ``--quick`` shrinks them for a smoke run."""

    get_s: int = 3
    auth_s: int = 2
    warmup_s: int = 1
    ws_s: float = 2.5
    transfer_reps: int = 5
    stream_reps: int = 3
    idle_http: int = 10_000
    idle_ws: int = 5_000


def _load(argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpus_text(LOAD_CPUS), *argv]


# Pids of every long-running process the bench started (origins, proxies); set by bench.run.
OURS: list[int] = []


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Meter:
    """Across one measured run: the proxy's CPU seconds (all its processes), each core's busy
    %, and the CPU that none of our processes used ("foreign": other tenants of the machine,
    which make a run noisy)."""

    def __init__(self, proxy: Proc | None) -> None:
        self.pids = proxy.tree() if proxy is not None else []
        self.cpu0 = cpu_seconds(self.pids)
        self.ours0 = cpu_seconds(OURS)
        self.children0 = _children_cpu()
        self.cores0 = core_times()
        self.t0 = time.perf_counter()

    def done(self, out: dict[str, Any], count: float | None) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0
        cores1 = core_times()
        out["cores_busy_pct"] = core_busy(self.cores0, cores1)
        busy_s = sum(b1 - self.cores0[c][0] for c, (b1, _) in cores1.items()) / CLK_TCK
        ours = cpu_seconds(OURS) - self.ours0 + _children_cpu() - self.children0
        out["foreign_cpu_pct"] = round(max(0.0, busy_s - ours) / elapsed * 100, 1)
        if self.pids:
            cpu = cpu_seconds(self.pids) - self.cpu0
            out["proxy_cpu_s"] = round(cpu, 3)
            out["proxy_cpu_pct"] = round(100 * cpu / elapsed, 1)
            if count:
                out["proxy_cpu_us_per_req"] = round(cpu / count * 1e6, 2)
        return out


def settle(limit_pct: float = 25.0, max_wait_s: float = 0.4) -> float:
    """Wait (bounded) until the cores are mostly idle; returns the last busy % seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = core_times()
        time.sleep(0.2)
        busiest = max(core_busy(before, core_times()).values())
        if busiest <= limit_pct or time.monotonic() >= deadline:
            return busiest


def wrk(
    column: Column,
    proxy: Proc | None,
    *,
    service: str,
    host: str,
    path: str,
    connections: int,
    duration_s: int,
    headers: str = "",
    delay_ms: int = 0,
) -> dict[str, Any]:
    if WRK is None:
        return {"absent": "wrk is not installed"}
    env = dict(os.environ, WRK_HOST=host, WRK_PATH=path, WRK_HEADERS=headers)
    if delay_ms:
        env["WRK_DELAY_MS"] = str(delay_ms)
    argv = _load(
        [
            WRK,
            "-t1",
            f"-c{connections}",
            f"-d{duration_s}s",
            "--timeout",
            "5s",
            "-s",
            str(LUA),
            f"http://{column.address(service)}/",
        ]
    )
    meter = Meter(proxy)
    run = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=duration_s + 30, check=False
    )
    match = re.search(r"^WRK_JSON (.*)$", run.stdout, re.MULTILINE)
    if run.returncode != 0 or match is None:
        return {"error": f"wrk exit {run.returncode}: {run.stderr.strip()[:300]}"}
    data = json.loads(match.group(1))
    seconds = data["duration_us"] / 1e6
    errors = data["errors"]
    out: dict[str, Any] = {
        "connections": connections,
        "requests": data["requests"],
        "req_s": round(data["requests"] / seconds, 1),
        "latency_us": data["latency_us"],
        "errors": errors,
    }
    if any(errors.values()):
        out["error"] = f"wrk counted errors: {errors}"
    return meter.done(out, data["requests"])


def small_get(
    column: Column, proxy: Proc | None, conns: int, seconds: int, delay_ms: int = 0
) -> dict[str, Any]:
    return wrk(
        column,
        proxy,
        service="app",
        host=HOST_APP,
        path="/small",
        connections=conns,
        duration_s=seconds,
        delay_ms=delay_ms,
    )


def client(
    column: Column, proxy: Proc | None, command: str, service: str, *args: str
) -> dict[str, Any]:
    host = {"app": HOST_APP, "py": HOST_PY, "envd": HOST_ENVD}[service]
    argv = _load(
        [
            sys.executable,
            "-m",
            "bench.clients",
            command,
            "--address",
            column.address(service),
            "--host",
            host,
            *args,
        ]
    )
    meter = Meter(proxy)
    run = subprocess.run(
        argv, capture_output=True, text=True, env=tool_env(), cwd=ROOT, timeout=120, check=False
    )
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines:
        return {"error": f"client exit {run.returncode}: {run.stderr.strip()[-300:]}"}
    out: dict[str, Any] = json.loads(lines[-1])
    count = out.get("round_trips")
    return meter.done(out, count)


def hold(
    column: Column, proxy: Proc, command: str, service: str, count: int, run_dir: Path
) -> dict[str, Any]:
    """Open ``count`` idle connections through the proxy and read its RSS growth."""
    host = {"app": HOST_APP, "py": HOST_PY}[service]
    pids = proxy.tree()
    time.sleep(0.5)
    before = rss_kib(pids)
    argv = _load(
        [
            sys.executable,
            "-m",
            "bench.clients",
            command,
            "--address",
            column.address(service),
            "--host",
            host,
            "--count",
            str(count),
            "--hold-s",
            "90",
            "--timeout-s",
            "30",
        ]
    )
    err = (run_dir / f"{column.name}.{command}.err").open("wb")
    holder = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=tool_env(), cwd=ROOT
    )
    assert holder.stdout is not None
    assert holder.stdin is not None
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        line = holder.stdout.readline() if ready else b""
        if not line:
            return {"error": f"{command}: no report from the holder within 60 s"}
        state = json.loads(line)
        time.sleep(1.0)  # let the proxy settle (timers, pool sweeps)
        after = rss_kib(pids)
        open_after = _open_fds(pids)
    finally:
        holder.stdin.close()
        try:
            holder.wait(30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(5)
        err.close()
    tail = holder.stdout.read().decode().strip().splitlines()
    final = json.loads(tail[-1]) if tail else {}
    held = state.get("held", 0)
    out: dict[str, Any] = {
        "requested": count,
        "held": held,
        "failures": state.get("failures"),
        "still_open_at_end": final.get("still_open_at_end"),
        "rss_before_kib": before,
        "rss_after_kib": after,
        "proxy_open_fds": open_after,
        "kib_per_conn": round((after - before) / held, 2) if held else None,
    }
    if state.get("failures") or held < count or final.get("still_open_at_end", 0) < count:
        out["error"] = (
            f"{held} of {count} held after opening ({state.get('failures')} failed: "
            f"{state.get('first_failure')}), {final.get('still_open_at_end')} still open at end"
        )
    return out


def _open_fds(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total
