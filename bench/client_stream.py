"""The ``stream`` client: a Connect-style server stream (``application/connect+json``,
chunked) whose events carry their send time; per-event latency (arrival - send stamp, on the
``CLOCK_MONOTONIC`` all processes share) and time to the first event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from bench.client_http import Response, connect, head, percentile


class EventSink:
    """Splits a Connect stream body into envelopes and stamps each event's arrival."""

    def __init__(self, latencies: list[float]) -> None:
        self.latencies = latencies
        self.buf = bytearray()
        self.first = 0
        self.events = 0
        self.ended = False

    def __call__(self, data: bytes) -> None:
        now = time.monotonic_ns()
        buf = self.buf
        buf.extend(data)
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + length:
                break
            flags = buf[0]
            payload = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if flags & 0x02:
                self.ended = True
                continue
            event = json.loads(payload)
            if not self.first:
                self.first = now
            self.latencies.append((now - event["t"]) / 1000.0)
            self.events += 1


async def stream(args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[float] = []
    firsts: list[float] = []
    deadline = time.monotonic() + args.timeout_s
    request = b"\x00\x00\x00\x00\x02{}"
    for _ in range(args.reps):
        if time.monotonic() > deadline:
            break
        conn = await connect(args.address)
        sink = EventSink(latencies)
        conn.response = Response(sink)
        assert conn.transport is not None
        sent = time.monotonic_ns()
        conn.transport.write(
            head(
                "POST",
                "/stream",
                args.host,
                [
                    "Content-Type: application/connect+json",
                    "Connect-Protocol-Version: 1",
                    f"Content-Length: {len(request)}",
                ],
            )
            + request
        )
        await asyncio.wait_for(conn.response.done, max(1.0, deadline - time.monotonic()))
        conn.transport.close()
        if conn.response.status != 200 or not sink.ended or sink.events != args.events:
            return {
                "error": f"status {conn.response.status}, {sink.events} events, "
                f"end-of-stream {sink.ended}"
            }
        firsts.append((sink.first - sent) / 1000.0)
    return {
        "events": len(latencies),
        "latency_us": {
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "max": max(latencies) if latencies else None,
        },
        "first_event_us": statistics.median(firsts) if firsts else None,
        "first_event_runs_us": [round(f, 1) for f in firsts],
    }
