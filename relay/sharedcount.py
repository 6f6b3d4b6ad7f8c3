"""Per-sandbox in-flight counts shared by the workers of a supervisor (``process.workers > 1``).

SPEC §5a: a route's ``max_connections`` counts the in-flight exchanges to its sandbox. Each
worker counted only its own, so with two workers and a limit of 1 two exchanges ran (found by
review); nginx's ``limit_conn`` shares its count through a shared-memory zone, and so does this.

The supervisor creates ``<run dir>/inflight.bin`` before it spawns the workers: one column of
:data:`SLOTS` native ``uint32`` per worker, worker-major. Each worker maps it ``MAP_SHARED`` and
writes **only its own column**, so no two processes ever write the same cell and no lock is
taken; a reader sums the other columns. A sandbox id maps to two slots by a stable hash
(Python's ``hash()`` differs per process), and a worker's estimate of the others' count is the
smaller of its two slot sums (a count-min sketch): two sandboxes sharing a slot can only make
the estimate too high (a 429 that a single process would not have answered), and it takes both
slots being shared, each with a sandbox that has exchanges in flight elsewhere, to do so.

A worker zeroes its column when it starts, and the supervisor zeroes a dead worker's column
before it restarts it, so what a worker killed by SIGKILL held does not stay counted.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

SLOTS = 1 << 16  # per worker: 256 KiB of the file each
CELL = 4  # bytes: a native uint32 ("I")
FILE_NAME = "inflight.bin"
_MASK = SLOTS - 1
_CACHE_MAX = 4096  # slot pairs of sandbox ids remembered by a worker (a dict lookup, not a hash)


def create(run_dir: Path, workers: int) -> Path:
    """The supervisor's: a zeroed table for ``workers`` columns."""
    path = run_dir / FILE_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Allocated now, not sparse: a worker's first write to a page of a sparse file on a
        # full tmpfs would be a SIGBUS, here it is an error at start.
        try:
            os.posix_fallocate(fd, 0, SLOTS * CELL * workers)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # A filesystem that cannot allocate (ZFS before 2.2, some FUSE ones): sparse
            # then, rather than no relay at all (found by review).
            os.ftruncate(fd, SLOTS * CELL * workers)
    finally:
        os.close(fd)
    return path


def zero_column(path: Path, index: int) -> None:
    """The supervisor's, once worker ``index`` has exited (nothing writes its column then)."""
    size = SLOTS * CELL
    fd = os.open(path, os.O_WRONLY)
    try:
        # A write to the file is what every MAP_SHARED mapping of it reads (one page cache).
        os.pwrite(fd, bytes(size), index * size)
    finally:
        os.close(fd)


def slots(sandbox_id: str) -> tuple[int, int]:
    """Two independent slots of ``sandbox_id``, the same in every process. (Not zlib.crc32 with
    two seeds: CRC is linear, so same-length ids colliding under one seed collide under both.)"""
    digest = hashlib.blake2b(sandbox_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (
        int.from_bytes(digest[:4], "little") & _MASK,
        int.from_bytes(digest[4:], "little") & _MASK,
    )


class SharedCounts:
    """One worker's view of the table: it adds to and takes from its own column only."""

    def __init__(self, path: Path, index: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping holds the file
        columns = size // (SLOTS * CELL)
        if columns * SLOTS * CELL != size or not 0 <= index < columns:
            self._map.close()
            raise ValueError(f"{path}: {size} bytes hold no column {index}")
        self._cells = memoryview(self._map).cast("I")
        self._own = index * SLOTS
        self._others = tuple(w * SLOTS for w in range(columns) if w != index)
        self._slots: dict[str, tuple[int, int]] = {}
        self.zero()

    def zero(self) -> None:
        """This worker's column back to 0: what an earlier worker of this index left."""
        start = self._own * CELL
        self._map[start : start + SLOTS * CELL] = bytes(SLOTS * CELL)

    def _slots_of(self, sandbox_id: str) -> tuple[int, int]:
        pair = self._slots.get(sandbox_id)
        if pair is None:
            if len(self._slots) >= _CACHE_MAX:
                self._slots.clear()
            pair = self._slots[sandbox_id] = slots(sandbox_id)
        return pair

    def add(self, sandbox_id: str) -> None:
        a, b = self._slots_of(sandbox_id)
        cells, own = self._cells, self._own
        cells[own + a] += 1
        if b != a:
            cells[own + b] += 1

    def take(self, sandbox_id: str) -> None:
        a, b = self._slots_of(sandbox_id)
        cells, own = self._cells, self._own
        # Never below 0: a uint32 would wrap to 4 billion and refuse the slot for good.
        if cells[own + a]:
            cells[own + a] -= 1
        if b != a and cells[own + b]:
            cells[own + b] -= 1

    def others(self, sandbox_id: str) -> int:
        """The other workers' in-flight exchanges to ``sandbox_id`` (never too low)."""
        a, b = self._slots_of(sandbox_id)
        cells = self._cells
        first = second = 0
        for base in self._others:
            first += cells[base + a]
            second += cells[base + b]
        return min(first, second)

    def own(self, sandbox_id: str) -> int:
        """This worker's column's estimate (for tests)."""
        a, b = self._slots_of(sandbox_id)
        return min(self._cells[self._own + a], self._cells[self._own + b])

    def close(self) -> None:
        self._cells.release()
        self._map.close()
