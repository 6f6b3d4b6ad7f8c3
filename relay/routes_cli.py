"""``relay routes put FILE|- | delete ID | list`` (SPEC §3, §7) for both route sources.

Every route given to ``put`` is validated with the relay's own rules before anything is
written, so a control plane (or an operator) learns about a bad route here rather than from
a rejection counter on every relay. Writes are atomic per call: one MULTI/EXEC holding the
hash changes and their stream events (Redis), or one rename of the whole file (file).
``list`` shows what ``/routes`` shows: ids, addresses, generations, never a token.

Exit codes: 0 done, 2 invalid input or configuration (the message names the problem),
1 the source could not be read or written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import stat
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.config import Config
from relay.config_parse import load
from relay.core.model import Route
from relay.core.routes import RouteError, parse_route, parse_routes, public_view
from relay.core.target import valid_sandbox_id
from relay.feeds.file import FileError, read_routes_file, write_routes_file

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    Action = Callable[[aioredis.Redis, str], Awaitable[None]]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
DEFAULT_MAXLEN = 10_000


class InvalidInput(ValueError):
    """Input that must not be written; the message names the problem."""


def add_parser(sub: Any) -> None:
    """Register ``routes`` on the top-level subparsers of ``relay``."""
    routes = sub.add_parser("routes", help="write or read the configured route source")
    verbs = routes.add_subparsers(dest="verb", required=True)
    put = verbs.add_parser("put", help='publish routes: one route object or {"routes": [...]}')
    put.add_argument("source_file", metavar="FILE", help="JSON file, or - for stdin")
    delete = verbs.add_parser("delete", help="remove one sandbox's route")
    delete.add_argument("sandbox_id", metavar="ID", help="the sandbox id")
    for writer in (put, delete):
        writer.add_argument("--config", required=True, help="TOML configuration file")
        writer.add_argument(
            "--maxlen",
            type=int,
            default=DEFAULT_MAXLEN,
            help=f"redis: trim the event stream to about N entries (default {DEFAULT_MAXLEN}, "
            "0 = no)",
        )
    listing = verbs.add_parser("list", help="ids, addresses and generations (no tokens)")
    listing.add_argument("--config", required=True, help="TOML configuration file")


def run(args: argparse.Namespace) -> int:
    """Entry point for ``relay routes``; ConfigError propagates to ``main`` (exit 2)."""
    config = load(args.config)
    try:
        if args.verb == "put":
            text = sys.stdin.read() if args.source_file == "-" else _read(args.source_file)
            return _put(config, validate_input(text, config), args.maxlen)
        if args.verb == "delete":
            if not valid_sandbox_id(args.sandbox_id):
                raise InvalidInput(f"{args.sandbox_id!r} is not a sandbox id ^[a-z0-9]{{1,64}}$")
            return _delete(config, args.sandbox_id, args.maxlen)
        return _list(config)
    except InvalidInput as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except SourceError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return EXIT_FAILED


class SourceError(RuntimeError):
    """The route source could not be read or written."""


def _read(name: str) -> str:
    try:
        return Path(name).read_text()
    except OSError as exc:
        raise InvalidInput(f"cannot read {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{name}: not UTF-8 text") from None


def validate_input(text: str, config: Config) -> list[dict[str, Any]]:
    """The route objects of ``put``'s input, every one valid; else InvalidInput naming them all."""
    try:
        doc = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer past int()'s 4,300 digits
        raise InvalidInput(f"input is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("input is not valid JSON: nested too deeply") from None
    if isinstance(doc, dict) and "routes" in doc:
        extra = sorted(set(doc) - {"routes"})
        if extra:
            raise InvalidInput(f"unknown top-level key(s): {', '.join(extra)}")
        items = doc["routes"]
        if not isinstance(items, list):
            raise InvalidInput('"routes" must be a list')
    elif isinstance(doc, dict):
        items = [doc]
    else:
        raise InvalidInput('input must be one route object or {"routes": [...]}')
    problems: list[str] = []
    seen: set[str] = set()
    allowed = config.allowed_cidrs()
    for index, item in enumerate(items):
        parsed = parse_route(item, allowed)
        if isinstance(parsed, RouteError):
            sid = parsed.sandbox_id or "?"
            problems.append(f"route #{index} (sandbox_id {sid}): {parsed.reason}")
            continue
        sandbox_id = parsed.sandbox_id
        if sandbox_id in seen:
            problems.append(f"route #{index}: sandbox_id {sandbox_id} appears more than once")
        seen.add(sandbox_id)
    if problems:
        raise InvalidInput("invalid input, nothing written:\n  " + "\n  ".join(problems))
    return items


def _canonical(route: dict[str, Any]) -> str:
    return json.dumps(route, separators=(",", ":"), sort_keys=True)


# -- per verb, per source ------------------------------------------------------------------------


def _put(config: Config, routes: list[dict[str, Any]], maxlen: int) -> int:
    if config.routes.source == "redis":
        pairs = [(r["sandbox_id"], _canonical(r)) for r in routes]
        server = _redis(config, lambda c, prefix: _redis_put(c, prefix, pairs, maxlen))
        where = f"redis {server}"
    else:
        with _routes_file(config) as path:
            existing = _file_items(path, missing_ok=True)
            new_ids = {r["sandbox_id"] for r in routes}
            kept = [
                r for r in existing if not (isinstance(r, dict) and r.get("sandbox_id") in new_ids)
            ]
            _write(path, [*kept, *routes])
        where = str(path)
    print(f"put {len(routes)} route(s) to {where}")
    return EXIT_OK


def _delete(config: Config, sandbox_id: str, maxlen: int) -> int:
    if config.routes.source == "redis":
        existed = False

        async def go(client: aioredis.Redis, prefix: str) -> None:
            nonlocal existed
            from relay.feeds.redis_client import publish_delete  # noqa: PLC0415

            existed = await publish_delete(client, prefix, sandbox_id, maxlen or None)

        _redis(config, go)
    else:
        with _routes_file(config) as path:
            items = _file_items(path, missing_ok=False)
            kept = [
                r for r in items if not (isinstance(r, dict) and r.get("sandbox_id") == sandbox_id)
            ]
            existed = len(kept) != len(items)
            if existed:
                _write(path, kept)
    print(f"deleted {sandbox_id}" if existed else f"{sandbox_id} had no route")
    return EXIT_OK


def load_table(config: Config) -> tuple[dict[str, Route], list[RouteError]]:
    """The configured source's routes, validated; raises :class:`SourceError`."""
    allowed = config.allowed_cidrs()
    if config.routes.source == "redis":
        from relay.core.feed import parse_snapshot  # noqa: PLC0415

        raw: dict[bytes, bytes] = {}

        async def go(client: aioredis.Redis, prefix: str) -> None:
            from relay.feeds.redis_client import read_table  # noqa: PLC0415

            raw.update(await read_table(client, prefix))

        _redis(config, go)
        routes, errors = parse_snapshot(raw, allowed)
    else:
        routes, errors = parse_routes(
            _file_items(config.path(config.routes.file), missing_ok=False), allowed
        )
    return routes, errors


def _list(config: Config) -> int:
    routes, errors = load_table(config)
    for error in errors:
        print(f"relay: rejected route {error.sandbox_id or '?'}: {error.reason}", file=sys.stderr)
    views = [public_view(routes[sid]) for sid in sorted(routes)]
    print(json.dumps({"routes": views}, indent=2))
    return EXIT_OK


# -- sources -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _routes_file(config: Config) -> Iterator[Path]:
    """The routes file, locked: one ``put`` or ``delete`` at a time per routes file. Each reads
    the file, changes it and renames a new one over it, so two at once lost one's change, and a
    delete could come back with its credentials (found by review: 8 puts at once left 4-5
    routes). The lock is a file of its own beside it (``.<name>.lock``; the routes file itself
    is renamed over); relay itself never takes it, as each rename is atomic.

    The path is the file a symlink names: renamed over, the link became a file of its own,
    which relays reading the real one never saw (found by review: a delete kept serving), and
    the two ways to name it took two locks."""
    path = Path(os.path.realpath(config.path(config.routes.file)))
    lock = path.with_name(f".{path.name}.lock")
    try:
        # Read-only: flock needs no more, and whoever else may write the routes file (the
        # service user, the file's group) must be able to take it too (found by review: a
        # 0600 lock file root made locked every other writer out). It holds nothing.
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o640)
    except OSError as exc:
        raise SourceError(f"cannot lock {path}: {exc.strerror}") from None
    with contextlib.suppress(OSError):  # whoever may read the routes file may take the lock
        st = os.stat(path)
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o666)  # (fails on another's lock file)
        with contextlib.suppress(PermissionError):  # its owner too (found by review): as root
            os.fchown(fd, st.st_uid, st.st_gid)
        os.fchown(fd, -1, st.st_gid)  # not root: its group, where the caller is in it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for the other writer (a read-modify-write)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _file_items(path: Path, *, missing_ok: bool) -> list[Any]:
    if missing_ok and not path.exists():
        return []
    try:
        return read_routes_file(path)
    except FileError as exc:
        raise SourceError(str(exc)) from None


def _write(path: Path, routes: list[Any]) -> None:
    try:
        write_routes_file(path, routes)
    except OSError as exc:
        raise SourceError(f"cannot write {path}: {exc.strerror}") from None


async def _redis_put(
    client: aioredis.Redis, prefix: str, pairs: list[tuple[str, str]], maxlen: int
) -> None:
    from relay.feeds.redis_client import publish_puts  # noqa: PLC0415

    await publish_puts(client, prefix, pairs, maxlen or None)


def _redis(config: Config, action: Action) -> str:
    """Run ``action(client, prefix)`` against the configured Redis; its host:port."""
    from redis.exceptions import RedisError  # noqa: PLC0415

    from relay.feeds.redis_client import connect, redis_target  # noqa: PLC0415

    target = redis_target(config)

    async def go() -> None:
        client = connect(target, socket_timeout=10.0)
        try:
            await action(client, target.prefix)
        finally:
            await client.aclose()

    try:
        asyncio.run(go())
    except (RedisError, OSError) as exc:
        raise SourceError(f"redis {target.server}: {exc}") from None
    return target.server
