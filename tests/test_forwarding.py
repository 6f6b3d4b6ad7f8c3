"""relay between real sockets: an HTTP client, relay, and an aiohttp upstream on loopback.

Every test asserts on what reached the upstream as well as on what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import gc
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.forward import Exchange
from tests.support.harness import DOMAIN, RelayUnderTest, route, running_relay, scripted_upstream
from tests.support.ports import free_port
from tests.support.rawhttp import Connection, Response, request, request_bytes


@dataclass
class Seen:
    method: str
    path_qs: str
    headers: list[tuple[str, str]]
    body: bytes
    peer_port: int


@dataclass
class Upstream:
    server: TestServer
    seen: list[Seen] = field(default_factory=list)

    @property
    def port(self) -> int:
        port = self.server.port
        assert port is not None
        return port


async def _record(request: web.Request, upstream: Upstream) -> Seen:
    body = await request.read()
    peer = request.transport.get_extra_info("peername") if request.transport else ("", 0)
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers]
    seen = Seen(request.method, request.path_qs, headers, body, peer[1])
    upstream.seen.append(seen)
    return seen


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    holder: list[Upstream] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        seen = await _record(request, holder[0])
        if request.path == "/status/204":
            return web.Response(status=204)
        if request.path == "/stream":
            response = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await response.prepare(request)
            for i in range(int(request.query.get("n", "5"))):
                await response.write(f"event {i}\n".encode())
                await asyncio.sleep(float(request.query.get("interval", "0.05")))
            await response.write_eof()
            return response
        return web.json_response(
            {"method": seen.method, "path": seen.path_qs, "body": seen.body.decode("latin-1")},
            headers={"X-Upstream": "yes", "Connection": "keep-alive"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    holder.append(Upstream(server))
    yield holder[0]
    await server.close()


def app_host(port: int, sandbox: str = "sbx1") -> str:
    return f"{port}-{sandbox}.{DOMAIN}"


@pytest.fixture(params=[False, True], ids=["writes", "held"])
async def relay(
    tmp_path: Path, upstream: Upstream, request: pytest.FixtureRequest
) -> AsyncIterator[RelayUnderTest]:
    """Each test twice: small writes sent at once (a quiet relay) and every one held to the
    end of the loop's turn (relay under load, relay.outbox)."""
    routes = [route("sbx1", envd_token="envd-secret", traffic_token="traffic-secret")]
    async with running_relay(tmp_path, routes, hold_every_write=request.param) as r:
        yield r


async def test_get_through_an_app_port(relay: RelayUnderTest, upstream: Upstream) -> None:
    response = await request(
        relay.port,
        "GET",
        "/hello?x=1",
        app_host(upstream.port),
        [
            ("E2b-Traffic-Access-Token", "traffic-secret"),
            ("X-Access-Token", "envd-secret"),
            ("X-Forwarded-For", "6.6.6.6"),
            ("Connection", "keep-alive, X-Hop"),
            ("X-Hop", "1"),
            ("User-Agent", "test/1"),
        ],
    )
    assert response.status == 200
    assert response.json() == {"method": "GET", "path": "/hello?x=1", "body": ""}
    assert response.header("X-Upstream") == "yes"
    (seen,) = upstream.seen
    names = {name.lower() for name, _ in seen.headers}
    assert "e2b-traffic-access-token" not in names
    assert "x-access-token" not in names
    assert "x-forwarded-for" not in names
    assert "x-hop" not in names
    assert ("Host", app_host(upstream.port)) in seen.headers
    assert ("User-Agent", "test/1") in seen.headers


async def test_traffic_token_required(relay: RelayUnderTest, upstream: Upstream) -> None:
    missing = await request(relay.port, "GET", "/", app_host(upstream.port))
    assert missing.status == 403
    assert "is missing" in str(missing.json())
    wrong = await request(
        relay.port, "GET", "/", app_host(upstream.port), [("E2b-Traffic-Access-Token", "nope")]
    )
    assert wrong.status == 403
    assert "is invalid" in str(wrong.json())
    assert upstream.seen == []


