"""``listen.allowed_clients`` (who may connect) and ``listen.trusted_proxies`` (whose
X-Forwarded-* are kept) end to end (SPEC §4, §6); ``check-config`` keeps secrets out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.__main__ import main
from tests.support.certs import issue
from tests.support.harness import DOMAIN, route, running_relay
from tests.support.ops import get, samples
from tests.support.rawhttp import request

FORWARDED = ("forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip")


@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    async def echo_headers(request: web.Request) -> web.Response:
        return web.json_response(
            [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers]
        )

    app = web.Application()
    app.router.add_get("/{tail:.*}", echo_headers)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def _turned_away(port: int, host: str) -> bool:
    try:
        response = await request(port, "GET", "/", host)
    except ConnectionError:
        return True
    return response.status == 0


@pytest.mark.parametrize(
    ("allowed", "admitted"),
    [([], True), (["127.0.0.0/8"], True), (["10.0.0.0/8", "::1/128"], False)],
    ids=["everyone", "loopback-allowed", "loopback-not-allowed"],
)
async def test_allowed_clients(
    tmp_path: Path, upstream: TestServer, allowed: list[str], admitted: bool
) -> None:
    overrides = {"listen": {"allowed_clients": allowed}}
    async with running_relay(tmp_path, [route("aclbox", insecure=True)], overrides) as relay:
        host = f"{upstream.port}-aclbox.{DOMAIN}"
        refused = await _turned_away(relay.port, host)
        assert relay.relay.admin_bound is not None
        status, body = await get(relay.relay.admin_bound[1], "/metrics")
    assert refused is not admitted
    # relay_connections_reset_total: a reset at accept left no trace an operator could see.
    assert status == 200
    resets = {
        dict(labels)["reason"]: value
        for (name, labels), value in samples(body.decode()).items()
        if name == "relay_connections_reset_total"
    }
    assert resets == ({} if admitted else {"not_allowed": 1.0})


async def _forwarded_headers(
    tmp_path: Path, upstream: TestServer, trusted: list[str], sent: list[tuple[str, str]]
) -> dict[str, str]:
    overrides = {"listen": {"trusted_proxies": trusted}}
    async with running_relay(tmp_path, [route("xffbox", insecure=True)], overrides) as relay:
        host = f"{upstream.port}-xffbox.{DOMAIN}"
        response = await request(relay.port, "GET", "/", host, sent)
    assert response.status == 200
    seen: list[list[Any]] = json.loads(response.body)
    return {k.lower(): v for k, v in seen if k.lower() in FORWARDED}


INBOUND = [
    ("X-Forwarded-For", "203.0.113.9"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Host", "edge.example"),
    ("X-Real-IP", "203.0.113.9"),
    ("Forwarded", "for=203.0.113.9"),
]


async def test_untrusted_peer_loses_every_forwarded_field(
    tmp_path: Path, upstream: TestServer
) -> None:
    assert await _forwarded_headers(tmp_path, upstream, ["10.0.0.0/8"], INBOUND) == {}
    assert await _forwarded_headers(tmp_path, upstream, [], INBOUND) == {}


async def test_trusted_proxy_fields_are_kept_and_extended(
    tmp_path: Path, upstream: TestServer
) -> None:
    seen = await _forwarded_headers(tmp_path, upstream, ["127.0.0.1/32"], INBOUND)
    assert seen["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "edge.example"


async def test_trusted_proxy_without_fields_gets_them_set(
    tmp_path: Path, upstream: TestServer
) -> None:
    seen = await _forwarded_headers(tmp_path, upstream, ["127.0.0.0/8"], [])
    assert seen == {
        "x-forwarded-for": "127.0.0.1",
        "x-forwarded-proto": "http",
        "x-forwarded-host": f"{upstream.port}-xffbox.{DOMAIN}",
    }


def test_check_config_prints_no_secret_and_no_internal_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(
        "[routes]\nsource = 'redis'\nredis_url = 'rediss://relay:hunter2@redis.example:6380/0'\n"
        "[listen]\ntls_cert = 'tls.crt'\ntls_key = 'tls.key'\n"
    )
    assert main(["check-config", "--config", str(config)]) == 2  # tls.crt does not exist
    assert "relay: config error: listen.tls_cert: cannot read" in capsys.readouterr().err
    assert main(["check-config", "--offline", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    printed = json.loads(out)
    assert set(printed) == {
        "listen",
        "admin",
        "routing",
        "routes",
        "upstream",
        "management",
        "process",
    }
    assert printed["listen"]["tls_key"] == "tls.key"  # a path, not the key itself


def test_check_config_runs_the_host_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs = issue(tmp_path, [f"*.{DOMAIN}"])
    config = tmp_path / "relay.toml"
    config.write_text(
        f"[routing]\ndomains = ['{DOMAIN}']\n"
        f"[listen]\ntls_cert = '{certs.cert_file}'\ntls_key = '{certs.key_file}'\n"
        "[upstream]\nsource_interface = 'lo'\n"
    )
    assert main(["check-config", "--config", str(config)]) == 0
    config.write_text(config.read_text().replace(f"['{DOMAIN}']", "['other.test']"))
    assert main(["check-config", "--config", str(config)]) == 2
    assert "listen.tls_cert: subjectAltName does not cover *.other.test" in capsys.readouterr().err
