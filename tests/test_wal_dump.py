"""`blipmq wal dump|inspect|cat` against logs written by a real broker, and damaged ones."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import BLIPMQ
from crc32c import crc32c
from fleet import CONFIG, drive
from terminal import stderr_on_terminal

from blipmq_cli.exits import Exit
from blipmq_server.errors import WalError
from blipmq_server.wal import reader
from blipmq_server.wal import record as rec


def blipmq(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([BLIPMQ, *args], capture_output=True, timeout=60)


def cat_json(path: Path | str, *extra: str) -> list[dict]:
    res = blipmq("wal", "cat", str(path), *extra)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def test_dump_while_the_broker_runs_copies_every_record(start_broker, tmp_path) -> None:
    b = start_broker(CONFIG)
    sent = drive(b, "pi-1")
    out = tmp_path / "dump"
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out),
                "--device-id", "pi-1")
    assert res.returncode == 0, res.stderr
    assert b"dump of pi-1" in res.stderr and res.stdout == b""
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device_id"] == "pi-1" and manifest["format_version"] == 1
    assert manifest["blipmq_version"] == "0.1.0" and manifest["damaged_bytes"] == 0
    records = cat_json(out)
    assert manifest["records"] == len(records)
    assert [r["offset"] for r in records] == sorted(r["offset"] for r in records)
    assert manifest["first_offset"] == records[0]["offset"]
    assert manifest["last_offset"] == records[-1]["offset"]
    messages = [r for r in records if r["kind"] == "message"]
    assert Counter(r["topic"] for r in messages) == sent.counts
    got_bytes = Counter()
    for r in messages:
        got_bytes[r["topic"]] += len(r["payload"].encode())
    assert got_bytes == sent.payload_bytes
    assert sum(r["qos"] for r in messages) == sent.qos1
    dead = [r for r in messages if "dead_letter" in r]
    assert len(dead) == sent.dead and all(r["topic"] == "$dlq/alerts" for r in dead)
    assert {r["dead_letter"]["deliveries"] for r in dead} == {2}
    groups = {(r["op"], r["group"]) for r in records if r["kind"] == "group"}
    assert {("create", "billing"), ("create", "pager")} <= groups
    acks = [r for r in records if r["kind"] == "ack"]
    assert acks and all(r["offsets"] or r["floor"] for r in acks)
    # the copy is the source's bytes, and each segment's checksum is in the manifest
    for seg in manifest["segments"]:
        copy = (out / "wal" / seg["name"]).read_bytes()
        assert (b.data_dir / "wal" / seg["name"]).read_bytes().startswith(copy)
        assert len(copy) == seg["size"] and crc32c(copy) == seg["crc32c"]
    # the broker went on untouched: a confirmed publish, and a clean restart
    assert b.cli("pub", "orders", "after", "--qos", "1").returncode == 0
    assert b.stop() == 0
    b2 = start_broker(CONFIG, data_dir=b.data_dir)
    assert b2.metric("blipmq_wal_recovery_quarantined") == 0
    assert b2.metric("blipmq_wal_recovery_torn_bytes") == 0


def test_dump_again_adds_only_what_is_new(start_broker, tmp_path) -> None:
    b = start_broker({"wal": {"segment_bytes": 4096}})
    out = tmp_path / "dump"
    lines = b"".join(b"reading %05d\n" % i for i in range(300))
    assert b.cli("pub", "t", "--lines", "-", "--qos", "1", input=lines).returncode == 0
    assert b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out)).returncode == 0
    first = json.loads((out / "manifest.json").read_text())
    assert first["records"] == 300 and len(first["segments"]) > 3
    assert first["device_id"] == os.uname().nodename
    sealed = {s["name"]: (out / "wal" / s["name"]).stat().st_mtime_ns
              for s in first["segments"][:-1]}
    more = b"".join(b"later %05d\n" % i for i in range(40))
    assert b.cli("pub", "t", "--lines", "-", "--qos", "1", input=more).returncode == 0
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert b"40 new record(s)" in res.stderr
    second = json.loads((out / "manifest.json").read_text())
    assert second["records"] == 340 and second["created_ms"] == first["created_ms"]
    for name, mtime in sealed.items():  # sealed copies were not written again
        assert (out / "wal" / name).stat().st_mtime_ns == mtime
    payloads = blipmq("wal", "cat", str(out), "--format", "lines").stdout
    assert payloads == lines + more
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out))
    assert b"0 new record(s)" in res.stderr
    # another device's name into the same dump is refused
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out),
                "--device-id", "other")
    assert res.returncode == Exit.USAGE and b"holds the dump of device" in res.stderr


def test_dumps_taken_during_a_publish_are_whole_and_catch_up(start_broker, tmp_path) -> None:
    b = start_broker({"wal": {"segment_bytes": 64 * 1024}})
    out = tmp_path / "dump"
    n = 20_000
    pub = b.spawn_shell(f"seq 1 {n} | blipmq pub load --lines - --qos 1")
    rounds = 0
    while pub.poll() is None and rounds < 200:  # bounded: one dump per round
        res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out))
        assert res.returncode == 0, res.stderr
        assert b"not copied" not in res.stderr
        rounds += 1
    assert pub.wait(60) == 0
    assert b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out)).returncode == 0
    assert rounds >= 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == n and manifest["damaged_bytes"] == 0
    assert blipmq("wal", "cat", str(out), "--format", "lines").stdout.split() == [
        str(i).encode() for i in range(1, n + 1)]


def test_since_and_until_keep_a_time_window(start_broker, tmp_path) -> None:
    b = start_broker()
    # QoS 1: confirmed once written, so the files hold it when ``pub`` returns (a QoS 0
    # record may be held back to grow a batch first)
    assert b.cli("pub", "--qos", "1", "t", "early").returncode == 0
    cut = cat_json(b.data_dir)[-1]["timestamp_ms"] + 1
    while time.time() * 1000 <= cut:  # the next record must be stamped after ``cut``
        time.sleep(0.001)
    assert b.cli("pub", "--qos", "1", "t", "late").returncode == 0
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(tmp_path / "a"),
                "--since", str(cut))
    assert res.returncode == 0, res.stderr
    assert [r["payload"] for r in cat_json(tmp_path / "a")] == ["late"]
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(tmp_path / "b"),
                "--until", str(cut))
    assert [r["payload"] for r in cat_json(tmp_path / "b")] == ["early"]
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(tmp_path / "c"),
                "--since", "yesterday")
    assert res.returncode == Exit.USAGE and res.stderr.count(b"\n") == 1


def damaged_log(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A data dir of two segments whose first has a flipped byte in its third record."""
    from blipmq_server.protocol.message import Message, message_record

    wal = tmp_path / "data" / "wal"
    wal.mkdir(parents=True)
    payloads = [b"p%02d" % i for i in range(10)]
    bodies = [message_record(Message("t", p)) for p in payloads]
    one = rec.encode_many(1, 1, 1_700_000_000_000, bodies[:5])
    two = rec.encode_many(1, 6, 1_700_000_000_000, bodies[5:])
    data = bytearray(rec.header(1) + b"".join(one))
    hit = rec.HEADER_SIZE + len(one[0]) + len(one[1]) + 30
    data[hit] ^= 0xFF
    (wal / "00000000000000000001.seg").write_bytes(bytes(data))
    (wal / "00000000000000000006.seg").write_bytes(rec.header(6) + b"".join(two))
    return tmp_path / "data", [p for i, p in enumerate(payloads) if i != 2]


