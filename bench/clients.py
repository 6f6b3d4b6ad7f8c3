"""The benchmark's Python load clients (everything wrk does not do).

Each subcommand connects to one address (the origin directly, or a proxy), sends requests with
a routing ``Host`` header, prints one JSON object on stdout and exits. Every loop is bounded by
a count and a deadline. Run with uvloop, raw protocols, no HTTP library: the clients should
cost as little CPU as the origin, so that the proxy is what is measured.

  download   GET a 64 MiB body N times; MiB/s per transfer; CRC-32 checked once
  upload     POST a 64 MiB body N times; MiB/s per transfer; the origin echoes count and CRC
  stream     a Connect-style server stream: per-event latency (arrival - send stamp) and
             time to first event
  ws-echo    WebSocket echo round trips/s over C connections for D seconds
  hold-http  open N keep-alive connections, one GET each, then hold them idle until stdin
             closes (or --hold-s passes)
  hold-ws    the same with N WebSocket connections (handshake done, then idle)

The shared HTTP/1.1 pieces are in ``bench.client_http``; each kind of client in its module:
``bench.client_transfer`` (download, upload), ``bench.client_stream``, ``bench.client_ws``
(ws-echo) and ``bench.client_hold`` (hold-http, hold-ws).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httptools
import uvloop

from bench.client_hold import hold
from bench.client_http import MIB
from bench.client_stream import stream
from bench.client_transfer import download, upload
from bench.client_ws import ws_echo

# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", required=True, help="host:port to connect to")
        p.add_argument("--host", required=True, help="Host header")
        p.add_argument("--timeout-s", type=float, default=60.0)

    p = sub.add_parser("download")
    common(p)
    p.add_argument("--path", default="/blob")
    p.add_argument("--size", type=int, default=64 * MIB)
    p.add_argument("--crc", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p = sub.add_parser("upload")
    common(p)
    p.add_argument("--path", default="/upload")
    p.add_argument("--size", type=int, default=64 * MIB)
    p.add_argument("--reps", type=int, default=4)
    p = sub.add_parser("stream")
    common(p)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    p = sub.add_parser("ws-echo")
    common(p)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--payload", type=int, default=32)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--duration-s", type=float, default=3.0)
    for name in ("hold-http", "hold-ws"):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--batch", type=int, default=250)
        p.add_argument("--hold-s", type=float, default=120.0)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    command = args.command
    if command == "download":
        return await download(args)
    if command == "upload":
        return await upload(args)
    if command == "stream":
        return await stream(args)
    if command == "ws-echo":
        return await ws_echo(args)
    return await hold(args, websocket=command == "hold-ws")


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    try:
        result = uvloop.run(main(arguments))
    except (OSError, TimeoutError, httptools.HttpParserError, ConnectionError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
