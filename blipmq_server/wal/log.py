"""The segmented write-ahead log: buffered appends, group-commit batches, syncs, reads by
offset and retention (docs/WAL.md). Recovery on open is in ``recovery.py``.

Appends only touch memory. ``take_batch`` hands everything appended since the last batch to
the caller as one ``Batch``; ``Batch.write`` does the blocking work (create segment files,
one write per segment, and, if asked, the sync in ``Batch.plan``) and is meant to run in a
worker thread while appends go on; then the owner calls ``commit`` or ``abort``. The log
knows what it has written and not fsynced (segment files, and the directory after a file
was created): one ``Sync`` covers all of it, with a batch or alone (``take_sync``, then
``synced`` or ``sync_failed``). One batch or sync is in flight at a time. A segment is
sealed when the log rotates past it; its append descriptor is closed then, so descriptors
stay bounded (``disk.py``). No trio, no clock: timestamps and ``now_ms`` come from the
caller.

``commit`` also hands what it made readable to the recent-records cache (``cache.py``), so
``read`` at recent offsets decodes from memory; ``read_files`` reads the segment files and
is safe in a worker thread. ``open`` and ``close`` empty the cache, retention trims it.
``Batch`` and ``Sync`` are in ``batch.py``.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple

from blipmq_server.errors import WalError
from blipmq_server.kinds import Kind
from blipmq_server.wal import record as rec
from blipmq_server.wal.batch import Batch, Part, Sync
from blipmq_server.wal.cache import RecentCache
from blipmq_server.wal.disk import Disk
from blipmq_server.wal.recovery import Recovery, recover
from blipmq_server.wal.segment import SUFFIX, Segment, segment_name

_MESSAGE = int(Kind.MESSAGE)

MiB = 1024 * 1024
_READ_CHUNK = 256 * 1024
_LOST_KEPT = 64
# room set aside on the log's disk for the records retention needs written (a full disk)
RESERVE_NAME = "reserve"
RESERVE_BYTES = MiB

__all__ = ["SUFFIX", "Batch", "Log", "LogOptions", "MiB", "Recovery", "Retention", "Segment",
           "Sync", "segment_name"]


class LogOptions(NamedTuple):
    segment_bytes: int = 64 * MiB
    retention_bytes: int = 0  # 0: no size cap
    retention_ms: int = 0  # 0: keep forever
    index_every: int = 64  # one sparse index entry per this many records
    cache_bytes: int = 4 * MiB  # recent committed records kept in memory for reads; 0: off


_first = itemgetter(0)
_end = itemgetter(1)


def _around(holes: list[tuple[int, int]], pos: int, stop: int) -> tuple[int, int]:
    """``pos`` moved past a damaged range it is in (or at), and where the valid bytes from
    there end: the next damaged range, or ``stop``. Records never straddle one."""
    i = bisect.bisect_right(holes, pos, key=_end)  # the first range ending after pos
    while i < len(holes) and holes[i][0] <= pos:
        pos = holes[i][1]
        i += 1
    return pos, min(stop, holes[i][0]) if i < len(holes) else stop


def _last_ts(seg: Segment) -> int:
    return seg.last_ts


class Retention:
    """What one round of retention removed (a plain class: cheaper to define than a
    dataclass, on every start)."""

    __slots__ = ("forced_below", "paths", "removed")

    def __init__(self) -> None:
        self.removed: list[str] = []  # segment file names, for the log line
        # offsets below this were needed but removed (size cap)
        self.forced_below: int | None = None
        self.paths: list[str] = []  # files still to delete (``delete=False``)


class Log:
    def __init__(
        self, directory: str, options: LogOptions | None = None, disk: Disk | None = None
    ) -> None:
        self.directory = directory
        self.options = options or LogOptions()
        self.disk = disk or Disk()
        self.segments: list[Segment] = []
        self.next_offset = 1
        self.written_offset = 0  # highest offset committed to the files
        self.synced_offset = 0  # every committed offset up to this one is fsynced
        self._in_flight: Batch | None = None
        self._syncing: Sync | None = None
        self._tail: Segment | None = None  # the segment appends go to
        self._batch_tail: Segment | None = None  # the tail when the last batch was taken
        self._pending = 0  # records appended and not yet taken into a batch
        self._pending_bytes = 0  # ... and their bytes
        self._pending_messages = 0  # ... of them MESSAGE records (the rest: bookkeeping)
        # Written and not fsynced: segments (by path, in log order) and the directory
        self._unsynced: dict[str, Segment] = {}
        self._dir_unsynced = False
        self._cache = RecentCache(self.options.cache_bytes)
        # offset ranges of batches the disk refused, newest last (a few are enough: a
        # publisher asks about its own records, appended moments ago)
        self.lost: list[tuple[int, int]] = []
        self.cache_hits = 0  # reads served wholly from the cache
        self.cache_misses = 0  # reads that went to the segment files

    # ---------------------------------------------------------------------------- recovery

    def open(self, on_record: Callable[[rec.Record], str | None] | None = None,
             message_flags: int = 0, bodies: bool = False) -> Recovery:
        """Scan every segment, cut a torn tail, set damaged bytes aside, index the rest
        (``wal/recovery.py``).

        ``on_record`` is called, in log order, with every valid record that is not a MESSAGE
        (group, ack and retained records), so their owner can rebuild its state in the same
        pass, and with every MESSAGE whose flags byte has a bit of ``message_flags`` (the
        broker asks for retained publishes). It returns None, or why it cannot read the
        record's body: that record is set aside as damaged. ``bodies`` (the broker): a
        record ``record.body_problem`` refuses (a MESSAGE whose lengths run past it) is
        damage too, so no reader is ever handed one.
        What an earlier run wrote may not have been fsynced: every segment kept, and the
        directory, count as unsynced until the first sync.
        """
        self._cache.drop()
        os.makedirs(self.directory, exist_ok=True)
        done = recover(self.directory, self.disk, self.options.index_every, on_record,
                       message_flags, bodies)
        self.segments = done.segments
        self._tail = self._batch_tail = self.segments[-1] if self.segments else None
        self.next_offset = done.next_offset
        self.written_offset = done.last_offset
        self.synced_offset = 0
        self._unsynced = {seg.path: seg for seg in self.segments}
        self._dir_unsynced = bool(self.segments)
        self._check_writable()
        return done.found

    def _check_writable(self) -> None:
        """Raise PermissionError (naming the path) at the start, when the directory or the
        segment the next records go to cannot be written, rather than refuse every write
        once serving. That segment stays open for appends from now on: should it be
        deleted before its first write, its descriptor still has it (``Disk.restore``)."""
        probe = os.path.join(self.directory, ".write-check")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.remove(probe)
        if self._tail is not None:
            self.disk.open(self._tail.path)

    # ----------------------------------------------------------------------------- appends

    def append(self, kind: int, body: bytes, timestamp_ms: int) -> int:
        """Buffer one record; returns its offset. Nothing touches the disk here."""
        return self.append_many(kind, (body,), timestamp_ms)

    def append_many(self, kind: int, bodies: Sequence[bytes], timestamp_ms: int) -> int:
        """Buffer records with consecutive offsets; returns the first one's offset.

        The broker's hot path: one call per PUBLISH frame. The records go to the tail
        segment in one ``extend`` unless they would take it past ``segment_bytes``.
        """
        first = self.next_offset
        records = rec.encode_many(kind, first, timestamp_ms, bodies)
        seg = self._tail or self._new_segment(first)
        if not seg.pending:
            seg.pending_first = first
        size = sum(map(len, records))
        if seg.projected + size <= self.options.segment_bytes:
            seg.pending.extend(records)
            seg.projected += size
        else:
            self._spread(seg, first, records, timestamp_ms)
        seg = self._tail
        seg.pending_ts = timestamp_ms
        self.next_offset = first + len(records)
        self._pending += len(records)
        self._pending_bytes += size
        if kind == _MESSAGE:
            self._pending_messages += len(records)
        return first

    def _spread(self, seg: Segment, offset: int, records: list[bytes], timestamp_ms: int
                ) -> None:
        """Append records one by one, opening a new segment whenever one fills up."""
        limit = self.options.segment_bytes
        for data in records:
            size = len(data)
            if seg.projected + size > limit and seg.projected > rec.HEADER_SIZE:
                seg.pending_ts = timestamp_ms
                seg = self._new_segment(offset)
                seg.pending_first = offset
            seg.pending.append(data)
            seg.projected += size
            offset += 1

    def _new_segment(self, base: int) -> Segment:
        seg = Segment(os.path.join(self.directory, segment_name(base)), base)
        self.segments.append(seg)
        self._tail = seg
        return seg

    @property
    def pending_records(self) -> int:
        return self._pending

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def pending_messages(self) -> int:
        """Pending MESSAGE records: what a consumer reading the log's tail waits for (group,
        ack and state records only keep the books)."""
        return self._pending_messages

    def take_batch(self) -> Batch | None:
        """Everything appended since the last batch, or None. Call ``commit`` or ``abort``."""
        if self._in_flight is not None or self._syncing is not None:
            raise WalError("a log batch or sync is already in progress")
        if not self._pending:
            return None
        parts = []
        tail = self._tail
        creates = False
        for seg in self.segments:
            if not seg.pending:
                continue
            base = seg.size if seg.created else rec.HEADER_SIZE
            starts = list(accumulate(map(len, seg.pending[:-1]), initial=base))
            parts.append(Part(seg, b"".join(seg.pending), starts, seg.pending_first,
                              seg.pending_ts, not seg.created))
            creates = creates or not seg.created
            seg.pending = []
        last = parts[-1]
        unsynced = self._unsynced
        if unsynced:
            covered = list(unsynced.values())
            covered += [p.segment for p in parts if p.segment.path not in unsynced]
        else:
            covered = [p.segment for p in parts]
        plan = Sync(covered, self.directory if creates or self._dir_unsynced else None,
                    self.directory)
        sealed = [p.segment for p in parts if p.segment is not tail]
        before = self._batch_tail  # its last records may have gone out with an earlier batch
        if before is not None and before is not tail and before not in sealed:
            sealed.append(before)
        self._batch_tail = tail
        self._in_flight = Batch(parts, parts[0].first_offset,
                                last.first_offset + len(last.starts) - 1, self._pending,
                                self.directory, plan, sealed)
        self._pending = self._pending_bytes = self._pending_messages = 0
        return self._in_flight

    def commit(self, batch: Batch) -> None:
        """The batch is on disk: make its records readable."""
        every = self.options.index_every
        for part in batch.parts:
            seg = part.segment
            if not seg.created:
                seg.created = True
                seg.size = rec.HEADER_SIZE
            seg.size += len(part.data)
            n = len(part.starts)
            for i in range(-seg.count % every, n, every):  # records numbered 0, every, 2*every..
                seg.index.append((part.first_offset + i, part.starts[i]))
            if seg.first < 0:
                seg.first = part.first_offset
            seg.last = part.first_offset + n - 1
            seg.last_ts = part.last_ts
            seg.count += n
        self.written_offset = batch.last_offset
        self._in_flight = None
        if batch.synced:
            self._mark_synced(batch.plan)
        else:
            for part in batch.parts:
                self._unsynced.setdefault(part.segment.path, part.segment)
                self._dir_unsynced = self._dir_unsynced or part.new_file
        for part in batch.parts:
            first = part.first_offset
            self._cache.add(first, first + len(part.starts) - 1, part.data, part.segment,
                            part.starts[0])

    def abort(self, batch: Batch) -> None:
        """The batch could not be written: its records are gone (their offsets stay unused,
        and ``lost`` names them)."""
        self.lost.append((batch.first_offset, batch.last_offset))
        del self.lost[:-_LOST_KEPT]
        for part in batch.parts:
            seg = part.segment
            seg.projected -= len(part.data)
            if not seg.created and not seg.pending and seg is not self._tail:
                self.segments.remove(seg)
        self._in_flight = None

    # ------------------------------------------------------------------------------- syncs

    @property
    def unsynced(self) -> bool:
        """Whether anything written is not fsynced yet (segment files or the directory)."""
        return bool(self._unsynced) or self._dir_unsynced

    def take_sync(self) -> Sync | None:
        """A sync of everything written and not fsynced, or None. Run it (``Sync.run``, in a
        worker thread), then call ``synced`` or ``sync_failed``."""
        if self._in_flight is not None or self._syncing is not None:
            raise WalError("a log batch or sync is already in progress")
        if not self.unsynced:
            return None
        self._syncing = Sync(list(self._unsynced.values()),
                             self.directory if self._dir_unsynced else None, self.directory)
        return self._syncing

    def synced(self, sync: Sync) -> None:
        """``sync`` ran: what it covered is durable."""
        self._syncing = None
        self._mark_synced(sync)

    def sync_failed(self, sync: Sync) -> None:
        """``sync`` failed: what it covered stays unsynced, for the next sync to retry."""
        self._syncing = None

    def _mark_synced(self, sync: Sync) -> None:
        unsynced = self._unsynced
        for seg in sync.segments:
            unsynced.pop(seg.path, None)
        if sync.directory is not None:
            self._dir_unsynced = False
        if not unsynced and not self._dir_unsynced:
            self.synced_offset = self.written_offset

    # ------------------------------------------------------------------------------- reads

    @property
    def first_offset(self) -> int:
        """The oldest offset the log holds, written, being written or still pending."""
        flying = self._in_flight.parts if self._in_flight is not None else ()
        for seg in self.segments:
            if seg.count:
                return seg.first
            # a segment whose records are all in the batch being written: not counted yet
            # and no longer pending (a fresh log's first records, the first after a roll)
            part = next((p for p in flying if p.segment is seg), None)
            if part is not None:
                return part.first_offset
            if seg.pending:
                return seg.pending_first
        return self.next_offset

    @property
    def pending_from(self) -> int:
        """The first offset appended and not committed yet (pending, or in the batch being
        written), or ``next_offset``. Offsets between ``written_offset`` and this one are
        never stored: a batch the disk refused, or damage recovery set aside."""
        if self._in_flight is not None:
            return self._in_flight.first_offset
        return self.next_offset - self._pending

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def read(
        self, from_offset: int, max_records: int = 1000, max_bytes: int = MiB
    ) -> list[rec.Record]:
        """Committed records with offset >= ``from_offset``, in order, within the limits.

        Served from the recent-records cache when ``from_offset`` is at or past its oldest
        offset (``cache_hits``); otherwise from the segment files (``cache_misses``), which
        then also serve the rest of that read.
        """
        if self.cached(from_offset):
            self.cache_hits += 1
            return self._cache.read(from_offset, max_records, max_bytes)
        return self.read_files(from_offset, max_records, max_bytes)

    def offset_at(self, timestamp_ms: int) -> int:
        """The offset of the first committed record stamped at or after ``timestamp_ms``, or
        ``written_offset + 1`` when there is none yet.

        Timestamps are taken as non-decreasing (a wall clock set back makes this the first
        such record of the first segment that reaches the time). A binary search over the
        segments' newest timestamps, then over the segment's sparse index (a few 25-byte
        reads of record headers), then at most ``index_every`` records read: the log is
        never scanned from its start.
        """
        segments = [s for s in self.segments if s.count]
        i = bisect.bisect_left(segments, timestamp_ms, key=_last_ts)
        if i == len(segments):
            return self.written_offset + 1
        seg = segments[i]
        index = seg.index
        lo, hi = 0, len(index)
        while lo < hi:  # the first index entry stamped at or after the time
            mid = (lo + hi) // 2
            if self._timestamp_at(seg, index[mid][1]) < timestamp_ms:
                lo = mid + 1
            else:
                hi = mid
        offset = index[lo - 1][0] if lo else seg.first
        while True:  # the segment's newest record qualifies: this ends within it
            records = self.read(offset, self.options.index_every + 1, MiB)
            if not records:
                return self.written_offset + 1
            for r in records:
                if r.timestamp_ms >= timestamp_ms:
                    return r.offset
            offset = records[-1].offset + 1

    def _timestamp_at(self, seg: Segment, pos: int) -> int:
        """The timestamp of the committed record at file position ``pos`` of ``seg``."""
        head = self.disk.pread(seg.path, pos, rec.RECORD_OVERHEAD)
        return rec.FIXED.unpack_from(head, rec.PREFIX.size)[2]

    def lost_between(self, first: int, last: int) -> bool:
        """Whether any record from ``first`` to ``last`` was in a batch the disk refused."""
        return any(a <= last and first <= b for a, b in self.lost)

    def cached(self, offset: int) -> bool:
        """Whether ``read`` at ``offset`` is served from the recent-records cache."""
        return self._cache.covers(offset)

    def read_files(
        self, from_offset: int, max_records: int = 1000, max_bytes: int = MiB
    ) -> list[rec.Record]:
        """``read`` from the segment files only. Safe in a worker thread while the event loop
        appends, commits and retains: it works on a snapshot of the segment list and reads
        committed bytes only, never a damaged range recovery left in a segment (``holes``);
        a segment deleted meanwhile raises OSError."""
        self.cache_misses += 1
        out: list[rec.Record] = []
        size = 0
        segments = list(self.segments)
        bases = [s.first if s.count else s.base for s in segments]
        i = max(0, bisect.bisect_right(bases, from_offset) - 1)
        for seg in segments[i:]:
            if not seg.count or seg.last < from_offset:
                continue
            j = bisect.bisect_right(seg.index, from_offset, key=_first) - 1
            pos = seg.index[j][1] if j >= 0 else rec.HEADER_SIZE
            stop = seg.size  # committed bytes now (a commit on the event loop may add more)
            holes = seg.holes
            end = stop
            while pos < stop and len(out) < max_records and size < max_bytes:
                if holes:  # damage recovery left in place: never read as records
                    pos, end = _around(holes, pos, stop)
                    if pos >= stop:
                        break
                chunk = self.disk.pread(seg.path, pos, min(end - pos, _READ_CHUNK))
                at, added = rec.decode_run(chunk, 0, out, max_records, max_bytes - size,
                                           from_offset)
                if at == 0 and len(chunk) >= rec.RECORD_OVERHEAD:
                    length, _ = rec.PREFIX.unpack_from(chunk)
                    if 4 + length > len(chunk):  # one record larger than the chunk: read it
                        chunk = self.disk.pread(seg.path, pos, 4 + length)
                        at, added = rec.decode_run(chunk, 0, out, max_records,
                                                   max_bytes - size, from_offset)
                size += added
                if at == 0:
                    raise WalError(f"{seg.path}: unreadable record at byte {pos}")
                pos += at
            if len(out) >= max_records or size >= max_bytes:
                break
        return out

    # --------------------------------------------------------------------------- retention

    def retain(self, now_ms: int, keep_from: int | None = None, *, delete: bool = True,
               hold_from: int | None = None, carried_from: int | None = None) -> Retention:
        """Drop whole old segments by total size and by age (never the newest one).

        A segment holding offsets >= ``keep_from`` (still needed by a durable group) is kept
        unless the size cap forces it out; then ``forced_below`` says what was lost. One
        holding offsets >= ``hold_from`` is kept even then (a bridge with the ``block``
        policy has not forwarded them: its publishers are held back instead). One holding
        offsets >= ``carried_from`` is always kept: the caller carried what a restart needs
        (checkpoints, retained values, states) from older segments to there, and a burst
        after that must not take them with it. The
        dropped segments leave the log at once; their files are deleted here, or, with
        ``delete=False``, listed in ``paths`` for the caller to pass to ``delete`` off the
        event loop (unlinking a 64 MiB segment takes 5-20 ms of the kernel's time).
        """
        opts = self.options
        result = Retention()
        total = self.total_bytes
        while len(self.segments) > 1:
            seg = self.segments[0]
            in_flight = self._in_flight is not None and any(
                p.segment is seg for p in self._in_flight.parts
            )
            if seg.pending or in_flight:
                break
            too_big = bool(opts.retention_bytes) and total > opts.retention_bytes
            too_old = bool(opts.retention_ms) and seg.count > 0 and (
                now_ms - seg.last_ts > opts.retention_ms
            )
            if not (too_big or too_old or (seg.count == 0 and seg.created)):
                break
            if carried_from is not None and seg.count > 0 and seg.last >= carried_from:
                break
            needed = keep_from is not None and seg.count > 0 and seg.last >= keep_from
            if needed and (not too_big or (hold_from is not None and seg.last >= hold_from)):
                break
            if needed:
                result.forced_below = seg.last + 1
            self.segments.pop(0)
            total -= seg.size
            self._unsynced.pop(seg.path, None)  # deleted: nothing of it to sync
            seg.removed = True  # a sync running now skips it (``Sync.run``)
            if seg.created:
                result.paths.append(seg.path)
            result.removed.append(os.path.basename(seg.path))
        if result.removed:
            self._cache.drop(self.first_offset)
        if delete:
            self.delete(result.paths)
            result.paths = []
        return result

    def missing(self) -> list[Segment]:
        """Blocking (any thread): the segments whose files are gone from the directory
        (deleted under the broker), the one being written excepted. Asked after
        ``Batch.restored`` or a file not found: what could not be written back."""
        return [seg for seg in list(self.segments) if seg.created and not seg.removed
                and seg is not self._tail and not os.path.exists(seg.path)]

    def drop(self, gone: list[Segment]) -> list[Segment]:
        """Segments whose files were deleted under the broker (``missing``) leave the log,
        as retention's do: their records are lost. Returns those that left (none that
        holds records not yet written)."""
        batch = self._in_flight
        left = [seg for seg in gone if seg in self.segments and seg is not self._tail
                and not seg.pending and not (batch is not None and any(
                    p.segment is seg for p in batch.parts))]
        for seg in left:
            self.segments.remove(seg)
            self._unsynced.pop(seg.path, None)
            seg.removed = True
            self.disk.forget(seg.path)
        if left:
            self._cache.drop(self.first_offset)
        return left

    @property
    def reserve_path(self) -> str:
        return os.path.join(self.directory, RESERVE_NAME)

    def make_reserve(self) -> int:
        """Blocking: set aside room on the log's disk (``RESERVE_BYTES``, less on a small
        disk) that ``release_reserve`` gives back when the disk is full, so that the records
        retention needs written can be; returns the bytes set aside (0: none, the disk
        refused)."""
        try:
            return self.disk.reserve(self.reserve_path, RESERVE_BYTES)
        except OSError:
            return 0

    def has_reserve(self) -> bool:
        return os.path.isfile(self.reserve_path)

    def release_reserve(self) -> bool:
        """Blocking: delete the reserve; whether there was one (a directory or the like
        put there is not one, and stays)."""
        if not os.path.isfile(self.reserve_path):
            return False
        try:
            self.disk.remove(self.reserve_path)
        except OSError:
            return False
        return True

    def delete(self, paths: list[str]) -> None:
        """Blocking: delete the files of segments ``retain`` dropped (any thread)."""
        for path in paths:
            try:
                self.disk.remove(path)
            except FileNotFoundError:
                pass  # gone already: what retention wanted

    def close(self) -> None:
        self._cache.drop()
        self.disk.close()
