"""A stalled standard error must not stall the data path (relay.errorlog's writer thread).

Under systemd standard error is journald's stream socket; when journald stalls (a full disk,
load) or stderr is a pipe whose reader stopped (``relay serve 2>&1 | slow-reader``, a terminal
paused with Ctrl-S), a write to it blocks. Found by review: logging wrote from the event loop,
so every warning relay logged then stopped every sandbox's traffic, as the access log's writes
to standard output did before relay.accesswriter.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import signal
import socket
import threading
import time
import types
import urllib.request
from pathlib import Path
from typing import BinaryIO

import pytest

from relay import accesswriter, errorlog
from tests.support.harness import RelayProcess, write_routes
from tests.support.ops import blocked_signals

REJECTED = 400  # warnings of ~3 KB: 1.2 MB, past the writer's 1 MiB limit
FIELD = "x" * 3000  # an unknown field: the warning names it


def _metric(relay: RelayProcess, name: str) -> float:
    url = f"http://127.0.0.1:{relay.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as answer:
        text: str = answer.read().decode()
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    return 0.0  # a family with labels has no sample before its first count


def _answered(relay: RelayProcess) -> int:
    """The status of a request for an unknown sandbox, which relay answers itself (404)."""
    with socket.create_connection(("127.0.0.1", relay.port), timeout=2) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: nowhere.example\r\nConnection: close\r\n\r\n")
        return int(conn.recv(100).split()[1])


def test_a_stderr_nobody_reads_does_not_stall_requests_or_the_exit(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()  # read only once the stall has been shown
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: one page
    relay = RelayProcess(tmp_path, [], stderr_fd=write_fd)
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(_read_all(read_fd)), daemon=True)
    try:
        relay.start()  # its start-up lines fit in the pipe
        os.close(write_fd)
        write_fd = -1
        # 400 warnings in one turn of the loop: the pipe is full after the first.
        rejected = [
            {"sandbox_id": f"r{i:04d}", "address": "127.0.0.1", FIELD: 1} for i in range(REJECTED)
        ]
        write_routes(relay.routes_file, rejected)
        deadline = time.monotonic() + 5
        while _metric(relay, "relay_route_rejections_total") < REJECTED:  # the loop answers
            assert time.monotonic() < deadline, "the routes file was not read"
            time.sleep(0.05)
        asked = time.monotonic()
        assert _answered(relay) == 404
        assert time.monotonic() - asked < 1.0
        # Beyond 1 MiB waiting, whole lines are dropped and counted.
        dropped = _metric(relay, "relay_log_dropped_lines_total")
        assert 0 < dropped < REJECTED
        reader.start()  # the reader is back: what waits is written, and so is the rest
        _settle(got)
        assert relay.proc is not None
        started = time.monotonic()
        relay.proc.send_signal(signal.SIGTERM)
        assert relay.proc.wait(timeout=8) == 0
        assert time.monotonic() - started < 3
        reader.join(5)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        if not reader.is_alive() and not reader.ident:
            os.close(read_fd)  # a relay still blocked on the pipe gets EPIPE and can stop
        relay.stop()
    lines = bytes(got).decode().splitlines()
    # Whole lines, in order, with a gap where lines were dropped, and the notice saying so.
    ids = [m[1] for line in lines if (m := re.search(r"sandbox_id=(r\d+) reason=unknown", line))]
    assert ids == sorted(ids)
    assert all(line.endswith("x" * 3000) for line in lines if "sandbox_id=r" in line)
    told = [int(m[1]) for line in lines if (m := re.search(r"(\d+) log line\(s\) dropped", line))]
    assert told == [dropped]
    assert len(ids) + dropped == REJECTED
    assert lines[-1].endswith(" stopped")  # nothing lost at the exit


def _settle(got: bytearray) -> None:
    """Until ``got`` has stopped growing (the writer's queue is empty)."""
    deadline = time.monotonic() + 5
    size = -1
    while size != len(got) and time.monotonic() < deadline:
        size = len(got)
        time.sleep(0.3)


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read()


def _handler(stream: BinaryIO, limit: int = errorlog.LIMIT) -> errorlog.StderrHandler:
    handler = errorlog.StderrHandler(stream, limit=limit)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    return handler


def _logger(handler: logging.Handler) -> logging.Logger:
    """A logger of the test's own, writing to ``handler`` only (caplog keeps the root's)."""
    logger = logging.getLogger(f"relay-test-{id(handler)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger


def test_beyond_the_limit_whole_lines_are_dropped_counted_and_told_once() -> None:
    # A real pipe nobody reads at first, a real writer thread, a 16 KiB limit: the pipe takes
    # 64 KiB, the queue 16 KiB more; every later record is dropped whole, the newest first.
    read_fd, write_fd = os.pipe()
    stream = open(write_fd, "wb")  # noqa: SIM115 - closed below
    handler = _handler(stream, limit=16 * 1024)
    logger = _logger(handler)
    records = 200
    for i in range(records):
        logger.warning("line %04d %s", i, "y" * 1000)  # ~1 KB
    # The thread has no say in what is kept: the loop's side decides, and never waits.
    dropped = handler.dropped
    assert 0 < dropped < records
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(_read_all(read_fd)))
    reader.start()
    _settle(got)
    logger.warning("after")  # standard error takes lines again: told first
    assert handler.finish(timeout=5)
    stream.close()
    reader.join(5)
    lines = bytes(got).decode().splitlines()
    numbers = [int(m[1]) for line in lines if (m := re.match(r"WARNING line (\d+) y+$", line))]
    assert numbers == list(range(len(numbers)))  # in order, and the newest were dropped
    assert len(numbers) + dropped == records
    assert lines[-2:] == [
        f"WARNING {dropped} log line(s) dropped (standard error is not keeping up: 16 KiB"
        " waiting); relay_log_dropped_lines_total counts them",
        "WARNING after",
    ]
    assert handler.dropped == dropped


def test_a_stalled_stderr_holds_the_exit_a_bounded_time_and_counts_the_rest() -> None:
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)
    with open(write_fd, "wb") as stream:
        handler = _handler(stream)
        logger = _logger(handler)
        for i in range(10):
            logger.error("line %d %s", i, "z" * 1000)  # the pipe takes 4
        started = time.monotonic()
        assert not handler.finish(timeout=0.3)
        assert time.monotonic() - started < 1
        assert handler.dropped == 6
        logger.error("later")  # relay is exiting: dropped at once, counted
        assert handler.dropped == 7
        data = os.read(read_fd, 65536)
    os.close(read_fd)
    assert [line.split()[2] for line in data.decode().splitlines()] == ["0", "1", "2", "3"]


