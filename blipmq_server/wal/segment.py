"""One segment file of the log: its name, and what the log knows of it in memory.

Standard library only; no trio, no I/O.
"""

from __future__ import annotations

import os

from blipmq_server.wal import record as rec

SUFFIX = ".seg"
TEMP = ".tmp"  # a segment being rewritten by recovery (renamed over the segment when done)
CORRUPT = ".corrupt"


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SUFFIX}"


def base_of(name: str) -> int | None:
    """The base offset a segment file's name states, or None for a name not made by
    ``segment_name`` (also accepts the name of a file set aside from a segment)."""
    stem = name.split(".", 1)[0]
    return int(stem) if stem.isdigit() and len(stem) == 20 else None


def offset_named(name: str) -> bool:
    """Whether ``name`` is a segment's name as the log makes them (``segment_name``): a
    file named otherwise (``12.seg``, a copy kept as ``<name>.bak.seg``) is not part of the
    log, for recovery and every reader alike."""
    base = base_of(name)
    return base is not None and name == segment_name(base)


class Segment:
    """One segment file. ``size`` counts committed bytes (header included) on disk."""

    __slots__ = ("base", "count", "created", "first", "holes", "index", "last", "last_ts",
                 "path", "pending", "pending_first", "pending_ts", "projected", "removed",
                 "size", "stale")

    def __init__(self, path: str, base: int) -> None:
        self.path = path
        self.base = base
        self.size = 0
        self.created = False
        self.first = -1
        self.last = -1
        self.last_ts = 0
        self.count = 0
        self.index: list[tuple[int, int]] = []  # sparse (offset, position)
        # damaged byte ranges recovery left in the file (no room to rewrite it without
        # them), in file order: reads skip them
        self.holes: list[tuple[int, int]] = []
        # Appended, not yet written. Their offsets are contiguous from pending_first, so only
        # the encoded bytes are kept per record (the hot path appends one bytes object).
        self.pending: list[bytes] = []
        self.pending_first = 0
        self.pending_ts = 0  # timestamp of the newest pending record
        self.projected = rec.HEADER_SIZE  # file size once everything pending is written
        self.stale = False  # a failed batch left bytes after ``size`` that could not be cut
        self.removed = False  # retention deleted the file

    def __repr__(self) -> str:
        return f"Segment({os.path.basename(self.path)}, {self.first}..{self.last})"
