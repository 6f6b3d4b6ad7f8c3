"""Found by review: a WebSocket client still sending when relay ended its splice (a revoked
route, a drain) was reset, and the reset discarded relay's 1001 Close frame.

Splice._end closed the client connection with ``transport.close()``: relay stops reading at
once and closes the socket when its own buffer is empty. Frames the client sent meanwhile stay
unread, and a socket closed with unread bytes is reset (RFC 9293 §3.6.1; Linux sends an RST
and drops its send queue), so what the kernel had not sent yet, relay's Close frame among it,
never reaches a client that reads more slowly than relay writes. The upstream side of the same
close half-closes and reads on (``UpstreamConnection.close``); nginx's lingering close does so
for clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from pathlib import Path

from relay.core.streams import CLOSE_GOING_AWAY, close_frame
from relay.websocket import Splice
from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream, until
from tests.test_websocket_departure import HS_RESP, masked_binary

FRAME = 30000


def server_frame(payload: bytes) -> bytes:  # unmasked, as a server sends it (RFC 6455 §5.1)
    return bytes([0x82, 126]) + struct.pack(">H", len(payload)) + payload


async def test_a_revoked_websocket_client_still_sending_gets_the_close_frame(
    tmp_path: Path,
) -> None:
    """The app sends 60 KB the client has not read yet; the route is revoked; the client
    sends a few more frames, then reads everything: the last bytes must be relay's 1001."""
    sent_by_app = server_frame(b"a" * FRAME) * 2
    go = asyncio.Event()

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HS_RESP)
        await asyncio.wait_for(go.wait(), 5)  # once relay's send buffer is small
        writer.write(sent_by_app)
        with contextlib.suppress(OSError):
            for _ in range(10000):  # bounded: reads and drops until relay closes
                if not await reader.read(65536):
                    break
        writer.close()

    loop = asyncio.get_running_loop()
    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader's
        client.setblocking(False)
        with client:
            await loop.sock_connect(client, ("127.0.0.1", relay.port))
            await loop.sock_sendall(
                client,
                f"GET /ws HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\nConnection: Upgrade\r\n"
                "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode(),
            )
            await until(lambda: bool(relay.relay.live.get("sbx")))
            (live,) = relay.relay.live["sbx"]
            assert isinstance(live, Splice)
            splice = live
            transport = splice.client.transport  # type: ignore[attr-defined]
            # A small send buffer on relay's side (fixed, so not grown by autotuning): what
            # the client has not read waits in relay's buffer and the kernel's queue.
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            go.set()
            # relay took all of it (the Close frame goes after whole frames only) and holds
            # what the client has not read yet in its buffer.
            await until(lambda: splice.bytes_out == len(sent_by_app))
            assert transport.get_write_buffer_size() > 0
            relay.set_routes([])  # revoked: relay sends its 1001 and closes
            await until(lambda: not relay.relay.live.get("sbx"))
            # The client, not having read the Close yet, sends on (as a chatty one does).
            for _ in range(3):
                await loop.sock_sendall(client, masked_binary(b"c" * 1000))
            await asyncio.sleep(0.05)
            received = bytearray()
            reset = False
            for _ in range(10000):  # bounded: reads until the end (5 s at most)
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(client, 65536), 5)
                except ConnectionResetError:
                    reset = True
                    break
                if not chunk:
                    break
                received.extend(chunk)
                await asyncio.sleep(0.001)  # a slow reader
    _, _, frames = bytes(received).partition(b"\r\n\r\n")
    assert frames.endswith(close_frame(CLOSE_GOING_AWAY)), (
        f"the client got {len(frames)} of {len(sent_by_app) + 4} bytes, reset={reset}"
    )
    assert not reset
