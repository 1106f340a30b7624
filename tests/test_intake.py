"""Large frames in progress, bounded together (``server/intake.py``): a connection holds up
to 64 KiB of an incomplete frame on its own and a larger one only with a grant from
``server.max_reading_bytes``; readers keep no message while they wait for their next read.

The ``Intake`` alone (grants in order, cancelled waiters, give-backs), both decoders'
``wanted``, and the real broker process under many connections part way through large
MQTT PUBLISHes: its memory, and every message still arriving once they finish.
"""

from __future__ import annotations

import itertools
import socket
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from blipmq_cli import Client
from blipmq_server.counters import ConnectionCounters
from blipmq_server.mqtt import codec as mqtt
from blipmq_server.mqtt.packets import Connect, Publish, Subscribe, Will
from blipmq_server.protocol import codec
from blipmq_server.protocol.message import Message, RawMessage, message_record
from blipmq_server.server.intake import Intake


def test_grants_come_in_the_order_they_were_asked_for() -> None:
    async def main() -> None:
        intake = Intake(10, ConnectionCounters())
        assert intake.take(1, 6)
        assert not intake.take(2, 6)  # no room: 2 must wait
        got: list[int] = []

        async def waiter(conn: int, size: int) -> None:
            await intake.wait(conn, size)
            got.append(conn)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, 2, 6)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(waiter, 3, 5)
            await trio.testing.wait_all_tasks_blocked()
            assert not intake.take(4, 1), "4 fits, but 2 and 3 asked first"
            assert got == []
            intake.give_back(1)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [2] and intake.used == 6 and intake.held == {2: 6}
            intake.give_back(2)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [2, 3] and intake.held == {3: 5}
        assert intake.counters.reading_waits == 2
        assert intake.take(4, 5), "room for 4 beside 3, nobody waits"
        intake.give_back(3)
        intake.give_back(3)  # twice (a close after a finished frame): nothing more
        intake.give_back(4)
        assert intake.used == 0 and not intake.held

    trio.run(main)


def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_in() -> None:
    async def main() -> None:
        intake = Intake(10, ConnectionCounters())
        assert intake.take(1, 5)
        granted = trio.Event()

        async def second() -> None:
            await intake.wait(3, 5)
            granted.set()

        scope = trio.CancelScope()

        async def first() -> None:
            with scope:
                await intake.wait(2, 9)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(second)  # 5 fits, but 2 (waiting for 9) was first
            await trio.testing.wait_all_tasks_blocked()
            assert not granted.is_set()
            scope.cancel()  # 2's connection closed while it waited
            await trio.testing.wait_all_tasks_blocked()
            assert granted.is_set() and intake.held == {1: 5, 3: 5}
        # a frame larger than the whole budget (none is: the broker raises the budget to
        # its largest frame) takes the budget, not more
        intake.give_back(1)
        intake.give_back(3)
        assert intake.take(5, 99) and intake.used == 10

    trio.run(main)


def test_the_decoders_say_how_large_the_frame_they_are_reading_is() -> None:
    record = message_record(Message("t", b"x" * 100_000))
    native = codec.encode(codec.Publish((RawMessage(b"t", 0, 0, 100_000, record),), 7))
    packet = mqtt.encode(Publish("t/x", b"y" * 200_000, 1, False, False, 9))
    for decoder, data, decode in ((codec.Decoder(1 << 20), native, "frames"),
                                  (mqtt.Decoder(1 << 20), packet, "packets")):
        seen = set()
        cuts = [0, 1, 2, 3, *range(4, len(data) - 1, 997), len(data) - 1]  # the length split
        for start, end in itertools.pairwise(cuts):
            decoder.feed(data[start:end])
            assert getattr(decoder, decode)() == []
            seen.add(decoder.wanted)
        assert len(data) in seen and seen <= {0, 2, 3, 4, 5, len(data)}, seen
        assert decoder.wanted == len(data) and decoder.buffered == len(data) - 1
        decoder.feed(data[-1:])
        assert len(getattr(decoder, decode)()) == 1
        assert decoder.wanted == 0 and decoder.buffered == 0


