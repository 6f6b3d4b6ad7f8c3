# ruff: noqa: E501  (tables of raw wire bytes read best one request per line)
"""Control paths, control ports, tunnels and other protocols (SPEC §1, §2, §5a).

Every request here carries a valid ``X-Access-Token`` (or targets an insecure sandbox), so the
only thing standing between it and envd's control surface is relay's policy. The recording
upstream listens on the envd port and on a denied port: for every attack it must see nothing,
not even a connection.

Paths that *look* like control paths but that envd (Go ``net/http`` + chi: one percent-decoding,
case-sensitive, no ``;`` parameters) would not route to one are forwarded unchanged; they are
listed separately, with why envd does not see a control path in them.
"""

from __future__ import annotations

import pytest

from relay.core.policy import CONTROL_PATHS
from tests.hostile.conftest import ENVD_TOKEN, Hostile, body_json, connected, exchange
from tests.support.harness import DOMAIN

# Paths that must reach the control-path 404 (cleaned, decoded once: envd's view).
CONTROL_SPELLINGS = [
    "/init",
    "//init",
    "///init",
    "/./init",
    "/.//./init",
    "/a/../init",
    "/a/b/../../init",
    "/../init",
    "/../../../../init",
    "/init/",
    "/init/.",
    "/init//",
    "/init/./",
    "/x/../init/",
    "/%69nit",
    "/%69%6E%69%74",
    "/%69%6e%69%74",
    "/in%69t",
    "/%2e/init",
    "/%2E/init",
    "/%2e%2e/init",
    "/%2E%2e/init",
    "/x/%2e%2e/init",
    "/x/%2E%2E/%69nit",
    "/.%2e/init",
    "/init?x=1",
    "/init?",
    "/init?a=/../x&b=%2f",
    *sorted(CONTROL_PATHS),
    *(p + "/" for p in sorted(CONTROL_PATHS)),
    *("//" + p[1:] for p in sorted(CONTROL_PATHS)),
    "/fs%66reeze",
    "/%75pgrade",
    "/x/../upgrade?force=1",
]

CONTROL_SPELLINGS = list(dict.fromkeys(CONTROL_SPELLINGS))

# Encodings relay refuses outright (400) on every port: servers decode them differently.
REFUSED_SPELLINGS = [
    "/init%2f",
    "/%2finit",
    "/%2Finit",
    "/..%2finit",
    "/x%2f..%2finit",
    "/%5cinit",
    "/%5Cinit",
    "/x/..%5cinit",
    "/\\init",
    "/x\\..\\init",
    "/init%00",
    "/%00/init",
    "/init#",
    "/init#frag",
    "/#/init",
    "/%zzinit",
    "/init%",
    "/init%2",
    "/%u0069nit",
]

# Not a control path for envd either; forwarded with the request-target unchanged.
NOT_CONTROL = {
    "/INIT": "chi routes are case-sensitive",
    "/Init": "chi routes are case-sensitive",
    "/%252e%252e/init": "decoded once it is /%2e%2e/init, a literal directory name",
    "/%2569nit": "decoded once it is /%69nit",
    "/init;x": "a ';' is part of the segment for Go, not a parameter",
    "/init%3bx": "decoded once it is /init;x",
    "/init%20": "a trailing space is part of the name",
    "/init.": "a different name",
    "/initx": "a different name",
    "/in?it": "the path is /in",
    "/?/init": "the path is /, /init is the query",
    "//49983-sbx.e2b.test/init": "origin-form: Go reads it as the path //49983-sbx.e2b.test/init",
    "/files/../../init/x": "cleans to /init/x, not a control path",
}

METHODS = [
    "GET",
    "HEAD",
    "POST",
    "PUT",
    "DELETE",
    "OPTIONS",
    "TRACE",
    "PATCH",
    "PROPFIND",
    "PROPPATCH",
    "MKCOL",
    "COPY",
    "MOVE",
    "LOCK",
    "UNLOCK",
    "SEARCH",
    "PURGE",
    "REPORT",
    "MKACTIVITY",
    "CHECKOUT",
    "MERGE",
    "M-SEARCH",
    "NOTIFY",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "LINK",
    "UNLINK",
    "SOURCE",
    "QUERY",
    "ACL",
    "BIND",
    "REBIND",
    "UNBIND",
    "MKCALENDAR",
]
WS_HEADERS = (
    "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


def envd_request(hostile: Hostile, method: str, target: str, extra: str = "") -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: {hostile.envd}\r\n"
        f"X-Access-Token: {ENVD_TOKEN}\r\n{extra}\r\n"
    ).encode("latin-1")


