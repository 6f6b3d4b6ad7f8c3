"""The first bytes on the TLS listener (relay.handshake): a plain-HTTP request gets a 400 that
says why (as nginx answers "The plain HTTP request was sent to HTTPS port"); a TLS client, or
anything else, goes to the handshake as before. A handshake that fails on them sends its
alert (relay.tls.AlertingObject), read here from a raw socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
import warnings
from pathlib import Path

import pytest

from tests.support.certs import Issued, client_hello, issue
from tests.support.harness import DOMAIN, running_relay, until


def _tls(certs: Issued, **listen: object) -> dict[str, dict[str, object]]:
    return {"listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file), **listen}}


def _client_hello() -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(
        incoming, outgoing, server_hostname=f"49983-sbx.{DOMAIN}"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _exchange(port: int, *pieces: bytes, pause: float = 0.0) -> tuple[bytes, float]:
    """Send ``pieces`` on a raw TCP connection (``pause`` between them), then read to the
    close: what relay sent (b"" for a reset) and how long after connecting it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(pause)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
        return got, time.monotonic() - started


async def test_plain_http_on_the_tls_port_is_answered_400(tmp_path: Path) -> None:
    """curl http://…:443 and an SDK given http:// for an https:// relay saw "connection reset";
    now they read why, in SPEC §5's JSON, and the connection closes (it never leaves its
    handshake: it counts in ``Relay.handshakes`` until then, as any other)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    host = f"49983-sbx.{DOMAIN}"
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nUser-Agent: curl/8\r\n\r\n".encode()
    async with running_relay(tmp_path, [], _tls(certs, header_timeout_s=3)) as relay:
        got, elapsed = await asyncio.to_thread(_exchange, relay.port, request)
        await until(lambda: not relay.relay.handshakes and not relay.relay.connections)
        refused = relay.relay.observer.refusals
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request"
    assert b"Connection: close" in lines
    assert b"Content-Type: application/json; charset=utf-8" in lines
    assert f"Content-Length: {len(body)}".encode() in lines
    assert json.loads(body) == {
        "code": 400,
        "message": "The plain HTTP request was sent to the HTTPS port: use https://",
    }
    assert elapsed < 1.0, f"closed {elapsed:.2f} s after the request (not at its answer)"
    assert refused.get("plain_http") == 1


async def test_an_upload_sent_before_reading_still_reads_the_400(tmp_path: Path) -> None:
    """The client sends its whole body before it reads (most do): relay drops it and closes
    after the client's FIN, so no reset destroys the answer (RFC 9112 §9.6)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    body = b"x" * (4 << 20)
    head = f"POST /files HTTP/1.1\r\nHost: 49983-sbx.{DOMAIN}\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"

    def upload(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(head.encode() + body)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
            return got

    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        got = await asyncio.to_thread(upload, relay.port)
        await until(lambda: not relay.relay.handshakes)
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n")


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"POST /files?path=x HTTP/1.1\r\n", id="post"),
        pytest.param(b"CONNECT 10.0.0.1:50090 HTTP/1.1\r\n", id="connect"),
        pytest.param(b"OPTIONS * HTTP/1.1\r\n", id="asterisk"),
    ],
)
async def test_any_request_line_gets_the_400(tmp_path: Path, first: bytes) -> None:
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        # A byte at a time: the method is told from its space, however it arrives.
        got, _ = await asyncio.to_thread(
            _exchange, relay.port, *(first[i : i + 1] for i in range(12)), first[12:], pause=0.01
        )
        await until(lambda: not relay.relay.handshakes)
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n")


async def test_a_head_request_gets_the_400s_head_only(tmp_path: Path) -> None:
    """RFC 9110 §9.3.2, as relay's other answers: curl -I read the JSON as excess bytes."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        got, _ = await asyncio.to_thread(
            _exchange, relay.port, f"HEAD / HTTP/1.1\r\nHost: 49983-sbx.{DOMAIN}\r\n\r\n".encode()
        )
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"Content-Length: 0" not in head  # the GET's length, as RFC 9110 §8.6 allows
    assert body == b""


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"SSH-2.0-OpenSSH_9.6 Ubuntu\r\n", id="ssh-banner"),
        pytest.param(b"get / HTTP/1.1\r\n\r\n", id="lower-case-method"),
        pytest.param(b"\x00\x01\x02\x03 binary", id="binary"),
        pytest.param(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ / HTTP/1.1\r\n\r\n", id="method-too-long"),
        pytest.param(b"\x15\x03\x03\x00\x02\x02\x28", id="tls-alert-record"),
    ],
)
async def test_other_bytes_get_no_http_answer(tmp_path: Path, first: bytes) -> None:
    """Only what clearly begins an HTTP/1.x request line is answered; the rest goes to the
    handshake, which fails as it did (closed, no HTTP)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        got, _ = await asyncio.to_thread(_exchange, relay.port, first)
        await until(lambda: not relay.relay.handshakes)
    assert not got.startswith(b"HTTP/")


