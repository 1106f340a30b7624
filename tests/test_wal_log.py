"""The write-ahead log on real files: recovery from torn and corrupt bytes, reads, retention,
injected disk faults. Pure: no event loop, no broker."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk, FaultyDisk
from blipmq_server.wal.log import Log, LogOptions, MiB, Recovery

MSG = rec.Kind.MESSAGE


def body(i: int, size: int = 40) -> bytes:
    return f"message-{i:06d}-".encode().ljust(size, b".")


def write_log(path: Path, n: int, opts: LogOptions | None = None, batch: int = 7) -> Log:
    log = Log(str(path), opts)
    log.open()
    for i in range(n):
        log.append(MSG, body(i), 1000 + i)
        if i % batch == batch - 1:
            flush(log)
    flush(log)
    return log


def flush(log: Log, sync: bool = True) -> None:
    b = log.take_batch()
    if b is not None:
        b.write(log.disk, sync)
        log.commit(b)


def reopen(path: Path, opts: LogOptions | None = None) -> tuple[Log, Recovery]:
    log = Log(str(path), opts)
    return log, log.open()


def all_bodies(log: Log) -> list[bytes]:
    return [r.body for r in log.read(0, max_records=10**9, max_bytes=1 << 40)]


def segments(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".seg")


def test_append_many_spreads_over_segments(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=4096)
    log = Log(str(tmp_path), opts)
    log.open()
    assert log.append_many(MSG, [body(i, 100) for i in range(5)], 7) == 1  # fits the tail
    assert log.append_many(MSG, [body(i, 100) for i in range(5, 200)], 8) == 6
    assert log.next_offset == 201 and log.pending_records == 200
    flush(log)
    files = segments(tmp_path)
    assert len(files) > 5 and all(f.stat().st_size <= 4096 for f in files)
    log.close()
    again, found = reopen(tmp_path, opts)
    assert found.records == 200 and not found.quarantined
    records = again.read(0, max_records=1000, max_bytes=1 << 30)
    assert [r.offset for r in records] == list(range(1, 201))
    assert [r.body for r in records] == [body(i, 100) for i in range(200)]
    assert [r.timestamp_ms for r in records[4:6]] == [7, 8]
    # each file is named after its first record's offset
    firsts = [int(f.stem) for f in files]
    assert firsts == sorted(firsts) and firsts[0] == 1


def test_append_commit_reopen(tmp_path: Path) -> None:
    log = write_log(tmp_path, 50)
    assert log.written_offset == 50 and log.next_offset == 51
    log.close()
    again, found = reopen(tmp_path)
    assert found.records == 50 and found.torn_bytes == 0 and not found.quarantined
    assert all_bodies(again) == [body(i) for i in range(50)]
    assert again.next_offset == 51
    assert again.append(MSG, b"next", 0) == 51


def test_pending_records_are_not_readable_until_committed(tmp_path: Path) -> None:
    log = write_log(tmp_path, 3)
    log.append(MSG, b"pending", 0)
    assert log.pending_records == 1
    assert len(all_bodies(log)) == 3
    flush(log)
    assert all_bodies(log)[-1] == b"pending"


def test_the_first_offset_counts_records_being_written(tmp_path: Path) -> None:
    """A fresh log's first records, taken by the flusher and not committed yet, are held by
    the log: a subscription from the earliest offset made at that moment began past them
    (``blipmq pub t x; blipmq sub t --from earliest -e`` printed nothing on a slow disk)."""
    opts = LogOptions(segment_bytes=4096)
    log = Log(str(tmp_path), opts)
    log.open()
    log.append(MSG, body(0), 1)
    assert log.first_offset == 1  # pending
    batch = log.take_batch()
    assert batch is not None
    log.append(MSG, body(1), 2)
    assert log.first_offset == 1  # in flight, with one pending behind it
    batch.write(log.disk, True)
    log.commit(batch)
    assert log.first_offset == 1


def test_rotation_and_reads_across_segments(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, index_every=4)
    log = write_log(tmp_path, 200, opts)
    files = segments(tmp_path)
    assert len(files) > 5
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.stat().st_size <= 1000 for f in files)
    assert all_bodies(log) == [body(i) for i in range(200)]
    got = log.read(137, max_records=5)
    assert [r.offset for r in got] == [137, 138, 139, 140, 141]
    assert [r.body for r in got] == [body(i) for i in range(136, 141)]
    assert [r.offset for r in log.read(190, max_bytes=100)] == [190, 191, 192]
    assert log.read(10_000) == []
    log.close()
    again, found = reopen(tmp_path, opts)
    assert found.segments == len(files) and all_bodies(again) == [body(i) for i in range(200)]


def test_a_record_larger_than_the_read_chunk(tmp_path: Path) -> None:
    log = Log(str(tmp_path))
    log.open()
    big = os.urandom(700_000)
    log.append(MSG, b"small", 1)
    log.append(MSG, big, 2)
    log.append(MSG, b"after", 3)
    flush(log)
    assert [r.body for r in log.read(1)] == [b"small", big, b"after"]


def test_decode_run_stops_at_a_cut_record_and_at_its_limits() -> None:
    records = [rec.Record(1, 10 + i, 1000 + i, bytes([i]) * (i + 1)) for i in range(5)]
    data = b"".join(rec.encode(*r) for r in records)
    ends = [sum(len(rec.encode(*r)) for r in records[:i + 1]) for i in range(5)]
    out: list[rec.Record] = []
    assert rec.decode_run(data[:ends[2] + 3], 0, out, 100, 1 << 20) == (ends[2], 6)
    assert out == records[:3]  # the cut fourth record is left for the next read
    out = []
    assert rec.decode_run(data, 0, out, 100, 1 << 20, from_offset=12) == (ends[4], 12)
    assert out == records[2:]  # records before from_offset are passed over
    out = [records[0]]  # a call adds to what the list holds: max_records counts it
    assert rec.decode_run(data, ends[0], out, 3, 1 << 20) == (ends[2], 5)
    assert out == records[:3]
    out = []
    assert rec.decode_run(data, 0, out, 100, 3) == (ends[1], 3)  # the budget is reached
    assert out == records[:2]
    assert rec.decode_run(data, 0, [], 100, 0) == (0, 0)  # nothing asked, nothing read


def test_torn_tail_at_every_byte_of_the_last_records(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_log(src, 20).close()
    seg = segments(src)[0]
    data = seg.read_bytes()
    scan = rec.scan(data)
    cut_from = scan.records[-3][1]  # every byte of the last three records
    for cut in range(cut_from, len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(data[:cut])
        log, found = reopen(d)
        whole = sum(1 for _, pos in scan.records if pos + 4 + rec.PREFIX.unpack_from(data, pos)[0]
                    <= cut)
        assert all_bodies(log) == [body(i) for i in range(whole)], cut
        assert found.torn_bytes == cut - (scan.records[whole][1] if whole < 20 else len(data))
        assert not found.quarantined
        assert log.append(MSG, b"after", 0) == whole + 1  # the log goes on from there
        flush(log)
        log.close()
        again, found2 = reopen(d)
        assert all_bodies(again)[-1] == b"after" and found2.torn_bytes == 0


def test_torn_segment_header_of_the_last_segment(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=600)
    write_log(tmp_path, 40, opts).close()
    files = segments(tmp_path)
    last = files[-1]
    last.write_bytes(last.read_bytes()[:7])
    log, found = reopen(tmp_path, opts)
    assert not last.exists() and found.torn_bytes == 7
    expected_count = sum(len(rec.scan(f.read_bytes()).records) for f in files[:-1])
    assert all_bodies(log) == [body(i) for i in range(expected_count)]


def test_bit_flip_in_an_older_segment_sets_the_record_aside_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    opts = LogOptions(segment_bytes=1000)
    write_log(tmp_path, 100, opts).close()
    files = segments(tmp_path)
    target = files[1]
    data = bytearray(target.read_bytes())
    scan = rec.scan(bytes(data))
    start, end = scan.records[2][1], scan.records[3][1]
    data[start + 30] ^= 0x10  # inside the third record's body
    target.write_bytes(bytes(data))
    log, found = reopen(tmp_path, opts)
    assert len(found.quarantined) == 1 and "CRC mismatch" in found.notes[0]
    aside = tmp_path / found.quarantined[0]
    assert aside.name == f"{target.name}.{start}.corrupt"
    assert aside.read_bytes() == bytes(data[start:end])  # the damaged record, nothing more
    bodies = all_bodies(log)
    lost = scan.records[2][0]
    assert bodies == [body(o - 1) for o in range(1, 101) if o != lost]
    assert log.next_offset == 101
    # the segment was rewritten without the damage: a second start finds nothing wrong
    log.close()
    again, found2 = reopen(tmp_path, opts)
    assert not found2.quarantined and found2.torn_bytes == 0 and not found2.notes
    assert all_bodies(again) == bodies


def test_bit_flip_mid_last_segment_is_quarantined_not_truncated_silently(tmp_path: Path) -> None:
    write_log(tmp_path, 30).close()
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    pos = rec.scan(bytes(data)).records[10][1]
    data[pos + 9] ^= 0xFF  # inside the offset field
    seg.write_bytes(bytes(data))
    log, found = reopen(tmp_path)
    assert len(found.quarantined) == 1 and found.torn_bytes == 0
    assert all_bodies(log) == [body(i) for i in range(30) if i != 10]
    assert log.append(MSG, b"x", 0) == 31


def test_bad_magic_in_an_older_segment(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=600)
    write_log(tmp_path, 40, opts).close()
    first = segments(tmp_path)[0]
    original = first.read_bytes()
    first.write_bytes(b"XXXXXX" + original[6:])
    log, found = reopen(tmp_path, opts)
    assert found.quarantined == [f"{first.name}.0.corrupt"]
    assert (tmp_path / found.quarantined[0]).read_bytes() == b"XXXXXX" + original[6:16]
    assert first.read_bytes() == original  # a new header, and every record kept
    assert all_bodies(log) == [body(i) for i in range(40)]


def test_a_segment_with_nothing_valid_is_set_aside_whole(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=600)
    write_log(tmp_path, 40, opts).close()
    first = segments(tmp_path)[0]
    garbage = b"XXXXXX" + bytes(range(256)) * 2
    first.write_bytes(garbage)
    log, found = reopen(tmp_path, opts)
    assert not first.exists() and found.quarantined == [f"{first.name}.0.corrupt"]
    assert (tmp_path / found.quarantined[0]).read_bytes() == garbage
    assert all_bodies(log)[-1] == body(39)


def before_doomed_after(tmp_path: Path, faults: Callable[[FaultyDisk, bool], None]) -> Log:
    """Write "before"; fail the batch holding "doomed" with ``faults`` switched on, then
    switch them off and write "after" (offsets 1, then 3: 2 was lost)."""
    disk = FaultyDisk()
    log = Log(str(tmp_path), disk=disk)
    log.open()
    log.append(MSG, b"before", 0)
    flush(log)
    log.append(MSG, b"doomed", 0)
    batch = log.take_batch()
    assert batch is not None
    faults(disk, True)
    with pytest.raises(OSError):
        batch.write(disk, True)
    log.abort(batch)
    faults(disk, False)
    log.append(MSG, b"after", 0)
    flush(log)
    return log


@pytest.mark.parametrize("partial", [0, 5, 60])
def test_failed_write_leaves_no_trace_and_the_log_resumes(tmp_path: Path, partial: int) -> None:
    def faults(disk: FaultyDisk, on: bool) -> None:
        disk.fail_writes, disk.partial = on, partial

    log = before_doomed_after(tmp_path, faults)
    assert [(r.offset, r.body) for r in log.read(0)] == [(1, b"before"), (3, b"after")]
    log.close()
    again, found = reopen(tmp_path)
    assert found.torn_bytes == 0 and not found.quarantined
    assert [r.body for r in again.read(0)] == [b"before", b"after"]


def test_bytes_a_failed_undo_left_are_cut_by_the_next_write(tmp_path: Path) -> None:
    def faults(disk: FaultyDisk, on: bool) -> None:
        disk.fail_fsync = disk.fail_truncate = on  # written, not synced, and cannot be cut

    log = before_doomed_after(tmp_path, faults)
    expected = [(1, b"before"), (3, b"after")]
    assert [(r.offset, r.body) for r in log.read(0)] == expected
    log.close()
    again, found = reopen(tmp_path)
    assert found.torn_bytes == 0 and not found.quarantined
    assert [(r.offset, r.body) for r in again.read(0)] == expected


def test_failed_fsync_is_a_failed_batch(tmp_path: Path) -> None:
    disk = FaultyDisk()
    log = Log(str(tmp_path), disk=disk)
    log.open()
    log.append(MSG, b"one", 0)
    batch = log.take_batch()
    disk.fail_fsync = True
    with pytest.raises(OSError):
        batch.write(disk, True)
    log.abort(batch)
    disk.fail_fsync = False
    log.append(MSG, b"two", 0)
    flush(log)
    assert [r.body for r in log.read(0)] == [b"two"]


def test_retention_by_size_and_age(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, retention_bytes=3000)
    log = write_log(tmp_path, 200, opts)
    result = log.retain(now_ms=0)
    assert result.removed and log.total_bytes <= 3000 + 1000
    assert all_bodies(log)[-1] == body(199)
    assert log.first_offset > 1
    aged = Log(str(tmp_path / "aged"), LogOptions(segment_bytes=1000, retention_ms=100))
    aged.open()
    for i in range(100):
        aged.append(MSG, body(i), 1000 + i)
    flush(aged)
    removed = aged.retain(now_ms=1150).removed
    assert removed and all(r.timestamp_ms >= 1050 or r.offset >= aged.segments[0].first
                           for r in aged.read(0))
    assert aged.read(0)[-1].body == body(99)  # the newest segment always stays


def test_retention_keeps_what_a_group_needs_until_the_size_cap(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, retention_ms=1)
    log = write_log(tmp_path, 100, opts)
    kept = log.retain(now_ms=10**9, keep_from=5)
    assert kept.removed == [] and log.first_offset == 1
    capped = Log(str(tmp_path), LogOptions(segment_bytes=1000, retention_bytes=2000))
    capped.open()
    result = capped.retain(now_ms=0, keep_from=5)
    assert result.forced_below is not None and result.forced_below > 5
    assert capped.first_offset == result.forced_below


def test_the_documented_example_record() -> None:
    """docs/WAL.md shows this record byte for byte."""
    from blipmq_server.protocol.codec import Message, message_record

    body = message_record(Message("t", b"hi", 1))
    assert rec.encode(MSG, 1, 1795363200000, body).hex(" ") == (
        "00 00 00 25 40 99 53 89 01 00 00 00 00 00 00 00 01 00 00 01 a2 03 fc 5c 00 "
        "01 00 00 00 00 00 01 00 00 00 00 00 02 74 68 69"
    )


# ------------------------------------------------------------------ recent-records cache


class CountingDisk(Disk):
    """A real Disk that counts the reads of segment bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.preads = 0

    def pread(self, path: str, pos: int, size: int) -> bytes:
        self.preads += 1
        return super().pread(path, pos, size)


