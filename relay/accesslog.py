"""The access log: one JSON line per exchange (SPEC §7), buffered like nginx's ``buffer=``.

Writing a line through ``logging`` costs about 35 µs here (record, formatter, lock, and a
``write`` + ``flush`` per line), a third of relay's whole per-request budget. ``relay serve``
therefore writes the lines itself: each is formatted with one ``%`` operation (strings escaped
by the C JSON encoder) and appended to a buffer that is handed over every 0.25 s, when it
passes 64 KiB, and at exit.

The writes run in a thread of their own, never on the event loop, in pieces a pipe shared by
several workers takes whole: :mod:`relay.accesswriter` has why and how, and what becomes of
lines a stalled standard output does not take.

Without :func:`configure` (tests, embedding), lines go to the ``relay.access`` logger.
"""

from __future__ import annotations

import atexit
import json
import logging
import time
from typing import BinaryIO

from relay.accesswriter import EXIT_WAIT_S, PENDING_LIMIT, Writer
from relay.core.answers import log_members

logger = logging.getLogger("relay.access")
log = logging.getLogger("relay")

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
WARN_EVERY_S = 60.0  # at most one warning about dropped lines in this time


class AccessLog:
    """Where access-log lines go: a buffered binary stream, or the ``relay.access`` logger."""

    __slots__ = (
        "_buffer",
        "_dropped",
        "_reported",
        "_size",
        "_stream",
        "_warned_at",
        "_writer",
        "buffering",
        "limit",
    )

    def __init__(self, limit: int = PENDING_LIMIT) -> None:
        self._stream: BinaryIO | None = None
        # Lines as str, encoded once per flush, not once per line: every line is ASCII
        # (strings escaped by encode_basestring_ascii, numbers, JSON words), so a line's
        # length in characters is its length in bytes.
        self._buffer: list[str] = []
        self._size = 0
        self.buffering = False  # configured with a stream: lines are always written
        self.limit = limit  # bytes waiting for the writer thread, at most
        self._writer: Writer | None = None
        self._dropped = 0  # lines dropped by the writers of earlier streams
        self._reported = 0  # dropped lines a warning has told of
        self._warned_at = -WARN_EVERY_S

    @property
    def enabled(self) -> bool:
        return self._stream is not None or logger.isEnabledFor(logging.INFO)

    @property
    def dropped(self) -> int:
        """Lines lost so far: not taken by the sink in time, or lost to a failed write."""
        writer = self._writer
        return self._dropped + (writer.dropped if writer is not None else 0)

    def configure(self, stream: BinaryIO | None) -> None:
        self.finish()
        if self._writer is not None:
            self._dropped += self._writer.dropped
        self._stream = stream
        self.buffering = stream is not None
        self._writer = None if stream is None else Writer(stream, self.limit)

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
        """Hand the buffer to the writer thread as one block (the event loop never writes)."""
        lines, writer = self._buffer, self._writer
        if writer is None or not lines:
            return
        self._buffer = []
        self._size = 0
        writer.put("".join(lines).encode(), len(lines))
        if writer.dropped + self._dropped != self._reported:
            self._report(final=False)

    def finish(self, timeout: float = EXIT_WAIT_S) -> bool:
        """At exit: hand over the buffer and wait up to ``timeout`` for the thread to write
        every block. False when the sink did not take them in time: what is left is counted
        as dropped, and so is every later line (the thread may stay blocked in a write)."""
        self.flush()
        writer = self._writer
        if writer is None:
            return True
        done = writer.finish(timeout)
        self._report(final=True)
        return done

    def _report(self, *, final: bool) -> None:
        """One warning for the lines dropped since the last one, at most every WARN_EVERY_S
        (``final``: at exit, whenever some were)."""
        dropped, now = self.dropped, time.monotonic()
        if dropped == self._reported or (not final and now - self._warned_at < WARN_EVERY_S):
            return
        reason = self._writer.reason if self._writer is not None else ""
        log.warning(
            "access log: %d line(s) dropped (%s); relay_access_log_dropped_lines_total counts them",
            dropped - self._reported,
            reason,
        )
        self._reported, self._warned_at = dropped, now


ACCESS_LOG = AccessLog()


def configure(stream: BinaryIO | None) -> None:
    """``relay serve``: write access lines to ``stream`` (stdout), buffered."""
    ACCESS_LOG.configure(stream)
    # Relay.stop finishes the log; this covers any other way out (once, however often called).
    atexit.unregister(ACCESS_LOG.finish)
    atexit.register(ACCESS_LOG.finish)
