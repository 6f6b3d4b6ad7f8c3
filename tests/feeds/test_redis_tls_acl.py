"""``rediss://`` with a CA made at test time, and the read-only ACL user of docs/route-feed.md.

The ACL line below is the one the documentation gives control-plane authors; this test is
what verifies it: the relay loads, follows, notices a trim and resyncs with exactly these
rights, Redis logs no denied command for it, and the same identity cannot write or read
outside its prefix. The password comes from a file (and, for the CLI, the environment) and
never appears in a log line.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from redis.exceptions import NoPermissionError

from relay.__main__ import main
from tests.feeds.helpers import dumps, put, redis_feed, relay_config, route, start_relay, wait_for
from tests.feeds.redisproc import RedisProcess, redis_server_path

pytestmark = pytest.mark.slow

# The documented ACL rules for the relay's identity (docs/route-feed.md), prefix "relay:".
RELAY_ACL = (
    "resetkeys %R~relay:* resetchannels -@all "
    "+auth +hello +ping +multi +exec +hgetall +xread +xinfo|stream"
)
# The documented rules for a control-plane (writer) identity.
WRITER_ACL = (
    "resetkeys ~relay:* resetchannels -@all "
    "+auth +hello +ping +multi +exec +hset +hdel +hgetall +xadd +xtrim"
)


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 signed by it (EC P-256, 1 day)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


@dataclass(frozen=True)
class TlsRedis:
    server: RedisProcess
    tls: TlsFiles
    password: str

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.server.port}"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    if redis_server_path() is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    directory = tmp_path / "redis-tls"
    directory.mkdir()
    tls = make_tls(directory)
    password = secrets.token_hex(16)
    server = RedisProcess(directory)
    server.config_lines = [
        "port 0",
        f"tls-port {server.port}",
        f"tls-cert-file {tls.cert}",
        f"tls-key-file {tls.key}",
        f"tls-ca-cert-file {tls.ca}",
        "tls-auth-clients no",
        "user default on nopass ~* &* +@all",  # the control plane, in this test
        f"user relay on >{password} {RELAY_ACL}",
        f"user control-plane on >{password}-cp {WRITER_ACL}",
    ]
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS support: {exc}")
        raise
    try:
        yield TlsRedis(server, tls, password)
    finally:
        server.stop()


def client_for(
    tls_redis: TlsRedis, username: str | None = None, password: str | None = None
) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        tls_redis.url,
        protocol=2,
        ssl_ca_certs=str(tls_redis.tls.ca),
        username=username,
        password=password,
    )


async def test_feed_over_tls_as_the_read_only_acl_user(
    tmp_path: Path, tls_redis: TlsRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password_file = tmp_path / "redis-password"
    password_file.write_text(tls_redis.password + "\n")
    writer = client_for(tls_redis)
    relay_identity = client_for(tls_redis, username="relay", password=tls_redis.password)
    try:
        await writer.hset("relay:routes", "first", dumps(route("first")))
        relay = await start_relay(
            relay_config(
                tmp_path,
                tls_redis.url,
                redis_username="relay",
                redis_password_file=str(password_file),
                redis_ca_file=str(tls_redis.tls.ca),
            ),
            block_ms=200,
        )
        feed = redis_feed(relay)
        try:
            await wait_for(lambda: relay.feed_state.ready, 5, "the first table over TLS")
            assert relay.table.get("first") is not None
            await put(writer, route("second"))
            await wait_for(lambda: relay.table.get("second") is not None, 2, "a followed put")
            # Lose entries on purpose: the gap check (XINFO in MULTI) and the resync (HGETALL)
            # must work with the same rights.
            async with writer.pipeline(transaction=True) as pipe:
                pipe.hset("relay:routes", "third", dumps(route("third")))
                pipe.xadd("relay:routes:events", {"op": "put", "id": "third", "route": "{}"})
                pipe.xtrim("relay:routes:events", maxlen=0, approximate=False)
                await pipe.execute()
            await wait_for(lambda: relay.table.get("third") is not None, 3, "the resync")
            relay.reload()  # SIGHUP resync
            await wait_for(lambda: feed.snapshots >= 3, 3, "the SIGHUP resync")
            assert feed.gaps == 1
            assert feed.failures == 0
        finally:
            await relay.stop()

        # Redis denied the relay nothing: the documented ACL is sufficient.
        denied = [e for e in await writer.acl_log() if e.get("username") == "relay"]
        assert denied == []
        # ... and it is read-only and confined to the prefix.
        with pytest.raises(NoPermissionError):
            await relay_identity.hset("relay:routes", "evil", "{}")
        with pytest.raises(NoPermissionError):
            await relay_identity.xadd("relay:routes:events", {"op": "delete", "id": "first"})
        with pytest.raises(NoPermissionError):
            await relay_identity.hgetall("other:routes")
        with pytest.raises(NoPermissionError):
            await relay_identity.keys("*")
    finally:
        await writer.aclose()
        await relay_identity.aclose()
    assert tls_redis.password not in caplog.text


async def test_wrong_password_is_a_feed_failure_and_never_logged(
    tmp_path: Path,
    tls_redis: TlsRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not-" + tls_redis.password
    monkeypatch.setenv("RELAY_TEST_REDIS_PASSWORD", wrong)
    relay = await start_relay(
        relay_config(
            tmp_path,
            tls_redis.url,
            redis_username="relay",
            redis_password_env="RELAY_TEST_REDIS_PASSWORD",
            redis_ca_file=str(tls_redis.tls.ca),
        ),
        backoff_cap_s=0.1,
    )
    try:
        await wait_for(lambda: redis_feed(relay).failures >= 2, 3, "failed attempts")
        assert not relay.feed_state.ready
        assert relay.observer.feed_errors == 1  # once per outage, not per attempt
    finally:
        await relay.stop()
    assert "WRONGPASS" in caplog.text or "invalid username-password" in caplog.text
    assert wrong not in caplog.text
    assert tls_redis.password not in caplog.text


def test_cli_over_tls_with_the_password_from_the_environment(
    tmp_path: Path,
    tls_redis: TlsRedis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``relay routes list`` works with the relay's own read-only identity; ``put`` needs a
    writer identity and fails cleanly (exit 1) with the read-only one."""
    monkeypatch.setenv("RELAY_TEST_REDIS_PASSWORD", tls_redis.password)
    config = tmp_path / "cli.toml"
    config.write_text(
        f'[routes]\nsource = "redis"\nredis_url = "{tls_redis.url}"\n'
        'redis_username = "relay"\nredis_password_env = "RELAY_TEST_REDIS_PASSWORD"\n'
        f'redis_ca_file = "{tls_redis.tls.ca}"\n'
    )
    route_file = tmp_path / "route.json"
    route_file.write_text(dumps(route("clitls")))
    assert main(["routes", "list", "--config", str(config)]) == 0
    assert '"routes": []' in capsys.readouterr().out
    assert main(["routes", "put", str(route_file), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "NOPERM" in err or "permission" in err.lower()
    assert tls_redis.password not in err


def test_cli_as_the_documented_control_plane_identity(
    tmp_path: Path,
    tls_redis: TlsRedis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``relay routes put/delete/list`` work with the writer ACL of docs/route-feed.md."""
    monkeypatch.setenv("RELAY_TEST_REDIS_PASSWORD", tls_redis.password + "-cp")
    config = tmp_path / "writer.toml"
    config.write_text(
        f'[routes]\nsource = "redis"\nredis_url = "{tls_redis.url}"\n'
        'redis_username = "control-plane"\nredis_password_env = "RELAY_TEST_REDIS_PASSWORD"\n'
        f'redis_ca_file = "{tls_redis.tls.ca}"\n'
    )
    route_file = tmp_path / "route.json"
    route_file.write_text(dumps(route("bycp")))
    assert main(["routes", "put", str(route_file), "--config", str(config)]) == 0
    assert main(["routes", "list", "--config", str(config)]) == 0
    assert '"sandbox_id": "bycp"' in capsys.readouterr().out
    assert main(["routes", "delete", "bycp", "--config", str(config)]) == 0
    assert "deleted bycp" in capsys.readouterr().out