def test_damage_is_reported_and_skipped_never_fatal(tmp_path) -> None:
    data_dir, good = damaged_log(tmp_path)
    res = blipmq("wal", "cat", str(data_dir), "--format", "lines")
    assert res.returncode == 0
    assert res.stdout.split() == good
    assert res.stderr.count(b"\n") == 1 and b"CRC mismatch" in res.stderr
    res = blipmq("wal", "inspect", str(data_dir))
    assert res.returncode == 0, res.stderr
    assert b"Damage found" in res.stdout and b"CRC mismatch" in res.stdout
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(tmp_path / "d"))
    assert res.returncode == 0 and b"not copied" in res.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["records"] == 9 and manifest["damaged_bytes"] > 0
    assert blipmq("wal", "cat", str(tmp_path / "d"), "--format", "lines").stdout.split() == good
    # a single segment file, whatever its bytes
    seg = tmp_path / "junk.seg"
    seg.write_bytes(os.urandom(5000))
    res = blipmq("wal", "inspect", str(seg))
    assert res.returncode == 0 and b"Damage found" in res.stdout


def test_inspect_counts_topics_and_kinds(start_broker) -> None:
    b = start_broker(CONFIG)
    sent = drive(b, "gw-7", readings=11, orders=4, alerts=2)
    res = b.cli("wal", "inspect", str(b.data_dir))
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode()
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()]
    topics = {r[0]: r[1:] for r in rows if len(r) == 3}
    for topic, n in sent.counts.items():
        assert topics[topic] == [f"{n:,}", f"{sent.payload_bytes[topic]:,}"]
    assert "No damage found." in text


