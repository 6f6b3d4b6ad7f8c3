"""Signals in the first moments of ``relay serve`` (found by review): before the event loop's
handlers are in place, a SIGHUP's default action ended relay, with one worker or several
(systemd counts that death as clean, so Restart=on-failure did not bring it back), and a
SIGTERM ended it with -15 instead of a drain and exit 0. They are held until then
(relay.systemd.hold_signals)."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.harness import config_data, route, to_toml, write_routes
from tests.support.ops import blocked_signals
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


# What pip's console script (/usr/local/bin/relay, systemd's ExecStart) does: it imports
# relay.__main__ as a module (found by review: the hold ran only under `python -m relay`).
CONSOLE_SCRIPT = "import sys\nfrom relay.__main__ import main\nsys.exit(main())\n"
LAUNCHERS = {"module": ["-m", "relay"], "console-script": ["-c", CONSOLE_SCRIPT]}


def _config(tmp_path: Path, workers: int, **sections: dict[str, object]) -> Path:
    data = config_data(tmp_path, {"process": {"workers": workers}, **sections}, port=free_port())
    data["admin"]["address"] = f"127.0.0.1:{free_port()}"
    write_routes(tmp_path / "routes.json", [route("box", insecure=True)])
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(data))
    return config


def _start(tmp_path: Path, workers: int, launcher: str = "module") -> subprocess.Popen[bytes]:
    config = _config(tmp_path, workers)
    with (tmp_path / "stderr").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, *LAUNCHERS[launcher], "serve", "--config", str(config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _held(proc: subprocess.Popen[bytes], within_s: float = 10.0) -> None:
    """Wait until the child catches SIGHUP and SIGTERM (SigCgt in /proc), and check that it
    did so before its event loop existed: uvloop is not loaded yet (/proc/PID/maps). Without
    relay.systemd.hold_signals they are caught only once the loop's handlers are in place, so
    this fails; with it, a signal sent now lands during relay's imports. Waiting for the hold,
    not a fixed delay from the spawn: on a loaded machine the interpreter's own start took
    longer than 0.1 s, and a signal before any code of relay's ran killed the child."""
    mask = 1 << (signal.SIGHUP - 1) | 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:  # bounded
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["SigCgt"], 16) & mask == mask:
            assert "uvloop" not in Path(f"/proc/{proc.pid}/maps").read_text()
            return
        time.sleep(0.001)
    raise AssertionError("the child never caught SIGHUP and SIGTERM")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("after_s", [0.0, 0.2])
