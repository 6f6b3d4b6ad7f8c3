"""sd_notify and the unit file (SPEC §7): the protocol against a fake $NOTIFY_SOCKET with a real
``relay serve``, and ``systemd-analyze verify`` of systemd/relay.service when the tool exists."""

from __future__ import annotations

import asyncio
import configparser
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relay.config import load
from relay.systemd import Notifier, message, notify_address, watchdog_interval_s
from tests.support.harness import RelayProcess, route, write_routes
from tests.support.ops import NotifySocket, get

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "relay.service"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/run/systemd/notify", "/run/systemd/notify"),
        ("@abstract", "\0abstract"),
        ("relative/path", None),
        ("", None),
    ],
    ids=["path", "abstract", "relative", "unset"],
)
def test_notify_address(value: str, expected: str | None) -> None:
    assert notify_address({"NOTIFY_SOCKET": value}) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "43"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
    ids=["half", "our-pid", "other-pid", "zero", "garbage", "unset"],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env, 42) == expected


def test_message_keeps_one_assignment_per_line() -> None:
    assert message(READY=1, STATUS="a\nWATCHDOG=1") == b"READY=1\nSTATUS=a WATCHDOG=1"


def test_notifier_sends_to_an_abstract_socket() -> None:
    name = f"relay-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(1)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready("up")
        assert sock.recv(100) == b"READY=1\nSTATUS=up"
        assert notifier.reloading()
        assert sock.recv(100).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        notifier.close()


def test_notifier_without_a_socket_is_silent() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()


def test_notifier_survives_a_missing_socket(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not notifier.stopping()  # logged at debug level, never raised
    notifier.close()


async def test_notify_protocol_with_a_real_relay(tmp_path: Path) -> None:
    """READY=1 only once /readyz is 200 and the data port accepts; WATCHDOG=1 at half of
    WATCHDOG_USEC; RELOADING=1 then READY=1 on SIGHUP; STOPPING=1 on SIGTERM; exit 0."""
    notify = NotifySocket(tmp_path / "notify.sock")
    env = {k: v for k, v in os.environ.items() if k != "WATCHDOG_PID"}
    env.update(NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="400000")
    later = tmp_path / "later.json"  # the route table is not there yet: relay is not ready
    overrides: dict[str, dict[str, Any]] = {
        "routes": {"file": str(later)},
        "process": {"drain_timeout_s": 1},
    }
    relay = RelayProcess(tmp_path, [], overrides, env=env)
    try:
        relay.start(until_ready=False)
        await asyncio.sleep(0.5)
        assert "READY" not in notify.names()
        assert (await get(relay.admin_port, "/readyz"))[0] == 503
        write_routes(later, [route("sbx1", insecure=True)])
        ready = await notify.wait_for("READY")
        assert (await get(relay.admin_port, "/readyz"))[0] == 200
        with socket.create_connection(("127.0.0.1", relay.port), timeout=1):
            pass
        assert "1 route(s)" in ready["STATUS"]
        await asyncio.sleep(0.5)
        notify.drain()
        pings = [t for t, m in notify.messages if "WATCHDOG" in m]
        assert len(pings) >= 3  # every 0.2 s
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        reloading = await notify.wait_for("RELOADING")
        assert int(reloading["MONOTONIC_USEC"]) > 0
        await notify.wait_for("READY")
        relay.proc.send_signal(signal.SIGTERM)
        await notify.wait_for("STOPPING")
        code = await asyncio.to_thread(relay.proc.wait, 10)
        assert code == 0
    finally:
        relay.stop()
        notify.close()
    order = [k for _, m in notify.messages for k in m if k in ("READY", "RELOADING", "STOPPING")]
    assert order == ["READY", "RELOADING", "READY", "STOPPING"]


def _unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read(UNIT)
    return parser


def test_unit_file_settings() -> None:
    unit = _unit()
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert "relay serve --config" in service["ExecStart"]
    default_drain = load(ROOT / "config" / "relay.toml").process.drain_timeout_s
    assert float(service["TimeoutStopSec"]) > default_drain
    assert int(service["LimitNOFILE"]) >= 65536
    assert service["CapabilityBoundingSet"] == "CAP_NET_BIND_SERVICE"
    assert service["AmbientCapabilities"] == "CAP_NET_BIND_SERVICE"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert service[key] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["User"] == "relay"
    assert set(service["RestrictAddressFamilies"].split()) == {
        "AF_INET",
        "AF_INET6",
        "AF_UNIX",
        "AF_NETLINK",
    }
    assert "WatchdogSec" in service


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        print("systemd-analyze not installed (apt-get install systemd): not verifying the unit")
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart= exists: point it at this checkout's relay script.
    relay_bin = Path(sys.executable).with_name("relay")
    assert relay_bin.exists()
    text = UNIT.read_text().replace("/usr/local/bin/relay", str(relay_bin))
    unit = tmp_path / "relay.service"
    unit.write_text(text)
    result = subprocess.run(
        [tool, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "relay.service" not in result.stderr, result.stderr


async def test_a_sighup_before_the_routes_are_ready_sends_no_ready(tmp_path: Path) -> None:
    """Found by review: a SIGHUP before the first route table (a routes file not valid yet,
    which is no start-up error) made a single relay send RELOADING=1 and READY=1, and systemd
    took it for started while /readyz was 503 (SPEC §7). The supervisor already held it back."""
    notify = NotifySocket(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=str(notify.path))
    pending = tmp_path / "pending.json"
    pending.write_text("not a routes file yet")
    relay = RelayProcess(tmp_path, [], {"routes": {"file": str(pending)}}, env=env)
    try:
        relay.start(until_ready=False)
        assert relay.proc is not None
        await asyncio.sleep(0.5)
        status, _ = await get(relay.admin_port, "/readyz")
        assert status == 503
        notify.drain()
        relay.proc.send_signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
        status, _ = await get(relay.admin_port, "/readyz")
        assert status == 503
        assert "READY" not in notify.names(), [m for _, m in notify.messages]
        write_routes(pending, [route("late", insecure=True)])  # the table arrives: READY=1
        for _ in range(50):
            notify.drain()
            if "READY" in notify.names():
                break
            await asyncio.sleep(0.1)
        assert "READY" in notify.names()
    finally:
        relay.stop()
        notify.close()
