"""Strict configuration (SPEC §6): unknown keys and wrong types name the key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relay.__main__ import _parser, log_level, main, redacted
from relay.addresses import split_address
from relay.config import ConfigError
from relay.config_parse import load, parse
from tests.support.harness import serve_until_exit
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_default_config_loads() -> None:
    config = load(ROOT / "config" / "relay.toml")
    assert config.listen.addresses == ["127.0.0.1:8080"]
    assert config.path(config.routes.file) == ROOT / "config" / "routes.json"
    assert config.settings().strip


@pytest.mark.parametrize(
    ("upstream", "host"),
    [
        ("http://127.0.0.1:3000", b"127.0.0.1:3000"),
        ("http://[::1]/", b"[::1]"),
        ("http://api.internal:3000", b"api.internal:3000"),
        ("", b""),
    ],
)
def test_management_host_is_the_upstream_authority(upstream: str, host: bytes) -> None:
    """The Host an HTTP/1.0 management request without one is forwarded with (relay.core)."""
    config = parse({"management": {"upstream": upstream}}, ROOT)
    assert config.settings().management_host == host


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"listen": {"adress": "x"}}, "listen.adress"),
        ({"listen": {"max_connections": "10"}}, "listen.max_connections"),
        ({"listen": {"max_connections": True}}, "listen.max_connections"),
        ({"listen": {"address": 8080}}, "listen.address"),
        ({"listen": {"address": "nohostport"}}, "listen.address[0]"),
        # int() raises ValueError past 4,300 digits (found by review)
        ({"listen": {"address": "127.0.0.1:" + "0" * 5000}}, "listen.address[0]"),
        ({"admin": {"address": "127.0.0.1:" + "9" * 5000}}, "admin.address"),
        # Not a host: serve stopped with "cannot listen ...: Unknown error -2", exit 1 (so
        # Restart=on-failure looped), and check-config passed it (found by review).
        ({"listen": {"address": "exa mple:8080"}}, "listen.address[0]"),
        ({"listen": {"address": "[zz]:8080"}}, "listen.address[0]"),
        ({"listen": {"address": "[127.0.0.1]:8080"}}, "listen.address[0]"),
        # IPv4-mapped: an IPv6 listener is v6-only, so serve stopped with "cannot listen ...:
        # Invalid argument", exit 1, which Restart=on-failure repeats (found by review).
        ({"listen": {"address": ["[::1]:0", "[::ffff:127.0.0.1]:8080"]}}, "listen.address[1]"),
        ({"admin": {"address": "::ffff:10.0.0.1:9090"}}, "admin.address"),
        ({"admin": {"address": "user@127.0.0.1:9090"}}, "admin.address"),
        (
            {"routes": {"source": "redis", "redis_url": "redis://[::1:6379/0"}},
            "routes.redis_url",
        ),
        ({"listen": {"tls_cert": "a.pem"}}, "listen.tls_key"),
        ({"listen": {"trusted_proxies": ["nope"]}}, "listen.trusted_proxies[0]"),
        ({"upstream": {"credentials": "maybe"}}, "upstream.credentials"),
        ({"upstream": {"denied_ports": [0]}}, "upstream.denied_ports[0]"),
        ({"upstream": {"denied_ports": ["1"]}}, "upstream.denied_ports[0]"),
        ({"upstream": {"source_address": "nope"}}, "upstream.source_address"),
        # One family only can be dialled from a source address: with none of its family in
        # allowed_cidrs no route could be, nor an IP management upstream of the other one
        # (found by review: serve started, every dial 502 "dial: Invalid argument").
        (
            {"upstream": {"source_address": "::1", "allowed_cidrs": ["127.0.0.0/8"]}},
            "upstream.source_address",
        ),
        (
            {"upstream": {"source_address": "10.0.0.1", "allowed_cidrs": ["fc00::/7"]}},
            "upstream.source_address",
        ),
        (
            {"upstream": {"source_interface": "br0", "allowed_cidrs": ["fd00::/8"]}},
            "upstream.source_interface",
        ),
        (
            {
                "upstream": {"source_address": "::1"},
                "management": {"upstream": "http://127.0.0.1:3000"},
            },
            "upstream.source_address",
        ),
        ({"routes": {"source": "etcd"}}, "routes.source"),
        ({"routes": {"source": "redis"}}, "routes.redis_url"),
        ({"management": {"upstream": "https://x"}}, "management.upstream"),
        # Not a host: relay dialled "user:pw@10.0.0.1" (every API request 502) and
        # check-config printed the password (found by review).
        ({"management": {"upstream": "http://user:pw@10.0.0.1:3000"}}, "management.upstream"),
        ({"management": {"upstream": "http://exa mple:80"}}, "management.upstream"),
        ({"management": {"upstream": "http://[zz]:80"}}, "management.upstream"),
        ({"management": {"upstream": "http://::1:3000"}}, "management.upstream"),
        ({"management": {"upstream": "http://10.0.0.1:0"}}, "management.upstream"),
        ({"process": {"workers": 0}}, "process.workers"),
        # Found by review: serve built a list of that many workers until the OOM killer came
        # (exit 137, no message) and check-config passed it.
        ({"process": {"workers": 9223372036854775807}}, "process.workers"),
        ({"process": {"workers": 1025}}, "process.workers"),
        ({"nosuch": {}}, "nosuch"),
        # A domain no Host can end with (a port, a wildcard, a scheme, empty): relay started
        # and answered every Host-form request as if it named no sandbox (found by review).
        ({"routing": {"domains": ["example.com:443"]}}, "routing.domains[0]"),
        ({"routing": {"domains": ["ok.test", "*.example.com"]}}, "routing.domains[1]"),
        ({"routing": {"domains": ["https://example.com"]}}, "routing.domains[0]"),
        ({"routing": {"domains": [""]}}, "routing.domains[0]"),
        ({"routing": {"domains": ["."]}}, "routing.domains[0]"),
        ({"routing": {"domains": ["a..b"]}}, "routing.domains[0]"),
        ({"routing": {"domains": ["exa mple.com"]}}, "routing.domains[0]"),
        ({"routing": {"domains": ["b\u00fccher.de"]}}, "routing.domains[0]"),
        ({"listen": []}, "listen"),
    ],
)
def test_bad_config_names_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(data)
    assert str(info.value).startswith(key + ":")


@pytest.mark.parametrize(
    ("toml", "line"),
    [
        # listen.address is a string or a list: the element's own error, not the union's
        # ("listen.address: expected str | list[str], got list", found by review).
        (
            '[listen]\naddress = ["127.0.0.1:8080", 8081]\n',
            "listen.address[1]: expected str, got int",
        ),
        (
            '[listen]\naddress = ["127.0.0.1:8080", "127.0.0.1"]\n',
            "listen.address[1]: bad address '127.0.0.1': write host:port, an IPv6 host in brackets "
            "([::1]:8080)",
        ),
        # The value out of range, not only its place.
        (
            "[upstream]\ndenied_ports = [50090, 70000]\n",
            "upstream.denied_ports[1]: must be a port number (1-65535), got 70000",
        ),
        (
            '[upstream]\nallowed_cidrs = ["10.0.0.0/8", "10.0.0.0/33"]\n',
            "upstream.allowed_cidrs[1]: not a CIDR: '10.0.0.0/33'",
        ),
    ],
)
def test_a_bad_list_element_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, line: str
) -> None:
    path = tmp_path / "relay.toml"
    path.write_text(toml)
    assert main(["check-config", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"relay: config error: {line}\n"


@pytest.mark.parametrize(
    "upstream",
    [
        {"source_address": "::1"},  # the default allowed_cidrs hold both families
        {"source_address": "fd00::1", "allowed_cidrs": ["fc00::/7"]},
        {"source_address": "10.0.0.1", "allowed_cidrs": ["10.0.0.0/8", "fc00::/7"]},
        {"source_interface": "br0", "allowed_cidrs": ["10.0.0.0/8"]},
    ],
)
def test_a_source_address_with_routes_of_its_family_is_accepted(upstream: dict[str, Any]) -> None:
    parse({"upstream": upstream, "management": {"upstream": "http://relay-api.internal:3000"}})


def test_domains_in_any_case_and_with_a_root_dot_are_accepted() -> None:
    config = parse({"routing": {"domains": ["Sandbox.Example.COM.", "e2b-1.local"]}})
    assert config.settings().domains == ("sandbox.example.com", "e2b-1.local")


@pytest.mark.parametrize(
    ("section", "address"),
    [
        ("listen", "[::1:8080"),
        ("listen", "::1]:8080"),
        ("listen", "[::1]"),
        ("listen", "[::1]:"),
        ("listen", "[::1]:65536"),
        ("admin", "::1"),
        # Unbracketed: fd00::1 port 2, or fd00::1:2 with no port? Refused (nginx too).
        ("listen", "::1:8080"),
        ("listen", "fd00::1:2"),
        ("admin", "::1:9090"),
        ("admin", "[fe80::1]x:80"),
    ],
)
def test_a_malformed_ipv6_address_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str, address: str
) -> None:
    """The line names the key and the value, and says the form (review E: admin.address said
    only "bad address", and neither said that IPv6 goes in brackets)."""
    path = tmp_path / "relay.toml"
    path.write_text(f'[{section}]\naddress = "{address}"\n')
    assert main(["check-config", "--offline", "--config", str(path)]) == 2
    key = "listen.address[0]" if section == "listen" else "admin.address"
    assert capsys.readouterr().err.splitlines() == [
        f"relay: config error: {key}: bad address {address!r}: write host:port, an IPv6 host "
        "in brackets ([::1]:8080)"
    ]


@pytest.mark.parametrize(
    ("listen", "admin", "key"),
    [
        (["127.0.0.1:8080", "127.0.0.1:8080"], "127.0.0.1:9090", "listen.address[1]"),
        (["[::1]:8080", "[0:0::1]:8080"], "127.0.0.1:9090", "listen.address[1]"),
        (["0.0.0.0:8080", "127.0.0.1:8080"], "127.0.0.1:9090", "listen.address[1]"),
        (["127.0.0.1:8080"], "127.0.0.1:8080", "admin.address"),
        (["[::]:8080"], "[::1]:8080", "admin.address"),
    ],
)
def test_an_address_used_twice_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], listen: list[str], admin: str, key: str
) -> None:
    """Found by review: relay bound the first and then stopped on its own port with exit 1
    "Address already in use" (so Restart=on-failure looped), and check-config passed it."""
    with pytest.raises(ConfigError) as info:
        parse({"listen": {"address": listen}, "admin": {"address": admin}})
    assert str(info.value).startswith(key + ":")
    path = tmp_path / "relay.toml"
    quoted = ", ".join(f'"{a}"' for a in listen)
    path.write_text(f'[listen]\naddress = [{quoted}]\n[admin]\naddress = "{admin}"\n')
    assert main(["check-config", "--offline", "--config", str(path)]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        (["127.0.0.1:0", "127.0.0.1:0"], "127.0.0.1:0"),  # each gets a port of its own
        (["127.0.0.1:8080", "127.0.0.2:8080"], "127.0.0.1:9090"),
        (["0.0.0.0:8080", "[::]:8080"], "127.0.0.1:9090"),  # IPv6 listeners are v6-only
    ],
)
def test_distinct_addresses_are_accepted(listen: list[str], admin: str) -> None:
    parse({"listen": {"address": listen}, "admin": {"address": admin}})


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("127.0.0.1:8080", "127.0.0.1"),
        ("[::1]:8080", "::1"),
        ("localhost:8080", "localhost"),
        ("relay-1.internal.:8080", "relay-1.internal."),
    ],
)
def test_listen_hosts_accepted(address: str, host: str) -> None:
    config = parse({"listen": {"address": address}})
    assert split_address(config.listen.addresses[0]) == (host, 8080)


def test_ints_are_accepted_as_floats() -> None:
    config = parse({"listen": {"header_timeout_s": 3}})
    assert config.listen.header_timeout_s == 3.0


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[routes]\nsource = "redis"\nredis_url = "redis://relay:s3cret@127.0.0.1:6379/0"\n'
    )
    assert main(["check-config", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    assert "<redacted>" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[listen]\nmax_connections = 'many'\n")
    assert main(["check-config", "--config", str(bad)]) == 2
    assert "listen.max_connections" in capsys.readouterr().err


def test_redacted_keeps_non_secrets() -> None:
    config = parse({"routes": {"redis_url": "redis://127.0.0.1:6379"}})
    assert redacted(config)["routes"]["redis_url"] == "redis://127.0.0.1:6379"


def test_cli_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relay", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("relay ")


def test_refuses_to_start_on_the_pure_python_parser(tmp_path: Path) -> None:
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = tmp_path / "relay.toml"
    config.write_text('[listen]\naddress = "127.0.0.1:0"\n[admin]\naddress = "127.0.0.1:0"\n')
    env = {"AIOHTTP_NO_EXTENSIONS": "1", "PATH": "/usr/bin:/bin"}
    result = serve_until_exit(config, timeout=20, env=env)
    assert result.returncode == 1
    assert "pure-Python HTTP parser" in result.stderr


@pytest.mark.parametrize(
    ("taken", "workers"),
    [("listen.address", 1), ("admin.address", 1), ("listen.address", 2), ("admin.address", 2)],
)
def test_a_taken_port_stops_serve_with_one_line(tmp_path: Path, taken: str, workers: int) -> None:
    # Held by a listener, so no SO_REUSEADDR can share it (the CI failure: EADDRINUSE on bind).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = {"listen.address": free_port(), "admin.address": free_port(), taken: busy}
        (tmp_path / "routes.json").write_text('{"routes": []}')
        config = tmp_path / "relay.toml"
        config.write_text(
            f'[listen]\naddress = "127.0.0.1:{ports["listen.address"]}"\n'
            f'[admin]\naddress = "127.0.0.1:{ports["admin.address"]}"\n'
            f"[process]\nworkers = {workers}\n"
        )
        result = serve_until_exit(config, timeout=30)
    assert result.returncode == 1, result.stderr
    line = f"relay: cannot start: cannot listen on {taken} 127.0.0.1:{busy}: Address already in use"
    assert line in result.stderr.splitlines()
    assert "Traceback" not in result.stderr


def test_a_name_that_does_not_resolve_says_so(tmp_path: Path) -> None:
    """Found by review: the getaddrinfo error was printed as "Unknown error -2" (its errno is
    an EAI_* code, which os.strerror does not know)."""
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = tmp_path / "relay.toml"
    config.write_text(
        '[listen]\naddress = "no-such-host.invalid:8080"\n[admin]\naddress = "127.0.0.1:0"\n'
    )
    result = serve_until_exit(config, timeout=30)
    assert result.returncode == 1, result.stderr
    assert "Unknown error" not in result.stderr
    line = "relay: cannot start: cannot listen on listen.address no-such-host.invalid:8080: "
    assert any(
        text.startswith(line) and len(text) > len(line) for text in result.stderr.splitlines()
    )


def test_allocator_is_tuned_on_glibc() -> None:
    from relay.startup import tune_allocator

    assert tune_allocator() is True  # this machine runs glibc (Debian)


def test_gc_is_kept_off_the_request_path() -> None:
    # In a subprocess: the test process's own collector is pytest's business.
    code = (
        "import gc; from relay.startup import tune_gc; tune_gc(); "
        "print(gc.get_threshold()[0], gc.get_freeze_count() > 1000)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert result.stdout.split() == ["10000", "True"]


@pytest.mark.parametrize("how", ["option", "environment"])
def test_an_unknown_log_level_is_a_usage_error(tmp_path: Path, how: str) -> None:
    """``--log-level`` (or ``$RELAY_LOG_LEVEL``, its default) naming no level ended ``relay
    serve`` in logging's ValueError: a traceback and exit 1, which the unit's
    ``Restart=on-failure`` retries for ever (exit 2 is the usage error it does not retry)."""
    (tmp_path / "routes.json").write_text('{"routes": []}')
    config = tmp_path / "relay.toml"
    config.write_text('[listen]\naddress = "127.0.0.1:0"\n[admin]\naddress = "127.0.0.1:0"\n')
    command = [sys.executable, "-m", "relay", "serve", "--config", str(config)]
    env = dict(os.environ)
    if how == "option":
        command += ["--log-level", "verbose"]
    else:
        env["RELAY_LOG_LEVEL"] = "verbose"
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=30, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("relay: ")
    assert "--log-level: unknown level 'verbose'" in line


@pytest.mark.parametrize("level", ["debug", "WARNING", "warn", "Error"])
def test_log_levels_in_any_case_are_taken(level: str) -> None:
    args = _parser().parse_args(["serve", "--config", "x.toml", "--log-level", level])
    assert log_level(args.log_level) == level.upper()


def test_an_empty_relay_log_level_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Environment=RELAY_LOG_LEVEL=`` in a unit (or ``RELAY_LOG_LEVEL= relay serve``) means
    "not set", as an empty variable does for most programs: INFO, not a usage error (exit 2,
    which the unit does not retry; found by review of the check of the level)."""
    monkeypatch.setenv("RELAY_LOG_LEVEL", "")
    args = _parser().parse_args(["serve", "--config", "x.toml"])
    assert log_level(args.log_level) == "INFO"


