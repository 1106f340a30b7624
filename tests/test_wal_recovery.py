"""Recovery from damage on real files: corruption is told apart from a torn tail, every valid
record after damage is kept, offsets are never given twice. Pure: no event loop, no broker.
"""

from __future__ import annotations

import atexit
import functools
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blipmq_server.errors import WalError
from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk
from blipmq_server.wal.log import Log, LogOptions, Recovery

MSG = rec.Kind.MESSAGE


def body(i: int, size: int = 60) -> bytes:
    return f"message-{i:06d}-".encode().ljust(size, b".")


def write_log(path: Path, n: int, opts: LogOptions | None = None, batch: int = 5) -> None:
    log = Log(str(path), opts)
    log.open()
    for i in range(n):
        log.append(MSG, body(i), 1000 + i)
        if i % batch == batch - 1 or i == n - 1:
            b = log.take_batch()
            assert b is not None
            b.write(log.disk, False)
            log.commit(b)
    log.close()


def reopen(path: Path, opts: LogOptions | None = None, disk: Disk | None = None
           ) -> tuple[Log, Recovery]:
    log = Log(str(path), opts, disk)
    return log, log.open()


class NoRoom(Disk):
    """A disk that says it has no room left (a full card): recovery must not need any for
    damage it can leave in place."""

    def free(self, directory: str) -> tuple[int, int]:
        return 0, 4096


def everything(log: Log) -> list[rec.Record]:
    return log.read(0, max_records=10**9, max_bytes=1 << 40)


def segments(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".seg")


