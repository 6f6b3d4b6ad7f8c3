"""One route update that revokes several sandboxes, and what a revocation counts (SPEC §3).

Ending a revoked exchange can start the next request queued on its client connection (a
Connect stream ends cleanly and keeps the connection); that request is decided under the new
table. Found by review: when the update revoked that request's sandbox too, it took an idle
pooled connection of the sandbox's *old* route, sent its head upstream, and was then revoked
itself, answered "The sandbox was not found". Real sockets, a real relay in-process.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

from relay.drain import drain
from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    route,
    running_relay,
    scripted_upstream,
    until,
)


class Upstream:
    """``/connect``: a Connect stream of slow events; ``/ka``: a keep-alive 200 ``ok``;
    ``/hang``: no answer."""

    def __init__(self) -> None:
        self.connections = 0
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                if head.startswith(b"GET /ka "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    continue
                if head.startswith(b"GET /hang "):
                    await asyncio.wait_for(reader.read(), 10)  # no answer: until relay closes
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for i in range(200):  # bounded: 10 s at most
                    event = json.dumps({"i": i}).encode()
                    frame = b"\0" + struct.pack(">I", len(event)) + event
                    writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                    await writer.drain()
                    await asyncio.sleep(0.05)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def request(path: str, port: int, sandbox: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {port}-{sandbox}.{DOMAIN}\r\n\r\n".encode()


async def read_until_idle(reader: asyncio.StreamReader, quiet_s: float = 0.5) -> bytes:
    out = b""
    for _ in range(200):  # bounded
        try:
            data = await asyncio.wait_for(reader.read(65536), quiet_s)
        except TimeoutError:
            return out
        if not data:
            return out
        out += data
    return out


async def prime_pool(relay: RelayUnderTest, port: int, sandbox: str, count: int) -> None:
    """``count`` idle pooled upstream connections of ``sandbox``'s current route."""
    clients = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(count)]
    for _, writer in clients:
        writer.write(request("/ka", port, sandbox))
    for reader, writer in clients:
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_request_started_by_a_revocation_runs_under_the_new_route(
    tmp_path: Path,
) -> None:
    upstream = Upstream()
    old = [route("aaa", insecure=True), route("bbb", insecure=True)]
    new = [route("aaa", envd_token="e1"), route("bbb", envd_token="e2")]  # both revoked
    async with scripted_upstream(upstream.serve) as port, running_relay(tmp_path, old) as relay:
        for sandbox in ("aaa", "bbb"):
            await prime_pool(relay, port, sandbox, 2)
        assert relay.relay.pool.opened == 4
        # Both orders, so that whichever sandbox the revocation takes first, one client's
        # queued request starts while the other sandbox is still to be revoked.
        clients = []
        for first, second in (("aaa", "bbb"), ("bbb", "aaa")):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(request("/connect", port, first) + request("/ka", port, second))
            clients.append((reader, writer))
        await until(lambda: sum(h.startswith(b"GET /connect") for h in upstream.heads) == 2)
        opened_before = upstream.connections
        relay.set_routes(new)
        for reader, writer in clients:
            answer = await read_until_idle(reader)
            writer.close()
            stream, _, queued = answer.partition(b"0\r\n\r\n")
            assert b'"code":"unavailable"' in stream  # the stream's clean end (SPEC §3)
            assert queued.startswith(b"HTTP/1.1 200 OK"), queued
            assert queued.endswith(b"ok"), queued
        # The two queued requests went out on new upstream connections: none of the old
        # routes' idle ones was reused, and the pool kept none of them.
        assert upstream.connections == opened_before + 2
        assert relay.relay.observer.revoked_exchanges == 2  # the streams, not the new requests


async def test_an_exchange_already_answered_is_not_revoked_again(tmp_path: Path) -> None:
    """An exchange relay answered itself (here 502, a closed port) while it reads and drops the
    rest of the request body is no longer in flight (max_connections); a revocation then ends
    nothing and counts nothing (found by review: it was counted, and its access-log reason
    became "revoked")."""
    closed = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    async with running_relay(tmp_path, [route("sbx", insecure=True)]) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        host = f"{port}-sbx.{DOMAIN}"
        writer.write(f"POST /up HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.readuntil(b"}"), 10)
        assert answer.startswith(b"HTTP/1.1 502"), answer
        assert relay.relay.inflight.get("sbx") == 0  # reading the body it drops: not in flight
        relay.set_routes([route("sbx", envd_token="rotated")])
        assert relay.relay.observer.revoked_exchanges == 0
        writer.write(b"x" * 100)
        await writer.drain()
        writer.close()


async def test_a_request_waiting_for_its_answer_learns_why(tmp_path: Path) -> None:
    """A removed route: "The sandbox was not found" (as E2B's proxy says for a dead sandbox).
    A changed one: another 502 text, as the sandbox still runs; E2B's SDKs 2.63+ read "was
    not found" as SandboxNotRunningException and any other 502 as unreachable."""
    upstream = Upstream()
    old = [route("moved", insecure=True), route("gone", insecure=True)]
    async with scripted_upstream(upstream.serve) as port, running_relay(tmp_path, old) as relay:
        clients = {}
        for sandbox in ("moved", "gone"):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(request("/hang", port, sandbox))
            clients[sandbox] = (reader, writer)
        await until(lambda: sum(h.startswith(b"GET /hang") for h in upstream.heads) == 2)
        relay.set_routes([route("moved", envd_token="rotated")])
        answers = {}
        for sandbox, (reader, writer) in clients.items():
            answer = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 502 "), answer
            answers[sandbox] = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert answers["gone"] == {
            "code": 502,
            "message": "The sandbox was not found",
            "sandboxId": "gone",
        }
        assert answers["moved"]["code"] == 502
        assert answers["moved"]["sandboxId"] == "moved"
        assert "was not found" not in answers["moved"]["message"]
        assert "port is not open" not in answers["moved"]["message"]


async def test_drain_and_stop_answer_alike_and_count_what_they_end(tmp_path: Path) -> None:
    """Found by review: relay's stop answered 503 without the Retry-After that a drain's
    answer has, a drain's answer had no sandboxId, and a drain counted (and relabelled) an
    exchange relay had already answered. Both now end things through ``revoke``."""
    upstream = Upstream()
    closed = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    closed_port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    async with (
        scripted_upstream(upstream.serve) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        waiting = await asyncio.open_connection("127.0.0.1", relay.port)
        waiting[1].write(request("/hang", port, "sbx"))
        answered = await asyncio.open_connection("127.0.0.1", relay.port)
        host = f"{closed_port}-sbx.{DOMAIN}"
        answered[1].write(
            f"POST /up HTTP/1.1\r\nHost: {host}\r\nContent-Length: 9\r\n\r\n".encode()
        )
        assert (await asyncio.wait_for(answered[0].readuntil(b"}"), 10)).startswith(b"HTTP/1.1 502")
        await until(lambda: any(h.startswith(b"GET /hang") for h in upstream.heads))
        assert await drain(relay.relay, 0) == 1  # the waiting request; not the answered one
        answer = await asyncio.wait_for(waiting[0].readuntil(b"}"), 5)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert b"\r\nRetry-After: 1" in head
        assert json.loads(body) == {
            "code": 503,
            "message": "relay is shutting down",
            "sandboxId": "sbx",
        }
        for _, writer in (waiting, answered):
            writer.close()
