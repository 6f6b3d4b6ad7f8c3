"""Large Content-Length responses passed on without llhttp (ResponseReader._pass_body), byte-exact.

Bodies that never repeat (a misplaced or overwritten read would show in the digest), written
by the upstream in pieces of assorted sizes, to fast and slow clients (a small receive window
keeps relay's writes queued in its transport), over plain TCP and TLS. Also: the upstream
connection is pooled and reused after such a body, bytes after the body make it unusable, and
an upstream or client that goes mid-body ends the exchange. Real sockets, a real relay
in-process, a scripted upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    route,
    running_relay,
    scripted_upstream,
    tls_listener,
)

SIZE = 6 * 1024 * 1024


def body(seed: bytes, size: int = SIZE) -> bytes:
    """Bytes that never repeat: a misplaced or overwritten read shows in the digest."""
    return hashlib.shake_256(seed).digest(size)


class Upstream:
    """Answers each request on a connection with the next body of ``bodies``, written in
    pieces of assorted sizes; counts connections and requests."""

    def __init__(self, bodies: list[bytes], *, after: bytes = b"", cut_at: int = 0) -> None:
        self.bodies = bodies
        self.after = after  # written with the body's last piece: bytes out of turn
        self.cut_at = cut_at  # close after this many body bytes, short of the length
        self.connections = 0
        self.requests = 0
        self.ended = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.requests < len(self.bodies):
                await reader.readuntil(b"\r\n\r\n")
                payload = self.bodies[self.requests]
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload))
                pos, step = 0, 1000
                end = self.cut_at or len(payload)
                while pos < end:
                    piece = payload[pos : min(end, pos + step)]
                    pos += len(piece)
                    writer.write(piece + (self.after if pos == len(payload) else b""))
                    await writer.drain()
                    step = step * 7 % 400_000 + 1  # 1 byte to ~400 KiB, the reads vary too
                if self.cut_at:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.ended.set()


@contextlib.asynccontextmanager
async def through_relay(
    tmp_path: Path, upstream: Upstream, *, tls: bool = False, small_window: bool = False
) -> AsyncIterator[tuple[RelayUnderTest, asyncio.StreamReader, asyncio.StreamWriter, str]]:
    """A relay in front of ``upstream``, and a client connected to it: (relay, its reader and
    writer, the Host to ask for). ``small_window``: the client's receive buffer fills at
    once, so relay's writes stay queued in its transport."""
    overrides, client_tls = tls_listener(tmp_path / "pki") if tls else (None, None)
    async with (
        scripted_upstream(upstream.serve) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)], overrides) as relay,
    ):
        host = f"{port}-sbx.{DOMAIN}"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if small_window:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", relay.port))
        reader, writer = await asyncio.open_connection(
            sock=sock, ssl=client_tls, server_hostname=host if client_tls is not None else None
        )
        try:
            yield relay, reader, writer, host
        finally:
            writer.close()


async def get(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, *, slow: bool
) -> bytes:
    writer.write(f"GET /files HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    out = bytearray()
    while len(out) < length:
        chunk = await asyncio.wait_for(reader.read(min(8192, length - len(out))), 10)
        if not chunk:
            break
        out += chunk
        if slow:
            await asyncio.sleep(0.0005)  # the client lags: relay's writes are only partly sent
    return bytes(out)


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("slow", [False, True])
async def test_large_bodies_arrive_exactly_and_the_connection_is_reused(
    tmp_path: Path, tls: bool, slow: bool
) -> None:
    bodies = [body(b"first"), body(b"second", SIZE + 12345)]
    upstream = Upstream(bodies)
    async with through_relay(tmp_path, upstream, tls=tls, small_window=slow) as (_, r, w, host):
        for expected in bodies:  # one client connection, one pooled upstream connection
            got = await get(r, w, host, slow=slow)
            assert len(got) == len(expected)
            assert hashlib.sha256(got).digest() == hashlib.sha256(expected).digest()
    assert upstream.connections == 1
    assert upstream.requests == 2


async def test_bytes_after_a_large_body_make_the_connection_unusable(tmp_path: Path) -> None:
    first, second = body(b"one"), body(b"two", 1000)
    upstream = Upstream([first, second], after=b"HTTP/1.1 200 OK\r\n\r\nout of turn")
    async with through_relay(tmp_path, upstream) as (_, reader, writer, host):
        assert await get(reader, writer, host, slow=False) == first
        # Not pooled: the second request goes out on a new upstream connection.
        upstream.requests = 1
        assert await get(reader, writer, host, slow=False) == second
    assert upstream.connections == 2


async def test_an_upstream_gone_mid_body_cuts_the_response(tmp_path: Path) -> None:
    upstream = Upstream([body(b"cut")], cut_at=3 * 1024 * 1024)
    async with through_relay(tmp_path, upstream) as (relay, reader, writer, host):
        got = await get(reader, writer, host, slow=False)
        assert got == body(b"cut")[: len(got)]
        assert len(got) == 3 * 1024 * 1024  # all that was sent, then the close
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.wait_for(upstream.ended.wait(), 5)
        assert relay.relay.pool.opened == 0


async def test_a_client_gone_mid_body_closes_the_upstream(tmp_path: Path) -> None:
    upstream = Upstream([body(b"gone", 64 * 1024 * 1024)])
    async with through_relay(tmp_path, upstream) as (relay, reader, writer, host):
        writer.write(f"GET /files HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(4 * 1024 * 1024)
        writer.transport.abort()
        await asyncio.wait_for(upstream.ended.wait(), 10)
        for _ in range(100):
            if not relay.relay.connections and relay.relay.pool.opened == 0:
                break
            await asyncio.sleep(0.05)
        assert not relay.relay.connections
        assert relay.relay.pool.opened == 0
