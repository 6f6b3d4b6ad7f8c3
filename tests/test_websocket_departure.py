"""Found by review: a WebSocket whose client left (FIN) while relay was not reading it stayed
spliced.

When relay is not reading the client (the upstream's write buffer is full: a hung or slow
app), the client's departure is only noticed by ``check_peer`` (relay/departures.py), which
polls for POLLERR/POLLHUP only. A client that closes its socket normally sends a FIN, which
is POLLRDHUP: ignored. The splice then lives for as long as the upstream stays silent,
holding both sockets and counting as in flight for the sandbox (SPEC §5a max_connections),
although a client FIN on a splice that relay *is* reading ends it at once (eof_received).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import struct
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from relay import departures, timers
from relay.flow import PAUSE_UPSTREAM_FULL
from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream, until

if TYPE_CHECKING:
    from relay.server import ClientConnection

HS_RESP = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)


def masked_binary(payload: bytes) -> bytes:
    key = os.urandom(4)
    head = bytes([0x82, 0x80 | 126]) + struct.pack(">H", len(payload))
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def unsent(sock: socket.socket) -> int:  # bytes the kernel has not had acknowledged yet
    queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return queued


async def paused_websocket(
    relay_port: int, app_port: int, conn_of: Callable[[], ClientConnection]
) -> tuple[asyncio.StreamWriter, int]:
    """A WebSocket through relay, fed frames until relay stops reading it (its upstream full);
    the client's writer and the bytes it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
    writer.write(
        f"GET /ws HTTP/1.1\r\nHost: {app_port}-sbx.{DOMAIN}\r\nConnection: Upgrade\r\n"
        "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101")
    conn = conn_of()
    frame = masked_binary(b"z" * 65000)
    sent = 0
    for _ in range(2000):  # bounded: until relay stops reading the client
        writer.write(frame)
        sent += len(frame)
        await asyncio.sleep(0.002)
        if conn._paused & PAUSE_UPSTREAM_FULL:
            break
    assert conn._paused & PAUSE_UPSTREAM_FULL
    return writer, sent


async def test_client_fin_ends_a_splice_relay_is_not_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its frames left unread wait for an upstream that takes none for SPLICE_FIN_WAIT_S.
    monkeypatch.setattr(departures, "SPLICE_FIN_WAIT_S", 1.0)
    monkeypatch.setattr(timers, "PEER_CHECK_S", 0.25)  # (2 s by default)
    upstream_closed = asyncio.Event()

    async def hung_app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HS_RESP)
        transport = cast("asyncio.Transport", writer.transport)  # (uvloop's: no subclass)
        transport.pause_reading()  # never reads again, never writes
        try:
            for _ in range(300):  # bounded: 30 s
                await asyncio.sleep(0.1)
                if writer.transport.is_closing():
                    break
        finally:
            upstream_closed.set()
            writer.close()

    async with (
        scripted_upstream(hung_app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        writer, _ = await paused_websocket(
            relay.port, port, lambda: next(iter(relay.relay.connections))
        )
        sock = writer.get_extra_info("socket")
        # Everything the client sent reached relay's socket, so its FIN will too.
        await until(lambda: writer.transport.get_write_buffer_size() == 0 and unsent(sock) == 0)
        assert relay.relay.inflight.get("sbx") == 1
        (splice,) = relay.relay.live["sbx"]
        writer.close()  # the client leaves: a FIN, as any WebSocket client's close
        # relay checks a client it does not read every PEER_CHECK_S (0.25 s here): well within.
        await until(lambda: relay.relay.inflight.get("sbx", 0) == 0, within_s=8)
        assert splice.upstream.closed  # type: ignore[attr-defined]  # its upstream let go
        assert not relay.relay.connections


async def close_and_half_close(writer: asyncio.StreamWriter) -> int:
    """Three more frames, sitting unread in relay's socket, the client's Close frame, then its
    FIN once all of it reached relay's socket; the bytes sent."""
    frame = masked_binary(b"z" * 65000)
    data = frame * 3 + masked_close()
    writer.write(data)
    sock = writer.get_extra_info("socket")
    await until(lambda: writer.transport.get_write_buffer_size() == 0 and unsent(sock) == 0)
    writer.write_eof()  # the client's Close is sent: it half-closes
    return len(data)


def masked_close() -> bytes:
    key = os.urandom(4)
    payload = struct.pack(">H", 1000)
    return bytes([0x88, 0x80 | 2]) + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


@pytest.mark.parametrize("upstream", ["pauses-then-reads", "steady-and-slow"])
async def test_the_upstream_gets_everything_sent_before_the_client_fin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstream: str
) -> None:
    """Found by reviews of the fix above: the peer check cut the splice at the client's FIN
    while relay's socket still held frames sent before it, its Close frame among them; they are
    passed on while the upstream takes some (relay.departures.SPLICE_FIN_WAIT_S). Then: progress
    was measured by what relay read from the paused client, which cannot move, so a steady
    200 KB/s upstream was cut; now by what the upstream took, relay's buffer and the kernel's
    queue to it. There the wait is cut to 3 s and the peer check to 0.25 s: what the upstream
    took moves in bursts up to ~1.5 s apart at 200 KB/s, what relay read from the client not
    for ~4 s after the FIN (the kernel's send queue to the upstream, ~4 MB, wakes relay only
    when a good part of it drained; the old measure cut at ~3.5 s). The upstream reads at
    200 KB/s for two waits after the client's FIN, past that first stall, then the rest at
    once: reading all ~4.8 MB at 200 KB/s took ~25 s."""
    steady = upstream == "steady-and-slow"
    if steady:
        monkeypatch.setattr(departures, "SPLICE_FIN_WAIT_S", 3.0)
    # The first check comes one PEER_CHECK_S after relay stops reading the client.
    monkeypatch.setattr(timers, "PEER_CHECK_S", 0.25)
    received = bytearray()
    done = asyncio.Event()
    fin_sent = asyncio.Event()
    gaps: list[float] = []

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HS_RESP)
        if not steady:
            transport = cast("asyncio.Transport", writer.transport)
            transport.pause_reading()
            await asyncio.sleep(1.0)  # slower than PEER_CHECK_S for a while, then reads all
            transport.resume_reading()
        last = time.monotonic()
        slow_until = float("inf")
        try:
            for _ in range(4000):  # bounded; steady: a little every 50 ms, then the rest
                slow = steady and last < slow_until
                chunk = await asyncio.wait_for(reader.read(10000 if slow else 1 << 20), 8)
                if not chunk:
                    break
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                received.extend(chunk)
                if fin_sent.is_set() and slow_until == float("inf"):
                    slow_until = now + 2 * departures.SPLICE_FIN_WAIT_S
                if slow:
                    await asyncio.sleep(0.05)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            done.set()
            writer.close()

    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        writer, sent = await paused_websocket(
            relay.port, port, lambda: next(iter(relay.relay.connections))
        )
        sent += await close_and_half_close(writer)
        fin_sent.set()
        await asyncio.wait_for(done.wait(), 60)
        writer.close()
    if steady:
        assert max(gaps[1:], default=0) < 0.5  # the upstream took some at least every 0.5 s
    assert len(received) == sent, f"upstream got {len(received)} of {sent} bytes"
    assert received[-8] == 0x88  # its Close frame (2-byte head, 4-byte mask, 2-byte code) last