@pytest.mark.parametrize("args", [
    ("wal", "cat", "/nonexistent/blipmq"),
    ("wal", "inspect", "/etc"),
    ("wal", "inspect", "/etc/hostname"),
    ("wal", "cat", "/etc", "--format", "xml"),
    ("wal", "dump", "--data-dir", "/etc", "--out", "/tmp/never"),
])
def test_bad_paths_are_one_line_and_exit_2(args) -> None:
    res = blipmq(*args)
    assert res.returncode == Exit.USAGE
    assert res.stderr.count(b"\n") == 1 and b"Traceback" not in res.stderr


def test_dump_refuses_a_directory_that_is_not_a_dump(start_broker, tmp_path) -> None:
    b = start_broker()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(tmp_path / "busy"))
    assert res.returncode == Exit.USAGE and b"is not a dump" in res.stderr


def test_check_cuts_a_partial_tail_at_every_byte() -> None:
    from blipmq_server.protocol.message import Message, message_record

    records = rec.encode_many(1, 1, 5, [message_record(Message("a/b", b"x" * i))
                                        for i in range(6)])
    data = rec.header(1) + b"".join(records)
    ends = [rec.HEADER_SIZE + sum(map(len, records[:i])) for i in range(len(records) + 1)]
    for cut in range(len(data) + 1):
        got = reader.check(data[:cut], "00000000000000000001.seg")
        whole = sum(1 for e in ends[1:] if e <= cut)
        assert len(got.records) == whole and not got.damage
        assert got.good_end == (max(e for e in ends if e <= cut) if cut >= 16 else 0)
        closed = reader.check(data[:cut], open_tail=False)
        assert len(closed.records) == whole
        assert bool(closed.damage) == (cut not in ends)


def test_check_never_reads_a_record_inside_a_damaged_payload() -> None:
    """D1: ``blipmq wal`` and the dump readers resynced onto a record a client had put in a
    payload, after one flipped bit in that message's record (and lost the records after
    it when its offset was large)."""
    from blipmq_server.protocol.message import Message, message_record

    forged = rec.encode(1, 1000, 5, message_record(Message("forged", b"!")))
    bodies = [message_record(Message("t", p)) for p in (b"a", b"x" + forged + b"y", b"b")]
    data = bytearray(rec.header(1) + b"".join(rec.encode_many(1, 1, 5, bodies)))
    second = rec.scan(bytes(data)).records[1][1]
    for where, mask in ((1, 0xFF), (20, 0x01)):  # its length; its timestamp
        damaged = bytearray(data)
        damaged[second + where] ^= mask
        for open_tail in (True, False):
            got = reader.check(bytes(damaged), open_tail=open_tail)
            assert [o for o, _ in got.records] == [1, 3]
            assert [(d.start, d.end) for d in got.damage] == [(second, got.records[1][1])]


def test_dump_draws_its_progress_on_a_terminal(tmp_path) -> None:
    from blipmq_server.protocol.message import Message, message_record

    wal = tmp_path / "data" / "wal"
    wal.mkdir(parents=True)
    body = message_record(Message("t", b"x" * 1000))
    for i in range(20):  # 20 segments of 1,000 records: one progress step each
        base = 1 + i * 1000
        records = rec.encode_many(1, base, 1_700_000_000_000, [body] * 1000)
        (wal / f"{base:020d}.seg").write_bytes(rec.header(base) + b"".join(records))
    status, text = stderr_on_terminal(  # stderr on a terminal: the bar is drawn there
        [BLIPMQ, "wal", "dump", "--data-dir", str(tmp_path / "data"),
         "--out", str(tmp_path / "dump")], dict(os.environ))
    assert status == 0
    percents = {int(p) for p in re.findall(r"(\d{1,3})%", text)}
    assert "dumping" in text, text[-500:]
    assert len(percents & set(range(1, 100))) >= 3, sorted(percents)  # drawn on the way
    assert len(cat_json(tmp_path / "dump")) == 20_000


def _message(topic: str, payload: bytes) -> bytes:
    from blipmq_server.protocol import message as msg

    return msg.message_record(msg.Message(topic, payload, 1, 0, None, False))


def _crafted_log(tmp_path: Path, bad: list[tuple[int, bytes, int]]) -> tuple[Path, list[bytes]]:
    """A data directory of one segment with ten messages, some replaced by records whose
    CRC holds: (index, body, timestamp_ms). Returns it and the payloads that stay good."""
    wal = tmp_path / "data" / "wal"
    wal.mkdir(parents=True)
    out, good = [], []
    crafted = {i: (body, ts) for i, body, ts in bad}
    for i in range(10):
        body, ts = crafted.get(i, (_message("t", b"m%d" % i), 1795363200000 + i))
        out.append(rec.encode(rec.Kind.MESSAGE, i + 1, ts, body))
        if i not in crafted:
            good.append(b"m%d" % i)
    (wal / "00000000000000000001.seg").write_bytes(rec.header(1) + b"".join(out))
    return tmp_path / "data", good