def test_workers_do_not_share_a_port_another_relay_listens_on(tmp_path: Path) -> None:
    """A port another relay's workers listen on (SO_REUSEPORT, same user) was joined silently
    by a second relay with workers: both served it, the kernel splitting new connections
    between two configurations and route tables, where a single relay stops with "Address
    already in use" (exit 1). Seen by hand: two supervisors on one data port, four listeners."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a worker binds
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        (tmp_path / "routes.json").write_text('{"routes": []}')
        config = tmp_path / "relay.toml"
        config.write_text(
            f'[listen]\naddress = "127.0.0.1:{busy}"\n'
            f'[admin]\naddress = "127.0.0.1:{free_port()}"\n'
            "[process]\nworkers = 2\n"
        )
        try:
            result = serve_until_exit(config, timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("relay's workers joined the port another relay listens on")
    assert result.returncode == 1, result.stderr
    taken = f"cannot listen on listen.address 127.0.0.1:{busy}: Address already in use"
    assert f"relay: cannot start: {taken}" in result.stderr.splitlines()
    assert "Traceback" not in result.stderr


def test_output_into_a_pipe_nobody_reads_ends_quietly() -> None:
    """``relay check-config | head -3`` (or ``routes list``, ``sign-url``): the reader left
    before relay wrote. A traceback and exit 1 (found by review); now no message and the exit
    status of a Unix tool killed by SIGPIPE, 128 + 13, as cat or grep give."""
    config = str(ROOT / "config" / "relay.toml")
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: every write gets EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relay", "check-config", "--offline", "--config", config],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode == 141
