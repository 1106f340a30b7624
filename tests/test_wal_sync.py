"""What each fsync policy makes durable, seen through the log's file layer: a Disk that
records every call. The log, the flusher and (for QoS 1 confirms) the Trio server run for
real on loopback and real files; only the recording is added.

The guarantee checked everywhere: once a sync is done, every segment file has been fsynced
after its last write, and the directory after the last file was created in it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from test_server import Conn, connect, make_config
from trio.testing import wait_all_tasks_blocked

from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import Message
from blipmq_server.server.app import Bound, Server
from blipmq_server.server.flusher import LINGER_BYTES, LINGER_RECORDS, LINGER_S, Flusher
from blipmq_server.wal import policy
from blipmq_server.wal import record as rec
from blipmq_server.wal.disk import Disk, FaultyDisk
from blipmq_server.wal.log import Log, LogOptions

MSG = rec.Kind.MESSAGE
SMALL = LogOptions(segment_bytes=4096)


class RecordingDisk(Disk):
    """A real Disk that records each write, fsync and file creation, in order, with the
    time it finished."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, float]] = []
        self._made: set[str] = set()
        self._mutex = threading.Lock()

    def _note(self, op: str, path: str) -> None:
        with self._mutex:
            self.calls.append((op, path, time.perf_counter()))

    def append(self, path: str, data: bytes) -> None:
        new = not os.path.exists(path)
        super().append(path, data)
        if new:
            self._note("create", path)
        self._note("write", path)

    def write_file(self, path: str, data: bytes) -> None:
        super().write_file(path, data)
        self._note("create", path)
        self._note("write", path)
        self._note("fsync", path)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._note("create", dst)

    def fsync(self, path: str) -> None:
        super().fsync(path)
        self._note("fsync", path)

    def fsync_dir(self, directory: str) -> None:
        super().fsync_dir(directory)
        self._note("fsync_dir", directory)

    def count(self, op: str) -> int:
        return sum(1 for c in self.calls if c[0] in op.split("|"))

    def not_durable(self) -> set[str]:
        """Files written after their last fsync; "<dir>" if a file was created after the
        directory's last fsync."""
        last_write: dict[str, int] = {}
        last_sync: dict[str, int] = {}
        created = dir_synced = -1
        for i, (op, path, _) in enumerate(list(self.calls)):
            if op == "write":
                last_write[path] = i
            elif op == "fsync":
                last_sync[path] = i
            elif op == "create":
                created = i
            elif op == "fsync_dir":
                dir_synced = i
        out = {os.path.basename(p) for p, i in last_write.items() if last_sync.get(p, -1) < i}
        return out | ({"<dir>"} if created > dir_synced else set())

    def written(self) -> set[str]:
        return {os.path.basename(c[1]) for c in self.calls if c[0] == "write"}


def body(i: int, size: int = 300) -> bytes:
    return f"record-{i:06d}-".encode().ljust(size, b".")


def make_log(path: Path, options: LogOptions = SMALL) -> tuple[Log, RecordingDisk]:
    disk = RecordingDisk()
    log = Log(str(path), options, disk)
    log.open()
    return log, disk


def segment_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix == ".seg")


# --------------------------------------------------------------------------- the log layer


def test_one_sync_covers_every_segment_written_since_the_last_and_the_directory(
    tmp_path: Path,
) -> None:
    log, disk = make_log(tmp_path)
    for i in range(200):  # 200 batches of one record, none synced: about 15 segments
        log.append(MSG, body(i), i)
        batch = log.take_batch()
        assert batch is not None
        batch.write(disk, False)
        log.commit(batch)
    assert len(segment_files(tmp_path)) > 10 and disk.count("fsync|fsync_dir") == 0
    assert log.unsynced and log.synced_offset == 0
    assert disk.not_durable() >= set(segment_files(tmp_path)) | {"<dir>"}
    sync = log.take_sync()
    assert sync is not None and sync.calls == len(segment_files(tmp_path)) + 1
    sync.run(disk)
    log.synced(sync)
    assert disk.not_durable() == set()
    assert not log.unsynced and log.synced_offset == 200 and log.take_sync() is None


