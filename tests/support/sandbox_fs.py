"""The fake sandbox's filesystem: sandbox paths mapped into a host directory, and EntryInfo
built exactly as envd builds it.

Sources: envd ``internal/permissions/path.go`` (ExpandAndResolve, EnsureDirs),
``internal/services/filesystem/utils.go`` (entryInfo), ``packages/shared/pkg/filesystem/entry.go``
(GetEntryInfo: Lstat, symlinks typed by their target), Go's ``os.FileMode.String`` for
``permissions``, and proto3 JSON for the encoding (int64 as a string, enums by name, zero values
omitted, Timestamp as RFC 3339 with 0/3/6/9 fractional digits).

Every sandbox path maps to ``root/<path>``; ``..`` cannot climb above ``root``. Paths reported
back to clients are sandbox paths. A command run by the fake runs on the host, so it sees host
paths (``$HOME`` is the mapped home directory): the mapping is a test convenience, not isolation.
"""

from __future__ import annotations

import contextlib
import grp
import os
import posixpath
import pwd
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.connect import ConnectError, JSONDict


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxUser:
    name: str
    home: str  # sandbox path


# The users of an E2B base image that the SDK names: "user" is envd's default user
# (notes §1.1 `default_username`), "root" is the other one SDK callers pass.
USERS: dict[str, SandboxUser] = {
    "user": SandboxUser(name="user", home="/home/user"),
    "root": SandboxUser(name="root", home="/root"),
}
DEFAULT_USER = USERS["user"]


def go_clean(path: str) -> str:
    """Go's path.Clean (normpath keeps a leading '//', Go does not)."""
    cleaned = posixpath.normpath(path)
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


def go_errno_text(error: OSError) -> str:
    """The text of a syscall errno as Go prints it (lower-case first letter)."""
    text = error.strerror or str(error)
    return text[:1].lower() + text[1:]


def go_base(path: str) -> str:
    """os.FileInfo.Name() for an Lstat(path): the last element, '/' for the root."""
    stripped = path.rstrip("/")
    return posixpath.basename(stripped) if stripped else "/"


# Go's os.FileMode type bits, in the order FileMode.String prints them ("dalTLDpSugct?").
_GO_MODE_LETTERS = "dalTLDpSugct?"
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_DEVICE = 1 << 26
_GO_MODE_NAMED_PIPE = 1 << 25
_GO_MODE_SOCKET = 1 << 24
_GO_MODE_SETUID = 1 << 23
_GO_MODE_SETGID = 1 << 22
_GO_MODE_CHAR_DEVICE = 1 << 21
_GO_MODE_STICKY = 1 << 20


def go_file_mode(st_mode: int) -> int:
    """The Go os.FileMode that os.Lstat reports for a Linux st_mode (os/stat_linux.go)."""
    mode = st_mode & 0o777
    kind = stat.S_IFMT(st_mode)
    mode |= {
        stat.S_IFBLK: _GO_MODE_DEVICE,
        stat.S_IFCHR: _GO_MODE_DEVICE | _GO_MODE_CHAR_DEVICE,
        stat.S_IFDIR: _GO_MODE_DIR,
        stat.S_IFIFO: _GO_MODE_NAMED_PIPE,
        stat.S_IFLNK: _GO_MODE_SYMLINK,
        stat.S_IFSOCK: _GO_MODE_SOCKET,
    }.get(kind, 0)
    if st_mode & stat.S_ISUID:
        mode |= _GO_MODE_SETUID
    if st_mode & stat.S_ISGID:
        mode |= _GO_MODE_SETGID
    if st_mode & stat.S_ISVTX:
        mode |= _GO_MODE_STICKY
    return mode


