"""Answers relay writes itself outside a forwarded exchange's usual path (SPEC §5, §7): past
``listen.max_connections``, and when an exchange's own request breaks mid-body."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from pathlib import Path

import pytest

from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream

ORIGIN = b"Origin: https://app.example\r\n"


async def _exchange(port: int, parts: list[bytes], wait_s: float = 2.0) -> bytes:
    """Send ``parts`` (a pause between them), then read until relay closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)
        out = b""
        async with asyncio.timeout(wait_s):
            while data := await reader.read(65536):
                out += data
        return out
    finally:
        writer.close()


async def test_an_overload_503_answers_a_head_with_no_content_and_cors(
    tmp_path: Path, access_lines: list[dict[str, object]]
) -> None:
    """The 503 past listen.max_connections is an answer to a parsed request: a HEAD gets no
    content (RFC 9110 §9.3.2) and a request with an Origin gets Access-Control-Allow-Origin
    (SPEC §5), as every other answer of relay's. It was written without the request's head:
    a HEAD got the JSON body and a browser's fetch an opaque network error."""
    overrides = {"listen": {"max_connections": 1}}
    async with running_relay(tmp_path, [route("held", insecure=True)], overrides) as relay:
        _, holder = await asyncio.open_connection("127.0.0.1", relay.port)
        try:
            await asyncio.sleep(0.05)
            answer = await _exchange(
                relay.port, [b"HEAD / HTTP/1.1\r\nHost: x\r\n" + ORIGIN + b"\r\n"]
            )
        finally:
            holder.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nRetry-After: " in head
    assert b"\r\nAccess-Control-Allow-Origin: *" in head, head
    assert content == b"", content
    # A request that was parsed is logged with its method and path (docs/operations.md: only
    # requests refused before they could be parsed log them as null); they were null.
    assert [(line["method"], line["path"], line["status"]) for line in access_lines] == [
        ("HEAD", "/", 503)
    ]


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_431_for_a_whole_head_answers_as_its_request_asks(
    tmp_path: Path, pipelined: bool
) -> None:
    """A head llhttp parsed whole but past listen.max_header_bytes (a browser's large Cookie)
    is refused 431 knowing the request: with Access-Control-Allow-Origin for its Origin (SPEC
    §5; without it a browser's fetch sees a network error, not the 431) and no content for
    a HEAD. Alone, or behind a pipelined request still in flight (the refusal then waits for
    its answer), it had neither."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    overrides = {"listen": {"max_header_bytes": 1024}}
    big = b"HEAD / HTTP/1.1\r\nHost: x\r\n" + ORIGIN + b"Cookie: " + b"c" * 1100 + b"\r\n\r\n"
    async with (
        scripted_upstream(slow) as port,
        running_relay(tmp_path, [route("big", insecure=True)], overrides) as relay,
    ):
        first = f"GET / HTTP/1.1\r\nHost: {port}-big.{DOMAIN}\r\n\r\n".encode()
        answer = await _exchange(relay.port, [first + big if pipelined else big])
    if pipelined:
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        answer = answer[answer.index(b"\r\n\r\nok") + 6 :]
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer
    assert b"\r\nAccess-Control-Allow-Origin: *" in head, head
    assert content == b"", content


async def test_a_request_broken_mid_body_is_one_exchange_with_its_answer(
    tmp_path: Path, access_lines: list[dict[str, object]]
) -> None:
    """A forwarded request whose chunked body turns malformed before any response is
    answered 400 and closed. That is one exchange: one request in relay_requests, one
    access-log line with its method, path and the 400. It was counted twice (("refused",
    "4xx") and ("app", "none")) and logged twice: a line of nulls with the 400, and the
    exchange's own with status 0 and reason "client_closed", though relay had closed it."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):  # takes the request, never answers
            pass
        writer.close()

    async with (
        scripted_upstream(silent) as port,
        running_relay(tmp_path, [route("brokenbody", insecure=True)]) as relay,
    ):
        head = (
            f"POST /up HTTP/1.1\r\nHost: {port}-brokenbody.{DOMAIN}\r\n"
            "Transfer-Encoding: chunked\r\n"
        ).encode() + ORIGIN
        answer = await _exchange(relay.port, [head + b"\r\n", b"zz\r\n"])
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b"\r\nAccess-Control-Allow-Origin: *" in answer  # SPEC §5, as for any error
        await asyncio.sleep(0.1)
        assert dict(relay.relay.observer.requests) == {("app", "4xx"): 1}
    assert len(access_lines) == 1, access_lines
    line = access_lines[0]
    assert (line["method"], line["path"], line["status"]) == ("POST", "/up", 400), line
    assert line["sandbox_id"] == "brokenbody"