def flip(path: Path, pos: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= mask
    path.write_bytes(bytes(data))


def test_length_bit_flip_mid_newest_segment_is_corruption_not_a_torn_tail(
    tmp_path: Path,
) -> None:
    """A flipped high bit makes a record's length run past the end of the
    file, which looks like a torn write; the valid records after it say otherwise."""
    write_log(tmp_path, 400)
    seg = segments(tmp_path)[-1]
    size = seg.stat().st_size
    records = rec.scan(seg.read_bytes()).records
    _, pos = records[150]
    flip(seg, pos + 1, 0x40)  # length + 4 MiB: past the end of the file
    log, found = reopen(tmp_path)
    assert found.torn_bytes == 0
    assert found.quarantined == [f"{seg.name}.{pos}.corrupt"]
    assert (tmp_path / found.quarantined[0]).stat().st_size == records[151][1] - pos
    assert [r.body for r in everything(log)] == [body(i) for i in range(400) if i != 150]
    assert seg.stat().st_size == size - (records[151][1] - pos)  # rewritten without it
    assert log.next_offset == 401
    assert log.append(MSG, b"next", 0) == 401


def test_length_bit_flip_to_a_smaller_length_keeps_the_records_after(tmp_path: Path) -> None:
    write_log(tmp_path, 100)
    seg = segments(tmp_path)[-1]
    _, pos = rec.scan(seg.read_bytes()).records[40]
    flip(seg, pos + 3, 0x08)  # length - 8: inside its own record, CRC mismatch
    log, found = reopen(tmp_path)
    assert len(found.quarantined) == 1 and found.torn_bytes == 0
    assert [r.offset for r in everything(log)] == [o for o in range(1, 101) if o != 41]


def test_damage_in_several_segments_each_loses_only_the_damaged_record(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=2000)
    write_log(tmp_path, 300, opts)
    files = segments(tmp_path)
    lost = []
    for seg in files[1:-1:3]:
        offset, pos = rec.scan(seg.read_bytes()).records[5]
        flip(seg, pos + 30, 0x01)
        lost.append(offset)
    log, found = reopen(tmp_path, opts)
    assert len(found.quarantined) == len(lost)
    assert [r.offset for r in everything(log)] == [o for o in range(1, 301) if o not in lost]
    # the rewritten segments are whole now: nothing to find on the next start
    log.close()
    again, found2 = reopen(tmp_path, opts)
    assert not found2.quarantined and not found2.notes
    assert [r.offset for r in everything(again)] == [o for o in range(1, 301) if o not in lost]


def test_a_torn_tail_after_damage_is_still_cut(tmp_path: Path) -> None:
    write_log(tmp_path, 50)
    seg = segments(tmp_path)[-1]
    records = rec.scan(seg.read_bytes()).records
    flip(seg, records[20][1] + 30, 0x02)
    seg.write_bytes(seg.read_bytes()[:-7])  # and the last record loses its end
    log, found = reopen(tmp_path)
    assert len(found.quarantined) == 1 and found.torn_bytes > 0
    assert [r.offset for r in everything(log)] == [o for o in range(1, 50) if o != 21]


def test_offsets_are_not_reused_after_the_end_of_the_newest_segment_is_set_aside(
    tmp_path: Path,
) -> None:
    write_log(tmp_path, 60)
    seg = segments(tmp_path)[-1]
    records = rec.scan(seg.read_bytes()).records
    for _, pos in records[-3:]:  # the last three records damaged: nothing valid after
        flip(seg, pos + 30, 0x04)
    log, found = reopen(tmp_path)
    assert found.torn_bytes == 0 and len(found.quarantined) == 1
    assert everything(log)[-1].offset == 57
    assert log.next_offset > 60  # offsets 58-60 were written, if damaged
    first_new = log.next_offset
    log.close()
    # a second start no longer sees the damaged bytes (they are in a .corrupt file now)
    again, found2 = reopen(tmp_path)
    assert not found2.quarantined and again.next_offset == first_new
    assert again.append(MSG, b"new", 0) == first_new
    b = again.take_batch()
    assert b is not None
    b.write(again.disk, True)
    again.commit(b)
    again.close()
    third, _ = reopen(tmp_path)
    assert [(r.offset, r.body) for r in everything(third)][-1] == (first_new, b"new")
    assert third.next_offset == first_new + 1


def test_a_record_its_owner_cannot_read_is_set_aside_and_its_offset_not_reused(
    tmp_path: Path,
) -> None:
    write_log(tmp_path, 20)
    log = Log(str(tmp_path))
    log.open()
    group = log.append(rec.Kind.GROUP, b"not a group", 2000)  # the last record of the log
    b = log.take_batch()
    assert b is not None
    b.write(log.disk, True)
    log.commit(b)
    log.close()
    taken: list[int] = []

    def on_record(record: rec.Record) -> str | None:  # the broker's parser, in short
        if record.body == b"not a group":
            return "its body of 11 bytes ends early"
        taken.append(record.offset)
        return None

    again = Log(str(tmp_path))
    found = again.open(on_record=on_record)
    assert not taken and len(found.quarantined) == 1
    assert any(f"GROUP record {group} cannot be read (its body of 11 bytes ends early)"
               in note for note in found.notes), found.notes
    assert [r.offset for r in everything(again)] == list(range(1, 21))
    assert again.next_offset == group + 1  # used, if set aside
    again.close()
    third, found3 = reopen(tmp_path)  # the record is in the .corrupt file now
    assert not found3.quarantined and third.next_offset == group + 1
    third.close()


def test_offsets_are_not_reused_when_the_newest_segment_is_unreadable(tmp_path: Path) -> None:
    opts = LogOptions(segment_bytes=1000)
    write_log(tmp_path, 100, opts)
    newest = segments(tmp_path)[-1]
    base = int(newest.stem)
    newest.write_bytes(b"\xff" * newest.stat().st_size)  # header and records unreadable
    log, found = reopen(tmp_path, opts)
    assert found.quarantined == [f"{newest.name}.0.corrupt"]
    assert everything(log)[-1].offset == base - 1
    assert log.next_offset > 100
    first_new = log.next_offset
    log.close()
    again, _ = reopen(tmp_path, opts)
    assert again.next_offset == first_new


@pytest.mark.parametrize("newest", [True, False], ids=["newest", "older"])
def test_a_flipped_bit_in_a_header_s_base_offset_is_repaired_from_the_name(
    tmp_path: Path, newest: bool
) -> None:
    """D6: no CRC covers the header's base offset, and recovery trusted it over the file
    name: one flipped bit in the newest segment's header made the next offset 2**48 + 1,
    with no warning."""
    opts = LogOptions(segment_bytes=1000)
    write_log(tmp_path, 60, opts)
    seg = segments(tmp_path)[-1 if newest else 1]
    original = seg.read_bytes()
    flip(seg, 9, 0x01)  # base offset + 2**48
    log, found = reopen(tmp_path, opts)
    assert log.next_offset == 61
    assert [r.offset for r in everything(log)] == list(range(1, 61))
    assert any(f"{seg.name}: its header states base offset {int(seg.stem) + 2**48}" in note
               and "header rewritten" in note for note in found.notes), found.notes
    assert not found.quarantined and seg.read_bytes() == original
    log.close()
    _, again = reopen(tmp_path, opts)
    assert not again.notes


@pytest.mark.parametrize("name", ["12.seg", "00000000000000000001.bak.seg"])
def test_a_segment_file_not_named_after_an_offset_is_left_alone(tmp_path: Path, name: str) -> None:
    """D8: a copy of a segment kept as ``12.seg`` was read as part of the log (sorted first):
    its records came before the real ones, which recovery then set aside as out of order,
    and the copy was rewritten to a bare header. It is not part of the log now."""
    opts = LogOptions(segment_bytes=1000)
    write_log(tmp_path, 60, opts)
    copy = tmp_path / name
    copy.write_bytes(segments(tmp_path)[1].read_bytes())
    kept = copy.read_bytes()
    log, found = reopen(tmp_path, opts)
    assert [r.offset for r in everything(log)] == list(range(1, 61))
    assert not found.quarantined and log.next_offset == 61
    assert found.notes == [f"{name}: not named after an offset (00000000000000000001.seg ...); "
                           "left alone, not part of the log"]
    assert copy.read_bytes() == kept


def test_an_unfinished_rewrite_is_discarded(tmp_path: Path) -> None:
    write_log(tmp_path, 20)
    seg = segments(tmp_path)[-1]
    (tmp_path / (seg.name + ".tmp")).write_bytes(b"half a rewrite")
    log, _ = reopen(tmp_path)
    assert not (tmp_path / (seg.name + ".tmp")).exists()
    assert [r.body for r in everything(log)] == [body(i) for i in range(20)]


def embedded(offset: int, kind: int = MSG, body: bytes = b"FORGED") -> bytes:
    """A whole, valid record, as a client may put it in a payload (or publish a segment)."""
    return rec.encode(kind, offset, 7, body)


def write_bodies(path: Path, bodies: list[bytes]) -> None:
    log = Log(str(path))
    log.open()
    for i, b in enumerate(bodies):
        log.append(MSG, b, 1000 + i)
    batch = log.take_batch()
    assert batch is not None
    batch.write(log.disk, False)
    log.commit(batch)
    log.close()


@pytest.mark.parametrize(("where", "mask", "forged"), [
    (1, 0xFF, 1000),  # length runs past the end: the old resync took offset 1000, then cut
    (1, 0xFF, 4),  # ... an offset in order: the forged record was delivered
    (3, 0x04, 1000),  # a smaller length, inside its own payload
    (62, 0x01, 4),  # a payload bit (after the record in it): its length says where it ends
    (5, 0x10, 1000),  # its CRC field
], ids=["length-past-end", "length-in-order", "length-smaller", "payload", "crc"])
def test_a_record_inside_a_damaged_payload_is_never_taken_for_the_log_s(
    tmp_path: Path, where: int, mask: int, forged: int
) -> None:
    """D1: after damage, resync took the first valid record bytes it met, inside the damaged
    record's own payload: a forged record came in, and one with a large offset made the
    real records after it fail 'offset does not follow' and be cut as a torn tail."""
    bodies = [body(i) for i in range(8)]
    bodies[2] = b"pad-" + embedded(forged) + b"-tail"
    write_bodies(tmp_path, bodies)
    seg = segments(tmp_path)[-1]
    records = rec.scan(seg.read_bytes()).records
    flip(seg, records[2][1] + where, mask)
    log, found = reopen(tmp_path)
    assert found.torn_bytes == 0 and found.quarantined == [f"{seg.name}.{records[2][1]}.corrupt"]
    assert [(r.offset, r.body) for r in everything(log)] == [
        (i + 1, body(i)) for i in range(8) if i != 2]
    assert log.next_offset == 9


def test_a_record_damaged_in_its_length_and_elsewhere_sets_the_rest_aside(
    tmp_path: Path,
) -> None:
    """Its length runs past the end and its CRC holds nowhere: nothing tells its end from
    its payload, as for a record cut short (a torn write, which may end right after a
    record inside its payload): the rest of the file is set aside (not cut as a torn tail,
    as whole records run to the end), never read as the log's."""
    bodies = [body(i) for i in range(8)]
    bodies[2] = b"pad-" + embedded(4) + b"-tail"
    write_bodies(tmp_path, bodies)
    seg = segments(tmp_path)[-1]
    data = seg.read_bytes()
    at = rec.scan(data).records[2][1]
    flip(seg, at + 1, 0xFF)  # its length runs past the end
    flip(seg, at + 20, 0x01)  # and its timestamp: its CRC holds nowhere
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 2]
    assert found.torn_bytes == 0 and found.quarantined == [f"{seg.name}.{at}.corrupt"]
    assert (tmp_path / found.quarantined[0]).stat().st_size == len(data) - at
    assert log.next_offset > 8


