"""The ``routes.redis_*`` keys (SPEC §3, §6): where the Redis identity comes from, the URL as
redis-py will take it, and a password written into the URL, found (the feed warns) and
redacted (``check-config`` prints the URL).
"""

from __future__ import annotations

import urllib.parse

from relay.config import ConfigError, Routes, check


def url_password(url: str) -> str | None:
    """A password written into a Redis URL: the userinfo's, or a non-empty ``password``
    query parameter, which redis-py's ``from_url`` also reads (and prefers over its
    argument; it ignores an empty one)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        return parts.password
    values = urllib.parse.parse_qs(parts.query).get("password")
    return values[0] if values else None


def redact_url(url: str) -> str:
    """``url`` with any password in it (userinfo or query) replaced by ``<redacted>``, and
    otherwise exactly as written (``check-config``'s output may be copied back)."""
    if url_password(url) is None:
        return url
    # urlsplit, and redis-py through it, drop tabs and line ends anywhere in a URL (WHATWG):
    # the password they read may be spelled with them in the file, where the replacements
    # below would not find it (found by review: check-config printed it). Shown without them.
    url = url.translate(_DROPPED_BY_URLSPLIT)
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        url = url.replace(f":{parts.password}@", ":<redacted>@", 1)
    if parts.query:
        pieces = [
            # The key as parse_qs (url_password, redis-py) reads it: "pass%77ord" is one too
            # (found by review: check-config printed its value).
            "password=<redacted>"
            if urllib.parse.unquote_plus(piece.partition("=")[0]) == "password"
            else piece
            for piece in parts.query.split("&")
        ]
        url = url.replace(f"?{parts.query}", "?" + "&".join(pieces), 1)
    return url


_DROPPED_BY_URLSPLIT = dict.fromkeys(map(ord, "\t\r\n"))
_URL_ERRORS = (("Port", "invalid port"), ("IPv6", "invalid IPv6 address"))


def check_redis_secrets(routes: Routes) -> None:
    """Where the Redis identity comes from must be unambiguous.

    The password belongs in ``redis_password_file`` or ``redis_password_env`` (SPEC §6); a
    password inside ``redis_url`` is still accepted (``check-config`` redacts it, the feed
    logs a warning) but not together with those keys, because redis-py would silently
    prefer the URL's.
    """
    try:
        urllib.parse.urlsplit(routes.redis_url).port  # noqa: B018 - it raises what is wrong
    except ValueError as exc:  # "Invalid IPv6 URL" for redis://[::1:6379/0 (found by review)
        # Never urllib's text, which quotes what it could not parse: in "redis://user:secret"
        # (the @ forgotten) the "port" is the password, and its netloc check quotes the whole
        # netloc, password included (found by review, twice).
        text = str(exc)
        why = next((w for k, w in _URL_ERRORS if k in text), "not a valid URL")
        raise ConfigError(f"routes.redis_url: {why}") from None
    check(
        not (routes.redis_password_file and routes.redis_password_env),
        "routes.redis_password_env",
        "set redis_password_file or redis_password_env, not both",
    )
    check(
        url_password(routes.redis_url) is None
        or not (routes.redis_password_file or routes.redis_password_env),
        "routes.redis_url",
        "holds a password while redis_password_file or redis_password_env is set",
    )
    check(
        not (urllib.parse.urlsplit(routes.redis_url).username and routes.redis_username),
        "routes.redis_username",
        "redis_url names a user already",
    )
    check(
        not routes.redis_ca_file or routes.redis_url.startswith("rediss://"),
        "routes.redis_ca_file",
        "needs a rediss:// URL",
    )


def check_redis_options(url: str) -> None:
    """The URL's options as redis-py takes them when the feed connects (``?socket_timeout=``,
    ``?protocol=``, an option it does not know...): refused there, the feed task died with a
    traceback and relay stayed "not ready" for ever, or the feed failed with a traceback at
    every retry (found by review). A client and a connection object are made here as the
    feed makes them, without I/O; redis-py's messages name the option."""
    from redis.asyncio import Redis  # noqa: PLC0415 - only for source = redis
    from redis.exceptions import RedisError  # noqa: PLC0415

    try:
        pool = Redis.from_url(url, protocol=2).connection_pool
        pool.make_connection()  # type: ignore[no-untyped-call]  # (redis-py leaves it untyped)
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigError(f"routes.redis_url: redis-py refuses it: {exc}") from None
    except Exception as exc:  # ?retry=x: AttributeError, whatever redis-py trips on
        raise ConfigError(
            f"routes.redis_url: redis-py cannot use it ({type(exc).__name__})"
        ) from None
