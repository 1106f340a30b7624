"""A group-commit batch and a sync: the blocking work the flusher runs in a worker thread.

``Log.take_batch`` gathers what was appended since the last batch into a ``Batch`` (one
``Part`` per segment it touches); ``Batch.write`` writes each part with one call, fsyncs what
its ``Sync`` plan covers when asked, and closes the append descriptors of sealed segments.
A failed write undoes what it can and re-raises; the log then drops the batch (``abort``).
Standard library only; no trio. Plain slotted classes, not dataclasses: each start of the
broker defines them, and a dataclass costs about 0.3 ms of generated code there.
"""

from __future__ import annotations

import os

from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk
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

    __slots__ = ("directory", "segments")

    def __init__(self, segments: list[Segment], directory: str | None) -> None:
        self.segments = segments
        self.directory = directory

    @property
    def calls(self) -> int:
        """fsync calls ``run`` makes."""
        return len(self.segments) + (self.directory is not None)

    def run(self, disk: Disk) -> None:
        """Blocking: fsync every file, then the directory."""
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

    __slots__ = ("directory", "first_offset", "last_offset", "parts", "plan", "records",
                 "sealed", "synced")

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

    @property
    def seals(self) -> bool:
        """Whether the log rotated since the last batch (a segment is full)."""
        return bool(self.sealed)

    def write(self, disk: Disk, sync: bool) -> None:
        """Blocking: write, and fsync everything in ``plan`` if ``sync``; close the append
        descriptors of sealed segments. On failure, undo partial writes and re-raise."""
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
                disk.append(seg.path, rec.header(seg.base) + data if part.new_file else data)
                if any(seg is s for s in self.sealed):  # one batch may fill many segments
                    disk.seal(seg.path)
            if sync:
                self.plan.run(disk)
                self.synced = True
        except OSError:
            for seg, start in done:
                try:
                    disk.seal(seg.path)
                    if start:
                        disk.truncate(seg.path, start)
                    elif os.path.exists(seg.path):
                        disk.remove(seg.path)
                except OSError:
                    # The next write cuts it first. Should the broker stop before that, the
                    # next start keeps these records: never confirmed, at worst duplicates.
                    seg.stale = True
            raise
        finally:
            for seg in self.sealed:
                disk.seal(seg.path)