def test_a_record_damaged_in_its_length_runs_no_further_than_its_crc_says(
    tmp_path: Path,
) -> None:
    """Its length alone damaged (past the end of the file): its CRC finds its end, the
    record is set aside and every record after it kept, whatever its payload holds."""
    bodies = [body(i) for i in range(8)]
    bodies[2] = b"pad-" + embedded(4) + b"-tail"
    write_bodies(tmp_path, bodies)
    seg = segments(tmp_path)[-1]
    data = seg.read_bytes()
    at, end = rec.scan(data).records[2][1], rec.scan(data).records[3][1]
    flip(seg, at + 1, 0xFF)
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 2, 4, 5, 6, 7, 8]
    assert found.torn_bytes == 0 and found.quarantined == [f"{seg.name}.{at}.corrupt"]
    assert (tmp_path / found.quarantined[0]).stat().st_size == end - at


def test_a_torn_last_record_never_lets_a_record_inside_it_in(tmp_path: Path) -> None:
    """D1 (d): the log cut inside its last record, after a whole record in its payload."""
    write_bodies(tmp_path, [body(0), body(1), b"pad-" + embedded(4) + b"-tail"])
    seg = segments(tmp_path)[-1]
    seg.write_bytes(seg.read_bytes()[:-3])
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 2]
    assert found.torn_bytes > 0 and not found.quarantined  # a torn write: cut
    assert log.append(MSG, b"next", 0) > 2  # the forged offset 4 may count as used


