"""The file route source: per-route validation, reload on change, revocation (SPEC §3)."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path
from typing import Any

import pytest

from relay.core.routes import parse_routes as parse_routes_of_core
from relay.feeds import file as file_feed
from tests.support.harness import DOMAIN, route, running_relay, write_routes
from tests.support.rawhttp import request


async def test_one_malformed_route_is_rejected_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    routes = [
        route("good", insecure=True),
        route("bad", address="8.8.8.8", insecure=True),  # outside upstream.allowed_cidrs
        {"sandbox_id": "worse", "address": "127.0.0.1", "envd_token": "t", "colour": "red"},
        route("alsogood", envd_token="x"),
    ]
    with caplog.at_level("WARNING", logger="relay"):
        async with running_relay(tmp_path, routes) as relay:
            assert sorted(relay.relay.table.routes) == ["alsogood", "good"]
            assert relay.relay.observer.route_errors == 2
            missing = await request(relay.port, "GET", "/health", f"49983-bad.{DOMAIN}")
            assert missing.status == 502
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "sandbox_id=bad" in messages
    assert "allowed_cidrs" in messages
    assert "sandbox_id=worse" in messages
    assert "unknown field" in messages


async def test_broken_file_keeps_the_previous_table(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [route("keep", insecure=True)]) as relay:
        relay.routes_file.write_text("{not json")
        relay.relay.feed.load()
        assert relay.relay.table.get("keep") is not None
        assert relay.relay.observer.feed_errors == 1


async def test_file_change_is_picked_up_by_polling(tmp_path: Path) -> None:
    async with running_relay(tmp_path, [route("first", insecure=True)]) as relay:
        write_routes(relay.routes_file, [route("second", insecure=True)])
        started = time.monotonic()
        while relay.relay.table.get("second") is None:
            assert time.monotonic() - started < 1.0
            await asyncio.sleep(0.02)
        assert relay.relay.table.get("first") is None


async def test_sighup_style_reload(tmp_path: Path) -> None:
    async with running_relay(
        tmp_path, [route("a", insecure=True)], {"routes": {"poll_interval_s": 60}}
    ) as relay:
        write_routes(relay.routes_file, [route("b", insecure=True)])
        relay.relay.reload()
        assert relay.relay.table.get("b") is not None


async def test_a_version_whose_read_failed_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the feed took a version for seen before reading it, so a read that
    failed for a reason other than the file (EMFILE at the descriptor limit) left a removed
    route serving until the file changed again or a SIGHUP."""
    real = Path.read_text
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if failures and self.name == "routes.json":
            raise failures.pop()
        return real(self, *args, **kwargs)

    async with running_relay(
        tmp_path, [route("keep", insecure=True), route("gone", insecure=True)]
    ) as relay:
        monkeypatch.setattr(Path, "read_text", read_text)
        write_routes(relay.routes_file, [route("keep", insecure=True)])
        started = time.monotonic()
        while relay.relay.table.get("gone") is not None:
            assert time.monotonic() - started < 2.0, "the removed route is still served"
            await asyncio.sleep(0.02)
        assert not failures  # the read did fail once
        assert relay.relay.observer.feed_errors == 1


@pytest.mark.parametrize("first", [False, True], ids=["a-later-read", "the-first-read"])
async def test_polling_goes_on_after_an_unexpected_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, first: bool
) -> None:
    """Found by review: an exception out of a read (a bug), the first one included, ended the
    feed's task, and with it every later reload of the file, while /readyz stayed 200."""
    real = parse_routes_of_core
    bugs = [RuntimeError("a bug")]

    def parse_routes(*args: Any) -> Any:
        if bugs:
            raise bugs.pop()
        return real(*args)

    caplog.set_level("ERROR", logger="relay")
    if first:  # the relay's first read strikes it
        monkeypatch.setattr(file_feed, "parse_routes", parse_routes)
    async with running_relay(tmp_path, [route("first", insecure=True)]) as relay:
        monkeypatch.setattr(file_feed, "parse_routes", parse_routes)
        if bugs:
            write_routes(relay.routes_file, [route("second", insecure=True)])
            started = time.monotonic()
            while bugs:
                assert time.monotonic() - started < 2.0
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        write_routes(relay.routes_file, [route("third", insecure=True)])
        started = time.monotonic()
        while relay.relay.table.get("third") is None:
            assert time.monotonic() - started < 2.0, "the file is no longer polled"
            await asyncio.sleep(0.02)
    assert "unexpected error" in caplog.text
