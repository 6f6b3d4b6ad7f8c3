"""The access log's writer: a thread that writes the flushed blocks to standard output.

The writes run in a thread of their own, never on the event loop. Standard output is a pipe or
a socket (journald, under systemd) whose reader can stall: journald busy or stuck, ``relay
serve | slow-reader``, a terminal paused with Ctrl-S. A write then blocks, and made from the
loop it stopped every sandbox's traffic until the reader came back, and kept relay from exiting
(found by review; tests/test_accesslog_sink.py). Now a flush encodes the buffer into one block
and appends it to a queue, once per flush, never per line (a line's own path is unchanged),
without waiting for the thread nor waking it (see :class:`Writer`); one daemon thread per
process, started at the first block, writes the blocks in order. Lines are never reordered.
When the sink is slower than the traffic, blocks wait, up to :data:`PENDING_LIMIT` bytes per
process; beyond it whole blocks are dropped, counted (``relay_access_log_dropped_lines_total``)
and said on stderr through the ``relay`` logger at most once a minute (stderr may be stalled
too, which a warning that rare accepts). 8 MiB is ~40,000 lines: about 2 s of a worker serving
20,000 requests/s, minutes of a quieter one, enough to ride out a pause of journald's; a longer
stall would only postpone the loss, with every worker holding the memory. At exit relay waits
:data:`EXIT_WAIT_S` for the queue; a sink still stalled then does not keep relay from exiting:
the rest is counted as dropped. A write that fails (the reader gone, a full disk) loses its
lines, counted alike.

The thread writes to the descriptor (``os.write``), not through ``sys.stdout.buffer``: a
daemon thread blocked inside a ``BufferedWriter`` holds its lock, and the interpreter's flush
of stdout at exit then aborts the process ("could not acquire lock ... at interpreter
shutdown"). Writes go out in pieces of at most ``PIPE_BUF`` bytes cut at line ends, so lines
from several workers sharing one pipe (journald) never interleave.

To a regular file (``relay serve > access.log``) a block goes out in one ``write``: Linux
holds the file's lock for the whole of a write to a regular file, so another worker's write
lands before or after it, never inside (``PIPE_BUF`` is a pipe's rule). A flush of 64 KiB in
4 KiB pieces took ~110 µs here, every ~300 requests of a busy worker; in one write it takes
~20 µs (bench/README.md, "A seventh host").

:mod:`relay.errorlog` writes the diagnostic log to standard error with the same writer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import stat
import threading
from collections import deque
from collections.abc import Iterator
from typing import BinaryIO

from relay.systemd import signals_blocked

log = logging.getLogger("relay")

PIPE_BUF = select.PIPE_BUF
PENDING_LIMIT = 8 * 1024 * 1024  # bytes handed to the writer and not yet written (see above)
EXIT_WAIT_S = 2.0  # at exit, for the sink to take what is left
POLL_S = 0.1  # the thread looks for blocks this often (see Writer)
_write = os.write  # a name of its own, so that a test can count the calls


class Writer:
    """The thread that writes one stream's blocks, and the blocks waiting for it.

    The loop never waits for the thread nor wakes it: it appends a block to a deque (atomic
    under the GIL) and the thread looks every :data:`POLL_S` (``prompt``, for the few lines
    of relay.errorlog: each block wakes it). No count has two writers: the
    loop keeps ``queued``, ``accepted`` and ``refused``, the thread ``written``, ``done`` and
    ``lost``; a line accepted is done, lost, or still to write (what a finish that gives up
    counts as dropped).
    Measured on this shared 2-core host, 1,000 flushes of 64 KiB, one every
    ~1.3 ms: with the writes on the loop ~0.7% took over 1 ms; with a ``threading.Condition``
    (the loop took its lock, the thread held it) 12-20%, ~4.5 ms each; with a
    ``queue.SimpleQueue`` (no lock to wait for, but each put woke the thread, which took the
    core and the GIL from the loop) 8-25%; polling as here ~0.4%.
    """

    def __init__(
        self,
        stream: BinaryIO,
        limit: int,
        *,
        name: str = "relay-access-log",
        what: str = "standard output",
        prompt: bool = False,
        direct: bool = False,
    ) -> None:
        self.stream = stream
        self.name = name  # the thread's
        self.what = what  # the stream, as the reasons name it
        # ``prompt``: each put wakes the thread, for lines that are rare and wanted at once
        # (relay.errorlog); the access log's flushes do not (see above).
        self.prompt = prompt
        # ``direct``: when no thread can be started, the caller writes the blocks itself,
        # blocking as a write from it did before (relay.errorlog: a diagnostic line is worth
        # that), rather than keeping them for a thread that may never come.
        self.direct = direct
        self.writing = False  # the caller is writing (direct): a put meanwhile only queues
        self.fd = _descriptor(stream)  # -1: a stream without one (tests): its write()
        self.file = self.fd >= 0 and _regular_file(self.fd)
        if self.fd >= 0:
            # What went to the stream's own buffer before goes first; the thread then
            # writes the descriptor (see the module's docstring).
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self.limit = limit
        self.blocks: deque[tuple[bytes, int]] = deque()  # (bytes, lines), oldest first
        self.thread: threading.Thread | None = None
        self.closing = threading.Event()  # finish(): write what is left, then end
        self.wake = threading.Event()  # a block or the closing: the thread looks at once
        # The loop's:
        self.queued = 0  # bytes appended to ``blocks``
        self.accepted = 0  # their lines
        self.refused = 0  # lines dropped: over the limit, or left at a finish that timed out
        self.given_up = False  # finish() timed out: the sink is stalled, lines are dropped
        # The thread's:
        self.written = 0  # bytes of the blocks taken and written (or lost)
        self.done = 0  # lines written, counted per block written whole (see _write_pieces)
        self.lost = 0  # lines lost to a failed write
        # The block being written and how far (bytes, at a piece's end): what a finish that
        # gives up mid-block counts as written.
        self.current: bytes | None = None
        self.progress = 0
        self.torn = False  # a write to the file stopped inside a line
        # Either's (a plain store): why lines were last dropped, for the warning.
        self.reason = ""

    @property
    def dropped(self) -> int:
        return self.refused + self.lost

    @property
    def waiting(self) -> int:
        """Bytes handed over and not yet written."""
        return self.queued - self.written

    def put(self, data: bytes, lines: int) -> bool:
        """Queue ``data`` (``lines`` lines); False when it was dropped (and counted)."""
        if self.given_up:
            self.refused += lines  # relay is exiting: finish() said why
            return False
        if self.waiting + len(data) > self.limit:
            self.refused += lines
            if self._start():  # else its reason stands (and the next flush tries again)
                self.reason = f"{self.what} is not keeping up: {self.limit >> 10} KiB waiting"
            return False
        self.queued += len(data)
        self.accepted += lines
        self.blocks.append((data, lines))
        if self._start():
            if self.prompt:
                self.wake.set()
        elif self.direct:
            self._write_here()
        # else the blocks wait (up to the limit) for the next flush to start the thread
        return True

    def _start(self) -> bool:
        """Start the thread unless it runs; False when it cannot be started. ``Thread.start``
        raises RuntimeError ("can't start new thread", EAGAIN) at RLIMIT_NPROC or a cgroup's
        pids.max (systemd's TasksMax): raised from a flush, it escaped into the request that
        filled the buffer, or into Relay.stop, and the Thread left behind unstarted was never
        tried again, its join at exit raising too (found by review)."""
        if self.thread is not None:
            return True
        self.closing.clear()
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        # Started with every signal blocked, which it keeps: a signal is then the main
        # thread's alone. The kernel gives a process's signal to any thread that does not
        # block it, and relay.systemd.end_loop_handlers blocks SIGTERM, SIGINT and SIGHUP in
        # the main thread only, while it takes them off the loop's handlers: one given to
        # this thread then would meet its default action (a SIGTERM ending relay as it exits,
        # a Ctrl-C a KeyboardInterrupt). Found by review, from the mask, not seen happen.
        try:
            with signals_blocked():
                thread.start()
        except RuntimeError as exc:
            self.reason = f"cannot start the writer thread: {exc}"
            return False
        self.thread = thread
        return True

    def finish(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every block to be written and the thread to end (a
        later put starts another); False, and what is left counted as dropped, if not."""
        if self.given_up:
            return False
        if self.thread is None and not self.blocks:
            return True
        if not self._start():
            if self.direct:
                self._write_here()  # (not bounded by ``timeout``: see ``direct``)
                return True
            self._give_up()
            return False
        thread = self.thread
        assert thread is not None
        self.closing.set()
        self.wake.set()
        thread.join(timeout)
        if not thread.is_alive():
            self.thread = None
            return True
        self._give_up()
        self.reason = f"{self.what} took nothing for {timeout:g} s at exit"
        return False

    def _give_up(self) -> None:
        """Relay is exiting without the sink: what is left is dropped, and every later line."""
        self.given_up = True
        self.blocks.clear()
        current, progress = self.current, self.progress
        partial = current.count(b"\n", 0, progress) if current is not None else 0
        self.refused += self.accepted - self.done - partial - self.lost

    def _run(self) -> None:
        blocks, closing, wake = self.blocks, self.closing, self.wake
        while True:
            try:
                data, lines = blocks.popleft()
            except IndexError:
                if closing.is_set():
                    return
                wake.wait(POLL_S)
                wake.clear()  # then the deque is looked at again: no put is missed
                continue
            self._write_block(data, lines)
            if self.given_up:
                return  # finish() counted what this block had left: relay is exiting

    def _write_here(self) -> None:
        """``direct``, no thread: the caller writes what waits, in order. A line logged
        meanwhile (an internal error below) is queued and written by this same loop."""
        if self.writing:
            return
        self.writing = True
        try:
            while self.blocks and self.thread is None:
                self._write_block(*self.blocks.popleft())
        finally:
            self.writing = False

    def _write_block(self, data: bytes, lines: int) -> None:
        """One block written (or lost) and counted, by the thread (or, ``direct``, the caller)."""
        done = self.done
        self.current, self.progress = data, 0
        try:
            if self.file:
                lost, reason = self._write_file(data, lines)
            else:
                lost, reason = self._write_pieces(data, lines)
        except Exception:  # a bug here must not stop the writes for good
            log.exception("internal error in the writer of %s", self.what)
            lost, reason = lines - (self.done - done), "internal error"
        if self.given_up:
            return
        self.current = None
        self.written += len(data)
        if lost:
            self.lost += lost
            self.reason = reason

    def _write_pieces(self, data: bytes, lines: int) -> tuple[int, str]:
        """``data`` (``lines`` lines) in pieces of at most PIPE_BUF bytes cut at line ends;
        the lines lost to an error (a closed or broken pipe) and why. Lines are counted only
        when a write fails (or a finish gives up mid-block): a block written whole adds its
        known count. Counting each piece's line ends cost ~2,800 instructions per request
        (callgrind, bench.micro), about 0.5% of relay's CPU per small GET on the core it shares
        with the loop."""
        view = memoryview(data)
        start = piece = 0
        try:
            for end in _cuts(data):
                if self.fd < 0:
                    self.stream.write(data[start:end])
                    start = end
                while start < end:
                    written = _write(self.fd, view[start:end])
                    if not written:
                        raise OSError("wrote nothing")  # never for a pipe; no loop for ever
                    start += written
                piece = self.progress = end
            if self.fd < 0:
                self.stream.flush()
        except (OSError, ValueError) as exc:
            self.done += data.count(b"\n", 0, piece)
            return data.count(b"\n", start), f"write failed: {_why(exc)}"
        self.done += lines
        return 0, ""

    def _write_file(self, data: bytes, lines: int) -> tuple[int, str]:
        """All of ``data`` in one ``write`` (more only if the kernel writes it short).

        A write cut short by a full disk, a quota or ``RLIMIT_FSIZE`` raises once nothing more
        fits, and the rest of the block is lost; the file then ends inside a line, so the
        next write starts with a line end: one broken line, not that one glued to the next.
        """
        skip = 0
        if self.torn:
            data, skip = b"\n" + data, 1
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                written = _write(self.fd, view[done:])
                if not written:
                    raise OSError("wrote nothing")  # never for a file; no loop for ever
                done += written
        except OSError as exc:
            self.done += data.count(b"\n", skip, done)
            return data.count(b"\n", max(done, skip)), f"write failed: {_why(exc)}"
        finally:
            if done:
                self.torn = data[done - 1] != 0x0A  # b"\n"
        self.done += lines
        return 0, ""


def _cuts(data: bytes) -> Iterator[int]:
    """Where pieces of at most PIPE_BUF bytes of ``data`` end, each at a line end (a line
    longer than PIPE_BUF, which relay.core.answers prevents, would go whole in its own)."""
    start, size = 0, len(data)
    while size - start > PIPE_BUF:
        end = data.rfind(b"\n", start, start + PIPE_BUF) + 1
        if end <= start:
            end = data.find(b"\n", start + PIPE_BUF) + 1 or size
        yield end
        start = end
    yield size


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _descriptor(stream: BinaryIO) -> int:
    """The stream's descriptor, or -1 (io.BytesIO: io.UnsupportedOperation)."""
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):
        return -1


def _regular_file(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
