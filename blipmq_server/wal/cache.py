"""The log's recent-records cache: what was committed last, kept in memory for reads.

``Log.commit`` hands each batch part's bytes here (whole records with contiguous offsets,
exactly what was written, shared, not copied); the deque is bounded by
``LogOptions.cache_bytes`` of record bytes (the small per-chunk Python overhead is not
counted). A read at or past the oldest cached offset decodes from memory and never touches
the disk. Only committed bytes are cached; retention drops the chunks of deleted segments.
Used on the event loop only (the worker thread that reads for consumers reads the files).
Standard library only; no trio.
"""

from __future__ import annotations

import bisect
from collections import deque
from operator import itemgetter
from typing import NamedTuple

from blipmq_server.wal import record as rec
from blipmq_server.wal.segment import Segment

_first = itemgetter(0)


class _Chunk(NamedTuple):
    """One committed ``Part`` kept for reads: its records' bytes, shared, not copied."""

    first: int
    last: int
    data: bytes
    segment: Segment
    start: int  # file position of data[0] in the segment, to seek through its sparse index


class RecentCache:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes of record data; 0: nothing is cached
        self._chunks: deque[_Chunk] = deque()
        self.size = 0

    def covers(self, offset: int) -> bool:
        chunks = self._chunks
        return bool(chunks) and offset >= chunks[0].first

    def add(self, first: int, last: int, data: bytes, segment: Segment, start: int) -> None:
        if self.limit <= 0:
            return
        chunks = self._chunks
        chunks.append(_Chunk(first, last, data, segment, start))
        self.size += len(data)
        while self.size > self.limit and len(chunks) > 1:
            self.size -= len(chunks.popleft().data)

    def drop(self, below: int | None = None) -> None:
        """Forget chunks holding offsets below ``below`` (all of them if None)."""
        chunks = self._chunks
        while chunks and (below is None or chunks[0].first < below):
            self.size -= len(chunks.popleft().data)

    def read(self, from_offset: int, max_records: int, max_bytes: int) -> list[rec.Record]:
        """Cached records from ``from_offset`` (``covers`` it), within the limits."""
        out: list[rec.Record] = []
        if max_records <= 0 or max_bytes <= 0:  # as the file path: nothing asked, nothing read
            return out
        size = 0
        chunks = self._chunks
        for k in range(bisect.bisect_right(chunks, from_offset, key=_first) - 1, len(chunks)):
            first, last, data, seg, start = chunks[k]
            if last < from_offset:
                continue
            pos = 0
            if from_offset > first:  # seek: nearest index entry, then skip < index_every
                j = bisect.bisect_right(seg.index, from_offset, key=_first) - 1
                offset, at = seg.index[j]
                if offset > first:
                    first, pos = offset, at - start
                for _ in range(from_offset - first):
                    pos += 4 + rec.PREFIX.unpack_from(data, pos)[0]
            pos, added = rec.decode_run(data, pos, out, max_records, max_bytes - size)
            size += added
            if len(out) >= max_records or size >= max_bytes:
                return out
        return out
