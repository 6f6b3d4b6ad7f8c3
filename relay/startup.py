"""Before relay serves: refuse an unsafe machine, and tune the process for the data path.

``check_parsers`` runs in :meth:`relay.runtime.Relay.start`; the ``tune_*`` functions run
once per process in ``relay serve`` (each worker included) before the event loop starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
from collections.abc import Iterator

from relay.addresses import authority

log = logging.getLogger("relay")

# Descriptors a relay holds besides its connections' (listeners, the event loop's, libuv's
# spare, the feed's, admin connections, idle pooled upstream connections), with room to spare.
FIXED_DESCRIPTORS = 128


class StartupError(RuntimeError):
    """relay cannot run safely on this machine; the message says why."""


@contextlib.contextmanager
def binding(what: str, host: str, port: int) -> Iterator[None]:
    """A listener that cannot bind stops relay with one line on stderr, not a traceback.

    The usual causes are an operator's to fix: the port is taken (EADDRINUSE), below 1024
    without ``CAP_NET_BIND_SERVICE`` (EACCES), or the address is not on this host
    (EADDRNOTAVAIL). systemd sees exit status 1 and the journal says which listener.
    """
    try:
        yield
    except OSError as exc:
        # A host name that does not resolve raises socket.gaierror, whose errno is an EAI_*
        # code: os.strerror(-2) is "Unknown error -2", its own strerror says what went wrong.
        if isinstance(exc, socket.gaierror):
            reason = exc.strerror or str(exc)
        else:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
        # In brackets for IPv6: "::1:8080" reads as one address (found by review).
        raise StartupError(f"cannot listen on {what} {authority(host, port)}: {reason}") from exc


def check_parsers() -> None:
    """Refuse to start on a pure-Python HTTP parser (SPEC §5a; issue: request smuggling).

    The data path parses with httptools (llhttp, C). The admin listener uses aiohttp, whose
    pure-Python fallback parser (``AIOHTTP_NO_EXTENSIONS``, or a wheel without its C
    extension) has had request-smuggling bugs; relay would rather not start than run on it.
    """
    import httptools.parser.parser as llhttp  # noqa: PLC0415
    from aiohttp import http_parser  # noqa: PLC0415

    if not llhttp.__file__ or not llhttp.__file__.endswith(".so"):
        raise StartupError("httptools has no compiled llhttp parser")
    try:
        from aiohttp._http_parser import (  # type: ignore[import-not-found]  # noqa: PLC0415
            HttpRequestParser as CParser,
        )
    except ImportError:
        raise StartupError("aiohttp's C HTTP parser is unavailable") from None
    if http_parser.HttpRequestParser is not CParser:
        raise StartupError(
            "aiohttp is using its pure-Python HTTP parser (AIOHTTP_NO_EXTENSIONS is set?)"
        )


# glibc mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator() -> bool:
    """Stop glibc from trimming and re-growing the heap for every body chunk.

    Each 256 KiB read from uvloop, and llhttp's copy of it for ``on_body``, is allocated and
    freed at the top of the heap; with glibc's defaults (trim above 128 KiB, dynamic mmap
    threshold) every chunk costs ``brk`` calls, page faults and zeroing. Raising both
    thresholds made 64 MiB transfers 2-3x faster here (bench/README.md, "Bulk transfers").
    Equivalent to ``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_`` in the environment.
    Returns False where there is no glibc (musl, other systems): nothing to tune.
    """
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    trimmed: int = mallopt(_M_TRIM_THRESHOLD, 64 << 20)
    mapped: int = mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    return trimmed == 1 and mapped == 1


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the request path.

    Per-request objects are freed by reference counting (relay breaks its one cycle, llhttp's
    parser → response reader → exchange, whenever an exchange ends), so what the collector finds is
    almost only long-lived state: modules, configuration, routes. ``gc.freeze()`` moves what
    exists at start into a generation it never scans, and a higher first threshold makes
    collections rarer; each one then scans only recent survivors. A full collection over a
    large route table would otherwise add milliseconds to whichever request it interrupts.
    """
    import gc  # noqa: PLC0415

    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def tune_open_files() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one; the soft limit relay runs with.

    A proxied connection holds two descriptors (client and upstream), and
    ``listen.max_connections`` (10,000 by default) needs twice that. systemd (240 and later)
    and most shells start a service with a soft limit of 1,024 and a far higher hard one, for
    programs that still use ``select()`` (which breaks past descriptor 1,023); a program that
    needs more raises its soft limit itself, as Go's runtime does for every Go program (E2B's
    proxy among them). relay never calls ``select()`` (uvloop uses epoll; relay.departures
    polls). Without this, a relay run outside the shipped unit (``LimitNOFILE=131072``) shed
    connections past ~500 while its configuration allowed 10,000 (found by review). Workers
    inherit the raised limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY in (soft, hard) or hard <= soft:
        return soft  # (Linux bounds a hard limit by fs.nr_open: never infinite there)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):  # over fs.nr_open: keep what was given
        return soft
    return hard


def check_open_files(max_connections: int) -> None:
    """One warning when the open-file limit cannot hold ``max_connections`` (two descriptors
    each, plus relay's own). Logged once relay started, so that a configuration error stays
    the only line a failed start prints; by each worker, not by a supervisor."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * max_connections + FIXED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the open-file limit (%d) is below the %d that listen.max_connections = %d needs "
            "(two descriptors per connection): past about %d connections relay sheds new "
            "ones and answers 503; raise LimitNOFILE (ulimit -n)",
            soft,
            needed,
            max_connections,
            max(0, (soft - FIXED_DESCRIPTORS) // 2),
        )
