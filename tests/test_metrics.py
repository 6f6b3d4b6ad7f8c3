"""Admin /metrics (SPEC §7): relay_* families with bounded labels, process_/python_ families,
merging across workers; /routes without tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from relay.core.model import Forward, Kind, Reason, Reject, RequestHead
from relay.metric_snapshot import SPECS
from relay.metrics import families, read_snapshots, write_snapshot
from relay.observe import Histogram, Observer
from tests.core.test_failures import forward as make_forward
from tests.support.harness import (
    DOMAIN,
    RelayUnderTest,
    route,
    running_relay,
    scripted_upstream,
    until,
)
from tests.support.ops import get, samples, value
from tests.support.ports import free_port
from tests.support.rawhttp import Connection, request


# -- pure ---------------------------------------------------------------------------------------
def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]
    assert h.total == pytest.approx(4.65)


class _Done:
    """What Observer.exchange_done reads off a finished exchange (relay.finish.Finish)."""

    def __init__(self, decision: Forward | Reject, status: int) -> None:
        self.decision = decision
        self.status = status
        self.bytes_in = 1
        self.bytes_out = 2
        self.reason = ""
        self.started_at = time.monotonic()
        self.head = RequestHead(method=b"GET", target=b"/x?q", version="1.1", headers=())
        self.client = SimpleNamespace(peer="127.0.0.1")


def test_requests_are_counted_by_kind_and_status_class() -> None:
    observer = Observer()
    forward = make_forward(Kind.ENVD)
    statuses = (0, 101, 200, 204, 302, 404, 503, 599, 600, 999, 1000)
    for status in statuses:
        observer.exchange_done(_Done(forward, status))  # type: ignore[arg-type]
    refused = Reject(reason=Reason.NOT_FOUND)
    observer.exchange_done(_Done(refused, 502))  # type: ignore[arg-type]
    observer.connection_refused(Reject(reason=Reason.HEADERS_TOO_LARGE), "127.0.0.1")
    assert observer.requests == {
        ("envd", "none"): 4,  # no response, and statuses no class covers
        ("envd", "1xx"): 1,
        ("envd", "2xx"): 2,
        ("envd", "3xx"): 1,
        ("envd", "4xx"): 1,
        ("envd", "5xx"): 2,
        ("refused", "5xx"): 1,
        ("refused", "4xx"): 1,
    }
    observer.first_response_byte(_Done(forward, 200))  # type: ignore[arg-type]
    assert sum(observer.first_byte["envd"].counts) == 1


def _snap(pid: int, requests: int, connections: int, routes: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "counters": {"relay_requests": [[["envd", "2xx"], requests]]},
        "histograms": {"relay_upstream_connect_seconds": [[[], [1] + [0] * 13, 0.0004]]},
        "gauges": {
            "relay_client_connections": [[[], connections]],
            "relay_routes": [[[], routes]],
            "relay_feed_ready": [[[], 1 if pid != 3 else 0]],
        },
    }


def test_families_merge_workers() -> None:
    alive, also_alive, dead = _snap(1, 5, 2, 10), _snap(3, 7, 4, 12), _snap(2, 100, 50, 9)
    out = {m.name: m for m in families([alive, also_alive, dead], [alive, also_alive])}
    (requests,) = out["relay_requests"].samples
    assert requests.value == 112  # counters: every worker that ever ran
    (connections,) = out["relay_client_connections"].samples
    assert connections.value == 6  # gauges: live workers only, summed
    assert out["relay_routes"].samples[0].value == 12  # max
    assert out["relay_feed_ready"].samples[0].value == 0  # min: one worker is not ready
    count = next(
        s for s in out["relay_upstream_connect_seconds"].samples if s.name.endswith("count")
    )
    assert count.value == 3


def test_snapshot_files_round_trip(tmp_path: Path) -> None:
    write_snapshot(tmp_path, _snap(7, 1, 1, 1))
    (tmp_path / "8.json").write_text("{trunc")  # a torn file is skipped, not fatal
    assert list(read_snapshots(tmp_path)) == [7]


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


@pytest.mark.parametrize(
    "odd",
    [
        {"counters": []},
        {"counters": {"relay_requests": 5}},
        {"counters": {"relay_requests": [[["app"], 1]]}},  # one label short
        {"counters": {"relay_requests": [[["app", "2xx"], "1"]]}},
        {"gauges": {"relay_routes": [[[], None]]}},
        {"histograms": {"relay_upstream_connect_seconds": [[[], [1, 2], 0.5]]}},
        {"histograms": {"relay_requests": [[["app", "2xx"], [1], 0.5]]}},
        # Found by review: json.loads makes these, and the exposition cannot write them.
        {"counters": {"relay_requests": [[["app", "2xx"], 10**400]]}},
        {"gauges": {"relay_routes": [[[], 10**400]]}},
        {"histograms": {"relay_upstream_connect_seconds": [[[], [10**400] * 14, 0.5]]}},
        {"counters": {"relay_requests": [[["app", "\ud800"], 1]]}},
    ],
)
def test_a_snapshot_of_the_wrong_shape_is_skipped(tmp_path: Path, odd: dict[str, Any]) -> None:
    """Valid JSON in the wrong shape (another version's file, or one written by hand) is left
    out like a torn one: the supervisor's /metrics still answers with the others (the whole
    exposition is written, as the supervisor's /metrics writes it)."""
    write_snapshot(tmp_path, _snap(7, 1, 1, 1))
    (tmp_path / "9.json").write_text(json.dumps({"pid": 9, **odd}))
    snaps = read_snapshots(tmp_path)
    assert list(snaps) == [7]
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families(list(snaps.values()), list(snaps.values())))))
    assert b"relay_requests_total" in generate_latest(registry)