def test_a_synced_batch_covers_what_earlier_batches_left_unsynced(tmp_path: Path) -> None:
    log, disk = make_log(tmp_path)
    for i in range(60):
        log.append(MSG, body(i), i)
        if i % 3 == 2:
            batch = log.take_batch()
            assert batch is not None
            batch.write(disk, False)
            log.commit(batch)
    log.append(MSG, b"waited on", 0)
    batch = log.take_batch()
    assert batch is not None
    batch.write(disk, True)  # one sync: this batch and everything before it
    log.commit(batch)
    assert batch.synced and disk.not_durable() == set()
    assert log.synced_offset == log.written_offset == 61


def test_sealed_segments_keep_no_descriptor_open(tmp_path: Path) -> None:
    fd_dir = Path("/proc/self/fd")
    before = len(list(fd_dir.iterdir()))
    log = Log(str(tmp_path), LogOptions(segment_bytes=4096, cache_bytes=0))
    log.open()
    for i in range(3000):  # about 230 segments, some batches spanning several
        log.append(MSG, body(i), i)
        if i % 7 == 0:
            batch = log.take_batch()
            assert batch is not None
            batch.write(log.disk, i % 2 == 0)
            log.commit(batch)
    batch = log.take_batch()
    assert batch is not None
    batch.write(log.disk, False)
    log.commit(batch)
    assert len(segment_files(tmp_path)) > 200
    for start in range(1, 3001, 97):  # reads all over the log (cache off: from the files)
        assert log.read(start, max_records=1)[0].offset == start
    held = len(list(fd_dir.iterdir())) - before
    assert held <= 10, f"{held} descriptors held for {len(segment_files(tmp_path))} segments"
    log.close()
    assert len(list(fd_dir.iterdir())) == before


