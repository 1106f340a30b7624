"""The write-ahead log on real files: recovery from torn and corrupt bytes, reads, retention,
injected disk faults. Pure: no event loop, no broker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import FaultyDisk
from blipmq_server.wal.log import Log, LogOptions, Recovery

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


def test_bit_flip_in_an_older_segment_is_quarantined(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000)
    write_log(tmp_path, 100, opts).close()
    files = segments(tmp_path)
    target = files[1]
    data = bytearray(target.read_bytes())
    scan = rec.scan(bytes(data))
    victim = scan.records[2][1] + 30  # inside the third record's body
    data[victim] ^= 0x10
    target.write_bytes(bytes(data))
    log, found = reopen(tmp_path, opts)
    assert len(found.quarantined) == 1 and "CRC mismatch" in found.notes[0]
    aside = tmp_path / found.quarantined[0]
    assert aside.read_bytes() == bytes(data[scan.records[2][1]:])
    bodies = all_bodies(log)
    first_in_target = scan.records[0][0]
    lost = set(range(first_in_target + 2, scan.records[-1][0] + 1))  # 1-based offsets lost
    assert bodies == [body(o - 1) for o in range(1, 101) if o not in lost]
    assert body(scan.records[2][0] - 1) not in bodies  # the corrupt record is never served


def test_bit_flip_mid_last_segment_is_quarantined_not_truncated_silently(tmp_path: Path) -> None:
    write_log(tmp_path, 30).close()
    seg = segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    pos = rec.scan(bytes(data)).records[10][1]
    data[pos + 9] ^= 0xFF  # inside the offset field
    seg.write_bytes(bytes(data))
    log, found = reopen(tmp_path)
    assert len(found.quarantined) == 1 and found.torn_bytes == 0
    assert all_bodies(log) == [body(i) for i in range(10)]
    assert log.append(MSG, b"x", 0) == 11


def test_bad_magic_in_an_older_segment(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=600)
    write_log(tmp_path, 40, opts).close()
    first = segments(tmp_path)[0]
    first.write_bytes(b"XXXXXX" + first.read_bytes()[6:])
    log, found = reopen(tmp_path, opts)
    assert not first.exists() and found.quarantined == [f"{first.name}.0.corrupt"]
    assert all_bodies(log)[-1] == body(39)


@pytest.mark.parametrize("partial", [0, 5, 60])
def test_failed_write_leaves_no_trace_and_the_log_resumes(tmp_path: Path, partial: int) -> None:
    disk = FaultyDisk()
    log = Log(str(tmp_path), disk=disk)
    log.open()
    log.append(MSG, b"before", 0)
    flush(log)
    log.append(MSG, b"doomed", 0)
    batch = log.take_batch()
    disk.fail_writes, disk.partial = True, partial
    with pytest.raises(OSError):
        batch.write(disk, True)
    log.abort(batch)
    disk.fail_writes = False
    log.append(MSG, b"after", 0)
    flush(log)
    assert [(r.offset, r.body) for r in log.read(0)] == [(1, b"before"), (3, b"after")]
    log.close()
    again, found = reopen(tmp_path)
    assert found.torn_bytes == 0 and not found.quarantined
    assert [r.body for r in again.read(0)] == [b"before", b"after"]


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
