"""``blipmq wal dump``: a consistent copy of a device's log, plus a manifest.

Safe while the broker runs: the segment files are only opened for reading (no lock, no
write, no rename in the data directory), and each copy ends after the last whole, valid
record it saw, so a write under way is left for the next dump. A segment retention deletes
meanwhile is skipped. Damaged bytes are not copied: they are counted in the manifest.

Layout of a dump (docs/ANALYTICS.md)::

    PATH/manifest.json        device id, format versions, offset and time range, segments
    PATH/wal/<segment>.seg    valid records only, byte for byte as the broker wrote them

Re-running into the same PATH only adds what is new: segments it has not copied, and the
records appended to a segment since the last run (appended to its copy). The manifest is
written last, through a temporary file and a rename, so an interrupted dump leaves the
previous one usable (a copy longer than its manifest says is cut back on the next run). A
first run writes a manifest listing no segment before it copies anything, so a first run
cut short is still a dump (of no listed segment) that the next run completes, while a
directory without a manifest is someone else's and refused.
Pure synchronous code; imports nothing beyond the runtime dependencies.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from blipmq_server.errors import WalError
from blipmq_server.wal import reader
from blipmq_server.wal import record as rec

FORMAT = "blipmq-wal-dump"
FORMAT_VERSION = 1

Progress = Callable[[int, int], None]  # bytes done, bytes in all


@dataclass(frozen=True, slots=True)
class Window:
    """Records kept by time (ms since the epoch; None: no bound). ``until`` is exclusive."""

    since: int | None = None
    until: int | None = None

    def keeps(self, ts: int) -> bool:
        return (self.since is None or ts >= self.since) and (self.until is None or ts < self.until)

    @property
    def everything(self) -> bool:
        return self.since is None and self.until is None


@dataclass(frozen=True, slots=True)
class DumpResult:
    device_id: str
    new_segments: int
    grown_segments: int
    records_added: int
    bytes_added: int
    damage: tuple[str, ...]  # one line per damaged part found in the source
    manifest: dict[str, Any]


def blipmq_version() -> str:
    from blipmq_server.version import version  # the build's own record when frozen

    return version()


def dump(data_dir: str, out: str, *, device_id: str | None = None, window: Window = Window(),
         progress: Progress | None = None) -> DumpResult:
    """Copy what is new in the log of ``data_dir`` into the dump at ``out``."""
    if device_id is not None and (why := reader.device_problem(device_id)) is not None:
        raise WalError(f"--device-id {why}: it names the device's partition in an export")
    source = reader.find_log(data_dir)
    if source.dump:
        raise WalError(f"{data_dir}: is a dump, not a data directory")
    old = _manifest(out)
    if old is not None:
        known = old.get("device_id")
        if device_id is not None and known != device_id:
            raise WalError(f"{out}: holds the dump of device {known!r}, not {device_id!r}")
        device_id = known
        if old.get("window") != _window_json(window):
            raise WalError(f"{out}: was dumped with another --since/--until "
                           f"({old.get('window')}); use a new output directory")
    device_id = device_id or socket.gethostname()
    if (why := reader.device_problem(device_id)) is not None:  # the hostname's
        raise WalError(f"the hostname {why}: give the device a name (--device-id ID)")
    entries: dict[str, dict[str, Any]] = {e["name"]: e for e in (old or {}).get("segments", [])}
    if old is None:
        # a first run writes its manifest (listing no segment) before copying anything: a
        # run cut short is then still this dump, and the next run completes it
        os.makedirs(out, exist_ok=True)
        old = _summary(device_id, window, [], None)
        _write_json(os.path.join(out, reader.MANIFEST), old)
    wal_out = os.path.join(out, reader.WAL_DIR)
    os.makedirs(wal_out, exist_ok=True)
    sizes = {p: _size(p) for p in source.segments}
    total = sum(max(0, s - entries.get(os.path.basename(p), {}).get("source_size", 0))
                for p, s in sizes.items())
    done = new = grown = added_records = added_bytes = 0
    damage: list[str] = [f"{os.path.basename(p)}: {reader.ODD}" for p in source.odd]
    damage += [f"{os.path.basename(p)}: {reader.STRAY}" for p in source.strays]
    last_name = os.path.basename(source.segments[-1]) if source.segments else ""
    for path in source.segments:
        name = os.path.basename(path)
        entry = entries.get(name)
        if sizes[path] is None or (entry is not None and entry["source_size"] == sizes[path]):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:  # retention removed it meanwhile
            continue
        if entry is not None and _rewritten(data, entry):
            # the broker's recovery set damage aside, and it may have grown past its old
            # size since: what was copied is not its start any more; copy it again
            damage.append(f"{name}: rewritten since the last dump (the broker's recovery set "
                          "damage aside); copied again")
            entry = None
        copied = _copy(data, name, os.path.join(wal_out, name), entry, window,
                       open_tail=name == last_name)
        entries[name] = copied.entry
        damage += [f"{name}: {d.problem} at byte {d.start} ({d.end - d.start} bytes not "
                   "copied)" for d in copied.damage]
        new += entry is None
        grown += entry is not None
        added_records += copied.records
        added_bytes += copied.bytes
        done += len(data) - (entry["source_size"] if entry else 0)
        if progress is not None:
            progress(min(done, total), total)
    manifest = _summary(device_id, window, sorted(entries.values(), key=lambda e: e["name"]),
                        old)
    _write_json(os.path.join(out, reader.MANIFEST), manifest)
    return DumpResult(device_id, new, grown, added_records, added_bytes, tuple(damage),
                      manifest)


@dataclass(frozen=True, slots=True)
class _Copied:
    entry: dict[str, Any]
    records: int
    bytes: int
    damage: tuple[reader.Damage, ...]


def _copy(data: bytes, name: str, target: str, entry: dict[str, Any] | None, window: Window,
          open_tail: bool) -> _Copied:
    """Append the valid records of ``data`` after ``entry``'s part to ``target``."""
    start = entry["source_size"] if entry else rec.HEADER_SIZE
    last = entry["last_offset"] if entry and entry["records"] else -1
    checked = reader.check(data, name, open_tail=open_tail, last_offset=last, start=start)
    kept = [(o, p) for o, p in checked.records
            if window.everything or window.keeps(_timestamp(data, p))]
    if not checked.damage and window.everything:
        body = data[start:checked.good_end]
    else:
        body = b"".join(data[p:_end(data, p)] for _, p in kept)
    if entry is None:
        base = kept[0][0] if kept and not window.everything else (checked.base or 1)
        body = rec.header(base) + body
        entry = {"name": name, "size": 0, "crc32c": 0, "records": 0, "first_offset": 0,
                 "last_offset": 0, "first_ms": 0, "last_ms": 0, "damaged_bytes": 0}
        mode = "wb"
    else:
        entry = dict(entry)
        _cut(target, entry["size"])
        mode = "ab"
    with open(target, mode) as f:
        f.write(body)
    if kept:
        if not entry["records"]:
            entry["first_offset"] = kept[0][0]
            entry["first_ms"] = _timestamp(data, kept[0][1])
        entry["last_offset"] = kept[-1][0]
        entry["last_ms"] = _timestamp(data, kept[-1][1])
    entry["records"] += len(kept)
    entry["size"] += len(body)
    entry["crc32c"] = crc32c(body, entry["crc32c"])
    entry["source_size"] = checked.good_end
    # the source's bytes copied so far, for a later dump to tell the segment was not
    # rewritten (``_rewritten``); carried on from the part checked before when it is known
    done = entry.get("source_crc32c")
    view = memoryview(data)
    entry["source_crc32c"] = (crc32c(view[:checked.good_end]) if done is None
                              else crc32c(view[start:checked.good_end], done))
    entry["damaged_bytes"] += checked.damaged_bytes
    return _Copied(entry, len(kept), len(body), checked.damage)