class PeakDisk(Disk):
    """A real Disk that notes the most append descriptors it ever held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def append(self, path: str, data: bytes) -> None:
        super().append(path, data)
        self.peak = max(self.peak, len(self._fds))


@pytest.mark.parametrize("sync", [False, True])
def test_one_batch_filling_many_segments_holds_one_append_descriptor_at_a_time(
    tmp_path: Path, sync: bool
) -> None:
    disk = PeakDisk()
    log = Log(str(tmp_path), SMALL, disk)
    log.open()
    log.append_many(MSG, [body(i) for i in range(4000)], 0)  # about 300 segments
    batch = log.take_batch()
    assert batch is not None and len(batch.sealed) > 290
    batch.write(disk, sync)
    log.commit(batch)
    assert disk.peak == 1 and len(disk._fds) == 1  # only the segment appends go to now
    assert [r.offset for r in log.read(1, 10**9, 1 << 40)] == list(range(1, 4001))


def test_retention_may_delete_a_segment_that_a_sync_covers(tmp_path: Path) -> None:
    log, disk = make_log(tmp_path, LogOptions(segment_bytes=4096, retention_bytes=20_000))
    for i in range(300):
        log.append(MSG, body(i), i)
        batch = log.take_batch()
        assert batch is not None
        batch.write(disk, False)
        log.commit(batch)
    sync = log.take_sync()
    assert sync is not None
    removed = log.retain(now_ms=0).removed  # while the sync waits for its worker thread
    assert removed
    sync.run(disk)  # the deleted files are skipped, the others fsynced
    log.synced(sync)
    assert disk.not_durable() <= set(removed)
    assert not log.unsynced


# ------------------------------------------------------------------------------ the flusher


def test_always_syncs_what_is_awaited_at_once_and_the_rest_in_time() -> None:
    always = policy.parse("always")
    assert not isinstance(always, str)
    assert always.sync_now(1, 0, awaited=True, unconfirmed_sync_ms=1000)
    assert not always.sync_now(1, 0, awaited=False, ms_unsynced=999, unconfirmed_sync_ms=1000)
    assert always.sync_now(1, 0, awaited=False, ms_unsynced=1000, unconfirmed_sync_ms=1000)
    assert always.sync_now(1, 0, awaited=False, unconfirmed_sync_ms=0)  # every batch


async def write_through_flusher(flusher: Flusher, n: int, per_batch: int = 5) -> None:
    for i in range(n):
        flusher.wal.append(MSG, body(i), i)
        if i % per_batch == per_batch - 1:
            await flusher.flush_once()
    await flusher.flush_once()


@pytest.mark.parametrize("fsync", ["always", "every_n:1000", "interval_ms:60000", "none"])
async def test_close_syncs_every_segment_and_the_directory_whatever_the_policy(
    tmp_path: Path, fsync: str
) -> None:
    log, disk = make_log(tmp_path)
    parsed = policy.parse(fsync)
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed, unconfirmed_sync_ms=60_000)
    await write_through_flusher(flusher, 400)
    log.append(MSG, b"pending at close", 0)
    assert len(segment_files(tmp_path)) > 25
    assert await flusher.close(10)
    assert disk.written() == set(segment_files(tmp_path))
    assert disk.not_durable() == set()


async def test_every_n_syncs_all_rotated_segments_once_n_records_are_written(
    tmp_path: Path,
) -> None:
    log, disk = make_log(tmp_path)
    parsed = policy.parse("every_n:100")
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed)
    await write_through_flusher(flusher, 95)  # 19 batches, about 7 segments: no sync yet
    assert disk.count("fsync|fsync_dir") == 0 and len(segment_files(tmp_path)) > 5
    await write_through_flusher(flusher, 5)  # the 100th record: one sync for all of them
    assert disk.not_durable() == set()
    assert flusher.counters.syncs == 1
    assert flusher.counters.fsyncs == len(segment_files(tmp_path)) + 1  # files + directory


async def test_none_never_syncs_while_running(tmp_path: Path) -> None:
    log, disk = make_log(tmp_path)
    parsed = policy.parse("none")
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed)
    await write_through_flusher(flusher, 300)
    assert disk.count("fsync|fsync_dir") == 0 and flusher.counters.fsyncs == 0


async def test_interval_syncs_everything_written_after_the_interval(tmp_path: Path) -> None:
    log, disk = make_log(tmp_path)
    parsed = policy.parse("interval_ms:200")
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flusher.run)
        await trio.sleep(0)
        for i in range(100):  # several rotations within the interval
            log.append(MSG, body(i), i)
            flusher.appended()
        with trio.fail_after(10):
            while log.pending_records or flusher.counters.syncs == 0 or log.unsynced:
                await trio.sleep(0.01)
        written = [c[2] for c in disk.calls if c[0] == "write"]
        synced = [c[2] for c in disk.calls if c[0] == "fsync_dir"]
        assert disk.not_durable() == set()
        assert synced[-1] > written[-1]
        nursery.cancel_scope.cancel()


async def test_always_seals_a_full_segment_durably_even_without_waiters(
    tmp_path: Path,
) -> None:
    log, disk = make_log(tmp_path)
    parsed = policy.parse("always")
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed, unconfirmed_sync_ms=60_000)
    await write_through_flusher(flusher, 60, per_batch=1)  # about 5 segments, QoS 0 only
    files = segment_files(tmp_path)
    assert len(files) > 3
    assert disk.not_durable() <= {files[-1]}  # only the segment being written is unsynced
    assert flusher.counters.syncs == len(files) - 1  # one per rotation


# ------------------------------------------------------- QoS 1 confirms and QoS 0 with `always`


def publish_frame(rid: int, qos: int, *payloads: bytes) -> bytes:
    return codec.encode_publish(
        [codec.message_record(Message("t", p, qos)) for p in payloads], rid)


async def start_server(
    nursery: trio.Nursery, tmp_path: Path, **wal: object
) -> tuple[Server, RecordingDisk, int]:
    cfg = make_config(wal={"enabled": True, "segment_bytes": 4096, **wal},
                      storage={"data_dir": str(tmp_path)})
    server = Server(cfg)
    disk = RecordingDisk()
    assert server.wal is not None
    server.wal.disk = disk
    bound: Bound = await nursery.start(server.serve)
    return server, disk, bound.port


async def flusher_running(nursery: trio.Nursery, tmp_path: Path, tailing: bool = False,
                          acks_due: Callable[[], bool] | None = None) -> tuple[Flusher, Log]:
    log, _ = make_log(tmp_path)
    parsed = policy.parse("none")
    assert not isinstance(parsed, str)
    flusher = Flusher(log, parsed, tailing=lambda: tailing, acks_due=acks_due)
    nursery.start_soon(flusher.run)
    await wait_all_tasks_blocked()
    return flusher, log


async def appended(flusher: Flusher, n: int = 1, size: int = 300) -> None:
    for _ in range(n):
        flusher.wal.append(MSG, body(0, size), 0)
    flusher.appended()
    await wait_all_tasks_blocked()


async def written(flusher: Flusher, records: int) -> None:
    deadline = time.monotonic() + 10  # real time: the tests' clock stands still
    while flusher.counters.records < records:
        assert time.monotonic() < deadline, "not written"
        await trio.sleep(0)


async def test_a_batch_nobody_waits_for_lingers_to_grow(
    nursery: trio.Nursery, tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    flusher, _ = await flusher_running(nursery, tmp_path)
    await appended(flusher)
    await appended(flusher)  # within the linger: the same batch
    assert flusher.counters.records == 0
    mock_clock.jump(LINGER_S)
    await written(flusher, 2)
    assert flusher.counters.batches == 1


@pytest.mark.parametrize("why", ["tailing", "big", "bytes", "closing"])
async def test_a_tail_reader_a_big_batch_or_shutdown_ends_the_linger(
    nursery: trio.Nursery, tmp_path: Path, mock_clock: trio.testing.MockClock, why: str
) -> None:
    # the clock never moves: only what hurries the batch gets it written
    flusher, log = await flusher_running(nursery, tmp_path, tailing=why == "tailing")
    if why == "big":
        # records small enough that their count, not their bytes, ends the linger
        assert LINGER_RECORDS * 64 < LINGER_BYTES
        await appended(flusher, LINGER_RECORDS - 1, size=32)
        assert flusher.counters.records == 0  # still lingering
        await appended(flusher)
    elif why == "bytes":  # few records, but a megabyte of them
        half = LINGER_BYTES // 2
        flusher.wal.append(MSG, b"x" * half, 0)
        flusher.appended()
        await wait_all_tasks_blocked()
        assert flusher.counters.records == 0  # still lingering
        flusher.wal.append(MSG, b"x" * half, 0)
        flusher.appended()
        await written(flusher, 2)
        return
    elif why == "closing":
        await appended(flusher)
        assert await flusher.close(10)
        assert not log.pending_records and flusher.counters.records == 1
        return
    else:
        await appended(flusher)
    await written(flusher, LINGER_RECORDS if why == "big" else 1)


async def test_bookkeeping_lingers_even_for_a_tail_reader_until_a_message_comes(
    nursery: trio.Nursery, tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # A tail reader waits for messages, not for a consumer's ack records: a bridge draining
    # a backlog acks all the time, and each of those batches used to cost a trip to a worker
    # thread. The clock never moves: only the message hurries the batch.
    flusher, log = await flusher_running(nursery, tmp_path, tailing=True)
    for _ in range(3):
        log.append(rec.Kind.ACK, b"acks", 0)
        flusher.appended()
        await wait_all_tasks_blocked()
    assert flusher.counters.records == 0 and log.pending_records == 3  # lingering
    assert log.pending_messages == 0
    await appended(flusher)
    await written(flusher, 4)
    assert flusher.counters.batches == 1 and log.pending_messages == 0


async def test_acks_the_core_wants_written_end_the_linger(
    nursery: trio.Nursery, tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # ... unless they ack half a consumer's window (Cursors.acks_due): a crash then
    # delivers no more than that again. The clock never moves.
    due = False
    flusher, log = await flusher_running(nursery, tmp_path, tailing=True,
                                         acks_due=lambda: due)
    log.append(rec.Kind.ACK, b"acks", 0)
    flusher.appended()
    await wait_all_tasks_blocked()
    assert flusher.counters.records == 0  # lingering
    due = True
    log.append(rec.Kind.ACK, b"more acks", 0)
    flusher.appended()
    await written(flusher, 2)


async def test_a_publisher_that_waits_ends_the_linger(
    nursery: trio.Nursery, tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # the clock never moves: the QoS 1 publish's confirm comes only if its wait hurried
    # the batch the QoS 0 publish before it started
    _, _, port = await start_server(nursery, tmp_path, fsync="none")
    conn = await connect(port)
    async with trio.open_nursery() as timer:
        timer.start_soon(cancel_after_real_seconds, timer.cancel_scope, 10)
        await conn.send(publish_frame(1, 0, b"nobody waits"), codec.Ping(b"", 2))
        await conn.expect(codec.Pong)
        await conn.send(publish_frame(3, 1, b"confirm me"))
        confirm = await conn.expect(codec.PubAck)
        timer.cancel_scope.cancel()
    assert confirm == codec.PubAck(1, 3)


async def cancel_after_real_seconds(scope: trio.CancelScope, seconds: float) -> None:
    await trio.to_thread.run_sync(time.sleep, seconds, abandon_on_cancel=True)
    scope.cancel()


async def test_qos1_confirm_comes_after_an_fsync_covering_its_records(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server, disk, port = await start_server(nursery, tmp_path)
    conn = await connect(port)
    for rid in range(1, 41):  # 3 records of ~900 bytes a publish: a new segment every other
        await conn.send(publish_frame(rid, 1, *(bytes([65 + rid % 26]) * 900,) * 3))
        assert (await conn.expect(codec.PubAck)) == codec.PubAck(3, rid)
        # PUB_ACK is sent once the sync returned: every write so far (this publish's
        # records included) has been fsynced, and every new segment's directory entry
        assert disk.not_durable() == set(), rid
    assert len(segment_files(tmp_path / "wal")) > 15
    server.shutdown.set()


async def test_qos0_records_are_synced_later_and_with_the_next_confirm(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server, disk, port = await start_server(nursery, tmp_path, unconfirmed_sync_ms=300)
    conn = await connect(port)
    for rid in range(1, 6):
        await conn.send(publish_frame(rid, 0, b"qos0-%d" % rid), codec.Ping(b"", 100 + rid))
        await conn.expect(codec.Pong)
    assert server.flusher is not None
    with trio.fail_after(10):
        while server.flusher.counters.records < 5:
            await trio.sleep(0.01)
    first_write = next(c[2] for c in disk.calls if c[0] == "write")
    # written, and not fsynced: QoS 0 does not force an fsync of its own
    assert server.flusher.counters.fsyncs == 0 and disk.count("fsync|fsync_dir") == 0
    with trio.fail_after(10):
        while disk.not_durable() or not server.flusher.counters.syncs:
            await trio.sleep(0.01)
    synced = next(c[2] for c in disk.calls if c[0] == "fsync")
    assert synced - first_write >= 0.25  # the timer (300 ms), not the write, caused it
    assert server.flusher.counters.syncs == 1
    # a QoS 0 publish, then a QoS 1 one: the confirm's sync covers both
    await conn.send(publish_frame(10, 0, b"unconfirmed"), publish_frame(11, 1, b"confirmed"))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 11)
    assert disk.not_durable() == set()
    server.shutdown.set()


async def test_unconfirmed_sync_ms_zero_syncs_every_batch(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server, disk, port = await start_server(nursery, tmp_path, unconfirmed_sync_ms=0)
    conn = await connect(port)
    for rid in range(1, 4):
        await conn.send(publish_frame(rid, 0, b"x"), codec.Ping(b"", 100 + rid))
        await conn.expect(codec.Pong)
        assert server.flusher is not None
        with trio.fail_after(10):
            while (server.flusher.counters.records < rid or disk.not_durable()
                   or server.flusher.counters.syncs < rid):
                await trio.sleep(0.01)
    assert server.flusher is not None and server.flusher.counters.syncs == 3
    server.shutdown.set()


async def serve_with_a_stuck_subscriber(
    nursery: trio.Nursery, tmp_path: Path, disk: Disk, block_timeout_ms: int, **wal: int
) -> tuple[Server, Bound, Conn]:
    """A broker on ``disk`` with queues of 2 and a subscriber to "t" that never reads its
    socket (hold on to it: dropped, its socket closes): big publishes to "t" fill the queue
    and block until it is cut off."""
    cfg = make_config(wal={"enabled": True, **wal}, storage={"data_dir": str(tmp_path)},
                      server={"write_timeout_ms": 0},
                      queues={"capacity": 2, "overflow": "block",
                              "block_timeout_ms": block_timeout_ms})
    server = Server(cfg)
    assert server.wal is not None and server.flusher is not None
    server.wal.disk = disk
    bound: Bound = await nursery.start(server.serve)
    stuck = await connect(bound.port)
    await stuck.send(codec.Subscribe("t", "", 0, 0, request_id=1))
    await stuck.expect(codec.Subscribed)
    return server, bound, stuck


async def test_a_publisher_that_waited_for_room_is_confirmed_after_a_sync(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Its first records were appended (and written, unsynced: nobody waited yet) before it
    blocked on a full queue; when it goes on, the confirm of those must not wait for the
    unconfirmed-records timer, nor come before their sync."""
    disk = RecordingDisk()
    server, bound, _stuck = await serve_with_a_stuck_subscriber(
        nursery, tmp_path, disk, 300, unconfirmed_sync_ms=60_000)
    pub = await connect(bound.port)
    # far more than the socket buffers hold: the queue fills and the publisher blocks
    # until the stuck subscriber is disconnected as a slow consumer
    for rid in range(7, 11):
        await pub.send(publish_frame(rid, 1, *[b"x" * 100_000] * 50))
    with trio.fail_after(5):
        for rid in range(7, 11):
            assert (await pub.expect(codec.PubAck)) == codec.PubAck(50, rid)
        while not server.counters.closed["slow_consumer"]:  # it did wait for room
            await trio.sleep(0.01)
    assert disk.not_durable() == set()
    server.shutdown.set()


async def test_a_blocked_publisher_is_not_confirmed_for_records_a_failed_write_lost(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Its first records went into a batch the disk refused while it waited for room (it had
    not asked for its confirm yet); a later batch succeeded. It must get ERROR STORAGE and
    PUB_ACK 0, not a confirm of everything."""
    disk = FaultyDisk()
    server, bound, _stuck = await serve_with_a_stuck_subscriber(nursery, tmp_path, disk, 1000)
    assert server.flusher is not None
    pub = await connect(bound.port)
    disk.fail_writes = True
    await pub.send(publish_frame(7, 1, *[b"x" * 100_000] * 60))  # fills the buffers, blocks
    with trio.fail_after(10):
        while not server.flusher.counters.failures:  # its first records: refused
            await trio.sleep(0.01)
        disk.fail_writes = False
        other = await connect(bound.port)
        await other.send(publish_frame(1, 1, b"later"))
        assert (await other.expect(codec.PubAck)) == codec.PubAck(1, 1)  # the log goes on
        err = await pub.expect(codec.Error)
        assert err.code == codec.ErrorCode.STORAGE and err.request_id == 7
        assert (await pub.expect(codec.PubAck)) == codec.PubAck(0, 7)
    server.shutdown.set()
