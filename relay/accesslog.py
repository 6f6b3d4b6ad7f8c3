"""The access log: one JSON line per exchange (SPEC §7), buffered like nginx's ``buffer=``.

Writing a line through ``logging`` costs about 35 µs here (record, formatter, lock, and a
``write`` + ``flush`` per line), a third of relay's whole per-request budget. ``relay serve``
therefore writes the lines itself: each is formatted with one ``%`` operation (strings escaped
by the C JSON encoder) and appended to a buffer that is written out every 0.25 s, when it
passes 64 KiB, and at exit. Writes go out in pieces of at most ``PIPE_BUF`` bytes cut at line
ends, so lines from several workers sharing one pipe (journald) never interleave.

To a regular file (``relay serve > access.log``) the buffer goes out in one ``write``: Linux
holds the file's lock for the whole of a write to a regular file, so another worker's write
lands before or after it, never inside (``PIPE_BUF`` is a pipe's rule). A flush of 64 KiB in
4 KiB pieces took ~110 µs here, every ~300 requests of a busy worker, all of it latency for
the requests in flight; in one write it takes ~20 µs (bench/README.md, "A seventh host").

Without :func:`configure` (tests, embedding), lines go to the ``relay.access`` logger.
"""

from __future__ import annotations

import json
import logging
import os
import select
import stat
from typing import BinaryIO

from relay.core.answers import log_members

logger = logging.getLogger("relay.access")

_escape = json.encoder.encode_basestring_ascii
# The request's members (sandbox_id, port, method, path) come from relay.core.answers.
_LINE = (
    '{"time":%.3f,"client":%s,%s,'
    '"status":%s,"bytes_in":%d,"bytes_out":%d,"duration_ms":%s,"reason":%s}\n'
)
# The usual line (a status, a duration, no reason) with its numbers formatted by the same
# ``%`` operation: the same bytes as _LINE gives, ~0.2 µs sooner (no conditionals, no f-string).
_SERVED = (
    '{"time":%.3f,"client":%s,%s,'
    '"status":%d,"bytes_in":%d,"bytes_out":%d,"duration_ms":%.2f,"reason":null}\n'
)
FLUSH_AT = 64 * 1024
PIPE_BUF = select.PIPE_BUF
_write = os.write  # a name of its own, so that a test can count the calls


class AccessLog:
    """Where access-log lines go: a buffered binary stream, or the ``relay.access`` logger."""

    __slots__ = ("_buffer", "_file", "_size", "_stream", "_torn", "buffering")

    def __init__(self) -> None:
        self._stream: BinaryIO | None = None
        # Lines as str, encoded once per flush, not once per line: every line is ASCII
        # (strings escaped by encode_basestring_ascii, numbers, JSON words), so a line's
        # length in characters is its length in bytes.
        self._buffer: list[str] = []
        self._size = 0
        self.buffering = False  # configured with a stream: lines are always written
        self._file = -1  # the stream's descriptor when it is a regular file (one write)
        self._torn = False  # a write to that file stopped inside a line

    @property
    def enabled(self) -> bool:
        return self._stream is not None or logger.isEnabledFor(logging.INFO)

    def configure(self, stream: BinaryIO | None) -> None:
        self.flush()
        self._stream = stream
        self.buffering = stream is not None
        self._file = _regular_file(stream)
        self._torn = False

    def write(
        self,
        *,
        time: float,
        client: str,
        sandbox_id: str | None,
        port: int | None,
        method: str | None,
        path: str | None,
        status: int | None,
        bytes_in: int,
        bytes_out: int,
        duration_ms: float | None,
        reason: str | None,
    ) -> None:
        self.write_line(
            time,
            client,
            log_members(sandbox_id, port, method, path),
            status,
            bytes_in,
            bytes_out,
            duration_ms,
            reason,
        )

    def write_line(
        self,
        time: float,
        client: str,
        members: str,
        status: int | None,
        bytes_in: int,
        bytes_out: int,
        duration_ms: float | None,
        reason: str | None,
    ) -> None:
        """One line, the request's members already made (``Forward.log_fields``)."""
        if status is not None and duration_ms is not None and reason is None:
            self.served(time, client, members, status, bytes_in, bytes_out, duration_ms)
            return
        line = _LINE % (
            time,
            _escape(client),
            members,
            "null" if status is None else status,
            bytes_in,
            bytes_out,
            "null" if duration_ms is None else f"{duration_ms:.2f}",
            "null" if reason is None else _escape(reason),
        )
        self._put(line)

    def served(
        self,
        time: float,
        client: str,
        members: str,
        status: int,
        bytes_in: int,
        bytes_out: int,
        duration_ms: float,
    ) -> None:
        """The usual line: a status, a duration and no reason (one ``%``, no conditionals)."""
        self._put(
            _SERVED % (time, _escape(client), members, status, bytes_in, bytes_out, duration_ms)
        )

    def _put(self, line: str) -> None:
        if self._stream is None:
            logger.info(line[:-1])
            return
        self._buffer.append(line)
        self._size += len(line)
        if self._size >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        stream, lines = self._stream, self._buffer
        if stream is None or not lines:
            return
        self._buffer = []
        self._size = 0
        piece: list[str] = []
        size = 0
        try:
            if self._file >= 0:
                stream.flush()  # whatever else went to the stream goes out first
                self._write_file(self._file, "".join(lines).encode())
                return
            for line in lines:
                if size + len(line) > PIPE_BUF and piece:
                    stream.write("".join(piece).encode())
                    piece, size = [], 0
                piece.append(line)
                size += len(line)
            stream.write("".join(piece).encode())
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or full stdout must not take the data path down with it

    def _write_file(self, fd: int, data: bytes) -> None:
        """All of ``data`` in one ``write`` (more only if the kernel writes it short).

        A write cut short by a full disk, a quota or ``RLIMIT_FSIZE`` raises once nothing more
        fits, and the rest of the buffer is lost; the file then ends inside a line, so the
        next write starts with a line end: one broken line, not that one glued to the next.
        """
        if self._torn:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                written = _write(fd, view)
                if not written:
                    break  # never for a regular file; no loop for ever if it were
                view = view[written:]
        finally:
            done = len(data) - len(view)
            if done:
                self._torn = data[done - 1] != 0x0A  # b"\n"


def _regular_file(stream: BinaryIO | None) -> int:
    """The stream's descriptor if it is a regular file, else -1."""
    if stream is None:
        return -1
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else -1
    except (OSError, ValueError, AttributeError):  # no descriptor (io.UnsupportedOperation)
        return -1


ACCESS_LOG = AccessLog()


def configure(stream: BinaryIO | None) -> None:
    """``relay serve``: write access lines to ``stream`` (stdout), buffered."""
    ACCESS_LOG.configure(stream)
