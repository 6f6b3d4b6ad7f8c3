"""Route feed benchmark: publish-to-serving latency and relay memory per 100,000 routes.

    .venv/bin/python bench/route_feed.py [--puts 300] [--cli-puts 20] [--routes 100000]

Starts a private redis-server (loopback, free port, temp dir; never the machine's Redis), a
``python -m relay serve`` process reading it, and a fake sandbox app in this process.

1. Latency: for each of ``--puts`` new sandboxes, publish its route exactly as
   ``relay routes put`` does (HSET + XADD in one MULTI/EXEC) and request it through the relay
   back to back until it answers 200; the time from the start of the MULTI to that answer.
   Then the same for deletes (until 502). ``--cli-puts`` more puts go through the real
   ``relay routes put`` command, whose time is dominated by Python start-up.
2. Memory: relay RSS (VmRSS) once ready with an empty table, then in fresh relay processes
   after a snapshot of N and 2N routes (HGETALL path), and after N routes arrived as stream
   events; reported per 100,000 routes. Then every one of the N routes is replaced twice
   (new tokens, 500 routes per MULTI) and RSS recorded after each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from relay.feeds.redis_client import publish_delete, publish_puts  # noqa: E402
from tests.feeds.helpers import SandboxApp  # noqa: E402
from tests.feeds.redisproc import RedisProcess  # noqa: E402
from tests.support.ports import free_port  # noqa: E402


def route(sandbox_id: str, i: int) -> str:
    return json.dumps(
        {
            "sandbox_id": sandbox_id,
            "address": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}" if i else "127.0.0.1",
            "envd_token": secrets.token_hex(16),
            "traffic_token": secrets.token_hex(16),
            "generation": 1,
        },
        separators=(",", ":"),
    )


def local_route(sandbox_id: str) -> str:
    return json.dumps(
        {"sandbox_id": sandbox_id, "address": "127.0.0.1", "insecure": True},
        separators=(",", ":"),
    )


class Relay:
    def __init__(self, directory: Path, redis_url: str) -> None:
        self.port, self.admin = free_port(), free_port()
        self.config = directory / f"relay-{self.port}.toml"
        self.config.write_text(
            f'[listen]\naddress = "127.0.0.1:{self.port}"\n'
            f'[admin]\naddress = "127.0.0.1:{self.admin}"\n'
            f'[routes]\nsource = "redis"\nredis_url = "{redis_url}"\n'
        )
        self.log = (directory / f"relay-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env={**os.environ, "RELAY_LOG_LEVEL": "WARNING"},
            cwd=REPO,
        )

    async def routes(self, session: aiohttp.ClientSession) -> int | None:
        try:
            async with session.get(f"http://127.0.0.1:{self.admin}/readyz") as response:
                body = await response.json()
                return int(body["routes"]) if response.status == 200 else None
        except aiohttp.ClientConnectionError:
            return None

    async def wait_routes(self, session: aiohttp.ClientSession, count: int, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while await self.routes(session) != count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"relay did not reach {count} routes")
            await asyncio.sleep(0.05)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds (rounded to 0.1) and the sample count."""
    ordered = sorted(samples)
    if len(ordered) < 2:
        return {}
    q = statistics.quantiles(ordered, n=100, method="inclusive")
    ms = {"p50": q[49], "p99": q[98], "max": ordered[-1]}
    return {**{k: round(v * 1000, 1) for k, v in ms.items()}, "n": len(ordered)}


async def latency(args: argparse.Namespace, directory: Path, redis_url: str) -> dict[str, Any]:
    app = SandboxApp()
    await app.start()
    relay = Relay(directory, redis_url)
    writer = aioredis.Redis.from_url(redis_url, protocol=2)
    try:
        async with aiohttp.ClientSession() as session:
            await relay.wait_routes(session, 0, 20)
            headers = {"E2b-Sandbox-Port": str(app.port)}
            url = f"http://127.0.0.1:{relay.port}/"

            async def until(sandbox_id: str, status: int, start: float) -> float:
                while True:
                    async with session.get(
                        url, headers={**headers, "E2b-Sandbox-Id": sandbox_id}
                    ) as response:
                        await response.read()
                        if response.status == status:
                            return time.monotonic() - start
                    if time.monotonic() - start > 5:
                        raise RuntimeError(f"{sandbox_id}: no {status} within 5 s")

            puts, deletes = [], []
            for i in range(args.puts):
                sid = f"lat{i}"
                start = time.monotonic()
                await publish_puts(writer, "relay:", [(sid, local_route(sid))], 10_000)
                puts.append(await until(sid, 200, start))
                await asyncio.sleep(0.005)
            for i in range(args.puts):
                sid = f"lat{i}"
                start = time.monotonic()
                await publish_delete(writer, "relay:", sid, 10_000)
                deletes.append(await until(sid, 502, start))
                await asyncio.sleep(0.005)
            cli = []
            config = str(relay.config)
            for i in range(args.cli_puts):
                sid = f"cli{i}"
                source = directory / f"{sid}.json"
                source.write_text(local_route(sid))
                start = time.monotonic()
                cli_put = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-m", "relay", "routes", "put", str(source)),
                    *("--config", config),
                    stdout=asyncio.subprocess.DEVNULL,
                    cwd=REPO,
                )
                assert await cli_put.wait() == 0
                cli.append(await until(sid, 200, start))
        return {
            "put_to_serving_ms": percentiles_ms(puts),
            "delete_to_refused_ms": percentiles_ms(deletes),
            "cli_put_to_serving_ms": percentiles_ms(cli),
        }
    finally:
        relay.stop()
        await writer.aclose()
        await app.stop()


