"""Operator-facing faults found by review: secrets in a Redis URL's query, a routes file
made world-readable by ``relay routes``, values that would spin or never expire, files that
are not UTF-8, and a TLS port that let silent clients wait out a 60 s handshake."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relay.__main__ import main
from relay.config import ConfigError
from relay.config_parse import load, parse
from relay.config_redis import redact_url
from relay.feeds.file import write_routes_file
from relay.feeds.redis_client import redis_target
from tests.support.certs import issue
from tests.support.harness import DOMAIN, config_data, route, running_relay, to_toml, write_routes


def config_file(tmp_path: Path, overrides: dict[str, dict[str, Any]]) -> Path:
    path = tmp_path / "relay.toml"
    path.write_text(to_toml(config_data(tmp_path, overrides)))
    return path


QUERY_URL = "redis://127.0.0.1:6379/0?password=hunter2"


def test_check_config_redacts_a_password_in_the_query(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """redis-py reads ``?password=`` too (and prefers it): SPEC §7 check-config redacts it."""
    path = config_file(tmp_path, {"routes": {"source": "redis", "redis_url": QUERY_URL}})
    assert main(["check-config", "--config", str(path), "--offline"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert "<redacted>" in out


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@h:1/0", "redis://u:<redacted>@h:1/0"),
        ("redis://h/0?db=1&password=x%40y", "redis://h/0?db=1&password=<redacted>"),
        ("rediss://h/0", "rediss://h/0"),
        # Without a password, exactly as written (check-config's output may be copied back).
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        (
            "rediss://h/0?ssl_ca_certs=/etc/relay/ca.pem",
            "rediss://h/0?ssl_ca_certs=/etc/relay/ca.pem",
        ),
        (
            "redis://h/0?client_name=a%20b&password=p",
            "redis://h/0?client_name=a%20b&password=<redacted>",
        ),
        ("redis://h/0?password=", "redis://h/0?password="),  # redis-py ignores an empty one
        # an encoded key is the same key to parse_qs and redis-py (found by review)
        ("redis://h/0?pass%77ord=p", "redis://h/0?password=<redacted>"),
        ("redis://h/0?%70assword=p&db=1", "redis://h/0?password=<redacted>&db=1"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    ["redis://relay:hun\tter2@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?pass\nword=hunter2"],
)
def test_check_config_redacts_a_password_spelled_with_tabs_or_line_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """urlsplit, and so redis-py, drop tabs and line ends anywhere in a URL: the password
    redis-py sends here is "hunter2". redact_url looked for it as urlsplit gave it, did not
    find it in the URL as written, and check-config printed it (found by review)."""
    path = config_file(tmp_path, {"routes": {"source": "redis", "redis_url": url}})
    assert main(["check-config", "--config", str(path), "--offline"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)["routes"]["redis_url"]
    assert "hunter2" not in shown.replace("\t", "").replace("\n", ""), shown
    assert "<redacted>" in shown


def test_no_repr_shows_a_password_written_into_redis_url(tmp_path: Path) -> None:
    """A password in redis_url is accepted (README, Decisions), so the dataclasses that hold
    the URL must not print it: repr(config) and repr(RedisTarget) did (found by review)."""
    routes = {"source": "redis", "redis_url": "redis://relay:hunter2@127.0.0.1:6379/0"}
    config = parse(config_data(tmp_path, {"routes": routes}), base_dir=tmp_path)
    target = redis_target(config)
    for shown in (repr(config), str(config), repr(config.routes), repr(target), str(target)):
        assert "hunter2" not in shown, shown


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?socket_timeout=soon",  # the feed task died at start
        "redis://h/0?max_connections=x",
        "redis://h/0?sockettimeout=1",  # unknown: a traceback at every retry
        "redis://h/0?protocol=4",
        "redis://h/0?retry=1",  # an AttributeError inside redis-py
    ],
)
def test_a_redis_url_option_redis_py_refuses_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """redis-py refuses such a URL only when the feed connects: the feed task died with a
    traceback ("background task failed") and relay served 503 "not ready" for ever, or each
    retry failed with a traceback, while check-config passed it (found by review). SPEC §6:
    a wrong value stops startup with a message naming the key."""
    routes = {"source": "redis", "redis_url": url}
    with pytest.raises(ConfigError, match=r"^routes\.redis_url: "):
        parse(config_data(tmp_path, {"routes": routes}), base_dir=tmp_path)
    path = config_file(tmp_path, {"routes": routes})
    assert main(["check-config", "--config", str(path), "--offline"]) == 2
    assert "routes.redis_url" in capsys.readouterr().err


@pytest.mark.parametrize(
    "upstream", ["http://api:s3cret@127.0.0.1:3000", "http://s3cret@127.0.0.1", "http://a b:80"]
)
def test_a_management_upstream_with_userinfo_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], upstream: str
) -> None:
    """management.upstream must be http://host:port. With userinfo it was taken as the host
    "api:s3cret@127.0.0.1": relay started, every management request failed to resolve it
    (502 "The API server is unreachable"), and check-config printed the password, as it
    redacts only routes.redis_url (found by review)."""
    path = config_file(tmp_path, {"management": {"upstream": upstream}})
    assert main(["check-config", "--config", str(path), "--offline"]) == 2
    captured = capsys.readouterr()
    assert "management.upstream" in captured.err
    assert "s3cret" not in captured.out + captured.err


def test_a_query_password_conflicts_with_a_password_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    routes = {"source": "redis", "redis_url": QUERY_URL, "redis_password_file": "pw"}
    with pytest.raises(ConfigError, match=r"routes\.redis_url"):
        parse(config_data(tmp_path, {"routes": routes}), base_dir=tmp_path)


@pytest.mark.parametrize(
    "url",
    ["redis://:s3cret-pw/0", "redis://relay:s3cret-pw", "redis://relay:s3cret\uff20pw@h:6379"],
)
def test_a_password_taken_for_a_port_is_not_quoted(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the @ forgotten, urlsplit takes the password for the port, and its error quoted it
    (found by review): check-config printed the secret."""
    path = config_file(tmp_path, {"routes": {"source": "redis", "redis_url": url}})
    assert main(["check-config", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "routes.redis_url" in out + err
    assert "s3cret" not in out + err


def test_relay_routes_keeps_a_private_routes_file_private(tmp_path: Path) -> None:
    """The routes file holds every sandbox's tokens; rewriting it with ``relay routes put``
    under a 022 umask must not make it world-readable (SPEC §2-3)."""
    routes = tmp_path / "routes.json"
    path = config_file(tmp_path, {})
    write_routes(routes, [route("aaa", envd_token="secret-token-1")])
    os.chmod(routes, 0o600)
    new = tmp_path / "new.json"
    new.write_text(json.dumps(route("bbb", envd_token="secret-token-2")))
    old_umask = os.umask(0o022)
    try:
        assert main(["routes", "put", str(new), "--config", str(path)]) == 0
    finally:
        os.umask(old_umask)
    assert "secret-token-2" in routes.read_text()
    assert stat.S_IMODE(routes.stat().st_mode) == 0o600


def test_relay_routes_keeps_the_routes_files_group(tmp_path: Path) -> None:
    """docs/operations.md installs the file 0640 root:relay for a service running as relay:
    a rewrite by root must keep that group, or the service can no longer read it."""
    routes = tmp_path / "routes.json"
    write_routes(routes, [route("aaa", envd_token="t")])
    groups = [g for g in os.getgroups() if g != routes.stat().st_gid]
    if not groups and os.geteuid() != 0:
        pytest.skip("needs a second group, or root")
    group = groups[0] if groups else 65534
    os.chown(routes, -1, group)
    os.chmod(routes, 0o640)
    write_routes_file(routes, [route("bbb", envd_token="t2")])
    assert routes.stat().st_gid == group
    assert stat.S_IMODE(routes.stat().st_mode) == 0o640


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("routes", "poll_interval_s", 0),  # a busy loop on stat()
        ("routes", "poll_interval_s", -1),
        ("listen", "idle_timeout_s", -5),
        ("upstream", "idle_timeout_s", 0),
        ("upstream", "max_idle_per_upstream", -1),
        ("upstream", "connect_timeout_s", float("inf")),
        ("process", "drain_timeout_s", float("nan")),
    ],
)
def test_out_of_range_values_are_refused_by_key(
    tmp_path: Path, section: str, key: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{key}")):
        parse(config_data(tmp_path, {section: {key: value}}), base_dir=tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[listen]\naddress = "127.0.0.1:\u00b2"\n', "listen.address[0]: bad address"),
        ("[process]\ndrain_timeout_s = 1" + "0" * 400 + "\n", "process.drain_timeout_s"),
        ("[listen]\nx = " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ],
    ids=["superscript-port", "huge-number", "deep-arrays"],
)
def test_odd_values_are_config_errors_not_tracebacks(
    tmp_path: Path, text: str, message: str
) -> None:
    """SPEC §6-7: a bad configuration stops with a message naming the key (exit 2). These
    raised ValueError, OverflowError and RecursionError out of load()."""
    path = tmp_path / "relay.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(path)


def test_a_config_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_bytes(b'[listen]\naddress = "127.0.0.1:0" # \xff\n')
    done = subprocess.run(
        [sys.executable, "-m", "relay", "check-config", "--config", str(path), "--offline"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "not UTF-8" in done.stderr
    assert "Traceback" not in done.stderr


async def test_the_route_file_feed_survives_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    """SPEC §3: a file that fails to parse keeps the previous table, and later changes are
    still read (before, the decode error ended the feed's task: no revocation any more)."""
    routes = [route("aaa", envd_token="t1"), route("bbb", envd_token="t2")]
    async with running_relay(tmp_path, routes) as relay:
        assert set(relay.relay.table.routes) == {"aaa", "bbb"}
        relay.routes_file.write_bytes(b'{"routes": [\xff')  # a writer caught mid-write
        await asyncio.sleep(0.5)
        assert set(relay.relay.table.routes) == {"aaa", "bbb"}
        write_routes(relay.routes_file, [route("aaa", envd_token="t1")])
        for _ in range(60):  # the feed polls every 0.25 s
            if "bbb" not in relay.relay.table.routes:
                break
            await asyncio.sleep(0.05)
        assert "bbb" not in relay.relay.table.routes


async def test_a_silent_client_on_the_tls_port_is_closed_at_the_header_timeout(
    tmp_path: Path,
) -> None:
    """SPEC §5a: header_timeout_s runs from accept, the TLS handshake included (asyncio's
    own default would keep the socket 60 s)."""
    certs = issue(tmp_path / "pki", [f"*.{DOMAIN}"])
    listen = {"tls_cert": str(certs.cert_file), "tls_key": str(certs.key_file)}
    listen["header_timeout_s"] = 1  # type: ignore[assignment]
    async with running_relay(tmp_path, [route("box", insecure=True)], {"listen": listen}) as r:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        started = time.monotonic()
        try:
            data = await asyncio.wait_for(reader.read(4096), 4)
        except ConnectionError:
            data = b""
        finally:
            writer.close()
        assert data == b""
        assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            '[routes]\nsource = "redis"\nredis_url = "rediss://127.0.0.1:1/0"\n'
            'redis_password_file = "/nonexistent/relay/password"\n',
            "routes.redis_password_file",
        ),
        (
            '[routes]\nsource = "redis"\nredis_url = "rediss://127.0.0.1:1/0"\n'
            'redis_ca_file = "/nonexistent/relay/ca.pem"\n',
            "routes.redis_ca_file",
        ),
        ('[listen]\naddress = "127.0.0.1:0"\n[process]\nworkers = 2\n', "listen.address[0]"),
    ],
    ids=["password-file", "ca-file", "port-0-with-workers"],
)
def test_check_config_refuses_what_serve_refuses(
    tmp_path: Path, text: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: check-config exited 0 for these, which serve refuses with exit 2."""
    path = tmp_path / "relay.toml"
    path.write_text(text)
    (tmp_path / "routes.json").write_text('{"routes": []}')
    assert main(["check-config", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert key in out + err


def test_offline_skips_the_host_checks_with_workers_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: with process.workers > 1, check-config --offline ran the host checks
    (TLS files, source address) through the supervisor's preflight."""
    path = tmp_path / "relay.toml"
    path.write_text(
        '[listen]\naddress = "127.0.0.1:8443"\n'
        'tls_cert = "/nonexistent/relay/cert.pem"\ntls_key = "/nonexistent/relay/key.pem"\n'
        "[process]\nworkers = 2\n"
    )
    (tmp_path / "routes.json").write_text('{"routes": []}')
    assert main(["check-config", "--offline", "--config", str(path)]) == 0, capsys.readouterr()
    assert main(["check-config", "--config", str(path)]) == 2  # online, they are checked


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_redis_password_file_that_is_not_utf8_is_a_config_error(
    tmp_path: Path, command: str
) -> None:
    """SPEC §6-7: a bad configuration stops with one line naming the key, exit 2 (which the
    unit does not restart). A password file that is not UTF-8 text ended both commands in a
    UnicodeDecodeError traceback, exit 1 (serve: restarted every 2 s by Restart=)."""
    secret = b"s3cret-\xff\xfe"
    (tmp_path / "redis-password").write_bytes(secret + b"\n")
    line, output = _one_config_error(
        tmp_path,
        command,
        'redis_url = "redis://127.0.0.1:1/0"\nredis_password_file = "redis-password"',
    )
    assert line.startswith("relay: config error: routes.redis_password_file: ")
    assert "s3cret" not in output


def _one_config_error(tmp_path: Path, command: str, redis: str) -> tuple[str, str]:
    """Run ``relay <command>`` on a Redis-fed config with ``redis`` lines in [routes]: it must
    exit 2 with one line on stderr and no traceback. The line, and all the process printed."""
    path = tmp_path / "relay.toml"
    path.write_text(
        '[listen]\naddress = "127.0.0.1:0"\n[admin]\naddress = "127.0.0.1:0"\n'
        f'[routes]\nsource = "redis"\n{redis}\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "relay", command, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    return line, done.stderr + done.stdout


@pytest.mark.parametrize("command", ["check-config", "serve"])
@pytest.mark.parametrize("content", [b"not a certificate\n", b""], ids=["junk", "empty"])
def test_a_redis_ca_file_without_a_certificate_is_a_config_error(
    tmp_path: Path, command: str, content: bytes
) -> None:
    """A CA file that holds no certificate passed check-config and start-up; serve then
    retried the TLS connection for ever with an X509 error and never became ready (found by
    review). OpenSSL now loads it when the config is checked, as it will for each connection."""
    (tmp_path / "ca.pem").write_bytes(content)
    line, _ = _one_config_error(
        tmp_path, command, 'redis_url = "rediss://127.0.0.1:1/0"\nredis_ca_file = "ca.pem"'
    )
    assert line.startswith("relay: config error: routes.redis_ca_file: "), line
