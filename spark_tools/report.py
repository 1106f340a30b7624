"""The export's HTML report: one self-contained file (inline SVG and CSS, no scripts, nothing
fetched), so an analyst can open it anywhere, offline.

Charts: fleet traffic per minute (a line per device), top topics (bars), payload sizes
(a histogram by power-of-two bucket), consumer lag per group (bars); then the tables
behind them. Everything is escaped; values come from ``job.Exported.aggregates``.
"""

from __future__ import annotations

import contextlib
import html
import os
import secrets
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

W, H, PAD = 760, 260, 48
COLOURS = ["#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f", "#2c7a7b",
           "#97266d"]


def _esc(v: object) -> str:
    return html.escape(str(v))


def _axes(ymax: float, label: str) -> list[str]:
    out = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" class="axis"/>',
           f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" class="axis"/>']
    for i in range(5):
        y = H - PAD - i * (H - PAD - 10) / 4
        out.append(f'<text x="{PAD - 6}" y="{y + 4:.0f}" class="tick" text-anchor="end">'
                   f'{ymax * i / 4:,.{0 if ymax >= 8 else 2}f}</text>')
    out.append(f'<text x="12" y="{H / 2:.0f}" class="label" transform="rotate(-90 12 '
               f'{H / 2:.0f})" text-anchor="middle">{_esc(label)}</text>')
    return out


