"""Route sources: ``file`` (embedded default) and ``redis`` (fleets). SPEC §3."""

from __future__ import annotations

from relay.config import Config
from relay.feeds.sink import Feed, StreamSink


def open_feed(sink: StreamSink, config: Config) -> Feed:
    """The feed ``routes.source`` names; raises ConfigError (naming the key) for bad secrets."""
    if config.routes.source == "redis":
        from relay.feeds.redis import RedisFeed  # noqa: PLC0415 (needs redis-py)
        from relay.feeds.redis_client import redis_target  # noqa: PLC0415

        return RedisFeed(
            sink,
            redis_target(config),
            config.allowed_cidrs(),
            max_stale_s=config.routes.max_stale_s,
        )
    from relay.feeds.file import FileFeed  # noqa: PLC0415

    return FileFeed(
        sink, config.path(config.routes.file), config.allowed_cidrs(), config.routes.poll_interval_s
    )
