"""SIGHUP reloads (SPEC §7): the configuration's reloadable keys, the TLS pair (checked first; a
bad one keeps the old), the routes file; open streams keep flowing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography import x509

from relay.config import Config
from relay.config_parse import load, parse
from relay.reload import RELOADABLE, flatten, plan, reload_settings
from relay.runtime import Relay
from tests.support.certs import Issued, issue
from tests.support.harness import DOMAIN, config_data, relay_process, route, to_toml, write_routes
from tests.support.ops import value, wait_until
from tests.support.ports import free_port
from tests.support.rawhttp import Connection, request, request_bytes


# -- plan (pure) --------------------------------------------------------------------------------
def _config(**sections: dict[str, Any]) -> Config:
    return parse(dict(sections))


@pytest.mark.parametrize(
    ("new", "applied", "restart"),
    [
        ({}, (), ()),
        ({"routing": {"domains": ["a.test", "b.test"]}}, ("routing.domains",), ()),
        (
            {"listen": {"max_connections": 5, "allowed_clients": ["10.0.0.0/8"]}},
            ("listen.max_connections", "listen.allowed_clients"),
            (),
        ),
        ({"listen": {"address": "127.0.0.1:1"}}, (), ("listen.address",)),
        ({"admin": {"address": "127.0.0.1:1"}}, (), ("admin.address",)),
        ({"process": {"workers": 4}}, (), ("process.workers",)),
        ({"upstream": {"source_address": "127.0.0.1"}}, (), ("upstream.source_address",)),
        ({"routes": {"file": "other.json"}}, (), ("routes.file",)),
        (
            {"listen": {"tls_cert": "c.pem", "tls_key": "k.pem"}},
            (),
            ("listen.tls_cert", "listen.tls_key"),
        ),
        (
            {"upstream": {"denied_ports": [1], "allowed_cidrs": ["10.0.0.0/8"]}},
            ("upstream.denied_ports", "upstream.allowed_cidrs"),
            (),
        ),
    ],
    ids=[
        "nothing",
        "domains",
        "limits",
        "listener",
        "admin",
        "workers",
        "source",
        "route-source",
        "tls-on",
        "upstream-policy",
    ],
)
def test_plan(
    new: dict[str, dict[str, Any]], applied: tuple[str, ...], restart: tuple[str, ...]
) -> None:
    old = _config(routing={"domains": ["a.test"]})
    data: dict[str, dict[str, Any]] = {"routing": {"domains": ["a.test"]}}
    for section, values in new.items():
        data.setdefault(section, {}).update(values)
    result = plan(old, parse(data))
    assert result.applied == applied
    assert result.restart_needed == restart
    effective = flatten(result.config)
    for key in restart:  # restart-only keys keep their running value
        assert effective[key] == flatten(old)[key]
    for key in applied:
        assert effective[key] == flatten(parse(data))[key]


def test_tls_paths_reload_while_tls_stays_on() -> None:
    old = _config(listen={"tls_cert": "a.pem", "tls_key": "a.key"})
    new = _config(listen={"tls_cert": "b.pem", "tls_key": "b.key"})
    assert plan(old, new).applied == ("listen.tls_cert", "listen.tls_key")


def test_every_reloadable_key_exists() -> None:
    assert set(RELOADABLE) <= set(flatten(Config()))


# -- a relay started from a file --------------------------------------------------------------
@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(int(request.query.get("n", "5"))):
            await response.write(f"event {i}\n".encode())
            await asyncio.sleep(float(request.query.get("interval", "0.05")))
        await response.write_eof()
        return response

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello {request.host}")

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/{tail:.*}", hello)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@contextlib.asynccontextmanager
async def relay_from_file(tmp_path: Path, data: dict[str, dict[str, Any]]) -> AsyncIterator[Relay]:
    write_routes(tmp_path / "routes.json", [route("sbx1", insecure=True)])
    path = tmp_path / "relay.toml"
    path.write_text(to_toml(data))
    relay = Relay(load(path))
    await relay.start()
    try:
        await wait_until(relay.ready)
        yield relay
    finally:
        await relay.stop()


def _rewrite(tmp_path: Path, data: dict[str, dict[str, Any]]) -> None:
    (tmp_path / "relay.toml").write_text(to_toml(data))


async def test_reload_applies_settings_and_keeps_a_stream_flowing(
    tmp_path: Path, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    data = config_data(tmp_path)
    async with relay_from_file(tmp_path, data) as relay:
        port = relay.bound[0][1]
        host = f"{upstream.port}-sbx1.{DOMAIN}"
        conn = await Connection.open(port)
        await conn.send(request_bytes("GET", "/stream?n=20&interval=0.05", host))
        await conn.pump(0.3)
        assert b"event 0" in conn.partial.body
        data["routing"]["domains"] = [DOMAIN, "new.test"]
        data["listen"]["max_connections"] = 77
        data["listen"]["address"] = "127.0.0.1:1"  # restart-only: logged, not applied
        _rewrite(tmp_path, data)
        with caplog.at_level(logging.INFO, logger="relay"):
            relay.reload()
        assert relay.config.listen.max_connections == 77
        assert relay.config.listen.addresses == ["127.0.0.1:0"]
        assert "listen.address changed but take(s) effect only on restart" in caplog.text
        assert "config reloaded: listen.max_connections, routing.domains" in caplog.text
        response = await request(port, "GET", "/", f"{upstream.port}-sbx1.new.test")
        assert response.status == 200
        assert response.body == f"hello {upstream.port}-sbx1.new.test".encode()
        streamed = await conn.read_response(5)
        await conn.close()
    assert streamed.status == 200
    assert streamed.body == b"".join(f"event {i}\n".encode() for i in range(20))
    assert relay.observer.reloads["ok"] == 1


async def test_a_broken_config_file_keeps_the_running_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with relay_from_file(tmp_path, config_data(tmp_path)) as relay:
        before = relay.config
        (tmp_path / "relay.toml").write_text("[listen]\nmax_connections = 'many'\n")
        relay.reload()
        assert relay.config is before
    assert "config reload failed, keeping the running configuration: listen.max_connections" in (
        caplog.text
    )
    assert relay.observer.reloads["error"] == 1


async def test_a_config_relay_cannot_parse_is_a_failed_reload_and_routes_still_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a ValueError out of the config's checks (a port past int()'s digit
    limit) escaped the reload, so the failure was neither counted nor logged, and the routes
    file was not re-read (SPEC §7). Any error in the checks is now a failed reload."""
    async with relay_from_file(tmp_path, config_data(tmp_path)) as relay:
        before = relay.config

        def broken(_path: object) -> object:
            raise ValueError("a bug in relay's own checks")

        monkeypatch.setattr("relay.reload.load", broken)
        write_routes(
            tmp_path / "routes.json", [route("sbx1", insecure=True), route("sbx2", insecure=True)]
        )
        relay.reload()
        assert relay.config is before
        assert relay.table.get("sbx2") is not None
    assert "config reload failed, keeping the running configuration" in caplog.text
    assert relay.observer.reloads["error"] == 1


