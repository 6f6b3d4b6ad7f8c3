"""The supervisor's rules, apart from its processes and sockets (``relay.workers``).

Pure functions of their arguments (the environment and the configuration are passed in), so
the restart backoff, the exit codes, the sd_notify parsing and each worker's environment are
tested without starting anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from relay.addresses import split_address
from relay.config import Config, ConfigError
from relay.lifecycle import RUN_DIR_ENV, SUPERVISOR_ENV, WORKER_ENV
from relay.preflight import host_checks

BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 10.0
NOTIFY_SOCKET = "notify.sock"  # in the run directory: the workers' sd_notify socket
STABLE_S = 30.0  # a worker that ran this long before it exited starts its backoff afresh


def restart_delay(failures: int) -> float:
    """Seconds to wait before restarting a worker that failed ``failures`` times in a row."""
    if failures <= 0:
        return 0.0
    # The exponent capped: past ~1,024 failures (hours of a crash loop, or of fork failing)
    # the float overflowed, and the waiter that restarts the worker died (found by review).
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures - 1, 64)))


def next_failures(previous: int, ran_for_s: float) -> int:
    """Consecutive failures after a worker exits: a long enough run resets the count."""
    return 1 if ran_for_s >= STABLE_S else previous + 1


def parse_notification(data: bytes) -> dict[str, str]:
    """``KEY=VALUE`` lines of an sd_notify datagram."""
    out = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key:
            out[key] = value
    return out


def startup_exit_code(returncode: int | None) -> int:
    """The supervisor's exit code when a worker died during start-up."""
    return 2 if returncode == 2 else 1


def worker_env(
    base: Mapping[str, str], index: int, run_dir: Path, watchdog_s: float, supervisor_pid: int
) -> dict[str, str]:
    env = {
        k: v
        for k, v in base.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
    }
    env[WORKER_ENV] = str(index)
    env[RUN_DIR_ENV] = str(run_dir)
    env[SUPERVISOR_ENV] = str(supervisor_pid)  # a worker drains once it is gone (lifecycle)
    env["NOTIFY_SOCKET"] = str(run_dir / NOTIFY_SOCKET)
    env["WATCHDOG_USEC"] = str(int(watchdog_s * 1_000_000))
    return env


def preflight(config: Config) -> None:
    """What the workers would each refuse, checked once before any is spawned (exit 2)."""
    config_checks(config)
    host_checks(config)


def config_checks(config: Config) -> None:
    """The part of :func:`preflight` that reads nothing of this host (``check-config
    --offline`` runs it too)."""
    for i, address in enumerate(config.listen.addresses):
        parsed = split_address(address)
        if parsed is not None and parsed[1] == 0:
            raise ConfigError(
                f"listen.address[{i}]: port 0 with process.workers > 1 would give each worker "
                "a different port"
            )
    if config.source is None:
        raise ConfigError("process.workers: workers need a configuration file to start from")


def supervises(config: Config, env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return config.process.workers > 1 and WORKER_ENV not in env
