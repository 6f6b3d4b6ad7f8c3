"""A stalled access-log sink must not stall the data path (relay.accesslog's writer thread).

Under systemd standard output is a pipe or socket to journald; when its reader stalls
(journald busy or stuck, ``relay serve | slow-reader``, a terminal paused with Ctrl-S) a write
to it blocks. Found by review: the access log wrote from the event loop, so a full pipe
stopped every sandbox's traffic until the reader came back, and kept relay from exiting.
"""

from __future__ import annotations

import io
import json
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

import pytest

from relay import accesswriter
from relay.accesslog import AccessLog
from relay.core.answers import log_members
from tests.support.harness import RelayProcess

# A path logged whole (paths are cut at 2,048 JSON characters): a line of ~2.2 KB, so that the
# pipe's 64 KiB fill within ~30 requests and the writer's 8 MiB limit within ~3,800.
PATH = "/" + "x" * 2000
FILL = 4_500


REQUEST = f"GET {PATH} HTTP/1.1\r\nHost: nowhere.example\r\n\r\n".encode()
BATCH = 100  # pipelined: ~200 KiB of requests and ~25 KiB of answers at a time


def _ask(conn: socket.socket, count: int) -> list[int]:
    """Statuses of ``count`` pipelined requests for an unknown sandbox, which relay answers
    (404) and logs itself; the socket's timeout bounds the wait."""
    conn.sendall(REQUEST * count)
    statuses: list[int] = []
    data = b""
    while len(statuses) < count:
        end = data.find(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", data[:end]) if end >= 0 else None
        if length is None or len(data) < end + 4 + int(length[1]):
            chunk = conn.recv(65536)
            assert chunk, "relay closed the connection"
            data += chunk
            continue
        statuses.append(int(data.split(None, 2)[1]))
        data = data[end + 4 + int(length[1]) :]
    return statuses


def _dropped(relay: RelayProcess) -> float:
    url = f"http://127.0.0.1:{relay.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=2) as answer:
        text: str = answer.read().decode()
    for line in text.splitlines():
        if line.startswith("relay_access_log_dropped_lines_total "):
            return float(line.split()[1])
    raise AssertionError("no relay_access_log_dropped_lines_total in /metrics")


def test_a_stdout_nobody_reads_does_not_stall_requests_or_the_exit(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()  # never read until relay has exited
    relay = RelayProcess(tmp_path, [], stdout_fd=write_fd)
    try:
        relay.start()
        os.close(write_fd)
        write_fd = -1
        conn = socket.create_connection(("127.0.0.1", relay.port), timeout=2)
        started = time.monotonic()
        for _ in range(FILL // BATCH):  # ~10 MB of lines: the pipe is full after the first 30
            assert _ask(conn, BATCH) == [404] * BATCH
        # Beyond the limit whole flushes are dropped: counted (the sweep hands over the rest
        # within 0.25 s), and said once on stderr. The pipe and the queue are full by then.
        deadline = time.monotonic() + 5
        while _dropped(relay) == 0:
            assert time.monotonic() < deadline, "no line dropped"
            time.sleep(0.05)
        asked = time.monotonic()
        assert _ask(conn, 1) == [404]  # within the connection's 2 s timeout
        assert time.monotonic() - asked < 1.0
        conn.close()
        warnings = [
            line
            for line in (tmp_path / "relay.stderr").read_text().splitlines()
            if "access log" in line and "dropped" in line
        ]
        assert len(warnings) == 1, warnings
        # At exit relay waits for the sink a bounded time (accesslog.EXIT_WAIT_S), not for ever.
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGTERM)
        assert relay.proc.wait(timeout=8) == 0
        assert time.monotonic() - started < 12
        os.set_blocking(read_fd, False)
        data = b""
        while chunk := os.read(read_fd, 65536):  # the write end is closed: ends at EOF
            data += chunk
    finally:
        os.close(read_fd)  # a relay still blocked on the pipe gets EPIPE and can stop
        if write_fd >= 0:
            os.close(write_fd)
        relay.stop()
    # What the pipe took: whole lines, in order; the warnings account for every other line.
    lines = [json.loads(line) for line in data.splitlines()]
    assert lines
    assert all(line["path"] == PATH and line["status"] == 404 for line in lines)
    times = [line["time"] for line in lines]
    assert times == sorted(times)
    told = re.findall(r"access log: (\d+) line", (tmp_path / "relay.stderr").read_text())
    assert len(lines) + sum(map(int, told)) == FILL + 1


def _numbered(log: AccessLog, first: int, count: int) -> None:
    members = log_members("s", 1, "GET", "/" + "y" * 900)  # ~1 KB a line
    for i in range(first, first + count):
        log.write_line(1.0, "192.0.2.1", members, 200, 0, i, 1.0, None)


def test_beyond_the_limit_whole_flushes_are_dropped_counted_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A real pipe nobody reads at first, a real writer thread, a 64 KiB limit: the pipe takes
    # 64 KiB, the queue 64 KiB more, and every later flush is dropped whole, in order.
    read_fd, write_fd = os.pipe()
    stream = open(write_fd, "wb")  # noqa: SIM115 - closed below
    log = AccessLog(limit=64 * 1024)
    log.configure(stream)
    flushes, per_flush = 40, 20
    with caplog.at_level(logging.WARNING, logger="relay"):
        for flush in range(flushes):
            _numbered(log, flush * per_flush, per_flush)
            log.flush()
        dropped = log.dropped
        said = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert len(said) == 1  # not one per dropped flush: at most one a minute
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read_all(read_fd)))
        reader.start()
        assert log.finish(timeout=5)  # once read, every block kept is written
        stream.close()
        reader.join(5)
    assert dropped > 0
    assert dropped % per_flush == 0  # whole flushes, never part of one
    assert log.dropped == dropped
    sequence = [json.loads(line)["bytes_out"] for line in bytes(got).splitlines()]
    assert len(sequence) + dropped == flushes * per_flush
    assert sequence == sorted(sequence)  # in order, gaps where flushes were dropped
    assert sequence[: 64 * 1024 // 1100] == list(range(64 * 1024 // 1100))


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read()


def test_a_failed_write_counts_its_lines_as_dropped() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone: EPIPE (Python ignores SIGPIPE)
    with open(write_fd, "wb") as stream:
        log = AccessLog()
        log.configure(stream)
        _numbered(log, 0, 10)
        assert log.finish()
        assert log.dropped == 10


class _Unstartable(threading.Thread):
    """A thread the system does not start: ``Thread.start`` raises so at RLIMIT_NPROC or a
    cgroup's pids.max (systemd's TasksMax), from the EAGAIN of ``pthread_create``."""

    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def _threads(monkeypatch: pytest.MonkeyPatch, thread: type[threading.Thread]) -> None:
    """The writer's threads (relay.accesswriter's own name for the module, so that no other
    thread of this process is touched)."""
    fake = types.SimpleNamespace(Thread=thread, Event=threading.Event)
    monkeypatch.setattr(accesswriter, "threading", fake)


def test_a_writer_thread_that_cannot_start_raises_nothing_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the flush that started the thread raised RuntimeError into the request
    that filled the buffer (or into Relay.stop), and the Thread left unstarted was never tried
    again: every later line waited for nothing, and the join at exit raised too."""
    stream = io.BytesIO()
    log = AccessLog()
    log.configure(stream)
    _threads(monkeypatch, _Unstartable)
    _numbered(log, 0, 5)
    log.flush()  # the blocks wait
    _threads(monkeypatch, threading.Thread)  # the system has threads to spare again
    _numbered(log, 5, 5)
    log.flush()
    assert log.finish()
    sequence = [json.loads(line)["bytes_out"] for line in stream.getvalue().splitlines()]
    assert sequence == list(range(10))
    assert log.dropped == 0


def test_a_writer_thread_that_never_starts_drops_the_lines_at_exit_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stream = io.BytesIO()
    log = AccessLog()
    log.configure(stream)
    _threads(monkeypatch, _Unstartable)
    _numbered(log, 0, 5)
    log.flush()
    with caplog.at_level(logging.WARNING, logger="relay"):
        assert not log.finish(timeout=1)
    assert log.dropped == 5
    assert stream.getvalue() == b""
    (said,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert "5 line(s) dropped (cannot start the writer thread" in said, said