def _spark_decode(path: Path) -> subprocess.CompletedProcess[bytes]:
    """``read_pieces`` (the export's and the Spark source's decoder) in a process of its own:
    what it read, as JSON lines (a crash stays there)."""
    code = ("import json, sys\nfrom spark_tools.source import plan, read_pieces\n"
            "for g in plan([sys.argv[1]]):\n"
            "    for b in read_pieces(g):\n"
            "        for r in b.select(['kind', 'offset', 'payload_size', 'problem', 'segment']"
            ").to_pylist(): print(json.dumps(r))\n")
    return subprocess.run([os.sys.executable, "-c", code, str(path)], capture_output=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in os.sys.path if p)})


def test_a_message_whose_lengths_run_past_its_record_is_damage_in_every_reader(tmp_path) -> None:
    """D03: a CRC-valid MESSAGE whose payload or topic length runs past the record: the wal
    tools clamped it silently, the Spark decoder read past the buffer (SIGSEGV)."""
    import struct

    huge_payload = struct.pack(">BIHHI", 1, 0, 1, 0, 0xFFFFFFFF) + b"tx"
    huge_topic = struct.pack(">BIHHI", 1, 0, 0xFFFF, 0, 1) + b"tx"
    data_dir, good = _crafted_log(tmp_path, [(4, huge_payload, 1795363200004),
                                             (9, huge_topic, 1795363200009)])
    res = blipmq("wal", "cat", str(data_dir), "--format", "lines")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == good
    err = res.stderr.decode()
    assert "MESSAGE record 5 cannot be read" in err and "MESSAGE record 10 cannot be read" in err
    assert "run past" in err, err
    res = blipmq("wal", "inspect", str(data_dir))
    assert res.returncode == 0 and b"Damage found: 2 part(s)" in res.stdout, res.stdout
    res = _spark_decode(data_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["offset"] for r in rows if r["kind"] == "message"] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert sorted(r["problem"][:24] for r in rows if r["kind"] == "damage") == [
        "MESSAGE record 10 cannot", "MESSAGE record 5 cannot "]


def test_a_message_whose_topic_is_not_utf8_is_damage_in_every_reader(start_broker,
                                                                      tmp_path) -> None:
    """A CRC-valid MESSAGE with the topic b"t/\\xff" was delivered: a durable group's
    consumer refused the DELIVER as malformed, reconnected and was handed it again, for
    good (the group never moved past it). Now it is damage like lengths that run past."""
    import struct

    bad = struct.pack(">BIHHI", 1, 0, 3, 0, 2) + b"t/\xff" + b"no"
    data_dir, good = _crafted_log(tmp_path, [(4, bad, 1795363200004)])
    res = blipmq("wal", "cat", str(data_dir), "--format", "lines")
    assert res.returncode == 0 and res.stdout.split() == good, res.stderr
    assert b"MESSAGE record 5 cannot be read (its topic is not UTF-8)" in res.stderr
    res = _spark_decode(data_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["offset"] for r in rows if r["kind"] == "message"] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    b = start_broker(data_dir=data_dir)
    res = b.cli("sub", "#", "-q", "1", "--group", "g", "--from", "earliest", "-e", timeout=30)
    assert res.returncode == 0 and res.stdout.split() == good, res.stderr
    assert any("MESSAGE record 5 cannot be read (its topic is not UTF-8)" in line
               for line in b.log)