@pytest.mark.parametrize(
    ("method", "target", "logged"),
    [
        # RFC 3986 §3.2.1: userinfo "user:password" is a credential; the form is refused 400
        (b"GET", b"http://user:s3cret@h.example/files?x=1", "http://h.example/files"),
        (b"GET", b"http://s3cret@h.example", "http://h.example"),
        # CONNECT's authority-form, which llhttp takes with a userinfo too: refused 405
        (b"CONNECT", b"user:s3cret@h.example:443", "h.example:443"),
        # a password with a '?' or '/' that the client did not percent-encode: its start
        # was logged, cut there as if a query or the path began (found by review)
        (b"GET", b"http://user:s3cret?x@h.example/files", "http://h.example/files"),
        (b"GET", b"http://user:s3cret/x@h.example/files", "http://h.example/files"),
        (b"CONNECT", b"user:s3cret?x@h.example:443", "h.example:443"),
        # a fragment is never sent by a browser; one sent (an OAuth "#access_token=...") is
        # refused 400 and kept out like a query
        (b"GET", b"/files#access_token=s3cret", "/files"),
    ],
)
async def test_a_refused_targets_credentials_are_not_logged(
    tmp_path: Path,
    access_lines: list[dict[str, object]],
    method: bytes,
    target: bytes,
    logged: str,
) -> None:
    """SPEC §7: an access-log line has no credential. A refused request's line showed its
    raw target without the query only: the userinfo of an absolute-form or authority-form
    target, and a fragment, were logged as sent."""
    async with running_relay(tmp_path, [route("cred", insecure=True)]) as relay:
        head = method + b" " + target + f" HTTP/1.1\r\nHost: 49983-cred.{DOMAIN}\r\n".encode()
        head += b"Connection: close\r\n\r\n"
        answer = await _exchange(relay.port, [head])
    assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 405 ")), answer
    assert [line["path"] for line in access_lines] == [logged]
    assert "s3cret" not in json.dumps(access_lines)