async def test_narrowing_allowed_cidrs_removes_routes_outside_even_if_routes_fail_to_load(
    tmp_path: Path, upstream: TestServer
) -> None:
    """Found by review: the narrowing was left to the feed's next load, which keeps the old
    table when the routes file does not parse; a route outside kept being served."""
    data = config_data(tmp_path)
    async with relay_from_file(tmp_path, data) as relay:
        host = f"{upstream.port}-sbx1.{DOMAIN}"
        assert (await request(relay.bound[0][1], "GET", "/", host)).status == 200
        (tmp_path / "routes.json").write_text("{ half-written")
        data.setdefault("upstream", {})["allowed_cidrs"] = ["10.0.0.0/8"]
        _rewrite(tmp_path, data)
        relay.reload()
        assert relay.table.get("sbx1") is None
        response = await request(relay.bound[0][1], "GET", "/", host)
        assert response.status == 502
        assert b"was not found" in response.body


async def test_lowering_max_stale_applies_to_a_feed_already_down(tmp_path: Path) -> None:
    """Found by review: the stale timer armed with the old max_stale_s was kept."""
    data = config_data(tmp_path)
    async with relay_from_file(tmp_path, data) as relay:
        relay.feed_broken(time.monotonic() - 5)  # the feed went down 5 s ago
        assert not relay.feed_state.stale  # max_stale_s 30 by default
        data["routes"]["max_stale_s"] = 1
        _rewrite(tmp_path, data)
        assert reload_settings(relay)  # the config only: a routes load would end the outage
        assert relay.feed_state.stale


