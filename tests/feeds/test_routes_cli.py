"""``relay routes put|delete|list`` for both sources (relay/routes_cli.py)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis

from relay.__main__ import main
from tests.feeds.helpers import dumps, route
from tests.feeds.redisproc import RedisProcess
from tests.support.ports import free_port


def file_config(tmp_path: Path) -> Path:
    config = tmp_path / "relay.toml"
    config.write_text('[routes]\nsource = "file"\nfile = "routes.json"\n')
    return config


def redis_config(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "relay.toml"
    config.write_text(f'[routes]\nsource = "redis"\nredis_url = "{url}"\n')
    return config


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def listed(capsys: pytest.CaptureFixture[str], config: Path) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["routes", "list", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "tok-" not in out  # no token, ever
    views: list[dict[str, Any]] = json.loads(out)["routes"]
    return views


@pytest.fixture
def sync_writer(redis_proc: RedisProcess) -> Any:
    client = redis.Redis.from_url(redis_proc.url, protocol=2)
    try:
        yield client
    finally:
        client.close()


# -- file source -------------------------------------------------------------------------------


def test_file_put_list_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = file_config(tmp_path)
    one = write_json(tmp_path / "one.json", route("aaa", generation=1))
    assert main(["routes", "put", str(one), "--config", str(config)]) == 0
    many = write_json(
        tmp_path / "many.json", {"routes": [route("aaa", generation=2), route("bbb")]}
    )
    assert main(["routes", "put", str(many), "--config", str(config)]) == 0
    views = listed(capsys, config)
    assert [(v["sandbox_id"], v["generation"]) for v in views] == [("aaa", 2), ("bbb", 0)]
    assert set(views[0]) == {
        "sandbox_id",
        "address",
        "generation",
        "insecure",
        "max_connections",
        "has_traffic_token",
    }
    assert main(["routes", "delete", "aaa", "--config", str(config)]) == 0
    assert main(["routes", "delete", "aaa", "--config", str(config)]) == 0  # idempotent
    assert "had no route" in capsys.readouterr().out
    assert [v["sandbox_id"] for v in listed(capsys, config)] == ["bbb"]
    stored = json.loads((tmp_path / "routes.json").read_text())
    assert stored["routes"][0]["envd_token"] == "tok-bbb"  # the file keeps the full route


def test_put_from_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = file_config(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO(dumps(route("fromstdin"))))
    assert main(["routes", "put", "-", "--config", str(config)]) == 0
    assert [v["sandbox_id"] for v in listed(capsys, config)] == ["fromstdin"]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="not-json"),
        pytest.param("[1, 2]", "one route object or", id="a-list"),
        pytest.param('{"routes": {}}', '"routes" must be a list', id="routes-not-list"),
        pytest.param('{"routes": [], "x": 1}', "unknown top-level key(s): x", id="extra-key"),
        pytest.param(
            json.dumps({"routes": [route("okay"), {**route("bad"), "address": "8.8.8.8"}]}),
            "route #1 (sandbox_id bad): address is outside upstream.allowed_cidrs",
            id="one-bad-of-two",
        ),
        pytest.param(
            json.dumps({**route("x"), "sandbox_id": "UPPER"}),
            "route #0 (sandbox_id ?): sandbox_id must match",
            id="bad-id",
        ),
        pytest.param(
            json.dumps({"routes": [route("twice"), route("twice")]}),
            "sandbox_id twice appears more than once",
            id="duplicate",
        ),
        pytest.param(
            json.dumps({**route("x"), "colour": "blue"}), "unknown field(s): colour", id="unknown"
        ),
    ],
)
def test_invalid_input_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: str, message: str
) -> None:
    config = file_config(tmp_path)
    source = tmp_path / "input.json"
    source.write_text(doc)
    assert main(["routes", "put", str(source), "--config", str(config)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "routes.json").exists()


def test_invalid_delete_id_and_missing_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = file_config(tmp_path)
    assert main(["routes", "delete", "Not-An-Id", "--config", str(config)]) == 2
    assert "is not a sandbox id" in capsys.readouterr().err
    assert main(["routes", "put", str(tmp_path / "nope.json"), "--config", str(config)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_list_reports_a_broken_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = file_config(tmp_path)
    (tmp_path / "routes.json").write_text("{")
    assert main(["routes", "list", "--config", str(config)]) == 1
    assert "invalid JSON" in capsys.readouterr().err


# -- redis source ------------------------------------------------------------------------------


def test_redis_put_list_delete(
    tmp_path: Path,
    redis_proc: RedisProcess,
    sync_writer: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = redis_config(tmp_path, redis_proc.url)
    many = write_json(tmp_path / "many.json", {"routes": [route("aaa"), route("bbb")]})
    assert main(["routes", "put", str(many), "--config", str(config)]) == 0
    assert sync_writer.hlen("relay:routes") == 2
    events: list[Any] = sync_writer.xrange("relay:routes:events")  # type: ignore[assignment]
    assert [e[1][b"op"] for e in events] == [b"put", b"put"]
    assert [e[1][b"id"] for e in events] == [b"aaa", b"bbb"]
    assert json.loads(events[0][1][b"route"]) == route("aaa")
    assert json.loads(sync_writer.hget("relay:routes", "aaa") or b"") == route("aaa")

    assert [v["sandbox_id"] for v in listed(capsys, config)] == ["aaa", "bbb"]
    assert main(["routes", "delete", "aaa", "--config", str(config)]) == 0
    assert sync_writer.hlen("relay:routes") == 1
    newest: list[Any] = sync_writer.xrevrange("relay:routes:events", count=1)  # type: ignore[assignment]
    assert newest[0][1] == {b"op": b"delete", b"id": b"aaa"}
    # A malformed value written by someone else is reported, the rest listed.
    sync_writer.hset("relay:routes", "junk", "{")
    assert [v["sandbox_id"] for v in listed(capsys, config)] == ["bbb"]


def test_redis_invalid_input_writes_nothing(
    tmp_path: Path,
    redis_proc: RedisProcess,
    sync_writer: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = redis_config(tmp_path, redis_proc.url)
    doc = {"routes": [route("fine"), {**route("bad"), "generation": -1}]}
    source = write_json(tmp_path / "in.json", doc)
    assert main(["routes", "put", str(source), "--config", str(config)]) == 2
    assert "generation must be an integer from 0 to 2^64-1" in capsys.readouterr().err
    assert sync_writer.exists("relay:routes", "relay:routes:events") == 0


def test_redis_put_trims_the_stream(
    tmp_path: Path, redis_proc: RedisProcess, sync_writer: redis.Redis
) -> None:
    config = redis_config(tmp_path, redis_proc.url)
    source = write_json(tmp_path / "in.json", {"routes": [route(f"r{i}") for i in range(300)]})
    assert main(["routes", "put", str(source), "--config", str(config), "--maxlen", "100"]) == 0
    assert sync_writer.hlen("relay:routes") == 300
    assert sync_writer.xlen("relay:routes:events") < 300  # MAXLEN ~ trims whole nodes


@pytest.mark.parametrize("refusal", ["acl", "wrongtype"])
def test_a_refused_redis_write_prints_no_token(
    tmp_path: Path,
    redis_proc: RedisProcess,
    sync_writer: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    refusal: str,
) -> None:
    """Found by review, walking docs/route-feed.md: ``relay routes put`` with the relay's own
    read-only identity printed redis-py's message for the refused command, which quotes it:
    ``HSET relay:routes abc {"address":...,"envd_token":"..."`` (up to 100 characters), so a
    route's token reached the terminal or a CI log. Refused at MULTI time (an ACL) and at EXEC
    time (a key of the wrong type): exit 1, the command and Redis's reason, no token."""
    url = redis_proc.url
    if refusal == "acl":
        sync_writer.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "ro", "on", ">ro-pw", "resetkeys", "%R~relay:*", "-@all",
            "+multi", "+exec", "+hgetall",
        )  # fmt: skip
        url = url.replace("redis://", "redis://ro:ro-pw@")
    else:
        sync_writer.set("relay:routes", "not a hash")
    config = redis_config(tmp_path, url)
    doc = {"routes": [dict(route("leaky"), traffic_token="traffic-secret-leaky")]}
    capsys.readouterr()
    assert main(["routes", "put", str(write_json(tmp_path / "r.json", doc)), "--config",
                 str(config)]) == 1  # fmt: skip
    out, err = capsys.readouterr()
    assert "HSET" in err
    assert ("NOPERM" in err or "permission" in err) if refusal == "acl" else "WRONGTYPE" in err
    for secret in ("tok-leaky", "traffic-secret", "envd_token", "{"):
        assert secret not in out + err, err


