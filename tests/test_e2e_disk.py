"""A real full disk: the broker's data directory on a tiny tmpfs that runs out of space.

Mounting needs root (CAP_SYS_ADMIN); where the mount is refused the test is skipped with the
reason, and tests/test_server.py still covers write and fsync failures through the log's
file layer (FaultyDisk).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from blipmq_cli.exits import Exit

_SIZE = 1 << 20  # 1 MiB filesystem


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "tiny"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_SIZE}", "tmpfs", str(where)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_refuses_qos1_then_resumes(start_broker, tiny_fs: Path) -> None:
    b = start_broker({"wal": {"segment_bytes": 65536}}, data_dir=tiny_fs / "data")
    assert b.cli("pub", "t", "before", "--qos", "1").returncode == 0
    # fill the filesystem, leaving about 100 KiB
    filler = tiny_fs / "filler"
    st = os.statvfs(tiny_fs)
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 100 * 1024))
    # ~400 KB in publishes of 20 KB (one at once could be a single batch too big to fit)
    confirmed = 0
    for chunk in range(20):
        lines = b"".join(b"%04d" % i + b"x" * 996 + b"\n" for i in range(20 * chunk,
                                                                          20 * chunk + 20))
        full = b.cli("pub", "t", "-", "--qos", "1", "--lines", input=lines)
        if full.returncode != 0:
            break
        confirmed += 20
    assert full.returncode == Exit.REFUSED, full.stderr
    err = full.stderr.decode()
    assert err.count("\n") == 1 and "No space left on device" in err, err
    m = re.search(r"(\d+) of (\d+) line\(s\) confirmed", err)
    assert m is not None, err
    confirmed += int(m.group(1))
    assert 0 < confirmed < 400
    assert b.metric("blipmq_wal_write_failures_total") >= 1
    assert b.proc.poll() is None  # the broker keeps running
    filler.unlink()  # the fault clears
    assert b.cli("pub", "t", "after", "--qos", "1").returncode == 0
    assert b.stop() == 0
    b2 = start_broker({"wal": {"segment_bytes": 65536}}, data_dir=tiny_fs / "data")
    res = b2.cli("sub", "t", "--from", "earliest", "--timeout", "2", "--format", "json")
    payloads = [json.loads(x)["payload"] for x in res.stdout.decode().splitlines()]
    assert payloads[0] == "before" and payloads[-1] == "after"
    stored = [int(p[:4]) for p in payloads[1:-1]]
    # every confirmed message is there, in order, and no refused batch left a piece behind
    assert stored[:confirmed] == list(range(confirmed))
    assert stored == sorted(set(stored))
    assert all(len(p) == 1000 for p in payloads[1:-1])


def _fill(where: Path) -> Path:
    """Fill the filesystem at ``where`` to the last byte."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for block in (1 << 16, 4096, 512, 1):
            try:
                while os.write(fd, b"\0" * block):
                    pass
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler


def test_until_end_finishes_when_the_last_batch_was_refused(start_broker, tiny_fs: Path) -> None:
    """The last thing appended was a QoS 1 publish the full disk refused: the log ends in a
    gap of offsets, and SUBSCRIBED's end is past it. The end mark waited for a record at
    end - 1, which never comes, even once there is room again."""
    b = start_broker(data_dir=tiny_fs / "data")
    assert b.cli("pub", "t", "before", "--qos", "1").returncode == 0
    filler = _fill(tiny_fs)
    # larger than a page: what is left of the segment's last page cannot take it
    refused = b.cli("pub", "t", "x" * 20_000, "--qos", "1")
    assert refused.returncode == Exit.REFUSED, refused
    filler.unlink()
    got = b.cli("sub", "#", "--from", "earliest", "--until-end", timeout=10)
    assert got.returncode == 0, got
    assert got.stdout == b"before\n"
    assert b.stop() == 0


