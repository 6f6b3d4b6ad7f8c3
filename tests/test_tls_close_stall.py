"""Found by review: a closed connection's last answer waits for a reader that pauses up to
CLOSE_STALL_S (60 s) without progress. Over TLS, progress was measured by the TLS transport's
buffer alone, which leaves out what the kernel still queues: a TLS reader pausing 8 s was cut
off at CLOSE_GRACE_S (an abort, whose reset lost the tail) where plain TCP keeps it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay import timers
from tests.support.harness import DOMAIN, route, running_relay, scripted_upstream, tls_listener

BODY = 3_000_000
# CLOSE_GRACE_S (5 s) for this test: a pause longer than it (3 s) is cut off where the fix is
# missing, as an 8 s pause was at 5 s; a pause shorter than it (1 s) always passed.
GRACE_S = 2.0


@pytest.mark.parametrize("pause_s", [1.0, 3.0])
async def test_a_pausing_reader_of_a_closed_connection_gets_the_whole_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pause_s: float
) -> None:
    monkeypatch.setattr(timers, "CLOSE_GRACE_S", GRACE_S)
    tls = True

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BODY + b"x" * BODY)
        await writer.drain()
        writer.close()

    overrides, ctx = tls_listener(tmp_path) if tls else ({}, None)
    async with (
        scripted_upstream(app) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)], overrides) as relay,
    ):
        host = f"{port}-sbx.{DOMAIN}"
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", relay.port, ssl=ctx, server_hostname=host if tls else None, limit=4096
        )
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        got = len(await reader.readexactly(4096))
        closing = False
        for _ in range(int(pause_s * 10)):  # the reader pauses; relay ends the exchange, closes
            await asyncio.sleep(0.1)
            closing = closing or any(c.closing for c in relay.relay.connections)
        try:
            while True:
                chunk = await asyncio.wait_for(reader.read(1 << 16), 10)
                if not chunk:
                    break
                got += len(chunk)
        except (ConnectionError, OSError):
            pass
        writer.close()
    assert closing, "relay never closed: the test did not reach the case"
    assert got == BODY, f"{'TLS' if tls else 'TCP'} reader got {got} of {BODY}"
