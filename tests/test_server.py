"""The Trio server in-process on loopback (port 0), driven with raw frames."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from blipmq_server import config as config_module
from blipmq_server.errors import ConfigError
from blipmq_server.kinds import Kind
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import ErrorCode, Message
from blipmq_server.server.app import Bound, Server
from blipmq_server.wal.disk import FaultyDisk
from blipmq_server.wal.log import Log


def make_config(**sections: dict) -> config_module.Config:
    overrides = {"server.port": 0, "metrics.enabled": False, "wal.enabled": False}
    for section, values in sections.items():
        overrides.update({f"{section}.{k}": v for k, v in values.items()})
    return config_module.load(None, env={}, overrides=overrides)


class Conn:
    """A raw protocol connection for tests."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = codec.Decoder(1 << 24)
        self.frames: list[codec.Frame] = []

    async def send(self, *frames: codec.Frame | bytes) -> None:
        data = b"".join(f if isinstance(f, bytes) else codec.encode(f) for f in frames)
        await self.stream.send_all(data)

    async def recv(self) -> codec.Frame | None:
        """The next frame, or None when the server closed the connection."""
        while not self.frames:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.decoder.feed(data)
            self.frames += self.decoder.frames()
        return self.frames.pop(0)

    async def expect(self, kind: type) -> codec.Frame:
        frame = await self.recv()
        assert isinstance(frame, kind), frame
        return frame

    async def closed(self) -> bool:
        return await self.recv() is None


async def start(nursery: trio.Nursery, cfg: config_module.Config) -> tuple[Server, int]:
    server = Server(cfg)
    bound: Bound = await nursery.start(server.serve)
    return server, bound.port


async def connect(port: int, api_key: str = "", handshake: bool = True) -> Conn:
    conn = Conn(await trio.open_tcp_stream("127.0.0.1", port))
    if handshake:
        await conn.send(codec.Hello(codec.VERSION, "test", 1), codec.Auth(api_key, 2))
        await conn.expect(codec.Welcome)
        await conn.expect(codec.AuthOk)
    return conn


def publish(*msgs: tuple[str, bytes], rid: int = 0, ttl: int = 0) -> bytes:
    return codec.encode_publish([codec.message_record(Message(t, p, 0, ttl)) for t, p in msgs], rid)


