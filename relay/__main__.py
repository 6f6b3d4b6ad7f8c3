"""Command line: ``relay serve | check-config | routes | sign-url | --version`` (SPEC §7).

Exit codes: 0 success, 2 configuration or usage error (the message names the bad key),
1 anything else.
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["serve"]:
    # Before the imports below (~0.1 s), whether run as ``python -m relay`` or as the console
    # script (which imports this module): a SIGHUP meanwhile ended the process (relay.systemd;
    # found by review, then found missing from the console script, and holding the signals of
    # every other command for good). Only ``serve``'s event loop takes them later.
    from relay.systemd import hold_signals

    hold_signals()

import argparse
import json
import logging
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

from relay import __version__, accesslog, errorlog, routes_cli
from relay.config import Config, ConfigError
from relay.config_parse import config_sections, load
from relay.config_redis import redact_url
from relay.core.auth import file_signature

log = logging.getLogger("relay")

EXIT_CONFIG = 2
SECRET_KEYS = frozenset({"redis_url"})
EXIT_SIGPIPE = 128 + 13  # as a shell reports a process killed by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG
    if args.command != "serve":
        from relay.systemd import release_signals  # noqa: PLC0415

        release_signals()  # held at import when argv named serve (a wrapper's main([...]))
    handler = {"serve": _serve, "check-config": _check_config, "sign-url": _sign_url}
    handler["routes"] = routes_cli.run
    try:
        code = handler[args.command](args)
        if args.command != "serve":
            sys.stdout.flush()  # a short output is written here, not at exit: see below
        return code
    except ConfigError as exc:
        # One write per line: workers share the supervisor's stderr, and print() writes the
        # text and its newline separately, so two workers' lines could interleave. In relay
        # serve, through the log's writer thread: after the lines logged before it.
        errorlog.say(f"relay: config error: {exc}")
        return EXIT_CONFIG
    except BrokenPipeError:
        # ``relay check-config | head -3``: the reader left. Quiet, with the status of a Unix
        # tool killed by SIGPIPE (Python ignores the signal, so the write raised instead;
        # found by review: a traceback and exit 1). stdout goes to /dev/null so that the
        # interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
    except BaseException:
        # A bug: Python writes the traceback to stderr itself, after the log lines before it.
        errorlog.finish()
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relay",
        description="The ingress of an E2B-compatible sandbox platform (SPEC §7).",
        epilog="exit codes: 0 success, 2 configuration or usage error (the message names the"
        " key), 1 anything else",
    )
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the relay")
    serve.add_argument("--config", required=True, help="TOML configuration file")
    serve.add_argument(
        "--log-level",
        default=os.environ.get("RELAY_LOG_LEVEL") or "INFO",  # empty: not set
        help="DEBUG, INFO (the default, or $RELAY_LOG_LEVEL), WARNING (no access log), ERROR",
    )
    check = sub.add_parser("check-config", help="validate a configuration and print it")
    check.add_argument("--config", required=True, help="TOML configuration file")
    check.add_argument(
        "--offline",
        action="store_true",
        help="skip the checks against this machine (TLS files, source address)",
    )
    sign = sub.add_parser("sign-url", help="make a signed /files URL exactly as the SDK does")
    sign.add_argument(
        "--url", required=True, help="envd base URL, e.g. https://49983-<id>.<domain>"
    )
    sign.add_argument("--path", default="", help="file path in the sandbox")
    sign.add_argument(
        "--op", choices=("read", "write"), default="read", help="download or upload (default read)"
    )
    sign.add_argument("--user", default="", help="username (omitted when empty)")
    sign.add_argument(
        "--expires-in", type=int, default=None, help="seconds from now (default: never expires)"
    )
    token = sign.add_mutually_exclusive_group(required=True)
    token.add_argument("--token-file", help="file holding the envd access token")
    token.add_argument("--token-env", help="environment variable holding the token")
    token.add_argument("--sandbox", help="take the token of this sandbox's route (needs --config)")
    sign.add_argument("--config", help="configuration whose route source holds --sandbox")
    routes_cli.add_parser(sub)
    return parser


def log_level(name: str) -> str:
    """``--log-level``'s value as logging names it, or a usage error (exit 2).

    logging itself raised ValueError for an unknown name: relay serve ended in a traceback
    with exit 1, which the unit's Restart=on-failure retries for ever (exit 2 is the error
    it does not retry, RestartPreventExitStatus=2)."""
    level = name.upper()
    if level not in logging.getLevelNamesMapping():
        raise ConfigError(
            f"--log-level: unknown level {name!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL;"
            " $RELAY_LOG_LEVEL sets the default)"
        )
    return level


def _setup_logging(level: str) -> None:
    worker = os.environ.get("RELAY_WORKER")  # set by the supervisor (relay.workers)
    tag = f"[worker {worker}] " if worker else ""
    # Written by a thread of its own, never by the event loop (relay.errorlog).
    errorlog.install(level.upper(), f"%(asctime)s %(levelname)s %(name)s {tag}%(message)s")
    # Access-log lines are JSON documents of their own, written bare and buffered to stdout
    # (relay.accesslog); a log level above INFO turns them off.
    # With stdout closed (``relay serve >&-``) Python has no sys.stdout: the lines then go
    # through the ``relay.access`` logger to stderr rather than stopping the start.
    if logging.getLogger("relay.access").isEnabledFor(logging.INFO) and sys.stdout is not None:
        accesslog.configure(sys.stdout.buffer)


def _hold_standard_descriptors() -> None:
    """Put /dev/null on descriptors 0-2 where the caller left them closed (``>&-``).

    libuv refuses to close a descriptor below 3 (an assertion in ``uv__close``, which aborts
    the process), and a closed 0, 1 or 2 is the first one a new socket gets: relay started
    with stdout closed died at its first closed connection. Daemons fill them the same way.
    With stdout closed Python has no ``sys.stdout`` (access lines then go through logging to
    stderr); with stderr closed, stderr becomes the /dev/null put there.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            # The lowest free descriptor is this one: those below it are open or filled.
            os.open(os.devnull, os.O_RDWR)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - lives as long as the process