def utc(t: datetime) -> datetime:
    """``t`` in UTC (a naive time is taken as UTC already, as the export's session has it)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def when(t: object) -> str:
    """A time as the report and the summary show it: UTC, and saying so."""
    return utc(t).strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(t, datetime) else str(t)


def line_chart(series: dict[str, list[tuple[datetime, int]]], label: str) -> str:
    series = {d: [(utc(t), v) for t, v in pts] for d, pts in series.items()}
    points = [p for s in series.values() for p in s]
    if not points:
        return "<p>No messages.</p>"
    t0 = min(t for t, _ in points).timestamp()
    t1 = max(t for t, _ in points).timestamp()
    span = max(t1 - t0, 60.0)
    ymax = max(v for _, v in points) or 1
    out = _axes(ymax, label)
    for i, (device, pts) in enumerate(sorted(series.items(), key=lambda d: d[0] or "")):
        colour = COLOURS[i % len(COLOURS)]
        xy = [(PAD + (t.timestamp() - t0) / span * (W - PAD - 20),
               H - PAD - v / ymax * (H - PAD - 10)) for t, v in sorted(pts)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                   'stroke-width="2"/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in xy]
        out.append(f'<text x="{W - 12}" y="{20 + 14 * i}" class="legend" text-anchor="end" '
                   f'fill="{colour}">{_esc(device)}</text>')
    start = datetime.fromtimestamp(t0, UTC).strftime("%Y-%m-%d %H:%M")
    out.append(f'<text x="{PAD}" y="{H - PAD + 18}" class="tick">{_esc(start)} UTC</text>')
    return _svg(out)


def bar_chart(bars: list[tuple[str, float]], label: str) -> str:
    if not bars:
        return "<p>Nothing to show.</p>"
    ymax = max(v for _, v in bars) or 1
    out = _axes(ymax, label)
    step = (W - PAD - 20) / len(bars)
    for i, (name, value) in enumerate(bars):
        h = value / ymax * (H - PAD - 10)
        x = PAD + i * step + step * 0.1
        out.append(f'<rect x="{x:.1f}" y="{H - PAD - h:.1f}" width="{step * 0.8:.1f}" '
                   f'height="{h:.1f}" fill="{COLOURS[0]}"><title>{_esc(name)}: {value:,.0f}'
                   '</title></rect>')
        short = name if len(name) <= 18 else name[:17] + "…"
        out.append(f'<text x="{x + step * 0.4:.1f}" y="{H - PAD + 14}" class="tick" '
                   f'text-anchor="middle">{_esc(short)}</text>')
    return _svg(out)


def _svg(parts: list[str]) -> str:
    return (f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>')


def _rows(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_esc(_fmt(r.get(c)))}</td>" for c in columns)
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: object) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, datetime):
        return when(v)
    return "" if v is None else str(v)


def render(done: Any) -> str:
    agg = done.aggregates
    per_minute: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    for r in agg["rates"]:
        per_minute[r["device"]].append((r["minute"], r["messages"]))
    topics: dict[str, int] = defaultdict(int)
    for r in agg["traffic"]:
        topics[r["topic"] or ""] += r["messages"]
    top = sorted(topics.items(), key=lambda t: (-t[1], t[0]))[:12]
    buckets: dict[int, int] = defaultdict(int)
    for r in agg["sizes"]:
        buckets[r["size_up_to"]] += r["messages"]
    sizes = [(f"≤{b:,} B", n) for b, n in sorted(buckets.items())]
    # a device of None: an output written before device ids were checked (h30 #12)
    lag = [(f"{r['device']}/{r['group_name']}", r["lag"]) for r in
           sorted(agg["groups"], key=lambda r: (r["device"] or "", r["group_name"] or ""))]
    devices = sorted(agg["devices"], key=lambda r: r["device"] or "")
    traffic = sorted(agg["traffic"], key=lambda r: (-r["messages"], r["device"] or "",
                                                    r["topic"] or ""))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>BlipMQ fleet report</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1a202c; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
svg {{ background: #f7fafc; border: 1px solid #e2e8f0; }}
.axis {{ stroke: #4a5568; }} .tick {{ font-size: 10px; fill: #4a5568; }}
.label, .legend {{ font-size: 11px; }}
table {{ border-collapse: collapse; margin: 8px 0; }}
td, th {{ border: 1px solid #e2e8f0; padding: 3px 8px; text-align: right; }}
th {{ background: #edf2f7; }} td:first-child {{ text-align: left; }}
.figures span {{ display: inline-block; margin-right: 24px; }}
</style></head><body>
<h1>BlipMQ fleet report</h1>
<p class="figures"><span><b>{done.devices}</b> device(s)</span>
<span><b>{done.rows:,}</b> records exported</span>
<span><b>{sum(topics.values()):,}</b> messages</span>
<span><b>{done.damaged_parts}</b> damaged part(s) skipped ({done.damaged_bytes:,} bytes)</span></p>
<h2>Fleet traffic over time (messages per minute, UTC)</h2>{line_chart(per_minute, "messages")}
<h2>Top topics</h2>{bar_chart(top, "messages")}
<h2>Payload sizes</h2>{bar_chart(sizes, "messages")}
<h2>Consumer lag at dump time</h2>{bar_chart(lag, "messages not acked")}
<h2>Devices</h2>{_rows(devices, ["device", "messages", "bytes", "topics", "first_seen",
                                 "last_seen"])}
<h2>Traffic by device and topic</h2>{_rows(traffic, ["device", "topic", "messages", "bytes",
                                                   "size_p50", "size_p95", "size_p99"])}
<h2>Consumer groups</h2>{_rows(agg["groups"], ["device", "group_name", "filter", "published",
                                              "acked", "lag", "deleted"])}
<h2>Dead letters</h2>{_rows(agg["dead_letters"], ["device", "topic", "reason", "messages"])}
<h2>Damage skipped</h2>{_rows(agg["damage"], ["device", "segment", "parts", "bytes",
                                             "first_problem"])}
</body></html>
"""


def write(path: str, done: Any) -> None:
    """Write the report to a temporary file next to ``path`` and rename it there: a write
    that fails (a full disk) leaves the previous report whole, or no file, and no
    temporary (a link at ``path`` is followed: its target is replaced)."""
    put(os.path.realpath(path), render(done).encode("utf-8"))


def put(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``: all of it or, on any error, nothing."""
    where, name = os.path.split(path)
    tmp = os.path.join(where, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
