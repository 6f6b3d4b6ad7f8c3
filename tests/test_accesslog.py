"""Access-log lines (SPEC §7): valid JSON with every field, whichever way they are made.

A forwarded request's line takes its request members (sandbox, port, method, path) from the
decision, made once (``Forward.log_fields``); refusals and WebSockets pass the same members as
keywords. Both ways must give the same bytes, escaped for JSON whatever the path holds.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay import accesslog, accesswriter
from relay.accesslog import AccessLog
from relay.core.answers import log_members
from relay.core.decide import Settings, decide
from relay.core.model import Forward, RequestHead, Route
from relay.core.routes import RouteTable
from tests.support.harness import RelayProcess

SETTINGS = Settings(domains=("e2b.test",), management=True)
TABLE = RouteTable.of(
    {"sbx1": Route(sandbox_id="sbx1", address="10.0.0.5", envd_token="envd-tok", generation=1)}
)


def _lines(log: AccessLog, stream: io.BytesIO) -> list[dict[str, object]]:
    log.finish()  # the writer thread has written every line
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize(
    "target",
    [b"/files", b'/q"uote\t', b"/caf%C3%A9/\xff?signature=v1_secret&x=1", b"/%22quoted%22"],
)
def test_a_forwarded_line_is_json_and_matches_the_keyword_form(target: bytes) -> None:
    head = RequestHead(
        method=b"GET",
        target=target,
        version="1.1",
        headers=((b"Host", b"49983-sbx1.e2b.test"), (b"X-Access-Token", b"envd-tok")),
        peer="192.0.2.1",
    )
    decision = decide(head, TABLE, SETTINGS)
    assert isinstance(decision, Forward)
    stream = io.BytesIO()
    log = AccessLog()
    log.configure(stream)
    log.write_line(1.5, "192.0.2.1", decision.log_fields, 200, 3, 4, 1.25, None)
    log.write(
        time=1.5,
        client="192.0.2.1",
        sandbox_id="sbx1",
        port=49983,
        method="GET",
        path=decision.log_path,
        status=200,
        bytes_in=3,
        bytes_out=4,
        duration_ms=1.25,
        reason=None,
    )
    log.finish()
    first, second = stream.getvalue().splitlines(keepends=True)
    assert first == second
    line = json.loads(first)
    assert line == {
        "time": 1.5,
        "client": "192.0.2.1",
        "sandbox_id": "sbx1",
        "port": 49983,
        "method": "GET",
        "path": decision.log_path,
        "status": 200,
        "bytes_in": 3,
        "bytes_out": 4,
        "duration_ms": 1.25,
        "reason": None,
    }
    assert "?" not in line["path"]  # never the query: a signed URL's query holds a signature
    assert b"secret" not in first


def test_members_without_a_request() -> None:
    stream = io.BytesIO()
    log = AccessLog()
    log.configure(stream)
    log.write_line(2.0, "::1", log_members(None, None, None, None), None, 0, 0, None, "slow")
    assert _lines(log, stream) == [
        {
            "time": 2.0,
            "client": "::1",
            "sandbox_id": None,
            "port": None,
            "method": None,
            "path": None,
            "status": None,
            "bytes_in": 0,
            "bytes_out": 0,
            "duration_ms": None,
            "reason": "slow",
        }
    ]


@given(
    status=st.one_of(st.none(), st.integers(100, 599)),
    duration=st.one_of(st.none(), st.floats(0, 1e9)),
    reason=st.one_of(st.none(), st.text(max_size=20)),
    sizes=st.tuples(st.integers(0, 2**63), st.integers(0, 2**63)),
    when=st.floats(0, 4e9),
)
def test_the_usual_line_is_the_same_bytes_as_the_general_one(
    status: int | None,
    duration: float | None,
    reason: str | None,
    sizes: tuple[int, int],
    when: float,
) -> None:
    # A served request (status, duration, no reason) takes a shorter format (_SERVED); its
    # line must be what the general format makes of the same values.
    stream = io.BytesIO()
    log = AccessLog()
    log.configure(stream)
    members = log_members("s", 49983, "GET", "/p")
    log.write_line(when, "::1", members, status, sizes[0], sizes[1], duration, reason)
    log.finish()
    general = accesslog._LINE % (
        when,
        '"::1"',
        members,
        "null" if status is None else status,
        sizes[0],
        sizes[1],
        "null" if duration is None else f"{duration:.2f}",
        "null" if reason is None else json.dumps(reason),
    )
    assert stream.getvalue() == general.encode()
    line = json.loads(stream.getvalue())
    assert (line["status"], line["bytes_in"], line["bytes_out"]) == (status, *sizes)
    assert line["reason"] == reason


class _Writes(io.BytesIO):
    """A stream that remembers each write, as a pipe would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return super().write(data)


