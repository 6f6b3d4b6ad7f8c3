"""A dial that fails for want of a local port or address of relay's host: EADDRNOTAVAIL (no
ephemeral port left towards one guest address, from the source address or not; or, at the
bind, ``upstream.source_address`` gone from the host since relay checked it at start).

Nothing reached the guest, so these are answered as relay being overloaded (503, Retry-After)
with a rate-limited warning naming what ran out, not 502 "port is not open", which blames it.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest

from relay.dial import DESCRIPTORS, PORTS, SOURCE_GONE, SOURCE_PORTS, shortage
from tests.support.fake_app import FakeApp
from tests.support.harness import DOMAIN, route, running_relay
from tests.support.rawhttp import request

GONE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): assigned to no interface here


async def test_a_source_address_gone_from_the_host_is_answered_503_and_named(
    tmp_path: Path, access_lines: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """relay checks ``upstream.source_address`` at start (relay.netlink); an address removed
    later (``ip addr del``, a DHCP lease lost) fails every bind with EADDRNOTAVAIL. relay
    answered 502 "The sandbox is running but port is not open" (access-log reason
    ``dial: Cannot assign requested address``), blaming every guest for its own host."""
    async with FakeApp() as app:
        overrides = {"upstream": {"source_address": "127.0.0.1"}}
        async with running_relay(tmp_path, [route("box", insecure=True)], overrides) as relay:
            host = f"{app.port}-box.{DOMAIN}"
            assert (await request(relay.port, "GET", "/", host)).status == 200
            relay.relay.pool.close_all()  # the next request dials
            relay.relay.pool.source_address = GONE  # what the kernel sees once it is removed
            with caplog.at_level(logging.WARNING, logger="relay.upstream"):
                answers = [await request(relay.port, "GET", "/", host) for _ in range(3)]
            refusals = relay.relay.observer.refusals
    for answer in answers:
        assert answer.status == 503, answer
        assert answer.json() == {
            "code": 503,
            "message": "relay has too many open connections",
            "sandboxId": "box",
        }
        assert answer.header("Retry-After") == "1"
    assert refusals["overloaded"] == 3
    assert refusals["port_closed"] == 0
    why = f"upstream.source_address {GONE} is not assigned to any local interface"
    assert [line["reason"] for line in access_lines[1:]] == [
        f"dial: Cannot assign requested address: {why}"
    ] * 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "relay.upstream"]
    assert warnings == [f"upstream dials fail: {why}; answering 503 until that changes"]


@pytest.mark.parametrize(
    ("code", "source", "at_bind", "short"),
    [
        (errno.EMFILE, None, False, DESCRIPTORS),
        (errno.ENFILE, "10.0.0.1", False, DESCRIPTORS),
        # connect() found no port towards this address and port (checked: a 4-port
        # ip_local_port_range in a network namespace, relay's uvloop dial) ...
        (errno.EADDRNOTAVAIL, None, False, PORTS),
        # ... and from a source address bound without a port (tests/test_source_ports.py).
        (errno.EADDRNOTAVAIL, "10.0.0.1", False, SOURCE_PORTS),
        # bind(source, 0): the address is not the host's ...
        (errno.EADDRNOTAVAIL, "10.0.0.1", True, SOURCE_GONE),
        # ... or, on a kernel without IP_BIND_ADDRESS_NO_PORT, no port of it is free towards
        # any destination (TIME_WAIT included).
        (errno.EADDRINUSE, "10.0.0.1", True, SOURCE_PORTS),
        (errno.EADDRINUSE, None, False, None),  # not from a dial without a bind
        (errno.EADDRINUSE, "10.0.0.1", False, None),  # nor from a connect
        (errno.ECONNREFUSED, None, False, None),
        (errno.EHOSTUNREACH, "10.0.0.1", False, None),
        (errno.EINVAL, "::1", True, None),  # a family mismatch: the route's, said as such
    ],
)
def test_what_a_failed_dial_ran_short_of(
    code: int, source: str | None, at_bind: bool, short: str
) -> None:
    assert shortage(code, source, at_bind=at_bind) == short
