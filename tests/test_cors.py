"""A browser's CORS preflight to envd (found by review): envd answers it before its token check
(rs/cors wraps WithAuthorization in envd's main.go), so relay lets it through without one. The
JS SDK in a browser sends X-Access-Token and a Connect content type on every envd call, so each
call is preceded by a preflight, which no browser sends credentials on."""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relay.core.decide import FeedState
from tests.support.fake_envd import ENVD_PORT, FakeEnvd
from tests.support.harness import DOMAIN, RelayUnderTest, route, running_relay
from tests.support.rawhttp import Connection, request, request_bytes
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


# Chromium 156's preflight for the JS SDK's ListDir call (fetch with X-Access-Token, a JSON
# Connect content type and the routing headers), byte for byte but for the Host's sandbox id
# and port, as captured from headless Chromium by a raw socket listening where relay would.
CHROMIUM_PREFLIGHT = (
    b"OPTIONS /filesystem.Filesystem/ListDir HTTP/1.1\r\n"
    b"Host: 49983-%s.e2b.test:8443\r\n"
    b"Connection: keep-alive\r\n"
    b"Accept: */*\r\n"
    b"Access-Control-Request-Method: POST\r\n"
    b"Access-Control-Request-Headers: "
    b"connect-protocol-version,content-type,e2b-sandbox-id,e2b-sandbox-port,x-access-token\r\n"
    b"Origin: http://3000-pub.e2b.test:8080\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    b"HeadlessChrome/156.0.0.0 Safari/537.36\r\n"
    b"Sec-Fetch-Mode: cors\r\n"
    b"Referer: http://3000-pub.e2b.test:8080/\r\n"
    b"Accept-Encoding: gzip, deflate\r\n"
    b"Accept-Language: en-US,en;q=0.9\r\n"
    b"\r\n"
)


async def test_a_refused_preflight_to_envd_lets_the_browser_read_the_refusal(
    tmp_path: Path,
) -> None:
    """Seen with headless Chromium: the JS SDK's call to a sandbox that is gone (paused, killed)
    failed with "TypeError: Failed to fetch", as the preflight got relay's 502 and a browser
    takes only a 2xx preflight ("It does not have HTTP ok status"): the SDK could not read
    "The sandbox was not found" that SPEC §5 gives it with Access-Control-Allow-Origin. relay
    now answers such a preflight as envd's CORS layer would (rs/cors, envd's main.go), and the
    actual request gets the refusal, readable."""
    sandbox = "gonebox"
    async with running_relay(tmp_path, [route("corsbox", envd_token=TOKEN)]) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(CHROMIUM_PREFLIGHT % sandbox.encode())
            preflight = await conn.read_response()
            assert preflight.status == 204, preflight.body
            assert preflight.header("Access-Control-Allow-Origin") == "*"
            assert preflight.header("Access-Control-Allow-Methods") == "POST"
            allowed = preflight.header("Access-Control-Allow-Headers") or ""
            assert "x-access-token" in allowed
            assert "e2b-sandbox-id" in allowed
            assert preflight.header("Content-Length") is None  # a 204 has none (RFC 9110 §8.6)
            assert preflight.body == b""
            # The actual request, on the same connection, gets the refusal with CORS.
            await conn.send(
                request_bytes(
                    "POST",
                    "/filesystem.Filesystem/ListDir",
                    f"49983-{sandbox}.{DOMAIN}:8443",
                    [
                        ("X-Access-Token", TOKEN),
                        ("Content-Type", "application/json"),
                        ("Connect-Protocol-Version", "1"),
                        ("Origin", "http://3000-pub.e2b.test:8080"),
                    ],
                    b'{"path":"/"}',
                )
            )
            actual = await conn.read_response()
            assert actual.status == 502, actual.body
            assert b"The sandbox was not found" in actual.body
            assert actual.header("Access-Control-Allow-Origin") == "*"
        finally:
            await conn.close()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (CHROMIUM_PREFLIGHT.replace(b"Host: 49983-", b"Host: 3000-"), "app port"),
        (CHROMIUM_PREFLIGHT.replace(b"/filesystem.Filesystem/ListDir", b"/init"), "control"),
        (CHROMIUM_PREFLIGHT.replace(b"Origin: http://3000-pub.e2b.test:8080\r\n", b""), "origin"),
    ],
)
async def test_other_refused_preflights_keep_the_refusal(
    tmp_path: Path, raw: bytes, why: str
) -> None:
    """Only envd's own CORS answer is given: an app's preflight policy is the app's (relay
    cannot tell what it would allow), an OPTIONS without an Origin is no browser's, and a
    control path is 404 for every method (SPEC §2)."""
    async with running_relay(tmp_path, []) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(raw % b"gonebox")
            response = await conn.read_response()
            assert response.status == (404 if why == "control" else 502), why
        finally:
            await conn.close()


