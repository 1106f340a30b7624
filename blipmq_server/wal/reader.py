"""Reading a log that is not open: for ``blipmq wal``, dumps and the Spark source.

Finds the segment files under a path (a data directory, its ``wal/`` directory, a dump
made by ``blipmq wal dump``, one segment file, or a directory holding several of those; one
that holds a log of its own and others one level down is refused, docs/ANALYTICS.md) and
checks a segment's bytes with the code recovery uses (``record.scan``, ``record.resync``),
but repairs nothing: damage is a value (where, how many bytes, why) and every valid record
around it is kept. A segment that a running broker is appending to may end inside a record
(a write under way): that is a ``partial`` tail, left out and not counted as damage.

Standard library and ``crc32c`` only; no trio, no clock.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from blipmq_server.errors import WalError
from blipmq_server.kinds import Kind
from blipmq_server.wal import record as rec
from blipmq_server.wal.segment import SUFFIX, base_of, offset_named

MANIFEST = "manifest.json"  # what makes a directory a dump (``blipmq wal dump``)
WAL_DIR = "wal"  # where segments live, in a data directory and in a dump alike


class Damage(NamedTuple):
    start: int  # byte position in the segment
    end: int
    problem: str


@dataclass(frozen=True, slots=True)
class Checked:
    """One segment's bytes, checked: its valid records and the damage between them."""

    base: int | None  # the base offset its name (or else its header) states, as recovery
    records: list[tuple[int, int]]  # (offset, position) of every valid record, in order
    damage: tuple[Damage, ...]
    partial: int  # bytes of a torn tail left out (a write under way, or interrupted)
    size: int  # bytes looked at

    @property
    def good_end(self) -> int:
        """Where the readable part ends: what a copy may take without a cut record."""
        return self.size - self.partial

    @property
    def damaged_bytes(self) -> int:
        return sum(d.end - d.start for d in self.damage)


def check(data: bytes, name: str = "", *, open_tail: bool = True, last_offset: int = -1,
          start: int = rec.HEADER_SIZE) -> Checked:
    """Check a segment's bytes (``data`` from byte 0, header included).

    ``open_tail``: the segment may still be written (or a write was cut off), so a torn
    last record is a partial tail rather than damage. ``start`` skips bytes already checked
    (``last_offset`` is then the offset of the last valid record before it). Never raises
    on bad bytes.
    """
    size = len(data)
    base = base_of(os.path.basename(name)) if name else None
    header_ok = size >= rec.HEADER_SIZE
    if header_ok:
        magic, version, stated = rec.HEADER.unpack_from(data)
        header_ok = magic == rec.MAGIC and version == rec.FORMAT_VERSION
        base = stated if header_ok and base is None else base  # no CRC covers the header
    records: list[tuple[int, int]] = []
    damage: list[Damage] = []
    last = last_offset
    view = memoryview(data)  # the CRC of each record is taken over a view, not a copy
    pos: int | None = max(start, rec.HEADER_SIZE) if header_ok else None
    damage_at, problem, torn = 0, "unreadable segment header", size < rec.HEADER_SIZE
    if size >= rec.HEADER_SIZE and not header_ok and data[:6] == rec.MAGIC:
        version = rec.HEADER.unpack_from(data)[1]
        # a format this reader does not know: its records are not read as version 1's
        problem = (f"segment format version {version}, this reader knows "
                   f"{rec.FORMAT_VERSION} only; not read")
        return Checked(base, [], (Damage(0, size, problem),), 0, size)
    for _ in range(size + 1):  # each round moves forward: bounded by the size
        if pos is not None:
            scan = rec.scan(view, pos, last, bodies=True)
            records += scan.records
            if scan.records:
                last = scan.records[-1][0]
            if scan.problem is None:
                return Checked(base, records, tuple(damage), 0, size)
            damage_at, problem, torn = scan.good_end, scan.problem, scan.torn
        pos = rec.resync(data, damage_at, last, bodies=True)
        if pos is None:
            break
        damage.append(Damage(damage_at, pos, problem))
    if torn and open_tail and (damage_at > 0 or size < rec.HEADER_SIZE) and not (
            rec.ends_in_records(data, damage_at + 1)):  # records after it: damage, as recovery says
        return Checked(base, records, tuple(damage), size - damage_at, size)
    damage.append(Damage(damage_at, size, problem))
    return Checked(base, records, tuple(damage), 0, size)