async def test_pipelined_session(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    conn = await connect(port, handshake=False)
    await conn.send(
        codec.Hello(codec.VERSION, "t", 1), codec.Auth("", 2),
        codec.Subscribe("a/#", "", 0, 0, request_id=3),
        publish(("a/b", b"one"), ("a/c", b"two"), rid=4), codec.Ping(b"xy", 5),
    )
    got: list[codec.Frame] = []
    while not (got and isinstance(got[-1], codec.Deliver)) or len(got) < 5:
        frame = await conn.recv()
        assert frame is not None
        got.append(frame)
    kinds = [type(f) for f in got]
    assert kinds[:3] == [codec.Welcome, codec.AuthOk, codec.Subscribed]
    assert codec.Pong in kinds
    deliver = next(f for f in got if isinstance(f, codec.Deliver))
    assert [(d.topic, d.payload) for d in deliver.messages] == [("a/b", b"one"), ("a/c", b"two")]
    assert [d.delivery_count for d in deliver.messages] == [1, 1]
    pong = next(f for f in got if isinstance(f, codec.Pong))
    assert pong.data == b"xy" and pong.request_id == 5
    server.shutdown.set()


async def test_first_frame_must_be_hello(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    conn = await connect(port, handshake=False)
    await conn.send(codec.Ping(b"", 9))
    err = await conn.expect(codec.Error)
    assert err.code == ErrorCode.PROTOCOL and err.request_id == 9
    assert await conn.closed()
    server.shutdown.set()


async def test_nothing_is_served_before_auth(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config(auth={"api_keys": ["k"]}))
    conn = await connect(port, handshake=False)
    await conn.send(codec.Hello(codec.VERSION, "t", 1), publish(("t", b"x"), rid=2))
    await conn.expect(codec.Welcome)
    err = await conn.expect(codec.Error)
    assert err.code == ErrorCode.NOT_AUTHENTICATED
    assert await conn.closed()
    assert server.broker.counters.published == 0

    conn = await connect(port, handshake=False)
    await conn.send(codec.Hello(codec.VERSION, "t", 1), codec.Auth("nope", 2))
    await conn.expect(codec.Welcome)
    assert (await conn.expect(codec.Error)).code == ErrorCode.AUTH_FAILED
    assert await conn.closed()
    ok = await connect(port, api_key="k")
    await ok.send(codec.Goodbye())
    server.shutdown.set()


async def test_unsupported_version(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    conn = await connect(port, handshake=False)
    await conn.send(codec.Hello(99, "future", 1))
    assert (await conn.expect(codec.Error)).code == ErrorCode.UNSUPPORTED_VERSION
    assert await conn.closed()
    server.shutdown.set()


async def test_handshake_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    server, port = await start(nursery, make_config(server={"handshake_timeout_ms": 500}))
    conn = await connect(port, handshake=False)
    before = trio.current_time()
    assert (await conn.expect(codec.Error)).code == ErrorCode.TIMEOUT
    assert await conn.closed()
    assert 0.5 <= trio.current_time() - before < 1
    server.shutdown.set()


async def test_block_policy_keeps_no_publisher_waiting_for_a_group_without_consumers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = make_config(queues={"capacity": 2, "overflow": "block", "block_timeout_ms": 2000})
    server, port = await start(nursery, cfg)
    pub = await connect(port)
    await pub.send(codec.Subscribe("t", "g", 0, 0, request_id=1))
    await pub.expect(codec.Subscribed)
    await pub.send(codec.Unsubscribe(1))  # leave the group with nobody consuming
    await pub.expect(codec.Unsubscribed)
    before = trio.current_time()
    await pub.send(publish(("t", b"1"), ("t", b"2"), ("t", b"3"), rid=7), codec.Ping(b"", 8))
    await pub.expect(codec.Pong)  # no error, no wait
    assert trio.current_time() - before < 0.1
    assert server.broker.counters.dropped_no_consumer == 1
    assert [i[0][-1:] for i in server.broker.group("t", "g").items] == [b"2", b"3"]
    server.shutdown.set()


async def test_a_consumer_that_takes_nothing_is_disconnected_not_the_publishers(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = make_config(queues={"capacity": 2, "overflow": "block", "block_timeout_ms": 2000},
                      server={"write_timeout_ms": 0})
    server, port = await start(nursery, cfg)
    stuck = await connect(port)  # subscribes, then never reads its socket again
    await stuck.send(codec.Subscribe("t", "", 0, 0, request_id=1))
    await stuck.expect(codec.Subscribed)
    pub = await connect(port)
    big = b"x" * 200_000
    before = trio.current_time()
    # far more than the socket buffers hold: the subscriber's writer stops, its queue fills
    await pub.send(*[publish(("t", big))] * 100, codec.Ping(b"", 8))
    await pub.expect(codec.Pong)  # the publisher got through, without an error
    assert trio.current_time() - before >= 2
    assert server.counters.closed["slow_consumer"] == 1
    assert server.broker.queues == ()  # the stuck subscription ended with its connection
    while await stuck.recv() is not None:  # what it had in its socket, then the end
        pass
    server.shutdown.set()


async def test_a_peer_that_does_not_read_its_replies_is_paused_then_closed(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = make_config(server={"max_pending_bytes": 65536, "write_timeout_ms": 3000})
    server, port = await start(nursery, cfg)
    flood = await connect(port)
    ping = codec.encode(codec.Ping(b"p" * 60_000))
    sent = 0
    with trio.move_on_after(30):
        try:
            while sent < 50_000:  # far more than the budget and every socket buffer
                await flood.send(ping)
                sent += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    assert sent < 50_000  # the broker stopped reading, then closed the connection
    while server.sessions:
        await trio.sleep(0.01)
    assert server.counters.closed["slow_consumer"] == 1
    server.shutdown.set()


async def test_keepalive_pings_a_silent_connection_then_closes_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    server, port = await start(nursery, make_config(server={"keepalive_ms": 1000}))
    silent = await connect(port)
    alive = await connect(port)
    before = trio.current_time()
    assert await silent.expect(codec.Ping)
    assert 1 <= trio.current_time() - before < 1.5
    assert await alive.expect(codec.Ping)
    await alive.send(codec.Pong(b"keepalive"))
    bye = await silent.expect(codec.Goodbye)
    assert bye.code == ErrorCode.TIMEOUT and "server.keepalive_ms" in bye.text
    assert await silent.closed()
    assert 2 <= trio.current_time() - before < 2.5
    while len(server.sessions) > 1:
        await trio.sleep(0.01)
    assert server.counters.closed["keepalive_timeout"] == 1
    assert await alive.expect(codec.Ping)  # answered: pinged again after the next quiet second
    assert len(server.sessions) == 1
    server.shutdown.set()


async def test_blocked_publisher_resumes_when_consumer_takes(nursery: trio.Nursery) -> None:
    cfg = make_config(queues={"capacity": 2, "overflow": "block", "block_timeout_ms": 10000})
    server, port = await start(nursery, cfg)
    sub = await connect(port)
    await sub.send(codec.Subscribe("t", "", 0, 0, request_id=1))
    await sub.expect(codec.Subscribed)
    pub = await connect(port)
    await pub.send(publish(*[("t", str(i).encode()) for i in range(50)]), codec.Ping(b"", 2))
    received: list[bytes] = []
    while len(received) < 50:
        frame = await sub.expect(codec.Deliver)
        received += [d.payload for d in frame.messages]
    assert received == [str(i).encode() for i in range(50)]
    await pub.expect(codec.Pong)
    server.shutdown.set()


async def test_refusal_keeps_the_connection(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config(server={"max_message_bytes": 10}))
    conn = await connect(port)
    await conn.send(publish(("ok", b"x"), ("ok", b"y" * 11), rid=3), codec.Ping(b"", 4))
    err = await conn.expect(codec.Error)
    assert err.code == ErrorCode.MESSAGE_TOO_LARGE and err.request_id == 3
    assert "1 before it were accepted" in err.text
    await conn.expect(codec.Pong)
    await conn.send(publish(("bad/+", b"x"), rid=5))
    assert (await conn.expect(codec.Error)).code == ErrorCode.INVALID_TOPIC
    server.shutdown.set()


async def test_client_frames_only(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    conn = await connect(port)
    await conn.send(codec.Welcome(1, 1, 1, "x", 3))
    assert (await conn.expect(codec.Error)).code == ErrorCode.PROTOCOL
    assert await conn.closed()
    server.shutdown.set()


async def test_group_deletion_notifies_its_consumers(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    member = await connect(port)
    await member.send(codec.Subscribe("jobs", "g", 0, 0, request_id=11))
    await member.expect(codec.Subscribed)
    admin = await connect(port)
    await admin.send(codec.Unsubscribe(0, "jobs", "g", 5))
    assert (await admin.expect(codec.Unsubscribed)).count == 1
    note = await member.expect(codec.Error)
    assert note.code == ErrorCode.GROUP_DELETED and note.request_id == 11
    await admin.send(codec.Unsubscribe(0, "jobs", "g", 6))
    assert (await admin.expect(codec.Error)).code == ErrorCode.NOT_FOUND
    server.shutdown.set()


async def test_shutdown_drains_queued_deliveries_then_says_goodbye(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    sub = await connect(port)
    await sub.send(codec.Subscribe("t", "", 0, 0, request_id=1))
    await sub.expect(codec.Subscribed)
    pub = await connect(port)
    await pub.send(publish(*[("t", b"m%d" % i) for i in range(1000)]), codec.Ping(b"", 2))
    await pub.expect(codec.Pong)
    server.shutdown.set()
    received = 0
    while True:
        frame = await sub.recv()
        if isinstance(frame, codec.Deliver):
            received += len(frame.messages)
        else:
            break
    assert received == 1000
    assert isinstance(frame, codec.Goodbye) and frame.code == ErrorCode.SHUTTING_DOWN


async def test_max_connections_error_frame(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config(server={"max_connections": 1}))
    first = await connect(port)
    second = await connect(port, handshake=False)
    err = await second.expect(codec.Error)
    assert err.code == ErrorCode.TOO_MANY_CONNECTIONS
    assert await second.closed()
    await first.send(codec.Ping(b"", 1))
    await first.expect(codec.Pong)
    assert server.counters.refused == 1
    server.shutdown.set()



async def test_bad_frame_behind_good_ones_is_answered_at_once(nursery: trio.Nursery) -> None:
    server, port = await start(nursery, make_config())
    conn = await connect(port)
    await conn.send(codec.Ping(b"a", 1), b"\x00\x00\x00\x05\xee\x00\x00\x00\x02")
    assert (await conn.expect(codec.Pong)).data == b"a"
    assert (await conn.expect(codec.Error)).code == ErrorCode.PROTOCOL
    assert await conn.closed()  # without the client sending anything more
    server.shutdown.set()


def publish_qos1(*msgs: tuple[str, bytes], rid: int) -> bytes:
    return codec.encode_publish([codec.message_record(Message(t, p, 1)) for t, p in msgs], rid)


async def _on_disk(nursery: trio.Nursery, tmp_path, disk: FaultyDisk, **wal: object
                   ) -> tuple[Server, Conn]:
    """A broker whose log (``wal`` settings besides ``enabled``) writes through ``disk``,
    and a connection to it."""
    cfg = make_config(wal={"enabled": True, **wal}, storage={"data_dir": str(tmp_path)})
    server = Server(cfg)
    assert server.wal is not None
    server.wal.disk = disk
    bound: Bound = await nursery.start(server.serve)
    return server, await connect(bound.port)


async def test_disk_fault_gives_an_error_instead_of_a_confirm_then_resumes(
    nursery: trio.Nursery, tmp_path
) -> None:
    disk = FaultyDisk()
    server, conn = await _on_disk(nursery, tmp_path, disk)
    await conn.send(publish_qos1(("t", b"stored"), rid=4))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 4)
    disk.fail_writes, disk.partial = True, 7  # a torn write, then ENOSPC
    await conn.send(publish_qos1(("t", b"lost-1"), ("t", b"lost-2"), rid=5))
    err = await conn.expect(codec.Error)
    assert err.code == ErrorCode.STORAGE and err.request_id == 5 and "No space" in err.text
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(0, 5)
    disk.fail_writes = False
    await conn.send(publish_qos1(("t", b"after"), rid=6))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 6)
    disk.fail_fsync = True
    await conn.send(publish_qos1(("t", b"unsynced"), rid=7))
    assert (await conn.expect(codec.Error)).code == ErrorCode.STORAGE
    assert (await conn.expect(codec.PubAck)).count == 0
    disk.fail_fsync = False
    assert server.flusher is not None and server.flusher.counters.failures == 2
    server.shutdown.set()
    await server.stopped.wait()
    reread = Log(str(tmp_path / "wal"))
    found = reread.open()
    assert found.torn_bytes == 0 and not found.quarantined
    payloads = [codec.decode_one(codec.encode_publish([r.body])).decoded()[0].payload
                for r in reread.read(0)]
    assert payloads == [b"stored", b"after"]


async def test_qos1_confirms_come_in_order_and_share_fsyncs(
    nursery: trio.Nursery, tmp_path
) -> None:
    cfg = make_config(wal={"enabled": True}, storage={"data_dir": str(tmp_path)})
    server = Server(cfg)
    bound: Bound = await nursery.start(server.serve)
    conns = [await connect(bound.port) for _ in range(4)]
    for c in conns:
        await c.send(*[publish_qos1(("t", b"m"), ("t", b"n"), rid=r) for r in range(1, 51)])
    for c in conns:
        acks = [await c.expect(codec.PubAck) for _ in range(50)]
        assert [a.request_id for a in acks] == list(range(1, 51))
        assert all(a.count == 2 for a in acks)
    assert server.flusher is not None
    counters = server.flusher.counters
    assert counters.records == 400
    assert counters.fsyncs < 200  # group commit: far fewer fsyncs than publishes
    server.shutdown.set()


async def test_a_segment_deleted_under_the_broker_is_written_back_before_a_confirm(
    nursery: trio.Nursery, tmp_path
) -> None:
    """Somebody deletes the segment being written: the next batch, written into the deleted
    file (still open), finds it gone and writes it back, from its descriptor, before it
    confirms. A restart reads what was confirmed before the deletion and after it."""
    cfg = make_config(wal={"enabled": True}, storage={"data_dir": str(tmp_path)})
    server, port = await start(nursery, cfg)
    conn = await connect(port)
    await conn.send(publish_qos1(("t", b"stored"), rid=4))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 4)
    for segment in (tmp_path / "wal").glob("*.seg"):
        segment.unlink()
    await conn.send(publish_qos1(("t", b"after"), rid=5))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 5)
    await conn.send(publish_qos1(("t", b"again"), rid=6))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 6)
    assert server.flusher is not None
    assert server.flusher.counters.restores == 1 and server.flusher.counters.failures == 0
    assert [p.name for p in (tmp_path / "wal").glob("*.seg")] == ["00000000000000000001.seg"]
    server.shutdown.set()
    await server.stopped.wait()
    assert _stored(tmp_path) == [b"stored", b"after", b"again"]


def _stored(data_dir) -> list[bytes]:
    """The payloads a restart finds in the log under ``data_dir``, which recovery leaves
    as it is."""
    log = Log(str(data_dir / "wal"))
    found = log.open()
    assert found.torn_bytes == 0 and not found.quarantined and not found.notes
    out = [codec.decode_one(codec.encode_publish([r.body])).decoded()[0].payload
           for r in log.read(0) if r.kind == Kind.MESSAGE]
    log.close()
    return out


async def test_a_log_directory_deleted_during_the_fsync_is_made_again_before_the_confirm(
    nursery: trio.Nursery, tmp_path
) -> None:
    """The directory goes while the batch's fsync runs, after its write went into the
    still open segment: the fsync succeeds (on the deleted file) and a check before the
    write was passed. The confirm waits until the directory is made again and the segment
    written back (a check after the fsync), so a restart reads it."""
    import shutil

    disk = FaultyDisk()
    server, conn = await _on_disk(nursery, tmp_path, disk)
    await conn.send(publish_qos1(("t", b"stored"), rid=4))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 4)
    disk.hold_fsync()
    await conn.send(publish_qos1(("t", b"during"), rid=5))
    with trio.fail_after(10):
        while not disk.fsync_held.is_set():
            await trio.sleep(0.01)
    shutil.rmtree(tmp_path / "wal")
    disk.release_fsync()
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 5)
    assert server.flusher is not None and server.flusher.counters.restores == 1
    server.shutdown.set()
    await server.stopped.wait()
    assert _stored(tmp_path) == [b"stored", b"during"]


async def test_a_log_directory_deleted_under_an_idle_broker_is_made_again_within_a_round(
    nursery: trio.Nursery, tmp_path
) -> None:
    """Nothing is written after the deletion: the maintenance round's check notices it,
    and the segment being written is back (what a kill -9 would then leave) without
    waiting for the next write."""
    import shutil

    cfg = make_config(wal={"enabled": True, "maintenance_interval_ms": 100},
                      storage={"data_dir": str(tmp_path)})
    server, port = await start(nursery, cfg)
    conn = await connect(port)
    await conn.send(publish_qos1(("t", b"stored"), rid=4))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 4)
    shutil.rmtree(tmp_path / "wal")
    segment = tmp_path / "wal" / "00000000000000000001.seg"
    with trio.fail_after(10):
        while server.flusher is None or server.flusher.counters.restores < 1:
            await trio.sleep(0.02)
    assert segment.exists()
    shutil.copytree(tmp_path / "wal", tmp_path / "killed" / "wal")  # as a kill -9 leaves it
    assert _stored(tmp_path / "killed") == [b"stored"]
    server.shutdown.set()


