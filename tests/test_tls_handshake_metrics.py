"""relay_tls_handshake_failures_total{reason} (relay.handshake): a TLS listener's failed
handshakes, which left no trace an operator could see (a broken chain, clients with old TLS
versions, scanners), each counted once by why it ended. Real TLS on loopback, read from the
admin port's /metrics as Prometheus would."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import time
import warnings
from pathlib import Path

from relay.handshake import failure_reason
from relay.metric_snapshot import snapshot
from relay.metrics import families, read_snapshots, retire, write_snapshot
from tests.support.certs import client_hello, issue
from tests.support.harness import DOMAIN, RelayUnderTest, running_relay, until
from tests.support.ops import get, samples

FAMILY = "relay_tls_handshake_failures_total"
HOST = f"49983-sbx.{DOMAIN}"


def _tls(tmp_path: Path, **listen: object) -> dict[str, dict[str, object]]:
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    return {"listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file), **listen}}


def _noverify(**versions: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if versions:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 leaves TLS < 1.2 out above level 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # as old clients are
            ctx.minimum_version = versions["minimum"]
            ctx.maximum_version = versions["maximum"]
    return ctx


def _hello_of(ctx: ssl.SSLContext) -> bytes:
    return client_hello(ctx, HOST)


def _send_and_read(port: int, data: bytes, *, linger_reset: bool = False) -> bytes:
    """Send ``data`` on a raw TCP connection (if empty: only a FIN), then read to the close;
    with ``linger_reset``, close at once with a reset (SO_LINGER 0) instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if data:
            sock.sendall(data)
        else:
            sock.shutdown(socket.SHUT_WR)
        if linger_reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
        return got


async def _failures(relay: RelayUnderTest) -> dict[str, float]:
    """The family's samples by reason, once no handshake is left in flight."""
    await until(lambda: not relay.relay.handshakes)
    assert relay.relay.admin_bound is not None
    status, body = await get(relay.relay.admin_bound[1], "/metrics")
    assert status == 200
    text = body.decode()
    assert f"# TYPE {FAMILY} counter" in text
    return {
        dict(labels)["reason"]: v for (name, labels), v in samples(text).items() if name == FAMILY
    }


async def test_a_client_offering_only_tls_1_0_counts_as_protocol(tmp_path: Path) -> None:
    """Refused by relay's TLS 1.2 minimum (relay.tls): an OpenSSL error, "protocol"."""
    old = _noverify(minimum=ssl.TLSVersion.TLSv1, maximum=ssl.TLSVersion.TLSv1)
    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        got = await asyncio.to_thread(_send_and_read, relay.port, _hello_of(old))
        assert got[:1] == b"\x15"  # the alert (relay.tls.AlertingObject)
        assert await _failures(relay) == {"protocol": 1}


async def test_garbage_counts_as_protocol(tmp_path: Path) -> None:
    """A scanner's bytes that are neither TLS nor an HTTP request line."""
    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        await asyncio.to_thread(_send_and_read, relay.port, b"\x00\x01\x02\x03 binary")
        assert await _failures(relay) == {"protocol": 1}


async def test_a_client_that_connects_and_closes_counts_as_closed(tmp_path: Path) -> None:
    """A port check (connect, FIN), a client that leaves mid-ClientHello, one that resets."""
    hello = _hello_of(_noverify())
    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        await asyncio.to_thread(_send_and_read, relay.port, b"")  # the FIN relay reads to
        assert await _failures(relay) == {"closed": 1}
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
            sock.sendall(hello[:20])  # a partial record, then the client's FIN
        assert await _failures(relay) == {"closed": 2}
        await asyncio.to_thread(_send_and_read, relay.port, hello[:20], linger_reset=True)
        assert await _failures(relay) == {"closed": 3}


async def test_a_silent_client_counts_as_timeout_at_the_header_timeout(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [], _tls(tmp_path, header_timeout_s=0.5)) as relay:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
            started = time.monotonic()
            await until(lambda: bool(relay.relay.handshakes))
            assert await _failures(relay) == {"timeout": 1}
            elapsed = time.monotonic() - started
            assert sock.recv(1) == b""  # relay closed it
    assert 0.4 < elapsed < 1.5, f"{elapsed:.2f} s (header_timeout_s=0.5)"


async def test_a_successful_handshake_and_plain_http_count_nothing(tmp_path: Path) -> None:
    """A handshake that succeeds (the client then leaves without a request, or after one)
    is no failure; the plain-HTTP 400 counts as relay_refusals_total{reason="plain_http"}
    alone, not twice; neither does a connection relay stops."""
    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        for send in (b"", f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", relay.port, ssl=_noverify(), server_hostname=HOST
            )
            if send:
                writer.write(send)
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 ")
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
        request = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        got = await asyncio.to_thread(_send_and_read, relay.port, request)
        assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert relay.relay.observer.refusals["plain_http"] == 1
        assert await _failures(relay) == {}
        held = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
        await until(lambda: bool(relay.relay.handshakes))
    with held:
        assert held.recv(1) == b""
    assert relay.relay.observer.tls_handshake_failures == {}  # stopping is no failure