class CountingFaultyDisk(FaultyDisk, CountingDisk):
    pass


LIMITS = [(1, MiB), (3, MiB), (1000, 1 << 40), (1000, 100), (7, 250), (0, MiB), (5, 0)]


def fill(log: Log, n: int, seed: int = 7, max_size: int = 400) -> None:
    """``n`` records of varying sizes (some bigger than small segments), in varying batches."""
    rng = random.Random(seed)
    i = 0
    while i < n:
        for _ in range(min(n - i, rng.choice([1, 2, 5, 17, 40]))):
            size = 1500 if rng.random() < 0.02 else rng.randrange(0, max_size)
            log.append(rng.choice([MSG, rec.Kind.ACK]), body(i, size), 1000 + i)
            i += 1
        flush(log)


def assert_reads_match_disk(log: Log, path: Path, opts: LogOptions, offsets: range) -> None:
    """Every read of ``log`` equals the same read of a fresh Log on the files (no cache)."""
    fresh, _ = reopen(path, opts)
    for o in offsets:
        for max_records, max_bytes in LIMITS:
            assert log.read(o, max_records, max_bytes) == fresh.read(o, max_records, max_bytes), (
                o, max_records, max_bytes)
    assert fresh.cache_hits == 0  # opening starts with an empty cache
    fresh.close()


