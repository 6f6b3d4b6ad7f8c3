"""relay.outbox: under load, small writes held until the end of the loop's turn, and
nothing else changes.

The Outbox alone (a recording transport, the turn's end called by hand), a model-based
property over random writes, closes and turns, and relay's two protocols on fake transports
with every small write held (``busy=0``): bytes written before a close, an abort or a
client's EOF go out before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.outbox import BUSY, MAX_HELD, SMALL, Outbox
from tests.support.wired import REQUEST, RESPONSE, Recorder, Turns, Wired, make_wired

# -- the Outbox alone ---------------------------------------------------------------------------


def test_unbound_writes_go_straight_through() -> None:
    outbox, sink = Outbox(), Recorder()
    outbox.write(sink, b"a")
    outbox.writelines(sink, [b"b", b"c"])
    assert sink.events == [("write", b"a"), ("write", b"bc")]


def test_a_quiet_loop_writes_at_once_and_a_busy_turn_makes_the_next_one_hold() -> None:
    outbox, turns, sink = Outbox(), Turns(), Recorder()
    outbox.bind(turns)
    outbox.write(sink, b"a")
    assert sink.data == b"a"  # quiet: straight through, counted
    assert len(turns.pending) == 1
    for _ in range(BUSY - 1):
        outbox.writelines(sink, [b"b"])
    turns.end()  # BUSY writes in that turn: the next one holds
    holding_after_busy = outbox.holding
    outbox.write(sink, b"c")
    assert sink.data == b"a" + b"b" * (BUSY - 1)
    turns.end()  # one write in that turn: quiet again
    assert sink.data.endswith(b"c")
    assert holding_after_busy
    assert not outbox.holding
    outbox.write(sink, b"d")
    assert sink.data.endswith(b"cd")


def test_small_writes_wait_for_the_end_of_the_turn_in_order() -> None:
    outbox, turns, one, two = Outbox(), Turns(), Recorder(), Recorder()
    outbox.bind(turns, busy=0)
    outbox.write(one, b"1")
    outbox.writelines(two, [b"2", b"2"])
    outbox.write(one, b"3")
    assert one.events == two.events == []
    assert len(turns.pending) == 1  # one callback per turn, however many writes
    turns.end()
    assert one.data == b"13"
    assert two.data == b"22"
    outbox.write(one, b"4")  # the next turn schedules again
    assert len(turns.pending) == 1
    assert one.data == b"13"


def test_a_large_write_sends_what_was_held_first() -> None:
    outbox, turns, sink = Outbox(), Turns(), Recorder()
    outbox.bind(turns, busy=0)
    outbox.write(sink, b"head")
    big = b"x" * (SMALL + 1)
    outbox.write(sink, big)
    assert sink.events == [("write", b"head"), ("write", big)]
    outbox.writelines(sink, [b"y" * SMALL, b"z"])  # large in total: not held either
    assert sink.data.endswith(b"z")


def test_held_bytes_are_bounded() -> None:
    outbox, turns, sink = Outbox(), Turns(), Recorder()
    outbox.bind(turns, busy=0)
    chunk = b"c" * SMALL
    for _ in range(MAX_HELD // SMALL):
        outbox.write(sink, chunk)
    assert sink.events == []
    outbox.write(sink, chunk)  # past MAX_HELD: everything goes out now
    assert sink.data == chunk * (MAX_HELD // SMALL + 1)


def test_a_closing_transport_gets_nothing_and_unbind_flushes() -> None:
    outbox, turns, gone, alive = Outbox(), Turns(), Recorder(), Recorder()
    outbox.bind(turns, busy=0)
    outbox.write(gone, b"lost")
    outbox.write(alive, b"kept")
    gone.abort()  # an abort discards what is buffered: so does the outbox
    outbox.unbind()
    assert gone.events == [("abort", b"")]
    assert alive.data == b"kept"
    outbox.write(alive, b"direct")  # unbound again: straight through
    assert alive.data == b"keptdirect"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["write", "writelines", "large", "turn", "flush", "close"]),
            st.integers(0, 2),
        ),
        max_size=40,
    ),
    st.sampled_from([0, 1, BUSY]),
)
def test_each_transport_gets_exactly_what_was_written_before_its_close(
    steps: list[tuple[str, int]], busy: int
) -> None:
    """The model: every transport receives, in order, the bytes written to it while it was
    open, each write once, provided whoever closes it flushes first (as relay's protocols
    do). The outbox may only move writes later, never reorder, drop or duplicate them."""
    outbox, turns = Outbox(), Turns()
    outbox.bind(turns, busy=busy)
    sinks = [Recorder() for _ in range(3)]
    expected = [b"", b"", b""]
    for n, (action, i) in enumerate(steps):
        sink, piece = sinks[i], b"%d," % n
        if action == "turn":
            turns.end()
        elif action == "flush":
            outbox.flush()
        elif sink.closing:
            continue
        elif action == "close":
            outbox.flush()
            sink.close()
        else:
            if action == "large":
                piece = piece.ljust(SMALL + 1, b".")
            if action == "writelines":
                outbox.writelines(sink, [piece[:1], piece[1:]])
            else:
                outbox.write(sink, piece)
            expected[i] += piece
    turns.end()
    assert [s.data for s in sinks] == expected


# -- relay's protocols ------------------------------------------------------------------------


@pytest.fixture
def wired(tmp_path: Path) -> Wired:
    return make_wired(tmp_path)


def test_an_exchange_writes_at_the_end_of_each_turn(wired: Wired) -> None:
    wired.client.data_received(REQUEST)
    assert wired.upstream_transport.events == []  # held: the turn is not over
    wired.turns.end()
    assert wired.upstream_transport.data.startswith(b"GET /x HTTP/1.1\r\n")
    wired.upstream.data_received(RESPONSE)
    assert wired.client_transport.events == []
    wired.turns.end()
    assert wired.client_transport.data.endswith(b"\r\n\r\nok")


def test_a_clients_eof_in_the_same_turn_does_not_lose_the_response(wired: Wired) -> None:
    """uvloop closes the transport when ``eof_received`` returns False: the response written
    earlier in the same turn must be in the transport by then."""
    wired.client.data_received(REQUEST)
    wired.turns.end()
    wired.upstream.data_received(RESPONSE)  # the exchange ends; its response is held
    assert wired.client_transport.events == []
    assert wired.client.eof_received() is False
    assert wired.client_transport.data.endswith(b"\r\n\r\nok")


def test_a_refusal_is_written_before_the_close(wired: Wired) -> None:
    wired.client.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    events = wired.client_transport.events
    # Refused mid-request: a lingering close, whose first step is the half-close.
    assert [kind for kind, _ in events] == ["write", "eof"], events
    assert events[0][1].startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize("end", ["close", "abort"])
def test_bytes_written_before_a_close_or_abort_go_first(wired: Wired, end: str) -> None:
    pairs: tuple[tuple[Any, Recorder], ...] = (
        (wired.client, wired.client_transport),
        (wired.upstream, wired.upstream_transport),
    )
    for protocol, transport in pairs:
        protocol.write(b"last words")
        assert transport.events == []
        getattr(protocol, end)()
        assert transport.events == [("write", b"last words"), (end, b"")]
