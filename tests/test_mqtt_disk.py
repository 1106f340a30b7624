"""MQTT sessions when the disk refuses a write: what the broker remembers of a session and
what its log says must agree again once writes succeed, or a reconnect or a restart acts on
state the client was never told about (an acknowledged message lost, a subscription gone).

The Trio server in-process on loopback (port 0), its log on a ``FaultyDisk`` whose writes
fail while ``fail_writes`` is set, driven by raw MQTT packets through the broker's codec.
Each scenario ends by restarting the server on the same data directory.
"""

from __future__ import annotations

import select
from pathlib import Path

import trio
import trio.testing

from blipmq_server import config as config_module
from blipmq_server.kinds import Kind
from blipmq_server.mqtt import codec as mqtt
from blipmq_server.mqtt.packets import (
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from blipmq_server.protocol.message import message_from_record
from blipmq_server.server.app import Bound, Server
from blipmq_server.wal.disk import FaultyDisk


def _config(data_dir: Path) -> config_module.Config:
    return config_module.load(None, env={}, overrides={
        "server.port": 0, "metrics.enabled": False, "mqtt.enabled": True, "mqtt.port": 0,
        "storage.data_dir": str(data_dir), "wal.fsync": "always"})


class Client:
    """One MQTT connection, a packet at a time."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = mqtt.Decoder()
        self.ready: list[object] = []

    async def send(self, *packets: object) -> None:
        await self.stream.send_all(b"".join(mqtt.encode(p) for p in packets))  # type: ignore[arg-type]

    async def recv(self) -> object | None:
        """The next packet; None once the broker closed the connection."""
        with trio.fail_after(10):
            while not self.ready:
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self.decoder.feed(data)
                self.ready += self.decoder.packets()
        return self.ready.pop(0)

    def nothing_came(self) -> bool:
        """Nothing from the broker is waiting to be read (a look, no wait)."""
        readable, _, _ = select.select([self.stream.socket.fileno()], [], [], 0)
        return not self.ready and not readable


class Broker:
    """The server in-process, started and stopped on one data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.disk = FaultyDisk()
        self.server: Server | None = None
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> None:
        server = self.server = Server(_config(self.data_dir))
        assert server.wal is not None
        server.wal.disk = self.disk
        bound: Bound = await nursery.start(server.serve)
        assert bound.mqtt_port is not None
        self.port = bound.mqtt_port

    async def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown.set()
        await self.server.stopped.wait()

    async def refused(self, c: Client, packet: Publish) -> None:
        """Send a QoS 0 ``packet`` while writes fail, and wait until its batch failed."""
        assert self.server is not None and self.server.flusher is not None
        counters = self.server.flusher.counters
        failures = counters.failures
        self.disk.fail_writes = True
        await c.send(packet)
        with trio.fail_after(10):
            while counters.failures == failures:
                await trio.sleep(0.01)
        self.disk.fail_writes = False

    async def fsync_held(self) -> None:
        """Wait until an fsync waits at the disk's gate (``FaultyDisk.hold_fsync``)."""
        with trio.fail_after(10):
            while not self.disk.fsync_held.is_set():
                await trio.sleep(0.01)

    async def client(self, client_id: str, clean: bool = False) -> tuple[Client, ConnAck]:
        c = Client(await trio.open_tcp_stream("127.0.0.1", self.port))
        await c.send(Connect("MQTT", 4, clean, 0, client_id))
        ack = await c.recv()
        assert isinstance(ack, ConnAck) and ack.code == 0, ack
        return c, ack


def _logged(b: Broker, topic: str) -> list[bytes]:
    """The payloads of ``topic``'s messages in the log, oldest first."""
    assert b.server is not None and b.server.wal is not None
    out = []
    for r in b.server.wal.read(0, 100_000, 1 << 30):
        if r.kind == Kind.MESSAGE:
            m = message_from_record(r.body)
            if m.topic == topic:
                out.append(m.payload)
    return out


async def test_a_qos2_publish_the_disk_refused_is_logged_when_the_client_sends_it_again(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The client's copy sent again after the reconnect (DUP) is the only one: it must be
    logged, not taken for a duplicate of a copy the disk never took."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("q2-device")
    b.disk.fail_writes = True
    await c.send(Publish("t/q2", b"important", 2, False, False, 7))
    assert await c.recv() is None  # closed without PUBREC: the client keeps the message
    b.disk.fail_writes = False
    c, ack = await b.client("q2-device")
    assert ack.session_present
    await c.send(Publish("t/q2", b"important", 2, False, True, 7))
    assert await c.recv() == PubRec(7)
    await c.send(PubRel(7))
    assert await c.recv() == PubComp(7)
    await c.send(Disconnect())
    await b.stop()
    await b.start(nursery)
    assert _logged(b, "t/q2") == [b"important"]
    await b.stop()


async def test_a_pubrel_the_disk_refused_frees_the_packet_id_in_the_log_too(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The PUBREL's record of the freed id was lost: once writes succeed the log must say
    the id is free, or after a restart the client's next message under that id is taken
    for the old one sent again and never logged."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("rel-device")
    await c.send(Publish("t/rel", b"m1", 2, False, False, 7))
    assert await c.recv() == PubRec(7)
    b.disk.fail_writes = True
    await c.send(PubRel(7))
    assert await c.recv() is None  # closed without PUBCOMP
    b.disk.fail_writes = False
    c, _ = await b.client("rel-device")
    await c.send(PubRel(7))
    assert await c.recv() == PubComp(7)
    await c.send(Disconnect())
    await b.stop()
    await b.start(nursery)
    c, _ = await b.client("rel-device")
    await c.send(Publish("t/rel", b"m2", 2, False, False, 7))  # a new message, id 7 reused
    assert await c.recv() == PubRec(7)
    await c.send(PubRel(7))
    assert await c.recv() == PubComp(7)
    await c.send(Disconnect())
    assert _logged(b, "t/rel") == [b"m1", b"m2"]
    await b.stop()


async def test_a_subscription_whose_group_record_the_disk_refused_survives_a_restart(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """A SUBSCRIBE while the disk refuses writes gets no SUBACK; the one sent again after
    the reconnect does, and then the subscription (its durable group in the log) must
    survive a restart with what was published for it meanwhile."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("sub-device")
    b.disk.fail_writes = True
    await c.send(Subscribe(1, (("s/#", 1),)))
    assert await c.recv() is None  # closed without SUBACK
    b.disk.fail_writes = False
    c, _ = await b.client("sub-device")
    await c.send(Subscribe(2, (("s/#", 1),)))
    assert await c.recv() == SubAck(2, (1,))
    await c.send(Disconnect())
    p, _ = await b.client("sub-publisher", clean=True)
    for i in range(3):
        await p.send(Publish("s/x", b"cmd-%d" % i, 1, False, False, i + 1))
        assert await p.recv() == PubAck(i + 1)
    await b.stop()
    await b.start(nursery)
    c, ack = await b.client("sub-device")
    assert ack.session_present
    got = []
    for _ in range(3):
        m = await c.recv()
        assert isinstance(m, Publish), m
        got.append(m.payload)
        await c.send(PubAck(m.packet_id))
    assert got == [b"cmd-0", b"cmd-1", b"cmd-2"]
    await b.stop()


async def test_an_unsubscribe_the_disk_refused_leaves_no_group_after_a_restart(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The UNSUBSCRIBE's deletion of the group was lost: once writes succeed the log must
    say the group is gone, or a restart brings back a group nobody reads, holding the log
    and its backlog for a subscription the client cancelled."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("unsub-device")
    await c.send(Subscribe(1, (("u/#", 1),)))
    assert await c.recv() == SubAck(1, (1,))
    b.disk.fail_writes = True
    await c.send(Unsubscribe(2, ("u/#",)))
    assert await c.recv() is None  # closed without UNSUBACK
    b.disk.fail_writes = False
    c, _ = await b.client("unsub-device")
    await c.send(Unsubscribe(3, ("u/#",)))
    assert await c.recv() == UnsubAck(3)
    await c.send(Disconnect())
    await b.stop()
    await b.start(nursery)
    assert b.server is not None and b.server.broker.cursors is not None
    assert [g.filter for g in b.server.broker.cursors.durable.values()] == []
    await b.stop()


async def test_a_retained_value_the_disk_refused_is_the_one_after_a_restart(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """Subscribers were given the new retained value from memory while the disk refused
    its record: once writes succeed it is written again, so a restart does not bring the
    old value back."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("retainer", clean=True)
    await c.send(Publish("r/state", b"v1", 1, True, False, 1))
    assert await c.recv() == PubAck(1)
    await b.refused(c, Publish("r/state", b"v2", 0, True, False, 0))

    async def retained() -> object | None:
        watcher, _ = await b.client("watcher", clean=True)
        await watcher.send(Subscribe(1, (("r/state", 0),)))
        assert await watcher.recv() == SubAck(1, (0,))
        return await watcher.recv()

    m = await retained()
    assert isinstance(m, Publish) and (m.payload, m.retain) == (b"v2", True)
    await c.send(Publish("r/other", b"x", 1, False, False, 2))  # written after it
    assert await c.recv() == PubAck(2)
    await b.stop()
    await b.start(nursery)
    m = await retained()
    assert isinstance(m, Publish) and (m.payload, m.retain) == (b"v2", True)
    await b.stop()


async def test_a_qos2_publish_whose_fsync_failed_gets_its_pubrec_once_one_succeeds(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """With ``wal.fsync = always`` a batch whose fsync fails is undone: the copies sent
    again get no PUBREC while syncs fail, then one does, and the message is logged once."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("sync-device")
    b.disk.fail_fsync = True
    await c.send(Publish("t/sync", b"once", 2, False, False, 9))
    assert await c.recv() is None  # no PUBREC: not synced
    c, _ = await b.client("sync-device")
    await c.send(Publish("t/sync", b"once", 2, False, True, 9))
    assert await c.recv() is None  # still not synced: still no PUBREC
    b.disk.fail_fsync = False
    c, _ = await b.client("sync-device")
    await c.send(Publish("t/sync", b"once", 2, False, True, 9))
    assert await c.recv() == PubRec(9)
    await c.send(PubRel(9))
    assert await c.recv() == PubComp(9)
    await c.send(Disconnect())
    assert _logged(b, "t/sync") == [b"once"]
    await b.stop()


async def test_a_retained_clear_the_disk_refused_stays_cleared_after_a_restart(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """A retained value cleared (an empty retained publish) while the disk refused the
    record: once writes succeed the clear is written again, so a restart does not bring
    the old value back."""
    b = Broker(tmp_path)
    await b.start(nursery)
    c, _ = await b.client("clearer", clean=True)
    await c.send(Publish("r/gone", b"v1", 1, True, False, 1))
    assert await c.recv() == PubAck(1)
    await b.refused(c, Publish("r/gone", b"", 0, True, False, 0))
    await c.send(Publish("r/other", b"x", 1, False, False, 2))  # written after it
    assert await c.recv() == PubAck(2)
    await b.stop()
    await b.start(nursery)
    watcher, _ = await b.client("watcher", clean=True)
    await watcher.send(Subscribe(1, (("r/#", 0),)))
    assert await watcher.recv() == SubAck(1, (0,))
    await watcher.send(Publish("r/marker", b"m", 0, False, False, 0))
    m = await watcher.recv()  # no retained value comes before it
    assert isinstance(m, Publish) and (m.topic, m.payload) == ("r/marker", b"m"), m
    await b.stop()


async def test_failed_writes_leave_no_batch_behind_for_the_collector(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """While the disk stays full the flusher retries every 0.2 s; a failed batch (its
    records' bytes) must be freed at once, not kept in a reference cycle until a full
    collection (the broker runs with the cyclic collector's thresholds raised): memory
    grew with the length of the outage."""
    import gc

    from blipmq_server.wal.batch import Batch

    b = Broker(tmp_path)
    await b.start(nursery)
    assert b.server is not None and b.server.flusher is not None
    flusher = b.server.flusher
    c, _ = await b.client("filler", clean=True)
    gc.collect()
    gc.disable()
    try:
        b.disk.fail_writes = True
        start = flusher.counters.failures
        with trio.fail_after(20):
            while flusher.counters.failures < start + 5:
                await c.send(Publish("t/big", b"x" * 100_000, 0, False, False, 0))
                await trio.sleep(0.05)
        alive = sum(1 for o in gc.get_objects() if isinstance(o, Batch))
        assert alive <= 1, f"{alive} failed batches kept alive"
    finally:
        gc.enable()
        b.disk.fail_writes = False
    await b.stop()


async def _offline_session(b: Broker, client_id: str, topic_filter: str) -> None:
    """A persistent session with a QoS 1 subscription, stored and not connected."""
    c, _ = await b.client(client_id)
    await c.send(Subscribe(1, ((topic_filter, 1),)))
    assert await c.recv() == SubAck(1, (1,))
    await c.send(Disconnect())
    assert await c.recv() is None
    assert b.server is not None
    with trio.fail_after(10):
        while client_id not in b.server.mqtt_sessions.offline:
            await trio.sleep(0.01)


async def test_a_clean_connack_waits_until_the_end_of_the_old_session_is_durable(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """CONNECT with clean session 1 ends the stored session (its records and its group's
    DELETE); CONNACK says session present 0, so it goes out only once those records are
    synced (``wal.fsync = always``), and the PINGRESP to a PINGREQ sent right behind the
    CONNECT only after it. The fsync is held: nothing may have come while it waits."""
    b = Broker(tmp_path)
    await b.start(nursery)
    await _offline_session(b, "held-device", "h/#")
    c = Client(await trio.open_tcp_stream("127.0.0.1", b.port))
    b.disk.hold_fsync()
    try:
        await c.send(Connect("MQTT", 4, True, 0, "held-device"), PingReq())
        await b.fsync_held()
        assert c.nothing_came()  # no CONNACK before the end of the session is on disk
    finally:
        b.disk.release_fsync()
    assert await c.recv() == ConnAck(False, 0)
    assert await c.recv() == PingResp()
    await c.send(Disconnect())
    await b.stop()
    await b.start(nursery)
    assert b.server is not None and b.server.broker.cursors is not None
    assert "held-device" not in b.server.mqtt_sessions.offline
    assert list(b.server.broker.cursors.durable) == []
    await b.stop()


async def test_a_clean_connect_whose_session_end_the_disk_refused_gets_no_connack(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """The records that end the stored session were refused: no CONNACK (3.1.1 has no
    code for it), the connection closes. The broker writes them again with its next
    batch; the client connects again and its CONNACK waits for that, and a restart then
    finds neither the session nor its group."""
    b = Broker(tmp_path)
    await b.start(nursery)
    await _offline_session(b, "refused-device", "r/#")
    b.disk.fail_writes = True
    c = Client(await trio.open_tcp_stream("127.0.0.1", b.port))
    await c.send(Connect("MQTT", 4, True, 0, "refused-device"))
    assert await c.recv() is None  # closed without CONNACK
    b.disk.fail_writes = False
    b.disk.hold_fsync()
    try:  # the records written again are not synced yet: neither is this CONNACK sent
        c = Client(await trio.open_tcp_stream("127.0.0.1", b.port))
        await c.send(Connect("MQTT", 4, True, 0, "refused-device"))
        await b.fsync_held()
        assert c.nothing_came()
    finally:
        b.disk.release_fsync()
    assert await c.recv() == ConnAck(False, 0)
    await c.send(Disconnect())
    await b.stop()
    await b.start(nursery)
    assert b.server is not None and b.server.broker.cursors is not None
    assert "refused-device" not in b.server.mqtt_sessions.offline
    assert list(b.server.broker.cursors.durable) == []
    c, ack = await b.client("refused-device")
    assert not ack.session_present
    await b.stop()


async def test_a_held_connack_is_not_the_clients_silence(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """While its CONNACK waits for the log, the client cannot ping (it may send nothing
    before CONNACK): that wait is the broker's, so a keepalive of 1 s does not close the
    connection however long the disk takes (it did, after 1.5 s, with no CONNACK ever)."""
    b = Broker(tmp_path)
    await b.start(nursery)
    await _offline_session(b, "slow-disk", "s/#")
    c = Client(await trio.open_tcp_stream("127.0.0.1", b.port))
    b.disk.hold_fsync()
    try:
        await c.send(Connect("MQTT", 4, True, 1, "slow-disk"))
        await b.fsync_held()
        await trio.sleep(3)  # twice 1.5 x the keepalive: the watchdog looked every second
        assert c.nothing_came()
    finally:
        b.disk.release_fsync()
    assert await c.recv() == ConnAck(False, 0)
    await c.send(Disconnect())
    await b.stop()
