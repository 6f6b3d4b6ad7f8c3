"""The upstream source address (SPEC §4, §6): checked over netlink at start, bound on every dial.

The end-to-end test needs root: it creates a network namespace and a veth pair, runs the
upstream inside the namespace and relay outside bound to the veth's address, and checks the
address the upstream saw. Without root (or without ``ip``) it is skipped with the reason.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relay.config import ConfigError, Upstream
from relay.config_parse import parse
from relay.netlink import InterfaceAddress, pick_source, read_addresses, resolve_source
from relay.runtime import Relay
from tests.support.harness import DOMAIN, config_data, route, running_relay, serve_until_exit
from tests.support.rawhttp import request

V4, V6 = socket.AF_INET, socket.AF_INET6
ADDRESSES = [
    InterfaceAddress("lo", V4, "127.0.0.1", 8),
    InterfaceAddress("br0", V6, "fd00::1", 64),
    InterfaceAddress("br0", V4, "10.11.0.1", 16),
    InterfaceAddress("br0", V4, "10.11.0.2", 16, secondary=True),
    InterfaceAddress("br1", V4, "10.12.0.2", 16, secondary=True),
    InterfaceAddress("br2", V6, "fd00::2", 64),
]
INTERFACES = ["lo", "br0", "br1", "br2", "eth0"]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, None),
        ({"source_address": "10.11.0.2"}, "10.11.0.2"),  # a secondary address is fine if named
        ({"source_address": "fd00:0::1"}, "fd00::1"),  # compared as addresses
        ({"source_interface": "br0"}, "10.11.0.1"),  # first primary IPv4, not the IPv6
    ],
    ids=["unset", "address", "v6-address", "interface"],
)
def test_pick_source(keys: dict[str, str], expected: str | None) -> None:
    assert pick_source(ADDRESSES, INTERFACES, **keys) == expected


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"source_address": "10.99.0.1"},
            "upstream.source_address: 10.99.0.1 is not assigned to any local interface",
        ),
        ({"source_interface": "br9"}, "upstream.source_interface: no interface named 'br9'"),
        ({"source_interface": "eth0"}, "upstream.source_interface: eth0 has no primary IPv4"),
        ({"source_interface": "br1"}, "upstream.source_interface: br1 has no primary IPv4"),
        ({"source_interface": "br2"}, "upstream.source_interface: br2 has no primary IPv4"),
    ],
    ids=["not-local", "no-interface", "no-address", "only-secondary", "only-v6"],
)
def test_pick_source_errors_name_the_key(keys: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        pick_source(ADDRESSES, INTERFACES, **keys)
    assert str(info.value).startswith(message)


def test_read_addresses_sees_loopback() -> None:
    addresses, interfaces = read_addresses()
    assert "lo" in interfaces
    assert InterfaceAddress("lo", V4, "127.0.0.1", 8) in addresses


def test_resolve_source_on_this_machine() -> None:
    assert resolve_source(Upstream(source_address="127.0.0.1")) == "127.0.0.1"
    assert resolve_source(Upstream(source_interface="lo")) == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"^upstream\.source_address: 192\.0\.2\.250 is not"):
        resolve_source(Upstream(source_address="192.0.2.250"))


async def test_relay_does_not_start_with_a_foreign_source(tmp_path: Path) -> None:
    overrides = {"upstream": {"source_interface": "relay-no-such-if"}}
    (tmp_path / "routes.json").write_text('{"routes": []}')
    relay = Relay(parse(config_data(tmp_path, overrides), base_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"^upstream\.source_interface: no interface named"):
        await relay.start()
    assert relay.bound == []


def test_serve_exits_2_on_a_foreign_source_address(tmp_path: Path) -> None:
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = tmp_path / "relay.toml"
    config.write_text(
        "[admin]\naddress = '127.0.0.1:0'\n[listen]\naddress = '127.0.0.1:0'\n"
        "[upstream]\nsource_address = '192.0.2.250'\n"
    )
    result = serve_until_exit(config)
    assert result.returncode == 2
    assert "relay: config error: upstream.source_address: 192.0.2.250 is not assigned" in (
        result.stderr
    )


# -- a network namespace ------------------------------------------------------------------------
PEER_SCRIPT = """
import http.server, sys
class Peer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.client_address[0].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Peer).serve_forever()
"""


@dataclass
class Veth:
    namespace: str
    host_if: str
    primary: str  # host side, first address
    secondary: str  # host side, second address in the same subnet
    peer: str  # inside the namespace
    port: int


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def veth() -> Iterator[Veth]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        reason = "needs root and iproute2 to create a network namespace and a veth pair"
        print(f"skipping the namespace test: {reason}")
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    net = f"10.237.{random.randrange(1, 250)}"
    v = Veth(f"relaytest{tag}", f"rly{tag}a", f"{net}.1", f"{net}.2", f"{net}.6", 8080)
    peer_if = f"rly{tag}b"
    proc: subprocess.Popen[bytes] | None = None
    try:
        _ip("netns", "add", v.namespace)
        _ip("link", "add", v.host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", v.namespace)
        _ip("addr", "add", f"{v.primary}/29", "dev", v.host_if)
        _ip("addr", "add", f"{v.secondary}/29", "dev", v.host_if)
        _ip("link", "set", v.host_if, "up")
        _ip("-n", v.namespace, "addr", "add", f"{v.peer}/29", "dev", peer_if)
        _ip("-n", v.namespace, "link", "set", peer_if, "up")
        _ip("-n", v.namespace, "link", "set", "lo", "up")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", v.namespace, sys.executable, "-c", PEER_SCRIPT, v.peer, "8080"]
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((v.peer, v.port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the upstream in the namespace did not start"
                time.sleep(0.05)
        yield v
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", v.namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", v.host_if], capture_output=True, check=False)


@pytest.mark.parametrize("mode", ["interface", "address"])
async def test_upstream_sees_the_configured_source(tmp_path: Path, veth: Veth, mode: str) -> None:
    upstream: dict[str, Any]
    if mode == "interface":
        upstream, expected = {"source_interface": veth.host_if}, veth.primary
    else:
        upstream, expected = {"source_address": veth.secondary}, veth.secondary
    routes = [route("nsbox", veth.peer, insecure=True)]
    async with running_relay(tmp_path, routes, {"upstream": upstream}) as relay:
        assert relay.relay.pool.source_address == expected
        response = await request(relay.port, "GET", "/", f"{veth.port}-nsbox.{DOMAIN}")
    assert response.status == 200
    assert response.body.decode() == expected
