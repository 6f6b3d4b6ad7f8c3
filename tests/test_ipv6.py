"""relay end to end over IPv6, on the loopback ``::1``: listeners (data, TLS, admin), routes
whose address is an IPv6 literal (envd and app ports, Host and header forms), Host headers
holding IPv6 literals, what relay writes about an IPv6 client (access log, X-Forwarded-For,
/routes), streaming and WebSocket.

Every other test binds 127.0.0.1, so this path was hardly exercised (review). Skipped, saying
why, on a machine without an IPv6 loopback.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from relay.config_parse import load, parse
from relay.runtime import Relay
from relay.startup import StartupError
from tests.support.fake_app import FakeApp
from tests.support.fake_envd import FakeEnvd
from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    config_data,
    route,
    running_relay,
    tls_listener,
    to_toml,
    until,
    write_routes,
)
from tests.support.ipv6 import no_ipv6_loopback
from tests.support.rawhttp import Connection, Response

_NO_IPV6 = no_ipv6_loopback()
pytestmark = pytest.mark.skipif(_NO_IPV6 is not None, reason=f"no IPv6 loopback: {_NO_IPV6}")

ENVD_TOKEN = "tok-v6"


@pytest.fixture
async def app() -> AsyncIterator[FakeApp]:
    async with FakeApp(host="::1") as fake:
        yield fake


@pytest.fixture
async def envd() -> AsyncIterator[FakeEnvd]:
    async with FakeEnvd(host="::1") as fake:
        yield fake


def v6_overrides(envd: FakeEnvd, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """relay on [::1] (data and admin), routes allowed to ::1 only, envd on the fake's port."""
    out: dict[str, dict[str, Any]] = {
        "listen": {"address": "[::1]:0"},
        "admin": {"address": "[::1]:0"},
        "upstream": {"allowed_cidrs": ["::1/128"], "envd_port": envd.port},
    }
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


async def ask(relay: RelayUnderTest, host: str, *fields: tuple[str, str]) -> Response:
    """One GET / to relay's [::1] listener with this Host and these fields."""
    (bound_host, port) = relay.relay.bound[0]
    assert bound_host == "::1"
    conn = await Connection.open(port, "::1")
    try:
        lines = "".join(f"{name}: {value}\r\n" for name, value in (("Host", host), *fields))
        await conn.send(f"GET / HTTP/1.1\r\n{lines}\r\n".encode())
        return await conn.read_response()
    finally:
        await conn.close()


def received(response: Response) -> dict[str, str]:
    """The fake app's description of what reached it: its header fields, by lower-case name."""
    described = response.json()
    assert isinstance(described, dict)
    return {name.lower(): value for name, value in described["headers"]}


async def admin_get(relay: RelayUnderTest, path: str) -> str:
    bound = relay.relay.admin_bound
    assert bound is not None
    assert bound[0] == "::1"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://[::1]:{bound[1]}{path}") as response,
    ):
        assert response.status == 200
        return await response.text()


