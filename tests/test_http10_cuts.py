"""Found by review: an HTTP/1.0 client gets a close-delimited response (relay re-frames a chunked or
unlengthed upstream body that way, core/responses.py). When the upstream dies mid-body, relay
ends the client connection with an orderly close (FIN), which for a close-delimited body *is*
the end of the message: the client takes the truncated body as complete.

RFC 9112 §8: a response with neither chunked coding nor Content-Length "is terminated by
closure of the connection and ... is considered complete unless an error was indicated by the
underlying connection". The only way left to tell the client is an abortive close (RST), as
relay's own contract wants a cut response to be visible (SPEC §3: "so the client sees the
truncation"; respond.py Respond.cut: "close without the terminator so the client sees it").
"""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from tests.support import harness
from tests.support.harness import route, running_relay, scripted_upstream
from tests.support.wired import DOMAIN, make_wired

HOST = f"3000-sbx.{DOMAIN}"


@pytest.mark.parametrize(
    ("head", "ending"),
    [
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "reset"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "fin"),
        (b"Connection: close\r\n\r\nhello", "reset"),
        (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "revoked"),
    ],
    ids=["chunked-reset", "chunked-fin", "unlengthed-reset", "chunked-revoked"],
)
def test_an_http10_client_sees_a_cut_response_as_cut(
    tmp_path: Path, head: bytes, ending: str
) -> None:
    w = make_wired(tmp_path)
    w.client.data_received(f"GET /x HTTP/1.0\r\nHost: {HOST}\r\n\r\n".encode())
    w.turns.end()
    w.upstream.data_received(b"HTTP/1.1 200 OK\r\n" + head)
    w.turns.end()
    if ending == "revoked":
        w.relay.install_routes({}, "t2")  # SPEC §3: the route is removed mid-response
    elif ending == "fin":
        w.upstream.eof_received()  # mid-chunk-stream: no last chunk
        w.upstream.connection_lost(None)
    else:
        w.upstream.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
    w.turns.end()
    events = w.client_transport.events
    assert events[0][0] == "write"
    assert events[0][1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length" not in events[0][1]  # close-delimited for the client
    assert w.client_transport.data.endswith(b"hello")
    kinds = [kind for kind, _ in events]
    assert "abort" in kinds, f"{kinds}: an orderly close ends a close-delimited body cleanly"
    assert "close" not in kinds


@pytest.mark.parametrize("ending", ["fin-mid-chunk-stream", "reset"])
async def test_a_cut_reaches_a_real_http10_client_as_a_reset(tmp_path: Path, ending: str) -> None:
    """The test above watches relay call abort() on a stand-in transport. On a real socket
    uvloop's (and asyncio's) abort() is a close that drops what is unsent, and the kernel
    sends a FIN, not a reset, when nothing the client sent is left unread: the client took
    the part it got for the whole answer (found by review). relay's abort sets SO_LINGER to
    zero first, so that the close is a reset."""

    async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if ending == "reset":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)
        sock = writer.get_extra_info("socket")
        if ending == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    async with (
        scripted_upstream(cut_short) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        host = f"{port}-sbx.{harness.DOMAIN}"
        writer.write(f"GET /x HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        got = b""
        cut = False
        try:
            async with asyncio.timeout(5):
                for _ in range(100):  # bounded: until the end of the answer
                    data = await reader.read(65536)
                    if not data:
                        break
                    got += data
        except ConnectionResetError:
            cut = True
        finally:
            writer.close()
    assert cut, f"an orderly close: {got!r} reads as the whole answer"