def test_a_segment_published_as_a_payload_stays_a_payload(tmp_path: Path) -> None:
    """D1: a payload that is a whole segment's records (``pubfile`` of a segment file),
    ending where the record ends: the damaged record's CRC finds its real end."""
    inner = b"".join(embedded(o) for o in range(3, 40))
    write_bodies(tmp_path, [body(0), body(1), rec.header(3) + inner, body(3), body(4)])
    seg = segments(tmp_path)[-1]
    at = rec.scan(seg.read_bytes()).records[2][1]
    flip(seg, at + 2, 0x01)  # its length, 256 bytes off
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 2, 4, 5]
    assert found.quarantined == [f"{seg.name}.{at}.corrupt"]
    size = rec.RECORD_OVERHEAD + rec.HEADER_SIZE + len(inner)
    assert (tmp_path / found.quarantined[0]).stat().st_size == size  # that record alone


def _payload_log(path: Path) -> tuple[Path, list[int]]:
    """Six records; the fourth's payload holds a whole, valid record (offset 4, as the
    fourth's own). Returns the segment and the records' positions (and the file's end)."""
    bodies = [body(i) for i in range(6)]
    bodies[3] = b"pad-" + embedded(4) + b"-tail"
    write_bodies(path, bodies)
    seg = segments(path)[-1]
    data = seg.read_bytes()
    return seg, [pos for _, pos in rec.scan(data).records] + [len(data)]


def test_a_length_and_crc_both_damaged_never_let_in_a_record_inside_the_next_one(
    tmp_path: Path,
) -> None:
    """Record 3's length points at the record inside record 4's payload, and its CRC is
    damaged too, so nothing of its own framing says where it ends (the fuzzer's case: one
    bit of each). That record was taken for the log's, record 4 was lost with it. Now a
    length that lands inside a whole record of the log is no end: the search goes on after
    that record (record 4 is lost with record 3: which of the two the length got wrong
    cannot be told), and nothing inside it is read."""
    seg, at = _payload_log(tmp_path)
    data = bytearray(seg.read_bytes())
    inner = at[3] + rec.RECORD_OVERHEAD + 4  # after "pad-"
    assert rec.valid_at(bytes(data), inner, 3)
    data[at[2] : at[2] + 4] = (inner - at[2] - 4).to_bytes(4, "big")
    data[at[2] + 4] ^= 0x01  # its CRC
    seg.write_bytes(bytes(data))
    log, found = reopen(tmp_path)
    assert [(r.offset, r.body) for r in everything(log)] == [
        (i + 1, body(i)) for i in (0, 1, 4, 5)]
    assert found.torn_bytes == 0 and found.quarantined == [f"{seg.name}.{at[2]}.corrupt"]
    assert log.next_offset == 7


def test_a_damaged_length_that_lands_on_the_end_of_the_file_keeps_the_records_after(
    tmp_path: Path,
) -> None:
    """Record 2's length alone damaged, pointing exactly at the end of the file: taken for
    the last record, everything after its start was set aside, the valid records too. Its
    CRC finds its end first now."""
    seg, at = _payload_log(tmp_path)
    data = bytearray(seg.read_bytes())
    data[at[1] : at[1] + 4] = (len(data) - at[1] - 4).to_bytes(4, "big")
    seg.write_bytes(bytes(data))
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 3, 4, 5, 6]
    assert found.quarantined == [f"{seg.name}.{at[1]}.corrupt"]
    assert (tmp_path / found.quarantined[0]).stat().st_size == at[2] - at[1]


def test_a_damaged_length_before_a_damaged_kind_never_lets_in_a_record_inside_it(
    tmp_path: Path,
) -> None:
    """One bit of record 3's length and the kind byte of record 4 (one bit each): record
    3's CRC was looked for only where a known kind byte follows, so its end went unfound,
    and the search from where its length pointed took the record inside record 4's
    payload. The places one flipped length bit points to are tried first now: record 3's
    CRC ends it, record 4 is framed by its own length, and both are set aside."""
    seg, at = _payload_log(tmp_path)
    flip(seg, at[2] + 3, 0x01)  # its length, one byte off
    flip(seg, at[3] + 8, 0x80)  # the next record's kind: MESSAGE (1) -> 129, unknown
    log, found = reopen(tmp_path)
    assert [r.offset for r in everything(log)] == [1, 2, 5, 6]
    assert [r.body for r in everything(log)] == [body(0), body(1), body(4), body(5)]
    assert found.quarantined == [f"{seg.name}.{at[2]}.corrupt"]
    assert (tmp_path / found.quarantined[0]).stat().st_size == at[4] - at[2]


# --------------------------------------------------------------------------- fuzzing


