"""Recovery on open: check every segment, cut a torn tail, set damage aside, keep the rest.

Only the log's last record can be torn (an interrupted write). Damage followed by a valid
record is corruption: recovery finds where the damaged record ends by its own framing, and
the next valid record after it (``record.resync``: never inside its payload), moves the
damaged bytes to ``<segment>.<position>.corrupt``, and rewrites the segment without them
(temporary file, fsync, rename, fsync of the directory), so every valid record after the
damage is kept, in any segment. That takes room, up to a segment's size: on a file system
without it the damage stays where it is, and reads skip it (``Segment.holes``); a header is
repaired in place and a torn tail cut, neither needing room. A record whose CRC holds but
whose body its owner cannot read (``on_record`` says why) is damage too, set aside the same
way. The next offset is beyond every offset the files show as used, damaged records
included; when that is past the last valid record (or damage left in place ends the newest
segment), an empty segment named after it keeps it for later restarts. Runs
before the broker serves: plain blocking calls through the log's ``Disk``. Standard library
and ``crc32c``; no trio, no clock.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import NamedTuple

from blipmq_server.errors import WalError
from blipmq_server.kinds import Kind
from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk
from blipmq_server.wal.segment import (
    CORRUPT,
    SUFFIX,
    TEMP,
    Segment,
    base_of,
    offset_named,
    segment_name,
)


class Recovery:
    """What opening the log found; logged by the broker and counted in its metrics. (A
    plain class, ``Recovered`` a NamedTuple: a dataclass costs 0.3 ms to define, on every
    start.)"""

    __slots__ = ("in_place", "notes", "quarantined", "records", "segments", "torn_bytes")

    def __init__(self) -> None:
        self.segments = 0
        self.records = 0
        self.torn_bytes = 0  # bytes cut off a torn tail
        self.quarantined: list[str] = []  # files set aside
        # damaged parts left in their segment (no room to set them aside): ``<name>@<byte>``
        self.in_place: list[str] = []
        self.notes: list[str] = []


class Recovered(NamedTuple):
    """The segments recovery kept, the log's offsets, and what it found."""

    segments: list[Segment]
    last_offset: int  # of the newest valid record, 0 if none
    next_offset: int
    found: Recovery


def recover(
    directory: str,
    disk: Disk,
    index_every: int,
    on_record: Callable[[rec.Record], str | None] | None = None,
    message_flags: int = 0,
    bodies: bool = False,
) -> Recovered:
    """Scan and repair every segment of ``directory`` in offset order.

    ``on_record`` gets every valid record that is not a MESSAGE, and every MESSAGE whose
    flags have a bit of ``message_flags``, in log order. It returns None once it has taken
    the record, or why the record's body cannot be read: that record is then set aside as
    damaged (its offset stays used).
    """
    found = Recovery()
    names = disk.listdir(directory)
    for name in names:
        if name.endswith(SUFFIX + TEMP):  # a rewrite that did not finish: the segment is whole
            disk.remove(os.path.join(directory, name))
    names = [n for n in names if n.endswith(SUFFIX)]
    for name in [n for n in names if not _regular(os.path.join(directory, n))]:
        names.remove(name)  # reading a FIFO would wait for a writer, and the start with it
        found.notes.append(f"{name}: not a regular file (a FIFO, a device or a socket); "
                           "left alone, not part of the log")
    for name in [n for n in names if not offset_named(n)]:
        names.remove(name)  # a copy kept by someone: its records would repeat the log's
        found.notes.append(f"{name}: not named after an offset ({segment_name(1)} ...); "
                           "left alone, not part of the log")
    for name in names:  # before anything is repaired: a newer log is not ours to change
        _check_version(os.path.join(directory, name))
    bases = [base_of(n) for n in names]  # every name states one (``offset_named``)
    segments: list[Segment] = []
    last = used = 0  # newest valid offset; highest offset the files show as used
    for i, name in enumerate(names):
        below = bases[i + 1] if i + 1 < len(names) else None
        path = os.path.join(directory, name)
        seg, seen = _segment(path, disk, i == len(names) - 1, last, below, found,
                             index_every, on_record, message_flags, bodies)
        used = max(used, seen)
        if seg is None:
            continue
        segments.append(seg)
        if seg.count:
            last = seg.last
    next_offset = max(last + 1, used + 1, segments[-1].base if segments else 1)
    # damage left at the end of the newest segment: nothing may be appended after it (a
    # later start could take what follows for the damaged record's payload)
    damaged_end = bool(segments) and any(end == segments[-1].size
                                         for _, end in segments[-1].holes)
    if damaged_end:
        next_offset = max(next_offset, segments[-1].base + 1)
    if (next_offset > last + 1 or damaged_end) and (
            not segments or segments[-1].base < next_offset):
        # Damaged records used offsets past the last valid one; once their bytes are set
        # aside only a segment named after the next offset says so to a later restart.
        path = os.path.join(directory, segment_name(next_offset))
        _mandatory(lambda: disk.write_file(path, rec.header(next_offset)), directory,
                   f"a new segment, {os.path.basename(path)}", rec.HEADER_SIZE, disk)
        disk.fsync_dir(directory)
        seg = Segment(path, next_offset)
        seg.created = True
        seg.size = seg.projected = rec.HEADER_SIZE
        segments.append(seg)
        found.notes.append(f"offsets up to {next_offset - 1} were used by damaged records; "
                           f"new segment {os.path.basename(path)} goes on from {next_offset}")
    found.segments = len(segments)
    found.records = sum(s.count for s in segments)
    return Recovered(segments, last, next_offset, found)