def test_lines_go_out_in_pipe_buf_pieces_cut_at_line_ends() -> None:
    # Several workers share journald's pipe: a write of at most PIPE_BUF bytes is atomic, so
    # lines never interleave; a path that would make a longer line is cut (below).
    stream = _Writes()
    log = AccessLog()
    log.configure(stream)
    paths = [f"/p{'x' * (i * 37 % 300)}" for i in range(200)]
    for i, path in enumerate(paths):
        log.write_line(
            float(i), "192.0.2.1", log_members("s", 1, "GET", path), 200, 0, i, 1.0, None
        )
    log.finish()
    assert len(stream.writes) > 1
    for piece in stream.writes:
        assert piece.endswith(b"\n")
        assert len(piece) <= accesswriter.PIPE_BUF
    lines = b"".join(stream.writes).splitlines()
    assert [json.loads(line)["path"] for line in lines] == paths
    assert [json.loads(line)["bytes_out"] for line in lines] == list(range(len(paths)))


def _fill(log: AccessLog, lines: int) -> list[str]:
    paths = [f"/p{i}{'x' * (i * 37 % 300)}" for i in range(lines)]
    for i, path in enumerate(paths):
        log.write_line(
            float(i), "192.0.2.1", log_members("s", 1, "GET", path), 200, 0, i, 1.0, None
        )
    assert log.finish()
    return paths


def test_a_regular_file_gets_the_buffer_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux writes to a regular file under its lock: one write cannot interleave with another
    # worker's, so the PIPE_BUF cutting (~5x the flush's time) is for pipes only.
    writes: list[int] = []

    def counted(fd: int, data: memoryview) -> int:
        writes.append(len(data))
        return os.write(fd, data)

    monkeypatch.setattr(accesswriter, "_write", counted)
    with (tmp_path / "access.log").open("ab") as stream:
        log = AccessLog()
        log.configure(stream)
        paths = _fill(log, 200)
    assert len(writes) == 1
    assert writes[0] > accesswriter.PIPE_BUF
    lines = (tmp_path / "access.log").read_bytes().splitlines()
    assert [json.loads(line)["path"] for line in lines] == paths


_TORN = """
import resource, sys
from relay.accesslog import AccessLog
from relay.core.answers import log_members

path, limit = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
log = AccessLog()
with open(path, "ab") as stream:
    log.configure(stream)
    for phase, count in (("full", 190), ("after", 20)):
        # CPython ignores SIGXFSZ: past the limit write() fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit if phase == "full" else soft, hard))
        for i in range(count):
            members = log_members("s", 1, "GET", f"/{phase}{i}-" + "x" * 300)
            log.write_line(float(i), "192.0.2.1", members, 200, 0, i, 1.0, None)
        log.finish()  # written by the writer thread before the limit changes
"""


