# ruff: noqa: E501  (tables of raw wire bytes read best one request per line)
"""Request smuggling and desync (SPEC §5a, RFC 9112 §6 and §11.2).

Every malformed framing is either refused (400, 501 or 505, and the connection closed) or
forwarded exactly once as one well-framed request that relay re-framed itself. The recording
upstream's raw bytes are compared byte for byte, so a request that reached it in the client's
framing, or twice, or merged with the next one, fails the test.

``@H@`` in a raw request stands for the Host of an application port of an insecure sandbox
(routing needs nothing else), so every byte that is not framing is forwarded untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.hostile.conftest import Hostile, body_json, connected, exchange
from tests.support.rawhttp import Connection

P = b"POST /smuggle HTTP/1.1\r\nHost: @H@\r\n"
G = b"GET /smuggle HTTP/1.1\r\nHost: @H@\r\n"
CHUNKED_BODY = b"5\r\nhello\r\n0\r\n\r\n"
# What the upstream must see for a chunked "hello", whatever chunk syntax the client used.
REFRAMED_CHUNKED = (
    b"POST /smuggle HTTP/1.1\r\nHost: @H@\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n"
)
REFRAMED_LENGTH = b"POST /smuggle HTTP/1.1\r\nHost: @H@\r\nContent-Length: 5\r\n\r\nhello"
SMUGGLED = b"GET /init HTTP/1.1\r\nHost: 49983-sbx.e2b.test\r\n\r\n"


@dataclass(frozen=True)
class Refused:
    """Refused at the head: nothing reaches the upstream, not even a connection."""

    statuses: tuple[int, ...] = (400,)


@dataclass(frozen=True)
class RefusedInBody:
    """The head was valid, its body's framing is not: relay may have started to forward,
    but the upstream never sees a complete request, only a prefix of relay's own framing."""

    prefix: bytes


@dataclass(frozen=True)
class Forwarded:
    """Forwarded once, re-framed: the upstream sees exactly these bytes."""

    upstream: bytes


Expect = Refused | RefusedInBody | Forwarded