async def test_a_partial_method_is_held_no_longer_than_a_silent_client(tmp_path: Path) -> None:
    """A slowloris that sends one letter is closed at header_timeout_s from accept, the
    handshake's own limit, with no answer (it never said it speaks HTTP)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    async with running_relay(tmp_path, [], _tls(certs, header_timeout_s=0.5)) as relay:
        got, elapsed = await asyncio.to_thread(_exchange, relay.port, b"G")
        await until(lambda: not relay.relay.handshakes)
    assert got == b""
    assert 0.4 < elapsed < 1.5, f"closed {elapsed:.2f} s after accept (header_timeout_s=0.5)"


async def test_a_client_hello_in_pieces_still_shakes_hands(tmp_path: Path) -> None:
    """The first byte alone (0x16) sends the connection to the handshake, whatever follows."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    hello = _client_hello()
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
            sock.sendall(hello[:1])
            await asyncio.sleep(0.05)
            sock.sendall(hello[1:])
            first = await asyncio.to_thread(sock.recv, 5)
    assert first[:1] == b"\x16"  # a ServerHello


# -- a failed handshake ends with OpenSSL's alert (RFC 8446 §6.2), not a bare close -------------
PROTOCOL_VERSION, HANDSHAKE_FAILURE, UNEXPECTED_MESSAGE = 70, 40, 10  # RFC 8446 §6


def _hello_of(ctx: ssl.SSLContext) -> bytes:
    return client_hello(ctx, f"49983-sbx.{DOMAIN}")


def _old_client() -> ssl.SSLContext:
    """A client that offers TLS 1.0 and 1.1 only (relay's minimum is 1.2)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 leaves TLS < 1.2 out above level 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # as old clients are
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    return ctx


def _rsa_only_client() -> ssl.SSLContext:
    """A TLS 1.2 client whose only cipher suite needs an RSA certificate (relay's is P-256)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers("ECDHE-RSA-AES128-GCM-SHA256")
    return ctx


def _alerts(got: bytes) -> list[tuple[int, int]]:
    """The (level, description) of each alert record among the plaintext records in ``got``
    (RFC 8446 §5.1: type, version, length; an alert is type 21 with two bytes)."""
    out = []
    while len(got) >= 5:
        kind, size = got[0], int.from_bytes(got[3:5], "big")
        body, got = got[5 : 5 + size], got[5 + size :]
        if kind == 21 and size == 2:
            out.append((body[0], body[1]))
    return out


@pytest.mark.parametrize(
    ("client", "description"),
    [
        pytest.param(_old_client, PROTOCOL_VERSION, id="tls1.1-only"),
        pytest.param(_rsa_only_client, HANDSHAKE_FAILURE, id="no-shared-cipher"),
    ],
)
async def test_a_failed_handshake_sends_its_alert(
    tmp_path: Path, client: type[ssl.SSLContext], description: int
) -> None:
    """curl then says "tlsv1 alert protocol version" or "handshake failure" (what nginx's
    clients see), not "connection reset by peer" / "unexpected eof"."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        got, _ = await asyncio.to_thread(_exchange, relay.port, _hello_of(client()))
        await until(lambda: not relay.relay.handshakes)
    assert _alerts(got) == [(2, description)]  # fatal


async def test_garbage_after_a_client_hello_gets_an_alert(tmp_path: Path) -> None:
    """A record the handshake cannot take, sent once relay answered the ClientHello, in a
    read of its own. TLS 1.2, whose alerts before ChangeCipherSpec are plaintext (TLS 1.3
    encrypts them once the ServerHello is out: RFC 8446 §5.2)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    async with running_relay(tmp_path, [], _tls(certs)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
            sock.sendall(_hello_of(client))
            flight = await asyncio.to_thread(sock.recv, 65536)
            assert flight[:1] == b"\x16"
            sock.sendall(b"\x16\x03\x03\x00\x04junk")  # a plaintext handshake record, after
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.to_thread(sock.recv, 65536):
                    got += chunk
        await until(lambda: not relay.relay.handshakes)
    assert _alerts(got) == [(2, UNEXPECTED_MESSAGE)]