async def test_segments_deleted_with_the_directory_leave_the_log_and_what_they_held_is_restated(
    nursery: trio.Nursery, tmp_path
) -> None:
    """The directory is deleted once the log has rotated: the segment being written is
    written back, the older ones are gone. They leave the log (their records are lost, and
    counted), and the durable group whose create record only they held is restated in a
    checkpoint, so a restart still finds it and where it was."""
    import shutil

    cfg = make_config(wal={"enabled": True, "segment_bytes": 4096},
                      storage={"data_dir": str(tmp_path)})
    server, port = await start(nursery, cfg)
    conn = await connect(port)
    await conn.send(codec.Subscribe("jobs", "g", 1, request_id=3))
    await conn.expect(codec.Subscribed)
    for rid in range(10, 40):  # 30 x 200 bytes: past the first segment
        await conn.send(publish_qos1(("other", b"x" * 200), rid=rid))
        assert (await conn.expect(codec.PubAck)).count == 1
    assert server.wal is not None and len(server.wal.segments) >= 2
    shutil.rmtree(tmp_path / "wal")
    await conn.send(publish_qos1(("other", b"after"), rid=40))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 40)
    assert len(server.wal.segments) == 1
    assert server.flusher is not None and server.flusher.counters.restores == 1
    await conn.send(publish_qos1(("other", b"then"), rid=41))  # the checkpoint is durable
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 41)
    assert await _groups_after_restart(nursery, server, tmp_path) == [("jobs", "g")]