async def refused_and_unseen(
    hostile: Hostile, raw: bytes, status: int, *, head: bool = False
) -> dict[str, object]:
    mark = hostile.recorder.mark()
    response, _ = await exchange(hostile.port, raw, head=head, linger=0)
    assert response.status == status, (raw, response.status, response.body)
    assert await hostile.recorder.nothing_since(mark, settle=0.02), raw
    return body_json(response) if not head else {}


@pytest.mark.parametrize("path", CONTROL_SPELLINGS)
async def test_control_path_spellings_are_reserved(hostile: Hostile, path: str) -> None:
    for method in ("GET", "POST"):
        body = await refused_and_unseen(hostile, envd_request(hostile, method, path), 404)
        assert body["path"] in CONTROL_PATHS
        assert "reserved for the control plane" in str(body["message"])


@pytest.mark.parametrize("path", REFUSED_SPELLINGS)
async def test_ambiguous_encodings_are_refused(hostile: Hostile, path: str) -> None:
    for host in (hostile.envd, hostile.app):
        raw = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-Access-Token: {ENVD_TOKEN}\r\n\r\n"
        await refused_and_unseen(hostile, raw.encode("latin-1"), 400)


@pytest.mark.parametrize("path", list(NOT_CONTROL), ids=list(NOT_CONTROL.values()))
async def test_lookalikes_reach_envd_unchanged(hostile: Hostile, path: str) -> None:
    mark = hostile.recorder.mark()
    response, _ = await exchange(hostile.port, envd_request(hostile, "GET", path), linger=0)
    assert response.status == 200
    (seen,) = await hostile.recorder.wait_for(mark, 1)
    assert seen.target == path.encode()
    assert seen.header(b"x-access-token") == []


@pytest.mark.parametrize("method", METHODS)
async def test_every_method_on_a_control_path(hostile: Hostile, method: str) -> None:
    await refused_and_unseen(
        hostile, envd_request(hostile, method, "/init"), 404, head=method == "HEAD"
    )
    await refused_and_unseen(
        hostile, envd_request(hostile, method, "/%2e/upgrade/"), 404, head=method == "HEAD"
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["/init", "//freeze/", "/%75pgrade"])
async def test_websocket_upgrades_to_control_paths(
    hostile: Hostile, method: str, path: str
) -> None:
    """A WebSocket handshake is a GET; on another method it is a bad upgrade (400)."""
    status = 404 if method == "GET" else 400
    raw = envd_request(hostile, method, path, WS_HEADERS)
    mark = hostile.recorder.mark()
    response, closed = await exchange(hostile.port, raw, head=method == "HEAD")
    assert response.status == status
    assert closed, "an answered upgrade request leaves HTTP: the connection must close"
    assert await hostile.recorder.nothing_since(mark, settle=0.02)


def control_port_requests(hostile: Hostile, port: int) -> list[bytes]:
    sb = f"sandbox.{DOMAIN}"
    token = f"X-Access-Token: {ENVD_TOKEN}\r\nE2b-Traffic-Access-Token: traffic-tok\r\n"
    hosts = [
        f"{port}-sbx.{DOMAIN}",
        f"{port}-SBX.{DOMAIN.upper()}",
        f"{port}-sbx.{DOMAIN}.",
        f"{port}-sbx.{DOMAIN}:443",
        f"{port}-sbx-legacysuffix.{DOMAIN}",
        f"{port}-open.{DOMAIN}",
        f"{port}-ghost.{DOMAIN}",  # refused before the lookup: no existence signal either
    ]
    out = [f"GET / HTTP/1.1\r\nHost: {h}\r\n{token}\r\n".encode() for h in hosts]
    for host in (sb, "localhost", "127.0.0.1", f"{port}-sbx.{DOMAIN}"):
        for value in (str(port), f" {port} ", f"{port}\t"):
            out.append(
                f"GET / HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: sbx\r\n"
                f"E2b-Sandbox-Port: {value}\r\n{token}\r\n".encode()
            )
    out.extend(
        f"{m} /x HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\n{token}\r\n".encode()
        for m in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH", "PROPFIND")
    )
    out.append(f"GET /ws HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\n{token}{WS_HEADERS}\r\n".encode())
    return out