CASES: list[tuple[str, bytes, Expect]] = [
    # -- Content-Length with Transfer-Encoding, repeated or malformed Content-Length
    (
        "cl-te",
        P + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY,
        Refused(),
    ),
    (
        "te-cl",
        P + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n" + CHUNKED_BODY,
        Refused(),
    ),
    (
        "cl-te-http10",
        b"POST / HTTP/1.0\r\nHost: @H@\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        Refused(),
    ),
    ("two-cl-same", P + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", Refused()),
    ("two-cl-different", P + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", Refused()),
    ("cl-list", P + b"Content-Length: 5, 5\r\n\r\nhello", Refused()),
    ("cl-plus", P + b"Content-Length: +5\r\n\r\nhello", Refused()),
    ("cl-negative", P + b"Content-Length: -5\r\n\r\nhello", Refused()),
    ("cl-hex", P + b"Content-Length: 0x5\r\n\r\nhello", Refused()),
    ("cl-inner-space", P + b"Content-Length: 5 5\r\n\r\nhello", Refused()),
    ("cl-overflow", P + b"Content-Length: 184467440737095516160\r\n\r\nhello", Refused()),
    ("cl-vtab", P + b"Content-Length: 5\x0b\r\n\r\nhello", Refused()),
    ("cl-trailing-space", P + b"Content-Length: 5 \r\n\r\nhello", Forwarded(REFRAMED_LENGTH)),
    # -- obfuscated Transfer-Encoding
    (
        "te-extra-leading-space",
        P + b"Transfer-Encoding:  chunked\r\n\r\n" + CHUNKED_BODY,
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "te-trailing-space",
        P + b"Transfer-Encoding: chunked \r\n\r\n" + CHUNKED_BODY,
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "te-capitalised",
        P + b"Transfer-Encoding: Chunked\r\n\r\n" + CHUNKED_BODY,
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "te-upper",
        P + b"TRANSFER-ENCODING: CHUNKED\r\n\r\n" + CHUNKED_BODY,
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "te-x-chunked",
        P + b"Transfer-Encoding: x-chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-chunked-identity",
        P + b"Transfer-Encoding: chunked, identity\r\n\r\n" + CHUNKED_BODY,
        Refused(),
    ),
    (
        "te-identity-chunked",
        P + b"Transfer-Encoding: identity, chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((501,)),
    ),
    (
        "te-gzip-chunked",
        P + b"Transfer-Encoding: gzip, chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((501,)),
    ),
    (
        "te-leading-comma",
        P + b"Transfer-Encoding: ,chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((501,)),
    ),
    (
        "te-trailing-comma",
        P + b"Transfer-Encoding: chunked,\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    ("te-quoted", P + b'Transfer-Encoding: "chunked"\r\n\r\n' + CHUNKED_BODY, Refused((400, 501))),
    (
        "te-obs-fold",
        P + b"Transfer-Encoding:\r\n chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-obs-fold-after",
        P + b"Transfer-Encoding: identity\r\n chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-vtab-before",
        P + b"Transfer-Encoding: \x0bchunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-vtab-after",
        P + b"Transfer-Encoding: chunked\x0b\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-formfeed",
        P + b"Transfer-Encoding: chunked\x0c\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    # llhttp validates Transfer-Encoding after on_headers_complete, so relay may have begun to
    # forward before the refusal (to a pooled connection even): the upstream sees at most the head.
    (
        "te-trailing-tab",
        P + b"Transfer-Encoding: chunked\t\r\n\r\n" + CHUNKED_BODY,
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "te-two-chunked",
        P + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY,
        Refused(),
    ),
    (
        "te-two-identity-chunked",
        P + b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((501,)),
    ),
    (
        "te-space-before-colon",
        P + b"Transfer-Encoding : chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-tab-before-colon",
        P + b"Transfer-Encoding\t: chunked\r\n\r\n" + CHUNKED_BODY,
        Refused((400, 501)),
    ),
    (
        "te-http10",
        b"POST /smuggle HTTP/1.0\r\nHost: @H@\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY,
        Refused(),
    ),
    # -- chunk sizes and extensions (the head is valid: the error is found in the body)
    (
        "chunk-size-overflow",
        P + b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF5\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-size-negative",
        P + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-size-0x",
        P + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-size-space",
        P + b"Transfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-ext-empty",
        P + b"Transfer-Encoding: chunked\r\n\r\n5;\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-ext-bws",
        P + b"Transfer-Encoding: chunked\r\n\r\n5 ;a=b\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-ext-bare-lf",
        P + b"Transfer-Encoding: chunked\r\n\r\n5;a\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-ext-bare-cr",
        P + b"Transfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-ext-nul",
        P + b"Transfer-Encoding: chunked\r\n\r\n5;a\x00\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-bare-lf",
        P + b"Transfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15]),
    ),
    (
        "chunk-data-too-long",
        P + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-15] + b"3\r\nhel\r\n"),
    ),
    (
        "chunk-data-no-crlf",
        P + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloX0\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-5]),
    ),
    (
        "chunk-ext-names",
        P + b"Transfer-Encoding: chunked\r\n\r\n5;a=b;c;d=e\r\nhello\r\n0;last\r\n\r\n",
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "chunk-ext-quoted",
        P + b'Transfer-Encoding: chunked\r\n\r\n5;a="b\\"c;d"\r\nhello\r\n0\r\n\r\n',
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "chunk-leading-zeros",
        P + b"Transfer-Encoding: chunked\r\n\r\n0005\r\nhello\r\n000\r\n\r\n",
        Forwarded(REFRAMED_CHUNKED),
    ),
    (
        "chunk-trailers-dropped",
        P
        + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n",
        Forwarded(REFRAMED_CHUNKED),
    ),
    # llhttp refuses a Content-Length trailer (it would contradict the chunked framing).
    (
        "chunk-trailer-content-length",
        P + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nContent-Length: 9\r\n\r\n",
        RefusedInBody(REFRAMED_CHUNKED[:-5]),
    ),
    (
        "chunk-upper-hex",
        P + b"Transfer-Encoding: chunked\r\n\r\nA\r\n0123456789\r\n0\r\n\r\n",
        Forwarded(REFRAMED_CHUNKED.replace(b"5\r\nhello", b"a\r\n0123456789")),
    ),
    # -- header syntax
    ("obs-fold", G + b"X-A: a\r\n b\r\n\r\n", Refused()),
    ("obs-fold-tab", G + b"X-A: a\r\n\tb\r\n\r\n", Refused()),
    ("obs-fold-first", b"GET /smuggle HTTP/1.1\r\n Host: @H@\r\n\r\n", Refused()),
    ("bare-lf-request-line", b"GET /smuggle HTTP/1.1\nHost: @H@\n\n", Refused()),
    ("bare-lf-header", b"GET /smuggle HTTP/1.1\r\nHost: @H@\nX-A: b\r\n\r\n", Refused()),
    ("bare-lf-end", G + b"\n", Refused()),
    ("bare-cr-request-line", b"GET /smuggle HTTP/1.1\rHost: @H@\r\n\r\n", Refused()),
    ("bare-cr-in-value", G + b"X-A: a\rb\r\n\r\n", Refused()),
    ("cr-space-in-value", G + b"X-A: a\r X-B: b\r\n\r\n", Refused()),
    ("nul-in-value", G + b"X-A: a\x00b\r\n\r\n", Refused()),
    ("vtab-in-value", G + b"X-A: a\x0bb\r\n\r\n", Refused()),
    ("del-in-value", G + b"X-A: a\x7fb\r\n\r\n", Refused()),
    ("space-before-colon", b"GET /smuggle HTTP/1.1\r\nHost : @H@\r\n\r\n", Refused()),
    ("tab-before-colon", b"GET /smuggle HTTP/1.1\r\nHost\t: @H@\r\n\r\n", Refused()),
    ("name-at", G + b"X@Y: a\r\n\r\n", Refused()),
    ("name-parens", G + b"X(Y): a\r\n\r\n", Refused()),
    ("name-space", G + b"X Y: a\r\n\r\n", Refused()),
    ("name-empty", G + b": a\r\n\r\n", Refused()),
    ("name-nul", G + b"X\x00: a\r\n\r\n", Refused()),
    ("name-utf8", G + b"X\xc3\xa9: a\r\n\r\n", Refused()),
    ("name-no-colon", G + b"X-A\r\n\r\n", Refused()),
    ("two-hosts", G + b"Host: other\r\n\r\n", Refused()),
    ("no-host", b"GET /smuggle HTTP/1.1\r\nX-A: a\r\n\r\n", Refused()),
    ("two-sandbox-ids", G + b"E2b-Sandbox-Id: open\r\nE2b-Sandbox-Id: open\r\n\r\n", Refused()),
    # -- request line and version
    ("http09", b"GET /smuggle\r\n\r\n", Refused((505,))),
    ("http09-version", b"GET /smuggle HTTP/0.9\r\nHost: @H@\r\n\r\n", Refused((505,))),
    ("http2-text", b"GET /smuggle HTTP/2.0\r\nHost: @H@\r\n\r\n", Refused((505,))),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Refused((400, 505))),
    ("http12", b"GET /smuggle HTTP/1.2\r\nHost: @H@\r\n\r\n", Refused((400, 505))),
    ("http30", b"GET /smuggle HTTP/3.0\r\nHost: @H@\r\n\r\n", Refused((400, 505))),
    # RFC 9112 §2.3: HTTP-name is "HTTP"; llhttp also reads RTSP/ and ICE/ (found by review),
    # and Go's server, E2B's proxy, answers them 400 "malformed HTTP version".
    ("rtsp-protocol", b"GET /smuggle RTSP/1.0\r\nHost: @H@\r\n\r\n", Refused()),
    ("rtsp-options", b"OPTIONS /smuggle RTSP/1.0\r\nHost: @H@\r\n\r\n", Refused()),
    ("rtsp-setup", b"SETUP /smuggle RTSP/1.0\r\nHost: @H@\r\n\r\n", Refused()),
    ("protocol-two-spaces", b"GET /smuggle  HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("ice-protocol", b"SOURCE /smuggle ICE/1.0\r\nHost: @H@\r\n\r\n", Refused()),
    ("http-lowercase", b"GET /smuggle http/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("http-10-digits", b"GET /smuggle HTTP/10.1\r\nHost: @H@\r\n\r\n", Refused((400, 505))),
    ("method-lowercase", b"get /smuggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("method-unknown", b"SMUGGLE /smuggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("method-tab", b"GET\t/smuggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("target-tab", b"GET /smu\tggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("target-high-byte", b"GET /smu\xffggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("target-nul", b"GET /smu\x00ggle HTTP/1.1\r\nHost: @H@\r\n\r\n", Refused()),
    ("only-crlf", b"\r\n\r\n\r\n" + b"\x16\x03\x01\x00\xa5\x01\x00\x00", Refused()),
    ("tls-client-hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32, Refused()),
    # -- bodies that look like requests stay bodies
    (
        "request-in-cl-body",
        P + b"Content-Length: %d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED),
        Forwarded(
            REFRAMED_LENGTH.replace(b"5\r\n\r\nhello", b"%d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED))
        ),
    ),
    ("obs-text-value", G + b"X-A: caf\xe9\r\n\r\n", Forwarded(G + b"X-A: caf\xe9\r\n\r\n")),
    ("leading-empty-lines", b"\r\n\r\n" + G + b"\r\n", Forwarded(G + b"\r\n")),
]


def _fill(raw: bytes, host: str) -> bytes:
    return raw.replace(b"@H@", host.encode())


@pytest.mark.parametrize(("raw", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_framing_is_refused_or_reframed(hostile: Hostile, raw: bytes, expect: Expect) -> None:
    recorder = hostile.recorder
    mark = recorder.mark()
    linger = 0.0 if isinstance(expect, Forwarded) else 1.0
    response, closed = await exchange(hostile.port, _fill(raw, hostile.app), linger=linger)
    if isinstance(expect, Refused):
        assert response.status in expect.statuses, (response.status, response.body)
        assert body_json(response)["code"] == response.status
        assert closed, "a framing refusal must close the connection"
        assert await recorder.nothing_since(mark), recorder.bytes_since(mark)
    elif isinstance(expect, RefusedInBody):
        assert response.status == 400, (response.status, response.body)
        assert closed
        await recorder.nothing_since(mark, settle=0.1)
        seen = recorder.bytes_since(mark)
        assert _fill(expect.prefix, hostile.app).startswith(seen), seen
        assert not any(r.complete for r in recorder.requests_since(mark))
    else:
        assert response.status == 200, (response.status, response.body)
        requests = await recorder.wait_for(mark, 1)
        assert len(requests) == 1
        assert requests[0].complete
        assert recorder.bytes_since(mark) == _fill(expect.upstream, hostile.app)


async def test_a_huge_chunk_size_is_streamed_in_relay_framing_never_the_clients(
    hostile: Hostile,
) -> None:
    """``FFFFFFFFFFFFFFFF`` is a valid chunk size: everything after it is chunk data, which
    relay forwards as data in its own chunks; the request never completes upstream."""
    recorder = hostile.recorder
    mark = recorder.mark()
    raw = (
        P
        + b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nhello\r\n0\r\n\r\n"
        + G
        + b"\r\n"
    )
    head = _fill(
        b"POST /smuggle HTTP/1.1\r\nHost: @H@\r\nTransfer-Encoding: chunked\r\n\r\n", hostile.app
    )
    data = _fill(b"hello\r\n0\r\n\r\n" + G + b"\r\n", hostile.app)
    async with connected(hostile.port) as conn:
        await conn.send(_fill(raw, hostile.app))
        await recorder.wait_for(mark, 1, timeout=0.5)
    await recorder.nothing_since(recorder.mark(), settle=0.1)
    seen = recorder.bytes_since(mark)
    assert seen == head + b"%x\r\n" % len(data) + data + b"\r\n"
    (request,) = recorder.requests_since(mark)
    assert not request.complete


# -- pipelining -----------------------------------------------------------------------------


def _get(host: str, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def _post(host: str, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _chunked(host: str, path: str, parts: list[bytes]) -> tuple[bytes, bytes]:
    """(what the client sends, what the upstream must get) for a chunked POST."""
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    sent = head + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    got = head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return sent, got


async def read_all(conn: Connection, count: int) -> list[tuple[int, bytes]]:
    out = []
    for _ in range(count):
        response = await conn.read_response(timeout=5)
        out.append((response.status, response.body))
    return out


async def test_two_pipelined_requests_in_one_packet(hostile: Hostile) -> None:
    recorder, host = hostile.recorder, hostile.app
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(_get(host, "/p1") + _get(host, "/p2"))
        answers = await read_all(conn, 2)
    assert answers == [(200, b"GET /p1 0"), (200, b"GET /p2 0")]
    assert recorder.bytes_since(mark) == _get(host, "/p1") + _get(host, "/p2")


async def test_ten_pipelined_requests_with_and_without_bodies(hostile: Hostile) -> None:
    recorder, host = hostile.recorder, hostile.app
    sent, expected, bodies = b"", b"", []
    for i in range(10):
        if i % 3 == 0:
            sent += _get(host, f"/p{i}")
            expected += _get(host, f"/p{i}")
            bodies.append(f"GET /p{i} 0".encode())
        elif i % 3 == 1:
            body = b"x" * (i * 100)
            sent += _post(host, f"/p{i}", body)
            expected += _post(host, f"/p{i}", body)
            bodies.append(f"POST /p{i} {len(body)}".encode())
        else:
            client, upstream = _chunked(host, f"/p{i}", [b"ab", b"c" * i])
            sent += client
            expected += upstream
            bodies.append(f"POST /p{i} {2 + i}".encode())
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(sent)
        answers = await read_all(conn, 10)
        assert answers == [(200, b) for b in bodies]
        await conn.send(_get(host, "/after"))  # still usable
        assert (await conn.read_response()).body == b"GET /after 0"
    assert recorder.bytes_since(mark) == expected + _get(host, "/after")


@pytest.mark.parametrize(
    "malformed",
    [
        b"GET /bad HTTP/1.1\r\nHost: @H@\r\nX-A: a\r\n b\r\n\r\n",
        b"POST /bad HTTP/1.1\r\nHost: @H@\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /bad HTTP/1.1\r\nHost: @H@\r\nTransfer-Encoding: chunked\r\n\r\nZ\r\nhello\r\n0\r\n\r\n",
        b"GET /bad HTTP/1.1\nHost: @H@\n\n",
        b"GET /bad HTTP/1.1\r\nHost: @H@\r\nTransfer-Encoding: identity, chunked\r\n\r\n",
        b"GET /bad RTSP/1.0\r\nHost: @H@\r\n\r\n",
        b"GET /p0 RTSP/1.0\r\nHost: @H@\r\n\r\n",  # as an earlier request's, but RTSP
    ],
    ids=["obs-fold", "cl-te", "bad-chunk", "bare-lf", "te-identity", "rtsp", "rtsp-same-target"],
)
async def test_ten_pipelined_with_one_malformed(hostile: Hostile, malformed: bytes) -> None:
    """Requests before the malformed one are forwarded once and answered in order; then the
    refusal, then the connection closes; nothing after it reaches the upstream."""
    recorder, host = hostile.recorder, hostile.app
    before = [_post(host, f"/p{i}", b"body%d" % i) for i in range(4)]
    after = [_get(host, f"/q{i}") for i in range(5)]
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(b"".join(before) + _fill(malformed, host) + b"".join(after))
        answers = await read_all(conn, 5)
        assert answers[:4] == [(200, b"POST /p%d 5" % i) for i in range(4)]
        assert answers[4][0] in (400, 501)
        assert await conn.closed_by_peer(2)
    await recorder.nothing_since(recorder.mark(), settle=0.1)
    assert recorder.bytes_since(mark) == b"".join(before)


async def test_a_refused_request_between_pipelined_ones_is_answered_in_place(
    hostile: Hostile,
) -> None:
    """A control path in the middle of a pipeline gets its 404 in order; the others pass."""
    recorder = hostile.recorder
    envd = hostile.envd
    token = "X-Access-Token: envd-tok\r\n"
    reqs = [
        f"GET /one HTTP/1.1\r\nHost: {envd}\r\n{token}\r\n".encode(),
        f"POST /init HTTP/1.1\r\nHost: {envd}\r\n{token}Content-Length: 2\r\n\r\n{{}}".encode(),
        f"GET /three HTTP/1.1\r\nHost: {envd}\r\n{token}\r\n".encode(),
    ]
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(b"".join(reqs))
        answers = await read_all(conn, 3)
    assert [a[0] for a in answers] == [200, 404, 200]
    assert answers[0][1] == b"GET /one 0"
    assert answers[2][1] == b"GET /three 0"
    forwarded = [(r.method, r.target) for r in recorder.requests_since(mark)]
    assert forwarded == [(b"GET", b"/one"), (b"GET", b"/three")]
    assert b"X-Access-Token" not in recorder.bytes_since(mark)


async def test_a_request_after_the_last_chunk_is_a_new_request(hostile: Hostile) -> None:
    """Bytes after ``0\\r\\n\\r\\n`` are the next request, decided on its own (here: refused)."""
    recorder, envd = hostile.recorder, hostile.envd
    raw = (
        f"POST /files HTTP/1.1\r\nHost: {envd}\r\nX-Access-Token: envd-tok\r\n"
        "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        f"POST /init HTTP/1.1\r\nHost: {envd}\r\nX-Access-Token: envd-tok\r\n\r\n"
    ).encode()
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(raw)
        answers = await read_all(conn, 2)
    assert [a[0] for a in answers] == [200, 404]
    assert [r.target for r in recorder.requests_since(mark)] == [b"/files"]


async def test_a_malformed_request_behind_a_streaming_response_waits_for_it(
    hostile: Hostile,
) -> None:
    """The response already streaming is finished, whole, before the refusal and the close."""
    host = hostile.app
    async with connected(hostile.port) as conn:
        await conn.send(_get(host, "/stream?n=5&interval=0.05") + b"GET /bad HTTP/1.1\n\n")
        stream = await conn.read_response(timeout=5)
        assert stream.complete
        assert stream.body == b"".join(b"event %d\n" % i for i in range(5))
        refusal = await conn.read_response(timeout=5)
        assert refusal.status == 400
        assert await conn.closed_by_peer(2)


@pytest.mark.parametrize(
    "refused",
    [
        b"GET /r HTTP/1.1\r\nHost: @H@\r\nHost: other\r\n\r\n",
        b"GET /r HTTP/1.1\r\nX-No-Host: 1\r\n\r\n",
        b"GET /r HTTP/1.1\r\nHost: @H@\r\nUpgrade: h2c\r\n\r\n",
        b"POST /r HTTP/1.1\r\nHost: @H@\r\nTransfer-Encoding: identity, chunked\r\n\r\n0\r\n\r\n",
        b"GET http://x/ HTTP/1.1\r\nHost: @H@\r\n\r\n",
    ],
    ids=["two-hosts", "no-host", "h2c", "te-identity", "absolute-form"],
)
async def test_requests_behind_one_refused_at_its_head_go_nowhere(
    hostile: Hostile, refused: bytes
) -> None:
    """A request refused (and the connection closed) as soon as its head is read, with more
    requests in the same packet: those are never parsed into exchanges, never forwarded."""
    host = hostile.app
    mark = hostile.recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(
            _fill(refused, host) + _get(host, "/behind1") + _post(host, "/behind2", b"x")
        )
        response = await conn.read_response(timeout=5)
        assert response.status in (400, 501)
        assert await conn.closed_by_peer(2)
    assert await hostile.recorder.nothing_since(mark)


@pytest.mark.parametrize(
    "cut", [b"GET /s", b"GET /smuggle ", b"GET /smuggle RT", b"GET /smuggle RTSP/1.0\r\n"]
)
async def test_a_request_line_of_another_protocol_cut_across_reads_is_refused(
    hostile: Hostile, cut: bytes
) -> None:
    """The RTSP request line (rtsp-protocol above) in two reads: refused all the same."""
    recorder, host = hostile.recorder, hostile.app
    raw = _fill(b"GET /smuggle RTSP/1.0\r\nHost: @H@\r\n\r\n", host)
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(_get(host, "/first") + cut)
        assert (await conn.read_response(timeout=5)).status == 200
        await conn.send(raw[len(cut) :])
        response = await conn.read_response(timeout=5)
        assert response.status == 400, (response.status, response.body)
        assert await conn.closed_by_peer(2)
    await recorder.nothing_since(recorder.mark(), settle=0.1)
    assert recorder.bytes_since(mark) == _get(host, "/first")


@pytest.mark.parametrize("cut", [b"GET /s", b"GET /smuggle HT", b"GET /smuggle HTTP/1.1\r\nHo"])
async def test_an_http_request_line_cut_across_reads_is_forwarded(
    hostile: Hostile, cut: bytes
) -> None:
    recorder, host = hostile.recorder, hostile.app
    raw = _get(host, "/smuggle")
    mark = recorder.mark()
    async with connected(hostile.port) as conn:
        await conn.send(_get(host, "/first") + cut)
        assert (await conn.read_response(timeout=5)).status == 200
        await conn.send(raw[len(cut) :])
        assert (await conn.read_response(timeout=5)).body == b"GET /smuggle 0"
    assert recorder.bytes_since(mark) == _get(host, "/first") + raw