async def memory(args: argparse.Namespace, directory: Path, redis_url: str) -> dict[str, Any]:
    n = args.routes
    churn_rounds = args.churn_rounds
    writer = aioredis.Redis.from_url(redis_url, protocol=2)
    out: dict[str, Any] = {"routes": n}
    try:
        await writer.flushall()
        async with aiohttp.ClientSession() as session:

            async def settled_rss(relay: Relay, count: int) -> int:
                await relay.wait_routes(session, count, 120)
                await asyncio.sleep(1.0)
                return relay.rss_kib()

            async def fill(count: int, start: int = 0) -> None:
                for base in range(start, count, 1000):
                    ids = [f"m{i:08d}" for i in range(base, min(count, base + 1000))]
                    mapping: dict[Any, Any] = {sid: route(sid, int(sid[1:]) + 1) for sid in ids}
                    await writer.hset("relay:routes", mapping=mapping)

            empty = Relay(directory, redis_url)
            out["rss_empty_kib"] = await settled_rss(empty, 0)
            # Stream path: the same relay receives N routes as events (1,000 per MULTI).
            for base in range(0, n, 1000):
                ids = [f"e{i:08d}" for i in range(base, min(n, base + 1000))]
                pairs = [(sid, route(sid, int(sid[1:]) + 1)) for sid in ids]
                await publish_puts(writer, "relay:", pairs, None)
            out["rss_after_stream_kib"] = await settled_rss(empty, n)
            empty.stop()
            await writer.flushall()

            await fill(n)
            started = time.monotonic()
            one = Relay(directory, redis_url)
            out["rss_snapshot_n_kib"] = await settled_rss(one, n)
            out["start_to_ready_with_n_s"] = round(time.monotonic() - started - 1.0, 2)
            # Churn: every route replaced (new tokens) --churn-rounds times, 500 per MULTI.
            out["rss_after_churn_kib"] = []
            for generation in range(2, 2 + churn_rounds):
                for base in range(0, n, 500):
                    ids = [f"m{i:08d}" for i in range(base, min(n, base + 500))]
                    pairs = [(sid, route(sid, int(sid[1:]) + generation)) for sid in ids]
                    await publish_puts(writer, "relay:", pairs, 10_000)
                await asyncio.sleep(2.0)
                out["rss_after_churn_kib"].append(one.rss_kib())
            one.stop()
            await fill(2 * n, n)
            two = Relay(directory, redis_url)
            out["rss_snapshot_2n_kib"] = await settled_rss(two, 2 * n)
            two.stop()
    finally:
        await writer.aclose()
    scale = 100_000 / n
    out["mib_per_100k_stream"] = round(
        (out["rss_after_stream_kib"] - out["rss_empty_kib"]) * scale / 1024, 1
    )
    out["mib_per_100k_snapshot"] = round(
        (out["rss_snapshot_n_kib"] - out["rss_empty_kib"]) * scale / 1024, 1
    )
    out["mib_per_100k_snapshot_marginal"] = round(
        (out["rss_snapshot_2n_kib"] - out["rss_snapshot_n_kib"]) * scale / 1024, 1
    )
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=300)
    parser.add_argument("--cli-puts", type=int, default=20)
    parser.add_argument("--routes", type=int, default=100_000)
    parser.add_argument("--churn-rounds", type=int, default=2, help="full replacements")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relay-route-feed-bench-") as tmp:
        directory = Path(tmp)
        server = RedisProcess(directory / "redis")
        server.start()
        try:
            result = {
                "latency": await latency(args, directory, server.url),
                "memory": await memory(args, directory, server.url),
            }
        finally:
            server.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