def _serve(args: argparse.Namespace) -> int:
    _hold_standard_descriptors()
    level = log_level(args.log_level)
    from relay.lifecycle import effective_config  # noqa: PLC0415

    # A worker its supervisor restarted runs what its siblings run, not the file as it is now.
    saved = effective_config(os.environ, args.config)
    config = saved.config if saved is not None else load(args.config)
    _setup_logging(level)
    # Imported here so that check-config and sign-url start without the server stack.
    import uvloop  # noqa: PLC0415

    from relay import workers  # noqa: PLC0415
    from relay.runtime import serve  # noqa: PLC0415
    from relay.startup import (  # noqa: PLC0415
        StartupError,
        tune_allocator,
        tune_gc,
        tune_open_files,
    )
    from relay.supervision import supervises  # noqa: PLC0415

    tune_allocator()
    tune_gc()
    tune_open_files()  # (relay.lifecycle warns when even the hard limit is short)

    try:
        if supervises(config):  # process.workers > 1 (relay.workers)
            return workers.supervise(config, level)
        uvloop.run(serve(config, saved.tls_files if saved is not None else None))
    except StartupError as exc:
        errorlog.say(f"relay: cannot start: {exc}")  # one write: see main()
        return 1
    return 0


def redacted(config: Config) -> dict[str, Any]:
    """The effective configuration with secrets replaced (SPEC §7, check-config)."""
    out = config_sections(config)
    for values in out.values():
        for key in values:
            if key in SECRET_KEYS and values[key]:
                values[key] = redact_url(values[key])
    return out


def _check_config(args: argparse.Namespace) -> int:
    config = load(args.config)
    # What serve refuses with exit 2, check-config refuses too (found by review: it passed a
    # missing redis_password_file or redis_ca_file, and port 0 with workers).
    from relay.supervision import config_checks, supervises  # noqa: PLC0415

    if supervises(config):
        config_checks(config)  # (host_checks below unless --offline)
    if not args.offline:
        from relay.preflight import host_checks  # noqa: PLC0415

        host_checks(config)
        if config.routes.source == "redis":
            from relay.feeds.redis_client import redis_target  # noqa: PLC0415

            redis_target(config, environment=False)  # its files: the password, the CA
    print(json.dumps(redacted(config), indent=2))
    return 0


def sign_url(
    base: str, path: str, op: str, user: str, token: str, expires_in: int | None, now: int
) -> str:
    """The URL ``Sandbox.download_url``/``upload_url`` returns (e2b ``_file_url``)."""
    expiration = now + expires_in if expires_in is not None else None
    signature = file_signature(path, op, user, token, expiration)
    query: dict[str, str] = {}
    if path:
        query["path"] = path
    if user:
        query["username"] = user
    query["signature"] = signature
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    url = urllib.parse.urljoin(base, "/files")
    return url + "?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)


def _sign_url(args: argparse.Namespace) -> int:
    # The SDK joins "/files" onto its envd URL, always http(s)://host: urljoin took a bare
    # host for a path and the URL printed had no host ("/files?..."), exit 0 (found by review).
    try:
        parts = urllib.parse.urlsplit(args.url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # "http://[::1": an IPv6 literal not closed
        usable = False
    if not usable:
        print(
            f"relay: --url must be http(s)://host[:port], e.g. "
            f"https://49983-<id>.<domain>; got {args.url!r}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if args.token_file:
        # One line, not a traceback, and never an empty token (as for --token-env).
        try:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            print(f"relay: cannot read {args.token_file}: {exc.strerror}", file=sys.stderr)
            return EXIT_CONFIG
        except UnicodeDecodeError:
            print(f"relay: {args.token_file} is not UTF-8 text", file=sys.stderr)
            return EXIT_CONFIG
        if not token:
            print(f"relay: {args.token_file} is empty", file=sys.stderr)
            return EXIT_CONFIG
    elif args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            print(f"relay: ${args.token_env} is empty", file=sys.stderr)
            return EXIT_CONFIG
    else:
        if not args.config:
            print("relay: --sandbox needs --config", file=sys.stderr)
            return EXIT_CONFIG
        config = load(args.config)
        try:
            routes, _ = routes_cli.load_table(config)  # the file or Redis, as configured
        except routes_cli.SourceError as exc:
            print(f"relay: {exc}", file=sys.stderr)
            return 1
        route = routes.get(args.sandbox)
        if route is None or route.envd_token is None:
            print(f"relay: no secured route for sandbox {args.sandbox}", file=sys.stderr)
            return 1
        token = route.envd_token
    print(
        sign_url(args.url, args.path, args.op, args.user, token, args.expires_in, int(time.time()))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
