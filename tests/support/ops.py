"""Helpers for the operations tests: a fake ``$NOTIFY_SOCKET``, admin GETs, metric samples."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


class NotifySocket:
    """The datagram socket systemd would listen on; records what relay sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.cursor = 0  # wait_for looks at messages from here on

    def drain(self) -> list[dict[str, str]]:
        """Read what is queued now."""
        new: list[dict[str, str]] = []
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return new
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))
            new.append(fields)

    async def wait_for(self, key: str, value: str = "1", timeout: float = 5.0) -> dict[str, str]:
        """The next message (after the last one waited for) that sets ``key=value``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain()
            for i in range(self.cursor, len(self.messages)):
                fields = self.messages[i][1]
                if fields.get(key) == value:
                    self.cursor = i + 1
                    return fields
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no {key}={value} in {[m for _, m in self.messages]}")

    def names(self) -> list[str]:
        self.drain()
        return [k for _, fields in self.messages for k in fields]

    def close(self) -> None:
        self.sock.close()


async def get(port: int, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
    """A plain HTTP/1.0 GET to 127.0.0.1:port (admin endpoints)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: admin\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` from a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


async def wait_until(check: Callable[[], bool], timeout: float = 5.0, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(step)


def port_refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False


def blocked_signals(task: Path) -> set[int]:
    """The signals a thread blocks: ``SigBlk`` in ``task``'s status (``/proc/PID/task/TID``)."""
    for line in (task / "status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split(":", 1)[1], 16)
            return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}
    raise AssertionError(f"no SigBlk in {task}/status")