async def test_the_405_for_connect_lists_the_methods_relay_forwards(tmp_path: Path) -> None:
    """RFC 9110 §15.5.6: a 405 response MUST carry an Allow field listing the methods the
    target supports. relay's 405 to CONNECT (SPEC §1) had none."""
    async with running_relay(tmp_path, [route("tunnel", insecure=True)]) as relay:
        connect = f"CONNECT 49983-tunnel.{DOMAIN}:443 HTTP/1.1\r\nHost: 49983-tunnel.{DOMAIN}"
        answer = await _exchange(relay.port, [connect.encode() + b":443\r\n\r\n"])
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 405 "), answer
    allow = [line for line in head.split(b"\r\n") if line.lower().startswith(b"allow:")]
    assert len(allow) == 1, head
    methods = {m.strip() for m in allow[0].partition(b":")[2].split(b",")}
    assert {b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"} <= methods
    assert b"CONNECT" not in methods


async def test_an_answer_relay_closes_after_says_so(tmp_path: Path) -> None:
    """The upstream closes before answering while the client is still sending its body: relay
    answers 502 and closes the connection, since the rest of the body has nowhere to go
    (Respond.cut). The answer must say so (RFC 9112 §9.6, as relay's other answers that
    close do: answer_bytes), or a client takes the connection for kept and sends its next
    request into the close. It had no Connection: close."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async with (
        scripted_upstream(hang_up) as port,
        running_relay(tmp_path, [route("hangup", insecure=True)]) as relay,
    ):
        head = f"POST /up HTTP/1.1\r\nHost: {port}-hangup.{DOMAIN}\r\nContent-Length: 100\r\n\r\n"
        answer = await _exchange(relay.port, [head.encode() + b"x" * 10])
    head_out = answer.partition(b"\r\n\r\n")[0]
    assert head_out.startswith(b"HTTP/1.1 502 "), answer
    assert b"\r\nConnection: close" in head_out, head_out


async def test_relays_own_answers_carry_a_date(tmp_path: Path) -> None:
    """RFC 9110 §6.6.1: an origin server with a clock MUST send Date in every 2xx, 3xx and 4xx
    response. relay is the origin of its own answers (a 404 without a target, a 401, a 405
    or 431 before it closes); they had none, unlike nginx's and Envoy's local replies."""
    overrides = {"listen": {"max_header_bytes": 1024}}
    requests = [
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # 404, through an exchange
        b"GET / HTTP/1.1\r\nHost: x\r\nCookie: " + b"c" * 1100 + b"\r\n\r\n",  # 431, refuse()
    ]
    async with running_relay(tmp_path, [route("dated", insecure=True)], overrides) as relay:
        answers = [await _exchange(relay.port, [request]) for request in requests]
    for answer in answers:
        head = answer.partition(b"\r\n\r\n")[0]
        assert head.startswith((b"HTTP/1.1 404 ", b"HTTP/1.1 431 ")), answer
        dates = [line for line in head.split(b"\r\n") if line.startswith(b"Date: ")]
        assert len(dates) == 1, head
        sent = email.utils.parsedate_to_datetime(dates[0][6:].decode())
        assert abs(sent.timestamp() - time.time()) < 5
        assert dates[0].endswith(b" GMT")


async def test_a_connection_refusal_logs_the_bytes_it_sent(
    tmp_path: Path, access_lines: list[dict[str, object]]
) -> None:
    """An access line's bytes_out counts the body relay sent, for its own answers too (an
    exchange's refusal logs its JSON's length). A refusal made for the connection (an
    overload 503, a 431, a malformed request) logged 0 whatever it sent."""
    overrides = {"listen": {"max_header_bytes": 1024}}
    too_large = b"GET / HTTP/1.1\r\nHost: x\r\nCookie: " + b"c" * 1100 + b"\r\n\r\n"
    async with running_relay(tmp_path, [route("counted", insecure=True)], overrides) as relay:
        answers = [await _exchange(relay.port, [data]) for data in (too_large, b"G\x01T\r\n")]
    sent = [len(answer.partition(b"\r\n\r\n")[2]) for answer in answers]
    assert all(sent), answers
    assert [line["bytes_out"] for line in access_lines] == sent


@pytest.mark.parametrize(
    ("target", "port", "status"),
    [
        ("/files", 49983, 401),  # no envd token
        ("/", 3000, 403),  # no traffic token
        ("/init", 49983, 404),  # envd's control path (SPEC §1)
        ("/", 50090, 403),  # a control port
    ],
)
async def test_a_refusal_logs_the_sandbox_and_port_the_request_named(
    tmp_path: Path,
    access_lines: list[dict[str, object]],
    target: str,
    port: int,
    status: int,
) -> None:
    """An operator filters the access log by sandbox and port. A refusal made after the
    target was known logged "port": null (401, 403, 429), and a control path or port no
    sandbox_id either (found by review), while a failed dial logged both. The answer itself
    still names no sandbox on a control path."""
    sandbox = route("named", envd_token="envd-" + "x" * 16, traffic_token="tt-" + "y" * 16)
    async with running_relay(tmp_path, [sandbox]) as relay:
        head = f"GET {target} HTTP/1.1\r\nHost: {port}-named.{DOMAIN}\r\nConnection: close\r\n\r\n"
        answer = await _exchange(relay.port, [head.encode()])
        await asyncio.sleep(0.1)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert [(line["sandbox_id"], line["port"], line["status"]) for line in access_lines] == [
        ("named", port, status)
    ]
    if target == "/init" or port == 50090:
        assert b"named" not in answer