async def test_allowed_clients_reload_disconnects_clients_no_longer_allowed(
    tmp_path: Path, upstream: TestServer
) -> None:
    data = config_data(tmp_path)
    async with relay_from_file(tmp_path, data) as relay:
        port = relay.bound[0][1]
        conn = await Connection.open(port)
        await conn.send(request_bytes("GET", "/", f"{upstream.port}-sbx1.{DOMAIN}"))
        assert (await conn.read_response()).status == 200
        data["listen"]["allowed_clients"] = ["10.0.0.0/8"]
        _rewrite(tmp_path, data)
        relay.reload()
        assert await conn.closed_by_peer()
        await conn.close()
        assert await _turned_away(port, f"{upstream.port}-sbx1.{DOMAIN}")


async def _turned_away(port: int, host: str) -> bool:
    """The connection was closed or reset without an answer."""
    try:
        response = await request(port, "GET", "/", host)
    except ConnectionError:
        return True
    return response.status == 0


# -- TLS ----------------------------------------------------------------------------------------
def _install(pair: Issued, cert: Path, key: Path) -> None:
    shutil.copy(pair.cert_file, cert)
    shutil.copy(pair.key_file, key)


async def _served_serial(port: int) -> int:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname=f"49983-x.{DOMAIN}"
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()
    return x509.load_der_x509_certificate(der).serial_number


def _serial(pair: Issued) -> int:
    return x509.load_pem_x509_certificate(pair.cert_file.read_bytes()).serial_number


async def test_tls_reload_checks_the_new_pair_first(
    tmp_path: Path, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    pki = tmp_path / "pki"
    first = issue(pki, [f"*.{DOMAIN}"], prefix="first")
    second = issue(pki, [f"*.{DOMAIN}"], prefix="second")
    expired = issue(pki, [f"*.{DOMAIN}"], not_after_days=-1, not_before_days=-2, prefix="old")
    narrow = issue(pki, [f"api.{DOMAIN}"], prefix="narrow")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _install(first, cert, key)
    data = config_data(tmp_path, {"listen": {"tls_cert": str(cert), "tls_key": str(key)}})
    async with relay_from_file(tmp_path, data) as relay:
        port = relay.bound[0][1]
        assert await _served_serial(port) == _serial(first)
        # A TLS stream open across every reload below keeps flowing.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        host = f"{upstream.port}-sbx1.{DOMAIN}"
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname=host
        )
        writer.write(
            request_bytes("GET", "/stream?n=30&interval=0.03", host, [("Connection", "close")])
        )

        _install(second, cert, key)
        relay.reload()
        assert await _served_serial(port) == _serial(second)

        for bad, reason in (
            ((expired.cert_file, expired.key_file), "expired"),
            ((narrow.cert_file, narrow.key_file), f"does not cover *.{DOMAIN}"),
            ((first.cert_file, second.key_file), "does not match"),
        ):
            shutil.copy(bad[0], cert)
            shutil.copy(bad[1], key)
            caplog.clear()
            relay.reload()
            assert "TLS reload failed, keeping the current certificate" in caplog.text
            assert reason in caplog.text
            assert await _served_serial(port) == _serial(second)

        # A new routing domain the served certificate does not cover is not applied.
        _install(second, cert, key)
        data["routing"]["domains"] = [DOMAIN, "uncovered.test"]
        _rewrite(tmp_path, data)
        caplog.clear()
        relay.reload()
        assert relay.config.routing.domains == [DOMAIN]
        assert "routing.domains not changed" in caplog.text

        body = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    assert body.startswith(b"HTTP/1.1 200")
    assert body.count(b"event ") == 30
    assert relay.observer.tls_reloads == {"ok": 1, "error": 4}