async def test_a_preflight_to_an_envd_that_does_not_listen_gets_envds_answer(
    tmp_path: Path,
) -> None:
    """The same preflight when the route exists but nothing listens on envd's port (envd not
    up, or gone): relay's 502 "port is not open" to it made the page's call fail as "Failed
    to fetch" too; the actual request gets the 502, readable."""
    closed = closed_envd_address()
    async with running_relay(tmp_path, [route("downbox", closed, envd_token=TOKEN)]) as relay:
        conn = await Connection.open(relay.port)
        try:
            await conn.send(CHROMIUM_PREFLIGHT % b"downbox")
            preflight = await conn.read_response(timeout=15)
            assert preflight.status == 204, preflight.body
            assert preflight.header("Access-Control-Allow-Origin") == "*"
            await conn.send(
                request_bytes(
                    "POST",
                    "/filesystem.Filesystem/ListDir",
                    f"49983-downbox.{DOMAIN}",
                    [("X-Access-Token", TOKEN), ("Origin", "http://3000-pub.e2b.test:8080")],
                    b"{}",
                )
            )
            actual = await conn.read_response(timeout=15)
            assert actual.status == 502, actual.body
            assert b"port is not open" in actual.body
            assert actual.header("Access-Control-Allow-Origin") == "*"
        finally:
            await conn.close()


def closed_envd_address() -> str:
    """A 127.0.0.<n> where nothing listens on envd's port (bound for a moment to check)."""
    for n in random.sample(range(2, 255), 40):
        address = f"127.0.0.{n}"
        with socket.socket() as probe:
            try:
                probe.bind((address, ENVD_PORT))
            except OSError:
                continue
            return address
    raise RuntimeError("no 127.0.0.<n> with envd's port free")


# Chromium 156's cross-origin fetch('/headers') of another sandbox's app port (a simple
# request: no preflight), as captured, but for the Host's port.
CHROMIUM_SIMPLE_GET = (
    b"GET /headers HTTP/1.1\r\n"
    b"Host: 3000-corsbox.e2b.test:8443\r\n"
    b"Connection: keep-alive\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    b"HeadlessChrome/156.0.0.0 Safari/537.36\r\n"
    b"Accept: */*\r\n"
    b"Origin: http://3000-pub.e2b.test:8080\r\n"
    b"Referer: http://3000-pub.e2b.test:8080/\r\n"
    b"Accept-Encoding: gzip, deflate\r\n"
    b"Accept-Language: en-US,en;q=0.9\r\n"
    b"\r\n"
)


async def test_a_cross_origin_page_can_read_the_retry_after_of_a_503(tmp_path: Path) -> None:
    """Seen with headless Chromium: a page's cross-origin fetch() to a relay whose route table
    was not ready read the 503 and its body, but ``headers.get("retry-after")`` was null: a
    browser shows a cross-origin script only the CORS-safelisted response fields unless the
    answer lists the others in Access-Control-Expose-Headers (Fetch standard, "CORS-safelisted
    response-header name"). SPEC §5 gives the 503 a Retry-After for the client to honour."""
    async with running_relay(tmp_path, [route("corsbox", envd_token=TOKEN)]) as relay:
        relay.relay.feed_state = FeedState(ready=False)
        conn = await Connection.open(relay.port)
        try:
            await conn.send(CHROMIUM_SIMPLE_GET)
            response = await conn.read_response()
        finally:
            await conn.close()
    assert response.status == 503, response.body
    assert response.header("Retry-After") is not None
    assert response.header("Access-Control-Allow-Origin") == "*"
    exposed = (response.header("Access-Control-Expose-Headers") or "").lower()
    assert "retry-after" in [name.strip() for name in exposed.split(",")], response.headers


CORS_FIELDS = (
    "Access-Control-Allow-Origin",
    "Access-Control-Allow-Methods",
    "Access-Control-Allow-Headers",
    "Access-Control-Max-Age",
)


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(PREFLIGHT, id="post"),
        pytest.param([PREFLIGHT[0], ("Access-Control-Request-Method", "OPTIONS")], id="options"),
        pytest.param([PREFLIGHT[0], ("Access-Control-Request-Method", "patch")], id="lowercase"),
        pytest.param([("Origin", ""), *PREFLIGHT[1:]], id="empty-origin"),
    ],
)
async def test_a_refused_preflight_allows_what_envd_allows(
    behind_relay: tuple[RelayUnderTest, FakeEnvd], headers: list[tuple[str, str]]
) -> None:
    """relay's answer to a refused preflight claims to be envd's (rs/cors 1.11.1,
    handlePreflight and isMethodAllowed): the requested method compared as sent, OPTIONS always
    allowed, and no allow field for an empty Origin. The same preflight to a sandbox whose envd
    answers it, and to one relay refuses, must allow the same (found by review: relay
    upper-cased the method, so 'patch' was allowed where envd allows nothing, and did not allow
    OPTIONS, which envd does)."""
    relay, _ = behind_relay
    by_envd = await request(relay.port, "OPTIONS", "/files", f"49983-corsbox.{DOMAIN}", headers)
    by_relay = await request(relay.port, "OPTIONS", "/files", f"49983-gonebox.{DOMAIN}", headers)
    assert by_envd.status == by_relay.status == 204, (by_envd.body, by_relay.body)
    assert [by_relay.header(name) for name in CORS_FIELDS] == [
        by_envd.header(name) for name in CORS_FIELDS
    ]
