"""A group-commit batch and a sync: the blocking work the flusher runs in a worker thread.

``Log.take_batch`` gathers what was appended since the last batch into a ``Batch`` (one
``Part`` per segment it touches); ``Batch.write`` writes each part with one call, fsyncs what
its ``Sync`` plan covers when asked, and closes the append descriptors of sealed segments.
A failed write undoes what it can and re-raises; the log then drops the batch (``abort``).
Neither says a record is stored before a check after its writes and fsyncs found every file
open for appends still at its path (``Disk.intact``); where one is not (the directory or
the file deleted under the broker), it is written back first (``Disk.restore``, and a new
segment this batch wrote and closed, from memory) and ``restored`` says so.
Standard library only; no trio. Plain slotted classes, not dataclasses: each start of the
broker defines them, and a dataclass costs about 0.3 ms of generated code there.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk, Restored
from blipmq_server.wal.segment import Segment


class Part:
    """One segment's share of a batch: its bytes, where each record starts, and offsets."""

    __slots__ = ("data", "first_offset", "last_ts", "new_file", "segment", "starts")

    def __init__(self, segment: Segment, data: bytes, starts: list[int], first_offset: int,
                 last_ts: int, new_file: bool) -> None:
        self.segment = segment
        self.data = data
        self.starts = starts  # file position of each record
        self.first_offset = first_offset
        self.last_ts = last_ts
        self.new_file = new_file  # this write creates the file


class Sync:
    """Everything written and not yet fsynced when it was taken: the segment files, and the
    directory when a file was created since the directory's last fsync. One ``run`` makes
    all of it durable (files first, then the directory that names them)."""

    __slots__ = ("directory", "home", "restored", "segments")

    def __init__(self, segments: list[Segment], directory: str | None, home: str) -> None:
        self.segments = segments
        self.directory = directory
        self.home = home  # the log's directory (``directory`` is set only to fsync it)
        self.restored: Restored | None = None  # set by ``run``: files deleted, written back

    @property
    def calls(self) -> int:
        """fsync calls ``run`` makes."""
        return len(self.segments) + (self.directory is not None)

    def run(self, disk: Disk, restore: Callable[[Disk], Restored] | None = None) -> None:
        """Blocking: fsync every file, then the directory; then check that every file open
        for appends is still at its path. Where one is not, or a file or the directory was
        gone for an fsync, ``restore`` (``Disk.restore`` by default) writes back what it
        can and everything is fsynced again: raises OSError if something is still gone
        (a closed segment deleted: its records are lost, the log drops it, ``missing``)."""
        try:
            self._fsync(disk)
            if disk.intact():
                return
        except FileNotFoundError:
            pass
        done = restore(disk) if restore is not None else disk.restore(self.home)
        self.restored = done.joined(self.restored)
        self._fsync(disk)
        if not disk.intact():
            raise OSError(errno.ENOENT, "the log's files were deleted again while they were "
                          "written back")

    def _fsync(self, disk: Disk) -> None:
        for seg in self.segments:
            try:
                disk.fsync(seg.path)
            except FileNotFoundError:
                if not seg.removed:
                    raise
                # retention deleted it meanwhile: nothing left to sync
        if self.directory is not None:
            disk.fsync_dir(self.directory)


class Batch:
    """Records appended since the previous batch, grouped by segment, ready to write."""

    __slots__ = ("_written", "directory", "first_offset", "last_offset", "parts", "plan",
                 "records", "restored", "sealed", "synced")

    def __init__(self, parts: list[Part], first_offset: int, last_offset: int, records: int,
                 directory: str, plan: Sync, sealed: list[Segment]) -> None:
        self.parts = parts
        self.first_offset = first_offset
        self.last_offset = last_offset
        self.records = records
        self.directory = directory
        # what a sync with this batch covers: its files and everything unsynced before
        self.plan = plan
        self.sealed = sealed  # full since the last batch: no more appends (the log rotated)
        self.synced = False  # set by ``write``: the batch and ``plan`` were fsynced
        # set by ``write``: files of the log were deleted and written back (or, on failure,
        # what was put back before it)
        self.restored: Restored | None = None
        self._written = 0  # parts written so far

    @property
    def seals(self) -> bool:
        """Whether the log rotated since the last batch (a segment is full)."""
        return bool(self.sealed)

    def write(self, disk: Disk, sync: bool) -> None:
        """Blocking: write, and fsync everything in ``plan`` if ``sync``; check that what
        was written is where a restart reads it (``Sync.run``), writing back what was
        deleted; close the append descriptors of sealed segments. On failure, undo partial
        writes and re-raise."""
        done: list[tuple[Segment, int]] = []
        try:
            for part in self.parts:
                seg, data = part.segment, part.data
                start = 0 if part.new_file else seg.size
                done.append((seg, start))
                if seg.stale:  # cut what an earlier failed batch left (the fault may be gone)
                    if start or os.path.exists(seg.path):
                        disk.truncate(seg.path, start)
                    seg.stale = False
                data = rec.header(seg.base) + data if part.new_file else data
                try:
                    disk.append(seg.path, data)
                except FileNotFoundError:
                    if not part.new_file:
                        raise
                    # the log's directory is gone: made again, with what it held put back
                    self.restored = self._restore(disk).joined(self.restored)
                    disk.append(seg.path, data)
                self._written += 1
                # One batch may fill many segments: each new one is closed once written
                # (its bytes are all in ``part``). One written before stays open until the
                # end: should it be deleted meanwhile, only its descriptor still has it all.
                if part.new_file and any(seg is s for s in self.sealed):
                    disk.seal(seg.path)
            if sync:
                self.plan.run(disk, self._restore)
                if self.plan.restored is not None:
                    self.restored = self.plan.restored.joined(self.restored)
                self.synced = True
            elif not disk.intact():
                self.restored = self._restore(disk).joined(self.restored)
                if not disk.intact():
                    raise OSError(errno.ENOENT, "the log's files were deleted again while "
                                  "they were written back")
        except OSError:
            for seg, start in done:
                try:
                    if start:  # through its descriptor: the file may be gone from its path
                        disk.truncate(seg.path, start)
                    else:
                        disk.seal(seg.path)
                        if os.path.exists(seg.path):
                            disk.remove(seg.path)
                except OSError:
                    # The next write cuts it first. Should the broker stop before that, the
                    # next start keeps these records: never confirmed, at worst duplicates.
                    seg.stale = True
            raise
        finally:
            for seg in self.sealed:
                disk.seal(seg.path)

    def _restore(self, disk: Disk) -> Restored:
        """Files of the log were deleted under it: ``Disk.restore`` (the directory, files
        open for appends), and each new segment this batch wrote and closed, gone with
        them, written again from memory (all of it is in its part)."""
        done = disk.restore(self.directory)
        names: list[str] = []
        size = 0
        for part in self.parts[: self._written]:
            path = part.segment.path
            if part.new_file and not disk.is_open(path) and not os.path.exists(path):
                data = rec.header(part.segment.base) + part.data
                disk.write_file(path, data)
                names.append(os.path.basename(path))
                size += len(data)
        if names:
            disk.fsync_dir(self.directory)
        return Restored(done.made, done.names + tuple(names), done.size + size)
