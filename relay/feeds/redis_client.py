"""Reaching the routes in Redis: the ``[routes]`` settings with the password read, a client
that never retries on its own, and the control-plane writes (``relay routes put/delete``,
bench and tests) in the shape the feed reads (relay.feeds.redis, SPEC §3).

Credentials: the ACL user is ``routes.redis_username``; the password is read from
``routes.redis_password_file`` or the environment variable named by
``routes.redis_password_env``, never from the config file, and never logged (log lines name
the server as host:port only).
"""

from __future__ import annotations

import ast
import os
import re
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from relay.config import Config, ConfigError
from relay.core.feed import events_key, routes_key

CONNECT_TIMEOUT_S = 3.0


# -- connection settings -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisTarget:
    """Everything needed to reach the routes in Redis; the password is never printed."""

    url: str = field(repr=False)  # may hold a password too (routes.redis_url)
    prefix: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None

    @property
    def server(self) -> str:
        """host:port (or the socket path) for log lines: no credentials."""
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme == "unix":
            return parts.path
        host = parts.hostname or "localhost"
        return f"{host}:{parts.port or 6379}"


def redis_target(config: Config, *, environment: bool = True) -> RedisTarget:
    """The ``[routes]`` Redis settings with the password read; errors name the key.

    ``environment=False`` (``check-config``, run from a shell that need not have the service's
    environment) does not look for ``routes.redis_password_env``."""
    routes = config.routes
    password: str | None = None
    if routes.redis_password_file:
        path = config.path(routes.redis_password_file)
        try:
            password = path.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"routes.redis_password_file: cannot read {path}: {exc.strerror}"
            ) from None
        except UnicodeDecodeError:
            # A traceback and exit 1 otherwise, which Restart= retries for ever. Not chained:
            # the decode error holds the file's bytes (its .object), the password.
            raise ConfigError(f"routes.redis_password_file: {path} is not UTF-8 text") from None
        if not password:
            raise ConfigError(f"routes.redis_password_file: {path} is empty")
    elif routes.redis_password_env and environment:
        password = os.environ.get(routes.redis_password_env) or None
        if password is None:
            raise ConfigError(
                f"routes.redis_password_env: ${routes.redis_password_env} is not set or empty"
            )
    ca_file = str(config.path(routes.redis_ca_file)) if routes.redis_ca_file else None
    if ca_file is not None and not Path(ca_file).is_file():
        raise ConfigError(f"routes.redis_ca_file: {ca_file} is not a readable file")
    if ca_file is not None:
        # Loaded as each connection will load it: a file without a certificate passed and the
        # feed then retried for ever with an X509 error, never ready (found by review).
        try:
            ssl.create_default_context(cafile=ca_file)
        except ssl.SSLError:
            raise ConfigError(
                f"routes.redis_ca_file: {ca_file} holds no PEM certificate OpenSSL can load"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"routes.redis_ca_file: cannot read {ca_file}: {exc.strerror}"
            ) from None
    return RedisTarget(
        url=routes.redis_url,
        prefix=routes.redis_prefix,
        username=routes.redis_username or None,
        password=password,
        ca_file=ca_file,
    )


def connect(target: RedisTarget, *, socket_timeout: float | None) -> aioredis.Redis:
    """A single-connection client that does not retry on its own (the feed loop does)."""
    options: dict[str, Any] = {
        "username": target.username,
        "password": target.password,
        "protocol": 2,  # RESP2: every Redis >= 5 speaks it; the replies parsed below are RESP2
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "single_connection_client": True,
        "health_check_interval": 0,
        "driver_info": None,  # no CLIENT SETINFO: the relay's ACL user need not be allowed it
    }
    if target.url.startswith("rediss://") and target.ca_file is not None:
        options["ssl_ca_certs"] = target.ca_file
    return aioredis.Redis.from_url(target.url, **options)


# -- writing (``relay routes put/delete``, control planes in Python) ----------------------------


async def publish_puts(
    client: aioredis.Redis, prefix: str, routes: Sequence[tuple[str, str]], maxlen: int | None
) -> None:
    """HSET + XADD for each (sandbox id, route JSON), all in one MULTI/EXEC."""
    async with client.pipeline(transaction=True) as pipe:
        for sandbox_id, text in routes:
            pipe.hset(routes_key(prefix), sandbox_id, text)
            pipe.xadd(
                events_key(prefix),
                {"op": "put", "id": sandbox_id, "route": text},
                maxlen=maxlen,
                approximate=True,
            )
        await _execute(pipe)


async def publish_delete(
    client: aioredis.Redis, prefix: str, sandbox_id: str, maxlen: int | None
) -> bool:
    """HDEL + XADD in one MULTI/EXEC; True when the route existed."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.hdel(routes_key(prefix), sandbox_id)
        pipe.xadd(
            events_key(prefix), {"op": "delete", "id": sandbox_id}, maxlen=maxlen, approximate=True
        )
        removed, _ = await _execute(pipe)
    return bool(removed)


# redis-py's message for a command refused inside a pipeline: "Command # 1 (HSET relay:routes
# abc {...}) of pipeline caused error: ('<the server's reply>',)".
_ANNOTATED = re.compile(r"Command # \d+ \((\w+)")
_MARKER = " of pipeline caused error: "
# What Redis appends to "unknown command" errors (a renamed or disabled HSET): the arguments.
_ARGS_ECHO = ", with args beginning with"


async def _execute(pipe: Any) -> list[Any]:
    """``pipe.execute()``, its error without the commands' arguments.

    redis-py quotes a refused command, arguments included, in its error (up to 100
    characters), and the arguments of HSET and XADD are a route's JSON with its tokens: a
    ``relay routes put`` with the relay's read-only identity printed them (found by review).
    A control plane in Python logging the error would too. The error keeps its class, the
    command's name and Redis's reason."""
    try:
        return list(await pipe.execute())
    except ResponseError as exc:
        raise type(exc)(_without_arguments(str(exc))) from None


def _without_arguments(text: str) -> str:
    command = _ANNOTATED.match(text)
    if command is not None:
        reason = "refused"
        with_reason = text.rpartition(_MARKER)[2]  # after the quoted command, whatever it held
        try:
            args = ast.literal_eval(with_reason)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            args = None
        if isinstance(args, tuple) and args and isinstance(args[0], str):
            reason = args[0]
        text = f"{command.group(1)}: {reason}"
    elif text.startswith("Command # "):
        text = "a command was refused"
    return text.split(_ARGS_ECHO, 1)[0]


async def read_table(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    raw = await client.hgetall(routes_key(prefix))
    return {k: v for k, v in raw.items() if isinstance(k, bytes) and isinstance(v, bytes)}