async def _durable_group(nursery: trio.Nursery, tmp_path, disk: FaultyDisk
                         ) -> tuple[Server, Conn]:
    """A broker on ``disk`` (``wal.fsync = always``) and a connection that made the durable
    group ``g`` on ``jobs`` (its create record durable: a QoS 1 publish after it confirmed)."""
    server, conn = await _on_disk(nursery, tmp_path, disk, fsync="always")
    await conn.send(codec.Subscribe("jobs", "g", 1, request_id=3))
    await conn.expect(codec.Subscribed)
    await conn.send(publish_qos1(("other", b"x"), rid=4))
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 4)
    return server, conn


async def _groups_after_restart(nursery: trio.Nursery, server: Server, tmp_path
                                ) -> list[tuple[str, str]]:
    """Stop ``server``, start another on its data directory: the durable groups it found."""
    server.shutdown.set()
    await server.stopped.wait()
    again = Server(make_config(wal={"enabled": True}, storage={"data_dir": str(tmp_path)}))
    await nursery.start(again.serve)
    assert again.broker.cursors is not None
    found = list(again.broker.cursors.durable)
    again.shutdown.set()
    await again.stopped.wait()
    return found


async def test_unsubscribed_waits_until_the_group_deletion_is_durable(
    nursery: trio.Nursery, tmp_path
) -> None:
    """UNSUBSCRIBE of a durable group: UNSUBSCRIBED means the group is gone, a crash
    included, so it goes out once the DELETE record is synced, and the PONG of a PING sent
    right behind it only after it (replies in the order of their frames). The fsync is
    held: nothing may have come while it waits."""
    import select

    disk = FaultyDisk()
    server, conn = await _durable_group(nursery, tmp_path, disk)
    disk.hold_fsync()
    try:
        await conn.send(codec.Unsubscribe(0, "jobs", "g", request_id=5), codec.Ping(b"p", 6))
        with trio.fail_after(10):
            while not disk.fsync_held.is_set():
                await trio.sleep(0.01)
        readable, _, _ = select.select([conn.stream.socket.fileno()], [], [], 0)
        assert not readable and not conn.frames  # no UNSUBSCRIBED before it is on disk
    finally:
        disk.release_fsync()
    assert (await conn.expect(codec.Unsubscribed)) == codec.Unsubscribed(1, 5)
    assert (await conn.expect(codec.Pong)).request_id == 6
    assert await _groups_after_restart(nursery, server, tmp_path) == []


