"""A client relay has stopped reading is still noticed when it resets (ClientConnection.check_peer).

While the upstream takes no more of a request body, relay pauses reading the client, and the
event loop then does not watch that socket: without a check, a client that gave up and reset
would hold both connections for as long as the upstream stalls (SPEC §4 sets no read timeout
on an exchange). Real sockets, a real relay in-process, an upstream that never reads its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from pathlib import Path
from typing import cast

import pytest

from relay import timers, upstreams
from tests.support.harness import DOMAIN, route, running_relay, tls_listener, until

CHECK_S = 0.2  # PEER_CHECK_S for these tests; relay sweeps every 0.25 s
# The upstream close's grace (CLOSE_GRACE_S, 5 s) for these tests: an upstream that reads
# nothing is aborted after it all the same, sooner.
GRACE_S = 1.0


def _upload_until_held_back(port: int, host: str, tls: ssl.SSLContext | None) -> socket.socket:
    """A 1 GiB upload sent until relay stops reading it (the send buffer stays full)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    sock.sendall(f"PUT /up HTTP/1.1\r\nHost: {host}\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
    sock.settimeout(0.5)
    block = b"u" * 65536
    with contextlib.suppress(TimeoutError):
        for _ in range(1 << 14):  # bounded: 1 GiB
            sock.sendall(block)
    return sock


@pytest.mark.parametrize(("ending", "tls"), [("reset", False), ("reset", True), ("fin", False)])
async def test_a_client_that_resets_while_held_back_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str, tls: bool
) -> None:
    monkeypatch.setattr(timers, "PEER_CHECK_S", CHECK_S)
    monkeypatch.setattr(upstreams, "CLOSE_GRACE_S", GRACE_S)
    release = asyncio.Event()
    upstream_ended = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        transport = cast("asyncio.Transport", writer.transport)
        transport.pause_reading()  # the sandbox's app stalls: its buffers fill
        await release.wait()
        transport.resume_reading()
        with contextlib.suppress(ConnectionError):
            while await reader.read(1 << 20):
                pass
        upstream_ended.set()
        writer.close()

    upstream = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    sock: socket.socket | None = None
    overrides, client_tls = tls_listener(tmp_path / "pki") if tls else (None, None)
    try:
        async with running_relay(tmp_path, [route("sbx", insecure=True)], overrides) as relay:
            host = f"{port}-sbx.{DOMAIN}"
            sock = await asyncio.to_thread(_upload_until_held_back, relay.port, host, client_tls)
            await until(lambda: len(relay.relay.connections) == 1)
            (conn,) = relay.relay.connections
            await until(lambda: bool(conn._paused))  # relay stopped reading the upload
            await asyncio.sleep(5 * CHECK_S)  # checked several times: alive, so kept
            assert len(relay.relay.connections) == 1
            assert relay.relay.pool.opened == 1
            if ending == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                sock = None
                await until(lambda: not relay.relay.connections)
                # The exchange ended mid-request: its upstream connection is closed, not
                # pooled; the close is aborted after its grace (the upstream reads nothing).
                await until(lambda: relay.relay.pool.opened == 0, within_s=GRACE_S + 5)
            else:
                # A FIN is not a departure: the client may still read the answer.
                sock.shutdown(socket.SHUT_WR)
                await asyncio.sleep(5 * CHECK_S)
                assert len(relay.relay.connections) == 1
            release.set()
            await asyncio.wait_for(upstream_ended.wait(), 5)
    finally:
        release.set()
        if sock is not None:
            sock.close()
        upstream.close()
