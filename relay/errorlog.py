"""The diagnostic log: ``logging``'s records on standard error, written by a thread.

``relay serve`` logs its warnings, errors and notices to standard error (``[worker N]`` in a
worker's lines). Under systemd that is journald's stream socket, which stops taking lines when
journald stalls (a full disk, load); with ``relay serve 2>&1 | slow-reader`` or a terminal
paused with Ctrl-S it is a pipe nobody reads. logging's ``StreamHandler`` wrote from whatever
thread logged, the event loop's included: the first warning past the pipe's 64 KiB then
stopped every sandbox's traffic until the reader came back (found by review;
tests/test_errorlog_sink.py), as the access log's writes to standard output did before.

So a record is formatted on the thread that logs it and handed, as one block, to a thread of
its own (:class:`relay.accesswriter.Writer`, the access log's, woken at each record: these
lines are rare and wanted at once), which writes the blocks in order. Lines are never
reordered, nor cut: a pipe shared by the workers gets whole lines.

What is dropped, and why: at most :data:`LIMIT` bytes per process wait for a stalled standard
error (~8,000 lines of ~130 bytes: minutes of a relay that warns a lot); beyond that each new
record is dropped whole, counted (``relay_log_dropped_lines_total``), and said by one line once
standard error takes lines again (half the limit free; at most once a minute, and at exit).
Holding more would only postpone the loss, with every worker holding the memory; and it is
the newest lines that are dropped, so what is written stays a gapless account up to the
stall. A write that fails (the reader gone) loses its lines, counted alike. At exit
(logging's own ``shutdown``, which runs last among relay's exit handlers) relay waits
:data:`~relay.accesswriter.EXIT_WAIT_S` for what is left: a standard error still stalled
then does not keep relay from exiting, and the rest is counted as dropped.

When no thread can be started (RLIMIT_NPROC, systemd's TasksMax) the lines are written by the
thread that logs them, as before: a diagnostic line is worth blocking for, and nothing raises
into the caller.

:func:`say` writes relay's own one-line messages (``relay: config error: …``) through the same
queue, so that they come after the lines logged before them and a stalled standard error does
not hold the exit either.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import BinaryIO

from relay.accesswriter import EXIT_WAIT_S, Writer

LIMIT = 1024 * 1024  # bytes waiting for standard error, at most (see above)
WARN_EVERY_S = 60.0  # at most one line about dropped lines in this time


class StderrHandler(logging.Handler):
    """logging's handler for relay serve: each record one block for the writer thread.

    ``emit`` runs under the handler's lock (``Handler.handle``), so the writer's counts have
    one writer on this side whichever thread logs. ``flush`` is logging's no-op: it may be
    called from the event loop; :meth:`finish` waits, at exit (``close``)."""

    def __init__(self, stream: BinaryIO, encoding: str = "utf-8", limit: int = LIMIT) -> None:
        super().__init__()
        self.encoding = encoding
        self.writer = Writer(
            stream, limit, name="relay-log", what="standard error", prompt=True, direct=True
        )
        self._reported = 0  # dropped lines a line has told of
        self._warned_at = -WARN_EVERY_S

    @property
    def dropped(self) -> int:
        return self.writer.dropped

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.put(text)

    def put(self, text: str) -> None:
        """``text`` (a traceback is several lines) after every line put before it."""
        writer = self.writer
        if (
            writer.dropped != self._reported
            and writer.waiting <= writer.limit // 2
            and not writer.given_up
        ):
            self._tell(final=False)  # standard error takes lines again
        self._put(text)

    def _put(self, text: str) -> bool:
        # The errors standard error has (Python's default for it): a line never fails to encode.
        data = (text + "\n").encode(self.encoding, "backslashreplace")
        return self.writer.put(data, data.count(b"\n"))

    def _tell(self, *, final: bool) -> None:
        """One line for the lines dropped since the last such line, at most every
        WARN_EVERY_S (``final``: at exit, whenever some were). Itself dropped when there is
        still no room: counted, and told with the others next time."""
        now = time.monotonic()
        if not final and now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        dropped = self.writer.dropped
        record = logging.LogRecord(
            "relay",
            logging.WARNING,
            __file__,
            0,
            "%d log line(s) dropped (%s); relay_log_dropped_lines_total counts them",
            (dropped - self._reported, self.writer.reason),
            None,
        )
        if self._put(self.format(record)):
            self._reported = dropped

    def finish(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Wait up to ``timeout`` for every line to be written; False if standard error did
        not take them (the rest counted as dropped, and every later line)."""
        self.acquire()
        try:
            if self.writer.dropped != self._reported:
                self._tell(final=True)
        finally:
            self.release()
        return self.writer.finish(timeout)

    def close(self) -> None:
        """At exit (``logging.shutdown``): the lines still waiting are written first."""
        self.finish()
        super().close()


_handler: StderrHandler | None = None


def install(level: str, fmt: str) -> None:
    """``relay serve``: the root logger writes to standard error through the thread.

    As ``logging.basicConfig`` did before: nothing is changed when the root logger has
    handlers already (a program that runs relay inside it, pytest's caplog). A standard
    error without a binary buffer (replaced by such a program) gets logging's own handler.
    """
    global _handler  # noqa: PLW0603 - one per process, set up once by relay serve
    root = logging.getLogger()
    if root.handlers:
        return
    stream = sys.stderr
    binary = getattr(stream, "buffer", None)
    if binary is None:
        logging.basicConfig(level=level, format=fmt, stream=stream)
        return
    stream.flush()  # what was written before goes first
    handler = StderrHandler(binary, getattr(stream, "encoding", None) or "utf-8")
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level)
    # Python's warnings (a RuntimeWarning, a DeprecationWarning shown) go the same way, not
    # written to standard error directly from the loop.
    logging.captureWarnings(True)
    _handler = handler


def say(line: str) -> None:
    """One line of relay's own on standard error (``relay: cannot start: …``), after the log
    lines before it; written directly when relay serve's logging is not set up."""
    handler = _handler
    if handler is None:
        sys.stderr.write(line + "\n")  # one write: lines of several workers never interleave
        return
    handler.acquire()
    try:
        handler.put(line)
    finally:
        handler.release()


def finish(timeout: float = EXIT_WAIT_S) -> bool:
    """Every line handed over written, waiting at most ``timeout`` (before a traceback that
    Python writes itself; at exit logging's shutdown does it)."""
    return _handler.finish(timeout) if _handler is not None else True


def dropped() -> int:
    """Diagnostic lines dropped so far in this process (``relay_log_dropped_lines_total``)."""
    return _handler.dropped if _handler is not None else 0
