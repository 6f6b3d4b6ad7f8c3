"""Early answers to large uploads reach clients that send their whole body before reading.

Closing a socket with unread bytes makes the kernel reset the connection, and a reset can
destroy an answer the client has not read yet (RFC 9112 §9.6). relay therefore lingers
when it closes in the middle of a request: it half-closes after its answer and drops what
the client still sends (``ClientConnection.close``). Real sockets, a real relay in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relay import closing, timers
from tests.support.certs import issue
from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    route,
    running_relay,
    scripted_upstream,
)

SIZE = 8 * 1024 * 1024  # several times what the kernel buffers on loopback
BLOCK = b"u" * 65536


async def send_upload(writer: asyncio.StreamWriter, host: str, headers: str) -> None:
    """A whole SIZE-byte upload, written before anything is read."""
    head = f"POST /files?path=/big HTTP/1.1\r\nHost: {host}\r\n{headers}"
    writer.write(f"{head}Content-Length: {SIZE}\r\n\r\n".encode())
    for _ in range(SIZE // len(BLOCK)):
        writer.write(BLOCK)
        await asyncio.wait_for(writer.drain(), 5)


async def upload_then_read(port: int, host: str, headers: str = "") -> tuple[bytes, bool]:
    """Send a whole SIZE-byte upload, then read: what a client that reads only after
    sending gets (the answer, and whether relay closed), or raises on a reset."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await send_upload(writer, host, headers)
        answer = await asyncio.wait_for(reader.read(65536), 5)
        closed = await asyncio.wait_for(reader.read(65536), 5) == b""
        return answer, closed
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[RelayUnderTest]:
    async with running_relay(tmp_path, [route("sbx", envd_token="envd-secret")]) as r:
        yield r


async def test_relays_own_answer_to_a_large_upload_is_read(relay: RelayUnderTest) -> None:
    answer, closed = await upload_then_read(
        relay.port, f"49983-sbx.{DOMAIN}", "X-Access-Token: wrong\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == 401
    assert closed


async def test_a_chunked_upload_past_the_discard_limit_still_gets_its_answer(
    relay: RelayUnderTest,
) -> None:
    """A refused chunked body is read and dropped up to DISCARD_LIMIT (the connection could
    be kept); past it relay closes, lingering, so the 401 written first is still read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        host = f"49983-sbx.{DOMAIN}"
        writer.write(
            f"POST /files HTTP/1.1\r\nHost: {host}\r\nX-Access-Token: wrong\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"%x\r\n" % len(BLOCK) + BLOCK + b"\r\n"
        for _ in range(SIZE // len(BLOCK)):
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 5)
        writer.write(b"0\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(65536), 5)
        closed = await asyncio.wait_for(reader.read(65536), 5) == b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert closed


async def test_an_upstreams_early_answer_to_a_large_upload_is_read(relay: RelayUnderTest) -> None:
    async def refuse_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n\r\ntoo big!")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):  # a server that drains, as Go's does
                pass
        writer.close()

    async with scripted_upstream(refuse_early) as port:
        answer, closed = await upload_then_read(relay.port, f"{port}-sbx.{DOMAIN}")
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert answer.endswith(b"too big!")
    assert closed


async def test_relays_502_when_the_upstream_goes_mid_upload_is_read(relay: RelayUnderTest) -> None:
    """The exchange is cut (its answer closes the connection) and the cut closes the client
    once more: a close while lingering leaves the linger alone."""

    async def close_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(65536)
        writer.close()  # FIN without an answer

    async with scripted_upstream(close_early) as port:
        answer, closed = await upload_then_read(relay.port, f"{port}-sbx.{DOMAIN}")
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert closed


async def test_a_revocation_mid_upload_is_read(relay: RelayUnderTest) -> None:
    async def drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    async with scripted_upstream(drain) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        head = f"POST /up HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\nContent-Length: {SIZE}\r\n\r\n"
        writer.write(head.encode())
        try:
            for i in range(SIZE // len(BLOCK)):
                if i == 16:
                    relay.set_routes([])  # the sandbox is gone: relay answers 502 itself
                writer.write(BLOCK)
                await asyncio.wait_for(writer.drain(), 5)
            answer = await asyncio.wait_for(reader.read(65536), 5)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 502 ")


async def test_lingering_ends(relay: RelayUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that never stops sending is cut off once LINGER_TOTAL_S has passed (and a
    close grace period, relay.timers, 1 s here instead of 5 s), having been sent its answer."""
    monkeypatch.setattr(closing, "LINGER_TOTAL_S", 0.3)
    monkeypatch.setattr(timers, "CLOSE_GRACE_S", 1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    host = f"49983-sbx.{DOMAIN}"
    writer.write(
        f"POST /files HTTP/1.1\r\nHost: {host}\r\nContent-Length: {1 << 40}\r\n\r\n".encode()
    )
    received = bytearray()

    async def read_all() -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                received.extend(data)

    reading = asyncio.ensure_future(read_all())
    started = time.monotonic()
    with contextlib.suppress(ConnectionError):
        while time.monotonic() - started < 15:
            writer.write(BLOCK)
            await asyncio.wait_for(writer.drain(), 10)
            await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    writer.close()
    await asyncio.wait_for(reading, 5)
    assert elapsed < 10, "relay never stopped lingering"
    assert bytes(received).startswith(b"HTTP/1.1 401 ")


async def test_over_tls_the_answer_to_a_large_upload_is_read(tmp_path: Path) -> None:
    """TLS cannot half-close, so relay lingers without a FIN: the client finishes its upload
    and reads the answer. (Closing with TLS's close_notify instead, which would signal the
    end at once, was tried: asyncio's client then failed its remaining writes with
    "Connection lost", so it was dropped.)"""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    tls = {"listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)}}
    host = f"49983-sbx.{DOMAIN}"
    async with running_relay(tmp_path, [route("sbx", envd_token="envd-secret")], tls) as relay:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", relay.port, ssl=certs.client_context(), server_hostname=host
        )
        try:
            await send_upload(writer, host, "X-Access-Token: wrong\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 401 ")
            assert b"\r\nConnection: close\r\n" in answer
            length = int(answer.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = await asyncio.wait_for(reader.readexactly(length), 5)
            assert json.loads(body)["code"] == 401
        finally:
            writer.close()