async def test_a_group_deletion_the_disk_refused_is_an_error_not_unsubscribed(
    nursery: trio.Nursery, tmp_path
) -> None:
    """The disk refused the DELETE record: ERROR STORAGE with the request's id, not
    UNSUBSCRIBED, and the connection stays. The group is gone from memory and its
    deletion is written again with the next batch, so a restart does not bring it back."""
    disk = FaultyDisk()
    server, conn = await _durable_group(nursery, tmp_path, disk)
    disk.fail_writes = True
    await conn.send(codec.Unsubscribe(0, "jobs", "g", request_id=5))
    err = await conn.expect(codec.Error)
    assert err.code == ErrorCode.STORAGE and err.request_id == 5, err
    assert "is deleted" in err.text and "restart" in err.text
    disk.fail_writes = False
    await conn.send(publish_qos1(("other", b"y"), rid=6))  # written after the deletion
    assert (await conn.expect(codec.PubAck)) == codec.PubAck(1, 6)
    await conn.send(codec.Unsubscribe(0, "jobs", "g", request_id=7))
    assert (await conn.expect(codec.Error)).code == ErrorCode.NOT_FOUND
    assert await _groups_after_restart(nursery, server, tmp_path) == []


async def test_retention_keeps_what_its_round_carried_when_a_burst_follows(
    nursery: trio.Nursery, tmp_path
) -> None:
    """A maintenance round carries what a restart needs (here the checkpoint of the durable
    group ``g``, whose CREATE record is in the first segment) into the newest segment, waits
    for it to be written, then deletes segments past the cap. More than the cap arrived in
    between (a burst), so that segment was no longer the newest, and it went too: after a
    restart the group was gone. Segments from where the round carried to are kept now."""
    from blipmq_server.kinds import Kind

    cfg = make_config(wal={"enabled": True, "fsync": "none", "segment_bytes": 4096,
                           "retention_bytes": 8192, "maintenance_interval_ms": 100},
                      storage={"data_dir": str(tmp_path)})
    server = Server(cfg)
    assert server.wal is not None
    wal = server.wal
    bound: Bound = await nursery.start(server.serve)
    conn = await connect(bound.port)
    await conn.send(codec.Subscribe("jobs", "g", 1, request_id=3))
    await conn.expect(codec.Subscribed)
    for rid in range(4, 40):  # the log past its first segments, confirmed (written)
        await conn.send(publish_qos1(("other", b"x" * 400), rid=rid))
        await conn.expect(codec.PubAck)
    noise = codec.message_record(Message("noise", b"n" * 500))
    real, rounds = server._written, []

    async def written(offset: int, deadline: float) -> None:
        await real(offset, deadline)  # the round's copies are on disk; now the burst
        last = 0
        for _ in range(40):  # 20 kB: more than the cap, written before retention runs
            last = wal.append(Kind.MESSAGE, noise, 0)
        server.log_touched()
        while wal.written_offset < last:
            await trio.sleep(0.005)
        rounds.append(offset)

    server._written = written  # type: ignore[method-assign]
    await conn.send(codec.Ping(b"p", 50))  # the next round: anchors not yet written
    with trio.fail_after(10):
        while not rounds:
            await trio.sleep(0.01)
        await trio.sleep(0.05)  # its retention
    server._written = real  # type: ignore[method-assign]
    assert ("jobs", "g") in await _groups_after_restart(nursery, server, tmp_path)