@dataclass(frozen=True)
class Placed:
    """An original record: where its bytes are."""

    file: str
    start: int
    end: int
    record: rec.Record


def build_reference(path: Path) -> tuple[LogOptions, list[Placed]]:
    opts = LogOptions(segment_bytes=700, index_every=3)
    rng = random.Random(5)
    log = Log(str(path), opts)
    log.open()
    for i in range(90):
        kind = rng.choice([MSG, MSG, rec.Kind.GROUP, rec.Kind.ACK])
        log.append(kind, hostile(rng, i, log.next_offset), 1000 + i)
        if rng.random() < 0.4:
            b = log.take_batch()
            assert b is not None
            b.write(log.disk, False)
            log.commit(b)
    b = log.take_batch()
    if b is not None:
        b.write(log.disk, False)
        log.commit(b)
    log.close()
    placed = []
    for seg in segments(path):
        data = seg.read_bytes()
        for _, pos in rec.scan(data).records:
            record, end = rec.decode_at(data, pos)
            placed.append(Placed(seg.name, pos, end, record))
    return opts, placed


def hostile(rng: random.Random, i: int, offset: int) -> bytes:
    """A body, a third of them holding whole, valid records (a client may publish them) with
    offsets a resync would take: the record's own, the next ones, far ahead; some chained,
    some ending the body."""
    plain = body(i, rng.randrange(0, 120))
    if rng.random() < 0.6:
        return plain
    inner = b"".join(embedded(rng.choice([offset, offset + 1, offset + 2, offset + 1000]),
                              rng.choice([MSG, rec.Kind.GROUP]), body(-i, rng.randrange(0, 30)))
                     for _ in range(rng.randrange(1, 3)))
    return plain[: rng.randrange(0, 20)] + inner + rng.choice([b"", b"-tail"])


@functools.cache
def reference() -> tuple[Path, LogOptions, list[Placed], list[str]]:
    """One reference log for every example (the fuzzer copies and damages it)."""
    path = Path(tempfile.mkdtemp(prefix="blipmq-wal-fuzz-"))
    atexit.register(shutil.rmtree, path, True)
    opts, placed = build_reference(path)
    return path, opts, placed, [p.name for p in segments(path)]


def newer_and_unread(segment: Path) -> bool:
    """Does the segment's header name a newer format over no readable first record?"""
    data = segment.read_bytes()
    if len(data) <= rec.HEADER_SIZE:
        return False
    magic, version, _ = rec.HEADER.unpack_from(data)
    return (magic == rec.MAGIC and version > rec.FORMAT_VERSION
            and not rec.scan(data, rec.HEADER_SIZE).records)


def kept_in_order(got: list[rec.Record], expected: list[rec.Record]) -> bool:
    """Whether ``got`` is ``expected`` less some records, in the same order."""
    rest = iter(expected)
    return all(any(r == e for e in rest) for r in got)