# ------------------------------------------------------------------------------ finding logs


@dataclass(frozen=True, slots=True)
class LogFiles:
    """The segment files of one log: a data directory, a dump or a lone segment."""

    root: str  # the path as found
    segments: tuple[str, ...]  # segment file paths, in offset order
    dump: bool  # a dump made by ``blipmq wal dump`` (its manifest is in ``root``)
    odd: tuple[str, ...] = ()  # named like segments but not regular files (FIFOs, devices...)
    strays: tuple[str, ...] = ()  # *.seg files not named after an offset: not of the log


def find_log(path: str) -> LogFiles:
    """The log at ``path``; raises WalError when ``path`` holds none."""
    if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise WalError(f"{path}: not a regular file (a FIFO, a device or a socket)")
    if os.path.isfile(path):
        if not path.endswith(SUFFIX):
            raise WalError(f"{path}: not a segment file (a BlipMQ segment ends in {SUFFIX})")
        return LogFiles(path, (path,), False)
    if not os.path.isdir(path):
        raise WalError(f"{path}: no such file or directory")
    found = _log_in(path)
    if found is None:
        below = _logs_below(path, None)
        if below:
            raise WalError(f"{path}: a directory of {len(below)} log(s), one level down "
                           f"({_names(below)}): give one of them")
        raise WalError(f"{path}: holds no BlipMQ log (no {WAL_DIR}/ directory, no {SUFFIX} "
                       "files, no dump manifest)")
    return found


def find_logs(path: str) -> list[LogFiles]:
    """Every log at ``path``: the log itself, or each log one level below it (a directory of
    dumps, one per device). Raises WalError when there is none, and when ``path`` holds a
    log of its own (or a dump manifest) and logs one level down too: reading only one of
    them would make the others vanish without a word."""
    if os.path.isfile(path) or not os.path.isdir(path):
        return [find_log(path)]
    found = _log_in(path)
    below = _logs_below(path, found)
    own = _own(path, found)
    if own and below:
        raise WalError(f"{path}: ambiguous: it holds a log of its own ({own}) and "
                       f"{len(below)} log(s) one level down ({_names(below)}); move what does "
                       "not belong elsewhere, or name each log")
    if found is not None:
        return [found]
    if not below:
        raise WalError(f"{path}: holds no BlipMQ log or dump (no {WAL_DIR}/ directory, no "
                       f"{SUFFIX} files, no dump manifest, at its top or one level down)")
    deeper = _logs_deeper(path, below)
    if deeper:
        raise WalError(f"{path}: holds {len(below)} log(s) one level down ({_names(below)}) "
                       f"and more two levels down ({', '.join(deeper[:3])}"
                       f"{' and more' if len(deeper) > 3 else ''}), which a directory of "
                       "dumps does not read: move them up a level, or name each log")
    return below


def _logs_deeper(path: str, below: list[LogFiles]) -> list[str]:
    """The logs two levels below ``path`` under its subdirectories that are not logs
    themselves ("site1/pi-17"): a directory of dumps is read one level down, and those
    would be left out without a word."""
    logs = {os.path.normpath(log.root) for log in below}
    found = []
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if os.path.normpath(sub) in logs or not os.path.isdir(sub):
            continue
        try:
            inner = sorted(os.listdir(sub))
        except OSError:
            continue  # unreadable (lost+found): nothing of it was going to be read anyway
        found += [f"{name}/{n}" for n in inner
                  if os.path.isdir(os.path.join(sub, n)) and _log_in(os.path.join(sub, n))]
    return found


