"""The Redis feed's state, its stale clock, and its snapshot: the resync from the hash (SPEC §3).

:class:`SnapshotFeed` holds what a :class:`~relay.feeds.redis.RedisFeed` knows (settings,
counters, the stream position, the learned read sizes and timeouts), reports failures and
recoveries to its sink (the stale clock), and loads the whole table: the stream's last id
and the hash in one MULTI, so the position followed from is exactly the one the hash
reflects. A snapshot is taken at every (re)connect and at every resync the follow loop
decides (SIGHUP, a gap, a backlog past ``max_backlog``, entries relay could not apply, a
reload of ``upstream.allowed_cidrs``); following the stream is :mod:`relay.feeds.redis`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.core.feed import (
    MISSING,
    Position,
    StreamInfo,
    events_key,
    format_stream_id,
    parse_snapshot,
    routes_key,
    start_position,
    stream_info,
)
from relay.core.model import Route
from relay.core.routes import Network, RouteError
from relay.feeds.redis_client import RedisTarget, connect
from relay.feeds.sink import StreamSink

log = logging.getLogger("relay.feeds.redis")  # the feed's one logger (relay.feeds.redis too)

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


class SnapshotFeed:
    """A Redis feed's state and snapshot; :class:`~relay.feeds.redis.RedisFeed` follows."""

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
        honour_cancel()
        self._snapshot_timeout_s = min(SNAPSHOT_TIMEOUT_CAP_S, 2 * (time.monotonic() - started))
        self._ok()
        info = info_or_missing(raw_info)
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


def honour_cancel() -> None:
    """Raise CancelledError if this task was asked to stop, even if a library swallowed it.

    ``Task.cancelling()`` still counts a cancel request that redis-py's read path absorbed
    (see :mod:`relay.feeds.redis`), so checking it after each call bounds the delay to one call.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def info_or_missing(raw: object) -> StreamInfo:
    if isinstance(raw, ResponseError) and "no such key" in str(raw).lower():
        return MISSING
    if isinstance(raw, Exception):
        raise raw
    if not isinstance(raw, Mapping):
        raise ResponseError(f"unexpected XINFO STREAM reply: {type(raw).__name__}")
    return stream_info(raw)


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