def test_an_in_bridge_on_a_full_disk_says_so_once_not_once_a_message(
        start_broker, tiny_fs: Path) -> None:
    """Each message from the upstream the log cannot store ends the link (the upstream sends
    it again), on every link while the disk is full: one warning says so, and one more when
    messages are stored again, whatever the number of messages and links meanwhile."""
    from tests.test_bridge import bridge_table, local_numbers, wait_status
    from tests.upstream import Mosquitto, mqtt_client

    with Mosquitto() as up:
        bp = start_broker({"wal": {"segment_bytes": 65536}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["cmd/# in 1"], backoff_min_ms=100,
            backoff_max_ms=200)]}, data_dir=tiny_fs / "data")
        wait_status(bp, "cloud", lambda b: b["connected"])
        filler = _fill(tiny_fs)
        pub = mqtt_client(up.port)
        for info in [pub.publish("cmd/x", b"%04d " % n + b"y" * 3000, qos=1)
                     for n in range(30)]:
            info.wait_for_publish(10)
        wait_status(bp, "cloud", lambda b: b["reconnects"] >= 5)
        said = [line for line in bp.log if "blipmq.bridge" in line]
        assert len(said) == 2, "\n".join(said)  # connected, then the one warning
        assert "a message from the upstream could not be stored" in said[1], said
        assert "No space left on device" in said[1], said
        filler.unlink()
        got = local_numbers(bp, "cmd/#", 30)
        assert {line[:4] for line in got} == {b"%04d" % n for n in range(30)}
        bp.wait_log("bridge cloud: messages from the upstream are stored again")
        pub.disconnect()
        pub.loop_stop()
        assert bp.stop() == 0


def test_a_full_disk_with_the_log_over_its_cap_does_not_need_a_restart(
        start_broker, tiny_fs: Path) -> None:
    """The log outgrows its cap between two maintenance rounds, and the disk fills to its
    last byte. Retention deletes segments only once what a restart needs (the bridge's group
    checkpoint, its retained state topic) is copied into the newest segment and written; on
    a full disk that copy never was, so every write was refused until a restart. The log's
    reserve (room set aside once the disk had some) is released for it, and writes resume."""
    from tests.test_bridge import bridge_table
    from tests.upstream import free_port, wait_until

    config = {"wal": {"segment_bytes": 65536, "retention_bytes": 262144,
                      "maintenance_interval_ms": 500},
              "bridge": [bridge_table("down", [f"127.0.0.1:{free_port()}"], ["s/# out 1"])]}
    b = start_broker(config, data_dir=tiny_fs / "data")
    assert wait_until((tiny_fs / "data" / "wal" / "reserve").exists, 10)
    assert b.cli("pub", "s/kept", "before", "--qos", "1").returncode == 0
    lines = b"".join(b"%05d" % i + b"x" * 995 + b"\n" for i in range(400))
    assert b.cli("pub", "o/flood", "-", "--lines", input=lines).returncode == 0
    # retention's round for that flood first: run after the fill, its copies could fit in
    # what is left of the files' last pages, and the segments it deleted made room, so no
    # write ever failed (CI, a busy machine: write failures 0 after 30 s)
    deadline = time.monotonic() + 30
    while b.metric("blipmq_wal_size_bytes") > 262144:
        assert time.monotonic() < deadline, "retention never ran"
        time.sleep(0.05)
    _fill(tiny_fs)  # to the last byte
    # more, past the cap again, so that what is left of the files' last pages is taken
    assert b.cli("pub", "o/flood", "-", "--lines", input=lines[:100_000]).returncode == 0
    b.wait_metric_at_least("blipmq_wal_write_failures_total", 1, timeout=30)  # a busy CI
    deadline = time.monotonic() + 30
    while True:  # bounded by the deadline: a few maintenance rounds
        after = b.cli("pub", "o/after", "again", "--qos", "1", timeout=10)
        if after.returncode == 0:
            break
        assert time.monotonic() < deadline, f"writes never resumed: {after.stderr!r}"
    b.wait_log("released the log's reserve")
    assert b.stop() == 0
    b2 = start_broker(config, data_dir=tiny_fs / "data")
    state = b2.cli("sub", "$SYS/bridge/down/state", "-C", "1", "-W", "5")
    assert state.stdout == b"0\n", state
    again = b2.cli("sub", "o/after", "--from", "earliest", "-W", "2")
    assert again.stdout == b"again\n", again


def _confirmed_again(b, within: float) -> None:
    """Publish a QoS 1 message until one is confirmed (bounded by ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:  # bounded by the deadline: a few maintenance rounds
        after = b.cli("pub", "o/after", "again", "--qos", "1", timeout=10)
        if after.returncode == 0:
            return
        assert time.monotonic() < deadline, (
            f"writes never resumed: {after.stderr!r}\n" + "\n".join(b.log[-20:]))


def _over_the_cap_and_full(b, tiny_fs: Path) -> None:
    """Idle durable groups made first (their records in the oldest segment), a log past its
    cap with one message of the groups' after it, the disk full to its last byte. A hundred
    groups: their checkpoints are more than what is left of a segment's last page."""
    from blipmq_cli.client import Client

    with Client(b.addr) as c:
        for i in range(100):
            c.subscribe("k", group=f"g{i}", qos=1)
    lines = b"".join(b"%05d" % i + b"x" * 995 + b"\n" for i in range(400))
    assert b.cli("pub", "o/flood", "-", "--lines", input=lines).returncode == 0
    assert b.cli("pub", "k", "kept", "--qos", "1").returncode == 0
    _fill(tiny_fs)
    # more, so that what is left of the files' last pages is taken too
    assert b.cli("pub", "o/flood", "-", "--lines", input=lines[:100_000]).returncode == 0
    b.wait_metric_at_least("blipmq_wal_write_failures_total", 1)


