"""relay/core/feed.py: events, snapshots, gap detection, staleness and backoff as tables."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core.decide import FeedState
from relay.core.feed import (
    MISSING,
    ORIGIN,
    Change,
    Position,
    StreamInfo,
    advance,
    backoff_delay,
    events_key,
    fold,
    format_stream_id,
    freshness,
    next_read_count,
    parse_event,
    parse_snapshot,
    parse_stream_id,
    routes_key,
    start_position,
    stream_info,
)
from relay.core.model import Route
from relay.core.routes import Network, RouteError, RouteTable

ALLOWED: tuple[Network, ...] = (ipaddress.ip_network("10.0.0.0/8"),)


def route_obj(sid: str, generation: int = 0) -> dict[str, Any]:
    return {"sandbox_id": sid, "address": "10.0.0.1", "envd_token": "t", "generation": generation}


def route_json(sid: str, generation: int = 0) -> bytes:
    return json.dumps(route_obj(sid, generation)).encode()


def put_event(sid: str, generation: int = 0) -> dict[bytes, bytes]:
    return {b"op": b"put", b"id": sid.encode(), b"route": route_json(sid, generation)}


def delete_event(sid: str) -> dict[bytes, bytes]:
    return {b"op": b"delete", b"id": sid.encode()}


def test_keys() -> None:
    assert routes_key("relay:") == "relay:routes"
    assert events_key("fleet-a:") == "fleet-a:routes:events"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"0-0", (0, 0)),
        ("1700000000000-3", (1700000000000, 3)),
        (b"18446744073709551615-18446744073709551615", (2**64 - 1, 2**64 - 1)),
    ],
)
def test_stream_ids(raw: bytes | str, expected: tuple[int, int]) -> None:
    assert parse_stream_id(raw) == expected
    assert parse_stream_id(format_stream_id(expected)) == expected


@pytest.mark.parametrize("raw", [b"", b"1", b"1-", b"-1", b"a-1", b"1-2-3", b"+", b"$"])
def test_bad_stream_ids(raw: bytes) -> None:
    with pytest.raises(ValueError, match="stream id"):
        parse_stream_id(raw)


# -- events ------------------------------------------------------------------------------------

GOOD = Route(sandbox_id="abc", address="10.0.0.1", envd_token="t")

EVENTS = [
    pytest.param(put_event("abc"), Change("abc", GOOD), None, id="put"),
    pytest.param(delete_event("abc"), Change("abc", None), None, id="delete"),
    pytest.param(
        {**put_event("abc"), b"ts": b"123", b"trace": b"x"},
        Change("abc", GOOD),
        None,
        id="extra-entry-fields-ignored",
    ),
    pytest.param(
        {**delete_event("abc"), b"route": b"{"},
        Change("abc", None),
        None,
        id="delete-ignores-route",
    ),
    pytest.param(
        {b"op": b"put", b"id": b"abc", b"route": b"{"},
        Change("abc", None),
        "route is not valid JSON",
        id="put-bad-json-removes",
    ),
    pytest.param(
        {b"op": b"put", b"id": b"abc", b"route": b"\xff"},
        Change("abc", None),
        "route is not valid JSON",
        id="put-not-utf8",
    ),
    pytest.param(
        {b"op": b"put", b"id": b"abc", b"route": route_json("xyz")},
        Change("abc", None),
        "differs from its key",
        id="put-id-mismatch",
    ),
    pytest.param(
        {
            b"op": b"put",
            b"id": b"abc",
            b"route": json.dumps({**route_obj("abc"), "address": "8.8.8.8"}).encode(),
        },
        Change("abc", None),
        "outside upstream.allowed_cidrs",
        id="put-invalid-route",
    ),
    pytest.param(
        {b"op": b"put", b"id": b"abc"}, Change("abc", None), "without a route", id="put-no-route"
    ),
    pytest.param({b"op": b"put"}, None, "event id must match", id="no-id"),
    pytest.param({b"op": b"delete", b"id": b"ABC"}, None, "event id must match", id="bad-id"),
    pytest.param({b"op": b"delete", b"id": b"\xff"}, None, "event id must match", id="binary-id"),
    pytest.param({b"op": b"rename", b"id": b"abc"}, None, "op must be", id="unknown-op"),
    pytest.param({b"id": b"abc"}, None, "op must be", id="no-op"),
]


@pytest.mark.parametrize(("fields", "change", "error"), EVENTS)
def test_parse_event(fields: dict[bytes, bytes], change: Change | None, error: str | None) -> None:
    got_change, got_error = parse_event(fields, ALLOWED)
    assert got_change == change
    if error is None:
        assert got_error is None
    else:
        assert got_error is not None
        assert error in got_error.reason


def test_fold_last_change_wins_and_sets_are_disjoint() -> None:
    batch = fold(
        [
            put_event("a", 1),
            put_event("b", 1),
            delete_event("a"),
            put_event("c", 1),
            put_event("c", 2),
            delete_event("d"),
            put_event("d", 3),
            {b"op": b"put", b"id": b"e", b"route": b"nope"},
            {b"op": b"zap", b"id": b"f"},
        ],
        ALLOWED,
    )
    assert {r.sandbox_id: r.generation for r in batch.puts} == {"b": 1, "c": 2, "d": 3}
    assert set(batch.deletes) == {"a", "e"}
    assert [e.sandbox_id for e in batch.errors] == ["e", "f"]


@st.composite
def event_lists(draw: st.DrawFn) -> list[dict[bytes, bytes]]:
    ids = st.sampled_from(["a", "b", "c", "d"])
    one = st.one_of(
        st.builds(put_event, ids, st.integers(0, 3)),
        st.builds(delete_event, ids),
        st.builds(lambda sid: {b"op": b"put", b"id": sid.encode(), b"route": b"{"}, ids),
    )
    return draw(st.lists(one, max_size=20))


@given(events=event_lists(), initial=st.sets(st.sampled_from(["a", "b", "c", "d"])))
def test_fold_equals_applying_one_by_one(
    events: list[dict[bytes, bytes]], initial: set[str]
) -> None:
    """One swap of the folded batch leaves the table exactly as applying each event alone."""
    table = RouteTable.of(
        {
            sid: Route(sandbox_id=sid, address="10.0.0.9", envd_token="t", generation=9)
            for sid in initial
        }
    )
    one_by_one = table
    for fields in events:
        change, _ = parse_event(fields, ALLOWED)
        if change is None:
            continue
        if change.route is None:
            one_by_one, _ = one_by_one.apply(deletes=[change.sandbox_id])
        else:
            one_by_one, _ = one_by_one.apply(puts=[change.route])
    batch = fold(events, ALLOWED)
    folded, _ = table.apply(batch.puts, batch.deletes)
    assert dict(folded.routes) == dict(one_by_one.routes)


def test_parse_snapshot_rejects_each_bad_value_alone() -> None:
    routes, errors = parse_snapshot(
        {
            b"good": route_json("good"),
            b"mismatch": route_json("other"),
            b"BAD": route_json("bad"),
            b"broken": b"{",
            b"gen": json.dumps({**route_obj("gen"), "generation": -1}).encode(),
        },
        ALLOWED,
    )
    assert list(routes) == ["good"]
    assert sorted((e.sandbox_id or "?", e.reason.split(" ")[0]) for e in errors) == [
        ("?", "hash"),
        ("broken", "route"),
        ("gen", "generation"),
        ("mismatch", "route"),
    ]
    assert all(isinstance(e, RouteError) for e in errors)


# -- XINFO STREAM and gap detection --------------------------------------------------------------


def test_stream_info_redis7() -> None:
    info = stream_info(
        {
            "length": 2,
            "last-generated-id": b"5-1",
            "max-deleted-entry-id": b"0-0",
            "entries-added": 7,
            "first-entry": (b"4-0", {b"op": b"delete"}),
            "last-entry": (b"5-1", {b"op": b"delete"}),
        }
    )
    assert info == StreamInfo(last_generated=(5, 1), first_entry=(4, 0), entries_added=7)
    assert start_position(info) == Position((5, 1), 7)


def test_stream_info_redis6_and_empty() -> None:
    info = stream_info({"last-generated-id": "9-0", "first-entry": None, "last-entry": None})
    assert info == StreamInfo(last_generated=(9, 0), first_entry=None, entries_added=None)
    with pytest.raises(ValueError, match="last-generated-id"):
        stream_info({"length": 0})


A = (100, 0)
B = (101, 0)
C = (102, 0)
D = (103, 0)


def info7(last: tuple[int, int], added: int, first: tuple[int, int] | None = None) -> StreamInfo:
    return StreamInfo(last_generated=last, first_entry=first, entries_added=added)


def info6(last: tuple[int, int], first: tuple[int, int] | None) -> StreamInfo:
    return StreamInfo(last_generated=last, first_entry=first, entries_added=None)


ADVANCES = [
    pytest.param(Position(A, 5), [], info7(A, 5, A), Position(A, 5), id="idle"),
    pytest.param(Position(A, 5), [B, C], info7(C, 7, A), Position(C, 7), id="two-new"),
    pytest.param(Position(A, 5), [C], info7(C, 7, C), None, id="one-trimmed-before-read"),
    pytest.param(Position(A, 5), [], info7(C, 7, None), None, id="all-new-trimmed"),
    pytest.param(Position(A, 5), [D], info7(D, 8, B), None, id="xdel-in-the-middle"),
    pytest.param(Position(C, 7), [D], info7(D, 8, D), Position(D, 8), id="own-pos-trimmed-ok"),
    pytest.param(Position(C, 7), [], info7(B, 1, B), None, id="stream-recreated"),
    pytest.param(Position(ORIGIN, 0), [], MISSING, Position(ORIGIN, 0), id="never-existed"),
    pytest.param(Position(C, 7), [], MISSING, None, id="stream-deleted"),
    pytest.param(Position(ORIGIN, 0), [A, B], info7(B, 2, A), Position(B, 2), id="created"),
    pytest.param(Position(A, None), [B], info6(B, A), Position(B, None), id="redis6-ok"),
    pytest.param(Position(A, None), [C], info6(C, C), None, id="redis6-position-trimmed"),
    pytest.param(Position(A, None), [], info6(A, None), Position(A, None), id="redis6-all-read"),
    pytest.param(Position(A, None), [], info6(C, None), None, id="redis6-trimmed-to-nothing"),
    pytest.param(Position(A, None), [B], info6(C, A), None, id="redis6-newest-deleted"),
    # A 6.2 relay whose snapshot found no stream follows from (ORIGIN, 0) (MISSING's count).
    pytest.param(Position(ORIGIN, 0), [C], info6(C, C), None, id="redis6-origin"),
    pytest.param(Position(ORIGIN, 0), [], info6(C, None), None, id="redis6-origin-trimmed"),
    pytest.param(Position(ORIGIN, 0), [], MISSING, Position(ORIGIN, 0), id="redis6-still-none"),
]


@pytest.mark.parametrize(("start", "read", "info", "expected"), ADVANCES)
def test_advance(
    start: Position, read: list[tuple[int, int]], info: StreamInfo, expected: Position | None
) -> None:
    last = read[-1] if read else None
    assert advance(start, info, count=len(read), last=last) == expected


# count, got, took_s -> next count; a budget of 0.3 s and a cap of 5,000 (a 1.2 s read timeout)
READ_COUNTS = [
    pytest.param(100, 100, 0.01, 200, id="full-and-quick-doubles"),
    pytest.param(4000, 4000, 0.1, 5000, id="up-to-the-cap"),
    pytest.param(5000, 5000, 0.01, 5000, id="at-the-cap"),
    pytest.param(200, 200, 0.2, 200, id="full-within-the-budget-keeps"),
    pytest.param(200, 200, 0.6, 100, id="slow-shrinks-in-proportion"),
    pytest.param(1000, 50, 0.6, 25, id="slow-short-read-shrinks-by-what-it-carried"),
    pytest.param(100, 10, 0.001, 100, id="short-read-says-little"),
    pytest.param(1000, 0, 2.0, 1000, id="slow-and-empty-keeps"),
    pytest.param(10, 1, 100.0, 1, id="never-below-one"),
]


@pytest.mark.parametrize(("count", "got", "took_s", "expected"), READ_COUNTS)
def test_next_read_count(count: int, got: int, took_s: float, expected: int) -> None:
    assert next_read_count(count, got=got, took_s=took_s, budget_s=0.3, cap=5000) == expected


@given(
    count=st.integers(1, 5000),
    share=st.floats(0.0, 1.0),
    rate=st.floats(1.0, 1e6),  # entries per second the link carries
)
def test_a_steady_link_keeps_each_read_within_the_budget(
    count: int, share: float, rate: float
) -> None:
    """At a steady rate, the read after any read (full or short, quick or slow) carries at most
    what the link moves in the budget, or one entry; the count stays within [1, cap]."""
    got = min(count, max(1, round(count * share)))
    following = next_read_count(count, got=got, took_s=got / rate, budget_s=0.3, cap=5000)
    assert 1 <= following <= 5000
    if got / rate > 0.3 or following > count:
        assert following / rate <= 0.3 * (1 + 1e-9) or following == 1


# -- staleness and backoff -----------------------------------------------------------------------

FRESHNESS = [
    pytest.param(False, None, 100.0, FeedState(ready=False, stale=False), id="not-ready"),
    pytest.param(False, 10.0, 100.0, FeedState(ready=False, stale=False), id="never-ready-down"),
    pytest.param(True, None, 100.0, FeedState(ready=True, stale=False), id="healthy"),
    pytest.param(True, 90.0, 100.0, FeedState(ready=True, stale=False), id="down-10s"),
    pytest.param(True, 70.0, 100.0, FeedState(ready=True, stale=True), id="down-30s"),
    pytest.param(True, 69.0, 100.0, FeedState(ready=True, stale=True), id="down-31s"),
]


@pytest.mark.parametrize(("ready", "since", "now", "expected"), FRESHNESS)
def test_freshness(ready: bool, since: float | None, now: float, expected: FeedState) -> None:
    assert freshness(ready=ready, broken_since=since, now=now, max_stale_s=30.0) == expected


def test_backoff_grows_to_the_cap() -> None:
    delays = [backoff_delay(n, base_s=0.1, cap_s=5.0, draw=0.999) for n in range(12)]
    assert delays == sorted(delays)
    assert delays[0] == pytest.approx(0.1, abs=0.001)
    assert delays[-1] == pytest.approx(5.0, abs=0.01)
    assert backoff_delay(10_000, base_s=0.1, cap_s=5.0, draw=0.0) == 2.5


@given(attempt=st.integers(0, 200), draw=st.floats(0.0, 1.0, exclude_max=True))
def test_backoff_is_jittered_within_half_a_step(attempt: int, draw: float) -> None:
    step = min(5.0, 0.1 * 2.0**attempt)
    delay = backoff_delay(attempt, base_s=0.1, cap_s=5.0, draw=draw)
    assert step / 2 <= delay <= step
