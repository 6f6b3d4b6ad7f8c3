"""Signals in the first moments of ``relay serve`` (found by review): before the event loop's
handlers are in place, a SIGHUP's default action ended relay, with one worker or several
(systemd counts that death as clean, so Restart=on-failure did not bring it back), and a
SIGTERM ended it with -15 instead of a drain and exit 0. They are held until then
(relay.systemd.hold_signals)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.harness import config_data, route, to_toml, write_routes
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def _start(tmp_path: Path, workers: int) -> subprocess.Popen[bytes]:
    data = config_data(tmp_path, {"process": {"workers": workers}}, port=free_port())
    data["admin"]["address"] = f"127.0.0.1:{free_port()}"
    write_routes(tmp_path / "routes.json", [route("box", insecure=True)])
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(data))
    with (tmp_path / "stderr").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--config", str(config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("after_s", [0.1, 0.3])
def test_a_sighup_while_starting_is_a_reload(tmp_path: Path, workers: int, after_s: float) -> None:
    proc = _start(tmp_path, workers)
    try:
        time.sleep(after_s)
        assert proc.poll() is None
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-500:]
    finally:
        assert _stop(proc) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sigterm_while_starting_is_a_stop(tmp_path: Path, workers: int) -> None:
    proc = _start(tmp_path, workers)
    try:
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, (tmp_path / "stderr").read_text()[-500:]
    finally:
        _stop(proc)
