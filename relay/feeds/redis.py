"""The ``redis`` route source (SPEC §3): a snapshot from a hash, then changes from a stream.

Loop, top to bottom (:meth:`RedisFeed.run`)::

    connect → snapshot (MULTI: XINFO STREAM + HGETALL) → install table, ready
            → follow: XREAD BLOCK (wake-up) → MULTI: XREAD COUNT n + XINFO STREAM
                      → gap? resync : apply the batch in one table swap
    any error → feed broken (stale clock starts at the last good read) → jittered backoff
              → reconnect → snapshot again (always: we cannot know what we missed)

Why these shapes:

- The snapshot reads the stream's last id and the hash in one MULTI, so the position we
  follow from is exactly the one the hash reflects; nothing is replayed, so a route never
  goes back to an older version for a moment (which would revoke its streams twice).
- The blocking ``XREAD COUNT 1`` is only a wake-up. The entries are then read in a MULTI
  with ``XINFO STREAM``, so the stream's ``entries-added`` counter is taken at the same
  instant as the read and a gap (trimmed or deleted entries we never saw) is detected
  exactly, even while connected (``relay.core.feed.advance``). A full read is followed by
  more reads before anything is applied, so the entries of one control-plane MULTI are never
  split over two table swaps: a request never sees half of a transaction. A backlog past
  ``max_backlog`` entries is cheaper to resync than to replay, and is resynced.
- The feed's client never retries by itself (``Retry(..., 0)``): one loop owns reconnection
  and the stale clock, so an outage is seen once, not hidden behind silent retries.
- Cancellation is checked by hand after every Redis call
  (:func:`~relay.feeds.redis_snapshot.honour_cancel`): redis-py 8.1 on Python 3.11 loses a
  task's cancellation about half the time when it races a reply inside the client's
  socket-timeout block, and a feed that ignores its cancellation would hang ``Relay.stop()``
  (found by the 1,000 updates/s test, reproduced in isolation).

The feed's state, its stale clock and the snapshot are in :mod:`relay.feeds.redis_snapshot`
(:class:`RedisFeed` adds following to its base there); reaching Redis (settings, credentials,
the client) and writing routes are in :mod:`relay.feeds.redis_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.config_redis import url_password
from relay.core.feed import (
    Fold,
    Position,
    StreamId,
    StreamInfo,
    advance,
    backoff_delay,
    format_stream_id,
    next_read_count,
    parse_stream_id,
)
from relay.feeds.redis_client import connect
from relay.feeds.redis_snapshot import (
    READ_COUNT_START,
    UNAPPLIED_RESYNC_S,
    SnapshotFeed,
    honour_cancel,
    info_or_missing,
)

log = logging.getLogger("relay.feeds.redis")


class RedisFeed(SnapshotFeed):
    """The ``redis`` route source: the loop above, on the state and snapshot of its base."""

    async def run(self) -> None:
        if url_password(self.target.url) is not None:
            log.warning(
                "routes.redis_url holds a password; prefer routes.redis_password_file or "
                "routes.redis_password_env, which keep it out of the configuration file"
            )
        self._attempt = 0
        while True:
            self._grace_s = self._hang_grace()
            client = connect(self.target, socket_timeout=self.block_ms / 1000 + self._grace_s)
            try:
                position = await self._snapshot()
                honour_cancel()
                if self._broken:
                    self._broken = False
                    self.sink.feed_restored()
                    log.info("route feed restored from %s", self.target.server)
                await self._follow(client, position)
                continue  # a reloaded max_stale_s: connect again with its read timeout
            except (RedisError, OSError) as exc:
                honour_cancel()  # a lost cancellation may surface as a connection error
                reason = self._failed(exc)
            except Exception as exc:  # a bug; keep the feed alive, the stale clock is running
                honour_cancel()
                log.exception("route feed: unexpected error")
                reason = self._failed(exc)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            delay = backoff_delay(
                self._attempt,
                base_s=self.backoff_base_s,
                cap_s=self.backoff_cap_s,
                draw=self.draw(),
            )
            self._attempt += 1
            log.warning("route feed: %s; retry %d in %.2fs", reason, self._attempt, delay)
            await asyncio.sleep(delay)

    # -- follow ----------------------------------------------------------------------------
    async def _follow(self, client: aioredis.Redis, position: Position) -> None:
        """Until an error, or until a reload changed the read timeout (returns: the caller
        connects again at once, its snapshot being the reload's resync)."""
        while True:
            if self._hang_grace() != self._grace_s:
                log.info("route feed: routes.max_stale_s changed; reconnecting")
                return
            if self._resync_requested:
                self._resync_requested = False
                position = await self._snapshot()
            if self._unapplied and self.clock() - self._unapplied_resync >= UNAPPLIED_RESYNC_S:
                # The hash changed with entries this relay cannot read: it is the truth.
                self._unapplied = False
                self._unapplied_resync = self.clock()
                log.warning(
                    "route feed: stream entries could not be applied; resyncing from %s",
                    self.routes_key,
                )
                position = await self._snapshot()
            # Wake-up only: COUNT 1 keeps what this read transfers (and we ignore) small.
            await client.xread(
                {self.events_key: format_stream_id(position.last_id)},
                count=1,
                block=self.block_ms,
            )
            honour_cancel()
            self._ok()
            read = await self._read_to_end(client, position.last_id)
            # The backoff starts again only once following works, not after a snapshot: a
            # fault that always strikes right after one (an ACL without XREAD) reloaded the
            # whole table in a tight loop (found by review). Nor after the wake-up alone: the
            # read takes a connection of its own (redis-py's pipeline), and when it could not
            # have one (relay at its descriptor limit, Redis at maxclients) the table was
            # reloaded after every wake-up (found by review).
            self._attempt = 0
            if read is None:
                self.gaps += 1
                log.warning("route feed: backlog over %d entries, resyncing", self.max_backlog)
                position = await self._snapshot()
                continue
            folding, info = read
            if folding.allowed is not self.allowed:
                # A reload changed upstream.allowed_cidrs while this read was awaited: its puts
                # were checked against the old ones, and the hash is read afresh instead
                # (found by review: a put outside the narrowed list was installed after the
                # reload had removed those outside).
                position = await self._snapshot()
                continue
            moved = advance(position, info, count=folding.count, last=folding.last)
            if moved is None:
                self.gaps += 1
                log.warning(
                    "route feed: stream entries after %s were trimmed or deleted before this "
                    "relay read them; resyncing from %s",
                    format_stream_id(position.last_id),
                    self.routes_key,
                )
                position = await self._snapshot()
                continue
            if folding.count:
                batch = folding.batch()
                if batch.errors:
                    self.sink.reject_routes(list(batch.errors), self.source)
                self.sink.apply_routes(batch.puts, batch.deletes, self.source)
                self.events += folding.count
            if self._lagging:
                self._lagging = False
                self.sink.feed_restored()
            position = moved
            self.position = position
            if folding.unapplied:
                self._unapplied = True  # resynced at the top of the loop, at most so often

    async def _read_to_end(
        self, client: aioredis.Redis, after: StreamId
    ) -> tuple[Fold, StreamInfo] | None:
        """Every entry after ``after`` up to the end of the stream, folded, and the stream's
        counters as of the last read; ``None`` when the backlog is too long to replay.

        Each read asks for as many entries as the last ones showed the link carries in a
        quarter of the read timeout (``next_read_count``, at most ``read_count``): that timeout
        is how a hung Redis is told, and it applies to a whole reply, so a large one on a slow
        link was taken for a hang (found by review). A read that times out anyway (a link that
        slowed down, or a hang) sends the count back to ``READ_COUNT_START``. The timeout itself
        is unchanged.

        Nothing is applied before the end, so a catch-up of several reads starts the stale
        clock, from the wake-up that began it, as a resync does (``_snapshot``): the table is
        as old as that while the reads go on, and a link slow enough to make them take longer
        than max_stale_s makes the cache stale until the batch is applied, as a resync over
        it did before the reads were sized (found by review: otherwise a sustained burst on a
        slow link kept a table minutes old, revoked routes included, serving as fresh).
        ``_follow`` stops the clock once the batch is applied."""
        since = self._last_ok if self._last_ok is not None else self.clock()
        folding = Fold(self.allowed)
        cursor = after
        budget_s = (self.block_ms / 1000 + self._grace_s) / 4
        while True:
            count = min(self._count, self.read_count)
            started = time.monotonic()
            try:
                async with client.pipeline(transaction=True) as pipe:
                    pipe.xread({self.events_key: format_stream_id(cursor)}, count=count)
                    pipe.xinfo_stream(self.events_key)
                    raw_read, raw_info = await pipe.execute(raise_on_error=False)
            except RedisTimeoutError:
                self._count = min(count, READ_COUNT_START)
                raise
            honour_cancel()
            self._ok()
            if isinstance(raw_read, Exception):
                raise raw_read
            info = info_or_missing(raw_info)
            got = _entries(raw_read)
            self._count = next_read_count(
                count,
                got=len(got),
                took_s=time.monotonic() - started,
                budget_s=budget_s,
                cap=self.read_count,
            )
            for entry_id, fields in got:
                folding.add(entry_id, fields)
            if len(got) < count:
                return folding, info
            if folding.count >= self.max_backlog:
                return None
            if not self._lagging:
                self._lagging = True
                self.sink.feed_broken(since)
            cursor = got[-1][0]


def _entries(raw: object) -> list[tuple[StreamId, dict[bytes, bytes]]]:
    """redis-py's RESP2 ``XREAD`` reply for one stream → (id, fields) pairs."""
    if not raw:
        return []
    assert isinstance(raw, list)
    out: list[tuple[StreamId, dict[bytes, bytes]]] = []
    for _key, items in raw:
        for raw_id, fields in items:
            out.append((parse_stream_id(raw_id), dict(fields or {})))
    return out
