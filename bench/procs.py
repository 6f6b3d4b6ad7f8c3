"""Process plumbing for the benchmark: pinned spawns, CPU time, RSS, readiness, clean stops.

Only processes this module started are ever signalled, by their own pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

CLK_TCK = os.sysconf("SC_CLK_TCK")

# glibc's allocator settings that relay gives itself (relay.startup.tune_allocator), for the
# bench's own Python processes too: the origin, the load clients and the floor forwarder. With
# glibc's defaults a process that moves 64 MiB in 256 KiB-1 MiB pieces trims and regrows its
# heap for every piece, and whether it does depends on its history (the dynamic mmap
# threshold): the direct column's upload swung 570-1,800 MiB/s between rounds of one run, and
# every column with it, which measured the tools rather than the proxies (bench/README.md,
# "A ninth host"). nginx and wrk are C programs with their own buffers: left as they are.
TOOL_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}


def tool_env() -> dict[str, str]:
    """The environment of one of the bench's own Python processes (TOOL_ALLOCATOR)."""
    return {**os.environ, **TOOL_ALLOCATOR}


def cpus_text(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@dataclass
class Proc:
    """A process the bench started, pinned with ``taskset``."""

    name: str
    popen: subprocess.Popen[Any]
    cpus: tuple[int, ...]
    logs: list[IO[Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tree(self) -> list[int]:
        """This process and its descendants (nginx workers, relay workers)."""
        return [self.pid, *descendants(self.pid)]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def affinity(self) -> dict[int, str]:
        out = {}
        for pid in self.tree():
            with contextlib.suppress(OSError):
                out[pid] = cpus_text(os.sched_getaffinity(pid))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()
                self.popen.wait(5)
        for log in self.logs:
            log.close()


def spawn(
    name: str,
    argv: Sequence[str],
    cpus: Sequence[int],
    *,
    stdout: Path | int | None = None,
    stderr: Path | int | None = None,
    stdin: int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    logs: list[IO[Any]] = []

    def sink(target: Path | int | None) -> Any:
        if isinstance(target, Path):
            handle = target.open("ab")
            logs.append(handle)
            return handle
        return target

    popen = subprocess.Popen(
        ["taskset", "-c", cpus_text(cpus), *argv],
        stdin=stdin,
        stdout=sink(stdout),
        stderr=sink(stderr),
        env=env,
        cwd=cwd,
        start_new_session=True,  # a Ctrl-C to the orchestrator does not hit it first
    )
    return Proc(name=name, popen=popen, cpus=tuple(cpus), logs=logs)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, []))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime of the given processes, in seconds (from /proc/<pid>/stat)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def rss_kib(pids: Iterable[int]) -> int:
    """VmRSS of the given processes, summed, in KiB (from /proc/<pid>/status)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def core_times() -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies per core from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            parts = line.split()
            values = [int(v) for v in parts[1:]]
            idle = values[3] + values[4]  # idle + iowait
            out[int(parts[0][3:])] = (sum(values) - idle, sum(values))
    return out


def core_busy(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
) -> dict[str, float]:
    busy: dict[str, float] = {}
    for core, (b1, t1) in after.items():
        b0, t0 = before.get(core, (0, 0))
        busy[f"cpu{core}"] = round(100.0 * (b1 - b0) / max(1, t1 - t0), 1)
    return busy


def wait_port(host: str, port: int, timeout_s: float = 15.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} while starting")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{host}:{port} did not accept connections within {timeout_s}s")


def http_get(host: str, port: int, path: str, host_header: str, timeout_s: float = 5.0) -> bytes:
    """A tiny blocking GET for readiness checks (one request, connection closed)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode()
        )
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)
