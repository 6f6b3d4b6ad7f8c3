"""The fake envd picks handlers as envd does (tests/support/envd_routes.py): chi matches the
path as sent (``RawPath`` when Go keeps one), the token check and the Connect handlers read the
decoded ``Path``. Before, the fake routed on aiohttp's decoded path: ``/%66iles``, ``//health``
and ``/x/../health`` reached handlers that answer 404 in envd (found in review)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.connect import unary
from tests.support.envd_routes import parse_target
from tests.support.fake_envd import UNAUTHORIZED, FakeEnvd
from tests.support_tests.conftest import TOKEN


async def exchange(
    envd: FakeEnvd, method: str, target: str, extra: str = ""
) -> tuple[int, dict[str, list[str]], bytes]:
    reader, writer = await asyncio.open_connection(envd.host, envd.port)
    try:
        writer.write(
            f"{method} {target} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode()
        )
        await writer.drain()
        raw = await reader.read(-1)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), []).append(value.strip())
    return int(lines[0].split()[1]), fields, body


NOT_FOUND = b"404 page not found\n"


@pytest.mark.parametrize(
    "target",
    [
        "/%68ealth",  # chi matches RawPath "/%68ealth", not Path "/health"
        "//health",  # Go neither cleans nor collapses slashes
        "/x/../health",
        "/health/",
        "/./health",
        "/HEALTH",
        "/health%23x",
        "/%70rocess.Process/List",  # outside the mount as sent
        "/process.Process",  # the mount is "/process.Process/*"
    ],
)
async def test_paths_that_only_decode_or_clean_to_a_route_are_404(target: str) -> None:
    async with FakeEnvd() as envd:
        status, fields, body = await exchange(envd, "GET", target)
    assert (status, body) == (404, NOT_FOUND), target
    assert fields["content-type"] == ["text/plain; charset=utf-8"]


async def test_the_token_check_reads_the_decoded_path() -> None:
    # auth.go:50: "GET" + URL.Path == "GET/health" is in authExcludedPaths, so no 401, and
    # then chi finds no route for the raw "/%68ealth": 404. "//health" is not excluded: 401.
    async with FakeEnvd(access_token=TOKEN) as envd:
        assert (await exchange(envd, "GET", "/%68ealth"))[0] == 404
        status, _, body = await exchange(envd, "GET", "//health")
        assert status == 401
        assert json.loads(body) == {"code": 401, "message": UNAUTHORIZED}
        assert (await exchange(envd, "GET", "/%66iles?path=/etc/passwd"))[0] == 404
        assert (await exchange(envd, "GET", "/health"))[0] == 204


async def test_connect_handlers_switch_on_the_decoded_path(envd: FakeEnvd) -> None:
    # Inside the mount the generated handler compares URL.Path: an escaped letter is List.
    result = await unary(envd.host, envd.port, "/process.Process/%4Cist", {})
    assert (result.status, result.json()) == (200, {})
    missing = await unary(envd.host, envd.port, "/process.Process/Nope", {})
    assert (missing.status, missing.body) == (404, NOT_FOUND)
    status, fields, _ = await exchange(envd, "GET", "/process.Process/List")
    assert (status, fields["allow"]) == (405, ["POST"])


@pytest.mark.parametrize(
    ("method", "target", "allow"),
    [
        ("PUT", "/files", {"GET", "POST"}),
        ("DELETE", "/files", {"GET", "POST"}),
        ("HEAD", "/files", {"GET", "POST"}),  # chi has no implicit HEAD for GET routes
        ("POST", "/health", {"GET"}),
        ("GET", "/init", {"POST"}),
        ("GET", "/files/compose", {"POST"}),
        ("PROPFIND", "/health", set()),  # not in chi's methodMap: 405 on any path
        ("PROPFIND", "/nope", set()),
    ],
)
async def test_wrong_method_is_chis_405_with_allow(
    method: str, target: str, allow: set[str], envd: FakeEnvd
) -> None:
    status, fields, body = await exchange(envd, method, target)
    assert status == 405
    assert set(fields.get("allow", [])) == allow  # one field per method, in Go map order
    assert len(fields.get("allow", [])) == len(allow)
    assert body == b""


async def test_a_bad_escape_is_net_http_400(envd: FakeEnvd) -> None:
    status, fields, body = await exchange(envd, "GET", "/files%zz")
    assert (status, body) == (400, b"400 Bad Request")
    assert "vary" not in fields  # answered before rs/cors runs
    assert envd.records[-1].target == "/files%zz"


def test_go_path_parsing() -> None:
    # url.setPath: RawPath only when Go's own escaping differs from what was sent.
    assert parse_target("/a%20b?x") == parse_target("/a%20b")
    cases = {
        "/a%20b": ("/a b", ""),
        "/a%2fb": ("/a/b", "/a%2fb"),
        "/a%2Fb": ("/a/b", "/a%2Fb"),
        "/health#x": ("/health#x", "/health#x"),  # no fragment in a request target
        "http://envd:49983/health?x=1": ("/health", ""),
    }
    for target, expected in cases.items():
        parsed = parse_target(target)
        assert parsed is not None, target
        assert (parsed.path, parsed.raw_path) == expected, target
    assert parse_target("/%") is None
    assert parse_target("/%4") is None
    assert parse_target("/%zz") is None
