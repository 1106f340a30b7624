"""``blipmq wal dump|inspect|cat``: a device's log, copied, summarised or printed.

These run on the device, inside the edge executable: pure Python on the runtime
dependencies (rich for tables and progress), nothing of Spark. Records are decoded by the
log's own code (``blipmq_server.wal``, ``protocol.message``, ``broker.durable`` for GROUP and
ACK bodies). Damage is reported, one line per damaged part on stderr, and skipped; it never
stops a command. Exit codes: 0 done (damage included), 2 a path that holds no log or a bad
option, 130 interrupted.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from blipmq_cli import commands
from blipmq_cli.dump import Window, dump
from blipmq_cli.exits import Exit
from blipmq_cli.literal import cell, json_visible, visible
from blipmq_server.broker import durable
from blipmq_server.broker.retained import parse_carry
from blipmq_server.broker.topics import matches, split
from blipmq_server.errors import BlipError, ProtocolError
from blipmq_server.kinds import Kind
from blipmq_server.protocol import message as msg
from blipmq_server.protocol.names import WIRE_TOPIC_BYTES, filter_problem
from blipmq_server.wal import reader
from blipmq_server.wal import record as rec

app = typer.Typer(help="Read the write-ahead log: dump it for analytics, inspect it, print it.",
                  no_args_is_help=True)

_MESSAGE, _GROUP, _ACK = int(Kind.MESSAGE), int(Kind.GROUP), int(Kind.ACK)
_RETAINED, _STATE = int(Kind.RETAINED), int(Kind.STATE)
_OPS = {durable.CREATE: "create", durable.DELETE: "delete", durable.IDLE: "idle",
        durable.CHECKPOINT: "checkpoint"}
_BODY = rec.RECORD_OVERHEAD  # a record's body starts here


def parse_time(text: str) -> int:
    """ms since the epoch from an ISO 8601 time (UTC unless it says), a date, or an int.

    A bare number of 4 or 8 digits is a year or a date (``2026``, ``20261127``, ISO 8601's
    basic form): as ms since the epoch it would fall on 1 January 1970, which nobody means.
    """
    word = text.strip()
    if word.isascii() and word.isdigit():
        if len(word) not in (4, 8):
            return int(word)
        try:  # 2026 -> 2026-01-01, 20261127 -> 2026-11-27
            when = datetime(int(word), 1, 1) if len(word) == 4 else datetime.strptime(
                word, "%Y%m%d")
        except ValueError:
            raise BlipError(f"{text!r} is not a date: a bare number of 4 or 8 digits is a "
                            "year or a date (2026, 20261127); ms since the epoch are longer "
                            "(1795363200000)") from None
        return int(when.replace(tzinfo=UTC).timestamp() * 1000)
    try:
        when = datetime.fromisoformat(word)
    except ValueError:
        raise BlipError(f"{text!r} is not a time (ISO 8601, e.g. 2026-11-22T16:00:00Z or "
                        "2026-11-22, or ms since the epoch)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    if not 0 <= ms <= rec.MAX_TIMESTAMP_MS:  # readers refuse such records; never a crash
        return f"{ms} ms"
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def _guard(fn: Callable[[], int]) -> int:
    """``commands.guarded``, plus: a path or option we refuse is a usage error (2)."""
    def run() -> int:
        try:
            return fn()
        except BlipError as exc:
            commands.say(str(exc))
            return Exit.USAGE
    return commands.guarded(run)


# ------------------------------------------------------------------------------ segments


@dataclass(frozen=True, slots=True)
class Loaded:
    name: str
    data: bytes
    checked: reader.Checked


def segments(path: str, report: Callable[[str], None]) -> Iterator[Loaded]:
    """Each segment of the log at ``path``, read and checked; damage goes to ``report``."""
    log = reader.find_log(path)
    problems, crcs = reader.log_problems(log)
    for p in problems:  # a missing segment, a file that is not one, a manifest's complaint
        lost = f"; {p.bytes:,} bytes" if p.bytes else ""
        report(f"{p.segment}: {p.problem}{lost}")
    for i, seg in enumerate(log.segments):
        name = os.path.basename(seg)
        if not reader.regular(seg):  # replaced by a FIFO meanwhile
            report(f"{name}: {reader.ODD}")
            continue
        try:
            with open(seg, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # retention removed it meanwhile
            continue
        # a dump is sealed: a record cut off at its end is damage, not a write under way
        checked = reader.check(data, name,
                               open_tail=not log.dump and i == len(log.segments) - 1)
        if crcs is not None and not checked.damage and (
                bad := reader.crc_problem(data, crcs.get(name))):  # unexplained by damage
            report(f"{name}: {bad}")
        for d in checked.damage:
            report(f"{name}: {d.problem} at byte {d.start}; {d.end - d.start} bytes skipped")
        yield Loaded(name, data, checked)


# -------------------------------------------------------------------------------- inspect


@dataclass
class SegmentRow:
    name: str
    records: int = 0
    size: int = 0
    first: int | None = None
    last: int | None = None
    first_ms: int | None = None
    last_ms: int | None = None
    damaged: int = 0
    partial: int = 0


@dataclass
class Survey:
    """What ``wal inspect`` shows: counted in one pass over every valid record."""

    segments: list[SegmentRow] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    topics: dict[str, list[int]] = field(default_factory=dict)  # topic -> [count, bytes]
    groups: set[tuple[str, str]] = field(default_factory=set)
    dead: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    damage: list[str] = field(default_factory=list)


def survey(path: str) -> Survey:
    out = Survey()
    unpack_fixed = rec.FIXED.unpack_from
    unpack_head = msg.MSG_HEAD.unpack_from
    for seg in segments(path, out.damage.append):
        row = SegmentRow(seg.name, len(seg.checked.records), seg.checked.size,
                         damaged=seg.checked.damaged_bytes, partial=seg.checked.partial)
        data = seg.data
        kinds: Counter[int] = Counter()
        for _, pos in seg.checked.records:
            kind, _, ts = unpack_fixed(data, pos + 8)
            kinds[kind] += 1
            if row.first_ms is None or ts < row.first_ms:
                row.first_ms = ts
            if row.last_ms is None or ts > row.last_ms:
                row.last_ms = ts
            if kind == _MESSAGE:
                flags, _, tlen, _, plen = unpack_head(data, pos + _BODY)
                start = pos + _BODY + msg.HEAD_SIZE
                topic = data[start:start + tlen].decode("utf-8", "replace")
                counts = out.topics.setdefault(topic, [0, 0])
                counts[0] += 1
                counts[1] += plen
                out.dead += bool(flags & msg.FLAG_DEAD)
            elif kind == _GROUP:
                body = rec.decode_at(data, pos)[0].body
                try:
                    g = durable.parse_group(body)
                    out.groups.add((g.topic_filter, g.group))
                except (struct.error, UnicodeDecodeError):
                    out.damage.append(f"{seg.name}: unreadable GROUP body at byte {pos}")
        if seg.checked.records:
            row.first, row.last = seg.checked.records[0][0], seg.checked.records[-1][0]
        for kind, n in kinds.items():
            out.kinds[reader.KIND_NAMES.get(kind, str(kind))] += n
        out.segments.append(row)
        if row.first_ms is not None:
            out.first_ms = min(out.first_ms or row.first_ms, row.first_ms)
            out.last_ms = max(out.last_ms or row.last_ms or 0, row.last_ms or 0)
    return out


def _show(path: str, s: Survey, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    total = sum(r.records for r in s.segments)
    head = cell(f"{path}: {len(s.segments)} segment(s), {total:,} record(s), "
                f"{iso(s.first_ms)} .. {iso(s.last_ms)}")
    head.stylize("bold", 0, len(visible(path)))
    console.print(head)
    table = Table(title="Segments", title_justify="left")
    for col in ("segment", "records", "bytes", "offsets", "first", "last", "damaged bytes"):
        table.add_column(col, justify="right" if col in ("records", "bytes") else "left")
    for r in s.segments:
        offsets = f"{r.first}..{r.last}" if r.first is not None else "-"
        damaged = f"{r.damaged:,}" + (f" (+{r.partial:,} partial)" if r.partial else "")
        table.add_row(cell(r.name), f"{r.records:,}", f"{r.size:,}", offsets, iso(r.first_ms),
                      iso(r.last_ms), damaged)
    console.print(table)
    kinds = Table(title="Records by kind", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("records", justify="right")
    for k in ("message", "group", "ack"):
        kinds.add_row(k, f"{s.kinds.get(k, 0):,}")
    kinds.add_row("dead letters (messages)", f"{s.dead:,}")
    kinds.add_row("durable groups named", f"{len(s.groups):,}")
    console.print(kinds)
    topics = Table(title="Topics", title_justify="left")
    topics.add_column("topic")
    topics.add_column("messages", justify="right")
    topics.add_column("payload bytes", justify="right")
    ranked = sorted(s.topics.items(), key=lambda t: (-t[1][0], t[0]))
    for topic, (n, size) in ranked[:top]:
        topics.add_row(cell(topic), f"{n:,}", f"{size:,}")  # any publisher's: literal.py
    if len(ranked) > top:
        topics.add_row(f"... {len(ranked) - top} more", "", "")
    console.print(topics)
    if s.damage:
        console.print(f"[bold red]Damage found[/]: {len(s.damage)} part(s)")
        for line in s.damage:
            console.print(cell(f"  {line}"))
    else:
        console.print("No damage found.")


# ------------------------------------------------------------------------------------ cat


def record_json(segment: str, r: rec.Record) -> dict[str, Any]:
    """One record as ``wal cat --format json`` prints it (raises on an unreadable body)."""
    out: dict[str, Any] = {"segment": segment, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                           "time": iso(r.timestamp_ms),
                           "kind": reader.KIND_NAMES.get(r.kind, str(r.kind))}
    if r.kind == _MESSAGE:
        m = msg.message_from_record(r.body)
        try:
            payload, encoding = m.payload.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            payload, encoding = base64.b64encode(m.payload).decode(), "base64"
        out |= {"topic": m.topic, "qos": m.qos, "ttl_ms": m.ttl_ms,
                "key": base64.b64encode(m.key).decode() if m.key is not None else None,
                "payload": payload, "encoding": encoding}
        dead = msg.dead_of(r.body)
        if dead is not None:
            out["dead_letter"] = {"deliveries": dead.deliveries, "reason": dead.reason}
        if m.retain:
            out["retain"] = True
    elif r.kind == _RETAINED:  # a retained value carried forward: its original publish
        offset, timestamp_ms, body = parse_carry(r.body)
        m = msg.message_from_record(body)
        out |= {"topic": m.topic, "retained_offset": offset,
                "retained_timestamp_ms": timestamp_ms, "payload_bytes": len(m.payload)}
    elif r.kind == _GROUP:
        g = durable.parse_group(r.body)
        out |= {"op": _OPS.get(g.op, str(g.op)), "filter": g.topic_filter, "group": g.group,
                "start": g.start}
        if g.op == durable.CHECKPOINT:
            out |= {"group_id": g.group_id, "unacked": list(g.unacked), "acked": list(g.acked)}
    elif r.kind == _ACK:
        group_id, floor, offsets = durable.parse_ack(r.body)
        out |= {"group_id": group_id, "floor": floor, "offsets": list(offsets)}
    elif r.kind == _STATE:  # a front end's saved state (an MQTT persistent session)
        (n,) = struct.unpack_from(">H", r.body)
        out |= {"key": r.body[2:2 + n].decode("utf-8", "replace"),
                "value_bytes": len(r.body) - 2 - n}
    return out


def cat(path: str, fmt: str, topic_filter: str | None) -> int:
    if fmt not in ("json", "lines"):
        raise BlipError(f"--format must be json or lines, not {fmt!r}")
    if topic_filter is not None and (problem := filter_problem(topic_filter, WIRE_TOPIC_BYTES)):
        raise BlipError(problem)
    wanted = split(topic_filter) if topic_filter is not None else None
    out = sys.stdout.buffer
    for seg in segments(path, commands.say):
        chunk: list[bytes] = []
        for r in reader.records(seg.data, seg.checked):
            if (wanted is not None or fmt == "lines") and r.kind != _MESSAGE:
                continue
            try:
                if fmt == "lines":
                    m = msg.message_from_record(r.body)
                    if wanted is None or matches(wanted, split(m.topic)):
                        chunk.append(m.payload + b"\n")
                    continue
                row = record_json(seg.name, r)
            except (struct.error, UnicodeDecodeError, ProtocolError, IndexError):
                commands.say(f"{seg.name}: record {r.offset} has an unreadable body; skipped")
                continue
            if wanted is None or matches(wanted, split(row["topic"])):
                chunk.append(json_visible(json.dumps(row, ensure_ascii=False)).encode() + b"\n")
            if len(chunk) >= 1024:
                out.write(b"".join(chunk))
                chunk = []
        out.write(b"".join(chunk))
    out.flush()
    return Exit.OK


# ----------------------------------------------------------------------------- commands


@app.command("dump")
def dump_command(
    data_dir: Annotated[str, typer.Option("--data-dir", help="The broker's data directory")],
    out: Annotated[str, typer.Option("--out", help="Dump directory (re-runs add what is new)")],
    device_id: Annotated[
        str | None, typer.Option("--device-id", help="Device name \\[default: the hostname]")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only records at or after TIME: ISO 8601 "
                                 "(2026-11-27T10:00:00Z, 2026-11-27, 20261127, 2026; UTC unless "
                                 "it says) or ms since the epoch")
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Only records before TIME (as --since)")
    ] = None,
) -> None:
    """Copy the log (sealed segments and the written part of the active one) for analytics.

    Safe while the broker runs. Writes PATH/manifest.json and PATH/wal/*.seg.
    """
    def run() -> int:
        window = Window(parse_time(since) if since else None, parse_time(until) if until else None)
        with _progress() as progress:
            done = dump(data_dir, out, device_id=device_id, window=window, progress=progress)
        for line in done.damage:
            commands.say(line)
        m = done.manifest
        commands.say(f"dump of {done.device_id} in {out}: {done.records_added:,} new record(s) "
                     f"({done.new_segments} new segment(s), {done.grown_segments} grown); "
                     f"{m['records']:,} record(s) in all, offsets {m['first_offset']}.."
                     f"{m['last_offset']}")
        return Exit.OK
    raise typer.Exit(_guard(run))


class _progress:
    """A progress bar on stderr when it is a terminal; otherwise nothing."""

    def __enter__(self) -> Callable[[int, int], None] | None:
        if sys.stderr is None or not sys.stderr.isatty():  # closed (2>&-), or not a terminal
            self.bar = None
            return None
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("dumping", total=None)
        shown = [-1]

        def update(done: int, total: int) -> None:
            # drawn at once for each percent more (a refresh timer alone can miss a quick dump)
            percent = done * 100 // total if total else 100
            self.bar.update(self.task, completed=done, total=total,  # type: ignore[union-attr]
                            refresh=percent != shown[0])
            shown[0] = percent
        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


@app.command("inspect")
def inspect_command(
    path: Annotated[str, typer.Argument(help="A data directory, a dump or a segment file")],
    top: Annotated[int, typer.Option("--top", help="Topics to list, busiest first")] = 50,
) -> None:
    """Summarise a log: segments, records by kind, topics, time range, damage."""
    def run() -> int:
        found = survey(path)
        _show(path, found, top)
        return Exit.OK
    raise typer.Exit(_guard(run))


@app.command("cat")
def cat_command(
    path: Annotated[str, typer.Argument(help="A data directory, a dump or a segment file")],
    fmt: Annotated[str, typer.Option("--format", help="json (every record) | lines (payloads)")
                   ] = "json",
    topic: Annotated[
        str | None, typer.Option("--topic", help="Only messages whose topic matches FILTER")
    ] = None,
) -> None:
    """Print the log's records, oldest first: one JSON object or one payload per line."""
    raise typer.Exit(_guard(lambda: cat(path, fmt, topic)))