@pytest.mark.parametrize("index_every", [1, 4, 64])
def test_cached_reads_equal_disk_reads_and_skip_the_disk(tmp_path: Path, index_every: int) -> None:
    opts = LogOptions(segment_bytes=1000, index_every=index_every)
    disk = CountingDisk()
    log = Log(str(tmp_path), opts, disk)
    log.open()
    fill(log, 300)
    assert len(segments(tmp_path)) > 20  # rotation, and records larger than a segment
    assert_reads_match_disk(log, tmp_path, opts, range(1, 305))
    assert disk.preads == 0 and log.cache_misses == 0
    assert log.cache_hits == 304 * len(LIMITS)
    assert [r.offset for r in log.read(1, 10**9, 1 << 40)] == list(range(1, 301))
    assert log.read(0, 2) == log.read(1, 2)  # below the cache: from the files, same answer
    assert disk.preads > 0 and log.cache_misses == 1


def test_cache_is_bounded_and_older_offsets_come_from_disk(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, cache_bytes=2000)
    disk = CountingDisk()
    log = Log(str(tmp_path), opts, disk)
    log.open()
    fill(log, 300)
    cached_from = log._cache._chunks[0].first
    assert 1 < cached_from and log._cache.size <= 2000
    assert sum(len(c.data) for c in log._cache._chunks) == log._cache.size
    assert log.read(cached_from, 10**9, 1 << 40)[-1].offset == 300 and disk.preads == 0
    log.read(cached_from - 1, 1)
    assert disk.preads > 0 and (log.cache_hits, log.cache_misses) == (1, 1)
    assert_reads_match_disk(log, tmp_path, opts, range(0, 303))
    # One batch bigger than the whole cache: it is still kept, alone.
    log.append(MSG, os.urandom(5000), 9)
    flush(log)
    assert len(log._cache._chunks) == 1 and log._cache._chunks[0].first == 301
    before = disk.preads
    assert log.read(301)[0].offset == 301 and disk.preads == before
    assert_reads_match_disk(log, tmp_path, opts, range(290, 303))
    log.close()
    assert not log._cache._chunks and log._cache.size == 0


