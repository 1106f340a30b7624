"""``blipmq stats``, ``groups``, ``ping`` and ``version``: what the broker says about itself.

Statistics come over the protocol (STATS, docs/PROTOCOL.md "Statistics"), so these work
wherever ``pub`` and ``sub`` do, without the metrics listener. Tables are drawn with rich
(imported here, never by the fast commands); ``--json`` prints the broker's report as one
JSON line. Every command returns an exit code (``exits.Exit``); errors are one line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from blipmq_cli.client import Client, connect_from_env
from blipmq_cli.exits import Exit
from blipmq_cli.literal import cell, json_visible, visible
from blipmq_server.protocol.codec import VERSION
from blipmq_server.version import version


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _uptime(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    return (f"{days}d " if days else "") + f"{hours:02d}:{minutes:02d}:{s:02d}"


def _groups_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="groups", title_justify="left")
    for name in ("filter", "group", "kind", "backlog", "in flight", "consumers"):
        table.add_column(name, justify="right" if name in ("backlog", "in flight", "consumers")
                         else "left")
    for g in report.get("groups", []):  # names any client chose: literal text (literal.py)
        table.add_row(*map(cell, (g["filter"], g["group"],
                                  "durable" if g["durable"] else "memory", g["backlog"],
                                  g["in_flight"], g["consumers"])))
    omitted = report.get("groups_omitted", 0)
    if omitted:
        table.caption = cell(f"{omitted} more group(s) not listed")
    return table


def _render(report: dict[str, Any], addr: str) -> Any:
    from rich.console import Group
    from rich.table import Table

    log = report.get("log")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("broker", f"{report.get('broker', '?')} {report.get('version', '?')} at {addr} "
                   f"(protocol {report.get('protocol', '?')})"),
        ("uptime", _uptime(report.get("uptime_s", 0))),
        ("connections", str(report.get("connections", 0))),
        ("subscriptions", f"{report.get('subscriptions', 0)} "
                          f"({report.get('subscribers', 0)} without a group)"),
        ("in flight", str(report.get("in_flight", 0))),
        ("log", "off" if log is None else f"{_size(log['bytes'])} in {log['segments']} "
                                          f"segment(s), offsets {log['first_offset']}-"
                                          f"{log['next_offset'] - 1}"),
        ("retained", f"{report['retained']['topics']} topic(s), "
                     f"{_size(report['retained']['bytes'])}"),
    ]
    m = report.get("messages", {})
    rows.append(("messages", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in m.items())))
    drops = report.get("drops", {})
    rows.append(("dropped", ", ".join(f"{k} {v}" for k, v in drops.items())))
    mqtt = report.get("mqtt")
    if mqtt and (mqtt.get("online") or mqtt.get("offline") or mqtt.get("wills_published")
                 or mqtt.get("protocol_errors") or mqtt.get("qos0_dropped")):
        errors = ", ".join(f"{k} {v}" for k, v in sorted(mqtt["protocol_errors"].items()))
        # QoS 0 publishes dropped, by reason (an older broker's report has none)
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(mqtt.get("qos0_dropped", {}).items()))
        bridges = mqtt.get("bridges")  # sessions that connected as a bridge (level 0x84)
        rows.append(("mqtt", f"{mqtt['online']} online"
                             + (f" ({bridges} bridge(s))" if bridges else "")
                             + f", {mqtt['offline']} offline "
                             f"session(s), {mqtt['inflight']} in flight, "
                             f"{mqtt['wills_published']} will(s) published"
                             + (f"; protocol errors: {errors}" if errors else "")
                             + (f"; QoS 0 dropped: {dropped}" if dropped else "")))
    for name, value in rows:
        summary.add_row(name, cell(value))
    topics = Table(title="topics", title_justify="left")
    topics.add_column("topic")
    topics.add_column("messages", justify="right")
    topics.add_column("bytes", justify="right")
    topics.add_column("retained")
    for t in report.get("topics", []):
        topics.add_row(*map(cell, (t["topic"], t["messages"], _size(t["bytes"]),
                                   "yes" if t["retained"] else "")))
    omitted = report.get("topics_omitted", 0)
    if omitted:
        topics.caption = cell(f"{omitted} more topic(s) not listed")
    return Group(summary, topics, _groups_table(report))


def _json_line(report: dict[str, Any]) -> None:
    # the exact strings: JSON escapes C0 controls, json_visible the others
    sys.stdout.write(json_visible(json.dumps(report, ensure_ascii=False)) + "\n")
    sys.stdout.flush()


def _restricted(report: dict[str, Any]) -> bool:
    """A report for a key that is not an admin's: it names the broker, nothing more."""
    if not report.get("restricted"):
        return False
    from blipmq_cli.commands import say

    say(f"statistics are for admin keys (docs/SECURITY.md); {report.get('key', 'this key')!r}"
        " is not one")
    return True