@pytest.mark.parametrize("which", ["50090", "recorder"])
async def test_control_ports_are_refused_in_every_form(hostile: Hostile, which: str) -> None:
    port = 50090 if which == "50090" else hostile.recorder.ports["control"]
    for raw in control_port_requests(hostile, port):
        body = await refused_and_unseen(hostile, raw, 403)
        assert "reserved for the control plane" in str(body["message"])
        assert "sandboxId" not in body  # answered before the route lookup


@pytest.mark.parametrize(
    "raw",
    [
        "GET / HTTP/1.1\r\nHost: 050090-sbx.e2b.test\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: 0050090-sbx.e2b.test\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: 150090-sbx.e2b.test\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: 50090-sbx.x.e2b.test\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: 050090\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: 0xc3aa\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: +50090\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: 5e4\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Port: 50090\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: sandbox.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Id: sbx\r\n"
        "E2b-Sandbox-Port: 50090\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: 49983-sbx.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: 50090\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: 50090-sbx.e2b.test\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: 49983\r\n\r\n",
    ],
    ids=[
        "host-leading-zero",
        "host-two-zeros",
        "host-out-of-range",
        "host-two-labels",
        "header-leading-zero",
        "header-hex",
        "header-sign",
        "header-exponent",
        "header-without-id",
        "header-id-repeated",
        "host-and-header-disagree",
        "header-and-host-disagree",
    ],
)
async def test_control_port_lookalikes_are_400(hostile: Hostile, raw: str) -> None:
    await refused_and_unseen(hostile, raw.encode(), 400)


@pytest.mark.parametrize(
    "target",
    [
        "49983-sbx.e2b.test:443",
        "@ENVD@:80",
        "127.0.0.1:@PORT@",
        "[::1]:@PORT@",
        "localhost:@PORT@",
        "/init",
        "/",
        "*",
        "http://@ENVD@/",
        "@ENVD@",
    ],
)
async def test_connect_is_refused_wherever_it_points(hostile: Hostile, target: str) -> None:
    target = target.replace("@ENVD@", hostile.envd)
    target = target.replace("@PORT@", str(hostile.recorder.ports["envd"]))
    for host in (hostile.envd, target):
        raw = (
            f"CONNECT {target} HTTP/1.1\r\nHost: {host}\r\nX-Access-Token: {ENVD_TOKEN}\r\n\r\n"
            # A client that starts its tunnel at once: these bytes must go nowhere.
            "GET /init HTTP/1.1\r\nHost: x\r\n\r\n"
        ).encode()
        mark = hostile.recorder.mark()
        response, closed = await exchange(hostile.port, raw)
        assert response.status in (400, 405), (target, response.body)
        if response.status == 405:
            assert body_json(response)["message"] == "CONNECT is not supported"
        assert closed
        assert await hostile.recorder.nothing_since(mark, settle=0.02)


async def test_connect_with_a_head_over_the_limit_is_still_405(hostile: Hostile) -> None:
    """SPEC §5a precedence: CONNECT (405) comes before framing (400/431). A CONNECT whose whole
    head arrived, over listen.max_header_bytes, was answered 431: the size was checked before
    decide() saw the method."""
    big = "X-Big: " + "b" * 17000 + "\r\n"
    raw = f"CONNECT {hostile.envd}:443 HTTP/1.1\r\nHost: {hostile.envd}\r\n{big}\r\n".encode()
    mark = hostile.recorder.mark()
    response, closed = await exchange(hostile.port, raw)
    assert response.status == 405, response.body
    assert body_json(response)["message"] == "CONNECT is not supported"
    assert closed
    assert await hostile.recorder.nothing_since(mark, settle=0.02)