def test_a_timestamp_past_year_9999_is_damage_not_a_crash(tmp_path) -> None:
    """D10: a CRC-valid record stamped 2^63+5 ms made `wal inspect`/`cat` exit 1."""
    data_dir, good = _crafted_log(tmp_path, [(3, _message("t", b"late"), 2**63 + 5)])
    for args in (("cat", str(data_dir)), ("inspect", str(data_dir))):
        res = blipmq("wal", *args)
        assert res.returncode == 0, res.stderr
        assert b"past the year 9999" in res.stdout + res.stderr
    res = blipmq("wal", "cat", str(data_dir), "--format", "lines")
    assert res.stdout.split() == good
    res = _spark_decode(data_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert 4 not in [r["offset"] for r in rows] and len(rows) == 10


def test_a_fifo_named_like_a_segment_is_refused_not_waited_on(tmp_path) -> None:
    """D10: a FIFO named *.seg hung `wal inspect|cat|dump` (opening it waits for a writer)."""
    data_dir, good = _crafted_log(tmp_path, [])
    os.mkfifo(data_dir / "wal" / "00000000000000008889.seg")
    for args in (("cat", str(data_dir), "--format", "lines"), ("inspect", str(data_dir)),
                 ("dump", "--data-dir", str(data_dir), "--out", str(tmp_path / "d"))):
        res = subprocess.run([BLIPMQ, "wal", *args], capture_output=True, timeout=20)
        assert res.returncode == 0, res.stderr
        assert b"00000000000000008889.seg: not a regular file" in res.stdout + res.stderr
    assert blipmq("wal", "cat", str(tmp_path / "d"), "--format", "lines").stdout.split() == good
    res = subprocess.run([BLIPMQ, "wal", "inspect", str(data_dir / "wal" /
                                                        "00000000000000008889.seg")],
                         capture_output=True, timeout=20)
    assert res.returncode == Exit.USAGE and b"not a regular file" in res.stderr


def test_a_segment_file_not_named_after_an_offset_is_not_read(tmp_path) -> None:
    """D8: with a copy of a segment kept as ``wal/12.seg``, `wal cat` printed its messages
    too (duplicates, offsets going backwards) where broker recovery set them aside. Like
    recovery now, the readers leave such a file out of the log, and say so."""
    data_dir, good = _crafted_log(tmp_path, [])
    segment = data_dir / "wal" / "00000000000000000001.seg"
    (data_dir / "wal" / "12.seg").write_bytes(segment.read_bytes())
    for args in (("cat", str(data_dir), "--format", "lines"), ("inspect", str(data_dir)),
                 ("dump", "--data-dir", str(data_dir), "--out", str(tmp_path / "d"))):
        res = subprocess.run([BLIPMQ, "wal", *args], capture_output=True, timeout=20)
        assert res.returncode == 0, res.stderr
        assert b"12.seg: not named after an offset" in res.stdout + res.stderr
    assert blipmq("wal", "cat", str(data_dir), "--format", "lines").stdout.split() == good
    assert blipmq("wal", "cat", str(tmp_path / "d"), "--format", "lines").stdout.split() == good
    assert sorted(p.name for p in (tmp_path / "d" / "wal").iterdir()) == [segment.name]


def _dump_of_three_segments(start_broker, tmp_path) -> Path:
    b = start_broker({"wal": {"segment_bytes": 4096}})
    assert b.shell("seq 1 300 | blipmq pub t --qos 1 --lines -").returncode == 0
    out = tmp_path / "dump"
    assert b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out)).returncode == 0
    assert b.stop() == 0
    assert len(list((out / "wal").glob("*.seg"))) >= 3
    return out


def test_a_dump_missing_or_cutting_a_segment_is_reported(start_broker, tmp_path) -> None:
    """D04: a dump missing a segment, or whose last segment is cut short or empty, or one
    whose bytes changed, said "No damage found"."""
    out = _dump_of_three_segments(start_broker, tmp_path)
    segs = sorted((out / "wal").glob("*.seg"))
    res = blipmq("wal", "inspect", str(out))
    assert b"No damage found." in res.stdout
    saved = {p: p.read_bytes() for p in segs}
    cases = {
        "missing": lambda: segs[1].unlink(),
        "cut": lambda: segs[-1].write_bytes(saved[segs[-1]][:len(saved[segs[-1]]) - 30]),
        "empty": lambda: segs[-1].write_bytes(b""),
        # a header's base offset changed: no record check sees it, the manifest's CRC does
        "changed": lambda: segs[0].write_bytes(saved[segs[0]][:15] + bytes(
            [saved[segs[0]][15] ^ 0x40]) + saved[segs[0]][16:]),
    }
    want = {"missing": b"segment missing", "cut": b"segment cut short",
            "empty": b"segment cut short", "changed": b"differs from the dump's manifest"}
    for case, spoil in cases.items():
        spoil()
        res = blipmq("wal", "inspect", str(out))
        assert res.returncode == 0, res.stderr
        assert b"Damage found" in res.stdout and want[case] in res.stdout, (case, res.stdout)
        res = blipmq("wal", "cat", str(out), "--format", "lines")
        assert res.returncode == 0 and want[case] in res.stderr, (case, res.stderr)
        for p, data in saved.items():
            p.write_bytes(data)


