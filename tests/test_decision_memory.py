"""Relay.decide remembers decisions only while they cannot change (relay/runtime.py)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

from relay.core.auth import file_signature
from relay.core.model import Forward, Reason, Reject, RequestHead
from tests.support.harness import DOMAIN, route, running_relay


def head(target: bytes, host: bytes, *extra: tuple[bytes, bytes]) -> RequestHead:
    return RequestHead(
        method=b"GET",
        target=target,
        version="1.1",
        headers=((b"Host", host), *extra),
        peer="127.0.0.1",
    )


async def test_a_repeated_head_is_decided_once_until_the_table_changes(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [route("mem", envd_token="tok")]) as r:
        relay = r.relay
        request = head(b"/health", f"49983-mem.{DOMAIN}".encode(), (b"X-Access-Token", b"tok"))
        first = relay.decide(request)
        assert isinstance(first, Forward)
        assert relay.decide(request) is first  # remembered
        r.set_routes([route("mem", envd_token="other")])  # a new table: everything forgotten
        after = relay.decide(request)
        assert isinstance(after, Reject)
        assert after.reason is Reason.ENVD_UNAUTHORIZED


async def test_clock_and_count_dependent_decisions_are_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = [route("mem", envd_token="tok"), route("lim", insecure=True, max_connections=1)]
    async with running_relay(tmp_path, routes) as r:
        relay = r.relay
        now = 1_800_000_000
        monkeypatch.setattr("relay.runtime.time.time", lambda: float(now))
        signature = file_signature("/a", "read", "", "tok", now + 10)
        target = (
            f"/files?path=%2Fa&signature={urllib.parse.quote(signature, safe='')}"
            f"&signature_expiration={now + 10}"
        ).encode()
        signed = head(target, f"49983-mem.{DOMAIN}".encode())
        assert isinstance(relay.decide(signed), Forward)
        now += 11  # the URL has expired
        expired = relay.decide(signed)
        assert isinstance(expired, Reject)
        assert expired.reason is Reason.ENVD_UNAUTHORIZED

        limited = head(b"/", f"8080-lim.{DOMAIN}".encode())
        assert isinstance(relay.decide(limited), Forward)
        relay.inflight["lim"] = 1
        refused = relay.decide(limited)
        assert isinstance(refused, Reject)
        assert refused.reason is Reason.SANDBOX_LIMIT
        relay.inflight.pop("lim")
        assert isinstance(relay.decide(limited), Forward)