async def test_routes_to_an_ipv6_guest_by_host_and_by_headers(
    tmp_path: Path, app: FakeApp, envd: FakeEnvd, access_lines: list[dict[str, Any]]
) -> None:
    """A route whose address is ``::1`` (written ``0:0::1``: one address, one pool) reaches the
    app port and envd through a relay listening on [::1]; an IPv6 client is ``::1`` in the
    access log and in X-Forwarded-For (the usual form, no brackets and no port: relay writes no
    ``Forwarded``, whose RFC 7239 §6 form would be ``for="[::1]:port"``), and /routes shows
    the address in its normal form, no token."""
    routes = [route("sbxv6", "0:0::1", envd_token=ENVD_TOKEN)]
    overrides = v6_overrides(envd, listen={"trusted_proxies": ["::1/128"]})
    async with running_relay(tmp_path, routes, overrides) as relay:
        by_host = await ask(relay, f"{app.port}-sbxv6.{DOMAIN}", ("X-Forwarded-For", "192.0.2.7"))
        assert by_host.status == 200
        fields = received(by_host)
        assert fields["x-forwarded-for"] == "192.0.2.7, ::1"
        assert fields["x-forwarded-proto"] == "http"

        # Header form, with relay's own [::1]:port as the Host (an SDK's E2B_SANDBOX_URL).
        port = relay.relay.bound[0][1]
        by_headers = await ask(
            relay,
            f"[::1]:{port}",
            ("E2b-Sandbox-Id", "sbxv6"),
            ("E2b-Sandbox-Port", str(envd.port)),
            ("X-Access-Token", ENVD_TOKEN),
        )
        assert by_headers.status == 404  # the fake envd's own answer to GET /
        (to_envd,) = envd.records
        assert dict(to_envd.headers)["Host"] == f"[::1]:{port}"
        assert "X-Access-Token" not in dict(to_envd.headers)  # strip mode

        # One pool key for the two spellings of the address (SPEC §4's pooling key).
        await until(lambda: relay.relay.pool.idle_count() == 2)
        assert {key.address for key in relay.relay.pool._idle} == {"::1"}

        listed = json.loads(await admin_get(relay, "/routes"))
        assert [r["address"] for r in listed["routes"]] == ["::1"]
        assert ENVD_TOKEN not in json.dumps(listed)
        metrics = await admin_get(relay, "/metrics")
        assert "::1" not in metrics  # no client address in a label
        assert "sbxv6" not in metrics  # nor a sandbox id (SPEC §7)
    assert [(line["client"], line["status"]) for line in access_lines] == [
        ("::1", 200),
        ("::1", 404),
    ]


@pytest.mark.parametrize(
    ("host", "status", "reason"),
    [
        ("[::1]:8080", 404, "no_target"),  # an IP literal carries no target (SPEC §1)
        ("[::1]", 404, "no_target"),
        ("[::ffff:127.0.0.1]:80", 404, "no_target"),
        ("[::1", 400, "bad_host"),
        ("[::1]x", 400, "bad_host"),
        ("[fe80::1%25lo]:80", 400, "bad_host"),  # RFC 6874 zones are not taken
        # Brackets hold an IPv6 address (RFC 3986 §3.2.2): these were taken as hosts.
        ("[:]", 400, "bad_host"),
        ("[1.2.3.4]:80", 400, "bad_host"),
        ("[::1::2]:80", 400, "bad_host"),
    ],
)
async def test_a_host_holding_an_ipv6_literal_names_no_sandbox(
    tmp_path: Path,
    envd: FakeEnvd,
    access_lines: list[dict[str, Any]],
    host: str,
    status: int,
    reason: str,
) -> None:
    async with running_relay(tmp_path, [], v6_overrides(envd)) as relay:
        answer = await ask(relay, host)
    assert answer.status == status
    body = answer.json()
    assert isinstance(body, dict)
    assert body["code"] == status
    assert [(line["status"], line["reason"]) for line in access_lines] == [(status, reason)]


