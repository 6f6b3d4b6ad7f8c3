"""Signals while relay drains (SPEC §7): a SIGHUP is ignored, a second SIGTERM or SIGINT cuts
the drain short, and neither kills the process with its default action (found by review:
the SIGHUP and SIGINT handlers were removed when the drain began)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.harness import DOMAIN, RelayProcess, relay_process, route, until
from tests.support.ops import get
from tests.support.rawhttp import Connection, request_bytes


async def _streaming_upstream(events: int) -> TestServer:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(events):
            await response.write(b"event %d\n" % i)
            await asyncio.sleep(0.05)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _streaming(relay: RelayProcess, upstream: TestServer) -> Connection:
    """A client connection with the upstream's stream under way through ``relay``."""
    conn = await Connection.open(relay.port)
    await conn.send(request_bytes("GET", "/stream", f"{upstream.port}-sbx1.{DOMAIN}"))
    await conn.pump(0.3)
    return conn


async def _exit_code(relay: RelayProcess, within: float) -> int | None:
    proc = relay.proc
    assert proc is not None
    await until(lambda: proc.poll() is not None, within)
    return proc.returncode


async def _two_signals(
    tmp_path: Path,
    events: int,
    drain_s: int,
    signals: tuple[signal.Signals, signal.Signals],
    exit_within_s: float,
) -> tuple[bytes, int | None, str]:
    """A stream of ``events`` through a single relay, two signals 0.3 s apart: what the
    client got, the exit code (waited for up to ``exit_within_s``) and relay's output."""
    first, second = signals
    upstream = await _streaming_upstream(events)
    try:
        overrides = {"process": {"drain_timeout_s": drain_s}}
        with relay_process(tmp_path, [route("sbx1", insecure=True)], overrides) as relay:
            conn = await _streaming(relay, upstream)
            assert relay.proc is not None
            relay.proc.send_signal(first)  # the drain starts
            await asyncio.sleep(0.3)
            relay.proc.send_signal(second)
            streamed = await conn.read_response(5)
            await conn.close()
            code = await _exit_code(relay, exit_within_s)
            return streamed.body, code, relay.output()
    finally:
        await upstream.close()


async def test_a_sighup_during_the_drain_is_ignored(tmp_path: Path) -> None:
    # systemctl reload, or a logrotate hook, while relay drains: the stream goes on.
    body, code, out = await _two_signals(tmp_path, 30, 10, (signal.SIGTERM, signal.SIGHUP), 10)
    assert body.count(b"event ") == 30, out[-2000:]
    assert code == 0, out[-2000:]
    assert "SIGHUP ignored: relay is draining" in out


async def test_a_second_sigint_cuts_the_drain_short(tmp_path: Path) -> None:
    # Ctrl-C, and again: the drain of a 10 s stream is cut short.
    _, code, out = await _two_signals(tmp_path, 200, 20, (signal.SIGINT, signal.SIGINT), 5)
    assert code == 0, out[-2500:]
    assert "Traceback" not in out, out[-2500:]


async def test_one_ctrl_c_to_a_supervisor_and_its_workers_drains(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole process group: each worker drains on its own
    SIGINT, and the supervisor's SIGTERM that follows is not a second signal (before, it cut
    every stream at once). A second Ctrl-C reaches the workers as WORKER_FORCE_SIGNAL."""
    upstream = await _streaming_upstream(30)
    overrides = {"process": {"workers": 2, "drain_timeout_s": 10}}
    relay = RelayProcess(tmp_path, [route("sbx1", insecure=True)], overrides)
    relay.start(timeout=20)
    try:
        _, body = await get(relay.admin_port, "/readyz")
        pids = [worker["pid"] for worker in json.loads(body)["workers"]]
        conn = await _streaming(relay, upstream)
        assert relay.proc is not None
        for pid in [relay.proc.pid, *pids]:
            os.kill(pid, signal.SIGINT)
        streamed = await conn.read_response(8)
        await conn.close()
        code = await _exit_code(relay, 15)
    finally:
        relay.stop()
        await upstream.close()
    out = relay.output()
    assert streamed.body.count(b"event ") == 30, out[-2500:]
    assert code == 0, out[-2500:]
