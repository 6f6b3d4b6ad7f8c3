"""Which sandbox and port a request is for (SPEC §1).

Two forms, checked in order:

1. the Host form ``<port>-<sandboxId>[-<ignored>...].<domain>``, which every SDK version uses
   for signed file URLs and which SDK 2.25's ``Sandbox.connect()`` relies on alone (it sends no
   routing headers: e2b-cookbook#103);
2. the header form ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port``, which SDKs >= 2.30 send on every
   envd request to ``https://sandbox.<domain>`` or to a fixed ``E2B_SANDBOX_URL``.

Unlike E2B's Go proxy, which silently ignores routing headers on a non-shared Host, relay
honours both and refuses a request whose two forms disagree: a request never goes to a
sandbox other than the one every part of it names.

One exception: ``api.<domain>`` is the control plane's own host, and a request to it is always
a management request, routing headers or not. SDK 2.25 put ``E2b-Sandbox-Id``/``-Port`` on its
control-plane ``POST /sandboxes/<id>/connect`` (E2B PR #1272); honouring them there would send
the SDK's API call to the sandbox's envd and break ``Sandbox.connect()`` on Harbor's pin.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import re

from relay.core.model import Reason, Reject, Target

_SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_PORT_LABEL = re.compile(r"[0-9]+-")
# RFC 3986 reg-name characters that can appear in a DNS name, plus the IPv6 literal form.
_REG_NAME = re.compile(r"[a-z0-9._~!$&'()*+,;=-]*")
_IPV6_LITERAL = re.compile(r"\[[0-9a-f:.]+\]")


def parse_port(text: str) -> int | None:
    """Decimal 1-65535, digits only, no sign, no leading zero (SPEC §1)."""
    if _PORT.fullmatch(text) is None:
        return None
    port = int(text)
    return port if port <= 65535 else None


def valid_sandbox_id(text: str) -> bool:
    return _SANDBOX_ID.fullmatch(text) is not None


def normalise_host(value: bytes) -> str | None:
    """Host without port and one trailing dot, lower-cased; None when it is not a host.

    RFC 9110 §7.2: ``Host = uri-host [ ":" port ]``.
    """
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        host, rest = text[: end + 1], text[end + 1 :]
        if _IPV6_LITERAL.fullmatch(host) is None or not _is_ipv6(host[1:-1]):
            return None
    else:
        host, colon, port = text.partition(":")
        rest = colon + port
    # ``port = *DIGIT`` (RFC 3986 §3.2.3), so an empty port after the colon is allowed.
    if rest and (rest[0] != ":" or not (rest[1:] == "" or rest[1:].isdigit())):
        return None
    if host.endswith("."):
        host = host[:-1]
    if not host or (not host.startswith("[") and _REG_NAME.fullmatch(host) is None):
        return None
    return host


def _is_ipv6(text: str) -> bool:
    """RFC 3986 §3.2.2: an IP-literal holds an IPv6 address (IPvFuture is not taken, nor a
    zone). The character class alone let ``[:]`` and ``[1.2.3.4]`` through as hosts, so they
    were answered "no sandbox" (or sent to the management upstream) where SPEC §5 says 400
    (found by review)."""
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


class ApiHost(enum.Enum):
    """The Host is ``api.<domain>``: a management request whatever its headers say."""

    API = "api"


API_HOST = ApiHost.API
API_LABEL = "api"

HostForm = Target | Reject | ApiHost | None


def target_from_host(host: str, domains: tuple[str, ...]) -> HostForm:
    """The Host form. ``domains`` are lower-case, longest first, so the most specific wins."""
    for domain in domains:
        if host == domain or not host.endswith(domain) or host[-len(domain) - 1] != ".":
            continue
        labels = host[: -len(domain) - 1]
        if "." in labels:
            return Reject(
                reason=Reason.BAD_HOST,
                detail=f"Invalid host: only one label may precede the domain {domain}",
            )
        if labels == API_LABEL:
            return API_HOST
        if _PORT_LABEL.match(labels) is None:
            return None  # sandbox.<domain> and other names: no target in the name
        parts = labels.split("-")
        port = parse_port(parts[0])
        if port is None:
            return Reject(reason=Reason.BAD_HOST, detail="Invalid sandbox port in host")
        if not valid_sandbox_id(parts[1]):
            return Reject(reason=Reason.BAD_HOST, detail="Invalid sandbox ID in host")
        return Target(parts[1], port)
    return None


def target_from_headers(
    ids: list[bytes] | None, ports: list[bytes] | None
) -> Target | Reject | None:
    """The header form; values are validated but, unlike the Host, not lower-cased."""
    if ids is None and ports is None:
        return None
    if ids is None or ports is None:
        missing = "E2b-Sandbox-Id" if ids is None else "E2b-Sandbox-Port"
        return Reject(reason=Reason.BAD_ROUTING_HEADER, detail=f"missing header {missing}")
    if len(ids) > 1 or len(ports) > 1:
        return Reject(reason=Reason.REPEATED_FIELD, detail="E2b-Sandbox-Id/Port is repeated")
    # Only spaces and tabs around a value (RFC 9110 §5.5), on the bytes: str.strip() of the
    # latin-1 text also took NBSP and NEL, so "sbx1\xa0" named sandbox sbx1 (found by review).
    sandbox_id = ids[0].strip(b" \t").decode("latin-1")
    if not valid_sandbox_id(sandbox_id):
        return Reject(reason=Reason.BAD_ROUTING_HEADER, detail="Invalid sandbox ID")
    port = parse_port(ports[0].strip(b" \t").decode("latin-1"))
    if port is None:
        return Reject(reason=Reason.BAD_ROUTING_HEADER, detail="Invalid sandbox port")
    return Target(sandbox_id, port)


# A Host longer than any host name (253 bytes, a trailing dot and ":65535") is parsed every
# time, never remembered: the 4,096 remembered hosts hold at most ~3 MiB (~0.7 KB each with
# the key and the answer). Hosts of any length (up to the 16 KiB head) could hold ~64 MiB.
HOST_MEMO_BYTES = 260


def host_target(value: bytes, domains: tuple[str, ...]) -> tuple[bool, HostForm]:
    """(Host is well-formed, what the Host form says), memoised: a relay sees the same few
    thousand hosts over and over, and parsing one costs more than the rest of ``decide``.
    The memo is bounded in count and in size (``HOST_MEMO_BYTES``), so hostile hosts only
    evict each other."""
    if len(value) > HOST_MEMO_BYTES:
        return _host_target(value, domains)
    return _remembered_host(value, domains)


def _host_target(value: bytes, domains: tuple[str, ...]) -> tuple[bool, HostForm]:
    if not value.strip(b" \t"):
        # An empty Host is well-formed: a client sends one when the target URI has no
        # authority (RFC 9112 §3.2; an empty reg-name, RFC 9110 §7.2). It names no sandbox,
        # so the header form or the management upstream takes it, as for any other name (SPEC
        # §1). Found by review: refused 400 "Invalid Host header".
        return True, None
    host = normalise_host(value)
    if host is None:
        return False, None
    return True, target_from_host(host, domains)


_remembered_host = functools.lru_cache(maxsize=4096)(_host_target)


def find_target(
    host: str | None,
    ids: list[bytes] | None,
    ports: list[bytes] | None,
    domains: tuple[str, ...],
) -> Target | Reject | None:
    """Both forms in SPEC order; None means the request names no sandbox."""
    from_host = target_from_host(host, domains) if host is not None else None
    return combine(from_host, ids, ports)


def combine(
    from_host: HostForm, ids: list[bytes] | None, ports: list[bytes] | None
) -> Target | Reject | None:
    """The Host form's answer joined with the header form's."""
    if from_host is API_HOST:
        return None  # the control plane's host: routing headers are not looked at
    if isinstance(from_host, Reject):
        return from_host
    from_headers = target_from_headers(ids, ports)
    if isinstance(from_headers, Reject):
        return from_headers
    if from_host is not None and from_headers is not None and from_host != from_headers:
        return Reject(
            reason=Reason.BAD_ROUTING_HEADER,
            detail="The Host and the E2b-Sandbox-Id/Port headers name different targets",
        )
    return from_host if from_host is not None else from_headers
