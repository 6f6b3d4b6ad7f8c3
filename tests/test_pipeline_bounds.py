"""Found by review: what relay holds for a client that pipelines requests and does not read
(or whose upstream is slow) is bounded by a slice, not by everything one read brought.

relay stops reading such a client (PAUSE_QUEUE, PAUSE_CLIENT_FULL), but a read of 128-256
KiB of pipelined heads was still parsed to its end, a slice per turn (relay.slices): ~2,800
queued exchanges (~2.5 MB of Python objects) behind a slow upstream, or ~1.5 MB of relay's
own answers (5 times the requests' bytes) in the write buffer of a client that does not read,
per connection, for a few hundred KiB sent. The rest of the read now waits, unparsed, until
the queue drains or the client reads. Real sockets, a real relay in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream, until

REQUESTS = 6000  # 45-byte heads: ~264 KiB, more than one read


async def test_refused_pipelined_requests_to_a_client_that_does_not_read_stay_bounded(
    tmp_path: Path,
) -> None:
    async with running_relay(tmp_path, [route("sbx", insecure=True)]) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port, limit=1 << 16)
        request = f"GET /p HTTP/1.1\r\nHost: 9-nosuch.{DOMAIN}\r\n\r\n".encode()
        writer.write(request * REQUESTS)
        await until(lambda: len(relay.relay.connections) == 1)
        (conn,) = relay.relay.connections
        most = 0
        for step in range(100):  # bounded: 1 s, ~1 MiB sent
            if step % 25 == 0 and step:
                writer.write(request * REQUESTS)  # the client sends on, unread answers or not
            await asyncio.sleep(0.01)
            if conn.transport is not None:
                most = max(most, conn.transport.get_write_buffer_size())
        # A few high-water marks (64 KiB) and one slice's answers, not a whole read's. (An
        # unread client left open would hold relay's stop: aborted on failure.)
        if most >= 512 * 1024:
            writer.transport.abort()
        assert most < 512 * 1024, most
        # Everything is answered, in order, once the client reads.
        got = 0
        async with asyncio.timeout(30):
            while got < 4 * REQUESTS:
                await reader.readuntil(b"\r\n\r\n")
                got += 1
                await reader.readuntil(b"}")  # relay's JSON body
        assert got == 4 * REQUESTS
        writer.close()


async def test_pipelined_requests_behind_a_slow_upstream_queue_a_bounded_number(
    tmp_path: Path,
) -> None:
    release = asyncio.Event()
    answered = 0

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                answered += 1
        writer.close()

    async with (
        scripted_upstream(slow) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port, limit=1 << 16)
        request = f"GET /p HTTP/1.1\r\nHost: {port}-sbx.{DOMAIN}\r\n\r\n".encode()
        count = 3000
        writer.write(request * count)
        await until(lambda: len(relay.relay.connections) == 1)
        (conn,) = relay.relay.connections
        most = 0
        for _ in range(100):  # bounded: 1 s
            await asyncio.sleep(0.01)
            most = max(most, len(conn.queue))
        if most >= 1000:
            writer.transport.abort()
        assert most < 1000, most  # a slice's worth (32 KiB of heads), not a read's
        release.set()
        got = 0
        async with asyncio.timeout(60):
            while got < count:
                await reader.readuntil(b"\r\n\r\nok")
                got += 1
        assert got == count
        writer.close()
