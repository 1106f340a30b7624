"""BlipMQ's MQTT listener as a bridge's upstream: a CONNECT at level 0x84 (mosquitto's
``try_private``, a BlipMQ bridge's) is a bridge session, whose messages are marked as
bridged in and which is sent no message so marked. Real brokers: two BlipMQ bridged to each
other, a raw bridge client, mosquitto bridged to BlipMQ."""

from __future__ import annotations

import json
import time
from collections import Counter

from blipmq_server.mqtt.codec import (
    ConnAck,
    Connect,
    PingReq,
    PingResp,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Will,
    encode,
)
from tests.conftest import BrokerProcess
from tests.mqttpeer import Paho, Raw
from tests.test_bridge import bridge_table, status, wait_status
from tests.upstream import Collector, Mosquitto, free_port, mqtt_client, wait_until

MQTT = {"enabled": True, "port": 0}


def stats(bp: BrokerProcess) -> dict:
    out = bp.cli("stats", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def subscribed(bp: BrokerProcess, *filters: str) -> bool:
    """Whether a persistent MQTT session (a bridge's) holds a subscription to each filter."""
    held = {g["filter"] for g in stats(bp)["groups"]
            if g["group"].startswith("mqtt.") and g["consumers"]}
    return set(filters) <= held


def settled(read, bounded, timeout: float = 20, quiet: float = 1.0):
    """``read()`` once it gave the same answer for ``quiet`` s (polled), within ``timeout``;
    every answer must be ``bounded`` (a loop fails at once, not at the deadline)."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert bounded(last), f"growing: {last}"
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {last}"
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_two_blipmq_brokers_bridged_both_ways_to_each_other_do_not_loop(start_broker) -> None:
    """Each broker has a `both` bridge to the other's MQTT listener. The listener answered the
    bridges' CONNECT (level 0x84) with CONNACK 1, so each bridge connected as a plain client
    and its `in` subscription was sent what the other broker's bridge had brought in: one
    publish became 34,000-74,000 copies on each side within 8 s, growing for ever. Now a
    bridge session gets nothing that came over a bridge: a message reaches the other side
    twice (once through each bridge), never comes back, and the counters stop."""
    ports = [free_port(), free_port()]

    def config(i: int) -> dict:
        return {"mqtt": {"enabled": True, "port": ports[i]}, "bridge": [bridge_table(
            f"to{1 - i}", [f"127.0.0.1:{ports[1 - i]}"], ["shared/# both 1"])]}

    left, right = start_broker(config(0)), start_broker(config(1))
    for bp, name in ((left, "to1"), (right, "to0")):
        wait_status(bp, name, lambda b: b["connected"])
    for bp in (left, right):
        assert wait_until(lambda bp=bp: subscribed(bp, "shared/#"), 20), stats(bp)["groups"]
    with Collector(ports[0], "shared/#") as seen_left, \
            Collector(ports[1], "shared/#") as seen_right:
        assert left.cli("pub", "shared/a", "from-left", "-q", "1").returncode == 0
        assert right.cli("pub", "shared/b", "from-right", "-q", "1").returncode == 0
        assert seen_left.wait_count(3, 20) and seen_right.wait_count(3, 20)

        def counters() -> tuple:
            return tuple((b["forwarded"], b["received"], b["skipped"])
                         for b in (status(left, "to1"), status(right, "to0")))

        final = settled(counters, lambda c: max(max(row) for row in c) <= 10)
        assert seen_left.wait_quiet(0.5, 10) and seen_right.wait_quiet(0.5, 10)
        got_left = Counter(seen_left.payloads())
        got_right = Counter(seen_right.payloads())
    assert got_left == {b"from-left": 1, b"from-right": 2}, got_left
    assert got_right == {b"from-right": 1, b"from-left": 2}, got_right
    # each bridge forwarded its side's message and brought the other's in, once; what came
    # in (over either bridge) was not sent back
    assert final == ((1, 1, 2), (1, 1, 2)), final
    for bp in (left, right):
        assert stats(bp)["mqtt"]["bridges"] == 1
        bp.wait_log("connected as a bridge (level 0x84)")


def _read(raw: Raw, got: list[Publish], done, timeout: float = 10) -> None:
    """Packets from ``raw`` until ``done()``; PUBLISHes go to ``got``, QoS 1 ones PUBACKed."""
    deadline = time.monotonic() + timeout
    while not done():
        packet = raw.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(packet, Publish):
            got.append(packet)
            if packet.qos:
                raw.send(PubAck(packet.packet_id))
        elif isinstance(packet, (SubAck, PubAck)):
            got.append(packet)  # type: ignore[arg-type]


def test_a_bridges_publishes_read_with_its_connect_are_all_marked_bridged(start_broker) -> None:
    """A bridge's CONNECT and its first PUBLISHes in one write, so one read for the broker:
    each of them is marked as bridged in, the later ones of a topic too, which take the
    reader's short way for a topic the client published to before (it must know that the
    CONNECT just read made this client a bridge). Another bridge session gets none of them;
    a plain client gets them all."""
    bp = start_broker({"mqtt": MQTT})
    other = Raw(bp.mqtt_port)
    assert other.connect("other-bridge", level=0x84).code == 0
    other.send(Subscribe(1, (("up/#", 0),)))
    other.expect(SubAck)
    with Collector(bp.mqtt_port, "up/#") as plain:
        edge = Raw(bp.mqtt_port)
        edge.send_bytes(b"".join(encode(p) for p in (
            Connect("MQTT", 0x84, True, 0, "edge-bridge"),
            *(Publish("up/x", str(i).encode(), 0, False, False, 0) for i in range(3)),
            PingReq())))
        assert edge.expect(ConnAck).code == 0
        edge.expect(PingResp)
        assert bp.cli("pub", "up/end", "plain").returncode == 0
        end = other.expect(Publish)
        assert (end.topic, end.payload) == ("up/end", b"plain")  # none of the bridge's
        assert plain.wait_count(4, 10), plain.messages()
        assert sorted(m.payload for m in plain.messages()) == [b"0", b"1", b"2", b"plain"]
        edge.disconnect()
    other.disconnect()


def test_a_bridge_session_gets_neither_its_own_messages_nor_bridged_ones(start_broker) -> None:
    """A client at level 0x84 is accepted as a bridge: it gets no message that came over a
    bridge (its own publishes, what the broker's own bridge brought in), neither live
    (QoS 0), nor from its log cursor (QoS 1), nor as a retained value; the skipped ones are
    settled (nothing left in flight). A plain client gets every message as before."""
    with Mosquitto() as up:
        cloud = mqtt_client(up.port)
        cloud.publish("cmd/ret", b"upstream-retained", qos=1, retain=True).wait_for_publish(5)
        bp = start_broker({"mqtt": MQTT, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["cmd/# in 1"])]})
        here = bp.cli("sub", "cmd/ret", "-C", "1", "-W", "15")  # brought in, retained
        assert here.stdout == b"upstream-retained\n", here
        assert bp.cli("pub", "-r", "edge/ret", "plain-retained", "-q", "1").returncode == 0
        with Collector(bp.mqtt_port, "#") as plain:
            edge = Raw(bp.mqtt_port)
            assert edge.connect("edge-bridge", clean=False, level=0x84).code == 0
            got: list = []
            edge.send(Subscribe(1, (("cmd/#", 1), ("edge/#", 0))))
            _read(edge, got, lambda: any(isinstance(p, SubAck) for p in got))
            edge.send(Publish("edge/own", b"from-the-bridge", 1, False, False, 7))
            _read(edge, got, lambda: any(isinstance(p, PubAck) for p in got))
            cloud.publish("cmd/lamp", b"on", qos=1).wait_for_publish(5)
            assert bp.cli("pub", "cmd/plain", "c", "-q", "1").returncode == 0
            assert bp.cli("pub", "edge/plain", "e").returncode == 0
            assert plain.wait_count(6, 15), plain.messages()
            assert bp.cli("pub", "cmd/end", "c-end", "-q", "1").returncode == 0
            assert bp.cli("pub", "edge/end", "e-end").returncode == 0
            ends = {"cmd/end", "edge/end"}
            _read(edge, got, lambda: ends <= {p.topic for p in got if isinstance(p, Publish)})
            topics = sorted(p.topic for p in got if isinstance(p, Publish))
            assert topics == ["cmd/end", "cmd/plain", "edge/end", "edge/plain", "edge/ret"]
            assert plain.wait_count(8, 10)
            assert sorted(m.topic for m in plain.messages()) == [
                "cmd/end", "cmd/lamp", "cmd/plain", "cmd/ret", "edge/end", "edge/own",
                "edge/plain", "edge/ret"]
            # the skipped deliveries were settled: the bridge session's group holds nothing
            report = stats(bp)
            assert report["mqtt"]["bridges"] == 1
            assert bp.metric("blipmq_mqtt_bridge_sessions") == 1
            table = bp.cli("stats")
            assert b"2 online (1 bridge(s))" in table.stdout, table.stdout.decode()
            assert wait_until(lambda: stats(bp)["in_flight"] == 0, 10), stats(bp)["groups"]
            mine = [g for g in stats(bp)["groups"] if g["filter"] == "cmd/#"
                    and g["group"].startswith("mqtt.")]
            assert all(g["backlog"] == 0 and g["in_flight"] == 0 for g in mine), mine
            bp.wait_log("MQTT client 'edge-bridge' from 127.0.0.1:")
            edge.disconnect()
        cloud.disconnect()
        cloud.loop_stop()


def test_mosquitto_bridged_to_blipmq_with_try_private(start_broker) -> None:
    """mosquitto's bridge (``try_private true``, its default) to BlipMQ's listener: taken as
    a bridge, both ways, and a `both` topic is neither echoed back nor passed around."""
    bp = start_broker({"mqtt": MQTT})
    bridge = [
        "connection toblip",
        f"address 127.0.0.1:{bp.mqtt_port}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession false",
        "restart_timeout 1",
        "notifications false",  # its link state: test_a_mosquitto_bridge_with_its_default...
        "topic up/# out 1",
        "topic down/# in 1",
        "topic both/# both 1",
    ]
    with Mosquitto(extra=bridge) as up, Collector(up.port, "#") as there, \
            Collector(bp.mqtt_port, "#") as here:
        assert wait_until(lambda: stats(bp)["mqtt"]["bridges"] == 1
                          and subscribed(bp, "down/#", "both/#"), 20), stats(bp)
        bp.wait_log("connected as a bridge (level 0x84)")
        pub = mqtt_client(up.port)
        pub.publish("up/a", b"1", qos=1).wait_for_publish(5)
        pub.publish("both/m", b"2", qos=1).wait_for_publish(5)
        assert bp.cli("pub", "down/b", "3", "-q", "1").returncode == 0
        assert bp.cli("pub", "both/b", "4", "-q", "1").returncode == 0
        assert here.wait_count(4, 15) and there.wait_count(4, 15)
        assert here.wait_quiet(1.0, 10) and there.wait_quiet(1.0, 10)
        for seen in (here, there):
            assert sorted((m.topic, m.payload) for m in seen.messages()) == [
                ("both/b", b"4"), ("both/m", b"2"), ("down/b", b"3"), ("up/a", b"1")]
        pub.disconnect()
        pub.loop_stop()


def test_a_mosquitto_bridge_with_its_default_notifications_stays_connected(start_broker
                                                                          ) -> None:
    """mosquitto's bridge publishes its link's state, retained at QoS 1, to
    ``$SYS/broker/connection/<client id>/state`` on the broker it connects to and makes
    that its will (``notifications``, on by default). BlipMQ refused the publish as one to
    a broker's '$' topic and closed the connection: with its defaults a mosquitto bridge
    reconnected for ever and carried nothing. A bridge session may publish there (and
    nowhere else under '$'); the state is kept as mosquitto keeps it, the will sets it 0."""
    bp = start_broker({"mqtt": MQTT})
    bridge = [
        "connection toblip",
        f"address 127.0.0.1:{bp.mqtt_port}",
        "bridge_protocol_version mqttv311",
        "remote_clientid edge-7",
        "cleansession false",
        "restart_timeout 1",
        "topic up/# out 1",
    ]
    state = "$SYS/broker/connection/edge-7/state"
    with Mosquitto(extra=bridge) as up, Collector(bp.mqtt_port, "up/#") as here:
        assert wait_until(lambda: stats(bp)["mqtt"]["bridges"] == 1, 20), stats(bp)
        with Collector(bp.mqtt_port, "$SYS/broker/connection/+/state") as states:
            assert states.wait_count(1, 10)
            assert [(m.topic, m.payload) for m in states.messages()] == [(state, b"1")]
        pub = mqtt_client(up.port)
        pub.publish("up/a", b"1", qos=1).wait_for_publish(5)
        assert here.wait_count(1, 15), here.messages()
        pub.disconnect()
        pub.loop_stop()
        assert bp.metric("blipmq_connections_closed_total", reason="protocol_error") == 0
        up.kill()  # its will: the state goes to 0
        with Collector(bp.mqtt_port, "$SYS/broker/connection/+/state") as states:
            # the retained 1 first if the will had not come yet, then the will's 0
            assert wait_until(lambda: [m.payload for m in states.messages()][-1:] == [b"0"],
                              20), states.messages()
    raw = Raw(bp.mqtt_port)  # a client that is not a bridge still may not publish there
    raw.connect("not-a-bridge")
    raw.send(Publish(state, b"1", 1, True, False, 1))
    assert raw.wait_closed() == []


def test_a_bridge_may_set_only_its_own_link_state(start_broker) -> None:
    """A bridge session may publish (and leave its will) on
    ``$SYS/broker/connection/<its own client id>/state`` only. Any bridge session could
    write any name's: `evil` (level 0x84) set real-bridge's retained state to 0 and made a
    `ghost` one. Now those are '$' topics like any other: dropped at QoS 0, the connection
    closed at QoS 1, its will there not published; its own state is still kept."""
    bp = start_broker({"mqtt": MQTT})
    real_state = "$SYS/broker/connection/real-bridge/state"
    real = Raw(bp.mqtt_port)
    assert real.connect("real-bridge", level=0x84,
                        will=Will(real_state, b"0", 1, True)).code == 0
    real.send(Publish(real_state, b"1", 1, True, False, 1))
    assert real.expect(PubAck) == PubAck(1)
    evil = Raw(bp.mqtt_port)
    assert evil.connect("evil", level=0x84, will=Will(real_state, b"0", 1, True)).code == 0
    evil.send(Publish("$SYS/broker/connection/ghost/state", b"1", 0, True, False, 0),
              Publish(real_state, b"0", 1, True, False, 2))
    assert evil.wait_closed() == []  # its will is due now, and refused
    again = Raw(bp.mqtt_port)
    assert again.connect("evil", level=0x84).code == 0
    again.send(Publish("$SYS/broker/connection/evil/state", b"1", 1, True, False, 3))
    assert again.expect(PubAck) == PubAck(3)
    again.disconnect()
    watcher = Paho(bp.mqtt_port, "watcher")
    assert watcher.subscribe(("$SYS/broker/connection/+/state", 0)) == [0]
    got = sorted((m.topic, m.payload) for m in watcher.take(2))
    watcher.sync()
    got += [(m.topic, m.payload) for m in watcher.drained()]
    assert got == [("$SYS/broker/connection/evil/state", b"1"), (real_state, b"1")], got
    watcher.disconnect()
    real.disconnect()


def test_a_share_member_that_is_a_bridge_gets_its_share_of_bridged_messages(start_broker
                                                                           ) -> None:
    """A `$share` group whose members are a plain client and a bridge session: bridged
    messages handed to the bridge member were settled unsent, for the whole group (h22 1:
    8 of 20 lost in 4 of 4 runs; nothing came again when the bridge member left). A share's
    members split its messages: the bridge member gets its share, bridged or not."""
    bp = start_broker({"mqtt": MQTT})
    worker = Paho(bp.mqtt_port, "worker")
    assert worker.subscribe(("$share/g/jobs", 1)) == [1]
    member = Raw(bp.mqtt_port)
    assert member.connect("bridge-member", level=0x84).code == 0
    member.send(Subscribe(1, (("$share/g/jobs", 1),)))
    assert member.expect(SubAck).codes == (1,)
    publisher = Raw(bp.mqtt_port)
    assert publisher.connect("upstream-bridge", level=0x84).code == 0
    for i in range(1, 21):
        publisher.send(Publish("jobs", b"job%d" % i, 1, False, False, i))
        assert publisher.expect(PubAck) == PubAck(i)
    got: list[bytes] = []
    deadline = time.monotonic() + 15
    while len(got) + worker.messages.qsize() < 20:  # bounded by the deadline
        assert time.monotonic() < deadline, (got, worker.messages.qsize())
        try:
            packet = member.recv(0.2)
        except AssertionError:  # nothing within 0.2 s
            continue
        assert isinstance(packet, Publish), packet
        got.append(packet.payload)
        member.send(PubAck(packet.packet_id))
    mine = [m.payload for m in worker.drained()]
    assert got and sorted(got + mine) == sorted(b"job%d" % i for i in range(1, 21))