def stats(*, addr: str | None, api_key: str | None, watch: bool = False,
          interval: float = 1.0, as_json: bool = False) -> int:
    if not 0 < interval <= 86400:  # nan, inf and 1e300 too (time.sleep refuses them)
        from blipmq_cli.commands import say

        say("--interval must be a number of seconds above 0, at most 86400")
        return Exit.USAGE
    with connect_from_env(addr, api_key) as client:
        if _restricted(client.stats()):
            return Exit.AUTH
        if as_json:
            while True:
                _json_line(client.stats())
                if not watch:
                    return Exit.OK
                time.sleep(interval)
        from rich.console import Console

        console = Console()
        if not watch:
            console.print(_render(client.stats(), client.addr))
            return Exit.OK
        if not sys.stdout.isatty():
            # a pipe or a file: one table per refresh, each written out at once; written
            # here, not by rich, which exits 1 when the reader goes away (`| head`): a
            # BrokenPipeError ends the command quietly, exit 0, as `sub | head` does
            while True:
                with console.capture() as table:
                    console.print(_render(client.stats(), client.addr))
                sys.stdout.write(table.get() + "\n")
                sys.stdout.flush()
                time.sleep(interval)
        from rich.live import Live

        with Live(_render(client.stats(), client.addr), console=console,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(_render(client.stats(), client.addr), refresh=True)


def groups(*, addr: str | None, api_key: str | None, as_json: bool = False) -> int:
    with connect_from_env(addr, api_key) as client:
        report = client.stats()
    if _restricted(report):
        return Exit.AUTH
    if as_json:
        _json_line({"groups": report.get("groups", []),
                    "groups_omitted": report.get("groups_omitted", 0)})
        return Exit.OK
    from rich.console import Console

    Console().print(_groups_table(report))
    return Exit.OK


def _bridges_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="bridges", title_justify="left")
    right = ("backlog", "bytes", "oldest", "in flight", "forwarded", "redelivered",
             "reconnects", "dropped", "dead")
    for name in ("bridge", "link", *right, "last error"):
        table.add_column(name, justify="right" if name in right else "left")
    for b in report.get("bridges", []):
        age = b["oldest_age_s"]
        table.add_row(*map(cell, (
            b["name"], f"up {b['address']}" if b["connected"] else "down",
            b["backlog_messages"], b["backlog_bytes"],
            "-" if age is None else f"{age:.1f} s", b["in_flight"], b["forwarded"],
            b["redelivered"], b["reconnects"], b["dropped"],
            b["dead_lettered"], b["last_error"] or "-")))  # an upstream's words, too
    omitted = report.get("bridges_omitted", 0)
    if omitted:
        table.caption = cell(f"{omitted} more bridge(s) not listed")
    return table


def bridges(*, addr: str | None, api_key: str | None, as_json: bool = False) -> int:
    with connect_from_env(addr, api_key) as client:
        report = client.stats()
    if _restricted(report):
        return Exit.AUTH
    if as_json:
        _json_line({"bridges": report.get("bridges", []),
                    "bridges_omitted": report.get("bridges_omitted", 0)})
        return Exit.OK
    if not report.get("bridges") and not report.get("bridges_omitted"):
        sys.stdout.write("no bridges configured ([[bridge]] in the broker's config file)\n")
        return Exit.OK
    from rich.console import Console

    # a terminal: its width; a pipe or a file: wide enough for every column on one line
    Console(width=None if sys.stdout.isatty() else 200).print(_bridges_table(report))
    return Exit.OK


def ping(*, addr: str | None, api_key: str | None, count: int = 1) -> int:
    if count < 1:
        from blipmq_cli.commands import say

        say("--count must be at least 1")
        return Exit.USAGE
    with connect_from_env(addr, api_key) as client:
        for i in range(count):
            rtt = client.ping()
            sys.stdout.write(f"pong from {client.addr}: time={rtt * 1000:.3f} ms\n")
            sys.stdout.flush()
            if i + 1 < count:
                time.sleep(1)
    return Exit.OK


def versions(*, addr: str | None, api_key: str | None, as_json: bool = False) -> int:
    """The client's version, then the broker's (asked over the protocol)."""
    client_line = {"client": version(), "protocol": VERSION}
    if not as_json:
        sys.stdout.write(f"client {version()} (protocol {VERSION})\n")
        sys.stdout.flush()
    client: Client = connect_from_env(addr, api_key)
    with client:
        report = client.stats()
    if as_json:
        _json_line({**client_line, "broker": report.get("version"),
                    "broker_protocol": report.get("protocol"), "addr": client.addr})
    else:
        sys.stdout.write(visible(f"broker {report.get('version')} "
                                 f"(protocol {report.get('protocol')}) at {client.addr}")
                         + "\n")
    return Exit.OK