@pytest.mark.parametrize(
    "headers",
    [
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n",
        "Connection: Upgrade\r\nUpgrade: h2c\r\n",
        "Upgrade: h2c\r\n",
        "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n",
        "Connection: HTTP2-Settings, Upgrade\r\nUpgrade: H2C\r\nHTTP2-Settings: \r\n",
        "Connection: Upgrade\r\nUpgrade: TLS/1.0, HTTP/1.1\r\n",
        "Connection: Upgrade\r\nUpgrade: websocket, h2c\r\n",
        "Connection: Upgrade\r\nUpgrade: h2c, websocket\r\n",
        "Connection: Upgrade\r\nUpgrade: websocket\r\nUpgrade: websocket\r\n",
        "Connection: Upgrade\r\nUpgrade: HTTP/2.0\r\n",
        "Connection: Upgrade\r\nUpgrade: IRC/6.9\r\n",
        "Connection: Upgrade\r\nUpgrade: connect-udp\r\n",
        "Connection: Upgrade\r\nUpgrade: \r\n",
    ],
    ids=[
        "h2c-settings",
        "h2c",
        "h2c-no-connection",
        "h2c-settings-no-connection",
        "h2c-upper",
        "tls",
        "websocket-then-h2c",
        "h2c-then-websocket",
        "two-upgrade-fields",
        "http2",
        "irc",
        "connect-udp",
        "empty",
    ],
)
async def test_non_websocket_upgrades_are_refused(hostile: Hostile, headers: str) -> None:
    for host in (hostile.envd, hostile.app):
        raw = (
            f"GET / HTTP/1.1\r\nHost: {host}\r\nX-Access-Token: {ENVD_TOKEN}\r\n{headers}\r\n"
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # an eager h2c client's preface
        ).encode()
        mark = hostile.recorder.mark()
        response, closed = await exchange(hostile.port, raw)
        assert response.status == 400, (headers, response.body)
        assert closed
        assert await hostile.recorder.nothing_since(mark, settle=0.02)


async def test_an_http_1_0_websocket_handshake_is_refused(hostile: Hostile) -> None:
    """RFC 6455 §4.2.1: a handshake is "an HTTP/1.1 or higher GET request", and RFC 9110 §7.8:
    a server MUST ignore Upgrade in an HTTP/1.0 request (an HTTP/1.0 intermediary may have
    passed on a client's Connection and Upgrade without knowing them, and would read the
    WebSocket's frames as HTTP). relay forwarded it upstream as an HTTP/1.1 handshake and
    switched the connection to a WebSocket."""
    for host in (hostile.envd, hostile.app):
        raw = (
            f"GET /ws HTTP/1.0\r\nHost: {host}\r\nX-Access-Token: {ENVD_TOKEN}\r\n{WS_HEADERS}\r\n"
        ).encode()
        mark = hostile.recorder.mark()
        response, closed = await exchange(hostile.port, raw)
        assert response.status == 400, (response.status, response.body)
        assert body_json(response)["code"] == 400
        assert closed
        assert await hostile.recorder.nothing_since(mark, settle=0.05)


@pytest.mark.parametrize(
    "target",
    [
        "http://@ENVD@/init",
        "http://@ENVD@/health",
        "https://@ENVD@/files",
        "HTTP://@ENVD@/",
        "http://evil.example/",
        "http://127.0.0.1:@PORT@/",
        "ftp://x/",
        "@ENVD@/init",
        "*",
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS"])
async def test_absolute_and_asterisk_forms_are_refused(
    hostile: Hostile, target: str, method: str
) -> None:
    target = target.replace("@ENVD@", hostile.envd)
    target = target.replace("@PORT@", str(hostile.recorder.ports["envd"]))
    raw = envd_request(hostile, method, target)
    mark = hostile.recorder.mark()
    response, closed = await exchange(hostile.port, raw)
    assert response.status == 400, (target, response.body)
    assert closed
    assert await hostile.recorder.nothing_since(mark, settle=0.02)


async def test_head_answer_has_no_body(hostile: Hostile) -> None:
    """RFC 9110 §9.3.2: relay's own answer to a HEAD carries no content, or the next response
    on the connection would be read from the middle of it (a response desync)."""
    conn_raw = envd_request(hostile, "HEAD", "/init") + envd_request(hostile, "GET", "/health")
    async with connected(hostile.port) as conn:
        await conn.send(conn_raw)
        head = await conn.read_response(head=True)
        assert head.status == 404
        after = await conn.read_response()
        assert after.status == 200, after
        assert after.body == b"GET /health 0"


async def test_an_http2_preface_is_refused_as_a_version_relay_does_not_speak(
    hostile: Hostile,
) -> None:
    """A client with prior knowledge of HTTP/2 (RFC 9113 §3.4) starts with its preface, which
    llhttp stops at: relay answered 400 "Malformed request: Pause on PRI/Upgrade", llhttp's
    own words. It is an HTTP version relay does not speak: 505, as SPEC §5a has it."""
    mark = hostile.recorder.mark()
    response, closed = await exchange(hostile.port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert response.status == 505, response.body
    assert b"HTTP version not supported" in response.body
    assert b"PRI" not in response.body
    assert closed
    assert await hostile.recorder.nothing_since(mark, settle=0.02)
