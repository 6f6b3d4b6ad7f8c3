"""A browser's CORS preflight to envd (found by review): envd answers it before its token check
(rs/cors wraps WithAuthorization in envd's main.go), so relay lets it through without one. The
JS SDK in a browser sends X-Access-Token and a Connect content type on every envd call, so each
call is preceded by a preflight, which no browser sends credentials on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.fake_envd import FakeEnvd
from tests.support.harness import DOMAIN, RelayUnderTest, route, running_relay
from tests.support.rawhttp import request
from tests.support.sdk_matrix import _bind_envd_and_app

TOKEN = "envd-cors-token"
PREFLIGHT = [
    ("Origin", "https://app.example"),
    ("Access-Control-Request-Method", "POST"),
    ("Access-Control-Request-Headers", "connect-protocol-version,content-type,x-access-token"),
]


@pytest.fixture
async def behind_relay(tmp_path: Path) -> AsyncIterator[tuple[RelayUnderTest, FakeEnvd]]:
    envd, app = await _bind_envd_and_app()
    try:
        async with running_relay(tmp_path, [route("corsbox", envd.host, envd_token=TOKEN)]) as r:
            yield r, envd
    finally:
        await app.close()
        await envd.close()


@pytest.mark.parametrize(
    "path", ["/process.Process/Start", "/filesystem.Filesystem/ListDir", "/files"]
)
async def test_a_preflight_reaches_envd_without_a_token(
    behind_relay: tuple[RelayUnderTest, FakeEnvd], path: str
) -> None:
    relay, _ = behind_relay
    response = await request(relay.port, "OPTIONS", path, f"49983-corsbox.{DOMAIN}", PREFLIGHT)
    assert response.status == 204, response.body
    assert response.header("Access-Control-Allow-Origin") == "*"
    assert response.header("Access-Control-Allow-Methods") == "POST"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([*PREFLIGHT, ("X-Access-Token", "wrong")], id="wrong-token"),
        pytest.param(PREFLIGHT[:1], id="not-a-preflight"),
        pytest.param([("Origin", "https://x"), ("Access-Control-Request-Method", "")], id="empty"),
        pytest.param([*PREFLIGHT, ("Content-Length", "2")], id="with-a-body"),
    ],
)
async def test_other_options_requests_still_need_the_token(
    behind_relay: tuple[RelayUnderTest, FakeEnvd], headers: list[tuple[str, str]]
) -> None:
    relay, _ = behind_relay
    body = b"{}" if ("Content-Length", "2") in headers else b""
    response = await request(
        relay.port, "OPTIONS", "/files", f"49983-corsbox.{DOMAIN}", headers, body
    )
    assert response.status == 401


async def test_the_first_request_method_is_the_one_read(
    behind_relay: tuple[RelayUnderTest, FakeEnvd],
) -> None:
    """envd reads the first value only (Go's Header.Get): an empty first and a second is no
    preflight to envd, whose handlers would get it, so not to relay either (found by review)."""
    relay, _ = behind_relay
    headers = [
        ("Origin", "https://app.example"),
        ("Access-Control-Request-Method", ""),
        ("Access-Control-Request-Method", "POST"),
    ]
    response = await request(relay.port, "OPTIONS", "/files", f"49983-corsbox.{DOMAIN}", headers)
    assert response.status == 401