damage = st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 7)), max_size=5)
truncation = st.none() | st.tuples(st.integers(0, 10**6), st.floats(0, 1))


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=damage, cut=truncation)
# one bit of a record's length and one of its CRC: the length lands inside the next record,
# whose payload holds a record, which was taken for the log's
@example(flips=[(13, 375, 0), (13, 376, 0)], cut=None)
# one bit of a record's length, pointing exactly at the end of its file: the records after
# it were set aside
@example(flips=[(9, 18, 1)], cut=None)
def test_recovery_keeps_every_intact_record_and_never_a_damaged_one(flips, cut, room) -> None:
    """With ``room``, damage is set aside and the segment rewritten; without (a full card),
    it stays in place and reads skip it: the same records either way, at every start, and
    once a start has room, the same again with the damage set aside."""
    source, opts, placed, files = reference()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "wal"
        shutil.copytree(source, where)
        sizes = {name: (source / name).stat().st_size for name in files}
        masks: dict[tuple[str, int], int] = {}
        for index, pos, bit in flips:
            name = files[index % len(files)]
            pos %= sizes[name]
            flip(where / name, pos, 1 << bit)
            masks[name, pos] = masks.get((name, pos), 0) ^ (1 << bit)
        hit = {name: {pos for (n, pos), m in masks.items() if n == name and m} for name in files}
        if cut is not None:
            name = files[cut[0] % len(files)]
            sizes[name] = int(sizes[name] * cut[1])
            os.truncate(where / name, sizes[name])

        def intact(p: Placed) -> bool:
            return p.end <= sizes[p.file] and not any(p.start <= h < p.end for h in hit[p.file])

        expected = [p.record for p in placed if intact(p)]
        # A record damaged in its length field and after it: where it ends cannot be told
        # from its payload, so what follows it in its file may be lost (docs/WAL.md), and
        # what its bytes hold, or a record's between it and the last damage in its file (a
        # flipped bit, or the file cut inside a record), may be read as records
        unsure: set[tuple[str, int]] = set()
        untold: set[tuple[str, int]] = set()
        for name in files:
            hits = sorted(hit[name])
            doubly = [p for p in placed if p.file == name
                      and any(p.start <= h < p.start + 4 for h in hits)
                      and any(h >= p.start + 4 for h in hits)]
            if doubly:
                first = min(p.start for p in doubly)
                unsure |= {(name, p.start) for p in placed if p.file == name and p.start > first}
                torn = [p.start for p in placed if p.file == name and p.start < sizes[name] < p.end]
                last = max([*hits, *torn])
                untold |= {(name, p.start) for p in placed
                           if p.file == name and first <= p.start <= last}
        required = [p.record for p in placed if intact(p) and (p.file, p.start) not in unsure]
        if any(newer_and_unread(where / name) for name in files):
            # a header naming a newer format over bytes that are no record of ours: the
            # start is refused and nothing is changed (a newer BlipMQ's log, or so it looks)
            before = {name: (where / name).read_bytes() for name in files}
            with pytest.raises(WalError, match="format version"):
                reopen(where, opts)
            assert {name: (where / name).read_bytes() for name in files} == before
            return
        log, found = reopen(where, opts, None if room else NoRoom())  # never raises else
        got = everything(log)
        # ... nor records from inside a payload, but from inside a record damaged in its
        # length and elsewhere, whose end nothing tells, or inside a record between it and
        # the last damage in its file (docs/WAL.md)
        inside = [(source / p.file).read_bytes()[p.start:p.end] for p in placed
                  if (p.file, p.start) in untold]
        got_own = [r for r in got if r in expected or not any(
            rec.encode(r.kind, r.offset, r.timestamp_ms, r.body) in original
            for original in inside)]
        assert kept_in_order(got_own, expected)  # nothing damaged
        assert set(required) <= set(got)  # every intact record, but after the unsure ones
        # Offsets: beyond every record whose bytes are all there, damaged or not, except
        # the newest file's last one when damaged (indistinguishable from a torn write).
        present = [p for p in placed if p.end <= sizes[p.file]]
        last_of_newest = max((p for p in present if p.file == files[-1]), default=None,
                             key=lambda p: p.start)
        must_exceed = [p.record.offset for p in present
                       if intact(p) or p is not last_of_newest]
        assert log.next_offset > max(must_exceed, default=0)
        first_next = log.next_offset
        log.close()
        # the repairs hold: nothing new to find (without room, the same damage again)
        again, found2 = reopen(where, opts, None if room else NoRoom())
        assert not found2.quarantined and found2.torn_bytes == 0
        assert room or len(found2.in_place) == len(found.in_place)
        assert everything(again) == got
        assert again.next_offset == first_next
        assert again.append(MSG, b"after", 0) == first_next
        b = again.take_batch()
        assert b is not None
        b.write(again.disk, False)
        again.commit(b)
        assert everything(again)[-1] == rec.Record(MSG, first_next, 0, b"after")
        again.close()
        if not room:  # a start with room sets the damage aside: the same records
            roomy, found3 = reopen(where, opts)
            assert len(found3.quarantined) == len(found.in_place) and not found3.in_place
            assert everything(roomy) == [*got, rec.Record(MSG, first_next, 0, b"after")]
            roomy.close()
            last, found4 = reopen(where, opts)
            assert not found4.notes
            last.close()


@pytest.mark.parametrize("fill", [b"\0", b"\xff", b"random"], ids=["zeros", "erased", "random"])
@pytest.mark.parametrize("at", [7, 3001, 123_457])
def test_an_overwritten_block_loses_only_the_records_it_touches(
        tmp_path: Path, fill: bytes, at: int) -> None:
    """A 4 KiB block of zeros (a bad sector), of 0xFF (erased flash) or of random bytes
    over many records: each record it touches is set aside and every other record kept,
    before and after it. The damaged records' own lengths lead into the block, whose
    "lengths" are no record's, so the records after are found by their bytes. (Erased and
    random blocks lost every record after them in the first version of the payload fix:
    a length past the end was taken for a record cut short.)"""
    opts = LogOptions(segment_bytes=1 << 20)
    write_log(tmp_path, 3000, opts, batch=100)
    seg, = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    placed = rec.scan(bytes(data)).records
    start = len(data) // 2 + at % 4096
    block = random.Random(at).randbytes(4096) if fill == b"random" else fill * 4096
    data[start:start + 4096] = block
    seg.write_bytes(bytes(data))
    ends = [pos for _, pos in placed[1:]] + [len(data)]
    touched = {offset for (offset, pos), end in zip(placed, ends, strict=True)
               if pos < start + 4096 and end > start}
    log, found = reopen(tmp_path, opts)
    assert [r.offset for r in everything(log)] == [
        offset for offset, _ in placed if offset not in touched]
    assert len(found.quarantined) == 1 and found.torn_bytes == 0


