"""Publishers faster than the disk: the broker stops reading them while more than
``wal.max_unwritten_bytes`` of appended records wait for a batch, so memory stays bounded
and TCP pushes back, on the MQTT listener, the native one and a bridge's ``in`` link alike.

The Trio server in-process on loopback (port 0), its log on a disk whose writes can be held
(a worker thread blocked in ``append``, as on a stalled SD card); each test floods QoS 0
publishes of 8 KiB, checks the log's unwritten bytes stay near the bound while the disk is
held and the flood is not all read, then lets the disk go and finds every message logged.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from blipmq_server import config as config_module
from blipmq_server.kinds import Kind
from blipmq_server.mqtt import codec as mqtt
from blipmq_server.mqtt.packets import (
    ConnAck,
    Connect,
    PingReq,
    PingResp,
    Publish,
    SubAck,
    Subscribe,
)
from blipmq_server.protocol.message import message_from_record
from blipmq_server.server.app import Bound, Server
from blipmq_server.wal.disk import Disk
from tests.upstream import free_port

LIMIT = 1 << 20  # wal.max_unwritten_bytes: the smallest allowed
PAYLOAD = b"p" * 8192
COUNT = 2000  # 16 MiB: many times the bound
SLACK = 512 << 10  # what one read (and the decoder's leftover) may add past the bound


class HeldDisk(Disk):
    """A disk whose writes wait while ``go`` is clear (a stalled card), up to 30 s."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.go.set()
        self.waiting = 0  # writes blocked right now

    def append(self, path: str, data: bytes) -> None:
        if not self.go.is_set():
            self.waiting += 1
            self.go.wait(30)
            self.waiting -= 1
        super().append(path, data)


async def _flooded(tmp_path: Path, flood: Callable[[Bound], Awaitable[None]],
                   extra: str = "", held_s: float = 0.0,
                   while_held: Callable[[Server], None] | None = None) -> None:
    path = tmp_path / "blipmq.toml"
    path.write_text(f'[storage]\ndata_dir = "{tmp_path}"\n{extra}')
    cfg = config_module.load(path, env={}, overrides={
        "server.port": 0, "metrics.enabled": False, "mqtt.enabled": True, "mqtt.port": 0,
        "wal.fsync": "none", "wal.max_unwritten_bytes": LIMIT})
    server = Server(cfg)
    assert server.wal is not None and server.flusher is not None
    wal, flusher = server.wal, server.flusher
    disk = wal.disk = HeldDisk()
    async with trio.open_nursery() as nursery:
        bound: Bound = await nursery.start(server.serve)
        disk.go.clear()
        done = trio.Event()

        async def publisher() -> None:
            await flood(bound)
            done.set()

        nursery.start_soon(publisher)
        peak = 0
        with trio.fail_after(20):  # until the reader stops: it waits for room, or not at all
            while not (disk.waiting and flusher.counters.read_waits) and not done.is_set():
                peak = max(peak, wal.pending_bytes)
                if peak > LIMIT + SLACK:
                    break
                await trio.sleep(0.005)
        peak = max(peak, wal.pending_bytes)
        assert peak <= LIMIT + SLACK, f"{peak} bytes waited for the held disk"
        assert not done.is_set(), "the broker read the whole flood with its disk held"
        await trio.sleep(held_s)  # the disk stays stalled (a slow card) this much longer
        if while_held is not None:
            while_held(server)
        disk.go.set()
        with trio.fail_after(30):
            await done.wait()
            while wal.pending_records or wal.written_offset < wal.next_offset - 1:
                await trio.sleep(0.01)
        logged = sum(1 for r in wal.read(0, 10 * COUNT, 1 << 30)
                     if r.kind == Kind.MESSAGE and message_from_record(r.body).topic == "flood/x")
        assert logged == COUNT
        server.shutdown.set()


