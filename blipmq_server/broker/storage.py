"""What the broker core needs of a log, and an in-memory log that provides it.

``MessageLog`` is the whole of it: the write-ahead log (``wal.log.Log``) implements it on
disk, ``MemoryLog`` in a list (the core's tests use it; nothing is ever durable there). A
record read back is a ``StoredRecord``. Record kinds come from ``blipmq_server.kinds``.
Pure: no trio, no clock, no files.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

READ_AHEAD_RECORDS = 1024  # one disk read for a log cursor: at most this many records
READ_AHEAD_BYTES = 256 * 1024  # ... and about this many bytes (at least one record)
_PRUNE_FROM = 1024  # ``Unwritten`` entries before the written ones are first pruned

K = TypeVar("K", bound=Hashable)


class StoredRecord(Protocol):
    """A record read back: also a 4-tuple in this order (both logs' records are named
    tuples), which the cursors' hot loop unpacks at once (``DurableGroup.take_new``)."""

    def __iter__(self) -> Iterator[int | bytes]: ...

    @property
    def kind(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def timestamp_ms(self) -> int: ...

    @property
    def body(self) -> bytes: ...


class MessageLog(Protocol):
    """Appends are buffered (offsets are assigned at once); ``written_offset`` is the last
    one readable; reads come back in offset order."""

    @property
    def next_offset(self) -> int:
        """The offset the next append gets."""
        ...

    @property
    def written_offset(self) -> int:
        """The highest offset stored (readable); below ``next_offset`` while appends wait."""
        ...

    @property
    def first_offset(self) -> int:
        """The oldest offset the log still holds, written or waiting."""
        ...

    @property
    def pending_from(self) -> int:
        """The first offset appended and not written yet (waiting, or in the batch being
        written): ``next_offset`` when nothing waits. No offset between ``written_offset``
        and this one is ever stored: the disk refused its batch, or recovery set damage
        there aside."""
        ...

    def append(self, kind: int, body: bytes, timestamp_ms: int) -> int:
        """Buffer one record; returns its offset."""
        ...

    def append_many(self, kind: int, bodies: Sequence[bytes], timestamp_ms: int) -> int:
        """Buffer records with consecutive offsets; returns the first one's."""
        ...

    def cached(self, offset: int) -> bool:
        """Whether ``read`` at ``offset`` is served from memory (no disk read)."""
        ...

    def offset_at(self, timestamp_ms: int) -> int:
        """The first stored record stamped at or after ``timestamp_ms`` (timestamps taken
        as non-decreasing), or ``written_offset + 1``."""
        ...

    def read(
        self, from_offset: int, max_records: int = ..., max_bytes: int = ...
    ) -> Sequence[StoredRecord]:
        """Stored records with offset >= ``from_offset``, within the limits (at least one
        when there is one)."""
        ...


class MemoryRecord(NamedTuple):
    kind: int
    offset: int
    timestamp_ms: int
    body: bytes


class MemoryLog:
    """A ``MessageLog`` in memory. Appends wait until ``store()`` (what the flusher's batch
    does for the write-ahead log); ``cached`` is True from ``cached_from`` on, so tests can
    make a cursor ask for disk reads."""

    def __init__(self, cached_from: int = 0) -> None:
        self.records: list[MemoryRecord] = []
        self.next_offset = 1
        self.written_offset = 0
        self.cached_from = cached_from

    @property
    def first_offset(self) -> int:
        return self.records[0].offset if self.records else self.next_offset

    @property
    def pending_from(self) -> int:
        return self.written_offset + 1

    def append(self, kind: int, body: bytes, timestamp_ms: int) -> int:
        return self.append_many(kind, (body,), timestamp_ms)

    def append_many(self, kind: int, bodies: Sequence[bytes], timestamp_ms: int) -> int:
        first = self.next_offset
        self.records += (MemoryRecord(kind, first + i, timestamp_ms, b)
                         for i, b in enumerate(bodies))
        self.next_offset += len(bodies)
        return first

    def store(self) -> None:
        self.written_offset = self.next_offset - 1

    def cached(self, offset: int) -> bool:
        return offset >= self.cached_from

    def read(
        self, from_offset: int, max_records: int = 1000, max_bytes: int = 1 << 20
    ) -> list[MemoryRecord]:
        records = self.records
        i = bisect.bisect_left(records, from_offset, key=_offset)
        out: list[MemoryRecord] = []
        size = 0
        for r in records[i:]:
            if r.offset > self.written_offset or len(out) >= max_records or size >= max_bytes:
                break
            out.append(r)
            size += len(r.body)
        return out

    def offset_at(self, timestamp_ms: int) -> int:
        stored = [r for r in self.records if r.offset <= self.written_offset]
        i = bisect.bisect_left(stored, timestamp_ms, key=_timestamp)
        return stored[i].offset if i < len(stored) else self.written_offset + 1

    def drop_below(self, offset: int) -> None:
        """Retention: forget records below ``offset``."""
        self.records = [r for r in self.records if r.offset >= offset]


def _offset(record: MemoryRecord) -> int:
    return record.offset


def _timestamp(record: MemoryRecord) -> int:
    return record.timestamp_ms


class Unwritten(Generic[K]):
    """Each key's newest record offset while the log may not have written it: what the
    core restates after a batch the disk refused (``Broker.relog``). Entries the log has
    written are pruned whenever the map doubled since the last pruning, so it stays about
    as large as what is unwritten, at a cost per note that does not grow with it."""

    def __init__(self, log: MessageLog | None) -> None:
        self.log = log
        self.at: dict[K, int] = {}
        self._prune_at = _PRUNE_FROM

    def note(self, key: K, offset: int) -> None:
        at = self.at
        at[key] = offset
        if len(at) >= self._prune_at and self.log is not None:
            written = self.log.written_offset
            for k in [k for k, o in at.items() if o <= written]:
                del at[k]
            self._prune_at = max(_PRUNE_FROM, 2 * len(at))

    def get(self, key: K) -> int:
        return self.at.get(key, 0)

    def forget(self, key: K) -> None:
        self.at.pop(key, None)

    def between(self, first: int, last: int) -> list[K]:
        """The keys whose newest record is one of ``first``..``last``, oldest first."""
        return sorted((k for k, o in self.at.items() if first <= o <= last),
                      key=self.at.__getitem__)