def _rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def _connect(port: int, client_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(mqtt.encode(Connect("MQTT", 4, True, 0, client_id)))
    assert sock.recv(4)[:1] == b"\x20"  # CONNACK
    return sock


CONNS = 40
BIG = 1 << 20  # each connection's PUBLISH payload


@pytest.mark.slow
def test_many_connections_part_way_through_large_frames_hold_only_the_budget(
        start_broker) -> None:
    """40 MQTT connections each send all but the last byte of a 1 MiB PUBLISH: the broker
    read all 40 MiB of them before (RssAnon grew by 41-42 MiB); now it reads at most 4 MiB
    of large frames plus 64 KiB a connection, the rest waits in TCP. Then each sends its
    last byte and every message reaches the subscriber: the grants pass on."""
    bp = start_broker({"mqtt": {"enabled": True, "port": 0}, "wal": {"fsync": "none"},
                       "server": {"max_message_bytes": BIG, "max_reading_bytes": 4 << 20}})
    assert bp.mqtt_port is not None
    port = bp.mqtt_port
    sub = _connect(port, "sub")
    sub.sendall(mqtt.encode(Subscribe(1, (("big/#", 0),))))
    assert sub.recv(5)[:1] == b"\x90"  # SUBACK
    base = _rss_anon_kib(bp.proc.pid)
    packet = mqtt.encode(Publish("big/x", b"b" * BIG))
    done: list[int] = []

    async def sender(i: int, last: trio.Event) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(mqtt.encode(Connect("MQTT", 4, True, 0, f"big{i}")))
        assert (await stream.receive_some(4))[:1] == b"\x20"
        await stream.send_all(packet[:-1])  # blocks in TCP while the broker does not read
        await last.wait()
        await stream.send_all(packet[-1:])
        await stream.send_all(b"\xe0\x00")  # DISCONNECT after it
        assert await stream.receive_some(1) == b""  # the broker read it all and closed
        done.append(i)

    def received() -> int:
        decoder, got = mqtt.Decoder(), 0
        sub.settimeout(30)
        while got < CONNS:  # bounded by the socket's timeout
            data = sub.recv(1 << 20)
            assert data, "the subscriber was disconnected"
            decoder.feed(data)
            got += sum(1 for p in decoder.packets() if isinstance(p, Publish))
        return got

    async def main() -> None:
        last = trio.Event()
        async with trio.open_nursery() as nursery:
            for i in range(CONNS):
                nursery.start_soon(sender, i, last)
            deadline = time.monotonic() + 30
            while bp.metric("blipmq_reading_waits_total") < CONNS - 4:  # bounded
                assert time.monotonic() < deadline, bp.metrics()
                await trio.sleep(0.05)
            await trio.sleep(0.3)  # what the ungranted readers hold is read by now
            grown = _rss_anon_kib(bp.proc.pid) - base
            assert grown < 16 << 10, f"RssAnon grew {grown} KiB with {CONNS} frames begun"
            last.set()
            got = await trio.to_thread.run_sync(received)
            assert got == CONNS
        assert sorted(done) == list(range(CONNS))

    trio.run(main)
    sub.close()


@pytest.mark.slow
def test_a_waiting_reader_keeps_no_message(start_broker) -> None:
    """40 connections each publish one whole 1 MiB message and the first byte of another,
    and stay: each reader then waits for its next read holding nothing of the message (it
    kept the last message it decoded, 41 MiB in all, for as long as the connection lived;
    and the MQTT decoder kept the whole buffer the message was joined in for the byte
    after it)."""
    bp = start_broker({"mqtt": {"enabled": True, "port": 0}, "wal": {"fsync": "none"},
                       "server": {"max_message_bytes": BIG}})
    assert bp.mqtt_port is not None
    base = _rss_anon_kib(bp.proc.pid)
    packet = mqtt.encode(Publish("big/x", b"b" * BIG))
    socks = []
    for i in range(CONNS):
        sock = _connect(bp.mqtt_port, f"keep{i}")
        # PINGREQ: its PINGRESP says the message was read; then a byte of the next PUBLISH
        sock.sendall(packet + b"\xc0\x00" + b"\x30")
        assert sock.recv(2) == b"\xd0\x00"
        socks.append(sock)
    deadline = time.monotonic() + 20
    while (grown := _rss_anon_kib(bp.proc.pid) - base) > 16 << 10:  # bounded by the deadline
        assert time.monotonic() < deadline, f"RssAnon {grown} KiB over the start's, idle"
        time.sleep(0.1)
    for sock in socks:
        sock.close()


@pytest.mark.slow
def test_a_connection_waiting_for_room_before_its_handshake_still_times_out(
        start_broker) -> None:
    """Handshakes share the room of one largest frame (1.13 MiB here): a peer sends the
    header of a 1 MiB CONNECT and 70 kB of it; another sends all but the last byte of a
    180 kB CONNECT (its will, user name and password) and waits for room: the handshake's
    deadline still ends it (it waited for good while not reading), and the first."""
    bp = start_broker({"mqtt": {"enabled": True, "port": 0},
                       "server": {"max_message_bytes": BIG, "max_reading_bytes": 1 << 20,
                                  "handshake_timeout_ms": 1000}})
    assert bp.mqtt_port is not None
    holder = socket.create_connection(("127.0.0.1", bp.mqtt_port), timeout=10)
    holder.sendall(b"\x10" + _remaining(BIG) + b"\0" * 70_000)
    deadline = time.monotonic() + 10
    late = socket.create_connection(("127.0.0.1", bp.mqtt_port), timeout=10)
    late.sendall(mqtt.encode(Connect("MQTT", 4, True, 0, "late",
                                     Will("late/will", b"w" * 60_000, 0, False),
                                     "u" * 60_000, b"p" * 60_000))[:-1])
    while bp.metric("blipmq_reading_waits_total") < 1:  # bounded by the deadline
        assert time.monotonic() < deadline, bp.metrics()
        time.sleep(0.05)
    try:
        got = late.recv(1)
    except ConnectionResetError:  # closed with the rest of its CONNECT unread
        got = b""
    assert got == b"", "closed at the handshake's deadline"
    bp.wait_metric("blipmq_mqtt_protocol_errors_total", 2, reason="handshake_timeout")
    holder.close()
    late.close()


def _remaining(n: int) -> bytes:
    """MQTT's remaining length field for ``n``."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (128 if n else 0))
        if not n:
            return bytes(out)


def test_peers_that_never_authenticate_hold_back_no_large_frame_of_those_that_did(
        start_broker) -> None:
    """h26 D2: two native peers that never send HELLO announce 1 MiB frames and send 70 kB
    of each; they took the budget of large frames (``server.max_reading_bytes``), so an
    authenticated client's 900 kB publish waited until their handshakes timed out. The
    handshakes now share a room of their own: the publish goes through at once."""
    bp = start_broker({"server": {"max_message_bytes": BIG, "max_reading_bytes": 1 << 20,
                                  "handshake_timeout_ms": 60_000}})
    peers = []
    for _ in range(2):
        peer = socket.create_connection(("127.0.0.1", bp.port), timeout=10)
        peer.sendall(BIG.to_bytes(4, "big") + b"\x10" + b"\0" * 70_000)
        peers.append(peer)
    bp.wait_metric("blipmq_reading_waits_total", 1)  # the first holds its room, one waits
    started = time.monotonic()
    with Client(f"127.0.0.1:{bp.port}", timeout=10) as client:
        client.publish("big", b"x" * 900_000, qos=1)
    assert time.monotonic() - started < 5
    for peer in peers:
        peer.close()