def go_mode_string(go_mode: int) -> str:
    """Go's FileMode.String(): type letters (or '-') then rwxrwxrwx."""
    letters = "".join(c for i, c in enumerate(_GO_MODE_LETTERS) if go_mode & (1 << (31 - i)))
    perms = "".join(c if go_mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (letters or "-") + perms


def proto_timestamp(ns: int) -> str:
    """google.protobuf.Timestamp in proto3 JSON: UTC, 'Z', 0/3/6/9 fractional digits."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if nanos == 0:
        return text + "Z"
    if nanos % 1_000_000 == 0:
        return f"{text}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{text}.{nanos // 1_000:06d}Z"
    return f"{text}.{nanos:09d}Z"


def _owner_names(st: os.stat_result) -> tuple[str, str]:
    """utils.go getFileOwnership: names when they resolve, numeric ids otherwise."""
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return owner, group


_TYPE_BY_KIND = {stat.S_IFREG: "FILE_TYPE_FILE", stat.S_IFDIR: "FILE_TYPE_DIRECTORY"}
METADATA_XATTR_PREFIX = "user.e2b."  # packages/shared/pkg/filesystem/xattr.go


def read_metadata(host_path: Path) -> dict[str, str]:
    """xattr.go ReadMetadata, best effort as GetEntryFromPath uses it (errors → no metadata)."""
    try:
        names = os.listxattr(host_path)
    except OSError:
        return {}
    metadata: dict[str, str] = {}
    for name in names:
        if not name.startswith(METADATA_XATTR_PREFIX):
            continue
        try:
            value = os.getxattr(host_path, name)
        except OSError:
            continue
        try:
            metadata[name[len(METADATA_XATTR_PREFIX) :]] = value.decode()
        except UnicodeDecodeError:
            continue  # envd skips non-UTF-8 values so the whole entry still marshals
    return metadata


class SandboxFS:
    def __init__(self, root: Path) -> None:
        self.root = root
        for user in USERS.values():
            self.host(user.home).mkdir(parents=True, exist_ok=True)
        self.host("/tmp").mkdir(exist_ok=True)

    def host(self, sandbox_path: str) -> Path:
        """Host path for a sandbox path (absolute or not; '..' never leaves the root)."""
        relative = go_clean("/" + sandbox_path).lstrip("/")
        return self.root / relative if relative else self.root

    def sandbox(self, host_path: str | Path) -> str:
        """Sandbox path for a host path inside the root; other host paths are returned as is."""
        host = Path(host_path)
        try:
            relative = host.relative_to(self.root)
        except ValueError:
            return str(host)
        return "/" + relative.as_posix() if relative.parts else "/"

    def resolve(self, path: str, user: SandboxUser, workdir: str | None = None) -> str:
        """permissions.ExpandAndResolve: '' → workdir, '~' → home, relative → under home.

        Absolute paths come back as given (not cleaned), as in envd; error texts and the
        ``path`` of a Stat entry therefore show the caller's spelling.
        """
        path = path or workdir or ""
        if path.startswith("~"):
            if len(path) > 1 and path[1] not in "/\\":
                raise ConnectError(
                    "invalid_argument",
                    f"failed to expand path '{path}' for user '{user.name}': "
                    "cannot expand user-specific home dir",
                )
            path = go_clean(user.home + "/" + path[1:])
        if path.startswith("/"):
            return path
        return go_clean(user.home + "/" + path)

    def ensure_dirs(self, path: str) -> None:
        """permissions.EnsureDirs: create each missing directory (0755); a file in the way fails."""
        parts = [p for p in go_clean(path).split("/") if p]
        current = ""
        for part in parts:
            current += "/" + part
            host = self.host(current)
            if host.is_dir():
                continue
            if host.exists():
                raise ConnectError("internal", f"path is a file: {current}")
            with contextlib.suppress(FileExistsError):  # created concurrently
                host.mkdir(mode=0o755)

    def entry_info(self, path: str) -> JSONDict:
        """utils.go entryInfo for a sandbox path (Lstat; not_found when it does not exist)."""
        host = self.host(path)
        try:
            st = os.lstat(host)
        except FileNotFoundError as exc:
            raise ConnectError(
                "not_found", f"file not found: lstat {path}: {go_errno_text(exc)}"
            ) from exc
        except OSError as exc:
            raise ConnectError(
                "internal", f"error getting file info: lstat {path}: {go_errno_text(exc)}"
            ) from exc
        return self.entry_from_stat(path, host, st)

    def entry_from_stat(self, path: str, host: Path, st: os.stat_result) -> JSONDict:
        entry_type: str | None
        symlink_target: str | None = None
        if stat.S_ISLNK(st.st_mode):
            # entry.go: a symlink is typed by its target; an unresolvable link keeps its own
            # path as target and gets no type and no mode.
            try:
                symlink_target = self.sandbox(os.path.realpath(host, strict=True))
            except OSError:
                symlink_target = path
            try:
                target_st = os.stat(self.host(symlink_target))
                entry_type = _TYPE_BY_KIND.get(stat.S_IFMT(target_st.st_mode))
                mode = target_st.st_mode & 0o777
            except OSError:
                entry_type, mode = None, 0
        else:
            entry_type = _TYPE_BY_KIND.get(stat.S_IFMT(st.st_mode))
            mode = st.st_mode & 0o777
        owner, group = _owner_names(st)
        entry: JSONDict = {"name": go_base(path)}
        if entry_type:
            entry["type"] = entry_type
        if path:
            entry["path"] = path
        if st.st_size:
            entry["size"] = str(st.st_size)  # int64 → JSON string (proto3 JSON)
        if mode:
            entry["mode"] = mode
        entry["permissions"] = go_mode_string(go_file_mode(st.st_mode))
        entry["owner"] = owner
        entry["group"] = group
        if st.st_mtime_ns:
            entry["modifiedTime"] = proto_timestamp(st.st_mtime_ns)
        if symlink_target is not None:
            entry["symlinkTarget"] = symlink_target
        metadata = read_metadata(host)
        if metadata:
            entry["metadata"] = metadata
        return entry
