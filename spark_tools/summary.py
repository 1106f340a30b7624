"""The export's summary on the terminal: rich tables from the aggregates read back."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from blipmq_cli.literal import cell
from spark_tools.report import when


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("device", "topic", "group", "filter",
                                                        "reason", "segment") else "right")
    for row in rows:  # names and reasons any publisher chose: literal text (literal.py)
        table.add_row(*[f"{v:,}" if isinstance(v, int) else
                        cell(when(v)) if isinstance(v, datetime) else cell(v) for v in row])
    return table


def show(done: Any, output: str, top: int = 15) -> None:
    console = Console() if sys.stdout.isatty() else Console(width=160)
    agg = done.aggregates
    line = cell(f"exported {done.rows:,} records from {done.devices} device(s) to "
                f"{output}; damage skipped: {done.damaged_parts} part(s), "
                f"{done.damaged_bytes:,} bytes")
    line.stylize("bold", 0, len("exported"))
    console.print(line)
    devices = sorted(agg["devices"], key=lambda r: r["device"] or "")  # None: h30 #12
    console.print(_table("Devices", ["device", "messages", "bytes", "topics",
                                     "first seen (UTC)", "last seen (UTC)"],
                         [[r["device"], r["messages"], r["bytes"] or 0, r["topics"],
                           r["first_seen"], r["last_seen"]] for r in devices]))
    topics: dict[str, list[int]] = {}
    for r in agg["traffic"]:
        t = topics.setdefault(r["topic"] or "", [0, 0])
        t[0] += r["messages"]
        t[1] += r["bytes"] or 0
    ranked = sorted(topics.items(), key=lambda t: (-t[1][0], t[0]))[:top]
    console.print(_table("Top topics", ["topic", "messages", "bytes"],
                         [[t, n, b] for t, (n, b) in ranked]))
    groups = sorted(agg["groups"], key=lambda r: (r["device"] or "", r["group_name"] or ""))
    console.print(_table("Consumer groups", ["device", "group", "filter", "published", "acked",
                                             "lag", "deleted (UTC)"],
                         [[r["device"], r["group_name"], r["filter"], r["published"],
                           r["acked"], r["lag"], r.get("deleted") or ""] for r in groups]))
    if agg["dead_letters"]:
        console.print(_table("Dead letters", ["device", "topic", "reason", "messages"],
                             [[r["device"], r["topic"], r["reason"], r["messages"]]
                              for r in sorted(agg["dead_letters"],
                                              key=lambda r: (r["device"] or "",
                                                             r["topic"] or ""))]))
    if agg["damage"]:
        console.print(_table("Damage skipped", ["device", "segment", "parts", "bytes"],
                             [[r["device"], r["segment"], r["parts"], r["bytes"]]
                              for r in agg["damage"]]))
