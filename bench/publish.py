"""Where a run's numbers go: one line per result on the console, the ``.json``, ``.md`` and
``.png`` files in bench/results, and the latest table and chart in bench/README.md and the
project README (between the ``bench:latest`` markers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench import report
from bench.host import host_speed_text
from bench.stack import BENCH

RESULTS = BENCH / "results"
README = BENCH / "README.md"
# The markers as the READMEs carry them (written when all of this lived in bench/run.py).
LATEST_START = "<!-- bench:latest:start (written by bench/run.py) -->"
LATEST_END = "<!-- bench:latest:end -->"


def log(message: str) -> None:
    print(message, flush=True)


def summary(workload: str, data: dict[str, Any]) -> str:
    if "error" in data:
        return f"ERROR {data['error']}"
    if "absent" in data:
        return f"absent: {data['absent']}"
    parts = []
    if "req_s" in data:
        lat = data["latency_us"]
        parts.append(
            f"{data['req_s']:>9,.0f} req/s  p50 {lat['p50']:>6,} µs  p99 {lat['p99']:>6,} µs"
        )
    if "mib_s" in data:
        parts.append(f"{data['mib_s']:,.0f} MiB/s (runs {data['mib_s_runs']})")
    if "first_event_us" in data:
        lat = data["latency_us"]
        parts.append(
            f"event p50 {lat['p50']:,.0f} µs p99 {lat['p99']:,.0f} µs, "
            f"first event {data['first_event_us']:,.0f} µs"
        )
    if "round_trips_s" in data:
        parts.append(f"{data['round_trips_s']:,.0f} round trips/s")
    if "kib_per_conn" in data:
        parts.append(
            f"{data['held']:,} held, RSS {data['rss_before_kib']:,} → {data['rss_after_kib']:,} "
            f"KiB = {data['kib_per_conn']} KiB/conn"
        )
    if "proxy_cpu_us_per_req" in data:
        parts.append(f"proxy CPU {data['proxy_cpu_us_per_req']} µs/req")
    if "cores_busy_pct" in data:
        parts.append("busy " + " ".join(f"{k} {v}%" for k, v in data["cores_busy_pct"].items()))
    return "  ".join(parts) or json.dumps(data)


def publish(document: dict[str, Any], results: Path, name: str, *, readme: bool) -> None:
    """The .md table and the .png chart next to the JSON; the README's latest section."""
    meta, present, data = document["meta"], document["columns"], document["results"]
    found = report.targets(data, present)
    header = (
        f"Run {meta['date']} on `{meta['host']}` ({meta['cpu']}, {meta['cores']} cores, "
        f"{meta['memory_gib']} GiB, kernel {meta['kernel']}, Python {meta['python']}), "
        f"nginx {meta['nginx']}, {meta['wrk']}; bench at {meta['relay_commit']}; relay from "
        f"`{meta['relay_src']}` at {meta.get('relay_src_commit', meta['relay_commit'])}; "
        f"took {meta['duration_s']:.0f} s. Host speed: {host_speed_text(meta.get('host_speed'))}. "
        f"Raw numbers: `results/{name}.json`."
    )
    absent_text = "\n".join(f"- `{k}` absent: {v}" for k, v in meta["absent"].items())
    md = "\n\n".join(
        part
        for part in (
            header,
            report.markdown_table(data, present),
            absent_text,
            "Targets (issue 7):\n\n```\n" + report.targets_text(found) + "\n```",
        )
        if part
    )
    (results / f"{name}.md").write_text(md + "\n")
    png = results / f"{name}.png"
    title = f"relay ratios, {meta['host']} {meta['date'][:10]} ({meta['cores']} cores)"
    charted = report.chart(data, present, png, title)
    if readme:
        update_readme(md, f"results/{name}.png" if charted else None)
    log("")
    log(md)
    log("")
    log(f"results: {results / name}.json, .md{', .png' if charted else ''}")


def update_readme(md: str, png: str | None) -> None:
    """The latest table and chart, in bench/README.md and in the project README's
    performance section (paths there are relative to the repository root)."""
    for readme, prefix in ((README, ""), (BENCH.parent / "README.md", "bench/")):
        if not readme.exists():
            continue
        text = readme.read_text()
        if LATEST_START not in text or LATEST_END not in text:
            continue
        table = md.replace("`results/", f"`{prefix}results/")
        body = table + (f"\n\n![relay ratios]({prefix}{png})" if png else "")

        def block(_: re.Match[str], body: str = body) -> str:
            return f"{LATEST_START}\n{body}\n{LATEST_END}"  # a function: no escapes in body

        new = re.sub(
            re.escape(LATEST_START) + ".*?" + re.escape(LATEST_END),
            block,
            text,
            flags=re.DOTALL,
        )
        readme.write_text(new)
