"""Found by review: an upstream's answer that came before the request body ended was sent to
the client without ``Connection: close``, though relay then closed the connection.

relay cannot keep a client connection whose request body it will not read to its end
(``Respond.response_end``), so it closes it after the answer (lingering, relay.closing). The
client was not told: RFC 9112 §9.6 has a server that will close say so in its last response
("SHOULD send a close connection option"), and RFC 9110 §10.1.1 asks a server answering
before the whole content to "indicate whether it intends to close the connection". Go's
net/http server, which E2B's proxy runs on, sends ``Connection: close`` whenever it will close
after an unread body (closeAfterReply). A client told nothing takes the connection for a
kept one and sends its next request into the close.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream
from tests.support.rawhttp import Connection

BODY = 8 << 20


async def test_an_answer_before_the_end_of_the_upload_says_the_connection_closes(
    tmp_path: Path,
) -> None:
    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        # A keep-alive answer of its own: the close is relay's decision, not the upstream's.
        writer.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 7\r\n\r\ntoo big")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until relay lets go of this connection
        writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(
            f"POST /upload HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\n"
            f"Content-Length: {BODY}\r\n\r\n".encode()
        )

        async def upload() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(BODY // 65536):  # bounded: the announced body, 64 KiB at a time
                    writer.write(b"x" * 65536)
                    await writer.drain()

        sending = asyncio.create_task(upload())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = await asyncio.wait_for(reader.readexactly(7), 5)
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert body == b"too big"
    fields = [line.lower() for line in head.split(b"\r\n")[1:]]
    assert b"connection: close" in fields, head


async def upstream_of_two_kinds(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """POST /duplex: the head at once, then the 10-byte body read and echoed (an upstream
    that answers while it reads, as a progress stream does); POST /early: 413 at once, the
    body never read; anything else: 200 "ok"."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        for _ in range(10):  # bounded: a few requests per connection
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"POST /duplex"):
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                body = await reader.readexactly(10)
                writer.write(b"a\r\n%s\r\n0\r\n\r\n" % body)
            elif head.startswith(b"POST /early"):
                writer.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 7\r\n\r\ntoo big")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    writer.close()


@pytest.mark.parametrize("path", ["/duplex", "/early"])
async def test_an_answer_before_a_small_bodys_end_keeps_the_connection(
    tmp_path: Path, path: str
) -> None:
    """An upstream's head sent before the request body ended (the upload still on its way):
    the connection is kept when the rest of the body can be dropped, as after relay's own
    answers (DISCARD_LIMIT), and as nginx and Go's server keep it. An upstream that reads the
    body while it answers (/duplex) lost the connection though the body then ended before the
    response: the head said close whenever it came before the body's end (found by review).
    One that answers without reading (/early) gets the rest dropped, not sent to it."""
    async with (
        scripted_upstream(upstream_of_two_kinds) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        host = f"{port}-sbx.{DOMAIN}"
        conn = await Connection.open(relay.port)
        try:
            await conn.send(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 10\r\n\r\n12345".encode()
            )
            await asyncio.sleep(0.2)  # the upstream's head comes before the rest of the body
            await conn.send(b"67890")
            first = await conn.read_response(timeout=3)
            assert first.header("Connection") is None
            await conn.send(f"GET /after HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            after = await conn.read_response(timeout=3)
        finally:
            await conn.close()
    assert (first.status, first.body) == (
        (200, b"1234567890") if path == "/duplex" else (413, b"too big")
    )
    assert (after.status, after.body) == (200, b"ok")
