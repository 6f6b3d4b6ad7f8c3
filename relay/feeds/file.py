"""The ``file`` route source: a JSON file ``{"routes": [<route>, ...]}`` (SPEC §3).

The file is polled (``os.stat`` every ``routes.poll_interval_s``, 0.25 s by default) rather
than watched with inotify: a stat is a few microseconds, it works on every filesystem
(including bind mounts and network filesystems where inotify is silent), and it keeps the
revocation bound (1 s from the change to the end of the sandbox's streams) with room to
spare. SIGHUP forces a reload. A file that fails to parse keeps the previous table.

Writers should replace the file atomically (write a temporary file, then rename), as
``relay routes put`` does; a reader polling a file being rewritten in place could otherwise
see a truncated document, which it would reject and retry on the next poll. ``relay routes``
writes the file a symlink names, and holds ``.<name>.lock`` beside it while it reads, changes
and renames it; another program that rewrites the file should take the same lock (flock).

Each change is read whole, but a route that says what it said at the last load is not
validated again: a reload of 100,000 routes after one delete takes ~0.3 s of the event loop
here, 1.35 s before (relay.core.routes.parse_routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.core.model import Route
from relay.core.routes import Network, parse_routes
from relay.feeds.sink import Sink

log = logging.getLogger("relay.feeds.file")

__all__ = ["FileError", "FileFeed", "Sink", "read_routes_file", "write_routes_file"]


class FileError(ValueError):
    """A routes file that cannot be used; ``unread`` when reading it failed (EMFILE, EIO...),
    not what it holds: the same version is read again at the next poll."""

    def __init__(self, message: str, *, unread: bool = False) -> None:
        super().__init__(message)
        self.unread = unread


def read_routes_file(path: Path) -> list[Any]:
    """The route objects of a routes file; raises :class:`FileError` on any problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileError(f"cannot read {path}: {exc.strerror}", unread=True) from None
    except UnicodeDecodeError as exc:
        # A writer caught mid-write, or not a routes file: like bad JSON, the previous table
        # stays (SPEC §3). An escaped exception would end the feed's task for good.
        raise FileError(f"{path}: not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer past int()'s 4,300 digits
        raise FileError(f"{path}: invalid JSON: {exc}") from None
    except RecursionError:
        raise FileError(f"{path}: invalid JSON: nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("routes"), list):
        raise FileError(f'{path}: expected an object {{"routes": [...]}}')
    unknown = set(doc) - {"routes"}
    if unknown:
        raise FileError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}")
    routes: list[Any] = doc["routes"]
    return routes


def write_routes_file(path: Path, routes: list[dict[str, Any]]) -> None:
    """Replace the file atomically (same directory, then rename), keeping who may read it.

    The file holds every sandbox's tokens (SPEC §2-3: readable by the ingress identity
    only), and the service reads it as its own user, often through the group of a root-owned
    file (docs/operations.md: ``0640 root:relay``). So the new file gets the old one's mode,
    owner and group whatever the umask of whoever runs ``relay routes``; a first file gets
    0640 and the group of its folder.
    """
    try:
        st = os.stat(path)
        mode, uid, gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    except OSError:
        mode, uid, gid = 0o640, -1, os.stat(path.parent).st_gid
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        with contextlib.suppress(PermissionError):  # not root: the file stays the caller's
            os.fchown(out.fileno(), uid, gid)
        os.fchmod(out.fileno(), mode)
        out.write(json.dumps({"routes": routes}, indent=2) + "\n")
    os.replace(tmp, path)


class FileFeed:
    source = "file"

    def __init__(
        self, sink: Sink, path: Path, allowed: tuple[Network, ...], poll_interval_s: float
    ) -> None:
        self.sink = sink
        self.path = path
        self.allowed = allowed
        self.max_stale_s = 30.0  # unused: a file is read afresh each poll, nothing can hang
        self.poll_interval_s = poll_interval_s
        self._seen: tuple[int, int, int] | None = None
        # The last load's routes, validated against _known_allowed (relay.core.routes.parse_routes)
        self._known: dict[str, Route] = {}
        self._known_allowed: tuple[Network, ...] | None = None
        self._last_error: str | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def load(self) -> bool:
        """Read the file now; True when a table was installed."""
        self._seen = self._signature()
        try:
            items = read_routes_file(self.path)
        except FileError as exc:
            if exc.unread:
                # Not seen: a version whose read failed (a relay at its descriptor limit) was
                # taken for seen, and its table never applied (found by review: a removed
                # route kept serving until the next change or SIGHUP).
                self._seen = None
            message = str(exc)
            if message != self._last_error:  # log a broken file once, not every poll
                self.sink.feed_failed(self.source, message)
            self._last_error = message
            return False
        self._last_error = None
        known = self._known if self._known_allowed is self.allowed else None
        routes, errors = parse_routes(items, self.allowed, known)
        self._known, self._known_allowed = routes, self.allowed
        if errors:
            self.sink.reject_routes(errors, self.source)
        self.sink.install_routes(routes, self.source)
        return True

    def poll(self) -> None:
        signature = self._signature()
        if signature != self._seen:
            self.load()

    async def run(self) -> None:
        self._guarded(self.load)
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self._guarded(self.poll)

    def _guarded(self, read: Callable[[], object]) -> None:
        """A read of the file, its first included: an unexpected error (a bug) is logged and
        the polls go on, as the Redis feed's do. Before, the task ended, and with it every
        later reload of the file, while /readyz stayed 200 (found by review). That version
        counts as seen (a bug would strike again, and log, at every poll); the next is read."""
        try:
            read()
        except Exception:
            log.exception("route feed: unexpected error reading %s", self.path)