class _AllToLoopback6(AbstractResolver):
    """Every name is ::1: the client reaches relay's [::1] listener by the sandbox's host."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(
                hostname=host, host="::1", port=port, family=socket.AF_INET6, proto=0, flags=0
            )
        ]

    async def close(self) -> None:
        return None


async def test_tls_streaming_and_websocket_over_ipv6(
    tmp_path: Path, app: FakeApp, envd: FakeEnvd
) -> None:
    """A TLS listener on [::1], upstream connections bound to ``source_address = "::1"``: a
    chunked stream arrives chunk by chunk, and a WebSocket echoes and carries its close code."""
    tls, client_tls = tls_listener(tmp_path / "pki")
    overrides = v6_overrides(envd, listen=tls["listen"], upstream={"source_address": "::1"})
    routes = [route("sbxv6", "::1", insecure=True)]
    async with running_relay(tmp_path, routes, overrides) as relay:
        assert relay.relay.pool.source_address == "::1"
        base = f"{app.port}-sbxv6.{DOMAIN}:{relay.port}"
        connector = aiohttp.TCPConnector(ssl=client_tls, resolver=_AllToLoopback6())
        async with aiohttp.ClientSession(connector=connector) as session:
            start = time.monotonic()
            arrivals = []
            async with session.get(f"https://{base}/stream?n=3&interval=0.2") as response:
                assert response.status == 200
                async for chunk in response.content.iter_any():
                    arrivals.append((time.monotonic() - start, chunk))
            assert b"".join(c for _, c in arrivals) == b"chunk 0\nchunk 1\nchunk 2\n"
            # Chunk by chunk: the first did not wait for the last, sent 0.4 s later.
            assert arrivals[-1][0] - arrivals[0][0] > 0.3

            async with session.ws_connect(f"wss://{base}/ws") as ws:
                await ws.send_str("over v6")
                echoed = await asyncio.wait_for(ws.receive(), 5)
                assert echoed.data == "over v6"
                await ws.close(code=4006)
        for _ in range(100):
            if app.ws_close_codes:
                break
            await asyncio.sleep(0.01)
    assert app.ws_close_codes == [4006]


@pytest.mark.parametrize("taken", ["listen.address", "admin.address"])
async def test_a_taken_ipv6_port_is_named_in_brackets(tmp_path: Path, taken: str) -> None:
    """The one line a listener that cannot bind stops relay with wrote ``::1:PORT``, which
    reads as one IPv6 address with no port (found by review; the start line has brackets)."""
    with socket.socket(socket.AF_INET6) as holder:
        holder.bind(("::1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        section = taken.partition(".")[0]
        overrides = {section: {"address": f"[::1]:{busy}"}}
        config = parse(config_data(tmp_path, overrides), base_dir=tmp_path)
        write_routes(tmp_path / "routes.json", [])
        relay = Relay(config)
        try:
            with pytest.raises(StartupError) as raised:
                await relay.start()
        finally:
            await relay.stop()
    assert str(raised.value) == f"cannot listen on {taken} [::1]:{busy}: Address already in use"


@pytest.mark.parametrize(("source", "guest"), [("127.0.0.1", "::1"), ("::1", "127.0.0.1")])
async def test_a_source_address_of_the_other_family_is_the_dial_reason(
    tmp_path: Path, envd: FakeEnvd, access_lines: list[dict[str, Any]], source: str, guest: str
) -> None:
    """``upstream.source_address`` is one address of one family, so a guest of the other is
    not dialled (docs/operations.md). The access log said only ``dial: Invalid argument`` or
    ``dial: Address family not supported by protocol`` (found by review); it says why."""
    overrides = v6_overrides(
        envd, upstream={"source_address": source, "allowed_cidrs": ["127.0.0.0/8", "::1/128"]}
    )
    async with running_relay(tmp_path, [route("sbxv6", guest, insecure=True)], overrides) as relay:
        answer = await ask(relay, f"8080-sbxv6.{DOMAIN}")
    assert answer.status == 502
    families = {"127.0.0.1": "IPv4", "::1": "IPv6"}
    (line,) = access_lines
    assert line["reason"] == (
        f"dial: the source address {source} is {families[source]}, "
        f"the upstream {guest} is {families[guest]}"
    )


async def test_an_ipv4_mapped_route_is_judged_by_the_ipv4_address_it_reaches_too(
    tmp_path: Path, envd: FakeEnvd
) -> None:
    """``::ffff:127.0.0.1`` is inside ``::/0`` as written, and an IPv6 socket connecting to it
    reaches 127.0.0.1: with ``allowed_cidrs`` meant for IPv6 guests only, a route could point
    relay at any IPv4 address, a host's own services or a metadata endpoint (found by review).
    It is refused unless the IPv4 address is allowed as well."""
    async with FakeApp(host="127.0.0.1") as v4_app:
        mapped = [route("sbxmap", "::ffff:127.0.0.1", insecure=True)]
        overrides = v6_overrides(envd, upstream={"allowed_cidrs": ["::/0"]})
        async with running_relay(tmp_path, mapped, overrides) as relay:
            assert relay.relay.table.get("sbxmap") is None
            answer = await ask(relay, f"{v4_app.port}-sbxmap.{DOMAIN}")
            assert answer.status == 502
            assert v4_app.records == []

        overrides = v6_overrides(envd, upstream={"allowed_cidrs": ["::/0", "127.0.0.0/8"]})
        async with running_relay(tmp_path, mapped, overrides) as relay:
            answer = await ask(relay, f"{v4_app.port}-sbxmap.{DOMAIN}")
            assert answer.status == 200  # the IPv4 address is allowed too


async def test_a_management_upstream_at_an_ipv6_address(
    tmp_path: Path, app: FakeApp, envd: FakeEnvd
) -> None:
    """``management.upstream = "http://[::1]:port"`` is dialled at ::1, and a request that had
    no Host (HTTP/1.0) gets the upstream's authority, brackets included (RFC 9112 §3.2)."""
    overrides = v6_overrides(envd, management={"upstream": f"http://[::1]:{app.port}"})
    async with running_relay(tmp_path, [], overrides) as relay:
        conn = await Connection.open(relay.port, "::1")
        try:
            await conn.send(b"GET /sandboxes HTTP/1.0\r\n\r\n")
            answer = await conn.read_response()
        finally:
            await conn.close()
    assert answer.status == 404  # the fake's answer to a path it does not serve
    (record,) = app.records
    assert record.target == "/sandboxes"
    assert dict(record.headers)["Host"] == f"[::1]:{app.port}"


