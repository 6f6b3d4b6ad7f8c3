"""Relay.decide remembers decisions only while they cannot change, and only for small heads
(relay/decisions.py)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

from relay.core.auth import file_signature
from relay.core.decide import FeedState, Settings
from relay.core.model import Decision, Forward, Reason, Reject, RequestHead, Route, Target
from relay.core.routes import RouteTable
from relay.decisions import MEMO_BYTES, MEMO_FIELDS, DecisionMemory
from tests.support.harness import DOMAIN, route, running_relay


class InFlight:
    """Stands for an exchange in the live index (relay.inflight.Live)."""

    decision: Decision | None = None

    def revoke(self, answer: Reason) -> bool:
        raise AssertionError("nothing is revoked here")


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


async def test_a_head_object_keeps_its_decision_only_while_the_memory_does(
    tmp_path: Path,
) -> None:
    # relay.request_heads reuses a connection's RequestHead for a repeated request, and the decision
    # rides on that object (RequestHead.decided): it must hold exactly as long as the memory's.
    async with running_relay(tmp_path, [route("mem", envd_token="tok")]) as r:
        relay = r.relay
        fields = (b"X-Access-Token", b"tok")
        request = head(b"/health", f"49983-mem.{DOMAIN}".encode(), fields)
        first = relay.decide(request)
        assert request.decided is not None
        assert request.decided[1] is first
        twin = head(b"/health", f"49983-mem.{DOMAIN}".encode(), fields)
        assert twin == request  # the shortcut is not part of the value
        assert relay.decide(twin) is first  # found by value, then kept on the twin too
        assert twin.decided is not None
        assert twin.decided[1] is first
        relay.draining = True
        drained = relay.decide(request)
        assert isinstance(drained, Reject)
        assert drained.reason is Reason.DRAINING
        relay.draining = False
        assert relay.decide(request) is first
        relay.settings = relay.settings  # a reload: every decision is forgotten
        again = relay.decide(request)
        assert again is not first
        assert again == first
        assert relay.decide(twin) is again  # the twin's shortcut went with the old epoch


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
        relay.live["lim"] = {InFlight()}  # one exchange in flight (relay.inflight.Inflight)
        assert relay.inflight.get("lim") == 1
        refused = relay.decide(limited)
        assert isinstance(refused, Reject)
        assert refused.reason is Reason.SANDBOX_LIMIT
        del relay.live["lim"]
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


def tiny_fields(count: int) -> tuple[tuple[bytes, bytes], ...]:
    """``count`` distinct two-byte fields: the most Python objects per byte of head."""
    return tuple((b"%c%c" % (97 + i % 26, 97 + i // 26 % 26), b"v") for i in range(count))


def sized(fields: int, size: int) -> RequestHead:
    """A forwarded head of exactly ``fields`` fields and ``size`` bytes of target, names and
    values (what ``relay.decisions.small`` counts)."""
    host = f"8080-mem.{DOMAIN}".encode()
    others = tiny_fields(fields - 2)
    used = len(b"/") + len(b"Host") + len(host) + 3 * len(others) + len(b"X-Pad")
    assert size >= used
    return head(b"/", host, *others, (b"X-Pad", b"p" * (size - used)))


MEMORY_INPUTS: tuple[RouteTable, Settings, FeedState, dict[str, int]] = (
    RouteTable.of({"mem": Route(sandbox_id="mem", address="127.0.0.1", insecure=True)}),
    Settings(domains=(DOMAIN,)),
    FeedState(),
    {},
)


@pytest.mark.parametrize(
    ("request_head", "refusal"),
    [
        # The review's probe: ~1,900 tiny fields under the 16 KiB head limit, refused (no
        # sandbox named) before any route is looked at; remembered, each pinned ~250 KB.
        (head(b"/p1", b"localhost", *tiny_fields(1900)), Reason.NO_TARGET),
        (sized(MEMO_FIELDS + 1, 200), None),  # one field too many
        (sized(3, MEMO_BYTES + 1), None),  # one byte too many
        (head(b"/" + b"a" * MEMO_BYTES, f"8080-mem.{DOMAIN}".encode()), None),  # the target counts
    ],
    ids=["1900-fields-refused", "fields", "bytes", "target"],
)
def test_a_head_too_large_to_remember_is_decided_every_time(
    request_head: RequestHead, refusal: Reason | None
) -> None:
    # A remembered head keeps its field tuple alive: ever-new heads of many fields (or of
    # many bytes) must cost relay a decide each, not memory (relay.decisions.MEMO_FIELDS).
    memory = DecisionMemory()
    first = memory.decide(request_head, *MEMORY_INPUTS)
    if refusal is None:
        assert isinstance(first, Forward)
        assert first.target == Target("mem", 8080)
    else:
        assert isinstance(first, Reject)
        assert first.reason is refusal
    again = memory.decide(request_head, *MEMORY_INPUTS)
    assert again == first  # decided afresh, to the same decision
    assert again is not first  # but not remembered


def test_an_ordinary_head_up_to_the_limits_is_remembered() -> None:
    memory = DecisionMemory()
    sdk = head(
        b"/process.Process/Start",
        f"8080-mem.{DOMAIN}".encode(),
        (b"User-Agent", b"e2b-python-sdk/2.3.0"),
        (b"Content-Type", b"application/connect+json"),
        (b"Connect-Protocol-Version", b"1"),
        (b"Content-Length", b"42"),
    )
    for request in (sdk, sized(MEMO_FIELDS, MEMO_BYTES)):
        first = memory.decide(request, *MEMORY_INPUTS)
        assert isinstance(first, Forward)
        assert memory.decide(request, *MEMORY_INPUTS) is first