def test_a_write_cut_short_by_a_full_file_breaks_one_line_only(tmp_path: Path) -> None:
    # Found by review: a flush that stops inside a line (EFBIG here; ENOSPC or a quota
    # alike) must not leave the next flush's first line glued to the torn one.
    path = tmp_path / "access.log"
    run = subprocess.run(
        [sys.executable, "-c", _TORN, str(path), "30000"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    data = path.read_bytes()
    # Up to the limit the file holds whole lines and then part of one; the lines that could
    # not be written are lost; after it, a line end and then the later lines, intact.
    cut, rest = data[:30000], data[30000:]
    assert not cut.endswith(b"\n")
    lines = cut.split(b"\n")
    assert all(_is_json(line) for line in lines[:-1])
    assert not _is_json(lines[-1])
    assert rest.startswith(b"\n")
    after = [json.loads(line)["path"] for line in rest[1:].splitlines()]
    assert after == [f"/after{i}-" + "x" * 300 for i in range(20)]


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def test_a_pipe_still_gets_pipe_buf_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []

    def counted(fd: int, data: memoryview) -> int:
        writes.append(len(data))
        return os.write(fd, data)

    monkeypatch.setattr(accesswriter, "_write", counted)
    read_fd, write_fd = os.pipe()
    stream = open(write_fd, "wb")  # noqa: SIM115 - closed below, before the pipe is read
    log = AccessLog()
    log.configure(stream)
    paths = _fill(log, 150)  # ~35 KiB: within the pipe's 64 KiB, so no reader is needed
    stream.close()
    with os.fdopen(read_fd, "rb") as reader:
        lines = reader.read().splitlines()
    assert len(writes) > 1
    assert all(size <= accesswriter.PIPE_BUF for size in writes)
    assert [json.loads(line)["path"] for line in lines] == paths


def test_a_full_buffer_is_written_without_waiting_for_the_sweep() -> None:
    stream = _Writes()
    log = AccessLog()
    log.configure(stream)
    members = log_members(None, None, None, None)
    size = len(accesslog._LINE % (1.0, '"::1"', members, "null", 0, 0, "null", '"x"'))
    count = -(-accesslog.FLUSH_AT // size)  # the line that reaches FLUSH_AT hands them over
    for _ in range(count):
        log.write_line(1.0, "::1", members, None, 0, 0, None, "x")
    deadline = time.monotonic() + 5
    while len(b"".join(stream.writes).splitlines()) < count:  # the writer thread's writes
        assert time.monotonic() < deadline, "not written"
        time.sleep(0.01)
    written = b"".join(stream.writes)
    assert len(written) >= accesslog.FLUSH_AT
    assert len(written.splitlines()) == count


def test_serve_with_stdout_closed_logs_to_stderr(tmp_path: Path) -> None:
    # Found by review: `relay serve >&-` stopped at start (Python has no sys.stdout then).
    relay = RelayProcess(tmp_path, [], close_stdout=True)
    relay.start()
    try:
        with socket.create_connection(("127.0.0.1", relay.port), 5) as conn:
            conn.sendall(b"GET /x HTTP/1.1\r\nHost: nowhere.example\r\nConnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 404")
    finally:
        assert relay.stop() == 0
    err = (tmp_path / "relay.stderr").read_text()
    logged = [line for line in err.splitlines() if "relay.access" in line]
    assert len(logged) == 1, err
    assert json.loads(logged[0].split("relay.access ", 1)[1])["status"] == 404


@pytest.mark.parametrize("char", ["L", "\xff", '"'], ids=["ascii", "latin-1", "escaped"])
def test_a_long_path_is_cut_so_that_its_line_fits_in_pipe_buf(char: str) -> None:
    """Found by review: a path up to listen.max_header_bytes made a line longer than PIPE_BUF,
    which a pipe shared by several workers (journald) does not write atomically: another
    worker's line could land inside it. The path is cut, visibly, and the line stays JSON."""
    path = "/" + char * 16_000
    stream = _Writes()
    log = AccessLog()
    log.configure(stream)
    log.write_line(
        1.0, "192.0.2.1", log_members("s" * 64, 49983, "OPTIONS", path), 200, 0, 0, 1.0, None
    )
    log.finish()
    (piece,) = stream.writes
    assert len(piece) <= accesswriter.PIPE_BUF
    logged = json.loads(piece)["path"]
    assert logged.endswith("…")
    assert path.startswith(logged[:-1])
    assert len(logged) > 300  # as much of it as fits