@pytest.mark.parametrize("fault", ["write", "torn write", "fsync"])
def test_an_aborted_batch_is_neither_cached_nor_readable(tmp_path: Path, fault: str) -> None:
    disk = CountingFaultyDisk()
    log = Log(str(tmp_path), disk=disk)
    log.open()
    log.append(MSG, b"before", 0)
    flush(log)
    log.append(MSG, b"doomed", 0)
    log.append(MSG, b"doomed too", 0)
    batch = log.take_batch()
    assert batch is not None
    disk.fail_writes = fault != "fsync"
    disk.partial = 30 if fault == "torn write" else 0
    disk.fail_fsync = fault == "fsync"
    with pytest.raises(OSError):
        batch.write(disk, True)
    log.abort(batch)
    disk.fail_writes = disk.fail_fsync = False
    assert [c.first for c in log._cache._chunks] == [1]
    assert log.read(2) == [] and log.read(3) == []
    assert [r.body for r in log.read(1)] == [b"before"]
    log.append(MSG, b"after", 0)
    flush(log)
    assert [(r.offset, r.body) for r in log.read(1)] == [(1, b"before"), (4, b"after")]
    assert [r.offset for r in log.read(2)] == [4]
    assert disk.preads == 0
    assert_reads_match_disk(log, tmp_path, LogOptions(), range(0, 6))