def test_redis_unreachable_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = redis_config(tmp_path, f"redis://127.0.0.1:{free_port()}")
    assert main(["routes", "list", "--config", str(config)]) == 1
    assert "relay: redis 127.0.0.1:" in capsys.readouterr().err


def test_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(
        '[routes]\nsource = "redis"\nredis_url = "redis://u:secret@127.0.0.1:1"\n'
        'redis_password_env = "SOME_VAR"\n'
    )
    assert main(["routes", "list", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "routes.redis_url: holds a password while" in err
    assert "secret" not in err
    config.write_text(
        '[routes]\nsource = "redis"\nredis_url = "redis://127.0.0.1:1"\n'
        'redis_password_file = "missing-password"\n'
    )
    assert main(["routes", "list", "--config", str(config)]) == 2
    assert "routes.redis_password_file" in capsys.readouterr().err
    config.write_text(
        '[routes]\nsource = "redis"\nredis_url = "redis://127.0.0.1:1"\nredis_ca_file = "ca.pem"\n'
    )
    assert main(["routes", "list", "--config", str(config)]) == 2
    assert "routes.redis_ca_file: needs a rediss:// URL" in capsys.readouterr().err


def test_sign_url_takes_the_token_from_the_redis_source(
    tmp_path: Path, redis_proc: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    from relay.core.auth import file_signature

    config = redis_config(tmp_path, redis_proc.url)
    one = write_json(tmp_path / "one.json", route("signme"))
    assert main(["routes", "put", str(one), "--config", str(config)]) == 0
    capsys.readouterr()
    args = ["sign-url", "--url", "http://x", "--path", "/a", "--sandbox", "signme"]
    assert main([*args, "--config", str(config)]) == 0
    url = capsys.readouterr().out.strip()
    expected = file_signature("/a", "read", "", "tok-signme", None)
    assert url.endswith("signature=" + expected.replace("+", "%2B").replace("/", "%2F"))
    assert main([*args[:-1], "nobody", "--config", str(config)]) == 1


# -- concurrent writers (found by review) -------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _routes_cli(config: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "routes", *args, "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )


def _file_ids(tmp_path: Path) -> list[str]:
    return sorted(
        r["sandbox_id"] for r in json.loads((tmp_path / "routes.json").read_text())["routes"]
    )


def test_a_writer_waits_for_the_one_before(tmp_path: Path) -> None:
    """put and delete read the file, change it and rename a new one over it: one that read
    before another's rename undid it (a deleted route came back with its credentials). Each
    holds .routes.json.lock meanwhile; here the test holds it, and a delete waits."""
    config = file_config(tmp_path)
    write_json(tmp_path / "routes.json", {"routes": [route("victim"), route("other")]})
    lock = os.open(tmp_path / ".routes.json.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    delete = _routes_cli(config, "delete", "victim")
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            delete.wait(timeout=1.5)
        waited = delete.returncode is None
        before = _file_ids(tmp_path)
    finally:
        os.close(lock)
        out, _ = delete.communicate(timeout=30)
    assert waited, "the delete did not wait for the lock"
    assert before == ["other", "victim"]
    assert delete.returncode == 0
    assert b"deleted victim" in out
    assert _file_ids(tmp_path) == ["other"]


def test_concurrent_puts_all_land(tmp_path: Path) -> None:
    """Eight puts at once, each of its own sandbox: without the lock 3-5 of 8 were lost."""
    config = file_config(tmp_path)
    write_json(tmp_path / "routes.json", {"routes": []})
    sources = [write_json(tmp_path / f"r{i}.json", route(f"box{i}")) for i in range(8)]
    puts = [_routes_cli(config, "put", str(source)) for source in sources]
    assert [p.wait(timeout=60) for p in puts] == [0] * 8
    for p in puts:
        p.communicate()
    assert _file_ids(tmp_path) == [f"box{i}" for i in range(8)]


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv")
@pytest.mark.parametrize("owner", ["root-0666", "nobody-0600"])
def test_a_second_writer_is_not_locked_out(owner: str) -> None:
    """Found by review, twice: the lock file root made locked out another identity that may
    write the routes file: the service user through the file's mode or group (a 0600 lock
    file), or as the file's owner (a lock file of root's). It is opened read-only, and takes the
    routes file's owner, group and mode."""
    assert SETPRIV is not None
    as_nobody = [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    shared = Path(tempfile.mkdtemp(prefix="relay-lock-", dir="/tmp"))  # nobody can reach it
    try:
        shared.chmod(0o777)
        config = shared / "relay.toml"
        config.write_text(f'[routes]\nfile = "{shared / "routes.json"}"\n')
        config.chmod(0o644)
        routes = shared / "routes.json"
        routes.write_text('{"routes": []}')
        if owner == "root-0666":
            routes.chmod(0o666)
        else:  # the service user's own file
            nobody = pwd.getpwnam("nobody")
            os.chown(routes, nobody.pw_uid, nobody.pw_gid)
            routes.chmod(0o600)
        for sandbox_id, who in (("first", []), ("second", as_nobody)):
            source = write_json(shared / f"{sandbox_id}.json", route(sandbox_id))
            source.chmod(0o644)
            put = ["routes", "put", str(source), "--config", str(config)]
            done = subprocess.run(
                [*who, sys.executable, "-m", "relay", *put],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=30,
                check=False,
            )
            assert done.returncode == 0, done.stderr
        assert _file_ids(shared) == ["first", "second"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_writers_through_a_symlink_change_and_lock_the_file_it_names(tmp_path: Path) -> None:
    """Found by review: with routes.file a symlink (/etc/relay/routes.json into a data volume),
    put and delete renamed their new file over the link, which became a file of its own: a
    relay reading the real file never saw a delete ("deleted victim", exit 0, still served),
    and writers naming the link and the real file took two different locks."""
    data = tmp_path / "data"
    data.mkdir()
    real = write_json(data / "routes.json", {"routes": [route("victim"), route("other")]})
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "routes.json").symlink_to(real)
    config = file_config(etc)
    lock = os.open(data / ".routes.json.lock", os.O_RDONLY | os.O_CREAT, 0o640)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a writer naming the real file holds its lock
    delete = _routes_cli(config, "delete", "victim")
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            delete.wait(timeout=1.5)
        waited = delete.returncode is None
    finally:
        os.close(lock)
        out, _ = delete.communicate(timeout=30)
    assert waited, "the writer through the symlink did not wait for the real file's lock"
    assert delete.returncode == 0
    assert b"deleted victim" in out
    assert (etc / "routes.json").is_symlink()
    assert _file_ids(data) == ["other"]