def test_every_spec_has_bounded_labels() -> None:
    allowed = {"kind", "status_class", "reason", "direction", "source", "result", "version", "side"}
    for name, spec in SPECS.items():
        assert name.startswith("relay_")
        assert set(spec.labels) <= allowed, name


# -- a relay under traffic ----------------------------------------------------------------------
@pytest.fixture
async def upstream() -> AsyncIterator[TestServer]:
    async def ws(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        async for msg in socket:
            if msg.type is WSMsgType.TEXT:
                await socket.send_str(msg.data)
        return socket

    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="0123456789")

    app = web.Application()
    app.router.add_get("/ws", ws)
    app.router.add_route("*", "/{tail:.*}", hello)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def _scrape(relay: RelayUnderTest) -> str:
    assert relay.relay.admin_bound is not None
    status, body = await get(relay.relay.admin_bound[1], "/metrics")
    assert status == 200
    return body.decode()


async def test_metrics_under_traffic(tmp_path: Path, upstream: TestServer) -> None:
    port = upstream.port
    assert port is not None
    routes = [
        route("metricsbox", envd_token="envd-tok", traffic_token="app-tok"),
        route("closedbox", insecure=True),
    ]
    overrides = {"upstream": {"envd_port": port}}
    async with running_relay(tmp_path, routes, overrides) as relay:
        envd = f"{port}-metricsbox.{DOMAIN}"
        app_port = free_port()  # nothing listens there: a refused dial
        for token in ("envd-tok", "wrong-tok"):
            await request(relay.port, "POST", "/x", envd, [("X-Access-Token", token)], b"abcd")
        await request(relay.port, "GET", "/", f"{port}-nosuchbox.{DOMAIN}")
        await request(relay.port, "GET", "/", f"{app_port}-closedbox.{DOMAIN}")
        await request(relay.port, "GET", "/", envd)  # no credential at all
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"{relay.url}/ws", headers={"Host": envd, "X-Access-Token": "envd-tok"}
            ) as ws,
        ):
            await ws.send_str("hi")
            assert (await ws.receive(2)).data == "hi"
            text = await _scrape(relay)
            assert value(text, "relay_active_websockets") == 1
            assert value(text, "relay_client_connections") == 1
        text = await _scrape(relay)
    assert value(text, "relay_requests_total", kind="envd", status_class="2xx") == 1
    assert value(text, "relay_requests_total", kind="envd", status_class="1xx") == 1  # the 101
    assert value(text, "relay_requests_total", kind="refused", status_class="4xx") == 2
    assert value(text, "relay_requests_total", kind="refused", status_class="5xx") == 1
    assert value(text, "relay_requests_total", kind="app", status_class="5xx") == 1
    assert value(text, "relay_auth_failures_total", reason="envd_token") == 2
    assert value(text, "relay_refusals_total", reason="not_found") == 1
    assert value(text, "relay_refusals_total", reason="port_closed") == 1
    assert value(text, "relay_upstream_connect_errors_total", reason="refused") == 1
    assert value(text, "relay_upstream_connect_seconds_count") == 1  # the WS reused it
    assert value(text, "relay_first_byte_seconds_count", kind="envd") == 2
    assert value(text, "relay_bytes_total", direction="in") >= 4 + 2 + 4  # body + WS frames
    assert value(text, "relay_websocket_sessions_total") == 1
    assert value(text, "relay_routes") == 2
    assert value(text, "relay_feed_ready") == 1
    assert any(k[0].startswith("process_") for k in samples(text))
    assert any(k[0].startswith("python_") for k in samples(text))
    for sandbox_id in ("metricsbox", "closedbox", "nosuchbox"):
        assert sandbox_id not in text
    for token in ("envd-tok", "app-tok", "wrong-tok"):
        assert token not in text


async def test_feed_revocation_and_rejection_metrics(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [route("feedbox", insecure=True)]) as relay:
        relay.set_routes([{"sandbox_id": "badbox", "address": "8.8.8.8", "insecure": True}])
        text = await _scrape(relay)
        assert value(text, "relay_revocations_total") == 1
        assert value(text, "relay_route_rejections_total", source="file") == 1
        assert value(text, "relay_routes") == 0
        relay.routes_file.write_text("{broken")
        relay.relay.feed.load()
        await asyncio.sleep(0.05)
        text = await _scrape(relay)
        assert value(text, "relay_feed_errors_total", source="file") == 1
        assert value(text, "relay_feed_staleness_seconds") > 0
        relay.set_routes([route("feedbox", insecure=True)])
        text = await _scrape(relay)
        assert value(text, "relay_feed_staleness_seconds") == 0
    for sandbox_id in ("feedbox", "badbox", "8.8.8.8"):
        assert sandbox_id not in text