class _Unstartable(threading.Thread):
    """A thread the system does not start: ``Thread.start`` raises so at RLIMIT_NPROC or a
    cgroup's pids.max (systemd's TasksMax), from the EAGAIN of ``pthread_create``."""

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_without_a_thread_the_lines_are_written_directly_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # relay.accesswriter's own name for the module: no other thread of this process is touched.
    fake = types.SimpleNamespace(Thread=_Unstartable, Event=threading.Event)
    monkeypatch.setattr(accesswriter, "threading", fake)
    stream = io.BytesIO()
    handler = _handler(stream)
    logger = _logger(handler)
    logger.warning("one")
    assert stream.getvalue() == b"WARNING one\n"  # at once, by the caller; nothing raised
    try:
        raise ValueError("two")
    except ValueError:
        logger.exception("traceback")
    errorlog_say(handler, "relay: cannot start: three")
    assert handler.finish(timeout=1)
    text = stream.getvalue().decode()
    assert text.startswith("WARNING one\nERROR traceback\nTraceback (most recent call last):\n")
    assert text.endswith("ValueError: two\nrelay: cannot start: three\n")
    assert handler.dropped == 0


def errorlog_say(handler: errorlog.StderrHandler, line: str) -> None:
    """``errorlog.say`` with ``handler`` as relay serve's."""
    saved = errorlog._handler
    errorlog._handler = handler
    try:
        errorlog.say(line)
    finally:
        errorlog._handler = saved


def _blocked(native_id: int) -> set[int]:
    """The signals a thread of this process blocks."""
    return blocked_signals(Path(f"/proc/self/task/{native_id}"))


def test_the_writer_thread_takes_no_signal() -> None:
    """A signal the kernel gives the writer thread rather than the main one is handled by
    its default action there, while relay takes it off the loop's handlers at exit
    (relay.systemd.end_loop_handlers blocks them in the main thread only, for that window):
    a SIGTERM or a Ctrl-C in it killed relay. The thread starts at the first log line, so it
    runs in every relay serve; the access log's likewise once a line is logged."""
    read_fd, write_fd = os.pipe()
    with open(write_fd, "wb") as stream:
        handler = _handler(stream)
        _logger(handler).warning("one")
        thread = handler.writer.thread
        assert thread is not None
        assert thread.native_id is not None
        blocked = _blocked(thread.native_id)
        assert handler.finish(timeout=1)
    os.close(read_fd)
    wanted = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
    assert wanted <= blocked
    assert signal.SIGTERM not in _blocked(threading.main_thread().native_id or 0)
