"""Is a certificate and key pair acceptable for these routing domains at this time?"""

from __future__ import annotations

import datetime
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from relay.__main__ import main
from relay.config_parse import load, parse
from relay.runtime import Relay
from relay.tlscheck import (
    TLSCheckError,
    check_files,
    load_files,
    problems,
    uncovered_domains,
)
from tests.support.certs import Issued, issue
from tests.support.harness import DOMAIN, config_data, serve_until_exit, to_toml, write_routes

NOW = datetime.datetime.now(datetime.UTC)


@pytest.mark.parametrize(
    ("names", "domains", "missing"),
    [
        (["*.e2b.test"], ["e2b.test"], []),
        (["*.E2B.test."], ["e2b.test"], []),  # case and a trailing dot do not matter
        (["e2b.test"], ["e2b.test"], ["e2b.test"]),  # the bare domain is not the wildcard
        (["*.test"], ["e2b.test"], ["e2b.test"]),  # one label only (RFC 6125 §6.4.3)
        (["49983-abc.e2b.test"], ["e2b.test"], ["e2b.test"]),
        (["*.a.test", "*.b.test"], ["a.test", "b.test"], []),
        (["*.a.test"], ["a.test", "b.test"], ["b.test"]),
        ([], ["e2b.test"], ["e2b.test"]),
    ],
    ids=["wildcard", "case-dot", "bare", "too-broad", "one-host", "two", "one-of-two", "no-san"],
)
def test_wildcard_coverage(names: list[str], domains: list[str], missing: list[str]) -> None:
    assert uncovered_domains(names, domains) == missing


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    base = tmp_path_factory.mktemp("pki")
    return {
        "good": issue(base, [f"*.{DOMAIN}", DOMAIN], prefix="good"),
        "other": issue(base, [f"*.{DOMAIN}"], prefix="other"),
        "expired": issue(base, [f"*.{DOMAIN}"], not_after_days=-1, not_before_days=-3, prefix="x"),
        "future": issue(base, [f"*.{DOMAIN}"], not_before_days=1, prefix="future"),
        "narrow": issue(base, [DOMAIN, f"api.{DOMAIN}"], prefix="narrow"),
    }


def _problems(cert_of: Issued, key_of: Issued, domains: list[str]) -> list[str]:
    cert, _ = load_files(cert_of.cert_file, cert_of.key_file)
    _, key = load_files(key_of.cert_file, key_of.key_file)
    return problems(cert, key, domains, NOW)


def test_a_good_pair_has_no_problem(pki: dict[str, Issued]) -> None:
    assert _problems(pki["good"], pki["good"], [DOMAIN]) == []
    info = check_files(pki["good"].cert_file, pki["good"].key_file, [DOMAIN])
    assert f"*.{DOMAIN}" in info.dns_names
    assert info.not_before < NOW < info.not_after


@pytest.mark.parametrize(
    ("cert", "key", "expected"),
    [
        ("good", "other", "listen.tls_key: the private key does not match the certificate"),
        ("expired", "expired", "listen.tls_cert: the certificate expired on"),
        ("future", "future", "listen.tls_cert: the certificate is not valid before"),
        ("narrow", "narrow", f"listen.tls_cert: subjectAltName does not cover *.{DOMAIN}"),
    ],
    ids=["key-mismatch", "expired", "not-yet-valid", "san-not-covering"],
)
def test_each_problem_is_named(pki: dict[str, Issued], cert: str, key: str, expected: str) -> None:
    (found,) = _problems(pki[cert], pki[key], [DOMAIN])
    assert found.startswith(expected)


def test_a_second_domain_must_be_covered_too(pki: dict[str, Issued]) -> None:
    (found,) = _problems(pki["good"], pki["good"], [DOMAIN, "other.dev"])
    assert "*.other.dev" in found
    assert f"*.{DOMAIN}" in found  # the message lists what the certificate has


def test_unreadable_and_unusable_files(tmp_path: Path, pki: dict[str, Issued]) -> None:
    good = pki["good"]
    with pytest.raises(TLSCheckError, match=r"^listen\.tls_cert: cannot read"):
        check_files(tmp_path / "nope.pem", good.key_file, [DOMAIN])
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem\n")
    with pytest.raises(TLSCheckError, match=r"^listen\.tls_cert: .* holds no PEM certificate"):
        check_files(garbage, good.key_file, [DOMAIN])
    with pytest.raises(TLSCheckError, match=r"^listen\.tls_key: .* holds no usable PEM"):
        check_files(good.cert_file, garbage, [DOMAIN])
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(TLSCheckError, match=r"^listen\.tls_key: .* is encrypted"):
        check_files(good.cert_file, encrypted, [DOMAIN])


