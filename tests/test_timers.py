"""relay.timers.Timers with a fake clock: header, idle and closing deadlines (SPEC §4, §5a),
and timeouts changed in place by a SIGHUP (relay/reload.py, SPEC §7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.closing import CLOSE_STALL_S
from relay.timers import CLOSE_GRACE_S, PEER_CHECK_S, Timers
from tests.support.wired import DOMAIN, make_wired


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Conn:
    def __init__(self) -> None:
        self.events: list[str] = []

    def head_timed_out(self) -> None:
        self.events.append("head timed out")

    def close(self) -> None:
        self.events.append("closed")

    def abort(self) -> None:
        self.events.append("aborted")

    def close_expired(self) -> None:
        self.abort()

    def check_peer(self) -> None:
        self.events.append("peer checked")


def _timers() -> tuple[Timers, Clock]:
    clock = Clock()
    return Timers(header_timeout_s=10, idle_timeout_s=630, clock=clock), clock


def test_deadlines_fire_once_at_their_timeout() -> None:
    timers, clock = _timers()
    head, idle, closing, done = Conn(), Conn(), Conn(), Conn()
    timers.expect_head(head)
    timers.expect_idle(idle)
    timers.close_deadline(closing)
    timers.expect_head(done)
    timers.head_done(done)
    clock.now += CLOSE_GRACE_S - 0.5
    timers.sweep()
    assert head.events == idle.events == closing.events == []
    clock.now += 0.5
    timers.sweep()
    assert closing.events == ["aborted"]
    assert head.events == []
    clock.now = 1000 + 9.5
    timers.sweep()
    assert head.events == []
    clock.now = 1000 + 10
    timers.sweep()
    assert head.events == ["head timed out"]
    assert idle.events == []
    clock.now = 1000 + 630
    timers.sweep()
    timers.sweep()
    assert head.events == ["head timed out"]
    assert idle.events == ["closed"]
    assert closing.events == ["aborted"]
    assert done.events == []


def test_a_new_wait_replaces_the_previous_one() -> None:
    timers, clock = _timers()
    conn = Conn()
    timers.expect_idle(conn)
    clock.now += 600
    timers.expect_head(conn)  # a request started: no longer idle
    clock.now += 31
    timers.sweep()
    assert conn.events == ["head timed out"]


def test_lowered_idle_timeout_applies_to_new_and_waiting_connections() -> None:
    timers, clock = _timers()
    old = Conn()
    timers.expect_idle(old)  # kept alive before the reload, under 630 s
    clock.now += 100
    timers.idle_timeout_s = 5  # SIGHUP lowers listen.idle_timeout_s
    new = Conn()
    timers.expect_idle(new)
    clock.now += 4
    timers.sweep()
    assert old.events == ["closed"]  # idle 104 s > 5 s: closed at the first sweep
    assert new.events == []
    clock.now += 1
    timers.sweep()
    # Not up to 630 s later behind the older entry.
    assert new.events == ["closed"]


def test_lowered_header_timeout_is_not_held_behind_an_older_wait() -> None:
    timers, clock = _timers()
    timers.header_timeout_s = 60
    slow = Conn()
    timers.expect_head(slow)
    timers.header_timeout_s = 2
    fast = Conn()
    clock.now += 1
    timers.expect_head(fast)
    clock.now += 2
    timers.sweep()
    assert slow.events == ["head timed out"]
    assert fast.events == ["head timed out"]


def test_raised_timeout_applies_to_waiting_connections() -> None:
    timers, clock = _timers()
    conn = Conn()
    timers.expect_head(conn)
    timers.header_timeout_s = 30  # SIGHUP raises listen.header_timeout_s
    clock.now += 29
    timers.sweep()
    assert conn.events == []
    clock.now += 1
    timers.sweep()
    assert conn.events == ["head timed out"]


def test_closing_grace_does_not_follow_the_configured_timeouts() -> None:
    timers, clock = _timers()
    conn = Conn()
    timers.close_deadline(conn)
    timers.header_timeout_s = timers.idle_timeout_s = 0.5
    clock.now += CLOSE_GRACE_S - 0.5
    timers.sweep()
    assert conn.events == []
    clock.now += 0.5
    timers.sweep()
    assert conn.events == ["aborted"]


def test_a_paused_client_is_checked_every_peer_check_s_until_resumed() -> None:
    timers, clock = _timers()
    paused, resumed, gone = Conn(), Conn(), Conn()
    for conn in (paused, resumed, gone):
        timers.paused(conn)
    timers.resumed(resumed)
    timers.forget(gone)
    clock.now += PEER_CHECK_S - 0.1
    timers.sweep()
    assert paused.events == []
    clock.now += 0.1
    timers.sweep()
    timers.sweep()  # checked once: the entry went with the check
    assert paused.events == ["peer checked"]
    assert resumed.events == gone.events == []
    timers.paused(paused)  # what check_peer does while the pause lasts
    clock.now += PEER_CHECK_S
    timers.sweep()
    assert paused.events == ["peer checked", "peer checked"]


@pytest.mark.parametrize("reading", [True, False], ids=["reading", "not-reading"])
def test_a_closing_client_is_cut_off_only_when_it_stops_reading(
    tmp_path: Path, reading: bool
) -> None:
    """Found by review: relay closed a connection after its last answer (Connection: close)
    and aborted it CLOSE_GRACE_S later whatever the client did, so a slow reader lost the
    tail still in relay's buffer, ended by an orderly FIN. It waits on while the client takes
    some, and cuts off one that takes nothing for CLOSE_STALL_S (nginx's send_timeout)."""
    w = make_wired(tmp_path)
    clock = Clock()
    w.relay.timers._clock = clock
    w.client.data_received(
        f"GET /big HTTP/1.1\r\nHost: 3000-sbx.{DOMAIN}\r\nConnection: close\r\n\r\n".encode()
    )
    w.turns.end()
    w.client_transport.buffered = 300_000  # a slow client: the answer waits in the buffer
    w.upstream.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    w.turns.end()
    assert w.client_transport.events[-1][0] == "close"
    steps = int(CLOSE_STALL_S / CLOSE_GRACE_S) + 2
    for step in range(steps):
        clock.now += CLOSE_GRACE_S
        if reading:
            w.client_transport.buffered -= 10_000
        w.relay.timers.sweep()
        aborted = ("abort", b"") in w.client_transport.events
        stalled = (step + 1) * CLOSE_GRACE_S >= CLOSE_STALL_S
        assert aborted is (stalled and not reading), step


class Faulty(Conn):
    """A connection whose deadline raises: a bug in relay's handling of it."""

    def head_timed_out(self) -> None:
        raise RuntimeError("Cannot call write() after write_eof()")


def test_a_deadline_that_raises_ends_its_connection_not_the_sweep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a 408 written after a FIN raised inside ``sweep``, which ended the
    sweeping task, and with it every header, idle and closing deadline of the worker. The
    bug is logged, its connection cut, and the other deadlines of the same sweep still run."""
    timers, clock = _timers()
    faulty, head, idle = Faulty(), Conn(), Conn()
    timers.expect_head(faulty)
    timers.expect_head(head)
    timers.expect_idle(idle)
    clock.now += 630
    timers.sweep()  # must not raise
    assert faulty.events == ["aborted"]
    assert head.events == ["head timed out"]
    assert idle.events == ["closed"]
    assert "internal error in a client connection's deadline" in caplog.text
    later = Conn()
    timers.expect_head(later)
    clock.now += 10
    timers.sweep()
    assert later.events == ["head timed out"]


def test_making_room_closes_the_longest_idle_connections_and_no_other() -> None:
    """relay.room: near the open-file limit, up to ``most`` of the connections waiting idle
    are closed, the longest idle first; one in its head wait is not, nor one that went back
    to work (a new request: expect_head), and the closed ones leave the idle wait."""
    timers, clock = _timers()
    idle = [Conn() for _ in range(5)]
    for conn in idle:
        timers.expect_idle(conn)
        clock.now += 1
    working, heading = idle[0], Conn()
    timers.expect_head(working)  # its next request began: no longer idle
    timers.expect_head(heading)
    assert timers.close_idle(3) == 3
    assert [c.events for c in idle] == [[], ["closed"], ["closed"], ["closed"], []]
    assert heading.events == []
    assert timers.close_idle(3) == 1
    assert idle[4].events == ["closed"]
    assert timers.close_idle(3) == 0
    clock.now += 630
    timers.sweep()  # no idle deadline left for the closed ones
    assert [c.events for c in idle[1:]] == [["closed"]] * 4
