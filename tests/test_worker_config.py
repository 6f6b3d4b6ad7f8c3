"""A worker its supervisor restarts runs what its siblings run, not the file as it is now
(relay.lifecycle.save_effective_config; found by review): restart-only keys keep their
running value, and a file broken since the last good reload does not keep it from starting."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from relay.config import load
from relay.lifecycle import RUN_DIR_ENV, WORKER_ENV, effective_config, save_effective_config
from relay.reload import plan
from tests.support.certs import issue
from tests.support.harness import DOMAIN, RelayProcess, route, tls_listener, write_routes
from tests.support.ops import get, value
from tests.support.rawhttp import request


def test_the_saved_configuration_reads_back_with_the_files_paths(tmp_path: Path) -> None:
    config_file = tmp_path / "etc" / "relay.toml"
    config_file.parent.mkdir()
    config_file.write_text(
        '[routes]\nfile = "routes.json"\nmax_stale_s = 5.0\n'
        '[upstream]\ndenied_ports = [1, 2]\n[listen]\naddress = ["127.0.0.1:1", "[::1]:1"]\n'
    )
    started = load(config_file)
    config_file.write_text('[routes]\nfile = "other.json"\nmax_stale_s = 9.0\n')
    running = plan(started, load(config_file)).config  # after a SIGHUP
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_effective_config(run_dir, running, None)
    assert (run_dir / "config.json").stat().st_mode & 0o777 == 0o600
    env = {WORKER_ENV: "1", RUN_DIR_ENV: str(run_dir)}
    config_file.write_text("not = = toml")  # broken since
    restarted = effective_config(env, str(config_file))
    assert restarted == running
    assert restarted is not None
    assert restarted.routes.file == "routes.json"  # restart-only: as at start
    assert restarted.routes.max_stale_s == 9.0  # reloadable: as last reloaded
    assert restarted.path(restarted.routes.file) == config_file.parent / "routes.json"
    assert restarted.source == config_file.resolve()  # the next SIGHUP reads the file
    assert effective_config({}, str(config_file)) is None  # a single relay reads the file
    assert effective_config({**env, RUN_DIR_ENV: str(tmp_path)}, str(config_file)) is None


def test_a_save_that_fails_leaves_no_older_one_behind(tmp_path: Path) -> None:
    """A restarted worker would otherwise run settings its siblings dropped at the reload
    whose save failed (access controls among them): it reads the file instead."""
    config_file = tmp_path / "relay.toml"
    config_file.write_text("[upstream]\ndenied_ports = [1]\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_effective_config(run_dir, load(config_file), None)
    env = {WORKER_ENV: "0", RUN_DIR_ENV: str(run_dir)}
    assert effective_config(env, str(config_file)) is not None
    (run_dir / f".config.json.{os.getpid()}").mkdir()  # the next write fails, as on ENOSPC
    save_effective_config(run_dir, load(config_file), None)
    assert effective_config(env, str(config_file)) is None


async def _upstream() -> TestServer:
    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", ok)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _ready_pids(relay: RelayProcess, within: float, exclude: int = 0) -> list[int] | None:
    deadline = time.monotonic() + within
    while True:
        status, body = await get(relay.admin_port, "/readyz")
        pids = [w["pid"] for w in json.loads(body)["workers"]]
        if status == 200 and None not in pids and exclude not in pids:
            return pids
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)


async def test_a_restarted_worker_keeps_the_running_routes_file(tmp_path: Path) -> None:
    """routes.file is restart-only: after a SIGHUP every worker keeps serving the old file,
    the restarted one too (before: it read the new file, and half the requests got 502)."""
    upstream = await _upstream()
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], {"process": {"workers": 2}})
    relay.start(timeout=20)
    try:
        write_routes(tmp_path / "other.json", [route("sbxb", insecure=True)])
        config_file = tmp_path / "relay.toml"
        text = config_file.read_text()
        config_file.write_text(text.replace(str(tmp_path / "routes.json"), "other.json"))
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
        pids = await _ready_pids(relay, 15)
        assert pids
        os.kill(pids[0], signal.SIGKILL)
        assert await _ready_pids(relay, 15, exclude=pids[0]), relay.output()[-3000:]
        host = f"{upstream.port}-sbxa.{DOMAIN}"
        statuses = {(await request(relay.port, "GET", "/", host)).status for _ in range(40)}
    finally:
        relay.stop()
        await upstream.close()
    assert statuses == {200}, relay.output()[-2000:]


async def test_a_worker_restarted_after_a_refused_reload_comes_back(tmp_path: Path) -> None:
    """The file broke and the reload was refused (both workers keep running, counted); a
    worker that dies then starts with the running configuration instead of failing on the
    file until someone mends it."""
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], {"process": {"workers": 2}})
    relay.start(timeout=20)
    try:
        config_file = tmp_path / "relay.toml"
        config_file.write_text(config_file.read_text() + "\nbogus_key = 1\n")
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.5)
        text = (await get(relay.admin_port, "/metrics"))[1].decode()
        assert value(text, "relay_reloads_total", result="error") == 2  # one per worker
        pids = await _ready_pids(relay, 15)
        assert pids
        os.kill(pids[0], signal.SIGKILL)
        back = await _ready_pids(relay, 6, exclude=pids[0])
    finally:
        relay.stop()
    assert back, relay.output()[-3000:]


def _half_written_renewal(directory: Path, cert_file: Path) -> None:
    directory.mkdir()
    cert_file.write_bytes(issue(directory, [f"*.{DOMAIN}"]).cert_file.read_bytes())


async def test_a_worker_restarted_after_a_refused_tls_pair_serves_the_running_one(
    tmp_path: Path,
) -> None:
    """A renewal half written (the new certificate over the old one, not yet its key) is
    refused by the reload, and the workers keep serving the pair they loaded; a worker that
    dies then starts with those bytes (saved in the run directory), not the files."""
    overrides, _ = tls_listener(tmp_path)
    overrides["process"] = {"workers": 2}
    relay = RelayProcess(tmp_path, [route("sbxa", insecure=True)], overrides)
    relay.start(timeout=20)
    try:
        _half_written_renewal(tmp_path / "other", Path(overrides["listen"]["tls_cert"]))
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.5)
        text = (await get(relay.admin_port, "/metrics"))[1].decode()
        assert value(text, "relay_tls_reloads_total", result="error") == 2
        pids = await _ready_pids(relay, 15)
        assert pids
        os.kill(pids[0], signal.SIGKILL)
        back = await _ready_pids(relay, 8, exclude=pids[0])
    finally:
        relay.stop()
    assert back, relay.output()[-3000:]
