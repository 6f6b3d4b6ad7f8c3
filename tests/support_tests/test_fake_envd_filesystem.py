"""The fake envd's filesystem.Filesystem service."""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

from tests.support.connect import ConnectStream, JSONDict, unary
from tests.support.fake_envd import FakeEnvd

FS = "/filesystem.Filesystem"
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3}|\.\d{6}|\.\d{9})?Z$")


async def call(envd: FakeEnvd, method: str, request: JSONDict) -> tuple[int, Any]:
    result = await unary(envd.host, envd.port, f"{FS}/{method}", request)
    return result.status, result.json()


async def test_stat_entry_is_proto3_json_like_envd(envd: FakeEnvd) -> None:
    envd.host_path("/home/user/a.txt").write_text("hello")
    os.chmod(envd.host_path("/home/user/a.txt"), 0o640)
    status, body = await call(envd, "Stat", {"path": "/home/user/a.txt"})
    assert status == 200
    entry = body["entry"]
    assert list(entry) == [
        "name",
        "type",
        "path",
        "size",
        "mode",
        "permissions",
        "owner",
        "group",
        "modifiedTime",
    ]
    assert entry["name"] == "a.txt"
    assert entry["type"] == "FILE_TYPE_FILE"
    assert entry["path"] == "/home/user/a.txt"
    assert entry["size"] == "5"  # int64 is a JSON string
    assert entry["mode"] == 0o640
    assert entry["permissions"] == "-rw-r-----"
    assert TIMESTAMP.match(entry["modifiedTime"])


async def test_relative_and_home_paths_resolve_under_home_user(envd: FakeEnvd) -> None:
    envd.host_path("/home/user/rel.txt").write_text("x")
    for spelling in ("rel.txt", "~/rel.txt"):
        status, body = await call(envd, "Stat", {"path": spelling})
        assert status == 200
        assert body["entry"]["path"] == "/home/user/rel.txt"


async def test_stat_missing_is_not_found_with_envd_text(envd: FakeEnvd) -> None:
    result = await unary(envd.host, envd.port, f"{FS}/Stat", {"path": "/home/user/nope"})
    assert result.status == 404
    assert result.head.header("Content-Type") == "application/json"
    assert result.json() == {
        "code": "not_found",
        "message": "file not found: lstat /home/user/nope: no such file or directory",
    }


async def test_directory_and_symlink_entries(envd: FakeEnvd) -> None:
    os.symlink(envd.host_path("/home/user"), envd.host_path("/home/user/link"))
    status, body = await call(envd, "Stat", {"path": "/home/user/link"})
    assert status == 200
    entry = body["entry"]
    assert entry["type"] == "FILE_TYPE_DIRECTORY"  # typed by its target (entry.go)
    assert entry["permissions"].startswith("L")
    assert entry["symlinkTarget"] == "/home/user"
    _, home = await call(envd, "Stat", {"path": "/home/user"})
    assert home["entry"]["permissions"].startswith("d")
    assert "symlinkTarget" not in home["entry"]


async def test_make_dir_move_list_remove(envd: FakeEnvd) -> None:
    status, body = await call(envd, "MakeDir", {"path": "/home/user/a/b"})
    assert status == 200
    assert body["entry"]["path"] == "/home/user/a/b"
    status, body = await call(envd, "MakeDir", {"path": "/home/user/a/b"})
    assert (status, body["code"]) == (409, "already_exists")

    envd.host_path("/home/user/a/f.txt").write_text("f")
    status, body = await call(
        envd, "Move", {"source": "/home/user/a/f.txt", "destination": "/home/user/x/g.txt"}
    )
    assert status == 200
    assert body["entry"]["name"] == "g.txt"
    assert envd.host_path("/home/user/x/g.txt").read_text() == "f"

    status, body = await call(envd, "ListDir", {"path": "/home/user"})
    assert [e["path"] for e in body["entries"]] == ["/home/user/a", "/home/user/x"]
    status, body = await call(envd, "ListDir", {"path": "/home/user", "depth": 2})
    assert [e["path"] for e in body["entries"]] == [
        "/home/user/a",
        "/home/user/a/b",
        "/home/user/x",
        "/home/user/x/g.txt",
    ]
    status, body = await call(envd, "ListDir", {"path": "/home/user/x/g.txt"})
    assert (status, body["code"]) == (400, "invalid_argument")

    assert await call(envd, "Remove", {"path": "/home/user/a"}) == (200, {})
    assert await call(envd, "Remove", {"path": "/home/user/a"}) == (200, {})  # RemoveAll
    assert not envd.host_path("/home/user/a").exists()
    status, body = await call(envd, "Move", {"source": "/home/user/a", "destination": "/tmp/z"})
    assert (status, body["code"]) == (404, "not_found")


async def test_empty_list_omits_the_field(envd: FakeEnvd) -> None:
    assert await call(envd, "ListDir", {"path": "/tmp"}) == (200, {})


async def test_watch_dir_streams_start_then_events(envd: FakeEnvd) -> None:
    request = {"path": "/home/user", "includeEntry": True}
    async with ConnectStream(
        envd.host, envd.port, f"{FS}/WatchDir", request, {"Keepalive-Ping-Interval": "50"}
    ) as watch:
        frames = aiter(watch)
        assert (await anext(frames)).payload == {"start": {}}
        envd.host_path("/home/user/new.txt").write_text("data")
        created = (await anext(frames)).payload["filesystem"]
        written = (await anext(frames)).payload["filesystem"]
    assert created["name"] == "new.txt"
    assert created["type"] == "EVENT_TYPE_CREATE"
    assert created["entry"]["path"] == "/home/user/new.txt"
    assert written["type"] == "EVENT_TYPE_WRITE"


async def test_watch_dir_on_a_missing_path_ends_with_not_found(envd: FakeEnvd) -> None:
    async with ConnectStream(envd.host, envd.port, f"{FS}/WatchDir", {"path": "/nope"}) as watch:
        frames = [frame async for frame in watch]
    assert [f.payload for f in frames] == [
        {
            "error": {
                "code": "not_found",
                "message": "path /nope not found: stat /nope: no such file or directory",
            }
        }
    ]


async def test_polling_watcher_api(envd: FakeEnvd) -> None:
    status, body = await call(envd, "CreateWatcher", {"path": "/home/user"})
    assert status == 200
    watcher = body["watcherId"]
    envd.host_path("/home/user/w.txt").write_text("")
    found: list[JSONDict] = []
    for _ in range(40):
        _, events = await call(envd, "GetWatcherEvents", {"watcherId": watcher})
        found += events.get("events", [])
        if found:
            break
        await asyncio.sleep(0.05)
    assert found == [{"name": "w.txt", "type": "EVENT_TYPE_CREATE"}]
    assert await call(envd, "RemoveWatcher", {"watcherId": watcher}) == (200, {})
    status, body = await call(envd, "GetWatcherEvents", {"watcherId": watcher})
    assert (status, body["code"]) == (404, "not_found")