def _check_version(path: str) -> None:
    """Raise WalError when the segment's header names a log format newer than this
    broker's and what follows it is not a record of ours: setting that aside as damage
    would hide what a newer BlipMQ logged from it after a downgrade and back. A newer
    version followed by a valid record is a damaged version field (a flipped bit), and an
    older or zero version, or a header that is not BlipMQ's, is damage: both repaired as
    before."""
    with open(path, "rb") as f:  # not ``Disk.pread``: it keeps the file open
        head = f.read(rec.HEADER_SIZE)
        if len(head) < rec.HEADER_SIZE:
            return
        magic, version, _ = rec.HEADER.unpack_from(head)
        if magic != rec.MAGIC or version <= rec.FORMAT_VERSION:
            return
        data = head + f.read()
    if len(data) == rec.HEADER_SIZE or rec.scan(data, rec.HEADER_SIZE).records:
        return  # nothing to hide, or records this broker reads: the header alone is wrong
    raise WalError(
        f"{path}: log format version {version}, this broker reads version "
        f"{rec.FORMAT_VERSION} only (written by a newer BlipMQ?): nothing was changed; run "
        "the newer version, or move the file out of the data directory if it is damaged")


def _segment(
    path: str,
    disk: Disk,
    is_last: bool,
    last: int,
    below: int | None,
    found: Recovery,
    index_every: int,
    on_record: Callable[[rec.Record], str | None] | None,
    message_flags: int = 0,
    bodies: bool = False,
) -> tuple[Segment | None, int]:
    """Check and repair one segment file; returns what is kept of it (None: nothing) and the
    highest offset its bytes show as used."""
    name = os.path.basename(path)
    directory = os.path.dirname(path)
    data = disk.read(path)
    base = base_of(name)  # the log names a segment after its first offset
    assert base is not None  # ``recover`` reads only such files (``offset_named``)
    used = base - 1 if base else 0
    if is_last and len(data) < rec.HEADER_SIZE:  # torn while being created
        disk.remove(path)
        found.torn_bytes += len(data)
        found.notes.append(f"{name}: torn segment header ({len(data)} bytes) removed")
        return None, used
    stated = None  # the base offset the header states, if the header is readable
    header_ok = len(data) >= rec.HEADER_SIZE
    if header_ok:
        magic, version, stated = rec.HEADER.unpack_from(data)
        header_ok = magic == rec.MAGIC and version == rec.FORMAT_VERSION
        stated = stated if header_ok else None
    records: list[tuple[int, int]] = []  # (offset, position) of every valid record
    others: list[int] = []  # positions of the valid records that are not MESSAGE
    runs: list[tuple[int, int]] = []  # byte ranges of valid records
    damaged: list[tuple[int, int, str]] = []  # byte ranges to set aside, and why
    pos: int | None = rec.HEADER_SIZE if header_ok else None
    damage_at, problem, torn = 0, "unreadable segment header", False
    for _ in range(len(data)):  # each round moves forward: bounded by the size
        if pos is not None:
            scan = rec.scan(data, pos, last, message_flags, bodies)
            records += scan.records
            others += scan.others
            if scan.records:
                last = scan.records[-1][0]
            if scan.good_end > pos:
                runs.append((pos, scan.good_end))
            if scan.problem is None:
                break
            damage_at, problem, torn = scan.good_end, scan.problem, scan.torn
        pos = rec.resync(data, damage_at, last, below, bodies=bodies)
        if pos is None:
            break
        damaged.append((damage_at, pos, problem))
    if on_record is not None:  # before the rewrite: a record refused is set aside with it
        refused_at: set[int] = set()
        for at in others:
            record, end = rec.decode_at(data, at)
            refused = on_record(record)
            if refused is not None:
                runs = _without(runs, at, end)
                damaged.append((at, end, f"{_kind_name(record.kind)} record {record.offset} "
                                         f"cannot be read ({refused})"))
                used = max(used, record.offset)
                refused_at.add(at)
        if refused_at:  # damage now, wherever its bytes end up
            records = [r for r in records if r[1] not in refused_at]
    if not runs and not header_ok:  # nothing valid in the file: set all of it aside
        aside = f"{path}.0{CORRUPT}"
        disk.rename(path, aside)
        disk.fsync_dir(directory)
        found.quarantined.append(os.path.basename(aside))
        found.notes.append(f"{name}: {problem} and no valid record; {len(data)} bytes set "
                           f"aside in {os.path.basename(aside)}")
        if is_last:
            used = max(used, _bound(data, 0, max(last, used), below))
        return None, used
    if header_ok and base != stated:  # no CRC covers the header: a flipped bit goes unseen
        found.notes.append(f"{name}: its header states base offset {stated}, its name says "
                           f"{base}; header rewritten")
    cut = None  # where a torn tail is cut
    if pos is None:  # the damage runs to the end of the file
        # a torn write ends the log; records running to the end after the damage (the
        # log's, after a damaged length) are not cut but set aside, for inspection
        if is_last and torn and not rec.ends_in_records(data, damage_at + 1):
            cut = damage_at
            found.torn_bytes += len(data) - cut
            found.notes.append(f"{name}: torn tail cut at byte {cut} ({len(data) - cut} "
                               f"bytes: {problem})")
        else:
            damaged.append((damage_at, len(data), problem))
            used = max(used, _bound(data, damage_at, last, below))
    damaged.sort()
    header_fix = not header_ok or base != stated
    # Damage followed by valid records can only leave the file in a rewritten copy (the
    # header alone is rewritten in place, a damaged end is cut): done when the file system
    # has room for it and the bytes set aside, else the damage stays where it is, skipped
    # by every read (``Segment.holes``), until a start with that room.
    copy = any(HEADER < end < len(data) for _, end, _ in damaged)
    free = need = 0
    if damaged:
        new = rec.HEADER_SIZE + sum(b - a for a, b in runs) if copy else 0
        free, block = disk.free(directory)
        need = sum(_blocks(n, block) for n in [new] + [end - a for a, end, _ in damaged])
    holes: list[tuple[int, int]] = []
    aside = bool(damaged) and need <= free and _set_aside(path, data, damaged, runs, base,
                                                          copy, disk, found)
    if damaged and not aside:
        holes = [(max(a, HEADER), end) for a, end, _ in damaged if end > HEADER]
        how = "rewrites the segment: it needs" if copy else "needs"
        for start, end, why in damaged:
            what = ("header rewritten in place" if end <= HEADER else
                    f"{end - start} bytes left in place, never read (setting them aside "
                    f"{how} {need} bytes free, there are {free}; a start with that room "
                    "does)")
            kept = "; the valid records after it are kept" if end < len(data) else ""
            if end > HEADER:
                found.in_place.append(f"{name}@{start}")
            found.notes.append(f"{name}: {why} at byte {start}; {what}{kept}")
        copy = False
    elif damaged and copy:  # rewritten from the valid records: a torn tail is gone too
        cut = None
        data = rec.header(base) + b"".join(data[a:b] for a, b in runs)
        scan = rec.scan(data, message_flags=message_flags, bodies=bodies)
        records, others = scan.records, scan.others
    elif damaged:  # set aside: what is left of the damage is a damaged end, cut
        cut = damaged[-1][0] if damaged[-1][1] == len(data) else cut
    if header_fix and not copy:  # 16 bytes, in place: torn, it is a damaged header again
        _mandatory(lambda: disk.overwrite(path, 0, rec.header(base)), directory,
                   f"{name}'s header", rec.HEADER_SIZE, disk)
    if cut is not None:
        disk.truncate(path, cut)
        disk.fsync(path)
        data = data[:cut]
    if aside or cut is not None:
        disk.fsync_dir(directory)
    seg = Segment(path, base)
    seg.created = True
    seg.size = seg.projected = len(data)
    seg.count = len(records)
    seg.holes = holes
    if records:
        seg.first, seg.last = records[0][0], records[-1][0]
        seg.index = records[::index_every]
        seg.last_ts = rec.decode_at(data, records[-1][1])[0].timestamp_ms
    return seg, used