def test_unknown_format_versions_are_refused_or_named(start_broker, tmp_path) -> None:
    """D12: a segment stamped version 99 was read as version 1 (and recovery rewrote it as
    version 1); a dump manifest claiming version 2 was read without a word."""
    out = _dump_of_three_segments(start_broker, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = manifest["wal_format_version"] = 2
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = blipmq("wal", "inspect", str(out))
    assert res.returncode == 0 and b"dump format version 2" in res.stdout, res.stdout
    b = start_broker()
    assert b.cli("pub", "t", "x", "--qos", "1").returncode == 0
    assert b.stop() == 0
    seg, = (b.data_dir / "wal").glob("*.seg")
    data = bytearray(seg.read_bytes())
    data[6:8] = (99).to_bytes(2, "big")
    seg.write_bytes(bytes(data))
    res = blipmq("wal", "inspect", str(b.data_dir))
    assert res.returncode == 0 and b"segment format version 99" in res.stdout, res.stdout
    assert b"0 record(s)" in res.stdout


def test_dump_again_after_recovery_rewrote_the_segment(start_broker, tmp_path) -> None:
    """A dump, then a byte flipped in the active segment, a restart (recovery sets the
    record aside and rewrites the segment, a record shorter), more records (the segment
    grows past its old size), another dump into the same directory: it copied on from the
    old size in the rewritten file, and ``msg-00101`` was missing, without a word. A
    segment whose copied part changed is copied again, and said so."""
    b = start_broker()
    out = tmp_path / "dump"
    first = b"".join(b"msg-%05d\n" % i for i in range(1, 101))
    assert b.cli("pub", "shift", "--lines", "-", "--qos", "1", input=first).returncode == 0
    assert b.stop() == 0
    assert b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out)).returncode == 0
    (segment,) = sorted((b.data_dir / "wal").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    pos = rec.HEADER_SIZE
    for _ in range(50):  # to record 51
        pos += 4 + rec.PREFIX.unpack_from(data, pos)[0]
    data[pos + 30] ^= 0xFF
    segment.write_bytes(bytes(data))
    b = start_broker(data_dir=b.data_dir)
    second = b"".join(b"msg-%05d\n" % i for i in range(101, 201))
    assert b.cli("pub", "shift", "--lines", "-", "--qos", "1", input=second).returncode == 0
    assert b.stop() == 0
    res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(out))
    assert res.returncode == 0 and b"rewritten since the last dump" in res.stderr, res
    dumped = blipmq("wal", "cat", str(out), "--topic", "shift", "--format", "lines").stdout
    kept = blipmq("wal", "cat", str(b.data_dir), "--topic", "shift", "--format", "lines").stdout
    assert dumped == kept and b"msg-00101\n" in dumped and b"msg-00200\n" in dumped


def _log_of(wal: Path, segments: list[list[tuple[int, bytes]]]) -> Path:
    """A data directory whose segments hold messages on topic ``t``: (timestamp_ms, payload)
    each, offsets from 1 on. Returns the data directory."""
    wal.mkdir(parents=True)
    offset = 1
    for records in segments:
        data = [rec.encode(rec.Kind.MESSAGE, offset + i, ts, _message("t", payload))
                for i, (ts, payload) in enumerate(records)]
        (wal / f"{offset:020d}.seg").write_bytes(rec.header(offset) + b"".join(data))
        offset += len(records)
    return wal.parent


@pytest.mark.parametrize("device", ["", "  ", "pi\x1b[2J", "x" * 201])
def test_dump_refuses_a_device_id_that_export_would_refuse(tmp_path, device: str) -> None:
    """A device id ``blipmq export`` refuses in a manifest (empty, control characters, over
    200 characters) was written into the dump, to be refused only later on the analytics
    side: ``wal dump`` refuses it at once, exit 2, one line, and writes nothing."""
    data_dir = _log_of(tmp_path / "data" / "wal", [[(1795363200000, b"a")]])
    out = tmp_path / "dump"
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(out),
                 "--device-id", device)
    assert res.returncode == Exit.USAGE, res.stderr
    assert res.stderr.startswith(b"blipmq: --device-id ") and res.stderr.count(b"\n") == 1
    assert not out.exists()
    ok = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(out),
                "--device-id", "x" * 200)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((out / "manifest.json").read_text())["device_id"] == "x" * 200