def test_a_reload_that_would_turn_authentication_off_beyond_loopback_is_refused() -> None:
    """The MQTT listener in force is beyond loopback, and ``[mqtt]`` changes only with a
    restart: a configuration without keys is refused on reload (ConfigError: the broker
    logs "reload refused"), even one that would pass at start because it moves the
    listener to loopback or allows anonymous clients; the keys in force stay. (In
    process: a test must not listen beyond loopback, and the refusal comes first.)"""
    keyed = make_config(auth={"api_keys": ("k",)},
                        mqtt={"enabled": True, "host": "gateway.lan"})
    server = Server(keyed)
    for new in (make_config(mqtt={"enabled": True}),
                make_config(mqtt={"enabled": True, "host": "gateway.lan",
                                  "allow_anonymous": True})):
        with pytest.raises(ConfigError, match=r"mqtt\.host: MQTT listens on gateway\.lan"):
            server.reload(new)
        assert server.keys.enabled and server.config.auth == keyed.auth
    # keys kept, or anonymous clients allowed by the configuration in force: applied
    assert "keys: 1" in " ".join(server.reload(make_config(
        auth={"api_keys": ("k2",)}, mqtt={"enabled": True, "host": "gateway.lan"})))


async def test_a_subscribe_of_many_filters_lets_the_others_in_between_two(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """h34 #6: MQTT's reader took every filter of a SUBSCRIBE in one turn of the event loop:
    one SUBSCRIBE of 2,000 filters held the whole broker ~4 s (10,000 retained values).
    Now it lets the other tasks in between two filters once it has worked for its turn
    (made 0 here: every filter is a turn of its own), and its SUBACK still answers them
    all, in order."""
    from blipmq_server.mqtt import codec as mqtt
    from blipmq_server.mqtt.packets import ConnAck, Connect, Publish, SubAck, Subscribe
    from blipmq_server.server import mqtt as front

    monkeypatch.setattr(front, "_TURN_S", -1.0, raising=False)
    done: list[str] = []
    subscribe_one = front.MqttSession.subscribe_one

    def counted(self: front.MqttSession, topic_filter: str, qos: int, retained: bool,
                restored: bool = False) -> tuple[int, bool]:
        done.append(topic_filter)
        return subscribe_one(self, topic_filter, qos, retained, restored)

    monkeypatch.setattr(front.MqttSession, "subscribe_one", counted)
    server = Server(make_config(mqtt={"enabled": True, "port": 0}))
    bound: Bound = await nursery.start(server.serve)
    assert bound.mqtt_port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", bound.mqtt_port)
    decoder = mqtt.Decoder()
    ready: list[object] = []

    async def recv() -> object:
        with trio.fail_after(10):
            while not ready:
                decoder.feed(await stream.receive_some(65536))
                ready.extend(decoder.packets())
        return ready.pop(0)

    await stream.send_all(mqtt.encode(Connect("MQTT", 4, True, 0, "many")))
    assert isinstance(await recv(), ConnAck)
    filters = [f"f/{i}" for i in range(200)]
    await stream.send_all(mqtt.encode(Subscribe(1, tuple((f, 0) for f in filters))))
    with trio.fail_after(10):
        while not done:  # this task runs again once the reader has begun
            await trio.sleep(0)
    seen = len(done)
    assert await recv() == SubAck(1, (0,) * 200)
    assert seen < len(filters), "the SUBSCRIBE's filters were all done in one turn"
    assert done == filters
    await stream.send_all(mqtt.encode(Publish("f/199", b"last")))
    got = await recv()
    assert isinstance(got, Publish) and (got.topic, got.payload) == ("f/199", b"last")
    server.shutdown.set()


async def test_a_connection_arriving_as_the_shutdown_begins_does_not_crash_it() -> None:
    """A connection the listener saw as the shutdown began: the accept task was already
    woken when the listener closed under it (CI: exit 1 with ClosedResourceError). The
    connect and the shutdown come in one step of this task, so which of the two the
    scheduler runs first is its coin toss; forty tosses."""
    for _ in range(40):
        async with trio.open_nursery() as nursery:
            server, port = await start(nursery, make_config(server={"shutdown_grace_ms": 100}))
            await trio.testing.wait_all_tasks_blocked()  # the accept task waits in epoll
            with socket.create_connection(("127.0.0.1", port)):  # no checkpoint in between
                server.shutdown.set()
                with trio.fail_after(10):
                    await server.stopped.wait()