async def _turned_away(relay: RelayUnderTest, host: str, client_tls: ssl.SSLContext | None) -> bool:
    try:
        reader, writer = await asyncio.open_connection(
            "::1", relay.port, ssl=client_tls, server_hostname=host if client_tls else None
        )
    except (ConnectionError, ssl.SSLError):
        return True  # reset during the handshake
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), 5)
    except (ConnectionError, ssl.SSLError):
        return True
    finally:
        writer.close()
    return not answer.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize(
    ("allowed", "admitted"), [(["127.0.0.0/8"], False), (["10.0.0.0/8", "::1/128"], True)]
)
async def test_allowed_clients_and_trusted_proxies_judge_an_ipv6_client(
    tmp_path: Path, app: FakeApp, envd: FakeEnvd, tls: bool, allowed: list[str], admitted: bool
) -> None:
    """``listen.allowed_clients`` on a plain and a TLS listener (checked before the handshake)
    and ``listen.trusted_proxies`` take an IPv6 client as its address: ``::1`` is in
    ``::1/128``, not in ``127.0.0.0/8`` (no IPv4-mapped form on a v6-only listener)."""
    listen: dict[str, Any] = {"allowed_clients": allowed, "trusted_proxies": ["127.0.0.0/8"]}
    client_tls = None
    if tls:
        tls_overrides, client_tls = tls_listener(tmp_path / "pki")
        listen.update(tls_overrides["listen"])
    overrides = v6_overrides(envd, listen=listen)
    async with running_relay(tmp_path, [route("sbxv6", "::1", insecure=True)], overrides) as relay:
        host = f"{app.port}-sbxv6.{DOMAIN}"
        assert await _turned_away(relay, host, client_tls) is not admitted
        if admitted and not tls:
            answer = await ask(relay, host, ("X-Forwarded-For", "192.0.2.7"))
            assert "x-forwarded-for" not in received(answer)  # ::1 is no trusted proxy


async def test_narrowing_allowed_cidrs_drops_a_mapped_route_whose_ipv4_address_left_them(
    tmp_path: Path, envd: FakeEnvd
) -> None:
    """A reload (SIGHUP) that narrows ``upstream.allowed_cidrs`` removes the routes now outside
    at once, by the rule the feeds apply: a route at ``::ffff:127.0.0.1`` stays inside
    ``::/0`` as written, but the IPv4 address it reaches no longer is (found by review)."""
    async with FakeApp(host="127.0.0.1") as v4_app:
        data = config_data(tmp_path, v6_overrides(envd))
        data["upstream"]["allowed_cidrs"] = ["::/0", "127.0.0.0/8"]
        config_file = tmp_path / "relay.toml"
        config_file.write_text(to_toml(data))
        write_routes(tmp_path / "routes.json", [route("sbxmap", "::ffff:127.0.0.1", insecure=True)])
        relay = Relay(load(config_file))
        await relay.start()
        try:
            under_test = RelayUnderTest(relay, tmp_path / "routes.json")
            await until(relay.ready)
            host = f"{v4_app.port}-sbxmap.{DOMAIN}"
            assert (await ask(under_test, host)).status == 200
            (tmp_path / "routes.json").write_text("{ half-written")  # the feed keeps its table
            data["upstream"]["allowed_cidrs"] = ["::/0"]
            config_file.write_text(to_toml(data))
            relay.reload()
            assert relay.table.get("sbxmap") is None
            assert (await ask(under_test, host)).status == 502
        finally:
            await relay.stop()