def test_a_damaged_length_before_a_torn_tail_keeps_the_records_between(tmp_path: Path) -> None:
    """The newest segment: one record's length damaged (past the end of the file), and the
    last record torn. The first version of the payload fix cut everything from the damaged
    record on as a torn tail (whole records no longer ran to the end), and gave their
    offsets again; the damaged record's CRC finds its end now, and only the torn record is
    cut."""
    write_log(tmp_path, 400, batch=50)
    seg = segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    placed = rec.scan(bytes(data)).records
    offset, at = placed[len(placed) // 2]
    data[at] ^= 0x80  # its length: past the end
    seg.write_bytes(bytes(data[:-30]))  # and the last record torn
    log, found = reopen(tmp_path)
    kept = [r.offset for r in everything(log)]
    last = placed[-1][0]
    assert offset not in kept and last not in kept
    assert [o for o, _ in placed if o not in (offset, last)] == [
        o for o in kept if o >= placed[0][0]]
    assert found.torn_bytes > 0 and len(found.quarantined) == 1
    assert log.next_offset >= last  # a torn record's offset may be given again (WAL.md)


# ------------------------------------------------------------------ without room on the disk


def _damage_middle(path: Path, n: int = 200, index: int = 100) -> tuple[Path, int]:
    """A log of ``n`` records in one segment, the record at ``index`` damaged in its
    payload: damage followed by valid records. Returns the segment and the damaged offset."""
    write_log(path, n, LogOptions(segment_bytes=1 << 20), batch=50)
    seg, = segments(path)
    offset, pos = rec.scan(seg.read_bytes()).records[index]
    flip(seg, pos + rec.RECORD_OVERHEAD + 30, 0x01)
    return seg, offset


def test_damage_without_room_to_set_it_aside_stays_in_place_and_is_never_read(
        tmp_path: Path) -> None:
    """No room for the rewritten copy: nothing is rewritten; the damaged bytes stay where
    they are and every read skips them, from any offset, before them or after."""
    seg, bad = _damage_middle(tmp_path)
    before = seg.read_bytes()
    log, found = reopen(tmp_path, disk=NoRoom())
    assert seg.read_bytes() == before and sorted(tmp_path.iterdir()) == [seg]
    assert found.in_place == [f"{seg.name}@{rec.scan(before).good_end}"]  # the damaged one
    assert not found.quarantined
    note, = found.notes
    assert "CRC mismatch" in note and "left in place, never read" in note, note
    assert "rewrites the segment: it needs" in note and "there are 0;" in note, note
    assert "the valid records after it are kept" in note, note
    kept = [i for i in range(1, 201) if i != bad]
    assert [r.offset for r in everything(log)] == kept
    for start in (1, 60, bad - 1, bad, bad + 1, 150, 200):
        assert [r.offset for r in log.read(start, max_records=10**6, max_bytes=1 << 30)] == [
            i for i in kept if i >= start]
        assert [r.offset for r in log.read_files(start, max_records=3)] == [
            i for i in kept if i >= start][:3]
    assert log.offset_at(1000 + bad - 1) == bad + 1  # its timestamp: the next one stored
    log.close()


def test_a_header_is_repaired_in_place_without_a_copy(tmp_path: Path) -> None:
    """Its base offset flipped: 16 bytes written over it, not a rewritten copy."""
    write_log(tmp_path, 60, LogOptions(segment_bytes=1000))
    seg = segments(tmp_path)[1]
    original = seg.read_bytes()
    flip(seg, 9, 0x01)
    written: list[str] = []

    class Watched(NoRoom):
        def write_file(self, path: str, data: bytes) -> None:
            written.append(path)
            super().write_file(path, data)

    log, found = reopen(tmp_path, LogOptions(segment_bytes=1000), Watched())
    assert written == [] and seg.read_bytes() == original
    assert any("header rewritten" in note for note in found.notes)
    assert [r.offset for r in everything(log)] == list(range(1, 61))
    log.close()


def test_a_copy_the_disk_refuses_halfway_leaves_the_damage_in_place(tmp_path: Path) -> None:
    """The file system said there was room, and then refused the copy (another writer took
    it): what was written of it is removed, and the damage stays in place."""
    import errno

    seg, bad = _damage_middle(tmp_path)
    before = seg.read_bytes()

    class Refusing(Disk):
        def write_file(self, path: str, data: bytes) -> None:
            if path.endswith(".tmp"):
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write_file(path, data)

    log, found = reopen(tmp_path, disk=Refusing())
    assert seg.read_bytes() == before and sorted(tmp_path.iterdir()) == [seg]
    assert len(found.in_place) == 1 and not found.quarantined
    assert [r.offset for r in everything(log)] == [i for i in range(1, 201) if i != bad]
    log.close()


def test_a_damaged_end_without_room_stays_and_the_log_goes_on_in_a_new_segment(
        tmp_path: Path) -> None:
    """The newest segment ends in damage that is no torn write (zeros where records were):
    without room to set it aside it stays, and nothing is appended after it (a later start
    could take what follows for the damaged record's payload): a new segment takes the
    next records. A start with room then sets the damage aside."""
    write_log(tmp_path, 100)
    seg, = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    at = rec.scan(bytes(data)).records[90][1]
    data[at:] = bytes(len(data) - at)  # records 91-100 zeroed
    seg.write_bytes(bytes(data))
    log, found = reopen(tmp_path, disk=NoRoom())
    assert seg.read_bytes() == bytes(data)
    assert len(found.in_place) == 1 and found.torn_bytes == 0
    assert [s.name for s in segments(tmp_path)] == [seg.name, f"{log.next_offset:020d}.seg"]
    assert log.append(MSG, b"after", 5000) == log.next_offset - 1
    b = log.take_batch()
    assert b is not None
    b.write(log.disk, True)
    log.commit(b)
    log.close()
    roomy, found = reopen(tmp_path)
    assert found.quarantined == [f"{seg.name}.{at}.corrupt"]
    assert [r.body for r in everything(roomy)] == [body(i) for i in range(90)] + [b"after"]
    roomy.close()


def test_without_room_for_a_new_segment_the_one_line_says_what_is_needed(
        tmp_path: Path) -> None:
    """The one write recovery cannot do without, on a disk with no room at all: the error
    says how much room it needs."""
    import errno

    write_log(tmp_path, 100)
    seg, = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    at = rec.scan(bytes(data)).records[90][1]
    data[at:] = bytes(len(data) - at)
    seg.write_bytes(bytes(data))

    class Full(NoRoom):
        def write_file(self, path: str, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WalError) as refused:
        reopen(tmp_path, disk=Full())
    said = str(refused.value)
    assert "recovery needs room for a new segment" in said, said
    assert "(16 bytes, 4096 on this file system; 0 bytes free): make room" in said, said
    assert seg.read_bytes() == bytes(data)


class _Crash(BaseException):
    """The process killed in the middle of recovery (not an OSError: nothing catches it)."""


class Crashing(Disk):
    """Dies at its ``at``-th change to the files (a write leaves half of its bytes)."""

    def __init__(self, at: int, room: bool) -> None:
        super().__init__()
        self.at, self.room, self.changes = at, room, 0

    def _change(self) -> bool:
        self.changes += 1
        return self.changes == self.at

    def free(self, directory: str) -> tuple[int, int]:
        return super().free(directory) if self.room else (0, 4096)

    def write_file(self, path: str, data: bytes) -> None:
        if self._change():
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise _Crash
        super().write_file(path, data)

    def overwrite(self, path: str, pos: int, data: bytes) -> None:
        if self._change():
            super().overwrite(path, pos, data[: len(data) // 2])
            raise _Crash
        super().overwrite(path, pos, data)

    def rename(self, src: str, dst: str) -> None:
        if self._change():
            raise _Crash
        super().rename(src, dst)

    def remove(self, path: str) -> None:
        if self._change():
            raise _Crash
        super().remove(path)

    def truncate(self, path: str, size: int) -> None:
        if self._change():
            raise _Crash
        super().truncate(path, size)


def _middle_and_torn(where: Path) -> None:
    write_log(where, 120, LogOptions(segment_bytes=4000), batch=7)
    first, *_, newest = segments(where)
    flip(first, rec.scan(first.read_bytes()).records[10][1] + 40, 0x01)  # middle damage
    flip(newest, 9, 0x01)  # its header's base offset
    os.truncate(newest, newest.stat().st_size - 5)  # a torn tail


def _damaged_end(where: Path) -> None:
    write_log(where, 100)
    seg, = segments(where)
    data = bytearray(seg.read_bytes())
    at = rec.scan(bytes(data)).records[90][1]
    data[at:] = bytes(len(data) - at)
    seg.write_bytes(bytes(data))


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
@pytest.mark.parametrize("damage", [_middle_and_torn, _damaged_end], ids=["middle", "end"])
def test_a_crash_at_any_step_of_recovery_loses_no_valid_record(
        tmp_path: Path, room: bool, damage) -> None:  # type: ignore[no-untyped-def]
    """Killed at each change recovery makes (a write half done), then started again: every
    record valid before is still there, nothing damaged is read, and offsets go on past
    every one used."""
    reference = tmp_path / "reference"
    damage(reference)
    pristine = tmp_path / "pristine"
    shutil.copytree(reference, pristine)
    opts = LogOptions(segment_bytes=4000)
    log, _ = reopen(reference, opts)
    kept, next_offset = everything(log), log.next_offset
    log.close()
    for at in range(1, 40):  # bounded: recovery makes a few changes
        where = tmp_path / f"crash-{at}"
        shutil.copytree(pristine, where)
        disk = Crashing(at, room)
        try:
            Log(str(where), opts, disk).open()
        except _Crash:
            pass
        else:
            assert at > 1
            break
        again, _ = reopen(where, opts)
        assert everything(again) == kept, at
        assert again.next_offset >= next_offset
        again.close()
    else:
        raise AssertionError("recovery never finished")