def test_retention_drops_cached_records_of_deleted_segments(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, retention_bytes=3000)
    disk = CountingDisk()
    log = Log(str(tmp_path), opts, disk)
    log.open()
    fill(log, 200, max_size=100)
    assert log._cache._chunks[0].first == 1
    assert log.retain(now_ms=0).removed
    first = log.first_offset
    assert first > 1 and log._cache._chunks[0].first == first
    assert log._cache.size == sum(len(c.data) for c in log._cache._chunks)
    assert log.read(1, 1)[0].offset == first  # deleted records are not served from memory
    assert_reads_match_disk(log, tmp_path, opts, range(0, 204))
    before = disk.preads
    assert log.read(first, 10**9, 1 << 40)[-1].offset == 200 and disk.preads == before


def test_cache_disabled(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000, cache_bytes=0)
    disk = CountingDisk()
    log = Log(str(tmp_path), opts, disk)
    log.open()
    fill(log, 100)
    assert not log._cache._chunks
    assert_reads_match_disk(log, tmp_path, opts, range(0, 103))
    assert log.cache_hits == 0 and log.cache_misses == 103 * len(LIMITS) and disk.preads > 0


def test_after_recovery_the_cache_holds_only_new_commits(tmp_path: Path) -> None:
    write_log(tmp_path, 20).close()
    disk = CountingDisk()
    log = Log(str(tmp_path), disk=disk)
    log.open()
    assert not log._cache._chunks
    assert [r.offset for r in log.read(20)] == [20] and disk.preads == 1
    log.append(MSG, b"new", 0)
    flush(log)
    assert [r.body for r in log.read(21)] == [b"new"] and disk.preads == 1
    assert [r.offset for r in log.read(19)] == [19, 20, 21] and disk.preads == 2