def test_an_mqtt_flood_is_read_no_faster_than_the_disk_takes_it(tmp_path: Path) -> None:
    async def flood(bound: Bound) -> None:
        assert bound.mqtt_port is not None
        stream = await trio.open_tcp_stream("127.0.0.1", bound.mqtt_port)
        await stream.send_all(mqtt.encode(Connect("MQTT", 4, True, 0, "flooder")))
        decoder = mqtt.Decoder()
        packets: list[object] = []
        while not packets:  # the CONNACK (bounded by the test's timeout)
            decoder.feed(await stream.receive_some(64))
            packets = decoder.packets()
        assert isinstance(packets[0], ConnAck) and packets[0].code == 0, packets
        packet = mqtt.encode(Publish("flood/x", PAYLOAD))
        for _ in range(COUNT // 100):
            await stream.send_all(packet * 100)
        await stream.aclose()

    trio.run(_flooded, tmp_path, flood)


def test_a_native_flood_is_read_no_faster_than_the_disk_takes_it(tmp_path: Path) -> None:
    from blipmq_cli import Client

    async def flood(bound: Bound) -> None:
        def publish() -> None:
            with Client(f"127.0.0.1:{bound.port}") as client:
                for _ in range(COUNT):
                    client.publish("flood/x", PAYLOAD)
                client.flush()

        await trio.to_thread.run_sync(publish)

    trio.run(_flooded, tmp_path, flood)


def test_a_bridged_in_flood_is_read_no_faster_than_the_disk_takes_it(tmp_path: Path) -> None:
    """A stand-in upstream (one connection: CONNACK, PINGRESP, SUBACK, then the flood) for a
    bridge whose ``in`` rule brings ``flood/#`` in at QoS 0."""
    port = free_port()
    listeners: list[trio.SocketListener] = []

    async def flood(bound: Bound) -> None:
        assert listeners
        stream = await listeners[0].accept()
        decoder = mqtt.Decoder()
        got: list[object] = []
        while not any(isinstance(p, Subscribe) for p in got):  # bounded by the timeout
            data = await stream.receive_some(65536)
            assert data, "the bridge closed the link"
            decoder.feed(data)
            for packet in decoder.packets():
                got.append(packet)
                if isinstance(packet, Connect):
                    await stream.send_all(mqtt.encode(ConnAck(False, 0)))
                elif isinstance(packet, PingReq):  # the link is up on its answer
                    await stream.send_all(mqtt.encode(PingResp()))
                elif isinstance(packet, Subscribe):
                    await stream.send_all(mqtt.encode(
                        SubAck(packet.packet_id, tuple(q for _, q in packet.topics))))
        packet = mqtt.encode(Publish("flood/x", PAYLOAD))
        for _ in range(COUNT // 100):
            await stream.send_all(packet * 100)
        await listeners[0].aclose()

    async def main() -> None:
        listeners.extend(await trio.open_tcp_listeners(port, host="127.0.0.1"))
        # the link waits for the log 2 s with a keepalive of 1 s: that silence is not the
        # upstream's, so the link stays (it was dropped after 1.5 s)
        await _flooded(tmp_path, flood, (
            f'[[bridge]]\nname = "up"\naddresses = ["127.0.0.1:{port}"]\n'
            'topics = ["flood/# in 0"]\nbackoff_min_ms = 100\nbackoff_max_ms = 200\n'
            'keepalive_s = 1\n'), held_s=2.0, while_held=link_stayed)

    def link_stayed(server: Server) -> None:
        (bridge,) = server.bridges.values()
        assert bridge.counters["reconnects"] == 0, bridge.last_error

    trio.run(main)


def _rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def test_memory_a_flood_held_goes_back_once_it_is_written(start_broker) -> None:
    """The real broker: 96 MiB of QoS 0 flood through MQTT, then idle. glibc keeps what the
    flood's batches freed (RssAnon stayed at 75 MiB here without a trim, 34 with it): the
    flusher trims the heap once the log is idle again."""
    import socket
    import time

    bp = start_broker({"mqtt": {"enabled": True, "port": 0}, "wal": {"fsync": "none"}})
    assert bp.mqtt_port is not None
    with socket.create_connection(("127.0.0.1", bp.mqtt_port), timeout=30) as sock:
        sock.sendall(mqtt.encode(Connect("MQTT", 4, True, 0, "flooder")))
        assert sock.recv(4)[:1] == b"\x20"  # CONNACK
        chunk = mqtt.encode(Publish("flood/x", PAYLOAD)) * 128  # 1 MiB
        for _ in range(96):
            sock.sendall(chunk)
        sock.sendall(b"\xc0\x00")  # PINGREQ: its PINGRESP comes once the flood was read
        assert sock.recv(2) == b"\xd0\x00"
    assert "blipmq_wal_read_waits_total" in bp.metrics()
    deadline = time.monotonic() + 20
    while _rss_anon_kib(bp.proc.pid) > 48 << 10:  # bounded by the deadline
        assert time.monotonic() < deadline, f"{_rss_anon_kib(bp.proc.pid)} KiB after the flood"
        time.sleep(0.1)


def test_the_flood_bench_runs() -> None:
    """bench/flood.py end to end, briefly: figures, no assertions on them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for args in (["--seconds", "0.5", "--size", "1024"], ["--subscriptions", "300"]):
        out = subprocess.run([sys.executable, str(root / "bench" / "flood.py"), *args],
                             capture_output=True, timeout=120, cwd=root)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert b"RSS" in out.stdout, out.stdout