async def test_workers_failures_add_up_in_the_supervisors_merge(tmp_path: Path) -> None:
    """With process.workers > 1 the supervisor sums the workers' snapshot files and folds a
    dead worker's into retired.json (relay.metrics): the family goes through both."""
    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        await asyncio.to_thread(_send_and_read, relay.port, b"")
        await _failures(relay)
        snap = snapshot(relay.relay)
    directory = tmp_path / "metrics"
    directory.mkdir()
    for pid in (111, 222):
        write_snapshot(directory, {**snap, "pid": pid})
    retire(directory, 111)
    merged = {m.name: m for m in families(list(read_snapshots(directory).values()), [])}
    (sample,) = merged[FAMILY.removesuffix("_total")].samples
    assert sample.labels == {"reason": "closed"}
    assert sample.value == 2


async def test_a_client_that_rejects_the_certificate_counts_as_protocol(tmp_path: Path) -> None:
    """A chain the client cannot verify (here: an issuer it does not trust; in production a
    missing intermediate or an expired certificate): its alert (RFC 8446 §6.2, unknown_ca)
    fails relay's handshake, which an operator now sees."""
    other_ca = issue(tmp_path / "other-pki", [f"*.{DOMAIN}"]).ca_file
    trusting_another = ssl.create_default_context(cafile=str(other_ca))  # only that CA

    def connect(port: int) -> None:
        # A blocking socket, as curl's or a browser's: it sends its alert (asyncio's and
        # uvloop's client side drop it, as their server side did: relay.tls.AlertingObject).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            try:
                trusting_another.wrap_socket(sock, server_hostname=HOST).close()
            except ssl.SSLCertVerificationError:
                return
            raise AssertionError("the client accepted a chain it cannot verify")

    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        await asyncio.to_thread(connect, relay.port)
        assert await _failures(relay) == {"protocol": 1}


async def test_a_client_that_leaves_right_after_a_finished_handshake_counts_nothing(
    tmp_path: Path,
) -> None:
    """Its Finished and its FIN sent at once: the handshake did not fail, and the connection
    is handed over before its FIN is read (the FIN is the connection's, not counted here)."""

    def finish_and_leave(port: int) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = _noverify().wrap_bio(incoming, outgoing, server_hostname=HOST)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    sock.sendall(outgoing.read())
                    incoming.write(sock.recv(65536))
            sock.sendall(outgoing.read())  # the client's Finished
            sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):
                    pass

    async with running_relay(tmp_path, [], _tls(tmp_path)) as relay:
        for _ in range(3):
            await asyncio.to_thread(finish_and_leave, relay.port)
        assert await _failures(relay) == {}


def test_every_end_of_start_tls_maps_to_the_closed_set() -> None:
    """The cases the loopback tests cannot make (an SSLEOFError, relay's own failure)."""
    ends: list[tuple[BaseException | None, str]] = [
        (None, "closed"),
        (ConnectionResetError(), "closed"),
        (BrokenPipeError(), "closed"),
        (ssl.SSLEOFError(), "closed"),
        (ssl.SSLError(1, "[SSL: UNSUPPORTED_PROTOCOL] unsupported protocol"), "protocol"),
        (ConnectionAbortedError("SSL handshake is taking longer than 5 seconds"), "timeout"),
        (StopIteration(), "error"),
        (RuntimeError(), "error"),
    ]
    assert [failure_reason(exc) for exc, _ in ends] == [reason for _, reason in ends]


async def _resets(relay: RelayUnderTest) -> dict[str, float]:
    assert relay.relay.admin_bound is not None
    status, body = await get(relay.relay.admin_bound[1], "/metrics")
    assert status == 200
    name = "relay_connections_reset_total"
    return {
        dict(labels)["reason"]: v for (n, labels), v in samples(body.decode()).items() if n == name
    }


async def test_resets_at_accept_count_as_connection_resets_not_handshake_failures(
    tmp_path: Path,
) -> None:
    """A TLS listener resets a peer outside allowed_clients, and a connection past
    max_connections handshakes in flight, before any TLS: relay_connections_reset_total
    (not_allowed, handshakes_full), not a handshake failure. Neither left a trace before."""
    overrides = _tls(tmp_path, max_connections=1)
    async with running_relay(tmp_path, [], overrides) as relay:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5):
            await until(lambda: len(relay.relay.handshakes) == 1)  # holds the one slot
            got = await asyncio.to_thread(_send_and_read, relay.port, b"")
            assert got == b""
            assert await _resets(relay) == {"handshakes_full": 1.0}
    overrides = _tls(tmp_path, allowed_clients=["10.0.0.0/8"])
    async with running_relay(tmp_path, [], overrides) as relay:
        await asyncio.to_thread(_send_and_read, relay.port, b"")
        await until(lambda: bool(relay.relay.observer.connections_reset))
        assert await _resets(relay) == {"not_allowed": 1.0}
        assert await _failures(relay) == {}