def test_a_directory_of_dumps_never_hides_a_device(tmp_path) -> None:
    """h30 #2: a stray segment file copied to the top of a directory of dumps was read as
    the only log there, every device dump one level down silently left out; a device's dump
    named ``wal`` was taken for the directory's own (empty) log: "the logs hold no records".
    A dump named ``wal`` is a device like any other now, and a directory holding a log of its
    own (or a manifest) and logs one level down is refused in one line naming both."""
    data_dir = _log_of(tmp_path / "data" / "wal", [[(1795363200000, b"a"), (1795363201000, b"b")]])
    dumps = tmp_path / "dumps"
    for device in ("dev1", "wal"):
        res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(dumps / device),
                     "--device-id", device)
        assert res.returncode == 0, res.stderr

    def roots(path: Path) -> list[str]:
        return [os.path.relpath(log.root, tmp_path) for log in reader.find_logs(str(path))]

    assert roots(dumps) == ["dumps/dev1", "dumps/wal"]
    # the documented layouts as before: a data directory, its wal/, a dump, one segment
    assert roots(data_dir) == ["data"] and roots(data_dir / "wal") == ["data/wal"]
    assert roots(dumps / "wal") == ["dumps/wal"]
    assert [len(log.segments) for log in reader.find_logs(str(dumps / "wal"))] == [1]
    assert cat_json(dumps / "wal") == cat_json(data_dir)
    (tmp_path / "fresh" / "wal").mkdir(parents=True)  # a log with no segment yet is a log
    assert roots(tmp_path / "fresh") == ["fresh"]
    res = blipmq("wal", "inspect", str(dumps))  # one log wanted: name the ones there
    assert res.returncode == Exit.USAGE and res.stderr.count(b"\n") == 1, res.stderr
    assert b"(dev1, wal): give one of them" in res.stderr
    segment = dumps / "dev1" / "wal" / "00000000000000000001.seg"
    strays = {"a segment file": (dumps / segment.name, segment.read_bytes()),
              "a manifest": (dumps / "manifest.json", (dumps / "dev1" / "manifest.json")
                             .read_bytes())}
    for what, (stray, data) in strays.items():
        stray.write_bytes(data)
        with pytest.raises(WalError, match=r"ambiguous: .*\(dev1, wal\)") as refused:
            reader.find_logs(str(dumps))
        assert stray.name in str(refused.value), what
        res = blipmq("export", str(dumps), "--output", str(tmp_path / "out"))
        assert res.returncode == Exit.USAGE and res.stderr.count(b"\n") == 1, res.stderr
        assert b"ambiguous" in res.stderr and stray.name.encode() in res.stderr, what
        stray.unlink()
    # a data directory holding a dump: which one is meant cannot be told either
    os.rename(dumps / "dev1", data_dir / "dev1")
    with pytest.raises(WalError, match=r"ambiguous: .*\(a wal/ directory of segments\)"):
        reader.find_logs(str(data_dir))
    assert not (tmp_path / "out").exists()


def test_logs_two_levels_down_beside_one_level_down_are_named_not_left_out(tmp_path) -> None:
    """h32 #6: ``top/b`` (a dump) and ``top/site1/a`` (a dump a level further down): the
    directory of dumps read ``b`` and left ``a`` out without a word. Now refused in one line
    naming both levels; a subdirectory with no log anywhere (lost+found) is still passed
    over, and names with escape sequences are shown as escapes on the terminal."""
    data_dir = _log_of(tmp_path / "data" / "wal", [[(1795363200000, b"a")]])
    top = tmp_path / "top"
    for where in ("b", "site1/a", "site1/\x1b[2Jc"):
        # (a device id takes no control characters: the folder's name does)
        res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(top / where),
                     "--device-id", where.rpartition("/")[2].replace("\x1b[2J", ""))
        assert res.returncode == 0, res.stderr
    (top / "lost+found").mkdir()
    with pytest.raises(WalError, match=r"1 log\(s\) one level down \(b\) and more two levels "
                                       r"down \(site1/\x1b\[2Jc, site1/a\)"):
        reader.find_logs(str(top))
    res = blipmq("export", str(top), "--output", str(tmp_path / "out"))
    assert res.returncode == Exit.USAGE and res.stderr.count(b"\n") == 1, res.stderr
    assert b"site1/a" in res.stderr and b"\x1b" not in res.stderr  # shown as \\x1b
    assert b"site1/\\x1b[2Jc" in res.stderr
    shutil.rmtree(top / "site1")
    assert [os.path.basename(log.root) for log in reader.find_logs(str(top))] == ["b"]


def test_json_lines_write_terminal_controls_as_escapes_of_the_same_values(
        start_broker, tmp_path) -> None:
    """h32 #5: `wal cat` (and `sub --format json`) wrote C1 controls and bidi overrides in a
    topic or payload raw, for a terminal to act on (CSI 2J clears it), where `stats --json`
    wrote them as escapes. Now as \\uXXXX escapes: the same values once decoded."""
    topic, payload = "c1/\u009b2J/\u202eevil", "p\u2028q\u0085"
    wal = tmp_path / "data" / "wal"
    wal.mkdir(parents=True)
    record = rec.encode(rec.Kind.MESSAGE, 1, 1795363200000, _message(topic, payload.encode()))
    (wal / f"{1:020d}.seg").write_bytes(rec.header(1) + record)
    res = blipmq("wal", "cat", str(tmp_path / "data"))
    assert res.returncode == 0, res.stderr
    for raw in ("\u009b", "\u202e", "\u2028", "\u0085"):
        assert raw.encode() not in res.stdout, raw
    [row] = [json.loads(line) for line in res.stdout.splitlines()]
    assert row["topic"] == topic
    b = start_broker()
    sub = b.spawn("sub", "c1/#", "--format", "json", "--count", "1")
    b.wait_subscribers(1)
    assert b.cli("pub", topic, payload).returncode == 0
    out, err = sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    assert b"\\u009b" in out and "\u009b".encode() not in out
    assert json.loads(out)["topic"] == topic and json.loads(out)["payload"] == payload