async def test_routes_endpoint_shows_no_token(tmp_path: Path) -> None:
    routes = [
        route("routesbox", envd_token="envd-secret-1", traffic_token="traffic-secret-1"),
        route("openbox", "10.1.2.3", insecure=True, generation=4),
    ]
    async with running_relay(tmp_path, routes) as relay:
        assert relay.relay.admin_bound is not None
        status, body = await get(relay.relay.admin_bound[1], "/routes")
    assert status == 200
    assert b"secret" not in body
    listed = json.loads(body)
    assert listed["count"] == 2
    assert [(r["sandbox_id"], r["address"], r["generation"]) for r in listed["routes"]] == [
        ("openbox", "10.1.2.3", 4),
        ("routesbox", "127.0.0.1", 0),
    ]
    assert listed["routes"][1]["has_traffic_token"] is True


async def test_the_staleness_gauge_counts_from_the_stale_clocks_start(tmp_path: Path) -> None:
    """Found by review: a feed reports a failure (feed_failed) when it notices it, then the
    outage from its last good read (feed_broken, which starts the stale clock, SPEC §3). The
    gauge counted from the first: ~6 s behind for a hung Redis, so it read 24 when the cache
    had turned stale at max_stale_s = 30."""
    async with running_relay(tmp_path, [route("gaugebox", insecure=True)]) as relay:
        last_good = time.monotonic() - 10.0
        relay.relay.feed_failed("redis", "127.0.0.1:1: TimeoutError")
        relay.relay.feed_broken(last_good)
        assert value(await _scrape(relay), "relay_feed_staleness_seconds") >= 10
        relay.relay.feed_restored()
        assert value(await _scrape(relay), "relay_feed_staleness_seconds") == 0


async def test_pipelined_requests_a_client_abandons_are_not_counted_as_refused(
    tmp_path: Path,
) -> None:
    """Found by review: a request queued behind a running one, whose client then left, ended
    with no decision and was counted as relay_requests{kind="refused"}, though relay refused
    nothing (relay_refusals stayed 0): an alert on refusals fired on clients that gave up."""
    heads: list[bytes] = []

    async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        with contextlib.suppress(OSError):
            await reader.read()  # never answers; until relay lets go
        writer.close()

    async with (
        scripted_upstream(stalled) as port,
        running_relay(tmp_path, [route("sbx", insecure=True)]) as relay,
    ):
        host = f"{port}-sbx.{DOMAIN}"
        _, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        one = f"GET /slow HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        writer.write(one + one.replace(b"/slow", b"/queued"))
        await until(lambda: len(heads) == 1)  # the first is upstream, the second queued
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # the client gives up on both: a reset, not a half-close
        await until(lambda: not relay.relay.connections)
        requests = relay.relay.observer.requests
    assert not relay.relay.observer.refusals
    assert requests[("refused", "none")] == 0, requests
    assert requests[("app", "none")] == 1, requests
    assert sum(requests.values()) == 2, requests  # the abandoned one is still counted


async def test_relay_bytes_says_it_counts_dropped_bodies_and_relays_own_answers(
    tmp_path: Path,
) -> None:
    """Found by review: relay_bytes' help said "Body bytes relayed (in: client to upstream,
    out: upstream to client)", but a refused request's body, which relay reads and drops, is
    counted "in", and relay's own answer "out": a flood of refused uploads looked like traffic
    to sandboxes. Its help now says what it counts (what the access log's bytes count; an
    answer to a request relay could not parse is now counted "out" too, as its line counts it)."""
    async with running_relay(tmp_path, [route("sbx", envd_token="envd-tok")]) as relay:
        host = f"49983-sbx.{DOMAIN}"
        answer = await request(
            relay.port, "POST", "/x", host, [("X-Access-Token", "wrong")], b"z" * 100
        )
        # And an answer with no exchange (a request that cannot be parsed): its log line
        # counts its body in bytes_out; relay_bytes did not.
        conn = await Connection.open(relay.port)
        try:
            await conn.send(b"NOT HTTP\r\n\r\n")
            malformed = await conn.read_response()
        finally:
            await conn.close()
        text = await _scrape(relay)
    assert answer.status == 401
    assert malformed.status == 400
    assert value(text, "relay_bytes_total", direction="in") == 100  # dropped, not relayed
    out = len(answer.body) + len(malformed.body)  # relay's own answers
    assert value(text, "relay_bytes_total", direction="out") == out
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "relay_bytes"]
    assert "client to upstream" not in family.documentation
    assert "dropped" in family.documentation
    assert "relay's own answers" in family.documentation
