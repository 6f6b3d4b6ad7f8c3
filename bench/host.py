"""What a run records about where it ran: the machine, the tools' versions, the commits, and the
host's speed for CPython (``bench.micro``), so that runs on different hosts are not read as a
change in relay (bench/README.md, "Hosts").
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from bench.stack import PRODUCT_BIN, PROXY_CPUS, ROOT


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
