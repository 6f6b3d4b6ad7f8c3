"""relay's hot path in-process, without sockets: user-space CPU per small GET.

    .venv/bin/python -m bench.micro [--requests 3000] [--rounds 15] [--relay-src DIR]
    .venv/bin/python -m bench.micro --compare DIR      # A/B: this tree vs DIR, interleaved
    .venv/bin/python -m bench.micro --cold-ms 10 [--compare DIR]   # latency on an idle core
    make bench-pyinstrument   # = --pyinstrument bench/results/micro-pyinstrument: call tree

Runs with relay's own venv (it imports relay). A real ``ClientConnection`` gets a request
through ``data_received`` from a fake transport; the exchange finds a pooled
``UpstreamConnection`` (fake transport too) and writes the request head to it; the driver then
feeds the upstream's response into ``data_received`` and checks that the client transport got
the response. Everything relay does per request runs — llhttp both ways, ``decide``, header
rules, the pool, the access log (to /dev/null) — except the syscalls and the event loop's
wake-ups, which ``make bench`` and ``bench.profile`` measure.

``--pyinstrument PREFIX`` profiles the same loop in this process with pyinstrument (a
statistical profiler that keeps whole Python call stacks, where py-spy on the live relay
mixes in the kernel and the event loop) and writes ``PREFIX.txt`` and ``PREFIX.html``.
pyinstrument is not one of relay's dependencies: ``make bench-pyinstrument`` installs it into
relay's venv first.

``--cold-ms MS`` measures latency instead of CPU: before each small GET the child sleeps MS
milliseconds, as a lightly loaded relay does between requests, and records how long after the
start of the client's read callback the request head reaches the upstream transport, and how
long after the upstream's read callback the response reaches the client transport, and, after
another MS idle, how long one event of a running Connect stream (a chunk holding one envelope,
as envd sends it) takes from the upstream's read callback to the client transport (medians per
round). On this VM an idle core makes every line of Python ~15-20x slower (caches and the core
itself go cold): a head written 4.6 µs after the read when hot is written ~100 µs after it
10 ms after the previous request, so at light load the order of relay's work, not its
total, decides the latency (see bench/README.md, "Cold requests").

Why: on this shared 2-core machine the loopback numbers swing by ±20% with the other
tenants' load, which hides a 5% improvement. Even CPU time swings (caches, the host), so an
A/B keeps one child process per tree alive, pinned to the same core, alternates short rounds
between them and compares the best rounds. Tied to relay's internal classes: adjust it when
they change.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
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
    # what the child measures (see serve_rounds).
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
STREAM_PORT = 18082
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


def _turn_end(relay: Any) -> Any:
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
    turn_end = _turn_end(relay)
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
    turn_end = _turn_end(relay)
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


WORKLOADS = (
    ("small GET", REQUEST, 18081),
    ("envd X-Access-Token", TOKEN_REQUEST, 49983),
    ("signed /files URL", SIGNED_REQUEST, 49983),
)
COLD_VALUES = ("request head upstream", "response to the client", "stream event to the client")


def serve_rounds(args: argparse.Namespace) -> None:
    """Child mode: build once, then run one round per line read from stdin."""
    # Answers go to a copy of the real stdout; fd 1 becomes /dev/null before relay is
    # imported, so whatever relay writes to stdout (the access log) costs what it costs.
    answer = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    relay, upstreams = build(not args.no_access_log)
    for _, request, port in WORKLOADS:
        drive(relay, upstreams, request, port, 2000)  # warm-up
    print("ready", file=answer, flush=True)
    for line in sys.stdin:
        n = int(line)
        gc.collect()
        if args.cold_ms:
            values = drive_cold(relay, upstreams, n, args.cold_ms / 1000)
            print(" ".join(f"{v:.3f}" for v in values), file=answer, flush=True)
            continue
        values = [drive(relay, upstreams, request, port, n) * 1e6 for _, request, port in WORKLOADS]
        print(" ".join(f"{v:.3f}" for v in values), file=answer, flush=True)


class Child:
    """A measuring child process for one relay tree, pinned to one core."""

    def __init__(self, args: argparse.Namespace, src: str, cpu: int) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        if src:  # the working directory comes first on sys.path: start from a neutral one
            env["PYTHONPATH"] = f"{src}{os.pathsep}{root}"
        argv = ["taskset", "-c", str(cpu), sys.executable, "-m", "bench.micro", "--child"]
        if args.no_access_log:
            argv.append("--no-access-log")
        if args.cold_ms:
            argv += ["--cold-ms", str(args.cold_ms)]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tempfile.gettempdir() if src else root,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the micro-benchmark child did not start")

    def round(self, n: int) -> list[float]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return [float(v) for v in self.proc.stdout.readline().split()]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu", type=int, default=1, help="core the children run on")
    parser.add_argument("--no-access-log", action="store_true")
    parser.add_argument("--relay-src", default="", help="measure this relay tree instead")
    parser.add_argument("--compare", default="", help="A/B: this tree vs DIR, interleaved")
    parser.add_argument("--pyinstrument", default="", help="profile in-process: PREFIX.{txt,html}")
    parser.add_argument(
        "--cold-ms", type=float, default=0.0, help="latency after MS idle (rounds of 100)"
    )
    parser.add_argument("--json", action="store_true", help="print the best rounds as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve_rounds(args)
        return 0
    if args.pyinstrument:
        return pyinstrument_profile(args)
    trees = [("this tree", str(Path(args.relay_src).resolve()) if args.relay_src else "")]
    if args.compare:
        trees.append(("compare", str(Path(args.compare).resolve())))
    if args.cold_ms and args.requests == 3000:
        args.requests = 100  # each request waits --cold-ms first
    children = {label: Child(args, src, args.cpu) for label, src in trees}
    runs: dict[str, list[list[float]]] = {label: [] for label in children}
    deadline = time.monotonic() + 120  # bounded whatever the machine does
    try:
        for _ in range(args.rounds):
            for label, proc in children.items():
                runs[label].append(proc.round(args.requests))
            if time.monotonic() > deadline:
                break
    finally:
        for proc in children.values():
            proc.close()
    if args.cold_ms:
        report_cold(args, runs)
        return 0
    best: dict[str, list[float]] = {}
    for label, items in runs.items():
        best[label] = [min(r[i] for r in items) for i in range(len(WORKLOADS))]
    if args.json:  # for bench.host's host-speed line: {tree: {workload: best µs}}
        document = {
            label: {name: round(b, 2) for (name, _, _), b in zip(WORKLOADS, values, strict=True)}
            for label, values in best.items()
        }
        print(json.dumps(document))
        return 0
    for label, items in runs.items():
        medians = [statistics.median(r[i] for r in items) for i in range(len(WORKLOADS))]
        print(
            f"{label:<10} "
            + ", ".join(
                f"{name}: {b:.1f} µs/req (median {m:.1f})"
                for (name, _, _), b, m in zip(WORKLOADS, best[label], medians, strict=True)
            )
        )
    print(
        f"(user-space CPU per request, no syscalls; best of {len(runs['this tree'])} "
        f"interleaved rounds of {args.requests} on cpu {args.cpu})"
    )
    if args.compare:
        for i, (name, _, _) in enumerate(WORKLOADS):
            ratio = best["compare"][i] / best["this tree"][i]
            print(f"  {name}: compare ÷ this tree = {ratio:.3f}")
    return 0


def pyinstrument_profile(args: argparse.Namespace) -> int:
    """Profile small GETs in this process with pyinstrument; text and HTML reports."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("pyinstrument is not installed: make bench-pyinstrument installs it", file=sys.stderr)
        return 2
    real_stdout = sys.stdout
    relay, upstreams = build(not args.no_access_log)  # points sys.stdout at /dev/null
    drive(relay, upstreams, REQUEST, 18081, 2000)  # warm-up
    profiler = Profiler(interval=0.0001)
    profiler.start()
    per_request = drive(relay, upstreams, REQUEST, 18081, args.requests * 10)
    profiler.stop()
    prefix = Path(args.pyinstrument)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = profiler.output_text(unicode=True, color=False, show_all=False)
    Path(f"{prefix}.txt").write_text(text)
    Path(f"{prefix}.html").write_text(profiler.output_html())
    print(text, file=real_stdout)
    print(
        f"{args.requests * 10} small GETs, {per_request * 1e6:.1f} µs each under the profiler; "
        f"reports: {prefix}.txt, {prefix}.html",
        file=real_stdout,
    )
    return 0


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