def _log_in(directory: str) -> LogFiles | None:
    """The log of ``directory`` itself: its ``wal/`` directory (a data directory or a dump),
    else the segment files at its top (a data directory's ``wal/`` given as such). A ``wal/``
    holding a dump manifest or a ``wal/`` of its own is not a log's segment directory (a log
    never holds either) but a device's dump named ``wal`` in a directory of dumps."""
    dump = os.path.isfile(os.path.join(directory, MANIFEST))
    sub = _wal_dir(directory)
    if sub is not None:
        return _files(directory, sub, dump)  # a log with no segment yet is still a log
    if _segment_names(directory):
        return _files(directory, directory, dump)
    return None


def _wal_dir(directory: str) -> str | None:
    """``directory``'s ``wal/``, when that is a log's segment directory: not where a log
    lives itself (a dump manifest, or a ``wal/`` of its own, in it)."""
    sub = os.path.join(directory, WAL_DIR)
    if not os.path.isdir(sub) or os.path.isfile(os.path.join(sub, MANIFEST)) or os.path.isdir(
            os.path.join(sub, WAL_DIR)):
        return None
    return sub


def _segment_names(where: str) -> list[str]:
    return sorted(n for n in os.listdir(where) if n.endswith(SUFFIX))


def _files(root: str, where: str, dump: bool) -> LogFiles:
    names = _segment_names(where)
    odd = [n for n in names if not regular(os.path.join(where, n))]
    strays = [n for n in names if not offset_named(n) and n not in odd]
    return LogFiles(root, tuple(os.path.join(where, n) for n in names
                                if n not in odd and n not in strays), dump,
                    tuple(os.path.join(where, n) for n in odd),
                    tuple(os.path.join(where, n) for n in strays))


def _logs_below(path: str, own: LogFiles | None) -> list[LogFiles]:
    """The logs one level below ``path``, but for ``own``'s segment directory."""
    mine = _wal_dir(path) if own is not None else None
    return [log for name in sorted(os.listdir(path))
            if os.path.join(path, name) != mine and os.path.isdir(os.path.join(path, name))
            and (log := _log_in(os.path.join(path, name))) is not None]


def _own(path: str, found: LogFiles | None) -> str:
    """What makes ``path`` a log of its own, in words ("" when nothing does)."""
    what = []
    if os.path.isfile(os.path.join(path, MANIFEST)):
        what.append(MANIFEST)
    if found is not None and _wal_dir(path) is not None:
        what.append(f"a {WAL_DIR}/ directory of segments")
    elif found is not None:
        names = [os.path.basename(p) for p in (*found.segments, *found.odd, *found.strays)]
        what.append(f"{len(names)} {SUFFIX} file(s) at its top: {_listed(sorted(names))}")
    return ", ".join(what)


def _names(logs: list[LogFiles]) -> str:
    return _listed([os.path.basename(log.root.rstrip("/")) for log in logs])


