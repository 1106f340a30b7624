"""What one client may make the broker hold: subscriptions per connection
(``server.max_subscriptions``) and durable groups in all (``queues.max_durable_groups``),
through the real broker process, over MQTT and the native protocol. Without them a client
subscribing to distinct filters grew the broker by about 3 KB each (630 MB for 200,000)."""

from __future__ import annotations

import pytest
from mqttpeer import Raw

from blipmq_cli import BrokerError, Client
from blipmq_server.mqtt.packets import SubAck, Subscribe
from blipmq_server.protocol.codec import ErrorCode

LIMITS = {"mqtt": {"enabled": True, "port": 0},
          "server": {"max_subscriptions": 5}, "queues": {"max_durable_groups": 3}}


def test_mqtt_filters_past_the_limit_get_the_failure_code(start_broker) -> None:
    bp = start_broker(LIMITS)
    assert bp.mqtt_port is not None
    c = Raw(bp.mqtt_port)
    c.connect("many", clean=True)
    c.send(Subscribe(1, tuple((f"t/{n}", 1) for n in range(7))))
    ack = c.recv()
    assert isinstance(ack, SubAck) and ack.codes == (1, 1, 1, 1, 1, 0x80, 0x80), ack
    said = bp.wait_log("server.max_subscriptions")
    assert "2 of 7 filter(s) refused (0x80): 't/5': " in said and "'t/6': " in said, said
    assert sum("refused" in line for line in bp.log) == 1, bp.log  # one line, not one each
    # a persistent session's QoS 1 subscriptions are durable groups: the broker-wide cap
    p = Raw(bp.mqtt_port)
    p.connect("kept", clean=False)
    p.send(Subscribe(1, tuple((f"k/{n}", 1) for n in range(4))))
    ack = p.recv()
    assert isinstance(ack, SubAck) and ack.codes == (1, 1, 1, 0x80), ack


def test_native_subscriptions_past_the_limits_are_refused_with_limit(start_broker) -> None:
    bp = start_broker(LIMITS)
    with Client(bp.addr) as client:
        for n in range(5):
            client.subscribe(f"t/{n}")
        with pytest.raises(BrokerError) as refused:
            client.subscribe("t/5")
        assert refused.value.code == ErrorCode.LIMIT, refused.value
        assert "server.max_subscriptions" in str(refused.value)
    with Client(bp.addr) as client:
        for n in range(3):
            client.subscribe("jobs", group=f"g{n}", qos=1)
        with pytest.raises(BrokerError) as refused:
            client.subscribe("jobs", group="g3", qos=1)
        assert refused.value.code == ErrorCode.LIMIT, refused.value
        assert "queues.max_durable_groups" in str(refused.value)
    sub = bp.cli("sub", "jobs", "--group", "g4", "-q", "1", "-W", "1")
    assert sub.returncode != 0 and b"queues.max_durable_groups" in sub.stderr, sub
    assert len(sub.stderr.strip().splitlines()) == 1, sub.stderr  # one line, no traceback


def test_a_session_restored_keeps_what_it_was_granted(start_broker) -> None:
    """server.max_subscriptions bounds new SUBSCRIBEs: a persistent session granted five
    filters keeps all five when the broker restarts with a limit of three (it kept three,
    saved itself without the others and orphaned their groups)."""
    from blipmq_server.mqtt.packets import ConnAck, PubAck, Publish

    bp = start_broker({"mqtt": {"enabled": True, "port": 0}})
    assert bp.mqtt_port is not None
    c = Raw(bp.mqtt_port)
    c.connect("kept-five", clean=False)
    c.send(Subscribe(1, tuple((f"f/{n}", 1) for n in range(5))))
    assert c.recv() == SubAck(1, (1,) * 5)
    assert bp.stop() == 0
    bp = start_broker({"mqtt": {"enabled": True, "port": 0},
                       "server": {"max_subscriptions": 3}}, data_dir=bp.data_dir)
    assert bp.mqtt_port is not None
    c = Raw(bp.mqtt_port)
    assert c.connect("kept-five", clean=False) == ConnAck(True, 0)
    for n in range(5):
        assert bp.cli("pub", f"f/{n}", f"m{n}", "-q", "1").returncode == 0
    got = set()
    for _ in range(5):
        packet = c.recv()
        assert isinstance(packet, Publish), packet
        got.add(packet.payload)
        c.send(PubAck(packet.packet_id))
    assert got == {f"m{n}".encode() for n in range(5)}


def test_a_refused_replacement_leaves_the_subscription_as_it_was(start_broker) -> None:
    """A persistent session at queues.max_durable_groups asks to make its QoS 0 subscription
    QoS 1 (a new durable group): refused (0x80), and the QoS 0 one goes on (it was torn down
    before the refusal, and the filter delivered nothing more)."""
    from blipmq_server.mqtt.packets import Publish

    bp = start_broker(LIMITS)
    assert bp.mqtt_port is not None
    c = Raw(bp.mqtt_port)
    c.connect("upgrade", clean=False)
    c.send(Subscribe(1, (("g/0", 1), ("g/1", 1), ("g/2", 1), ("b", 0))))
    assert c.recv() == SubAck(1, (1, 1, 1, 0))  # three durable groups: the cap
    c.send(Subscribe(2, (("b", 1),)))
    assert c.recv() == SubAck(2, (0x80,))
    assert bp.cli("pub", "b", "still", "-q", "1").returncode == 0
    packet = c.recv()
    assert isinstance(packet, Publish) and packet.payload == b"still" and packet.qos == 0
