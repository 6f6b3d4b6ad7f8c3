"""The in-process harness of ``bench.micro``: a relay with the bench routes and one pooled
upstream connection per destination, all on fake transports, and the loop that drives
keep-alive requests through it with no sockets and no event loop.

A real ``ClientConnection`` gets a request through ``data_received``; the exchange finds a
pooled ``UpstreamConnection`` and writes the request head to it; the driver then feeds the
upstream's response into ``data_received`` and checks that the client transport got the
response. Tied to relay's internal classes: adjust it when they change.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

ENVD_TOKEN = "bench-envd-token-0123456789abcdef"


def _signed_files_request() -> bytes:
    """``GET /files`` with a v1 signature made as the SDK makes it (no expiration)."""
    # relay.core.auth is pure (no logging, no stdout): importing it early changes nothing of
    # what the child measures (see bench.micro.serve_rounds).
    from relay.core.auth import file_signature

    signature = file_signature("/home/user/data.txt", "read", "user", ENVD_TOKEN, None)
    target = f"/files?path={quote('/home/user/data.txt', safe='')}&username=user"
    target += f"&signature={quote(signature, safe='')}"
    return (
        f"GET {target} HTTP/1.1\r\nHost: 49983-benchenvd.sandbox.localhost\r\n"
        "User-Agent: wrk\r\nAccept: */*\r\n\r\n"
    ).encode()


REQUEST = (
    b"GET /small HTTP/1.1\r\nHost: 18081-bench.sandbox.localhost\r\n"
    b"User-Agent: wrk\r\nAccept: */*\r\n\r\n"
)
TOKEN_REQUEST = (
    b"GET /small HTTP/1.1\r\nHost: 49983-benchenvd.sandbox.localhost\r\n"
    b"X-Access-Token: " + ENVD_TOKEN.encode() + b"\r\n\r\n"
)
SIGNED_REQUEST = _signed_files_request()
STREAM_PORT = 18082  # a Connect stream's upstream (--cold-ms, bench.micro_cold)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 30 Nov 2026 01:00:00 GMT\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 13\r\nConnection: keep-alive\r\n\r\n"
    b"hello, world\n"
)


class FakeSocketTransport:
    """Enough of a uvloop transport for relay's protocols; records what is written."""

    def __init__(self, peer: tuple[str, int]) -> None:
        self.peer = peer
        self.written: list[bytes] = []
        self.closing = False
        self.written_at = 0  # perf_counter_ns() of the last write (--cold-ms)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.written_at = time.perf_counter_ns()
        self.written.append(bytes(data))

    def writelines(self, parts: list[bytes]) -> None:
        self.written_at = time.perf_counter_ns()
        self.written.append(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0  # every write went out

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, *args: Any, **kwargs: Any) -> None:
        pass


def build(access_log: bool) -> Any:
    """A relay with the bench routes and one pooled upstream connection per destination."""
    # The access log exactly as `relay serve` sets it up (relay.__main__), its stdout being
    # /dev/null here; the child answers its parent on a copy of the real stdout.
    from relay import __main__ as cli
    from relay.config_parse import parse
    from relay.core.routes import parse_routes
    from relay.runtime import Relay
    from relay.upstream_conn import UpstreamConnection
    from relay.upstreams import PoolKey

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    cli._setup_logging("INFO" if access_log else "WARNING")

    base = Path(tempfile.mkdtemp(prefix="relay-micro-"))
    (base / "routes.json").write_text('{"routes": []}')
    config = parse(
        {"routing": {"domains": ["sandbox.localhost"]}, "routes": {"file": "routes.json"}},
        base,
    )
    relay = Relay(config)
    outbox = getattr(relay, "outbox", None)  # absent from trees before relay.outbox
    if outbox is not None:
        # No loop here: the drive ends each turn itself (relay.outbox.Outbox.end_turn).
        outbox.bind(lambda callback: None)
    token = ENVD_TOKEN
    routes, errors = parse_routes(
        [
            {"sandbox_id": "bench", "address": "127.0.0.1", "envd_token": token},
            {"sandbox_id": "benchenvd", "address": "127.0.0.2", "envd_token": token},
        ],
        relay.allowed_cidrs,
    )
    assert not errors, errors
    relay.install_routes(routes, "micro")
    upstreams = {}
    for sandbox, address, port in (
        ("bench", "127.0.0.1", 18081),
        ("benchenvd", "127.0.0.2", 49983),
        ("bench", "127.0.0.1", STREAM_PORT),  # --cold-ms: a Connect stream's upstream
    ):
        key = PoolKey(sandbox, 0, address, port)
        conn = UpstreamConnection(relay.pool, key)
        transport = FakeSocketTransport((address, port))
        conn.connection_made(transport)  # type: ignore[arg-type]
        relay.pool.release(conn)
        upstreams[port] = (conn, transport)
    return relay, upstreams


def turn_end_for(relay: Any) -> Any:
    """What ends one turn of the (absent) event loop for ``relay``'s outbox."""
    outbox = getattr(relay, "outbox", None)
    return outbox.end_turn if outbox is not None else lambda: None


def drive(relay: Any, upstreams: Any, request: bytes, port: int, n: int) -> float:
    """``n`` keep-alive requests on one client connection; CPU seconds per request."""
    from relay.server import ClientConnection

    client = ClientConnection(relay, tls=False)
    client_transport = FakeSocketTransport(("127.0.0.1", 40000))
    client.connection_made(client_transport)  # type: ignore[arg-type]
    conn, upstream_transport = upstreams[port]
    turn_end = turn_end_for(relay)
    start = time.process_time()
    for _ in range(n):
        client.data_received(request)
        turn_end()
        if not upstream_transport.written:
            raise RuntimeError(f"relay did not forward: {client_transport.written[-1:]}")
        upstream_transport.written.clear()
        conn.data_received(RESPONSE)
        turn_end()
        if not client_transport.written:
            raise RuntimeError("relay did not answer the client")
        client_transport.written.clear()
    elapsed = time.process_time() - start
    client.connection_lost(None)
    return elapsed / n


WORKLOADS = (
    ("small GET", REQUEST, 18081),
    ("envd X-Access-Token", TOKEN_REQUEST, 49983),
    ("signed /files URL", SIGNED_REQUEST, 49983),
)
