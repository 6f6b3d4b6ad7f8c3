"""The Redis route feed's decisions, without Redis: events, snapshots, gaps, staleness, backoff.

SPEC §3 publishes routes in two keys under a prefix::

    <prefix>routes          hash    field = sandbox id, value = route JSON
    <prefix>routes:events   stream  op=put id=<id> route=<json> | op=delete id=<id>

The control plane changes the hash and appends the event in one MULTI/EXEC. A relay takes a
snapshot (the hash plus the stream's position, read in one MULTI so that they agree), then
follows the stream. Everything that needs judgement lives here as pure functions over plain
values (bytes from the wire, ids as integer pairs, the clock and the random draw passed in),
so it is tested as tables; ``relay.feeds.redis`` only moves bytes and sleeps.

**Noticing a gap.** A follower must resync from the hash when an entry it has not read was
removed, by ``XTRIM``/``MAXLEN`` or ``XDEL``; a blocking ``XREAD`` from the last id simply
skips such a hole. Redis >= 7.0 reports ``entries-added`` (every ``XADD`` ever made) in
``XINFO STREAM``. The follower reads with ``XREAD`` and ``XINFO STREAM`` in one MULTI, so the
count is taken at the same instant as the read; once a read reaches the end of the stream,
``entries-added`` must have grown by exactly the number of entries read since the last such
point, else something was lost in between. Redis 6.2 has no counter: the follower then
resyncs whenever its own position was trimmed away (first entry newer than its last id, the
origin included), or when the stream's last id is past the last entry it read (trimmed to
nothing, or the newest entries deleted), which is conservative. A stream deleted or recreated
(last id going backwards) also resyncs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from relay.core.decide import FeedState
from relay.core.model import Route
from relay.core.routes import Network, RouteError, parse_route
from relay.core.target import valid_sandbox_id

StreamId = tuple[int, int]  # (milliseconds, sequence), ordered as Redis orders them
ORIGIN: StreamId = (0, 0)

# -- keys ----------------------------------------------------------------------------------


def routes_key(prefix: str) -> str:
    return f"{prefix}routes"


def events_key(prefix: str) -> str:
    return f"{prefix}routes:events"


# -- stream ids --------------------------------------------------------------------------------


def parse_stream_id(raw: bytes | str) -> StreamId:
    """``b"1700000000000-3"`` → ``(1700000000000, 3)``; raises ValueError on anything else."""
    text = raw.decode("ascii") if isinstance(raw, bytes) else raw
    ms, sep, seq = text.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        raise ValueError(f"not a stream id: {text!r}")
    return int(ms), int(seq)


def format_stream_id(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """The effect of one event on one sandbox: its new route, or ``None`` for removal."""

    sandbox_id: str
    route: Route | None


def parse_event(
    fields: Mapping[bytes, bytes], allowed: tuple[Network, ...]
) -> tuple[Change | None, RouteError | None]:
    """One stream entry → its change and/or the reason it was rejected.

    A malformed ``put`` whose id can be read removes that sandbox's route (and is reported):
    the hash now holds the same malformed value, so a resync would not load it either, and a
    control plane that meant to change credentials must not leave the old ones working.
    Entry fields other than ``op``, ``id`` and ``route`` are ignored, so that a control plane
    may add its own (a timestamp, a trace id) without breaking older relays.
    """
    op = fields.get(b"op")
    raw_id = fields.get(b"id")
    sandbox_id = _decode_id(raw_id)
    if sandbox_id is None:
        return None, RouteError(None, "event id must match ^[a-z0-9]{1,64}$")
    if op == b"delete":
        return Change(sandbox_id, None), None
    if op != b"put":
        return None, RouteError(sandbox_id, "event op must be put or delete")
    raw_route = fields.get(b"route")
    if raw_route is None:
        return Change(sandbox_id, None), RouteError(sandbox_id, "put event without a route")
    parsed = parse_route_json(raw_route, sandbox_id, allowed)
    if isinstance(parsed, RouteError):
        return Change(sandbox_id, None), parsed
    return Change(sandbox_id, parsed), None


def parse_route_json(
    raw: bytes, sandbox_id: str, allowed: tuple[Network, ...]
) -> Route | RouteError:
    """A route JSON value stored under ``sandbox_id`` (hash field or event id)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        # Not only JSONDecodeError (and UnicodeDecodeError, a ValueError too): an integer of
        # more than 4,300 digits is a plain ValueError and deep nesting a RecursionError, and
        # either escaping here stopped the whole feed (found by review: one such value in
        # Redis kept every relay of a fleet from loading any route).
        return RouteError(sandbox_id, "route is not valid JSON")
    parsed = parse_route(obj, allowed)
    if isinstance(parsed, RouteError):
        return RouteError(parsed.sandbox_id or sandbox_id, parsed.reason)
    if parsed.sandbox_id != sandbox_id:
        return RouteError(sandbox_id, f"route sandbox_id {parsed.sandbox_id} differs from its key")
    return parsed


