"""When an SDK cannot be installed, the index probe decides between a skip and a failure."""

from __future__ import annotations

import socket

import pytest

from tests.support.sdk_venv import index_unreachable


def test_unreachable_index_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
        assert index_unreachable().startswith(f"127.0.0.1:{port}: ")


def test_reachable_index(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{s.getsockname()[1]}/simple")
        assert index_unreachable() == ""
