"""Turn a run's results into the ratio table, the PASS/FAIL targets and the chart."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Results = dict[str, dict[str, dict[str, Any]]]  # workload -> column -> measurements


def dig(data: dict[str, Any] | None, path: str) -> float | None:
    value: Any = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) else None


@dataclass(frozen=True)
class Row:
    label: str
    workload: str
    path: str
    better: str  # "high" | "low"
    unit: str
    added: bool = False  # show value minus the direct column's (latency added by a proxy)
    proxy_only: bool = False  # direct has no such number (proxy CPU, proxy RSS)


P99 = "latency_us.p99"
ROWS = [
    Row("small GET c10", "get_c10", "req_s", "high", "req/s"),
    Row("small GET c10 p99", "get_c10", "latency_us.p99", "low", "µs"),
    Row("small GET c50", "get_c50", "req_s", "high", "req/s"),
    Row("small GET c50 p50", "get_c50", "latency_us.p50", "low", "µs"),
    Row("small GET c50 p99", "get_c50", "latency_us.p99", "low", "µs"),
    Row("small GET c50 p99 added", "get_c50", "latency_us.p99", "low", "µs", added=True),
    Row("small GET c50 CPU/req", "get_c50", "proxy_cpu_us_per_req", "low", "µs", proxy_only=True),
    Row("small GET c50 paced", "get_c50_paced", "req_s", "high", "req/s"),
    Row("small GET c50 paced p99", "get_c50_paced", "latency_us.p99", "low", "µs"),
    Row("small GET c50 paced p99 added", "get_c50_paced", P99, "low", "µs", added=True),
    Row("small GET c200", "get_c200", "req_s", "high", "req/s"),
    Row("small GET c200 p99", "get_c200", "latency_us.p99", "low", "µs"),
    Row("envd X-Access-Token c50", "auth_token", "req_s", "high", "req/s"),
    Row(
        "envd X-Access-Token CPU/req",
        "auth_token",
        "proxy_cpu_us_per_req",
        "low",
        "µs",
        proxy_only=True,
    ),
    Row("signed /files URL c50", "auth_signed", "req_s", "high", "req/s"),
    Row(
        "signed /files CPU/req",
        "auth_signed",
        "proxy_cpu_us_per_req",
        "low",
        "µs",
        proxy_only=True,
    ),
    Row("64 MiB download", "download", "mib_s", "high", "MiB/s"),
    Row("64 MiB upload", "upload", "mib_s", "high", "MiB/s"),
    Row("stream event latency p50", "stream", "latency_us.p50", "low", "µs"),
    Row("stream event latency p99", "stream", "latency_us.p99", "low", "µs"),
    Row("stream added p50", "stream", "latency_us.p50", "low", "µs", added=True),
    Row("stream added p99", "stream", "latency_us.p99", "low", "µs", added=True),
    Row("stream time to first event", "stream", "first_event_us", "low", "µs"),
    Row("WebSocket echo c1", "ws_c1", "round_trips_s", "high", "rt/s"),
    Row("WebSocket echo c50", "ws_c50", "round_trips_s", "high", "rt/s"),
    Row("idle keep-alive RSS/conn", "idle_http", "kib_per_conn", "low", "KiB", proxy_only=True),
    Row("idle WebSocket RSS/conn", "idle_ws", "kib_per_conn", "low", "KiB", proxy_only=True),
    Row("small GET c50, no access log", "get_c50_nolog", "req_s", "high", "req/s"),
    Row(
        "small GET c50 CPU/req, no access log",
        "get_c50_nolog",
        "proxy_cpu_us_per_req",
        "low",
        "µs",
        proxy_only=True,
    ),
]


def value(results: Results, row: Row, column: str) -> float | None:
    cell = results.get(row.workload, {}).get(column)
    if cell is None or "error" in cell:
        return None
    if row.proxy_only and column == "direct":
        return None
    v = dig(cell, row.path)
    if v is None or not row.added:
        return v
    if column == "direct":
        return None
    base = dig(results.get(row.workload, {}).get("direct"), row.path)
    return None if base is None else v - base


def cell_text(results: Results, row: Row, column: str) -> str:
    cell = results.get(row.workload, {}).get(column)
    if cell is not None and "error" in cell:
        return "error"
    if cell is not None and "absent" in cell:
        return "absent"
    v = value(results, row, column)
    if v is None:
        return "—"
    if row.unit in ("req/s", "rt/s"):
        return f"{v:,.0f}"
    if row.unit == "MiB/s":
        return f"{v:,.0f}"
    if row.unit == "KiB":
        return f"{v:.2f}"
    return f"{v:,.0f}"


def ratio(results: Results, row: Row, top: str, bottom: str) -> float | None:
    if row.added:
        return None
    a, b = value(results, row, top), value(results, row, bottom)
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratio_pairs(columns: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for workers in (1, 2):
        relay = f"relay-{workers}w"
        if relay in columns:
            if f"nginx-{workers}w" in columns:
                pairs.append((relay, f"nginx-{workers}w"))
            pairs.append((relay, "direct"))
        if workers == 1 and relay in columns and "floor-1w" in columns:
            # relay ÷ a bare uvloop forwarder (bench/floor.py): relay's own share of the cost
            pairs.append((relay, "floor-1w"))
    return pairs


def markdown_table(results: Results, columns: list[str]) -> str:
    pairs = ratio_pairs(columns)
    head = ["workload", "unit", *columns, *(f"{a} ÷ {b}" for a, b in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in ROWS:
        if row.workload not in results:
            continue
        arrow = "↑" if row.better == "high" else "↓"
        cells = [f"{row.label} ({arrow})", row.unit]
        cells += [cell_text(results, row, c) for c in columns]
        for a, b in pairs:
            r = ratio(results, row, a, b)
            cells.append("—" if r is None else f"{r:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- targets (issue 7) ----------------------------------------------------------------------


@dataclass
class Target:
    name: str
    passed: bool | None  # None: not measurable in this run
    detail: str


def _check(
    name: str, left: float | None, right: float | None, ok: Callable[[float, float], bool], fmt: str
) -> Target:
    if left is None or right is None:
        return Target(name, False, "no measurement (error or absent column)")
    return Target(name, ok(left, right), fmt.format(left=left, right=right))


def targets(results: Results, columns: list[str]) -> list[Target]:
    def get(workload: str, column: str, path: str) -> float | None:
        cell = results.get(workload, {}).get(column)
        if cell is None or "error" in cell:
            return None
        return dig(cell, path)

    out: list[Target] = []
    for workers in (1, 2):
        relay, nginx = f"relay-{workers}w", f"nginx-{workers}w"
        if relay not in columns:
            continue
        tag = f"[{workers} worker{'s' if workers > 1 else ''}]"
        out.append(
            _check(
                f"{tag} small GET c50 req/s ≥ 0.5x nginx",
                get("get_c50", relay, "req_s"),
                get("get_c50", nginx, "req_s"),
                lambda a, b: a >= 0.5 * b,
                "relay {left:,.0f} vs nginx {right:,.0f} req/s",
            )
        )
        out.append(
            _check(
                f"{tag} small GET c50 CPU/req ≤ 2.5x nginx",
                get("get_c50", relay, "proxy_cpu_us_per_req"),
                get("get_c50", nginx, "proxy_cpu_us_per_req"),
                lambda a, b: a <= 2.5 * b,
                "relay {left:.1f} µs vs nginx {right:.1f} µs",
            )
        )
        # The p99 target on two loads: closed loop (saturated: queueing) and paced (below
        # saturation: what the proxy adds); see bench/README.md, "Targets".
        for workload, load in (("get_c50", ""), ("get_c50_paced", " paced (below saturation)")):
            out.append(
                _check(
                    f"{tag} small GET c50{load} p99 added over direct ≤ 1 ms",
                    get(workload, relay, "latency_us.p99"),
                    get(workload, "direct", "latency_us.p99"),
                    lambda a, b: a - b <= 1000,
                    "relay p99 {left:,.0f} µs, direct p99 {right:,.0f} µs",
                )
            )
        for workload, label in (("download", "download"), ("upload", "upload")):
            out.append(
                _check(
                    f"{tag} 64 MiB {label} ≥ 0.8x direct",
                    get(workload, relay, "mib_s"),
                    get(workload, "direct", "mib_s"),
                    lambda a, b: a >= 0.8 * b,
                    "relay {left:,.0f} vs direct {right:,.0f} MiB/s",
                )
            )
        base = {q: get("stream", "direct", f"latency_us.{q}") for q in ("p50", "p99")}
        for q in ("p50", "p99"):
            r, n, d = (
                get("stream", relay, f"latency_us.{q}"),
                get("stream", nginx, f"latency_us.{q}"),
                base[q],
            )
            added_r = None if r is None or d is None else r - d
            added_n = None if n is None or d is None else n - d
            out.append(
                _check(
                    f"{tag} stream added latency {q} ≤ nginx's (+max(10 µs, 10%) noise)",
                    added_r,
                    added_n,
                    lambda a, b: a <= b + max(10.0, 0.1 * abs(b)),
                    "relay +{left:,.0f} µs vs nginx +{right:,.0f} µs",
                )
            )
        out.append(
            _check(
                f"{tag} stream first event not held back (≤ direct + 1 ms)",
                get("stream", relay, "first_event_us"),
                get("stream", "direct", "first_event_us"),
                lambda a, b: a - b <= 1000,
                "relay {left:,.0f} µs vs direct {right:,.0f} µs",
            )
        )
        for workload, label in (("ws_c1", "c1"), ("ws_c50", "c50")):
            out.append(
                _check(
                    f"{tag} WebSocket echo {label} ≥ 0.9x nginx",
                    get(workload, relay, "round_trips_s"),
                    get(workload, nginx, "round_trips_s"),
                    lambda a, b: a >= 0.9 * b,
                    "relay {left:,.0f} vs nginx {right:,.0f} round trips/s",
                )
            )
        for workload, label, limit in (
            ("idle_http", "keep-alive connection", 8.0),
            ("idle_ws", "WebSocket", 24.0),
        ):
            kib = get(workload, relay, "kib_per_conn")
            out.append(
                _check(
                    f"{tag} idle RSS per {label} ≤ {limit:g} KiB",
                    kib,
                    limit,
                    lambda a, b: a <= b,
                    "relay {left:.2f} KiB (limit {right:g})",
                )
            )
    return out


def targets_text(found: list[Target]) -> str:
    lines = []
    for t in found:
        mark = "PASS" if t.passed else "FAIL"
        lines.append(f"{mark}  {t.name}: {t.detail}")
    return "\n".join(lines)


# -- chart ---------------------------------------------------------------------------------


def chart(results: Results, columns: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pairs = ratio_pairs(columns)
    rows = [r for r in ROWS if not r.added and r.workload in results]
    labels = [f"{r.label} ({'↑' if r.better == 'high' else '↓'} better)" for r in rows]
    fig_h = 0.32 * len(rows) * max(1, len(pairs)) / 1.6 + 1.8
    fig, ax = plt.subplots(figsize=(11, fig_h))
    height = 0.8 / max(1, len(pairs))
    colours = ["tab:blue", "tab:orange", "tab:purple", "tab:green", "tab:red"]
    for i, (a, b) in enumerate(pairs):
        ys, xs = [], []
        for j, row in enumerate(rows):
            r = ratio(results, row, a, b)
            if r is None or r <= 0 or math.isnan(r):
                continue
            ys.append(j + (i - (len(pairs) - 1) / 2) * height)
            xs.append(r)
        ax.barh(ys, xs, height=height, color=colours[i % len(colours)], label=f"{a} ÷ {b}")
        for y, x in zip(ys, xs, strict=True):
            ax.text(x * 1.03, y, f"{x:.2f}", va="center", fontsize=7)
    for j, row in enumerate(rows):  # say why a bar is missing
        cells = results.get(row.workload, {})
        broken = [c for c in columns if "error" in cells.get(c, {})]
        if broken and all(ratio(results, row, a, b) is None for a, b in pairs):
            ax.text(1.0, j, "  error: " + ", ".join(broken), va="center", fontsize=7, color="red")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio (log scale; 1.0 = same as the reference)")
    ax.set_title(title, fontsize=10)
    if pairs:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
