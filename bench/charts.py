"""PNG charts of bench/compare.py's rows (matplotlib, headless).

    python bench/charts.py docs/bench      # draw again from docs/bench/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"blipmq": "#1f77b4", "mosquitto": "#9467bd", "nats": "#2ca02c", "redis": "#d62728"}


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], log: bool = True) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width - 0.4 + width / 2 for g in range(len(groups))]
        ys = [v or 0 for v in values]
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name.split()[0]))
        for bar, v in zip(bars, values, strict=True):
            if v:
                ax.annotate(_short(v), (bar.get_x() + bar.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=7, rotation=90,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    if log:
        ax.set_yscale("log")
        ax.margins(y=0.3)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _short(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.3g}M"
    return f"{v / 1e3:.3g}k" if v >= 1e4 else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def draw(rows: list[dict], out: Path) -> list[Path]:
    written = []
    brokers = [b for b in ("blipmq", "mosquitto", "nats", "redis")
               if any(r["broker"] == b for r in rows)]

    def get(workload: str, broker: str, key: str, size: int | None = None):
        for r in rows:
            if r["workload"] == workload and r["broker"] == broker and (
                    size is None or r.get("size") == size):
                return r.get(key)
        return None

    tp = [r for r in rows if r["workload"].startswith("throughput")]
    if tp:
        groups = sorted({(r["workload"][11:], r["size"]) for r in tp},
                        key=lambda g: (g[0], g[1]))
        labels = [f"{w}\n{s:,} B" for w, s in groups]
        fig, axes = plt.subplots(2, 1, figsize=(10, 9))
        for ax, key, title in ((axes[0], "deliveries_per_s", "deliveries/s (log scale)"),
                               (axes[1], "mb_per_s", "MB/s delivered (log scale)")):
            _bars(ax, labels, {b: [get(f"throughput {w}", b, key, s) for w, s in groups]
                               for b in brokers})
            ax.set_title(title)
        fig.suptitle("Throughput, QoS 0, each broker with its Python client")
        fig.tight_layout()
        written.append(_save(fig, out / "throughput.png"))

    if any(r["workload"].startswith("latency") for r in rows):
        fig, ax = plt.subplots(figsize=(9, 5))
        keys = ["p50_us", "p95_us", "p99_us", "max_us"]
        _bars(ax, ["p50", "p95", "p99", "max"],
              {b: [get("latency 2000 msg/s", b, k) for k in keys] for b in brokers})
        ax.set_ylabel("microseconds (log scale)")
        ax.set_title("End-to-end latency at an open-loop 2,000 msg/s, 100 B")
        fig.tight_layout()
        written.append(_save(fig, out / "latency.png"))

    if any(r["workload"] == "broker" for r in rows):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        _bars(axes[0], ["idle RSS", "peak RSS"],
              {b: [get("broker", b, "idle_rss_mb"), get("broker", b, "peak_rss_mb")]
               for b in brokers}, log=False)
        axes[0].set_ylabel("MB")
        axes[0].set_title("Broker memory")
        axes[0].margins(y=0.25)
        _bars(axes[1], ["start-up to accepting"],
              {b: [get("broker", b, "startup_ms")] for b in brokers}, log=False)
        axes[1].set_ylabel("ms")
        axes[1].set_title("Start-up")
        axes[1].margins(y=0.25)
        fig.tight_layout()
        written.append(_save(fig, out / "memory.png"))

    if tp:
        fig, ax = plt.subplots(figsize=(10, 5))
        _bars(ax, labels, {b: [get(f"throughput {w}", b, "cpu_us_per_delivery", s)
                               for w, s in groups] for b in brokers})
        ax.set_ylabel("broker CPU us per delivered message (log scale)")
        ax.set_title("Broker CPU time (utime+stime) per delivery: lower is better")
        fig.tight_layout()
        written.append(_save(fig, out / "cpu.png"))

    if any(r["workload"].startswith("curve") for r in rows):
        written.append(_curves(rows, brokers, out / "curve.png"))
    return written


CURVE_AXES = (  # chart row: its title, and the curve workloads drawn in it (line style)
    ("subscriptions on the subscriber's connection (one matches)",
     (("subscriptions exact", "o-", "exact"), ("subscriptions wildcard", "s--", "wildcard"),
      ("new topic resolve", "^:", "new-topic publish"))),
    ("topics the messages are spread over", (("topics", "o-", ""),)),
    ("idle subscribed connections beside the traffic", (("connections", "o-", ""),)),
)


def _curves(rows: list[dict], brokers: list[str], path: Path) -> Path:
    """One row per axis: deliveries/s and broker CPU per delivery, every broker, log x."""
    fig, axes = plt.subplots(len(CURVE_AXES), 2, figsize=(13, 13))
    for (title, series), (rate_ax, cpu_ax) in zip(CURVE_AXES, axes, strict=True):
        for broker in brokers:
            for workload, style, label in series:
                pts = sorted(((r["scale"] or 0, r) for r in rows if r["broker"] == broker
                              and r["workload"] == f"curve {workload}"), key=lambda p: p[0])
                if not pts:
                    continue
                xs = [max(x, 1) for x, _ in pts]
                name = f"{broker} {label}".strip()
                kw = {"color": COLORS[broker], "label": name}
                rate_ax.plot(xs, [r["deliveries_per_s"] or None for _, r in pts], style, **kw)
                cpu_ax.plot(xs, [r["cpu_us_per_delivery"] or None for _, r in pts], style, **kw)
        for ax, what in ((rate_ax, "deliveries/s"), (cpu_ax, "broker CPU us per delivery")):
            ax.set_xscale("log")
            if any(y for line in ax.get_lines() for y in line.get_ydata() if y):
                ax.set_yscale("log")  # not when nothing is above 0 (a --quick run's CPU ticks)
                _at_least_a_decade(ax)
            ax.set_xlabel(title + (" (0 plotted at 1)" if ax is rate_ax and
                                   "subscriptions" in title else ""))
            ax.set_title(f"{what} (log scale)", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle("Cost curves: 1 -> 1 traffic, 100 B, as the work grows; each broker with its "
                 "Python client")
    fig.tight_layout()
    return _save(fig, path)


def _at_least_a_decade(ax) -> None:
    """Widen a log y-axis to span at least 10x, so that a 20 % wobble does not look steep."""
    low, high = ax.get_ylim()
    if high < 10 * low:
        middle = (low * high) ** 0.5
        ax.set_ylim(middle / 10 ** 0.5, middle * 10 ** 0.5)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    for drawn in draw(json.loads((folder / "results.json").read_text())["rows"], folder):
        print(drawn)