def test_a_flood_that_fills_the_disk_before_the_first_maintenance_round_is_not_for_good(
        start_broker, tiny_fs: Path) -> None:
    """The reserve was made by the first maintenance round: a flood that filled the disk
    before it, with any durable group (whose checkpoint retention waits for), left no room
    for that checkpoint and no reserve to release, and writes stayed refused for good. The
    reserve is made at start, before anything is read."""
    config = {"wal": {"segment_bytes": 65536, "retention_bytes": 262144,
                      "maintenance_interval_ms": 2000}}
    b = start_broker(config, data_dir=tiny_fs / "data")
    _over_the_cap_and_full(b, tiny_fs)
    _confirmed_again(b, 20)
    b.wait_log("released the log's reserve")
    assert b.stop() == 0


def test_a_restart_on_a_full_disk_without_a_reserve_serves_again(
        start_broker, tiny_fs: Path) -> None:
    """The disk is full, the log past its cap, and there is no reserve (none could be made,
    or the broker stopped before it made it again): retention waited for a group's
    checkpoint the disk refused, before a restart and after it. Retention now deletes what
    is past the cap first, the checkpoint is written into that room, and the group's
    message is still its own after another restart."""
    config = {"wal": {"segment_bytes": 65536, "retention_bytes": 262144,
                      "maintenance_interval_ms": 60_000}}  # no round before the restart
    b = start_broker(config, data_dir=tiny_fs / "data")
    (tiny_fs / "data" / "wal" / "reserve").unlink(missing_ok=True)  # made at start
    _over_the_cap_and_full(b, tiny_fs)
    b.stop()
    config["wal"]["maintenance_interval_ms"] = 300
    b2 = start_broker(config, data_dir=tiny_fs / "data")
    b2.wait_metric_at_least("blipmq_wal_write_failures_total", 1)  # the first round's copies
    _confirmed_again(b2, 20)
    b2.wait_log("the log has no reserve: retention deleted segments")
    assert b2.stop() == 0
    b3 = start_broker(config, data_dir=tiny_fs / "data")
    for group in ("g0", "g99"):
        res = b3.cli("sub", "k", "--group", group, "--qos", "1", "-C", "1", "-W", "5")
        assert res.stdout == b"kept\n", res
    assert b3.stop() == 0


def test_a_full_disk_recovers_while_a_logged_flood_goes_on(start_broker, tiny_fs: Path) -> None:
    """As above, but a publisher keeps sending QoS 0 messages (logged, unconfirmed) all the
    while: the room the reserve's release made went to the flood's records before
    retention's copies could use it, and every QoS 1 publish was refused until the flood
    stopped. Now nothing more is read from the moment the reserve is released until
    retention's copies are written into its room, and QoS 1 publishes are confirmed again
    and again while the flood goes on."""
    import socket
    import threading

    from blipmq_server.mqtt import codec as mqtt
    from blipmq_server.mqtt.packets import Connect, Publish
    from tests.test_bridge import bridge_table
    from tests.upstream import free_port, wait_until

    config = {"wal": {"segment_bytes": 65536, "retention_bytes": 262144,
                      "maintenance_interval_ms": 500},
              "mqtt": {"enabled": True, "port": 0},
              "bridge": [bridge_table("down", [f"127.0.0.1:{free_port()}"], ["s/# out 1"])]}
    b = start_broker(config, data_dir=tiny_fs / "data")
    assert b.mqtt_port is not None
    assert wait_until((tiny_fs / "data" / "wal" / "reserve").exists, 10)
    lines = b"".join(b"%05d" % i + b"x" * 995 + b"\n" for i in range(400))
    assert b.cli("pub", "o/flood", "-", "--lines", input=lines).returncode == 0
    _fill(tiny_fs)
    stop = threading.Event()

    def flood() -> None:  # 1 KB QoS 0 messages, up to 20 MB/s, until stopped (or 120 s)
        with socket.create_connection(("127.0.0.1", b.mqtt_port), timeout=30) as sock:
            sock.sendall(mqtt.encode(Connect("MQTT", 4, True, 0, "flooder")))
            assert sock.recv(4)[:1] == b"\x20"
            packet = mqtt.encode(Publish("o/flood", b"f" * 1000)) * 20
            deadline = time.monotonic() + 120
            while not stop.is_set() and time.monotonic() < deadline:
                sock.sendall(packet)
                stop.wait(0.001)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        b.wait_metric_at_least("blipmq_wal_write_failures_total", 1)
        # not once (the room the release made, before the flood took it): again and again
        deadline = time.monotonic() + 30
        confirmed = 0
        while confirmed < 5:  # bounded by the deadline: a few maintenance rounds
            after = b.cli("pub", "o/after", "again", "--qos", "1", timeout=10)
            confirmed += after.returncode == 0
            assert time.monotonic() < deadline, (
                f"{confirmed} QoS 1 publish(es) confirmed in 30 s: {after.stderr!r}\n"
                + "\n".join([line for line in b.log if "bridge down" not in line][-30:]))
        assert flooder.is_alive(), "the flood went on all the while"
    finally:
        stop.set()
        flooder.join(30)
    b.wait_log("released the log's reserve")
    assert b.stop() == 0