_KILLED_DUMP = """
import os, signal, sys
from blipmq_cli.dump import dump
dump(sys.argv[1], sys.argv[2], device_id=sys.argv[3] or None,
     progress=lambda done, total: os.kill(os.getpid(), signal.SIGKILL))
"""


def _killed_dump(data_dir: Path, out: Path, device_id: str = "") -> None:
    """``wal dump`` SIGKILLed right after copying its first segment (progress is reported
    after each copy), as a reboot or the OOM killer would cut it."""
    res = subprocess.run([sys.executable, "-c", _KILLED_DUMP, str(data_dir), str(out),
                          device_id], capture_output=True, timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr


def test_a_first_dump_killed_midway_is_completed_by_the_next_run(tmp_path) -> None:
    """h30 #7: a first ``wal dump`` killed before it wrote manifest.json left PATH with
    segments and no manifest, and every later run refused it for good ("exists and is not a
    dump"). A first run writes its manifest before copying, so the next run completes it; a
    directory without a manifest is still someone else's and refused."""
    t = 1795363200000
    data_dir = _log_of(tmp_path / "data" / "wal",
                       [[(t + 10 * s + i, b"s%d-%d" % (s, i)) for i in range(10)]
                        for s in range(3)])
    out = tmp_path / "dump"
    _killed_dump(data_dir, out, "k")
    assert [p.name for p in (out / "wal").iterdir()] == ["00000000000000000001.seg"]
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert b"dump of k in" in res.stderr and b"30 record(s) in all" in res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device_id"] == "k" and manifest["records"] == 30
    assert len(manifest["segments"]) == 3
    before = cat_json(out)
    assert before == cat_json(data_dir)
    assert b"No damage found." in blipmq("wal", "inspect", str(out)).stdout
    # a later run cut short leaves the previous dump readable, and the next one goes on
    (data_dir / "wal" / "00000000000000000031.seg").write_bytes(
        rec.header(31) + b"".join(rec.encode(rec.Kind.MESSAGE, 31 + i, t + 100 + i,
                                             _message("t", b"m%d" % i)) for i in range(5)))
    _killed_dump(data_dir, out)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert cat_json(out)[:30] == before  # (its new copy is reported as not listed)
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(out))
    assert res.returncode == 0 and b"35 record(s) in all" in res.stderr, res.stderr
    assert cat_json(out) == cat_json(data_dir)
    assert b"No damage found." in blipmq("wal", "inspect", str(out)).stdout
    # killed while writing its first manifest: only the temporary file is there
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "manifest.json.tmp").write_text('{"format": "blip')
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(tmp_path / "early"))
    assert res.returncode == 0, res.stderr
    # segments without a manifest are not this dump's: refused, as before
    foreign = tmp_path / "foreign"
    (foreign / "wal").mkdir(parents=True)
    (foreign / "wal" / "00000000000000000001.seg").write_bytes(
        (data_dir / "wal" / "00000000000000000001.seg").read_bytes())
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(foreign))
    assert res.returncode == Exit.USAGE and b"is not a dump" in res.stderr, res.stderr


def test_a_bare_year_or_date_is_a_date_not_milliseconds(tmp_path) -> None:
    """h30 #16: ``--since 2026`` and ``--since 20261127`` were read as ms since the epoch
    (a moment on 1 January 1970), so they kept everything."""
    day = 86_400_000
    nov27 = 1795737600000  # 2026-11-27T00:00:00Z
    stamps = [nov27 - 400 * day, nov27 - day // 2, nov27 + day // 2]
    data_dir = _log_of(tmp_path / "data" / "wal", [[(ts, b"r%d" % i) for i, ts in
                                                    enumerate(stamps)]])

    def window(name: str, *args: str) -> list[bytes]:
        out = tmp_path / name
        res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(out), *args)
        assert res.returncode == 0, res.stderr
        return blipmq("wal", "cat", str(out), "--format", "lines").stdout.split()

    assert window("date", "--since", "20261127") == [b"r2"]
    assert window("year", "--since", "2026", "--until", "20261127") == [b"r1"]
    assert window("ms", "--since", str(nov27 - day)) == [b"r1", b"r2"]  # 13 digits: ms
    assert window("iso", "--until", "2026-11-27") == [b"r0", b"r1"]
    res = blipmq("wal", "dump", "--data-dir", str(data_dir), "--out", str(tmp_path / "bad"),
                 "--since", "20261340")
    assert res.returncode == Exit.USAGE and res.stderr.count(b"\n") == 1, res.stderr
    assert b"not a date" in res.stderr and b"20261127" in res.stderr