def _rewritten(data: bytes, entry: dict[str, Any]) -> bool:
    """Whether the source segment ``data`` no longer starts with the part an earlier dump
    copied: shorter than it, or other bytes (a manifest of an earlier version, without
    their CRC-32C, can tell only the first)."""
    size = entry["source_size"]
    if len(data) < size:
        return True
    known = entry.get("source_crc32c")
    return known is not None and crc32c(memoryview(data)[:size]) != known


def _timestamp(data: bytes, pos: int) -> int:
    return rec.FIXED.unpack_from(data, pos + rec.PREFIX.size)[2]


def _end(data: bytes, pos: int) -> int:
    return pos + 4 + rec.PREFIX.unpack_from(data, pos)[0]


def _cut(path: str, size: int) -> None:
    """A copy longer than its manifest entry (an interrupted run) goes back to that size."""
    if os.path.getsize(path) != size:
        os.truncate(path, size)


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def _window_json(window: Window) -> dict[str, int | None]:
    return {"since_ms": window.since, "until_ms": window.until}


def _summary(device_id: str, window: Window, entries: list[dict[str, Any]],
             old: dict[str, Any] | None) -> dict[str, Any]:
    full = [e for e in entries if e["records"]]
    now = int(time.time() * 1000)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "wal_format_version": rec.FORMAT_VERSION,
        "device_id": device_id,
        "blipmq_version": blipmq_version(),
        "created_ms": (old or {}).get("created_ms", now),
        "updated_ms": now,
        "window": _window_json(window),
        "records": sum(e["records"] for e in entries),
        "bytes": sum(e["size"] for e in entries),
        "damaged_bytes": sum(e["damaged_bytes"] for e in entries),
        "first_offset": full[0]["first_offset"] if full else None,
        "last_offset": full[-1]["last_offset"] if full else None,
        "first_ms": min((e["first_ms"] for e in full), default=None),
        "last_ms": max((e["last_ms"] for e in full), default=None),
        "segments": entries,
    }


def _manifest(out: str) -> dict[str, Any] | None:
    path = os.path.join(out, reader.MANIFEST)
    if not os.path.exists(path):
        # a first run cut short before its manifest was renamed into place leaves its
        # temporary file only
        if os.path.isdir(out) and set(os.listdir(out)) - {reader.MANIFEST + _TMP}:
            raise WalError(f"{out}: exists and is not a dump (no {reader.MANIFEST}); "
                           "give a new or empty directory")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as exc:
        raise WalError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise WalError(f"{path}: not a BlipMQ dump manifest")
    return found


def load_manifest(path: str) -> dict[str, Any] | None:
    """The manifest of the dump at ``path``, or None (not a dump, or unreadable)."""
    try:
        return _manifest(path) if os.path.isfile(os.path.join(path, reader.MANIFEST)) else None
    except WalError:
        return None


_TMP = ".tmp"


def _write_json(path: str, value: dict[str, Any]) -> None:
    tmp = path + _TMP
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
