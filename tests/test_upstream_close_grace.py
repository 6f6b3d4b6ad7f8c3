"""Found by review: an upstream connection closed with bytes still queued was aborted a fixed
``CLOSE_GRACE_S`` after the close, however steadily the upstream was taking them.

``UpstreamConnection.close`` leaves the transport to drain (uvloop has no close timeout) and
``Pool.sweep`` aborts it once the grace has passed. A WebSocket whose client sent its last
frames and its Close frame, then left, has its upstream closed with those frames queued: an
app that reads them at a steady, modest rate lost the tail, its Close frame included (SPEC §4:
close codes flow both ways), although it never stopped reading. The client side's closes wait
while the peer takes some (``Closing.close_expired``, nginx's ``send_timeout``); the upstream
side must too (nginx's ``proxy_send_timeout`` likewise counts between two writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import pytest

from relay import upstreams
from tests.support.harness import DOMAIN, route, running_relay, until
from tests.test_websocket_departure import HS_RESP, masked_binary, masked_close


@pytest.mark.parametrize("chatty", [False, True], ids=["reads-only", "sends-meanwhile"])
async def test_a_closed_upstream_that_reads_steadily_gets_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chatty: bool
) -> None:
    """And one that sends its client frames meanwhile (found by the same review): relay stopped
    reading it at the close, and the socket, closed with those frames unread, was reset, which
    discarded what the kernel had not sent yet, the client's Close frame among it."""
    # The grace cut to 0.5 s so that the test is short; the upstream takes ~50 KB/s for ~1 s
    # after the close, never pausing for more than 0.1 s.
    monkeypatch.setattr(upstreams, "CLOSE_GRACE_S", 0.5)
    received = bytearray()
    # A small receive buffer, so that what the app has not read yet waits in relay's own
    # write buffer rather than in the kernel's queues (relay's side below).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(5)
    port = listener.getsockname()[1]

    def app() -> None:
        """Reads 1 KB every 20 ms (~50 KB/s), at the socket, until the close; chatty, it
        sends a frame of its own each time too."""
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 4096:  # bounded
                head += conn.recv(4096)
            conn.sendall(HS_RESP)
            for _ in range(2000):  # bounded: 40 s
                try:
                    chunk = conn.recv(1024)
                except OSError:
                    break
                if not chunk:
                    break
                received.extend(chunk)
                if chatty:
                    with contextlib.suppress(OSError):
                        conn.send(b"\x81\x02hi")  # a text frame to the client, unmasked
                time.sleep(0.02)

    app_done = asyncio.get_running_loop().run_in_executor(None, app)
    try:
        async with running_relay(tmp_path, [route("sbx", insecure=True)]) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(
                f"GET /ws HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\nConnection: Upgrade\r\n"
                "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 101")
            # And a small send buffer on relay's side of it (fixed, so not grown by the
            # kernel's autotuning, which takes megabytes on loopback).
            (splice,) = relay.relay.live["sbx"]
            sock = splice.upstream.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            data = masked_binary(b"z" * 60000) + masked_close()
            writer.write(data)
            await writer.drain()
            writer.close()  # the client has said all it had to say, and leaves
            await until(lambda: not relay.relay.live.get("sbx"))  # the splice ended
            await asyncio.wait_for(app_done, 30)
            await until(lambda: relay.relay.pool.opened == 0)  # and the connection went
    finally:
        listener.close()
    assert len(received) == len(data), f"upstream got {len(received)} of {len(data)} bytes"
    assert received[-8] == 0x88  # its Close frame last
