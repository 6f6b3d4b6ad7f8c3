"""TLS admission and timeouts (SPEC §5a, §5), found by review: the first head's wait runs from
accept, not from the end of the handshake; a refusal of a whole bodiless request closes at once."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path

from tests.support.certs import issue
from tests.support.harness import DOMAIN, route, running_relay, until


def _noverify() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _tls(tmp_path: Path, **listen: object) -> dict[str, dict[str, object]]:
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    return {"listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file), **listen}}


async def test_tls_header_timeout_runs_from_accept(tmp_path: Path) -> None:
    """SPEC §5a: "header_timeout_s runs from accept for a connection's first request".
    On the TLS listener the head's timer starts only at the end of the handshake, so a
    client that takes (almost) header_timeout_s for its handshake gets a second
    header_timeout_s for its head: a slowloris holds its slot twice as long."""
    async with running_relay(tmp_path, [], _tls(tmp_path, header_timeout_s=1)) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        accepted = time.monotonic()
        await asyncio.sleep(0.8)  # a slow handshake, within the handshake's own timeout
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(
            sock=sock, ssl=_noverify(), server_hostname=f"49983-x.{DOMAIN}"
        )
        writer.write(b"GET / HTTP/1.1\r\nHost: 49983-x.")  # a partial head, then silence
        try:
            data = await asyncio.wait_for(reader.read(4096), 5)
        except ConnectionResetError:
            data = b""
        elapsed = time.monotonic() - accepted
        writer.close()
        assert data.startswith(b"HTTP/1.1 408")
        # 1 s from accept, plus the sweep's 0.25 s and slack; the code answers at ~2 s.
        assert elapsed < 1.6, f"408 came {elapsed:.2f} s after accept (header_timeout_s=1)"


async def test_tls_overload_503_closes_promptly(tmp_path: Path) -> None:
    """SPEC §5a: past listen.max_connections relay "answers 503 with Retry-After and closes".
    Over TLS, for a complete GET (no body), relay neither closes nor sends close_notify: the
    connection lingers for CLOSE_GRACE_S (5 s) and keeps its slot in Relay.connections, so
    under overload every refused TLS client that waits for the close holds a slot 5 s."""
    overrides = _tls(tmp_path, max_connections=1)
    async with running_relay(tmp_path, [route("sbx", insecure=True)], overrides) as relay:
        host = f"1-sbx.{DOMAIN}"
        _, held = await asyncio.open_connection(
            "127.0.0.1", relay.port, ssl=_noverify(), server_hostname=host
        )
        try:
            await until(lambda: len(relay.relay.connections) == 1)
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", relay.port, ssl=_noverify(), server_hostname=host
            )
            writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 503")
            assert b"Retry-After: 1" in head
            started = time.monotonic()
            # The client keeps reading (as a client waiting for "Connection: close" does).
            try:
                while await asyncio.wait_for(reader.read(65536), 10):
                    pass
            except (ConnectionResetError, ssl.SSLError):
                pass
            closed_after = time.monotonic() - started
            writer.close()
            assert closed_after < 2.0, f"relay closed {closed_after:.2f} s after its 503"
        finally:
            held.close()
        await until(lambda: not relay.relay.connections)