def _decode_id(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if valid_sandbox_id(text) else None


@dataclass(frozen=True, slots=True)
class Batch:
    """Net effect of consecutive events: apply as one ``RouteTable.apply`` swap."""

    puts: tuple[Route, ...]
    deletes: tuple[str, ...]
    errors: tuple[RouteError, ...]


@dataclass(slots=True)
class Fold:
    """The net effect of the entries read so far, in stream order; the last change of each
    sandbox wins.

    Folding as entries arrive keeps a long backlog's memory bounded by the sandboxes it
    touches rather than by its entries, and makes puts and deletes disjoint, so the order in
    which ``RouteTable.apply`` applies them does not matter (a put then a delete is a delete).
    """

    allowed: tuple[Network, ...]
    final: dict[str, Route | None] = field(default_factory=dict)
    errors: list[RouteError] = field(default_factory=list)
    count: int = 0  # entries added
    last: StreamId | None = None  # id of the last entry added
    # Entries with no change to apply (no readable id, an op other than put or delete): what
    # changed in the hash with them is unknown, so the follower resyncs from it (found by
    # review: a route deleted from the hash with op "del" kept serving on this relay).
    unapplied: int = 0

    def add(self, entry_id: StreamId, fields: Mapping[bytes, bytes]) -> None:
        change, error = parse_event(fields, self.allowed)
        self.count += 1
        self.last = entry_id
        if error is not None:
            self.errors.append(error)
        if change is None:
            self.unapplied += 1
        if change is not None:
            self.final.pop(change.sandbox_id, None)  # insertion order = order of last change
            self.final[change.sandbox_id] = change.route

    def batch(self) -> Batch:
        puts = tuple(r for r in self.final.values() if r is not None)
        deletes = tuple(sid for sid, r in self.final.items() if r is None)
        return Batch(puts, deletes, tuple(self.errors))


def fold(entries: Iterable[Mapping[bytes, bytes]], allowed: tuple[Network, ...]) -> Batch:
    """:class:`Fold` over a list of entries (ids not needed)."""
    folding = Fold(allowed)
    for fields in entries:
        folding.add(ORIGIN, fields)
    return folding.batch()


def parse_snapshot(
    fields: Mapping[bytes, bytes], allowed: tuple[Network, ...]
) -> tuple[dict[str, Route], list[RouteError]]:
    """The routes hash → routes by id, and each malformed value's reason."""
    routes: dict[str, Route] = {}
    errors: list[RouteError] = []
    for raw_id, raw_route in fields.items():
        sandbox_id = _decode_id(raw_id)
        if sandbox_id is None:
            errors.append(RouteError(None, "hash field must be a sandbox id ^[a-z0-9]{1,64}$"))
            continue
        parsed = parse_route_json(raw_route, sandbox_id, allowed)
        if isinstance(parsed, RouteError):
            errors.append(parsed)
        else:
            routes[sandbox_id] = parsed
    return routes, errors


# -- following the stream ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamInfo:
    """What ``XINFO STREAM`` says, reduced to what gap detection needs."""

    last_generated: StreamId
    first_entry: StreamId | None
    entries_added: int | None  # None before Redis 7.0


MISSING = StreamInfo(last_generated=ORIGIN, first_entry=None, entries_added=0)


def stream_info(raw: Mapping[str, object]) -> StreamInfo:
    """redis-py's parsed ``XINFO STREAM`` reply → :class:`StreamInfo`."""
    last = raw.get("last-generated-id")
    first = raw.get("first-entry")
    added = raw.get("entries-added")
    first_id: StreamId | None = None
    if isinstance(first, (tuple, list)) and first and isinstance(first[0], (bytes, str)):
        first_id = parse_stream_id(first[0])
    if not isinstance(last, (bytes, str)):
        raise ValueError("XINFO STREAM without last-generated-id")
    return StreamInfo(
        last_generated=parse_stream_id(last),
        first_entry=first_id,
        entries_added=added if isinstance(added, int) else None,
    )


@dataclass(frozen=True, slots=True)
class Position:
    """Where a follower stands: the last id consumed, and ``entries-added`` at that point."""

    last_id: StreamId
    added: int | None


def start_position(info: StreamInfo) -> Position:
    """The position a snapshot taken together with ``info`` corresponds to."""
    return Position(info.last_generated, info.entries_added)


def advance(
    start: Position, info: StreamInfo, *, count: int, last: StreamId | None
) -> Position | None:
    """The follower's new position after reading ``count`` entries, the last one ``last``
    (every entry after ``start`` up to the end of the stream as ``info`` saw it), or ``None``
    when entries were lost in between and the table must be resynced from the hash.
    """
    end = last if last is not None else start.last_id
    if info.last_generated < start.last_id or info.last_generated < end:
        return None  # the stream was deleted or recreated under us
    if info.entries_added is not None and start.added is not None:
        if info.entries_added - start.added != count:
            return None
        return Position(end, info.entries_added)
    # Redis < 7.0: no counter, so conservative. Resync if our own position was trimmed away
    # (the first entry newer than our last id), including the origin of a stream that did
    # not exist at the snapshot: what was trimmed before the first entry we see is unknown.
    # And if the stream's last id is past the last entry we read: the newest entries were
    # removed, by a trim to nothing (no first entry left to compare) or XDEL. Both went
    # unnoticed before (found by review): a delete trimmed away so, or trimmed away before
    # a relay that snapshotted an absent stream read it, left a revoked route serving.
    first = info.first_entry
    if info.last_generated > end or (first is not None and first > start.last_id):
        return None
    return Position(end, None)


def next_read_count(count: int, *, got: int, took_s: float, budget_s: float, cap: int) -> int:
    """Entries to ask for in the follower's next read, after one that asked for ``count``, got
    ``got`` and took ``took_s``: each reply must arrive well within the read timeout that tells
    a hung Redis, however slow the link (found by review: a burst read as one reply of 5,000
    entries took longer than that timeout on a slow link, and relay reconnected and reloaded
    the whole hash, again and again under a steady burst).

    A read slower than ``budget_s`` shrinks the count in proportion to what it carried; a full
    read in under half the budget doubles it (up to ``cap``), so on a fast link the count is
    back at ``cap`` within a few reads. Anything else keeps it: a short read says little about
    the link. Never below 1.
    """
    if took_s > budget_s and got > 0:
        return max(1, min(count, int(got * budget_s / took_s)))
    if got >= count and took_s < budget_s / 2:
        return min(cap, count * 2)
    return max(1, min(count, cap))


# -- staleness and reconnection --------------------------------------------------------------


def freshness(
    *, ready: bool, broken_since: float | None, now: float, max_stale_s: float
) -> FeedState:
    """SPEC §3 Staleness: cached routes serve until the feed has been broken ``max_stale_s``.

    ``broken_since`` is the last moment the feed was known good (its last successful read),
    on the same clock as ``now``; ``None`` while it is healthy.
    """
    stale = ready and broken_since is not None and now - broken_since >= max_stale_s
    return FeedState(ready=ready, stale=stale)


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, draw: float) -> float:
    """Reconnect delay for the ``attempt``-th consecutive failure (0-based).

    Exponential with "equal jitter": half the step is fixed, half is random (``draw`` in
    [0, 1)), so a fleet of relays that lost Redis together does not reconnect in lockstep,
    and no relay retries sooner than half the step.
    """
    step = min(cap_s, base_s * 2.0 ** min(attempt, 30))
    return step / 2 + step / 2 * draw