async def test_relay_refuses_to_start_on_a_bad_pair(tmp_path: Path, pki: dict[str, Issued]) -> None:
    bad = pki["expired"]
    overrides = {"listen": {"tls_cert": str(bad.cert_file), "tls_key": str(bad.key_file)}}
    relay = Relay(parse(config_data(tmp_path, overrides), base_dir=tmp_path))
    with pytest.raises(TLSCheckError, match="expired"):
        await relay.start()
    assert relay.bound == []  # nothing was listening


def test_serve_exits_2_naming_the_key(tmp_path: Path, pki: dict[str, Issued]) -> None:
    bad = pki["narrow"]
    write_routes(tmp_path / "routes.json", [])
    overrides = {"listen": {"tls_cert": str(bad.cert_file), "tls_key": str(bad.key_file)}}
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(config_data(tmp_path, overrides)))
    result = serve_until_exit(config)
    assert result.returncode == 2, result.stderr
    assert f"relay: config error: listen.tls_cert: subjectAltName does not cover *.{DOMAIN}" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def _unsupported_key(path: Path) -> Path:
    """An EC key on secp112r1: PEM that cryptography refuses with UnsupportedAlgorithm, which
    is not a ValueError (made by the openssl CLI, as cryptography cannot make one)."""
    subprocess.run(
        ["openssl", "ecparam", "-name", "secp112r1", "-genkey", "-noout", "-out", str(path)],
        check=True,
        capture_output=True,
    )
    return path


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@needs_openssl
def test_a_key_of_an_unsupported_type_is_named(tmp_path: Path, pki: dict[str, Issued]) -> None:
    """Found by review: it escaped as a traceback (exit 2 expected, naming the key)."""
    key = _unsupported_key(tmp_path / "odd.key")
    with pytest.raises(TLSCheckError, match=r"listen\.tls_key: .* unsupported key type"):
        check_files(pki["good"].cert_file, key, [DOMAIN])


@needs_openssl
async def test_a_reload_with_such_a_key_keeps_the_certificate_and_the_rest(
    tmp_path: Path, pki: dict[str, Issued], caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: on SIGHUP it escaped the reload, whose other settings were dropped,
    and neither counted nor said why."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["good"].cert_file, cert)
    shutil.copy(pki["good"].key_file, key)
    write_routes(tmp_path / "routes.json", [])
    data = config_data(tmp_path, {"listen": {"tls_cert": str(cert), "tls_key": str(key)}})
    (tmp_path / "relay.toml").write_text(to_toml(data))
    relay = Relay(load(tmp_path / "relay.toml"))
    await relay.start()
    try:
        _unsupported_key(key)
        data["listen"]["max_header_bytes"] = 8192
        (tmp_path / "relay.toml").write_text(to_toml(data))
        with caplog.at_level(logging.ERROR):
            relay.reload()
        assert "TLS reload failed, keeping the current certificate" in caplog.text
        assert relay.observer.tls_reloads["error"] == 1
        assert relay.config.listen.max_header_bytes == 8192
    finally:
        await relay.stop()


def _weak_rsa_pair(directory: Path) -> tuple[Path, Path]:
    """A pair every check of relay.tlscheck passes but OpenSSL refuses at its default security
    level (2): an RSA key under 2048 bits ("ee key too small")."""
    pair = issue(directory / "weak", [f"*.{DOMAIN}"], key=rsa.generate_private_key(65537, 1024))
    return pair.cert_file, pair.key_file


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_a_pair_openssl_refuses_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Found by review: check-config passed it (exit 0) and serve stopped on a traceback from
    load_cert_chain (exit 1, so Restart=on-failure looped)."""
    cert, key = _weak_rsa_pair(tmp_path)
    write_routes(tmp_path / "routes.json", [])
    overrides = {"listen": {"tls_cert": str(cert), "tls_key": str(key)}}
    config = tmp_path / "relay.toml"
    config.write_text(to_toml(config_data(tmp_path, overrides)))
    if command == "serve":
        result = serve_until_exit(config)
        code, err = result.returncode, result.stderr
    else:
        code, err = main(["check-config", "--config", str(config)]), capsys.readouterr().err
    assert code == 2, err
    assert "relay: config error: listen.tls_cert: " in err
    assert "key too small" in err
    assert "Traceback" not in err
