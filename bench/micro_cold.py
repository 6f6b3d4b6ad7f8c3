"""``bench.micro --cold-ms``: latency after idle instead of CPU. Before each small GET the
child sleeps MS milliseconds and records how long after the start of a read callback the
write it causes happens: the request head upstream, the response to the client, and (after
another MS idle) one event of a running Connect stream to the client; medians per round, the
best round per tree reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.micro_drive import (
    REQUEST,
    RESPONSE,
    STREAM_PORT,
    FakeSocketTransport,
    turn_end_for,
)

STREAM_BODY = b'{"cmd":"ls"}'
STREAM_REQUEST = (
    b"POST /stream HTTP/1.1\r\nHost: %d-bench.sandbox.localhost\r\n"
    b"Content-Type: application/connect+json\r\nContent-Length: %d\r\n\r\n%s"
    % (STREAM_PORT, len(STREAM_BODY), STREAM_BODY)
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def stream_event(i: int) -> bytes:
    """One event of a Connect server stream as envd (and bench.origin) sends it: a chunk
    holding one envelope (flags, 4-byte length, JSON)."""
    payload = b'{"i":%d,"t":%d}' % (i, 1_700_000_000_000_000_000 + i)
    envelope = b"\x00" + len(payload).to_bytes(4, "big") + payload
    return b"%x\r\n%s\r\n" % (len(envelope), envelope)


def drive_cold(relay: Any, upstreams: Any, n: int, pause_s: float) -> list[float]:
    """``n`` small GETs, each after ``pause_s`` idle, and after another ``pause_s`` one event
    of a running Connect stream; median µs from the start of each read callback to the write
    it causes: [request head upstream, response to the client, stream event to the client]."""
    from relay.server import ClientConnection

    client = ClientConnection(relay, tls=False)
    client_transport = FakeSocketTransport(("127.0.0.1", 40001))
    client.connection_made(client_transport)  # type: ignore[arg-type]
    conn, upstream_transport = upstreams[18081]
    streaming = ClientConnection(relay, tls=False)
    streaming_transport = FakeSocketTransport(("127.0.0.1", 40002))
    streaming.connection_made(streaming_transport)  # type: ignore[arg-type]
    stream_conn, stream_upstream = upstreams[STREAM_PORT]
    turn_end = turn_end_for(relay)
    streaming.data_received(STREAM_REQUEST)
    stream_conn.data_received(STREAM_HEAD)
    turn_end()
    if not stream_upstream.written or not streaming_transport.written:
        raise RuntimeError("relay did not start the stream")
    to_upstream: list[float] = []
    to_client: list[float] = []
    events: list[float] = []
    for i in range(n):
        time.sleep(pause_s)
        start = time.perf_counter_ns()
        client.data_received(REQUEST)
        turn_end()
        middle = time.perf_counter_ns()
        conn.data_received(RESPONSE)
        turn_end()
        if not upstream_transport.written or not client_transport.written:
            raise RuntimeError("relay did not forward the request or the response")
        to_upstream.append((upstream_transport.written_at - start) / 1000)
        to_client.append((client_transport.written_at - middle) / 1000)
        upstream_transport.written.clear()
        client_transport.written.clear()
        streaming_transport.written.clear()
        event = stream_event(i)
        time.sleep(pause_s)
        start = time.perf_counter_ns()
        stream_conn.data_received(event)
        turn_end()
        if not streaming_transport.written:
            raise RuntimeError("relay did not forward the stream event")
        events.append((streaming_transport.written_at - start) / 1000)
    stream_conn.data_received(b"0\r\n\r\n")  # the stream ends; its connection is pooled
    turn_end()
    client.connection_lost(None)
    streaming.connection_lost(None)
    return [statistics.median(to_upstream), statistics.median(to_client), statistics.median(events)]


COLD_VALUES = ("request head upstream", "response to the client", "stream event to the client")


def report_cold(args: argparse.Namespace, runs: dict[str, list[list[float]]]) -> None:
    count = len(COLD_VALUES)
    best = {
        label: [min(r[i] for r in items) for i in range(count)] for label, items in runs.items()
    }
    for label, items in runs.items():
        medians = [statistics.median(r[i] for r in items) for i in range(count)]
        print(
            f"{label:<10} "
            + ", ".join(
                f"{name}: {b:.1f} µs (median round {m:.1f})"
                for name, b, m in zip(COLD_VALUES, best[label], medians, strict=True)
            )
        )
    print(
        f"(from the start of the read callback to the write, {args.cold_ms:g} ms idle before "
        f"each request; best of {len(runs['this tree'])} interleaved rounds of "
        f"{args.requests} on cpu {args.cpu})"
    )
    if args.compare:
        for i, name in enumerate(COLD_VALUES):
            ratio = best["compare"][i] / best["this tree"][i]
            print(f"  {name}: compare ÷ this tree = {ratio:.3f}")