async def test_sighup_in_a_real_process_keeps_a_stream_flowing(
    tmp_path: Path, upstream: TestServer
) -> None:
    with relay_process(tmp_path, [route("sbx1", insecure=True)]) as relay:
        host = f"{upstream.port}-sbx1.{DOMAIN}"
        conn = await Connection.open(relay.port)
        await conn.send(request_bytes("GET", "/stream?n=20&interval=0.05", host))
        await conn.pump(0.3)
        config = tmp_path / "relay.toml"
        config.write_text(config.read_text().replace(f'"{DOMAIN}"', f'"{DOMAIN}", "hup.test"'))
        both = [route("sbx1", insecure=True), route("sbx2", insecure=True)]
        write_routes(relay.routes_file, both)
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.3)
        for sandbox, domain in (("sbx1", "hup.test"), ("sbx2", DOMAIN)):
            response = await request(relay.port, "GET", "/", f"{upstream.port}-{sandbox}.{domain}")
            assert response.status == 200, relay.output()
        streamed = await conn.read_response(5)
        await conn.close()
    assert streamed.body.count(b"event ") == 20
    assert "config reloaded: routing.domains" in relay.output()


async def test_reload_without_a_file_reloads_routes_and_tls_only(tmp_path: Path) -> None:
    relay = Relay(parse(config_data(tmp_path), base_dir=tmp_path))
    write_routes(tmp_path / "routes.json", [])
    await relay.start()
    try:
        relay.reload()  # built in memory: nothing to re-read but the routes file
        assert relay.observer.reloads["ok"] == 1
    finally:
        await relay.stop()


def test_a_config_folder_swapped_by_a_symlink_is_followed(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap volume (and Nix, Capistrano-style releases): relay.toml and
    routes.json are links through ``..data``, which an update points at a new folder before
    deleting the old one. relay resolved the config file's links at start and kept reading
    the old folder: the routes file it polled was gone (the previous table, with the route
    the update removed, kept serving) and every SIGHUP failed to read the config."""
    mount = tmp_path / "mount"
    mount.mkdir()
    port, admin = free_port(), free_port()
    for version, routes in (("..v1", [route("box", insecure=True)]), ("..v2", [])):
        folder = mount / version
        folder.mkdir()
        data = config_data(tmp_path, {"routes": {"file": "routes.json"}}, port=port)
        data["admin"]["address"] = f"127.0.0.1:{admin}"
        (folder / "relay.toml").write_text(to_toml(data))
        write_routes(folder / "routes.json", routes)
    (mount / "..data").symlink_to("..v1")
    for name in ("relay.toml", "routes.json"):
        (mount / name).symlink_to(f"..data/{name}")
    log = tmp_path / "relay.stderr"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--config", str(mount / "relay.toml")],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        _until_routes(admin, 1, 10, log)
        (mount / "..data_tmp").symlink_to("..v2")  # as the kubelet updates it
        os.replace(mount / "..data_tmp", mount / "..data")
        shutil.rmtree(mount / "..v1")
        _until_routes(admin, 0, 3, log)  # the removed route is gone (revoked)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        text = _admin_get(admin, "/metrics").decode()
        assert value(text, "relay_reloads_total", result="ok") == 1
        assert value(text, "relay_reloads_total", result="error") == 0
    finally:
        proc.terminate()
        proc.wait(10)
    assert "cannot read" not in log.read_text()


def _admin_get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
        body: bytes = answer.read()
        return body


def _until_routes(port: int, count: int, within: float, log: Path) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError):  # still starting
            if json.loads(_admin_get(port, "/routes"))["count"] == count:
                return
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
