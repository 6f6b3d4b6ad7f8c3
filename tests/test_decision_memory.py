"""Relay.decide remembers decisions only while they cannot change (relay/decisions.py)."""

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
        monkeypatch.setattr("relay.decisions.time.time", lambda: float(now))
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


@pytest.mark.parametrize("exp_name", ["signature_expiration", "signature%5Fexpiration"])
async def test_a_signed_url_is_remembered_until_its_expiration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exp_name: str
) -> None:
    # The SDK signs each download URL once and clients fetch it repeatedly: its decision is
    # remembered (a full decide costs ~3x the rest of the request, bench/micro.py) until the
    # second of its signature_expiration, however the parameter is spelled.
    async with running_relay(tmp_path, [route("mem", envd_token="tok")]) as r:
        relay = r.relay
        now = 1_800_000_000
        monkeypatch.setattr("relay.decisions.time.time", lambda: now + 0.5)
        signature = urllib.parse.quote(file_signature("/a", "read", "", "tok", now + 10), safe="")
        target = f"/files?path=%2Fa&signature={signature}&{exp_name}={now + 10}".encode()
        signed = head(target, f"49983-mem.{DOMAIN}".encode())
        first = relay.decide(signed)
        assert isinstance(first, Forward)
        assert first.expires == now + 10
        assert b"signature" not in first.path  # stripped before it goes upstream
        now += 10  # exp == now: still valid (envd's rule)
        assert relay.decide(signed) is first
        now += 1
        expired = relay.decide(signed)
        assert isinstance(expired, Reject)
        assert expired.reason is Reason.ENVD_UNAUTHORIZED
        assert isinstance(relay.decide(signed), Reject)  # and stays refused


async def test_an_unexpiring_signature_is_remembered_until_the_table_changes(
    tmp_path: Path,
) -> None:
    async with running_relay(tmp_path, [route("mem", envd_token="tok")]) as r:
        relay = r.relay
        signature = urllib.parse.quote(file_signature("/a", "read", "u", "tok", None), safe="")
        signed = head(
            f"/files?path=%2Fa&username=u&signature={signature}".encode(),
            f"49983-mem.{DOMAIN}".encode(),
        )
        first = relay.decide(signed)
        assert isinstance(first, Forward)
        assert first.expires is None
        assert relay.decide(signed) is first
        r.set_routes([route("mem", envd_token="rotated")])  # the token changed: re-checked
        refused = relay.decide(signed)
        assert isinstance(refused, Reject)
        assert refused.reason is Reason.ENVD_UNAUTHORIZED


async def test_the_memory_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A client sending ever-new heads (a new query each time) must not grow relay's memory.
    monkeypatch.setattr("relay.decisions.DECISION_MEMORY", 8)
    async with running_relay(tmp_path, [route("mem", insecure=True)]) as r:
        relay = r.relay
        host = f"8080-mem.{DOMAIN}".encode()
        first = relay.decide(head(b"/?n=0", host))
        assert relay.decide(head(b"/?n=0", host)) is first
        for n in range(1, 8):
            relay.decide(head(f"/?n={n}".encode(), host))
        assert relay.decide(head(b"/?n=0", host)) is first  # 8 held
        relay.decide(head(b"/?n=8", host))  # the ninth drops the memory
        again = relay.decide(head(b"/?n=0", host))
        assert isinstance(again, Forward)
        assert again is not first
        assert again == first  # decided afresh, to the same decision