@pytest.mark.parametrize("value", ["", " ", "\t"])
async def test_an_empty_traffic_token_is_a_missing_one(
    relay: RelayUnderTest, upstream: Upstream, value: str
) -> None:
    """E2B's proxy reads the token with Go's Header.Get, which gives "" for an empty field as
    for none, and answers "is missing" for both; relay said "is invalid". An empty
    X-Access-Token is no token either (README, Decisions)."""
    raw = f"GET / HTTP/1.1\r\nHost: {app_host(upstream.port)}\r\n"
    raw += f"E2b-Traffic-Access-Token:{value}\r\n\r\n"
    conn = await Connection.open(relay.port)
    try:
        await conn.send(raw.encode())
        response = await conn.read_response()
    finally:
        await conn.close()
    assert response.status == 403
    assert "is missing" in str(response.json())
    assert upstream.seen == []


async def test_keep_alive_reuses_one_upstream_connection(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    conn = await Connection.open(relay.port)
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    for i in range(3):
        await conn.send(request_bytes("GET", f"/{i}", app_host(upstream.port), token))
        response = await conn.read_response()
        assert response.status == 200
    await conn.close()
    assert [s.path_qs for s in upstream.seen] == ["/0", "/1", "/2"]
    assert len({s.peer_port for s in upstream.seen}) == 1


async def test_finished_exchanges_are_freed_without_the_cycle_collector(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    # An exchange, its response reader and llhttp's parser refer to each other while a
    # response is read; relay breaks that loop when the exchange ends, so a finished exchange
    # is freed at once by reference counting. A cycle left behind would cost a cyclic-GC pass
    # per few hundred requests on the hot path (bench/README.md, optimisation log).
    conn = await Connection.open(relay.port)
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    gc.collect()
    gc.disable()
    try:
        for i in range(5):
            await conn.send(request_bytes("GET", f"/{i}", app_host(upstream.port), token))
            assert (await conn.read_response()).status == 200
        await asyncio.sleep(0.05)  # the last exchange ends in the callback after its response
        alive = [o for o in gc.get_objects() if isinstance(o, Exchange)]
    finally:
        gc.enable()
    await conn.close()
    assert alive == []


async def test_pipelined_requests_are_answered_in_order(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    conn = await Connection.open(relay.port)
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    batch = b"".join(
        request_bytes("POST", f"/p{i}", app_host(upstream.port), token, body=f"body{i}".encode())
        for i in range(3)
    )
    await conn.send(batch)
    bodies = [(await conn.read_response()).json() for _ in range(3)]
    await conn.close()
    assert [b["path"] for b in bodies] == ["/p0", "/p1", "/p2"]  # type: ignore[index]
    assert [s.body for s in upstream.seen] == [b"body0", b"body1", b"body2"]


async def test_chunked_upload_is_streamed_and_reframed(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    conn = await Connection.open(relay.port)
    head = request_bytes(
        "POST",
        "/upload",
        app_host(upstream.port),
        [("E2b-Traffic-Access-Token", "traffic-secret"), ("Transfer-Encoding", "chunked")],
    )
    await conn.send(head)
    parts = [b"a" * 10, b"b" * 70000, b"c"]
    for part in parts:
        await conn.send(b"%x\r\n%s\r\n" % (len(part), part))
        await asyncio.sleep(0.01)
    await conn.send(b"0\r\n\r\n")
    response = await conn.read_response()
    await conn.close()
    assert response.status == 200
    assert upstream.seen[0].body == b"".join(parts)
    assert ("Transfer-Encoding", "chunked") in upstream.seen[0].headers


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
async def test_an_empty_body_keeps_its_content_length_zero(
    relay: RelayUnderTest, upstream: Upstream, method: str
) -> None:
    """A client that says ``Content-Length: 0`` (a browser's ``fetch`` POST without a body,
    requests' ``post(url)``, ``curl -d ''``; RFC 9110 §8.6: a user agent normally sends it
    even when empty) must not reach the guest without it. relay re-frames every request, and
    an empty one was forwarded with no framing field at all: the same message under RFC 9112
    §6.3, but apps that read ``int(headers["Content-Length"])`` (Python's http.server
    handlers) failed, and servers that want a length answer 411. E2B's proxy (Go's
    transport: transfer.go shouldSendContentLength) sends ``Content-Length: 0`` for these
    methods. A request without the field is still forwarded without it."""
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    conn = await Connection.open(relay.port)
    await conn.send(
        request_bytes(method, "/empty", app_host(upstream.port), [*token, ("Content-Length", "0")])
    )
    empty = await conn.read_response()
    await conn.send(request_bytes(method, "/none", app_host(upstream.port), token))
    none = await conn.read_response()
    await conn.close()
    assert (empty.status, none.status) == (200, 200)
    sent_empty, sent_none = upstream.seen
    assert ("Content-Length", "0") in sent_empty.headers
    assert sent_empty.body == b""
    names = {name.lower() for name, _ in sent_none.headers}
    assert "content-length" not in names
    assert "transfer-encoding" not in names


async def test_streamed_response_arrives_incrementally(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    conn = await Connection.open(relay.port)
    await conn.send(
        request_bytes(
            "GET",
            "/stream?n=5&interval=0.2",
            app_host(upstream.port),
            [("E2b-Traffic-Access-Token", "traffic-secret")],
        )
    )
    response = await conn.read_response(timeout=5)
    await conn.close()
    assert response.body == b"".join(f"event {i}\n".encode() for i in range(5))
    times = [t for t, _ in response.chunks]
    assert len(times) >= 4
    assert times[-1] - times[0] > 0.6  # spread over the upstream's ~0.8 s, not one burst
    assert response.header("Transfer-Encoding") == "chunked"


async def test_head_and_204(relay: RelayUnderTest, upstream: Upstream) -> None:
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    conn = await Connection.open(relay.port)
    await conn.send(request_bytes("HEAD", "/x", app_host(upstream.port), token))
    head = await conn.read_response(head=True)
    assert head.status == 200
    assert head.body == b""
    await conn.send(request_bytes("GET", "/status/204", app_host(upstream.port), token))
    no_content = await conn.read_response()
    assert no_content.status == 204
    await conn.send(request_bytes("GET", "/after", app_host(upstream.port), token))
    after = await conn.read_response()
    assert after.json() == {"method": "GET", "path": "/after", "body": ""}
    await conn.close()


async def test_expect_100_continue(relay: RelayUnderTest, upstream: Upstream) -> None:
    conn = await Connection.open(relay.port)
    await conn.send(
        request_bytes(
            "POST",
            "/continue",
            app_host(upstream.port),
            [
                ("E2b-Traffic-Access-Token", "traffic-secret"),
                ("Expect", "100-continue"),
                ("Content-Length", "5"),
            ],
        )
    )
    interim = await conn.read_response()
    assert interim.status == 100
    await conn.send(b"hello")
    final = await conn.read_response()
    await conn.close()
    assert final.status == 200
    assert upstream.seen[0].body == b"hello"


async def test_dial_is_retried_while_the_port_opens(tmp_path: Path) -> None:
    port = free_port()
    async with running_relay(tmp_path, [route("late", insecure=True)]) as relay:
        started = time.monotonic()
        pending = asyncio.ensure_future(request(relay.port, "GET", "/", app_host(port, "late")))

        async def hello(_request: web.Request) -> web.Response:
            return web.Response(text="late but here")

        await asyncio.sleep(0.25)
        app = web.Application()
        app.router.add_get("/", hello)
        server = TestServer(app, host="127.0.0.1", port=port)
        await server.start_server()
        try:
            response = await pending
        finally:
            await server.close()
        assert response.status == 200
        assert response.body == b"late but here"
        assert time.monotonic() - started < 2


async def test_closed_port_is_502_port_not_open(tmp_path: Path) -> None:
    port = free_port()
    async with running_relay(tmp_path, [route("sbx", insecure=True)]) as relay:
        started = time.monotonic()
        response = await request(relay.port, "GET", "/", app_host(port, "sbx"))
        elapsed = time.monotonic() - started
    assert response.status == 502
    assert response.json() == {
        "code": 502,
        "message": "The sandbox is running but port is not open",
        "sandboxId": "sbx",
        "port": port,
    }
    assert 0.9 < elapsed < 3  # 5 tries, 100+200+300+400 ms apart


async def test_unknown_sandbox_is_502_not_found(relay: RelayUnderTest) -> None:
    response = await request(relay.port, "GET", "/health", f"49983-ghost.{DOMAIN}")
    assert response.status == 502
    assert response.json() == {
        "code": 502,
        "message": "The sandbox was not found",
        "sandboxId": "ghost",
    }


async def test_management_upstream(tmp_path: Path, upstream: Upstream) -> None:
    overrides = {"management": {"upstream": f"http://127.0.0.1:{upstream.port}"}}
    async with running_relay(tmp_path, [], overrides) as relay:
        response = await request(
            relay.port,
            "POST",
            "/sandboxes/abc/connect",
            f"api.{DOMAIN}",
            [("X-API-Key", "e2b_key"), ("Content-Type", "application/json")],
            body=b'{"timeout": 10}',
        )
    assert response.status == 200
    (seen,) = upstream.seen
    assert seen.path_qs == "/sandboxes/abc/connect"
    assert ("X-API-Key", "e2b_key") in seen.headers
    assert seen.body == b'{"timeout": 10}'


async def test_per_sandbox_limit(tmp_path: Path, upstream: Upstream) -> None:
    routes = [route("lim", insecure=True, max_connections=1)]
    async with running_relay(tmp_path, routes) as relay:
        slow = asyncio.ensure_future(
            request(relay.port, "GET", "/stream?n=5&interval=0.1", app_host(upstream.port, "lim"))
        )
        await asyncio.sleep(0.2)
        refused = await request(relay.port, "GET", "/", app_host(upstream.port, "lim"))
        assert refused.status == 429
        assert json.loads(refused.body)["message"] == (
            "The sandbox has too many concurrent incoming connections (limit: 1)"
        )
        assert (await slow).status == 200
        again = await request(relay.port, "GET", "/", app_host(upstream.port, "lim"))
        assert again.status == 200


async def test_an_answered_exchange_dropping_its_body_is_not_in_flight(tmp_path: Path) -> None:
    # A 502 for an app port nothing listens on, sent before the request body ended: the rest of
    # the body is read and dropped, the connection kept. That exchange has no upstream any more
    # and must not count against max_connections (SPEC §5a), as an answer that came from the
    # upstream before the body's end does not (Finish._drop_rest). It did: the sandbox's next
    # request, on another connection, was answered 429 until the first client sent its body.
    closed = free_port()
    routes = [route("lim", insecure=True, max_connections=1)]
    async with running_relay(tmp_path, routes) as relay:
        first = await Connection.open(relay.port)
        try:
            head = request_bytes("POST", "/", app_host(closed, "lim"), [("Content-Length", "10")])
            await first.send(head + b"abc")  # 7 bytes of the body still to come
            answered = await first.read_response(5.0)
            assert answered.status == 502
            second = await request(relay.port, "GET", "/", app_host(closed, "lim"))
            assert second.status == 502
        finally:
            await first.close()


async def test_new_generation_never_reuses_a_pooled_connection(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    token = [("E2b-Traffic-Access-Token", "traffic-secret")]
    await request(relay.port, "GET", "/a", app_host(upstream.port), token)
    await request(relay.port, "GET", "/b", app_host(upstream.port), token)
    relay.set_routes(
        [route("sbx1", envd_token="envd-secret", traffic_token="traffic-secret", generation=2)]
    )
    await request(relay.port, "GET", "/c", app_host(upstream.port), token)
    ports = [s.peer_port for s in upstream.seen]
    assert ports[0] == ports[1]
    assert ports[2] != ports[1]


async def test_revoked_stream_is_truncated_within_a_second(
    relay: RelayUnderTest, upstream: Upstream
) -> None:
    conn = await Connection.open(relay.port)
    await conn.send(
        request_bytes(
            "GET",
            "/stream?n=100&interval=0.05",
            app_host(upstream.port),
            [("E2b-Traffic-Access-Token", "traffic-secret")],
        )
    )
    while not conn.partial.chunks:
        assert await conn.pump(2)
    relay.set_routes([])
    revoked_at = time.monotonic()
    while await conn.pump(1.5):
        assert time.monotonic() - revoked_at < 1.0
    assert time.monotonic() - revoked_at < 1.0
    assert not conn.partial.complete  # no terminating chunk: the client sees the truncation
    await conn.close()


async def test_a_stale_pooled_connection_is_retried_once_for_idempotent_requests(
    tmp_path: Path,
) -> None:
    """The upstream answers one request per connection, then closes when it gets a second
    (an idle-timeout race): a GET is sent again on a fresh connection, a POST is not."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the reuse: close without answering
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_relay(tmp_path, [route("stale", insecure=True)]) as relay:
            host = app_host(port, "stale")
            assert (await request(relay.port, "GET", "/1", host)).status == 200
            second = await request(relay.port, "GET", "/2", host)
            assert second.status == 200
            assert second.body == b"ok"
            assert connections == 2
            post = await request(relay.port, "POST", "/3", host, body=b"x")
            assert post.status == 502
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reused_connection_closed_mid_head_is_not_sent_again(tmp_path: Path) -> None:
    """The retry mends the idle-close race only: an upstream that began its answer (part of
    a status line) and then closed has taken the request, and a GET with side effects (apps
    have them) must not run twice. Go's transport retries only when nothing was read either
    (found by review). relay answered it again on a fresh connection: 200 and two runs."""
    runs = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal runs
        await reader.readuntil(b"\r\n\r\n")
        runs += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")  # the reuse: begin an answer, then close
            runs += 1
            writer.write(b"HTTP/1.1 200 O")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_relay(tmp_path, [route("midhead", insecure=True)]) as relay:
            host = app_host(port, "midhead")
            assert (await request(relay.port, "GET", "/1", host)).status == 200
            second = await request(relay.port, "GET", "/2", host)
    finally:
        server.close()
        await server.wait_closed()
    assert second.status == 502
    assert runs == 2


async def test_a_request_that_cannot_be_sent_again_avoids_a_connection_idle_past_a_second(
    tmp_path: Path,
) -> None:
    """The idle-close race a retry cannot mend: the app closes a keep-alive connection after
    its idle timeout (Node, uvicorn and Apache: 5 s) just as relay sends a POST on it. relay
    cannot send a body twice (RFC 9110 §9.2.2), and answered 502. A request with a body, or
    not idempotent, now goes on a fresh connection when the pooled one has been idle for
    longer than ``UNSAFE_REUSE_IDLE_S``, and that connection is closed, so the pool does not
    grow; a GET still reuses it (a race on it is sent again). The upstream here plays the race:
    a request on a connection idle for over 1.2 s is met with a close."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        answered = -1.0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if answered >= 0 and time.monotonic() - answered > 1.2:
                break  # its idle timeout fired as the request came: close, no answer
            length = 1 if head.startswith(b"POST") else 0
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            answered = time.monotonic()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_relay(tmp_path, [route("idlerace", insecure=True)]) as relay:
            host = app_host(port, "idlerace")
            assert (await request(relay.port, "POST", "/1", host, body=b"x")).status == 200
            await asyncio.sleep(1.5)
            post = await request(relay.port, "POST", "/2", host, body=b"x")
            assert (post.status, post.body) == (200, b"ok")
            assert connections == 2
            assert relay.relay.pool.opened == 1  # the stale one was closed, not kept
            await asyncio.sleep(1.5)
            get = await request(relay.port, "GET", "/3", host)  # reused, raced, sent again
            assert (get.status, get.body) == (200, b"ok")
            assert connections == 3
    finally:
        server.close()
        await server.wait_closed()


async def test_a_length_body_passed_through_in_pieces_stops_at_its_length(tmp_path: Path) -> None:
    """After the head, a Content-Length body is copied straight to the client: pieces arrive
    as sent, and bytes after the announced length (an injected second response) never do."""

    handlers: list[asyncio.Task[object]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"2345")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"6789HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until relay closes this connection (it must not reuse it)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_relay(tmp_path, [route("pieces", insecure=True)]) as relay:
            conn = await Connection.open(relay.port)
            await conn.send(request_bytes("GET", "/", app_host(port, "pieces")))
            response = await conn.read_response()
            assert response.body == b"0123456789"
            assert [chunk for _, chunk in response.chunks] == [b"01", b"2345", b"6789"]
            await conn.send(request_bytes("GET", "/again", app_host(port, "pieces")))
            again = await conn.read_response()
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)
    assert again.body == b"0123456789"  # a new upstream connection, not the injected answer
    assert len(handlers) == 2


@contextlib.asynccontextmanager
async def _scripted_upstream(
    answers: list[bytes | tuple[bytes, ...]],
) -> AsyncIterator[tuple[int, list[list[bytes]]]]:
    """An upstream answering each request it reads with the next scripted bytes, recording
    the request heads per connection; yields its port and those heads. An answer given as a
    tuple is sent in parts, 50 ms apart, so that relay reads them separately."""
    seen: list[list[bytes]] = []
    handlers: list[asyncio.Task[object]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        heads: list[bytes] = []
        seen.append(heads)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while answers:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
                answer = answers.pop(0)
                for index, part in enumerate((answer,) if isinstance(answer, bytes) else answer):
                    if index:
                        await asyncio.sleep(0.05)
                    writer.write(part)
                    await writer.drain()
            await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)


_INJECTED = b"okHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"


@pytest.mark.parametrize(
    "answer",
    [
        # The whole response and the injection in one read (parsed by llhttp).
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + _INJECTED,
        # The head in one read, the body and the injection in the next: the body is passed
        # through without llhttp (ResponseReader._pass_body), and the connection must not
        # reach the pool, where the pipelined POST would take it, before the injection is seen.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", _INJECTED),
    ],
    ids=["one-read", "body-passed-through"],
)
async def test_a_request_pipelined_behind_an_injected_response_gets_a_fresh_connection(
    tmp_path: Path, answer: bytes | tuple[bytes, ...]
) -> None:
    async with (
        _scripted_upstream([answer, b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond"]) as (
            port,
            seen,
        ),
        running_relay(tmp_path, [route("pipe", insecure=True)]) as relay,
    ):
        conn = await Connection.open(relay.port)
        host = app_host(port, "pipe")
        await conn.send(
            request_bytes("GET", "/1", host) + request_bytes("POST", "/2", host, body=b"x")
        )
        first = await conn.read_response()
        second = await conn.read_response()
        await conn.close()
    assert (first.status, first.body) == (200, b"ok")
    assert (second.status, second.body) == (200, b"second")
    # The POST went out once, on a connection of its own, never on the one that misbehaved.
    assert [len(heads) for heads in seen] == [1, 1]
    assert seen[1][0].startswith(b"POST /2 ")


async def test_responses_one_after_another_on_a_pooled_connection(tmp_path: Path) -> None:
    # One upstream connection carries three responses. llhttp's parser goes with the
    # connection from one exchange to the next, except after a body relay passed through
    # without it (the first: its second half comes in a later read), after which it would
    # still be waiting for that body.
    async with (
        _scripted_upstream(
            [
                (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234", b"56789"),
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
            ]
        ) as (port, seen),
        running_relay(tmp_path, [route("seq", insecure=True)]) as relay,
    ):
        conn = await Connection.open(relay.port)
        answers = []
        for i in range(3):
            await conn.send(request_bytes("GET", f"/{i}", app_host(port, "seq")))
            answers.append(await conn.read_response())
        await conn.close()
    assert [(a.status, a.body) for a in answers] == [
        (200, b"0123456789"),
        (200, b"abc"),
        (201, b"ok"),
    ]
    assert [len(heads) for heads in seen] == [3]  # all three on one upstream connection


async def _interim_then_final(conn: Connection, port: int) -> tuple[Response, Response]:
    """GET / on sandbox "hints": the 1xx and the final response relay passes on."""
    await conn.send(request_bytes("GET", "/", app_host(port, "hints")))
    return await conn.read_response(), await conn.read_response()


async def test_an_empty_reason_after_an_interim_response_is_not_the_interim_one(
    tmp_path: Path,
) -> None:
    async with (
        _scripted_upstream(
            [
                b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nok"
            ]
        ) as (port, _),
        running_relay(tmp_path, [route("hints", insecure=True)]) as relay,
    ):
        conn = await Connection.open(relay.port)
        interim, final = await _interim_then_final(conn, port)
        await conn.close()
    assert (interim.status, interim.reason) == (103, b"Early Hints")
    assert (final.status, final.reason, final.body) == (200, b"OK", b"ok")


async def test_an_interim_response_that_says_close_is_relayed_and_so_is_the_final_one(
    tmp_path: Path,
) -> None:
    """A 1xx may carry fields (RFC 9110 §15.2); "Connection: close" on one made llhttp refuse
    the final response (relay answered 502). The final response now reaches the client, and
    the upstream connection, which its server will close (RFC 9112 §9.6), is not reused."""
    async with (
        _scripted_upstream(
            [
                b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nConnection: close\r\n\r\n"
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext",
            ]
        ) as (port, seen),
        running_relay(tmp_path, [route("hints", insecure=True)]) as relay,
    ):
        conn = await Connection.open(relay.port)
        interim, final = await _interim_then_final(conn, port)
        await conn.send(request_bytes("GET", "/again", app_host(port, "hints")))
        after = await conn.read_response()
        await conn.close()
    assert (interim.status, final.status, final.body) == (103, 200, b"ok")
    assert (after.status, after.body) == (200, b"next")
    assert [len(heads) for heads in seen] == [1, 1]  # a second upstream connection


async def test_idle_upstream_connections_are_capped_per_upstream(
    tmp_path: Path, upstream: Upstream
) -> None:
    """Four concurrent requests open four upstream connections; two stay pooled, and the
    next four requests reuse those two and dial two more."""
    routes = [route("cap", insecure=True)]
    overrides = {"upstream": {"max_idle_per_upstream": 2}}
    async with running_relay(tmp_path, routes, overrides) as relay:
        host = app_host(upstream.port, "cap")

        async def burst() -> None:
            answers = await asyncio.gather(
                *(request(relay.port, "GET", "/stream?n=2&interval=0.1", host) for _ in range(4))
            )
            assert [a.status for a in answers] == [200] * 4

        await burst()
        assert relay.relay.pool.idle_count() == 2
        first = {s.peer_port for s in upstream.seen}
        assert len(first) == 4
        await burst()
        second = {s.peer_port for s in upstream.seen[4:]}
        assert len(second & first) == 2  # the two pooled ones were reused
        assert relay.relay.pool.idle_count() == 2


@contextlib.asynccontextmanager
async def _headers_routed(tmp_path: Path) -> AsyncIterator[tuple[int, int, list[bytes]]]:
    """A relay with sandbox ``sbx`` and an app of it that records each request head and
    answers 200 "ok": (relay's port, the app's port, the heads the app read)."""
    heads: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with (
        scripted_upstream(upstream) as app_port,
        running_relay(tmp_path, [route("sbx", envd_token="t")]) as r,
    ):
        yield r.port, app_port, heads


async def _exchange(port: int, raw: bytes) -> Response:
    conn = await Connection.open(port)
    try:
        await conn.send(raw)
        return await conn.read_response(timeout=5)
    finally:
        await conn.close()


async def test_http10_request_without_host_reaches_the_guest_with_one(tmp_path: Path) -> None:
    """Found by review: an HTTP/1.0 request routed by its E2b-Sandbox-* headers, with no Host,
    went upstream as HTTP/1.1 without one (RFC 9112 §3.2), which Go's net/http refuses."""
    async with _headers_routed(tmp_path) as (port, app_port, heads):
        response = await _exchange(
            port,
            b"GET /x HTTP/1.0\r\nE2b-Sandbox-Id: sbx\r\nE2b-Sandbox-Port: %d\r\n\r\n" % app_port,
        )
    assert (response.status, response.body) == (200, b"ok")
    assert heads[0].startswith(
        b"GET /x HTTP/1.1\r\nHost: %d-sbx.%s\r\n" % (app_port, DOMAIN.encode())
    )


async def test_an_empty_host_is_routed_by_the_sandbox_headers(tmp_path: Path) -> None:
    """RFC 9112 §3.2: a client sends an empty Host when the target URI has no authority, and
    an empty reg-name is a valid Host (RFC 9110 §7.2). It names no sandbox, so the header form
    routes it (SPEC §1: both forms apply on every Host but api.<domain>), and with no target
    it goes where any other name without one goes (no management upstream here: 404). relay
    refused it 400 "Invalid Host header" (found by review). The Host is preserved (SPEC §4),
    empty: Go's net/http (envd's) takes an empty Host, as it refuses only a missing one."""
    async with _headers_routed(tmp_path) as (port, app_port, heads):
        response = await _exchange(
            port,
            b"GET /x HTTP/1.1\r\nHost:\r\nE2b-Sandbox-Id: sbx\r\n"
            b"E2b-Sandbox-Port: %d\r\nConnection: close\r\n\r\n" % app_port,
        )
        assert (response.status, response.body) == (200, b"ok")
        assert heads[0].startswith(b"GET /x HTTP/1.1\r\nHost: \r\n")
        assert heads[0].count(b"Host:") == 1
        nothing = await request(port, "GET", "/x", "")
        assert nothing.status == 404, nothing.body


async def test_an_http10_client_kept_alive_is_told_so_by_relays_own_answers(
    tmp_path: Path,
) -> None:
    """Found by review: relay kept an HTTP/1.0 keep-alive connection after its own answer (a
    502 for an unknown sandbox here) without saying so, and the client could wait for a close
    (RFC 9112 §9.3: both sides must say so)."""
    async with running_relay(tmp_path, []) as relay:
        conn = await Connection.open(relay.port)
        try:
            for _ in range(2):  # the same connection, kept
                await conn.send(
                    b"GET /x HTTP/1.0\r\nHost: 3000-nobox.%s\r\nConnection: keep-alive\r\n\r\n"
                    % DOMAIN.encode()
                )
                response = await conn.read_response(timeout=5)
                assert response.status == 502
                assert response.header("Connection") == "keep-alive"
        finally:
            await conn.close()


async def test_a_response_without_a_date_is_given_one(tmp_path: Path) -> None:
    # RFC 9110 §6.6.1: "A recipient with a clock that receives a response message without a
    # Date header field MUST ... append a corresponding Date header field" when it forwards
    # it. nginx, Envoy and Go's server (E2B's proxy) do; relay passed such a response on
    # without one. An upstream's own Date is passed on as it came, never a second one.
    answers: list[bytes | tuple[bytes, ...]] = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\nContent-Length: 2\r\n\r\nok",
    ]
    async with (
        _scripted_upstream(answers) as (port, _),
        running_relay(tmp_path, [route("dateless", insecure=True)]) as relay,
    ):
        conn = await Connection.open(relay.port)
        got = []
        for i in range(3):
            await conn.send(request_bytes("GET", f"/{i}", app_host(port, "dateless")))
            got.append(await conn.read_response())
        await conn.close()
    for response in got[:2]:
        assert response.body == b"ok"
        dates = [value for name, value in response.headers if name.lower() == b"date"]
        assert len(dates) == 1, response.headers
        sent = email.utils.parsedate_to_datetime(dates[0].decode())
        assert abs(sent.timestamp() - time.time()) < 5
    assert [(n, v) for n, v in got[2].headers if n.lower() == b"date"] == [
        (b"date", b"Sun, 06 Nov 1994 08:49:37 GMT")
    ]
