"""Ports for child processes come from outside the kernel's ephemeral range, once each."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import ports
from tests.support.ports import ephemeral_range, free_port, pool


def test_ports_are_outside_the_ephemeral_range_and_unique() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not any(low <= port <= high for port in ports)
    for port in ports[:20]:  # each one binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        monkeypatch.setattr(ports, "pool", lambda _ephemeral: range(held, held + 1))
        with pytest.raises(RuntimeError, match=f"no free port in range\\({held}, "):
            ports.free_port()


def test_pool_falls_back_above_a_low_ephemeral_range() -> None:
    assert pool((32768, 60999)) == range(20768, 32768)
    assert pool((5000, 40000)) == range(40001, 52001)
    assert pool((1024, 65535)) == range(1024, 65536)


def test_ephemeral_range_reads_the_sysctl_or_defaults(tmp_path: Path) -> None:
    sysctl = tmp_path / "ip_local_port_range"
    sysctl.write_text("40000\t50000\n")
    assert ephemeral_range(sysctl) == (40000, 50000)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)
