"""sd_notify and the unit file (SPEC §7): the protocol against a fake $NOTIFY_SOCKET with a real
``relay serve``, and ``systemd-analyze verify`` of systemd/relay.service when the tool exists."""

from __future__ import annotations

import asyncio
import configparser
import ctypes
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

from relay.config_parse import load
from relay.systemd import Notifier, message, notify_address, watchdog_interval_s
from tests.support.certs import Issued, issue
from tests.support.harness import DOMAIN, RelayProcess, route, write_routes
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
    assert service["MemoryDenyWriteExecute"] == "yes"  # see the test below
    # An access-log line per request: journald's default 10,000 lines per 30 s would drop them
    # (and relay's warnings) under load, uncounted (found by review).
    assert service["LogRateLimitIntervalSec"] == "0"


# prctl(2): PR_SET_MDWE with PR_MDWE_REFUSE_EXEC_GAIN (Linux 6.3+), the kernel check systemd
# uses for MemoryDenyWriteExecute=yes where it can (a seccomp filter before that, which
# refuses the same mappings and, more broadly, any mprotect() adding PROT_EXEC).
PR_SET_MDWE = 65
PR_MDWE_REFUSE_EXEC_GAIN = 1


def _deny_write_execute() -> None:
    """In a child before exec: no memory both writable and executable, inherited by exec and
    by relay's workers."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MDWE)")


class _NoWriteExecute(RelayProcess):
    def _preexec(self) -> None:
        super()._preexec()
        _deny_write_execute()


def _write_execute_refused() -> bool:
    """Whether this kernel applies PR_SET_MDWE: a W+X mapping made under it fails."""
    probe = (
        "import mmap\n"
        "try:\n"
        "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "except OSError:\n"
        "    raise SystemExit(0)\n"
        "raise SystemExit(1)\n"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe], preexec_fn=_deny_write_execute, timeout=30, check=False
        )
    except subprocess.SubprocessError:  # prctl refused in the child: no PR_SET_MDWE here
        return False
    return result.returncode == 0


async def test_relay_runs_without_writable_executable_memory(tmp_path: Path) -> None:
    """The unit sets MemoryDenyWriteExecute=yes. It was left out because "cffi callbacks (used
    by cryptography) need writable executable memory": cryptography 50 has Rust bindings and
    creates no cffi callback, and nothing else relay loads (CPython 3.11, uvloop, httptools,
    aiohttp, pyroute2, ctypes' libffi with its static trampolines) maps W+X memory (checked
    under strace, with two workers too: no W+X mmap, no mprotect adding PROT_EXEC). This runs
    the paths that load native code under the kernel's check: TLS (memfds, the handshake),
    the source address checked over netlink, a request forwarded and a SIGHUP reload of the
    TLS pair. (With workers each is such a relay; the supervisor adds a Python spawn and a
    read-write mmap.)"""
    if not _write_execute_refused():
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+)")
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    upstream = await asyncio.start_server(_answer_ok, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]
    overrides: dict[str, dict[str, Any]] = {
        "listen": {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)},
        "upstream": {"source_address": "127.0.0.1"},
        "process": {"drain_timeout_s": 1},
    }
    relay = _NoWriteExecute(tmp_path, [route("wx", insecure=True)], overrides)
    try:
        relay.start(timeout=20)
        assert await _get_over_tls(relay.port, f"{port}-wx.{DOMAIN}", certs) == b"HTTP/1.1 200"
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        for _ in range(100):
            if "TLS certificate loaded" in relay.output():  # logged by a reload
                break
            await asyncio.sleep(0.05)
        assert "TLS certificate loaded" in relay.output(), relay.output()
        assert await _get_over_tls(relay.port, f"{port}-wx.{DOMAIN}", certs) == b"HTTP/1.1 200"
        relay.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.proc.wait, 15) == 0
    finally:
        relay.stop()
        upstream.close()
        await upstream.wait_closed()
    assert "Traceback" not in relay.output()


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()


async def _get_over_tls(relay_port: int, host: str, certs: Issued) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", relay_port, ssl=certs.client_context(), server_hostname=host
    )
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    return data[:12]


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