def _listed(names: list[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def regular(path: str) -> bool:
    """Whether ``path`` is a regular file (following links). Opening a FIFO named like a
    segment would wait for a writer forever; a device would never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # gone meanwhile, or unreadable: opening it says so


ODD = "not a regular file (a FIFO, a device or a socket); not read"
STRAY = "not named after an offset, as the log names its segments; not part of the log, not read"


# ------------------------------------------------------------------------- dump manifests


class Missing(NamedTuple):
    """What a dump's manifest lists and its files lack (or have unlisted)."""

    segment: str  # the segment's name ("manifest.json" for the manifest itself)
    bytes: int  # bytes missing (or extra)
    problem: str


DUMP_FORMAT = "blipmq-wal-dump"
DUMP_VERSION = 1
MAX_DEVICE_ID = 200  # characters: a directory name under an export, with room for "device="


def device_problem(device: object) -> str | None:
    """Why ``device`` cannot be a dump's ``device_id`` (None: it can). ``blipmq wal dump``
    refuses such an id at once, ``blipmq export`` a manifest that holds one."""
    if not isinstance(device, str):
        return f"is not text ({device!r})"
    if not device.strip():
        return "is empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in device):
        return "holds control characters"
    if len(device) > MAX_DEVICE_ID:
        return f"is longer than {MAX_DEVICE_ID} characters"
    return None


def load_manifest(root: str) -> tuple[dict | None, str | None]:
    """The manifest of the dump at ``root`` and what is wrong with it (None: nothing)."""
    try:
        with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({exc})"
    return _manifest_problem(found)


def parse_manifest(raw: bytes) -> tuple[dict | None, str | None]:
    try:
        return _manifest_problem(json.loads(raw))
    except ValueError as exc:
        return None, f"unreadable ({exc})"


def _manifest_problem(found: object) -> tuple[dict | None, str | None]:
    if not isinstance(found, dict) or found.get("format") != DUMP_FORMAT:
        return None, "not a BlipMQ dump manifest"
    if not isinstance(found.get("segments"), list):
        return None, "lists no segments"
    versions = (found.get("format_version"), found.get("wal_format_version"))
    if versions != (DUMP_VERSION, rec.FORMAT_VERSION):
        return found, (f"dump format version {versions[0]}, log format version {versions[1]}: "
                       f"this reader knows {DUMP_VERSION} and {rec.FORMAT_VERSION}; the "
                       "segments are read by their own headers")
    return found, None


def audit(manifest: dict, sizes: dict[str, int]) -> tuple[list[Missing], dict[str, int]]:
    """A dump's segment files (name -> size) against its manifest: a segment missing, cut
    short, longer or not listed is a problem. Also returns the CRC-32C each segment whose
    size matches must have (``crc_problem``)."""
    problems: list[Missing] = []
    crcs: dict[str, int] = {}
    listed: set[str] = set()
    for entry in manifest.get("segments", []):
        try:
            name, size = str(entry["name"]), int(entry["size"])
            what = (f"the manifest lists {int(entry['records']):,} record(s), offsets "
                    f"{entry['first_offset']}..{entry['last_offset']}")
            crc = int(entry["crc32c"])
        except (KeyError, TypeError, ValueError):
            problems.append(Missing(MANIFEST, 0, f"unreadable segment entry {entry!r}"))
            continue
        listed.add(name)
        have = sizes.get(name)
        if have is None:
            problems.append(Missing(name, size, f"segment missing: {what} in {size:,} bytes"))
        elif have < size:
            problems.append(Missing(name, size - have, f"segment cut short: {have:,} of "
                                    f"{size:,} bytes; {what}"))
        elif have > size:
            problems.append(Missing(name, have - size, f"segment {have - size:,} bytes longer "
                                    f"than the manifest's {size:,}"))
        else:
            crcs[name] = crc
    for name in sorted(set(sizes) - listed):
        problems.append(Missing(name, 0, "segment not listed in the dump's manifest"))
    return problems, crcs


def crc_problem(data: bytes, crc: int | None) -> str | None:
    if crc is None or rec.crc32c(data) == crc:
        return None
    return "CRC-32C differs from the dump's manifest: the copy changed after the dump"


def log_problems(log: LogFiles) -> tuple[list[Missing], dict[str, int] | None]:
    """What is wrong with a log as a whole, beyond each segment's bytes: files named like
    segments that are not regular files, and for a dump, its manifest against its files.
    Also the CRC each dump segment must have (None: not a dump)."""
    problems = [Missing(os.path.basename(p), 0, ODD) for p in log.odd]
    problems += [Missing(os.path.basename(p), 0, STRAY) for p in log.strays]
    if not log.dump:
        return problems, None
    manifest, problem = load_manifest(log.root)
    if problem is not None:
        problems.append(Missing(MANIFEST, 0, problem))
    if manifest is None:
        return problems, None
    sizes = {}
    for path in log.segments:
        try:
            sizes[os.path.basename(path)] = os.path.getsize(path)
        except OSError:
            pass
    found, crcs = audit(manifest, sizes)
    return problems + found, crcs


# -------------------------------------------------------------------------------- records


def records(data: bytes, checked: Checked) -> Iterator[rec.Record]:
    """The valid records of a checked segment, decoded, in order."""
    for _, pos in checked.records:
        yield rec.decode_at(data, pos)[0]


KIND_NAMES = {int(k): k.name.lower() for k in Kind}
