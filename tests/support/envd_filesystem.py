"""filesystem.Filesystem for the fake envd.

Sources: envd ``internal/services/filesystem/{stat,dir,move,remove,watch,watch_sync,utils}.go``
and ``spec/filesystem/filesystem.proto``. Error codes and texts follow envd; Go's error strings
are rebuilt with sandbox paths.

Watching polls the directory (every ``poll_interval`` seconds) instead of using inotify, and turns
snapshot differences into fsnotify-style events: a new entry is CREATE (plus WRITE when it already
has content, as the write that filled it would have been reported), a changed file is WRITE, a
permission change is CHMOD, a vanished entry is REMOVE, and an entry that reappears under another
name with the same inode and mtime is RENAME (old name) + CREATE (new name), as inotify reports a
rename. Within one poll, removals come first, then new entries oldest first, then changes; the
order of events that happen within one poll interval is therefore approximate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import secrets
import shutil
import stat
import string
from dataclasses import dataclass
from pathlib import Path

from tests.support.connect import ConnectError, JSONDict
from tests.support.envd_rpc import Call, KeepaliveTicker, Send, StreamMethod, UnaryMethod
from tests.support.sandbox_fs import SandboxFS, go_clean, go_errno_text

CREATE, WRITE, REMOVE, RENAME, CHMOD = (
    "EVENT_TYPE_CREATE",
    "EVENT_TYPE_WRITE",
    "EVENT_TYPE_REMOVE",
    "EVENT_TYPE_RENAME",
    "EVENT_TYPE_CHMOD",
)
# utils.go opCarriesEntry: remove/rename refer to an entry that is gone.
_CARRIES_ENTRY = {CREATE, WRITE, CHMOD}
_ID_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True, slots=True)
class _Seen:
    inode: int
    is_dir: bool
    size: int
    mtime_ns: int
    mode: int


class DirPoller:
    """Snapshot differences of a directory (or tree) as (relative name, event type) pairs."""

    def __init__(self, host_dir: Path, recursive: bool) -> None:
        self._dir = host_dir
        self._recursive = recursive
        self._snapshot = self._scan()

    def poll(self) -> list[tuple[str, str]]:
        old, new = self._snapshot, self._scan()
        self._snapshot = new
        # Oldest first (by mtime) approximates the order in which inotify would have seen them.
        added = sorted((n for n in new if n not in old), key=lambda n: (new[n].mtime_ns, n))
        renamed_from = {(new[n].inode, new[n].mtime_ns): n for n in added}
        events: list[tuple[str, str]] = []
        for name in sorted(n for n in old if n not in new):
            moved = (old[name].inode, old[name].mtime_ns) in renamed_from
            events.append((name, RENAME if moved else REMOVE))
        for name in added:
            events.append((name, CREATE))
            if not new[name].is_dir and new[name].size:
                events.append((name, WRITE))
        for name in sorted(n for n in new if n in old):
            before, after = old[name], new[name]
            if not after.is_dir and (before.size, before.mtime_ns) != (after.size, after.mtime_ns):
                events.append((name, WRITE))
            if before.mode != after.mode:
                events.append((name, CHMOD))
        return events

    def _scan(self) -> dict[str, _Seen]:
        seen: dict[str, _Seen] = {}
        pending = [""]
        while pending:
            prefix = pending.pop()
            try:
                entries = list(os.scandir(self._dir / prefix))
            except OSError:
                continue  # vanished between polls
            for entry in entries:
                name = f"{prefix}/{entry.name}" if prefix else entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                seen[name] = _Seen(st.st_ino, is_dir, st.st_size, st.st_mtime_ns, st.st_mode)
                if is_dir and self._recursive:
                    pending.append(name)
        return seen


@dataclass(eq=False)
class _SyncWatcher:
    task: asyncio.Task[None]
    events: list[JSONDict]


class FilesystemService:
    def __init__(self, fs: SandboxFS, *, poll_interval: float = 0.05) -> None:
        self._fs = fs
        self._poll_interval = poll_interval
        self._watchers: dict[str, _SyncWatcher] = {}
        self.workdir: str | None = None

    def unary_methods(self) -> dict[str, UnaryMethod]:
        return {
            "/filesystem.Filesystem/Stat": self.stat,
            "/filesystem.Filesystem/MakeDir": self.make_dir,
            "/filesystem.Filesystem/Move": self.move,
            "/filesystem.Filesystem/ListDir": self.list_dir,
            "/filesystem.Filesystem/Remove": self.remove,
            "/filesystem.Filesystem/CreateWatcher": self.create_watcher,
            "/filesystem.Filesystem/GetWatcherEvents": self.get_watcher_events,
            "/filesystem.Filesystem/RemoveWatcher": self.remove_watcher,
        }

    def stream_methods(self) -> dict[str, StreamMethod]:
        return {"/filesystem.Filesystem/WatchDir": self.watch_dir}

    async def close(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher.task.cancel()
        await asyncio.gather(*(w.task for w in watchers.values()), return_exceptions=True)

    def _resolve(self, call: Call, path: str) -> str:
        return self._fs.resolve(path, call.user, self.workdir)

    # -- unary (plain functions: filesystem calls are quick and synchronous) --------------------

    def stat(self, call: Call, request: JSONDict) -> JSONDict:
        return {"entry": self._fs.entry_info(self._resolve(call, request.get("path", "")))}

    def make_dir(self, call: Call, request: JSONDict) -> JSONDict:
        path = self._resolve(call, request.get("path", ""))
        host = self._fs.host(path)
        if host.exists():
            if host.is_dir():
                raise ConnectError("already_exists", f"directory already exists: {path}")
            raise ConnectError(
                "invalid_argument", f"path already exists but it is not a directory: {path}"
            )
        self._fs.ensure_dirs(path)
        return {"entry": self._fs.entry_info(path)}

    def move(self, call: Call, request: JSONDict) -> JSONDict:
        source = self._resolve(call, request.get("source", ""))
        destination = self._resolve(call, request.get("destination", ""))
        self._fs.ensure_dirs(posixpath.dirname(go_clean(destination)))
        src_host, dst_host = self._fs.host(source), self._fs.host(destination)
        try:
            # Go's os.Rename refuses to replace an existing directory (EEXIST).
            if dst_host.is_dir() and not dst_host.is_symlink() and src_host != dst_host:
                raise FileExistsError(17, "File exists")
            os.rename(src_host, dst_host)
        except FileNotFoundError as exc:
            raise ConnectError(
                "not_found",
                f"source file not found: rename {source} {destination}: {go_errno_text(exc)}",
            ) from exc
        except OSError as exc:
            raise ConnectError(
                "internal", f"error renaming: rename {source} {destination}: {go_errno_text(exc)}"
            ) from exc
        return {"entry": self._fs.entry_info(destination)}

    def list_dir(self, call: Call, request: JSONDict) -> JSONDict:
        depth = int(request.get("depth") or 1)  # dir.go: 0 means 1
        requested = self._resolve(call, request.get("path", ""))
        try:
            resolved_host = Path(os.path.realpath(self._fs.host(requested), strict=True))
        except FileNotFoundError as exc:
            raise ConnectError(
                "not_found", f"path not found: lstat {requested}: {go_errno_text(exc)}"
            ) from exc
        except OSError as exc:
            raise ConnectError(
                "internal", f"error resolving symlink: {requested}: {go_errno_text(exc)}"
            ) from exc
        if not resolved_host.is_dir():
            resolved = self._fs.sandbox(resolved_host)
            raise ConnectError("invalid_argument", f"path is not a directory: {resolved}")
        entries = []
        for relative, host in _walk(resolved_host, depth):
            try:
                entry = self._fs.entry_from_stat(
                    go_clean(f"{requested}/{relative}"), host, os.lstat(host)
                )
            except FileNotFoundError:
                continue  # dir.go: entries that vanished meanwhile are skipped
            entries.append(entry)
        return {"entries": entries} if entries else {}

    def remove(self, call: Call, request: JSONDict) -> JSONDict:
        path = self._resolve(call, request.get("path", ""))
        host = self._fs.host(path)
        try:
            # os.RemoveAll: a missing path is success; a symlink is removed, not followed.
            if host.is_dir() and not host.is_symlink():
                shutil.rmtree(host)
            else:
                host.unlink(missing_ok=True)
        except OSError as exc:
            raise ConnectError(
                "internal", f"error removing file or directory: {go_errno_text(exc)}"
            ) from exc
        return {}

    def create_watcher(self, call: Call, request: JSONDict) -> JSONDict:
        path, poller = self._open_watch(call, request)
        watcher_id = "w" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))
        events: list[JSONDict] = []
        include_entry = bool(request.get("includeEntry"))
        task = asyncio.create_task(self._collect(path, poller, include_entry, events))
        self._watchers[watcher_id] = _SyncWatcher(task, events)
        return {"watcherId": watcher_id}

    def get_watcher_events(self, call: Call, request: JSONDict) -> JSONDict:
        watcher = self._watcher(request.get("watcherId", ""))
        events = list(watcher.events)
        watcher.events.clear()
        return {"events": events} if events else {}

    async def remove_watcher(self, call: Call, request: JSONDict) -> JSONDict:
        watcher_id = request.get("watcherId", "")
        watcher = self._watcher(watcher_id)
        del self._watchers[watcher_id]
        watcher.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher.task
        return {}

    def _watcher(self, watcher_id: str) -> _SyncWatcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None:
            raise ConnectError("not_found", f"watcher with id {watcher_id} not found")
        return watcher

    # -- stream ---------------------------------------------------------------------------------

    async def watch_dir(self, call: Call, request: JSONDict, send: Send) -> None:
        path, poller = self._open_watch(call, request)
        include_entry = bool(request.get("includeEntry"))
        await send({"start": {}})
        ticker = KeepaliveTicker(call.keepalive_s)
        while True:
            await asyncio.sleep(min(self._poll_interval, ticker.remaining()))
            events = poller.poll()
            for name, kind in events:
                await send({"filesystem": self._event(path, name, kind, include_entry)})
                ticker.reset()
            if not events and ticker.remaining() <= 0:
                await send({"keepalive": {}})
                ticker.fired()

    def _open_watch(self, call: Call, request: JSONDict) -> tuple[str, DirPoller]:
        """watch.go / watch_sync.go checks before watching."""
        path = self._resolve(call, request.get("path", ""))
        host = self._fs.host(path)
        try:
            is_dir = stat.S_ISDIR(os.stat(host).st_mode)
        except FileNotFoundError as exc:
            raise ConnectError(
                "not_found", f"path {path} not found: stat {path}: {go_errno_text(exc)}"
            ) from exc
        except OSError as exc:
            raise ConnectError(
                "internal", f"error statting path {path}: stat {path}: {go_errno_text(exc)}"
            ) from exc
        if not is_dir:
            # Go formats the nil error it wraps here as "%!w(<nil>)"; envd really sends that.
            raise ConnectError("invalid_argument", f"path {path} not a directory: %!w(<nil>)")
        return path, DirPoller(host, bool(request.get("recursive")))

    def _event(self, path: str, name: str, kind: str, include_entry: bool) -> JSONDict:
        event: JSONDict = {"name": name, "type": kind}
        if include_entry and kind in _CARRIES_ENTRY:
            with contextlib.suppress(ConnectError):  # utils.go eventEntryInfo: best effort
                event["entry"] = self._fs.entry_info(go_clean(f"{path}/{name}"))
        return event

    async def _collect(
        self, path: str, poller: DirPoller, include_entry: bool, sink: list[JSONDict]
    ) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            for name, kind in poller.poll():
                sink.append(self._event(path, name, kind, include_entry))


def _walk(root: Path, depth: int, prefix: str = "") -> list[tuple[str, Path]]:
    """filepath.WalkDir order (lexical, depth-first, symlinks not followed) up to ``depth``."""
    found: list[tuple[str, Path]] = []
    try:
        names = sorted(os.listdir(root / prefix))
    except FileNotFoundError:
        return found
    except OSError as exc:
        raise ConnectError(
            "internal", f"error reading directory {root}: {go_errno_text(exc)}"
        ) from exc
    for name in names:
        relative = f"{prefix}/{name}" if prefix else name
        host = root / relative
        found.append((relative, host))
        if relative.count("/") + 1 < depth and host.is_dir() and not host.is_symlink():
            found.extend(_walk(root, depth, relative))
    return found