def test_first_offset_counts_records_not_yet_written(tmp_path) -> None:
    # a replay from "earliest" right after a publish must not skip what the flusher has not
    # written yet
    log = Log(str(tmp_path))
    log.open()
    assert log.first_offset == 1
    log.append(1, b"a", 0)
    log.append(1, b"b", 0)
    assert log.first_offset == 1 and log.next_offset == 3


def test_read_files_from_any_offset_across_read_chunks(tmp_path) -> None:
    # records of 40 KiB: one 256 KiB read chunk holds six; reads start between index entries
    log = Log(str(tmp_path), LogOptions(index_every=4))
    log.open()
    bodies = [bytes([i]) * 40_960 for i in range(40)]
    log.append_many(1, bodies, 0)
    batch = log.take_batch()
    batch.write(log.disk, False)
    log.commit(batch)
    for start in (1, 2, 8, 13, 40):
        got = log.read_files(start, 1000, 100 * MiB)
        assert [r.offset for r in got] == list(range(start, 41))
        assert [r.body for r in got] == bodies[start - 1 :]
    assert len(log.read_files(3, 1000, 100_000)) == 3  # stops once past max_bytes


class ByteCountingDisk(Disk):
    """A Disk that counts the bytes ``pread`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.read_bytes = 0

    def pread(self, path: str, pos: int, size: int) -> bytes:
        data = super().pread(path, pos, size)
        self.read_bytes += len(data)
        return data


@pytest.mark.parametrize("cache_bytes", [0, 4 * MiB])
def test_offset_at_finds_the_first_record_at_a_time_without_scanning(tmp_path: Path,
                                                                     cache_bytes: int) -> None:
    disk = ByteCountingDisk()
    opts = LogOptions(segment_bytes=16 * 1024, cache_bytes=cache_bytes)
    log = Log(str(tmp_path), opts, disk)
    log.open()
    stamps = []
    for i in range(3000):  # three records per millisecond, then a gap of a second
        ts = 1_000_000 + i // 3 + (1000 if i >= 2400 else 0)
        stamps.append(ts)
        log.append(1, body(i), ts)
        if i % 50 == 49:
            flush(log)
    flush(log)
    assert len(log.segments) > 5
    size = log.total_bytes
    for wanted in (0, 1_000_000, 1_000_001, 1_000_400, 1_000_799, 1_000_800, 1_001_500,
                   1_001_799, 1_001_800):
        disk.read_bytes = 0
        expected = next((i + 1 for i, ts in enumerate(stamps) if ts >= wanted), 3001)
        assert log.offset_at(wanted) == expected, wanted
        assert disk.read_bytes < 2 * opts.segment_bytes < size // 5  # headers, one segment
    log.append(1, b"pending", 2_000_000)  # not written yet: not found
    assert log.offset_at(2_000_000) == 3001


def test_encode_many_writes_what_encode_writes_record_by_record() -> None:
    """encode_many checksums a small record's fixed part and body joined, and runs the CRC
    over the fixed part and then the body of a large one (one copy per record); either way
    the bytes must be those of encode, record by record."""
    import os

    from blipmq_server.wal import record as rec

    bodies = [b"", b"x", os.urandom(100), os.urandom(rec._ONE_CALL - 1),
              os.urandom(rec._ONE_CALL), os.urandom(70_000)]
    assert rec.encode_many(1, 5, 123, bodies) == [
        rec.encode(1, 5 + i, 123, body) for i, body in enumerate(bodies)]


def test_the_reserve_is_made_grown_back_and_never_mistaken(tmp_path: Path) -> None:
    """The log's room for a full disk (``wal/reserve``): made at its size, made again at
    its size after an operator (or a crash while making it) left it short, released once;
    a directory at its name is neither taken for it nor an error (it killed the broker)."""
    from blipmq_server.wal.log import RESERVE_BYTES

    log = Log(str(tmp_path / "wal"))
    log.open()
    reserve = tmp_path / "wal" / "reserve"
    assert log.make_reserve() == RESERVE_BYTES == reserve.stat().st_size
    reserve.write_bytes(b"")  # left short
    assert log.has_reserve() and log.make_reserve() == RESERVE_BYTES
    assert log.release_reserve() and not reserve.exists() and not log.release_reserve()
    reserve.mkdir()
    assert not log.has_reserve() and not log.release_reserve() and log.make_reserve() == 0
    assert reserve.is_dir()
    log.close()
