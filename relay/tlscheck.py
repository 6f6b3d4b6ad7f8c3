"""Is a certificate and key pair fit to serve ``*.<domain>`` for every routing domain, now?

Checked at start (a bad pair stops relay with exit 2, naming ``listen.tls_cert``) and before a
SIGHUP swaps the pair (a bad new pair keeps the old one; the log says why):

- the private key belongs to the leaf certificate (same public key);
- the leaf is in date (``notBefore <= now <= notAfter``);
- its subjectAltName DNS entries cover ``*.<domain>`` for each ``routing.domains`` entry. The
  SDK's host form is ``<port>-<id>.<domain>``, one label under the domain, so only the
  wildcard itself covers every sandbox (RFC 6125 §6.4.3: a wildcard matches one label, so
  ``*.dev`` does not cover ``*.e2b.dev``). The subject CN is ignored, as browsers and
  Python's ``ssl`` do.

:func:`problems` is pure (certificate, key, domains and clock in; reasons out); the file
reading is in :func:`load_files`. Chain validation against a trust store is the client's
business and is not repeated here.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from relay.config import ConfigError


class TLSCheckError(ConfigError):
    """The pair cannot be used; the message names ``listen.tls_cert`` or ``listen.tls_key``."""


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What relay reports about the certificate it serves (log lines, metrics)."""

    subject: str
    serial: int
    not_before: datetime.datetime
    not_after: datetime.datetime
    dns_names: tuple[str, ...]


def _normalise(name: str) -> str:
    return name.strip().lower().rstrip(".")


def dns_names(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return ()
    return tuple(_normalise(n) for n in san.value.get_values_for_type(x509.DNSName))


def uncovered_domains(names: Iterable[str], domains: Sequence[str]) -> list[str]:
    """The routing domains whose ``*.<domain>`` wildcard is not among the SAN ``names``."""
    have = {_normalise(n) for n in names}
    return [d for d in domains if f"*.{_normalise(d)}" not in have]


def _public_der(key: object) -> bytes:
    public_bytes = getattr(key, "public_bytes", None)
    if public_bytes is None:
        return b""
    der: bytes = public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return der


def key_matches(cert: x509.Certificate, key: PrivateKeyTypes) -> bool:
    return _public_der(cert.public_key()) == _public_der(key.public_key())


def problems(
    cert: x509.Certificate,
    key: PrivateKeyTypes,
    domains: Sequence[str],
    now: datetime.datetime | None,
) -> list[str]:
    """Every reason the pair is unfit, in the order an operator should fix them; ``now``
    None: the dates are not checked (a pair already being served, see check_pair)."""
    out = []
    if not key_matches(cert, key):
        out.append("listen.tls_key: the private key does not match the certificate")
    if now is not None and now < cert.not_valid_before_utc:
        out.append(
            f"listen.tls_cert: the certificate is not valid before "
            f"{cert.not_valid_before_utc.isoformat()}"
        )
    if now is not None and now > cert.not_valid_after_utc:
        out.append(
            f"listen.tls_cert: the certificate expired on {cert.not_valid_after_utc.isoformat()}"
        )
    missing = uncovered_domains(dns_names(cert), domains)
    if missing:
        wanted = ", ".join(f"*.{_normalise(d)}" for d in missing)
        have = ", ".join(dns_names(cert)) or "none"
        out.append(
            f"listen.tls_cert: subjectAltName does not cover {wanted} "
            f"(routing.domains; the certificate has DNS names: {have})"
        )
    return out


def info(cert: x509.Certificate) -> CertInfo:
    return CertInfo(
        subject=cert.subject.rfc4514_string(),
        serial=cert.serial_number,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        dns_names=dns_names(cert),
    )


def load_files(cert_file: Path, key_file: Path) -> tuple[x509.Certificate, PrivateKeyTypes]:
    """The leaf certificate (first in the chain file) and the private key."""
    return parse_pair(*read_pair(cert_file, key_file), cert_file, key_file)


def read_pair(cert_file: Path, key_file: Path) -> tuple[bytes, bytes]:
    """The two files' bytes, each read once."""
    try:
        cert_pem = cert_file.read_bytes()
    except OSError as exc:
        raise TLSCheckError(f"listen.tls_cert: cannot read {cert_file}: {exc.strerror}") from None
    try:
        key_pem = key_file.read_bytes()
    except OSError as exc:
        raise TLSCheckError(f"listen.tls_key: cannot read {key_file}: {exc.strerror}") from None
    return cert_pem, key_pem


def parse_pair(
    cert_pem: bytes, key_pem: bytes, cert_file: Path, key_file: Path
) -> tuple[x509.Certificate, PrivateKeyTypes]:
    """The leaf certificate and the private key from the files' bytes (the paths name them)."""
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise TLSCheckError(f"listen.tls_cert: {cert_file} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TLSCheckError(
            f"listen.tls_key: {key_file} is encrypted (relay needs it in clear)"
        ) from None
    except ValueError:
        # Never echo the file's content: it is a secret.
        raise TLSCheckError(f"listen.tls_key: {key_file} holds no usable PEM private key") from None
    except UnsupportedAlgorithm:
        # Not a ValueError: it escaped start-up as a traceback, and a SIGHUP as a reload that
        # was neither applied nor counted (found by review: an EC key on secp112r1).
        raise TLSCheckError(f"listen.tls_key: {key_file} uses an unsupported key type") from None
    try:
        chain[0].public_key()
    except (UnsupportedAlgorithm, ValueError):
        raise TLSCheckError(
            f"listen.tls_cert: {cert_file} holds a key of an unsupported type"
        ) from None
    return chain[0], key


def check_files(
    cert_file: Path,
    key_file: Path,
    domains: Sequence[str],
    now: datetime.datetime | None = None,
) -> CertInfo:
    """Load and check a pair; raises :class:`TLSCheckError` with every problem found."""
    return check_pair(*read_pair(cert_file, key_file), cert_file, key_file, domains, now)


def check_pair(
    cert_pem: bytes,
    key_pem: bytes,
    cert_file: Path,
    key_file: Path,
    domains: Sequence[str],
    now: datetime.datetime | None = None,
    *,
    dates: bool = True,
) -> CertInfo:
    """:func:`check_files` on bytes already read (the bytes that will be served).

    ``dates=False`` for a pair that relay already serves (a restarted worker's copy of its
    siblings' pair): its dates were checked when it was loaded, and refusing it once it has
    expired would not stop the siblings serving it, only keep the worker from coming back.
    """
    cert, key = parse_pair(cert_pem, key_pem, cert_file, key_file)
    found = problems(
        cert, key, domains, (now or datetime.datetime.now(datetime.UTC)) if dates else None
    )
    if found:
        raise TLSCheckError("; ".join(found))
    return info(cert)