HEADER = rec.HEADER_SIZE
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def _blocks(size: int, block: int) -> int:
    """``size`` bytes rounded up to whole blocks of the file system (what a file takes)."""
    return -(-size // block) * block


def _set_aside(path: str, data: bytes, damaged: list[tuple[int, int, str]],
               runs: list[tuple[int, int]], base: int, copy: bool, disk: Disk,
               found: Recovery) -> bool:
    """Write each damaged range to ``<segment>.<position>.corrupt`` and, with ``copy``,
    the segment without them to ``<segment>.tmp``, renamed over it (a crash leaves the old
    file or the new one). False, with nothing changed, when the disk has no room."""
    name = os.path.basename(path)
    written: list[str] = []
    try:
        for start, end, _ in damaged:
            aside = f"{path}.{start}{CORRUPT}"
            written.append(aside)  # before: a write refused halfway leaves a file too
            disk.write_file(aside, data[start:end])
        if copy:
            written.append(path + TEMP)
            disk.write_file(path + TEMP, rec.header(base) + b"".join(
                data[a:b] for a, b in runs))
            disk.rename(path + TEMP, path)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        for leftover in written:
            try:
                disk.remove(leftover)
            except FileNotFoundError:
                pass
        return False
    for start, end, why in damaged:
        aside = f"{name}.{start}{CORRUPT}"
        found.quarantined.append(aside)
        kept = "; the valid records after it are kept" if end < len(data) else ""
        found.notes.append(f"{name}: {why} at byte {start}; {end - start} bytes set aside "
                           f"in {aside}{kept}")
    return True


def _mandatory(write: Callable[[], object], directory: str, what: str, size: int,
               disk: Disk) -> None:
    """A write recovery cannot do without: on a full disk, the one line says how much room
    it needs."""
    try:
        write()
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        free, block = disk.free(directory)
        raise WalError(f"{directory}: recovery needs room for {what} ({size} bytes, "
                       f"{_blocks(size, block)} on this file system; {free} bytes free): "
                       "make room and start again") from None


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # reading it says what is wrong


def _without(runs: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges ``runs`` less ``start``..``end`` (one record inside one of them)."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if a <= start < b:
            out += [r for r in ((a, start), (end, b)) if r[0] < r[1]]
        else:
            out.append((a, b))
    return out


def _kind_name(kind: int) -> str:
    try:
        return Kind(kind).name
    except ValueError:  # pragma: no cover - scan checked the kind
        return f"kind {kind}"


def _bound(data: bytes, start: int, last: int, below: int | None) -> int:
    bound = rec.offset_bound(data, start, len(data), last)
    return bound if below is None else min(bound, below - 1)