def _damaged_mid_segment(b, tiny_fs: Path) -> tuple[Path, int]:
    """300 messages of 1 KB confirmed into one segment, the broker stopped, and the CRC of
    the 151st broken (a flipped payload bit): damage followed by valid records. Returns
    the segment and the damaged record's offset."""
    from blipmq_server.wal import record as rec

    lines = b"".join(b"%04d" % i + b"x" * 996 + b"\n" for i in range(300))
    assert b.cli("pub", "t", "-", "--qos", "1", "--lines", input=lines).returncode == 0
    assert b.stop() == 0
    segment, = (tiny_fs / "data" / "wal").glob("*.seg")
    data = bytearray(segment.read_bytes())
    offset, pos = rec.scan(bytes(data)).records[150]
    data[pos + rec.RECORD_OVERHEAD + 40] ^= 0x01
    segment.write_bytes(bytes(data))
    return segment, offset


def _numbers(b) -> list[int]:
    got = b.cli("sub", "t", "--from", "earliest", "--timeout", "2", "--format", "json")
    return [int(json.loads(line)["payload"][:4]) for line in got.stdout.decode().splitlines()]


def test_damage_inside_a_segment_does_not_need_a_copy_s_room_to_start(
        start_broker, tiny_fs: Path) -> None:
    """Recovery sets damage followed by valid records aside by rewriting the segment into a
    copy: on a card too full for the copy the broker did not start (one line, `No space
    left on device`) until room was made. Without room the damage now stays in place,
    skipped by every read, and the broker starts with every valid record; a start with
    room rewrites the segment as before."""
    b = start_broker(data_dir=tiny_fs / "data")
    segment, offset = _damaged_mid_segment(b, tiny_fs)
    size = segment.stat().st_size
    filler = _fill(tiny_fs)
    b2 = start_broker(data_dir=tiny_fs / "data")
    said = b2.wait_log("left in place")
    assert "CRC mismatch" in said and "the valid records after it are kept" in said, said
    need = int(re.search(r"it needs (\d+) bytes free", said).group(1))  # type: ignore[union-attr]
    assert size <= need < size + 64 * 1024, said  # the copy, and the bytes set aside
    assert b2.metric("blipmq_wal_recovery_quarantined") == 1
    assert _numbers(b2) == [i for i in range(300) if i != offset - 1]
    assert segment.stat().st_size == size  # nothing rewritten, nothing set aside
    assert not list(segment.parent.glob("*.corrupt"))
    assert b2.stop() == 0
    filler.unlink()
    b3 = start_broker(data_dir=tiny_fs / "data")
    said = b3.wait_log("set aside in")
    assert "kept" in said, said
    assert len(list(segment.parent.glob("*.corrupt"))) == 1
    assert _numbers(b3) == [i for i in range(300) if i != offset - 1]
    assert b3.cli("pub", "t", "9999", "--qos", "1").returncode == 0
    assert b3.stop() == 0
    b4 = start_broker(data_dir=tiny_fs / "data")  # nothing left to repair
    assert not [line for line in b4.log if "WARNING" in line], b4.log
    assert _numbers(b4)[-1] == 9999
    assert b4.stop() == 0
