"""A control plane under load, as a separate process: paired route updates at a fixed rate.

``python -m tests.feeds.storm URL PAIRS RATE SECONDS VICTIM`` sends RATE updates per second
for SECONDS; update n sets both routes of pair n % PAIRS (``pa<k>``, ``pb<k>``) to generation
n // PAIRS + 1 in one MULTI/EXEC (HSET, HSET, XADD, XADD). Halfway it deletes VICTIM the same
way. It prints a JSON line with the ``time.monotonic()`` of the delete as soon as it is done
(CLOCK_MONOTONIC is system-wide on Linux, so the test can compare it with its own), and one
with the updates sent and the seconds taken at the end.
A process of its own so that the writer's pace does not depend on the relay's event loop.
"""

from __future__ import annotations

import json
import sys
import time

import redis


def route_text(sandbox_id: str, generation: int) -> str:
    return json.dumps(
        {
            "address": "127.0.0.1",
            "envd_token": f"tok-{sandbox_id}",
            "generation": generation,
            "sandbox_id": sandbox_id,
        },
        separators=(",", ":"),
        sort_keys=True,
    )


def storm(url: str, pairs: int, rate: int, seconds: float, victim: str) -> dict[str, float]:
    client = redis.Redis.from_url(url, protocol=2)
    sent = 0
    deleted_at = 0.0
    try:
        begin = time.monotonic()
        while time.monotonic() - begin < seconds:
            k, generation = sent % pairs, sent // pairs + 1
            with client.pipeline(transaction=True) as pipe:
                for side in "ab":
                    sid = f"p{side}{k}"
                    text = route_text(sid, generation)
                    pipe.hset("relay:routes", sid, text)
                    pipe.xadd("relay:routes:events", {"op": "put", "id": sid, "route": text})
                pipe.execute()
            sent += 1
            if not deleted_at and time.monotonic() - begin > seconds / 2:
                deleted_at = time.monotonic()
                with client.pipeline(transaction=True) as pipe:
                    pipe.hdel("relay:routes", victim)
                    pipe.xadd("relay:routes:events", {"op": "delete", "id": victim})
                    pipe.execute()
                print(json.dumps({"deleted_at": deleted_at}), flush=True)
            delay = begin + sent / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        return {"sent": sent, "seconds": time.monotonic() - begin, "deleted_at": deleted_at}
    finally:
        client.close()


if __name__ == "__main__":
    url, pairs, rate, seconds, victim = sys.argv[1:6]
    print(json.dumps(storm(url, int(pairs), int(rate), float(seconds), victim)), flush=True)
