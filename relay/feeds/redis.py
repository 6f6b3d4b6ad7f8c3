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
- Cancellation is checked by hand after every Redis call (:func:`_honour_cancel`): redis-py
  8.1 on Python 3.11 loses a task's cancellation about half the time when it races a reply
  inside the client's socket-timeout block, and a feed that ignores its cancellation would
  hang ``Relay.stop()`` (found by the 1,000 updates/s test, reproduced in isolation).

Reaching Redis (settings, credentials, the client) and writing routes are in
:mod:`relay.feeds.redis_client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.config_redis import url_password
from relay.core.feed import (
    MISSING,
    Fold,
    Position,
    StreamId,
    StreamInfo,
    advance,
    backoff_delay,
    events_key,
    format_stream_id,
    next_read_count,
    parse_snapshot,
    parse_stream_id,
    routes_key,
    start_position,
    stream_info,
)
from relay.core.model import Route
from relay.core.routes import Network, RouteError
from relay.feeds.redis_client import RedisTarget, connect
from relay.feeds.sink import StreamSink

log = logging.getLogger("relay.feeds.redis")

SOURCE = "redis"
BLOCK_MS = 1000  # a blocking read returns at least this often: liveness and gap checks
READ_COUNT = 5000  # the most entries per read inside the MULTI
# Where the per-read count starts, and where a read that timed out sends it back to: a few
# tens of kB of entries, which only a link too slow to follow at all takes a read timeout over.
# It grows from there while reads are quick (``next_read_count``).
READ_COUNT_START = 100
MAX_BACKLOG = 100_000  # past this many unread entries, resync instead of replaying
# At most one resync per this many seconds for stream entries relay cannot apply: each reloads
# the whole hash, and a control plane that writes such entries steadily (a bug, or an op of its
# own for another consumer) cost every relay of a fleet one per read (found by review).
UNAPPLIED_RESYNC_S = 5.0
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0
PARSE_SLICE = 5000  # hash entries parsed between yields to the event loop
# The longest a snapshot's reply is waited for (RedisFeed._snapshot learns how long, doubling
# after each that timed out): past it, a Redis that takes the connection and never answers
# (a network black hole) holds a reconnect no longer than this after it heals.
SNAPSHOT_TIMEOUT_CAP_S = 60.0


# -- the feed ----------------------------------------------------------------------------------


class RedisFeed:
    source = SOURCE

    def __init__(
        self,
        sink: StreamSink,
        target: RedisTarget,
        allowed: tuple[Network, ...],
        *,
        block_ms: int = BLOCK_MS,
        read_count: int = READ_COUNT,
        max_backlog: int = MAX_BACKLOG,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        max_stale_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.sink = sink
        self.max_stale_s = max_stale_s  # routes.max_stale_s; a reload may replace it
        self.target = target
        self.allowed = allowed
        self.block_ms = block_ms
        self.read_count = read_count
        self.max_backlog = max_backlog
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.clock = clock
        self.draw = draw
        self.routes_key = routes_key(target.prefix)
        self.events_key = events_key(target.prefix)
        # Counters, for tests and the metrics exposition.
        self.snapshots = 0  # full tables loaded (first load, reconnects, gaps, SIGHUP)
        self.gaps = 0  # resyncs because entries we had not read were lost
        self.failures = 0  # connection or command failures
        self.events = 0  # stream entries applied
        self.position: Position | None = None
        self._resync_requested = False
        self._unapplied = False  # entries relay could not apply were read: a resync is due
        self._unapplied_resync = -UNAPPLIED_RESYNC_S  # clock() at the last such resync
        self._last_ok: float | None = None
        self._broken = False
        self._lagging = False  # a catch-up of several reads started the stale clock
        self._attempt = 0  # failures since following last worked: the backoff's exponent
        self._grace_s = 0.0  # the hang grace of the current connection (_hang_grace)
        self._snapshot_timeout_s = 0.0  # learned by _snapshot; 0 until a first one ends
        self._count = min(read_count, READ_COUNT_START)  # learned by _read_to_end

    def load(self) -> bool:
        """SIGHUP: resync from the hash at the next wake-up (within ``block_ms``)."""
        self._resync_requested = True
        return True

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
                _honour_cancel()
                if self._broken:
                    self._broken = False
                    self.sink.feed_restored()
                    log.info("route feed restored from %s", self.target.server)
                await self._follow(client, position)
                continue  # a reloaded max_stale_s: connect again with its read timeout
            except (RedisError, OSError) as exc:
                _honour_cancel()  # a lost cancellation may surface as a connection error
                reason = self._failed(exc)
            except Exception as exc:  # a bug; keep the feed alive, the stale clock is running
                _honour_cancel()
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

    def _hang_grace(self) -> float:
        """A Redis that hangs (stopped, swapping, a network black hole) is only seen when a read
        times out. The blocking read returns every block_ms; past that, the grace is up to 5 s
        but at most half of routes.max_stale_s (at least 1 s), so that a short max_stale_s
        holds too (found by review: with max_stale_s = 2 a hung Redis was noticed, and the
        cache made stale, only after ~6 s)."""
        return min(5.0, max(1.0, self.max_stale_s / 2))

    def _failed(self, exc: BaseException) -> str:
        """Count a failure; the first of an outage is reported and starts the stale clock."""
        self.failures += 1
        self.position = None
        message = f"{self.target.server}: {type(exc).__name__}: {exc}"
        self._lagging = False  # the outage's clock carries on from the same start
        if not self._broken:
            self._broken = True
            since = self._last_ok if self._last_ok is not None else self.clock()
            self.sink.feed_failed(self.source, message)
            self.sink.feed_broken(since)
        return message

    def _ok(self) -> None:
        self._last_ok = self.clock()

    # -- snapshot --------------------------------------------------------------------------
    async def _snapshot(self) -> Position:
        """Install the whole table from the hash; the stream position it corresponds to.

        Read on a connection of its own, whose read timeout is learned instead of the one that
        tells a hung Redis (``_hang_grace``): the table comes as one reply, which redis-py reads
        whole within its socket timeout, and a large one (a few hundred thousand routes on
        loopback, fewer over a network or while the event loop is busy) took longer than those
        1.2-6 s. It was asked for again and again, cut each time, and relay never became ready,
        or after a reconnect stayed stale, every sandbox 503 (found by review). A snapshot that
        times out doubles the next one's wait, up to SNAPSHOT_TIMEOUT_CAP_S; one that completes
        sets it to twice what it took, at least the hang timeout. So a Redis that hangs during a
        snapshot is noticed within that wait; the stale clock still runs from the last good
        read (``_failed``), and following keeps the short timeout.
        """
        hang_timeout = self.block_ms / 1000 + self._grace_s
        timeout = max(hang_timeout, self._snapshot_timeout_s)
        # Taken while following worked (SIGHUP, a gap, entries relay could not apply): the
        # stale clock runs from the last good read while the reply is awaited, as it does
        # after a failure. That wait can be longer than max_stale_s, and a Redis that hung
        # then kept the cache fresh until it ended (found by review). A resync that itself
        # takes longer than max_stale_s turns the cache stale until it is loaded (SPEC §3).
        resync_since = None if self._broken else self._last_ok
        if resync_since is not None:
            self.sink.feed_broken(resync_since)
        client = connect(self.target, socket_timeout=timeout)
        started = time.monotonic()
        try:
            async with client.pipeline(transaction=True) as pipe:
                pipe.xinfo_stream(self.events_key)
                pipe.hgetall(self.routes_key)
                raw_info, raw_hash = await pipe.execute(raise_on_error=False)
        except RedisTimeoutError:
            self._snapshot_timeout_s = min(SNAPSHOT_TIMEOUT_CAP_S, 2 * timeout)
            raise
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()
        _honour_cancel()
        self._snapshot_timeout_s = min(SNAPSHOT_TIMEOUT_CAP_S, 2 * (time.monotonic() - started))
        self._ok()
        info = _info_or_missing(raw_info)
        if isinstance(raw_hash, Exception):
            raise raw_hash
        while True:
            allowed = self.allowed
            routes, errors = await _parse_snapshot_sliced(raw_hash, allowed)
            if allowed is self.allowed:
                break
            # A reload changed upstream.allowed_cidrs while a large table was parsed (it
            # yields between slices): parsed again, none outside the new ones installed.
        if errors:
            self.sink.reject_routes(errors, self.source)
        self.sink.install_routes(routes, self.source)
        if resync_since is not None:
            self.sink.feed_restored()
        self._lagging = False
        self.snapshots += 1
        self._unapplied = False  # whatever entries relay could not apply, the hash had them
        position = start_position(info)
        self.position = position
        log.info(
            "route feed: %d route(s) loaded from %s (%s), following from %s",
            len(routes),
            self.target.server,
            self.routes_key,
            format_stream_id(position.last_id),
        )
        return position

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
            _honour_cancel()
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
            _honour_cancel()
            self._ok()
            if isinstance(raw_read, Exception):
                raise raw_read
            info = _info_or_missing(raw_info)
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


def _honour_cancel() -> None:
    """Raise CancelledError if this task was asked to stop, even if a library swallowed it.

    ``Task.cancelling()`` still counts a cancel request that redis-py's read path absorbed
    (see the module docstring), so checking it after each call bounds the delay to one call.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _info_or_missing(raw: object) -> StreamInfo:
    if isinstance(raw, ResponseError) and "no such key" in str(raw).lower():
        return MISSING
    if isinstance(raw, Exception):
        raise raw
    if not isinstance(raw, Mapping):
        raise ResponseError(f"unexpected XINFO STREAM reply: {type(raw).__name__}")
    return stream_info(raw)


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


async def _parse_snapshot_sliced(
    raw: Mapping[bytes, bytes], allowed: tuple[Network, ...]
) -> tuple[dict[str, Route], list[RouteError]]:
    """``parse_snapshot`` in slices, yielding between them: a 100,000-route table takes a
    while to validate, and requests on the old table keep flowing meanwhile."""
    items = list(raw.items())
    routes: dict[str, Route] = {}
    errors: list[RouteError] = []
    for start in range(0, len(items), PARSE_SLICE):
        part_routes, part_errors = parse_snapshot(dict(items[start : start + PARSE_SLICE]), allowed)
        routes.update(part_routes)
        errors.extend(part_errors)
        if start + PARSE_SLICE < len(items):
            await asyncio.sleep(0)
    return routes, errors