def test_a_sighup_while_starting_is_a_reload(
    tmp_path: Path, workers: int, after_s: float, launcher: str
) -> None:
    proc = _start(tmp_path, workers, launcher)
    try:
        _held(proc)
        time.sleep(after_s)  # during relay's imports (~0.1-0.3 s), before the loop's handlers
        assert proc.poll() is None
        proc.send_signal(signal.SIGHUP)
        # Until every process logged the reload (a supervisor forwards it to its workers once
        # they are ready): the SIGHUP was taken, not its default action (bounded: 10 s).
        logged = 1 + workers if workers > 1 else 1
        deadline = time.monotonic() + 10
        while (tmp_path / "stderr").read_text().count("reload requested") < logged:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-500:]
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-500:]
            time.sleep(0.02)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-500:]
    finally:
        assert _stop(proc) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sigterm_while_starting_is_a_stop(tmp_path: Path, workers: int) -> None:
    proc = _start(tmp_path, workers)
    try:
        _held(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, (tmp_path / "stderr").read_text()[-500:]
    finally:
        _stop(proc)


def _read_until(proc: subprocess.Popen[bytes], text: bytes, seen: bytearray) -> None:
    """Read the child's stderr into ``seen`` until ``text`` is in it (bounded: 15 s)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + 15
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} in: {seen[-500:]!r}"
        if select.select([proc.stderr], [], [], left)[0]:
            chunk = os.read(proc.stderr.fileno(), 65536)
            assert chunk, f"stderr closed without {text!r}: {seen[-500:]!r}"
            seen += chunk


def _serve_piped(config: Path) -> subprocess.Popen[bytes]:
    """``relay serve`` with its stderr on a pipe (read with _read_until)."""
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _interrupted(tmp_path: Path, workers: int, wait_for: bytes, delay_s: float) -> bytes:
    """Start relay serve with its stderr on a pipe, wait for ``wait_for`` there (b"" for the
    signal hold, as _held), sleep ``delay_s``, send SIGINT (a terminal's Ctrl-C), then wait
    for the exit: it must be the stop's 0 (docs/operations.md, "Stopping": SIGINT is
    SIGTERM's twin). Returns the whole stderr."""
    config = _config(tmp_path, workers)
    proc = _serve_piped(config)
    seen = bytearray()
    try:
        if wait_for:
            _read_until(proc, wait_for, seen)
            proc.send_signal(signal.SIGTERM)
            # The last line of the process (the supervisor's, not a worker's "stopped").
            _read_until(proc, b"supervisor stopped\n" if workers > 1 else b" stopped\n", seen)
        else:
            _held(proc)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=15)
        seen += rest
        assert proc.returncode == 0, bytes(seen[-800:]).decode(errors="replace")
        return bytes(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_ctrl_c_while_starting_is_a_quiet_stop(tmp_path: Path) -> None:
    """Found by review: SIGINT was not held with SIGHUP and SIGTERM (relay.systemd), so a
    Ctrl-C in the first moments of relay serve (its imports, ~0.1-0.4 s; Relay.start) raised
    KeyboardInterrupt wherever Python was: a traceback and exit -2. Now it is a stop, taken
    once the loop's handlers are in place. Sent from the hold on, every 0.1 s up to 0.4 s."""
    for step in range(5):  # bounded: five starts
        err = _interrupted(tmp_path, 1, b"", step * 0.1)
        assert b"Traceback" not in err, err[-800:].decode(errors="replace")


@pytest.mark.parametrize(("workers", "delays_s"), [(1, (0.002, 0.005, 0.01)), (2, (0.005,))])
def test_a_ctrl_c_at_the_end_of_a_stop_is_quiet(
    tmp_path: Path, workers: int, delays_s: tuple[float, ...]
) -> None:
    """Found by review: once relay had stopped, the loop's handlers were removed, which gives
    SIGINT back to Python's KeyboardInterrupt (and SIGTERM and SIGHUP to their default
    actions): a Ctrl-C in the last ~20 ms of a lone relay's exit (the supervisor's: its
    admin's cleanup too) printed a traceback from the loop's close and exited -2. Sent
    2-10 ms after relay's last log line."""
    for delay_s in delays_s:  # bounded: three starts, or one of a supervisor and workers
        err = _interrupted(tmp_path, workers, b"ready", delay_s)
        assert b"Traceback" not in err, err[-800:].decode(errors="replace")


WRAPPER = (
    "import sys\nfrom relay.__main__ import main\n"
    "sys.exit(main(['routes', 'put', sys.argv[2], '--config', sys.argv[3]]))\n"
)


def _waits_for_a_lock(pid: int) -> bool:
    """Whether ``pid`` is blocked on a file lock: a "->" line of /proc/locks (proc(5)), as
    "1: -> FLOCK  ADVISORY  WRITE 4242 00:2e:1234 0 EOF"."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "->" and fields[5] == str(pid):
            return True
    return False


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(["-m", "relay", "routes", "put"], id="routes-put"),
        # the hold follows argv, which names serve here, while main() is given another command
        pytest.param(["-c", WRAPPER, "serve"], id="serve-argv-other-command"),
    ],
)
def test_other_commands_keep_the_default_signal_actions(tmp_path: Path, launch: list[str]) -> None:
    """Found by review, twice: signals were held for every command, and only serve's event loop
    takes them, so a `relay routes put` waiting for the routes file's lock ignored SIGTERM; then
    so did one run by a wrapper's main([...]) from a process whose argv named serve."""
    config = tmp_path / "relay.toml"
    config.write_text('[routes]\nsource = "file"\nfile = "routes.json"\n')
    (tmp_path / "routes.json").write_text('{"routes": []}')
    one = tmp_path / "one.json"
    one.write_text(json.dumps(route("aaa", insecure=True)))
    lock = os.open(tmp_path / ".routes.json.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the put waits for it
    tail = ["--config", str(config)] if launch[0] == "-m" else [str(config)]
    proc = subprocess.Popen(
        [sys.executable, *launch, str(one), *tail],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _waits_for_a_lock(proc.pid):  # bounded: 10 s
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the put never waited for the lock"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(lock)


def _blocked_by_thread(pid: int) -> dict[str, set[int]]:
    """Each thread of ``pid`` but its main one (name and id): the signals it blocks (SigBlk)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name == str(pid):
            continue
        name = (task / "comm").read_text().strip()
        out[f"{name} {task.name}"] = blocked_signals(task)
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_no_thread_but_the_main_one_takes_the_stop_signals(tmp_path: Path, workers: int) -> None:
    """relay.systemd.end_loop_handlers blocks SIGTERM, SIGINT and SIGHUP in the main thread
    while their default actions are back for a moment; the kernel then gives one to any other
    thread that does not block it, where SIGTERM's default action ends relay (-15) and SIGINT
    raises KeyboardInterrupt. Found by review: the writer threads block every signal, but
    libuv's threadpool (uvloop starts its 4 threads at the first create_server or
    getaddrinfo, in every relay serve, the supervisor's included) blocked none: SIGTERM sent
    without pause to a loop of end_loop_handlers ended it at once with the pool started, never
    without it. The loop's default executor likewise (its thread resolves
    upstream.source_address, relay.netlink)."""
    config = _config(tmp_path, workers, upstream={"source_address": "127.0.0.1"})
    proc = _serve_piped(config)
    seen = bytearray()
    try:
        _read_until(proc, b"all 2 workers ready" if workers > 1 else b"ready", seen)
        pids = [proc.pid]
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pids += [int(child) for child in children]
        assert len(pids) == workers + (workers > 1)
        wanted = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        for pid in pids:
            threads = _blocked_by_thread(pid)
            assert any(name.startswith("libuv-worker") for name in threads)
            if pid != proc.pid or workers == 1:  # serving: the log's and the executor's too
                assert len([name for name in threads if name.startswith("python")]) >= 2
            takers = [name for name, blocked in threads.items() if not wanted <= blocked]
            assert takers == [], f"pid {pid}: threads that take SIGTERM/SIGINT/SIGHUP: {takers}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
