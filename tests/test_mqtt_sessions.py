"""MQTT 3.1.1 sessions end to end: persistent sessions (clean session 0), redelivery with
DUP, takeover, session expiry, and what a SIGKILL of the broker must not lose.

The real broker on loopback; paho-mqtt and mosquitto_pub as clients, and a raw socket
(``mqttpeer.Raw``) where a well-behaved client cannot be made to misbehave (never PUBACK,
resend a QoS 2 PUBLISH with DUP). Each test names the statements of MQTT 3.1.1 it checks.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable, Iterator

import pytest
from mqttpeer import Paho, Raw, mosquitto, mosquitto_spawn, reap
from test_broker_retained import commit, open_broker
from upstream import free_port

from blipmq_server.mqtt.codec import (
    ConnAck,
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
    Will,
)
from blipmq_server.mqtt.state import group_name, pubrel_key, qos2_key, stored_ids
from blipmq_server.wal.log import LogOptions

MQTT = {"mqtt": {"enabled": True, "port": 0}}
# segments of 16 KiB, the oldest deleted past 64 KiB (``_past_retention``)
SMALL_LOG = {**MQTT, "wal": {"segment_bytes": 16384, "retention_bytes": 65536,
                             "maintenance_interval_ms": 100}}


@pytest.fixture(autouse=True)
def _reap_clients() -> Iterator[None]:
    """mosquitto and blipmq clients a failed test left running are killed."""
    yield
    reap()


def _nothing_more(raw: Raw) -> None:
    """Nothing is queued for ``raw`` before a PINGRESP (its answer to our PINGREQ)."""
    raw.send(PingReq())
    assert raw.recv() == PingResp()


def _subscribe(raw: Raw, topic_filter: str, qos: int, packet_id: int = 1) -> None:
    raw.send(Subscribe(packet_id, ((topic_filter, qos),)))
    assert raw.expect(SubAck) == SubAck(packet_id, (qos,))


# ------------------------------------------------------------------ 5. persistent sessions


def test_a_persistent_session_gets_what_was_published_while_it_was_away(start_broker) -> None:
    """MQTT-3.1.2-4/5: with clean session 0 the subscriptions and the QoS 1 messages that
    match them while disconnected are kept; MQTT-3.2.2-2: CONNACK's session present is 1
    on its return (-3: 0 for a new one); MQTT-3.1.2-6: clean session 1 discards it."""
    b = start_broker(MQTT)
    pub = Paho(b.mqtt_port, "ps-pub")
    pub.publish("ps/two/r", "retained", 1, retain=True)
    client = Paho(b.mqtt_port, "ps-1", clean=False)
    assert client.session_present is False
    assert client.subscribe(("ps/t", 1), ("ps/two/+", 2)) == [1, 2]
    m = client.get()
    assert (m.topic, m.retain) == ("ps/two/r", True)
    client.disconnect()

    n = 50
    for i in range(n):
        pub.publish("ps/t", f"m{i}", 1)
    pub.publish("ps/two/x", "qos 2", 2)
    back = Paho(b.mqtt_port, "ps-1", clean=False)
    assert back.session_present is True
    got = back.take(n + 1)
    assert [(m.payload, m.qos) for m in got if m.topic == "ps/t"] == [
        (f"m{i}".encode(), 1) for i in range(n)]
    assert [(m.topic, m.payload, m.qos) for m in got if m.topic != "ps/t"] == [
        ("ps/two/x", b"qos 2", 2)]  # and not the retained value again: no SUBSCRIBE
    pub.publish("ps/t", "live", 1)  # subscribed without a new SUBSCRIBE
    m = back.get()
    assert (m.topic, m.payload, m.qos, m.dup) == ("ps/t", b"live", 1, False)
    back.sync()
    assert back.drained() == []
    back.disconnect()

    fresh = Paho(b.mqtt_port, "ps-1", clean=True)  # ends the persistent session
    assert fresh.session_present is False
    fresh.disconnect()
    b.wait_metric("blipmq_durable_groups", 0)
    pub.publish("ps/t", "nobody's", 1)
    again = Paho(b.mqtt_port, "ps-1", clean=False)
    assert again.session_present is False
    again.sync()
    assert again.drained() == []


def test_a_qos0_subscription_of_a_persistent_session_is_kept(start_broker) -> None:
    """MQTT-3.1.2-4: the session's subscriptions are its state, whatever their QoS (QoS 0
    messages published while it was away need not be kept: mqtt.queue_qos0 is off)."""
    b = start_broker(MQTT)
    client = Paho(b.mqtt_port, "ps0", clean=False)
    assert client.subscribe(("ps0/t", 0)) == [0]
    client.disconnect()
    back = Paho(b.mqtt_port, "ps0", clean=False)
    assert back.session_present is True
    back.publish("ps0/t", "live", 1)
    m = back.get()
    assert (m.topic, m.payload, m.qos) == ("ps0/t", b"live", 0)


def test_a_clean_session_takeover_ends_the_persistent_session(start_broker) -> None:
    """MQTT-3.1.2-6: a connection with clean session 1 discards the session, also when it
    takes over a connected persistent one."""
    b = start_broker(MQTT)
    first = Paho(b.mqtt_port, "cs-1", clean=False)
    assert first.subscribe(("cs/t", 1)) == [1]
    second = Paho(b.mqtt_port, "cs-1", clean=True)
    assert second.session_present is False
    first.wait_closed()
    second.publish("cs/t", "to nobody", 1)
    second.sync()
    assert second.drained() == []
    second.disconnect()
    b.wait_metric("blipmq_durable_groups", 0)
    third = Paho(b.mqtt_port, "cs-1", clean=False)
    assert third.session_present is False
    third.sync()
    assert third.drained() == []


def test_an_unacknowledged_delivery_comes_again_with_dup(start_broker) -> None:
    """MQTT-4.4.0-1: on reconnection with clean session 0 the server re-sends the QoS 1
    and 2 PUBLISH packets not acknowledged, with DUP 1 (MQTT-3.3.1-1); once acknowledged,
    never again."""
    b = start_broker(MQTT)
    pub = Paho(b.mqtt_port, "dup-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect("dup-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "dup/t", 1)
    pub.publish("dup/t", "first", 1)
    first = raw.expect(Publish)
    assert (first.topic, first.payload, first.qos, first.dup) == ("dup/t", b"first", 1, False)
    raw.close()  # no PUBACK

    raw = Raw(b.mqtt_port)
    assert raw.connect("dup-1", clean=False) == ConnAck(True, 0)
    again = raw.expect(Publish)
    assert (again.topic, again.payload, again.qos, again.dup) == ("dup/t", b"first", 1, True)
    raw.send(PubAck(again.packet_id))
    _nothing_more(raw)
    pub.publish("dup/t", "second", 1)
    second = raw.expect(Publish)
    assert (second.payload, second.dup) == (b"second", False)
    raw.send(PubAck(second.packet_id))
    raw.disconnect()

    raw = Raw(b.mqtt_port)
    assert raw.connect("dup-1", clean=False) == ConnAck(True, 0)
    _nothing_more(raw)  # both were acknowledged: nothing is sent again


def test_an_unreceived_qos2_delivery_comes_again_with_dup_and_its_packet_id(start_broker
                                                                            ) -> None:
    """MQTT-4.4.0-1 and MQTT-3.3.1-1 at QoS 2: the PUBLISH the client never PUBRECed comes
    again with DUP 1 and the same packet id (so the client can tell it is the same one),
    and the flow completes: PUBREC, PUBREL, PUBCOMP."""
    b = start_broker(MQTT)
    pub = Paho(b.mqtt_port, "dup2-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect("dup2-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "dup2/t", 2)
    pub.publish("dup2/t", "once", 2)
    first = raw.expect(Publish)
    assert (first.payload, first.qos, first.dup) == (b"once", 2, False)
    raw.close()

    raw = Raw(b.mqtt_port)
    assert raw.connect("dup2-1", clean=False) == ConnAck(True, 0)
    again = raw.expect(Publish)
    assert (again.payload, again.qos, again.dup, again.packet_id) == (
        b"once", 2, True, first.packet_id)
    raw.send(PubRec(again.packet_id))
    assert raw.recv() == PubRel(again.packet_id)
    raw.send(PubComp(again.packet_id))
    _nothing_more(raw)
    raw.disconnect()
    raw = Raw(b.mqtt_port)
    assert raw.connect("dup2-1", clean=False) == ConnAck(True, 0)
    _nothing_more(raw)


FAST_RETRY = {**MQTT, "delivery": {"retry_backoff_ms": 300, "retry_backoff_max_ms": 300,
                                    "max_retries": 100}}


def _publishes(raw: Raw, n: int) -> list[Publish]:
    return [raw.expect(Publish) for _ in range(n)]


def _pubreced(b, name: str, clean: bool) -> tuple[Raw, Publish]:
    """A client ``name``-1 subscribed to ``name``/t at QoS 2 that got one message from
    ``name``-pub and PUBRECed it; the PUBREL has come, no PUBCOMP has gone."""
    pub = Paho(b.mqtt_port, f"{name}-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect(f"{name}-1", clean=clean) == ConnAck(False, 0)
    _subscribe(raw, f"{name}/t", 2)
    pub.publish(f"{name}/t", "exactly once", 2)
    first = raw.expect(Publish)
    raw.send(PubRec(first.packet_id))
    assert raw.recv() == PubRel(first.packet_id)
    return raw, first


def _overlapping(b, name: str, clean: bool) -> tuple[Raw, list[Publish]]:
    """A client ``name``-1 subscribed to ``name``/# and ``$share/g/name/#`` at QoS 2, and
    the six copies of three messages published to ``name``/t, none acknowledged."""
    pub = Paho(b.mqtt_port, f"{name}-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect(f"{name}-1", clean=clean) == ConnAck(False, 0)
    raw.send(Subscribe(1, ((f"{name}/#", 2), (f"$share/g/{name}/#", 2))))
    assert raw.expect(SubAck) == SubAck(1, (2, 2))
    for i in range(3):
        pub.publish(f"{name}/t", f"m{i}", 2)
    return raw, _publishes(raw, 6)


def test_a_delivery_keeps_its_packet_id_through_reconnects_and_a_sigkill(
        start_broker) -> None:
    """MQTT-4.4.0-1 and MQTT-2.3.1-3: a QoS 2 PUBLISH sent again (at the reconnect, and at a
    reconnect after the broker was SIGKILLed and restarted, which forgets what was in
    flight) carries its original packet id and DUP 1, so the client that stored it knows it
    for the same message; the flow then completes once. (Nothing is resent on the live
    connection, however short ``delivery.retry_backoff_ms``.)"""
    b = start_broker(FAST_RETRY)
    pub = Paho(b.mqtt_port, "pid-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect("pid-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "pid/t", 2)
    for i in range(2):  # two done first, so that packet ids handed out in turn would differ
        pub.publish("pid/t", f"done {i}", 2)
        done = raw.expect(Publish)
        raw.send(PubRec(done.packet_id))
        assert raw.expect(PubRel) == PubRel(done.packet_id)
        raw.send(PubComp(done.packet_id))
    for i in range(3):
        pub.publish("pid/t", f"held {i}", 2)
    first = _publishes(raw, 3)  # never PUBRECed
    ids = {m.payload: m.packet_id for m in first}
    assert [m.dup for m in first] == [False] * 3 and len(set(ids.values())) == 3

    def again(raw: Raw) -> None:
        resent = _publishes(raw, 3)
        assert {m.payload: m.packet_id for m in resent} == ids
        assert all(m.dup and m.qos == 2 for m in resent), resent

    time.sleep(1)  # three retry periods: no retry on the live connection
    _nothing_more(raw)
    raw.close()
    raw = Raw(b.mqtt_port)
    assert raw.connect("pid-1", clean=False) == ConnAck(True, 0)
    again(raw)
    raw.close()
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b = start_broker(FAST_RETRY, data_dir=b.data_dir)
    raw = Raw(b.mqtt_port)
    assert raw.connect("pid-1", clean=False) == ConnAck(True, 0)
    again(raw)
    for pid in sorted(ids.values()):
        raw.send(PubRec(pid))
        got = raw.recv()
        while isinstance(got, Publish):  # a retry that crossed our PUBREC
            assert got.packet_id in ids.values() and got.dup
            got = raw.recv()
        assert got == PubRel(pid)
        raw.send(PubComp(pid))
    _nothing_more(raw)
    assert b.metric("blipmq_mqtt_inflight") == 0


def test_a_slow_pubcomp_gets_no_retry_on_the_live_connection(start_broker) -> None:
    """MQTT-4.3.3-1: once the client PUBRECed a QoS 2 message, the server sends it PUBREL
    and never that PUBLISH again; a slow PUBCOMP is waited for on the live connection, with
    no retry (a clean session, whose cursor moves on at PUBCOMP)."""
    raw, first = _pubreced(start_broker(FAST_RETRY), "rr", clean=True)
    time.sleep(1)  # three retry periods
    _nothing_more(raw)
    raw.send(PubComp(first.packet_id))
    _nothing_more(raw)


def test_overlapping_subscriptions_copies_keep_their_own_packet_ids(start_broker) -> None:
    """One client, a plain and a shared subscription both matching, QoS 2: each copy has a
    packet id of its own, kept (PUBREL once PUBRECed, never the PUBLISH again) for a
    persistent session through a SIGKILL and restart of the broker."""
    b = start_broker(FAST_RETRY)
    raw, first = _overlapping(b, "ov", clean=False)
    ids: dict[bytes, set[int]] = {}
    for m in first:
        ids.setdefault(m.payload, set()).add(m.packet_id)
    assert [len(v) for v in ids.values()] == [2, 2, 2], ids
    raw.close()
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b = start_broker(FAST_RETRY, data_dir=b.data_dir)
    raw = Raw(b.mqtt_port)
    assert raw.connect("ov-1", clean=False) == ConnAck(True, 0)
    after = _publishes(raw, 6)
    assert all(m.packet_id in ids[m.payload] and m.dup for m in after), (ids, after)
    _complete(raw, {m.packet_id for m in after}, answers=1)


def test_overlapping_copies_of_a_clean_session_are_pubreled_once(start_broker) -> None:
    """The same in a clean session, whose cursors move on at PUBCOMP: once PUBRECed, each
    copy gets its PUBREL under its own id, never the PUBLISH again (MQTT-4.3.3), and no
    retry while the connection is up."""
    raw, first = _overlapping(start_broker(FAST_RETRY), "ovc", clean=True)
    assert len({m.packet_id for m in first}) == 6
    _complete(raw, {m.packet_id for m in first}, answers=1)


def _complete(raw: Raw, owed: set[int], answers: int, retried: int | None = None) -> None:
    """PUBREC each of ``owed``; expect a PUBREL for each and ``answers`` for ``retried`` of
    them (all: the answer, then retries), a PUBLISH retry only if it crossed our PUBREC;
    then PUBCOMP them all."""
    for pid in owed:
        raw.send(PubRec(pid))
    rels: dict[int, int] = {}
    retried = len(owed) if retried is None else retried
    while (len(rels) < len(owed)
           or sum(n >= answers for n in rels.values()) < retried):
        got = raw.recv()
        if isinstance(got, PubRel):
            assert got.packet_id in owed, got
            rels[got.packet_id] = rels.get(got.packet_id, 0) + 1
        else:
            assert isinstance(got, Publish) and got.packet_id in owed and got.dup, got
            assert got.packet_id not in rels, f"PUBLISH again after its PUBREL: {got}"
    for pid in owed:
        raw.send(PubComp(pid))
    _nothing_more(raw)


# retries every 200 ms, given up after 2 deliveries: what a live connection must not see
QUICK_GIVE_UP = {**MQTT, "delivery": {"retry_backoff_ms": 200, "retry_backoff_max_ms": 200,
                                      "max_retries": 2}}


@pytest.mark.parametrize("qos", [1, 2])
def test_an_unacked_delivery_is_not_resent_nor_dead_lettered_while_connected(
        start_broker, qos: int) -> None:
    """A persistent session that stops reading (a device stuck in a flash write) keeps its
    unacknowledged delivery: no copy on the live connection (MQTT 3.1.1 resends at
    reconnect, MQTT 5 forbids more), nothing dead-lettered however long it waits
    (``delivery.max_retries`` is the native consumers'), and it comes again with DUP 1 and
    its packet id when the client reconnects (MQTT-4.4.0-1)."""
    b = start_broker(QUICK_GIVE_UP)
    dead = Paho(b.mqtt_port, "dl-watch")
    assert dead.subscribe(("$dlq/#", 0)) == [0]
    pub = Paho(b.mqtt_port, "dl-pub")
    raw = Raw(b.mqtt_port)
    assert raw.connect("dl-1", clean=False, keepalive=300) == ConnAck(False, 0)
    _subscribe(raw, "dl/t", qos)
    pub.publish("dl/t", "close-valve", qos)
    first = raw.expect(Publish)
    assert (first.payload, first.dup) == (b"close-valve", False)
    time.sleep(1.5)  # 7 retry periods, 3 times max_retries' worth
    _nothing_more(raw)
    dead.sync()
    assert dead.drained() == []
    assert b.metric("blipmq_mqtt_inflight") == 1
    raw.close()  # the device is reset without having read it

    raw = Raw(b.mqtt_port)
    assert raw.connect("dl-1", clean=False) == ConnAck(True, 0)
    again = raw.expect(Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"close-valve", True,
                                                           first.packet_id)
    if qos == 1:
        raw.send(PubAck(again.packet_id))
    else:
        raw.send(PubRec(again.packet_id))
        assert raw.recv() == PubRel(again.packet_id)
        raw.send(PubComp(again.packet_id))
    _nothing_more(raw)
    dead.sync()
    assert dead.drained() == []


def test_a_share_member_that_stops_acking_keeps_its_deliveries_until_it_goes(
        start_broker) -> None:
    """A ``$share`` member that stops acknowledging keeps what it was sent while it is
    connected (no retry hands it to another member); once it goes, the others get it."""
    b = start_broker(QUICK_GIVE_UP)
    pub = Paho(b.mqtt_port, "shs-pub")
    stuck = Raw(b.mqtt_port)
    assert stuck.connect("shs-1", keepalive=300) == ConnAck(False, 0)
    _subscribe(stuck, "$share/g/shs/t", 1)
    pub.publish("shs/t", "one", 1)
    assert stuck.expect(Publish).payload == b"one"
    other = Raw(b.mqtt_port)
    assert other.connect("shs-2") == ConnAck(False, 0)
    _subscribe(other, "$share/g/shs/t", 1)
    time.sleep(1.5)
    _nothing_more(other)
    _nothing_more(stuck)
    stuck.close()
    got = other.expect(Publish)
    assert (got.payload, got.dup) == (b"one", True)
    other.send(PubAck(got.packet_id))
    _nothing_more(other)


@pytest.mark.slow
def test_qos2_through_mosquitto_clients_across_a_sigkill_is_exactly_once(start_broker) -> None:
    """mosquitto_pub -q 2 -l into a persistent mosquitto_sub -q 2, the broker SIGKILLed
    mid-stream and restarted on the same port and data: both clients reconnect by
    themselves, and the subscriber prints every line exactly once."""
    port = free_port()
    config = {"mqtt": {"enabled": True, "port": port}}
    b = start_broker(config)
    sub = mosquitto_spawn("mosquitto_sub", port, "-c", "-i", "x2-sub", "-q", "2", "-t", "x2/#")
    deadline = time.monotonic() + 10
    while b.metric("blipmq_subscriptions") < 1:
        assert time.monotonic() < deadline, "mosquitto_sub did not subscribe"
        time.sleep(0.02)
    n = 5_000
    lines = [f"E{i:06d}" for i in range(n)]
    pub = mosquitto_spawn("mosquitto_pub", port, "-c", "-i", "x2-pub", "-q", "2",
                          "-t", "x2/t", "-l")
    assert pub.stdin is not None and sub.stdout is not None
    pub.stdin.write("".join(x + "\n" for x in lines).encode())
    pub.stdin.close()
    got = [sub.stdout.readline().decode().strip() for _ in range(1_000)]  # mid-stream
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b = start_broker(config, data_dir=b.data_dir)
    assert pub.wait(60) == 0
    # one more line once the publisher is done: it comes after everything the log held
    # before it, duplicates included
    end = mosquitto("mosquitto_pub", port, "-q", "2", "-t", "x2/t", "-m", "END")
    assert end.returncode == 0, end.stderr
    while (line := sub.stdout.readline().decode().strip()) != "END":
        assert line, "mosquitto_sub ended"
        got.append(line)
    assert sorted(got) == lines, (len(got), len(set(got)))


def test_a_pubrel_not_completed_is_sent_again_not_the_publish(start_broker) -> None:
    """MQTT-4.4.0-1: on reconnection the server re-sends the unacknowledged PUBREL packets;
    MQTT-4.3.3-1: once it has sent PUBREL it must not send that PUBLISH again (a client
    that has already handed the message on would see it twice)."""
    b = start_broker(MQTT)
    raw, first = _pubreced(b, "rel", clean=False)
    raw.close()  # no PUBCOMP

    raw = Raw(b.mqtt_port)
    assert raw.connect("rel-1", clean=False) == ConnAck(True, 0)
    assert raw.recv() == PubRel(first.packet_id)
    raw.send(PubComp(first.packet_id))
    _nothing_more(raw)


def test_inbound_qos2_is_stored_once_whatever_the_resends(start_broker) -> None:
    """MQTT-4.3.3-2: until PUBREL, a PUBLISH with the same packet id is answered PUBREC and
    not delivered again; after PUBCOMP the id is free for a new message."""
    b = start_broker(MQTT)
    sub = Paho(b.mqtt_port, "in2-sub")
    assert sub.subscribe(("in2/t", 2)) == [2]
    raw = Raw(b.mqtt_port)
    assert raw.connect("in2-pub") == ConnAck(False, 0)
    raw.send(Publish("in2/t", b"one", 2, False, False, 7))
    assert raw.recv() == PubRec(7)
    for _ in range(3):
        raw.send(Publish("in2/t", b"one", 2, False, True, 7))
        assert raw.recv() == PubRec(7)
    raw.send(PubRel(7))
    assert raw.recv() == PubComp(7)
    raw.send(Publish("in2/t", b"two", 2, False, False, 7))  # the id again: a new message
    assert raw.recv() == PubRec(7)
    raw.send(PubRel(7))
    assert raw.recv() == PubComp(7)
    got = sub.take(2)
    assert [(m.payload, m.qos) for m in got] == [(b"one", 2), (b"two", 2)]
    sub.sync()
    assert sub.drained() == []
    assert b.metric("blipmq_messages_published_total") == 2


def test_a_qos2_id_released_on_a_later_connection_stays_free_on_the_next(start_broker
                                                                         ) -> None:
    """h21 D1: a persistent session's QoS 2 id freed by a PUBREL on the connection after
    the one that PUBLISHed came back as remembered on the connection after that (the
    session kept the first connection's set), so a new message's DUP=1 resend with the id
    was answered PUBREC and PUBCOMP and never logged: lost after its acknowledgement."""
    b = start_broker(MQTT)
    sub = Paho(b.mqtt_port, "stale-sub")
    assert sub.subscribe(("stale/t", 2)) == [2]
    raw = Raw(b.mqtt_port)
    assert raw.connect("stale-pub", clean=False) == ConnAck(False, 0)
    raw.send(Publish("stale/t", b"first", 2, False, False, 5))
    assert raw.recv() == PubRec(5)
    raw.close()  # the link drops before PUBREL
    raw = Raw(b.mqtt_port)
    assert raw.connect("stale-pub", clean=False) == ConnAck(True, 0)
    raw.send(PubRel(5))
    assert raw.recv() == PubComp(5)
    raw.disconnect()
    raw = Raw(b.mqtt_port)
    assert raw.connect("stale-pub", clean=False) == ConnAck(True, 0)
    # a new message with the free id, whose first copy the link lost: sent again, DUP=1
    raw.send(Publish("stale/t", b"second", 2, False, True, 5))
    assert raw.recv() == PubRec(5)
    raw.send(PubRel(5))
    assert raw.recv() == PubComp(5)
    raw.disconnect()
    assert [m.payload for m in sub.take(2)] == [b"first", b"second"]
    assert b.metric("blipmq_messages_published_total") == 2


# ----------------------------------------------------------------------------- 6. takeover


def test_a_second_connection_with_the_same_id_takes_over(start_broker) -> None:
    """MQTT-3.1.4-2: the server disconnects the existing client with that id; the one
    taken over had no chance to DISCONNECT, so its will is published."""
    b = start_broker(MQTT)
    watcher = Paho(b.mqtt_port, "to-watch")
    assert watcher.subscribe(("to/will", 1), ("to/x", 1)) == [1, 1]
    first = Raw(b.mqtt_port)
    assert first.connect("twin", will=Will("to/will", b"first gone", 1, False)).code == 0
    second = Paho(b.mqtt_port, "twin")
    assert first.wait_closed() == []
    m = watcher.get()
    assert (m.topic, m.payload, m.qos) == ("to/will", b"first gone", 1)
    b.wait_metric("blipmq_connections_closed_total", 1, reason="taken_over")
    assert second.subscribe(("to/echo", 1)) == [1]
    second.publish("to/echo", "second is in", 1)
    assert second.get().payload == b"second is in"
    assert not second.disconnected.is_set()

    third = Paho(b.mqtt_port, "twin")  # paho taken over by paho
    second.wait_closed()
    third.publish("to/x", "third", 1)
    m = watcher.get()
    assert (m.topic, m.payload) == ("to/x", b"third")
    watcher.sync()
    assert watcher.drained() == []  # the second had no will


def test_a_takeover_keeps_the_persistent_session(start_broker) -> None:
    """A persistent session taken over goes on in the new connection: its subscriptions,
    and its unacknowledged delivery, sent again with DUP 1."""
    b = start_broker(MQTT)
    pub = Paho(b.mqtt_port, "tk-pub")
    first = Raw(b.mqtt_port)
    assert first.connect("tk-1", clean=False) == ConnAck(False, 0)
    _subscribe(first, "tk/t", 1)
    pub.publish("tk/t", "in flight", 1)
    held = first.expect(Publish)
    assert held.payload == b"in flight"

    second = Raw(b.mqtt_port)
    assert second.connect("tk-1", clean=False) == ConnAck(True, 0)
    assert first.wait_closed() == []
    again = second.expect(Publish)
    assert (again.payload, again.dup) == (b"in flight", True)
    second.send(PubAck(again.packet_id))
    pub.publish("tk/t", "after", 1)
    after = second.expect(Publish)
    assert (after.payload, after.dup) == (b"after", False)
    second.send(PubAck(after.packet_id))
    _nothing_more(second)


def test_an_offline_session_expires(start_broker) -> None:
    """mqtt.session_expiry_ms: a persistent session offline that long is deleted, with its
    durable group; the client then starts afresh (session present 0)."""
    b = start_broker({"mqtt": {"enabled": True, "port": 0, "session_expiry_ms": 300}})
    client = Paho(b.mqtt_port, "exp-1", clean=False)
    assert client.subscribe(("exp/t", 1)) == [1]
    client.disconnect()
    b.wait_log("MQTT session 'exp-1' expired")
    b.wait_metric("blipmq_durable_groups", 0)
    back = Paho(b.mqtt_port, "exp-1", clean=False)
    assert back.session_present is False


def test_offline_sessions_expire_in_turn_whichever_came_back_meanwhile(start_broker) -> None:
    """mqtt.session_expiry_ms: 'early' goes offline, then 'late'; 'early' comes back before
    its time, so the oldest session still offline is 'late', which expires all the same.
    'early', offline again, expires after its own time too, and across a restart (the
    broker looks at its offline sessions only once the oldest of them may have expired)."""
    config = {"mqtt": {"enabled": True, "port": 0, "session_expiry_ms": 1500}}
    b = start_broker(config)
    early = Paho(b.mqtt_port, "early", clean=False)
    late = Paho(b.mqtt_port, "late", clean=False)
    assert early.subscribe(("exp/e", 1)) == [1] and late.subscribe(("exp/l", 1)) == [1]
    early.disconnect()
    late.disconnect()
    early = Paho(b.mqtt_port, "early", clean=False)
    assert early.session_present is True
    b.wait_log("MQTT session 'late' expired")
    assert not any("'early' expired" in line for line in b.log)
    early.disconnect()
    b.stop()
    b = start_broker(config, data_dir=b.data_dir)
    b.wait_log("MQTT session 'early' expired")
    b.wait_metric("blipmq_durable_groups", 0)
    assert Paho(b.mqtt_port, "late", clean=False).session_present is False

def test_ids_of_deliveries_whose_subscription_ended_come_free_on_the_watchdogs_look(
        start_broker) -> None:
    """A client without a keepalive, looked at by the watchdog with nothing in flight, then
    gets two QoS 1 messages, acks neither, and unsubscribes: the core holds those
    deliveries no more, and their packet ids come free within the watchdog's next look or
    two (it looks at a connection every second while it has deliveries in flight, else
    only when its keepalive can have run out: never, without one)."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    raw.connect("unsub-ids", keepalive=0)
    _subscribe(raw, "ids/#", 1)
    time.sleep(1.2)  # the watchdog looks at it with nothing in flight (once a second)
    sender = Raw(b.mqtt_port)
    sender.connect("unsub-ids-sender")
    for pid in (1, 2):
        sender.send(Publish("ids/a", b"%d" % pid, 1, packet_id=pid))
        assert sender.expect(PubAck) == PubAck(pid)
    sender.disconnect()
    assert [raw.expect(Publish).payload for _ in range(2)] == [b"1", b"2"]
    assert b.metric("blipmq_mqtt_inflight") == 2
    raw.send(Unsubscribe(2, ("ids/#",)))
    assert raw.expect(UnsubAck) == UnsubAck(2)
    b.wait_metric("blipmq_mqtt_inflight", 0, timeout=5)
    raw.close()

def test_an_expired_session_takes_the_share_groups_nobody_else_belongs_to(start_broker
                                                                         ) -> None:
    """A persistent session with QoS 1 shares expires: a share group nobody else belongs
    to goes with its backlog (it stayed for good); one another session still shares
    stays."""
    b = start_broker({"mqtt": {"enabled": True, "port": 0, "session_expiry_ms": 1500}})
    assert b.mqtt_port is not None
    gone = Raw(b.mqtt_port)
    gone.connect("exp-share", clean=False)
    gone.send(Subscribe(1, (("own/#", 1), ("$share/alone/sx/#", 1),
                            ("$share/both/sx/#", 1))))
    assert gone.expect(SubAck) == SubAck(1, (1, 1, 1))
    gone.disconnect()
    other = Paho(b.mqtt_port, "stays", clean=False)
    assert other.subscribe(("$share/both/sx/#", 1)) == [1]  # and stays connected
    for n in range(3):
        assert b.cli("pub", "sx/t", f"m{n}", "-q", "1").returncode == 0
    b.wait_log("MQTT session 'exp-share' expired")

    def groups() -> list[str]:
        res = b.cli("groups", "--json")
        assert res.returncode == 0, res.stderr
        return sorted(g["group"] for g in json.loads(res.stdout)["groups"])

    deadline = time.monotonic() + 10
    while groups() != ["both"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert groups() == ["both"]
    other.disconnect()


# ------------------------------------------------------------------------ 10, 11. SIGKILL


@pytest.mark.slow
def test_3000_qos1_messages_to_an_offline_session_survive_sigkill(start_broker) -> None:
    """Every QoS 1 message PUBACKed to mosquitto_pub is delivered to the persistent
    session after the broker is SIGKILLed and restarted on the same data."""
    b = start_broker(MQTT)
    client = Paho(b.mqtt_port, "sk-1", clean=False)
    assert client.subscribe(("sk/t", 1)) == [1]
    client.disconnect()
    n = 3000
    lines = [f"reading {i:05d}" for i in range(n)]
    res = mosquitto("mosquitto_pub", b.mqtt_port, "-i", "sk-pub", "-q", "1", "-t", "sk/t",
                    "-l", input="".join(x + "\n" for x in lines).encode(), timeout=60)
    assert res.returncode == 0, res.stderr
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    back = Paho(b2.mqtt_port, "sk-1", clean=False)
    assert back.session_present is True
    got = back.take(n, timeout=30)
    assert [m.payload.decode() for m in got] == lines
    assert {m.qos for m in got} == {1}
    back.sync()
    assert back.drained() == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_an_unacked_delivery_the_size_cap_removed_is_counted_when_a_restart_loses_it(
        start_broker, sig: signal.Signals) -> None:
    """An offline persistent session's delivery, sent and never PUBACKed, whose segment
    the size cap (wal.retention_bytes) removed, is still in memory and would be sent again;
    a restart (SIGKILL or SIGTERM) loses it. That loss is counted and logged like the size
    cap's others (blipmq_group_skipped_total and one warning for the group), once: not
    again at the next restart."""
    config = SMALL_LOG
    group = {"filter": "d7/#", "group": group_name("d7-1")}
    b = start_broker(config)
    raw = Raw(b.mqtt_port)
    assert raw.connect("d7-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "d7/#", 1)
    Paho(b.mqtt_port, "d7-pub").publish("d7/alarm", "important", 1)
    assert raw.expect(Publish).payload == b"important"  # never PUBACKed
    raw.close()
    # other topics push the log past the cap: the segment holding it (the first) goes. In
    # chunks of ~18 kB, each confirmed before the next: a flood of more than the cap within
    # one maintenance round would take the segment the round carried the session into too
    first = b.data_dir / "wal" / "00000000000000000001.seg"
    assert first.exists()
    deadline = time.monotonic() + 20
    while first.exists():
        assert time.monotonic() < deadline, "the size cap removed nothing"
        assert b.shell("seq -f '%080g' 1 150 | blipmq pub noise --qos 1 --lines -"
                       ).returncode == 0
    # in memory: not lost yet, and nothing else of its topics was skipped (the noise is
    # other topics')
    assert b.metric("blipmq_group_in_flight", **group) == 1
    assert b.metric("blipmq_group_skipped_total", **group) == 0
    assert b.stop(sig) == (-sig if sig == signal.SIGKILL else 0)

    b2 = start_broker(config, data_dir=b.data_dir)
    assert b2.metric("blipmq_group_skipped_total", **group) == 1
    assert b2.metric("blipmq_group_in_flight", **group) == 0
    lost = [line for line in b2.log if "before the restart" in line]
    assert len(lost) == 1 and "WARNING" in lost[0] and group["group"] in lost[0], b2.log
    raw = Raw(b2.mqtt_port)
    assert raw.connect("d7-1", clean=False) == ConnAck(True, 0)
    _nothing_more(raw)
    raw.close()
    assert b2.stop() == 0  # with the checkpoint written at the start, that says so

    b3 = start_broker(config, data_dir=b.data_dir)
    assert b3.metric("blipmq_group_skipped_total", **group) == 0
    assert not any("before the restart" in line for line in b3.log), b3.log


def test_inbound_qos2_packet_ids_survive_sigkill(start_broker) -> None:
    """MQTT-4.3.3-2 across a crash: the packet id of a QoS 2 PUBLISH that got PUBREC is
    remembered until PUBREL even through SIGKILL, so the client's resend (DUP 1, same id)
    after reconnecting is answered PUBREC and not stored a second time."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("crash-q2", clean=False) == ConnAck(False, 0)
    raw.send(Publish("q2k/t", b"exactly once", 2, False, False, 7))
    assert raw.recv() == PubRec(7)
    raw.close()
    raw = Raw(b.mqtt_port)  # a reconnection first: the id is still remembered
    assert raw.connect("crash-q2", clean=False) == ConnAck(True, 0)
    raw.send(Publish("q2k/t", b"exactly once", 2, False, True, 7))
    assert raw.recv() == PubRec(7)
    assert b.metric("blipmq_messages_published_total") == 1
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    logged = _resent_after_sigkill(start_broker, b, "crash-q2", "q2k/t", b"exactly once", 7)
    assert logged == b"exactly once\n"


def _resent_after_sigkill(start_broker, b, client_id: str, topic: str, payload: bytes,
                          pid: int) -> bytes:
    """``b`` was SIGKILLed with the PUBREL of ``client_id``'s QoS 2 PUBLISH ``pid`` owed:
    the client sends it again (DUP 1) to a broker restarted on the same data, gets PUBREC,
    PUBRELs it, and nothing is published again; what the log holds on ``topic``."""
    b2 = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect(client_id, clean=False) == ConnAck(True, 0)
    raw.send(Publish(topic, payload, 2, False, True, pid))
    assert raw.recv() == PubRec(pid)
    raw.send(PubRel(pid))
    assert raw.recv() == PubComp(pid)
    raw.disconnect()
    assert b2.metric("blipmq_messages_published_total") == 0
    logged = b2.cli("sub", topic, "--from", "earliest", "--until-end")
    assert logged.returncode == 0, logged.stderr
    return logged.stdout


def test_a_new_qos2_publish_reusing_a_remembered_packet_id_is_delivered(start_broker
                                                                        ) -> None:
    """MQTT-3.3.1-1: a resend carries DUP 1, so a QoS 2 PUBLISH with DUP 0 whose packet id
    is still remembered (no PUBREL came) is a new message: a device that rebooted and lost
    its state. It is logged and delivered once; the id then stands for it, through a
    resend (DUP 1), a SIGKILL of the broker and the resend after it, until its PUBREL."""
    b = start_broker(MQTT)
    sub = Paho(b.mqtt_port, "reuse-sub")
    assert sub.subscribe(("reuse/t", 2)) == [2]
    raw = Raw(b.mqtt_port)
    assert raw.connect("reuse-q2", clean=False) == ConnAck(False, 0)
    raw.send(Publish("reuse/t", b"reading-A", 2, False, False, 5))
    assert raw.recv() == PubRec(5)
    raw.close()  # the device reboots before PUBREL and forgets everything

    raw = Raw(b.mqtt_port)
    assert raw.connect("reuse-q2", clean=False) == ConnAck(True, 0)
    raw.send(Publish("reuse/t", b"reading-B", 2, False, False, 5))
    assert raw.recv() == PubRec(5)
    raw.send(Publish("reuse/t", b"reading-B", 2, False, True, 5))  # a resend: not again
    assert raw.recv() == PubRec(5)
    got = sub.take(2)
    assert [(m.payload, m.qos) for m in got] == [(b"reading-A", 2), (b"reading-B", 2)]
    sub.sync()
    assert sub.drained() == []
    assert b.metric("blipmq_messages_published_total") == 2
    line = b.wait_log("used again")
    assert "'reuse-q2'" in line and "packet id 5" in line, line
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL  # PUBREL not sent yet
    raw.close()

    logged = _resent_after_sigkill(start_broker, b, "reuse-q2", "reuse/t", b"reading-B", 5)
    assert logged == b"reading-A\nreading-B\n"


def _qos2(raw: Raw, topic: str, pids: Iterable[int], dup: bool = False,
          text: str = "m") -> None:
    """QoS 2 PUBLISHes of ``text`` + packet id under these ids, then each one's PUBREC."""
    pids = list(pids)
    raw.send(*(Publish(topic, f"{text}{pid}".encode(), 2, False, dup, pid) for pid in pids))
    for pid in pids:
        assert raw.recv() == PubRec(pid)


def _release(raw: Raw, *pids: int) -> None:
    raw.send(*(PubRel(pid) for pid in pids))
    for pid in pids:
        assert raw.recv() == PubComp(pid)


def _past_retention(b) -> None:
    """Noise, in chunks, until the size cap (``SMALL_LOG``) deleted every segment the log
    had: the STATE records of a session were in them."""
    wal = b.data_dir / "wal"
    first = {p.name for p in wal.glob("*.seg")}
    deadline = time.monotonic() + 30
    while first & {p.name for p in wal.glob("*.seg")}:
        assert time.monotonic() < deadline, "the size cap removed nothing"
        assert b.shell("seq -f '%080g' 1 150 | blipmq pub noise --qos 1 --lines -"
                       ).returncode == 0


def test_qos2_ids_awaiting_pubrel_cost_the_log_a_few_bytes_each(start_broker) -> None:
    """h21 D3: each QoS 2 PUBLISH of a persistent session rewrote the whole set of its
    packet ids awaiting PUBREL in one STATE record, so a client that never PUBRELs made
    the N-th one-byte publish write about 2N bytes (10,000 of them: 100 MB of log), and
    with that log retention's size cap took other sessions' backlogs. A publish writes
    its message and its id's block of 64 ids: a few bytes, however many ids wait."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("nopubrel", clean=False) == ConnAck(False, 0)
    before = b.metric("blipmq_wal_bytes_total")
    n = 3000
    _qos2(raw, "np/t", range(1, n + 1), text="p")  # one-byte payloads, not a PUBREL yet
    per_publish = (b.metric("blipmq_wal_bytes_total") - before) / n
    assert per_publish < 300, per_publish  # about 100; 3,088 before
    _release(raw, *range(1, n + 1))
    per_release = (b.metric("blipmq_wal_bytes_total") - before) / n - per_publish
    assert per_release < 100, per_release


def test_inbound_qos2_ids_outlive_retention_and_sigkill_and_so_do_their_releases(
        start_broker) -> None:
    """MQTT-4.3.3-2 through retention and crashes, with a session's ids in several blocks
    (a record per 64 ids): the ids awaiting PUBREL stay remembered (the size cap deleted
    the segments their records were in: the records were carried forward), a resend of
    their messages (DUP 1) is answered PUBREC and not logged again; an id PUBRELed before
    a SIGKILL stays free after it: a new message under it whose first copy the client
    lost, sent again with DUP 1, is logged."""
    config = SMALL_LOG
    b = start_broker(config)
    raw = Raw(b.mqtt_port)
    assert raw.connect("blocks", clean=False) == ConnAck(False, 0)
    _qos2(raw, "blk/t", range(1, 201))  # blocks 0 to 3
    _release(raw, 64, 130)
    raw.close()
    _past_retention(b)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL

    b2 = start_broker(config, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("blocks", clean=False) == ConnAck(True, 0)
    _qos2(raw, "blk/t", (1, 63, 65, 128, 129, 131, 200), dup=True)
    assert b2.metric("blipmq_messages_published_total") == 0
    _qos2(raw, "blk/t", (64, 130), dup=True, text="new ")  # released before the crash
    assert b2.metric("blipmq_messages_published_total") == 2
    _release(raw, 1, 65)
    assert b2.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b3 = start_broker(config, data_dir=b.data_dir)
    raw = Raw(b3.mqtt_port)
    assert raw.connect("blocks", clean=False) == ConnAck(True, 0)
    _qos2(raw, "blk/t", (2, 63, 64, 130, 200), dup=True, text="new ")
    assert b3.metric("blipmq_messages_published_total") == 0
    _qos2(raw, "blk/t", (1, 65), dup=True, text="new ")  # released before the second crash
    assert b3.metric("blipmq_messages_published_total") == 2
    raw.disconnect()
    logged = b3.cli("sub", "blk/t", "--from", "earliest", "--until-end")
    assert logged.returncode == 0, logged.stderr
    assert logged.stdout == b"new 64\nnew 130\nnew 1\nnew 65\n"


def _saved_whole(b, key: bytes, ids: set[int]) -> None:
    """Into the log of ``b`` (stopped): a set of a session's QoS 2 packet ids as the
    versions before the blocks saved it, whole in one record under ``key``."""
    core, log = open_broker(b.data_dir / "wal", LogOptions())
    core.put_state(key, stored_ids(ids), 1)
    commit(log)
    log.close()


def test_inbound_qos2_ids_an_earlier_version_saved_whole_are_kept_and_released(
        start_broker) -> None:
    """Upgrade: before the blocks, a persistent session's inbound QoS 2 ids awaiting
    PUBREL were one record, the whole set (``mqtt/q/<client id>``). A broker started on
    such a log rewrites it as blocks: those ids stay remembered (a resend is not logged
    again) and a PUBREL frees one, also after a SIGKILL. The record holds them all: a
    block of the client's beside it (the start that rewrote it was cut short, or a broker
    of that version ran on the log since) is stale."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("old-q2", clean=False) == ConnAck(False, 0)
    _qos2(raw, "old/t", (7,))  # a block with 7; the record below does not have it
    raw.disconnect()
    assert b.stop() == 0
    _saved_whole(b, qos2_key("old-q2"), {5, 6, 40000})  # what that version remembers

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    b2.wait_log("rewritten in blocks")
    raw = Raw(b2.mqtt_port)
    assert raw.connect("old-q2", clean=False) == ConnAck(True, 0)
    _qos2(raw, "old/t", (5, 6, 40000), dup=True)
    assert b2.metric("blipmq_messages_published_total") == 0
    _release(raw, 5)
    _qos2(raw, "old/t", (7,), dup=True, text="new ")  # not remembered: logged
    assert b2.metric("blipmq_messages_published_total") == 1
    assert b2.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b3 = start_broker(MQTT, data_dir=b.data_dir)
    assert not any("rewritten in blocks" in line for line in b3.log), b3.log
    raw = Raw(b3.mqtt_port)
    assert raw.connect("old-q2", clean=False) == ConnAck(True, 0)
    _qos2(raw, "old/t", (6, 40000, 7), dup=True, text="new ")
    assert b3.metric("blipmq_messages_published_total") == 0
    _qos2(raw, "old/t", (5,), dup=True, text="new ")  # released before the SIGKILL
    assert b3.metric("blipmq_messages_published_total") == 1
    _release(raw, 5, 6, 7, 40000)
    raw.disconnect()
    logged = b3.cli("sub", "old/t", "--from", "earliest", "--until-end")
    assert logged.returncode == 0, logged.stderr
    assert logged.stdout == b"m7\nnew 7\nnew 5\n"


def _owe_pubcomp(raw: Raw, n: int) -> dict[int, bytes]:
    """Read ``n`` QoS 2 deliveries, PUBREC each and read its PUBREL; never a PUBCOMP.
    Returns their packet ids -> payloads."""
    got: dict[int, bytes] = {}
    rels = 0
    while rels < n:
        packet = raw.recv()
        if isinstance(packet, Publish):
            assert packet.qos == 2 and packet.packet_id not in got, packet
            got[packet.packet_id] = packet.payload
            raw.send(PubRec(packet.packet_id))
        else:
            assert isinstance(packet, PubRel) and packet.packet_id in got, packet
            rels += 1
    return got


def _published(b, topic: str, n: int) -> None:
    """``n`` QoS 2 messages to ``topic``, ``1`` to ``n``, from a client of a clean
    session."""
    pub = Raw(b.mqtt_port)
    assert pub.connect(f"{topic}-pub") == ConnAck(False, 0)
    _qos2(pub, topic, range(1, n + 1), text="")
    _release(pub, *range(1, n + 1))
    pub.disconnect()


def _synced(raw: Raw, pid: int = 1) -> None:
    """What ``raw`` sent before is written: a QoS 1 PUBLISH's PUBACK waits for a log
    written after it."""
    raw.send(Publish("sync/t", b"", 1, False, False, pid))
    assert raw.expect(PubAck) == PubAck(pid)


def test_qos2_ids_owed_a_pubcomp_cost_the_log_a_few_bytes_each(start_broker) -> None:
    """Each PUBREC and PUBCOMP of an outbound QoS 2 delivery to a persistent session
    rewrote the whole set of its packet ids owed a PUBCOMP (``mqtt/r/<client id>``), a set
    ``mqtt.max_inflight`` does not bound (the cursor moves on at PUBREC): a client that
    PUBRECs and never PUBCOMPs made the N-th delivery write about 2N bytes. A PUBREC or
    PUBCOMP rewrites its id's block of 64 ids: a few bytes, however many ids are owed."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("nopubcomp", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "npc/t", 2)
    raw.disconnect()
    n = 3000
    _published(b, "npc/t", n)

    before = b.metric("blipmq_wal_bytes_total")
    raw = Raw(b.mqtt_port)
    assert raw.connect("nopubcomp", clean=False) == ConnAck(True, 0)
    got = _owe_pubcomp(raw, n)
    assert sorted(got.values(), key=int) == [b"%d" % i for i in range(1, n + 1)]
    per_message = (b.metric("blipmq_wal_bytes_total") - before) / n
    assert per_message < 300, per_message
    _pubcomp(raw, got)
    per_pubcomp = (b.metric("blipmq_wal_bytes_total") - before) / n - per_message
    assert per_pubcomp < 100, per_pubcomp
    raw.disconnect()
    raw = Raw(b.mqtt_port)
    assert raw.connect("nopubcomp", clean=False) == ConnAck(True, 0)
    _nothing_more(raw)  # no PUBREL owed any more


def _pubrels(raw: Raw, n: int) -> set[int]:
    """The packet ids of the next ``n`` packets, each a PUBREL (what a resumed session is
    owed first: PUBREL again, never the PUBLISH)."""
    got = set()
    for _ in range(n):
        packet = raw.recv()
        assert isinstance(packet, PubRel), packet
        got.add(packet.packet_id)
    return got


def _sigkilled(start_broker, b, raw: Raw, client_id: str, config: dict = MQTT
               ) -> tuple[object, Raw]:
    """``b`` SIGKILLed (``raw`` closed), a broker started on its data, and ``client_id``
    connected to it again: its session is there."""
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()
    b2 = start_broker(config, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect(client_id, clean=False) == ConnAck(True, 0)
    return b2, raw


def _pubcomp(raw: Raw, pids: Iterable[int]) -> None:
    """PUBCOMP these packet ids, and wait until the log holds what they changed."""
    raw.send(*(PubComp(pid) for pid in pids))
    _synced(raw)


def test_outbound_qos2_ids_owed_a_pubcomp_outlive_retention_and_sigkill_and_so_do_their_completions(
        start_broker) -> None:
    """MQTT-4.4.0-1 and MQTT-4.3.3-1 through retention and crashes, with a session's ids
    owed a PUBCOMP in several blocks (a record per 64 ids): after a restart each is sent
    PUBREL again, never its PUBLISH (the size cap deleted the segments their records were
    in: the records were carried forward); an id PUBCOMPed before a SIGKILL is not owed
    after it."""
    config = SMALL_LOG
    b = start_broker(config)
    raw = Raw(b.mqtt_port)
    assert raw.connect("owes", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "ow/t", 2)
    _published(b, "ow/t", 200)
    owed = set(_owe_pubcomp(raw, 200))
    assert len({pid // 64 for pid in owed}) > 2, sorted(owed)  # in several blocks
    done = sorted(owed)[::50]
    _pubcomp(raw, done)
    owed -= set(done)
    _past_retention(b)

    for step in (3, 1):  # a third of what is owed PUBCOMPed, then all the rest
        b, raw = _sigkilled(start_broker, b, raw, "owes", config)
        assert _pubrels(raw, len(owed)) == owed
        _nothing_more(raw)
        done = sorted(owed)[::step]
        _pubcomp(raw, done)
        owed -= set(done)
    assert not owed
    b, raw = _sigkilled(start_broker, b, raw, "owes", config)
    _nothing_more(raw)  # nothing owed, nothing sent again


def test_outbound_qos2_ids_an_earlier_version_saved_whole_are_kept_and_released(
        start_broker) -> None:
    """Upgrade: before the blocks, a persistent session's outbound QoS 2 ids owed a
    PUBCOMP were one record, the whole set (``mqtt/r/<client id>``). A broker started on
    such a log rewrites it as blocks: each id is sent PUBREL again, and a PUBCOMP releases
    it for good, also across a SIGKILL. The record holds them all: a block of the
    client's beside it (the start that rewrote it was cut short, or a broker of that
    version ran on the log since) is stale."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("old-r", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "oldr/t", 2)
    _published(b, "oldr/t", 1)
    stale = set(_owe_pubcomp(raw, 1))  # in a block; the record below does not have it
    old = {5, 6, 40000}
    assert not stale & old
    raw.disconnect()
    assert b.stop() == 0
    _saved_whole(b, pubrel_key("old-r"), old)  # what that version owes

    b = start_broker(MQTT, data_dir=b.data_dir)
    b.wait_log("rewritten in blocks")
    raw = Raw(b.mqtt_port)
    assert raw.connect("old-r", clean=False) == ConnAck(True, 0)
    for done in ((5,), (6, 40000)):
        assert _pubrels(raw, len(old)) == old
        _nothing_more(raw)
        _pubcomp(raw, done)
        old -= set(done)
        b, raw = _sigkilled(start_broker, b, raw, "old-r")
        assert not any("rewritten in blocks" in line for line in b.log), b.log
    _nothing_more(raw)


def test_a_session_owed_65535_pubcomps_waits_for_a_free_packet_id(start_broker) -> None:
    """A client that PUBRECs and never PUBCOMPs takes a packet id per message for good (the
    cursor moved on at PUBREC, ``mqtt.max_inflight`` does not bound them). With all
    65,535 taken, the next delivery raised RuntimeError("no free packet id") in the
    delivery encoding, which ran in whichever task delivered: the subscriber's writer, or
    a publisher's reader. Now the session's QoS 1/2 deliveries wait in the log, said once
    in the log and counted; the connections stay; a PUBCOMP frees an id and they go on."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("full", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "full/t", 2)
    raw.disconnect()
    assert b.stop() == 0
    every = set(range(1, 65536))  # owed a PUBCOMP, as 65,535 PUBRECs had left them
    # saved as the earlier versions did (rewritten in blocks at start): the test runs on
    # those too, and the upgrade is tried with every id
    _saved_whole(b, pubrel_key("full"), every)

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("full", clean=False) == ConnAck(True, 0)
    assert _pubrels(raw, 65535) == every
    pub = Raw(b2.mqtt_port)
    assert pub.connect("full-pub") == ConnAck(False, 0)
    pub.send(*(Publish("full/t", text, 1, False, False, pid)
               for pid, text in enumerate((b"a", b"b", b"c"), 1)))  # one log write
    assert [pub.recv() for _ in range(3)] == [PubAck(1), PubAck(2), PubAck(3)]
    b2.wait_log("all 65,535 packet ids are taken")
    _nothing_more(raw)  # no PUBLISH: it has no packet id to go with
    _nothing_more(pub)
    assert b2.metric("blipmq_mqtt_protocol_errors_total", reason="no_packet_id") == 1
    raw.send(PubComp(777))
    got = []
    for _ in range(3):  # one at a time, under the one id free, in their order
        packet = raw.expect(Publish)
        assert (packet.packet_id, packet.qos) == (777, 1), packet
        got.append(packet.payload)
        raw.send(PubAck(777))
    assert got == [b"a", b"b", b"c"]
    _nothing_more(raw)
    assert sum("packet ids are taken" in line for line in b2.log) == 1, b2.log
    assert not any("Traceback" in line for line in b2.log), b2.log
    b2, raw = _sigkilled(start_broker, b2, raw, "full")
    assert _pubrels(raw, 65534) == every - {777}
    _nothing_more(raw)  # what it PUBACKed does not come again


def test_a_suback_means_the_subscription_survives_sigkill(start_broker) -> None:
    """A persistent session's subscriptions are its state (MQTT-3.1.2-4/5): once SUBACK
    is out, a crash must not lose them, or what is published while the client is away
    goes nowhere (and a client told session present 1 never subscribes again). The broker
    is SIGKILLed the moment the SUBACK arrives."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("suback-k", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "sk2/t", 1)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    Paho(b2.mqtt_port, "sk2-pub").publish("sk2/t", "while away", 1)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("suback-k", clean=False) == ConnAck(True, 0)
    got = raw.expect(Publish)
    assert (got.topic, got.payload, got.qos) == ("sk2/t", b"while away", 1)


def test_an_unsuback_means_the_subscription_is_gone_after_sigkill(start_broker) -> None:
    """MQTT-3.10.4-2 across a crash: once UNSUBACK is out, a restart must not bring the
    subscription back. The broker is SIGKILLed the moment the UNSUBACK arrives."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("unsuback-k", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "uk/t", 1)
    b.wait_metric("blipmq_wal_pending_records", 0)  # the subscription is written
    raw.send(Unsubscribe(2, ("uk/t",)))
    assert raw.recv() == UnsubAck(2)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    Paho(b2.mqtt_port, "uk-pub").publish("uk/t", "unsubscribed", 1)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("unsuback-k", clean=False) == ConnAck(True, 0)
    _nothing_more(raw)


def test_a_clean_connack_means_the_old_session_is_gone_after_sigkill(start_broker) -> None:
    """MQTT-3.1.2-6 across a crash: CONNECT with clean session 1 ends the client id's
    persistent session; once its CONNACK (session present 0) is out, a restart must not
    bring that session back with its subscription and backlog (a later clean session 0
    would get session present 1 and the old messages). The broker is SIGKILLed the moment
    the CONNACK arrives."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("clean-k", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "ck/t", 1)
    raw.disconnect()
    b.wait_metric("blipmq_mqtt_sessions", 1, state="offline")  # stored, not connected
    Paho(b.mqtt_port, "ck-pub").publish("ck/t", "old backlog", 1)  # its backlog
    raw = Raw(b.mqtt_port)
    assert raw.connect("clean-k", clean=True) == ConnAck(False, 0)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("clean-k", clean=False) == ConnAck(False, 0)
    _nothing_more(raw)
    assert b2.metric("blipmq_durable_groups") == 0


def test_a_pubrel_owed_survives_sigkill(start_broker) -> None:
    """MQTT-4.3.3-1 across a crash: after PUBREC the broker owes PUBREL, and only that; a
    restart on the same data sends PUBREL again, never the PUBLISH."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("pubrel-k", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "prk/t", 2)
    Paho(b.mqtt_port, "prk-pub").publish("prk/t", "once", 2)
    first = raw.expect(Publish)
    raw.send(PubRec(first.packet_id))
    assert raw.recv() == PubRel(first.packet_id)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    raw.close()

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b2.mqtt_port)
    assert raw.connect("pubrel-k", clean=False) == ConnAck(True, 0)
    assert raw.recv() == PubRel(first.packet_id)
    raw.send(PubComp(first.packet_id))
    _nothing_more(raw)


@pytest.mark.parametrize("qos", [1, 2])
def test_a_resumed_session_subscribing_again_keeps_its_deliveries_and_acks(
        start_broker, qos: int) -> None:
    """MQTT-3.8.4-3: a SUBSCRIBE to a filter the session has replaces the subscription "but
    the flow of publications MUST NOT be interrupted". Clients (paho, mosquitto_sub -c)
    subscribe again as soon as a resumed session's CONNACK comes, while its backlog is on
    the way: each message comes once, under one packet id, and the acks of the copies sent
    before the SUBSCRIBE count (a message acked is not sent again on the next connect)."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    raw.connect("resub-dev", clean=False)
    _subscribe(raw, "rs/#", qos)
    raw.disconnect()
    pub = Raw(b.mqtt_port)
    pub.connect("resub-pub")
    for i in range(1, 4):
        pub.send(Publish("rs/t", b"m%d" % i, 1, False, False, i))
        assert pub.recv() == PubAck(i)

    def take(raw: Raw, until: bytes) -> list[tuple[bytes, int]]:
        """(payload, packet id) of every PUBLISH up to ``until``'s and the SUBACK, each
        acknowledged."""
        got: list[tuple[bytes, int]] = []
        subacked = False
        while not subacked or not got or got[-1][0] != until:
            p = raw.recv()
            if isinstance(p, SubAck):
                subacked = True
                continue
            if isinstance(p, PubRel):
                raw.send(PubComp(p.packet_id))
                continue
            assert isinstance(p, Publish), p
            got.append((p.payload, p.packet_id))
            raw.send(PubAck(p.packet_id) if p.qos == 1 else PubRec(p.packet_id))
        return got

    raw = Raw(b.mqtt_port)
    assert raw.connect("resub-dev", clean=False).session_present
    first = raw.recv()  # the backlog starts before the client subscribes again
    assert isinstance(first, Publish) and first.payload == b"m1", first
    raw.send(PubAck(first.packet_id) if first.qos == 1 else PubRec(first.packet_id))
    raw.send(Subscribe(2, (("rs/#", qos),)))
    pub.send(Publish("rs/t", b"end-1", 1, False, False, 4))
    assert pub.recv() == PubAck(4)
    got = [(first.payload, first.packet_id), *take(raw, b"end-1")]
    assert [p for p, _ in got] == [b"m1", b"m2", b"m3", b"end-1"], got
    raw.send(PingReq())  # nothing more comes before its answer (PUBRELs owed aside)
    while (p := raw.recv()) != PingResp():
        assert isinstance(p, PubRel), p
        raw.send(PubComp(p.packet_id))
    raw.disconnect()
    raw = Raw(b.mqtt_port)  # all of it was acknowledged: nothing comes again
    assert raw.connect("resub-dev", clean=False).session_present
    raw.send(Subscribe(3, (("rs/#", qos),)))
    pub.send(Publish("rs/t", b"end-2", 1, False, False, 5))
    assert pub.recv() == PubAck(5)
    assert [p for p, _ in take(raw, b"end-2")] == [b"end-2"]
    raw.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("qos", [0, 1])
def test_subscribing_again_sends_the_retained_values_again(start_broker, qos: int) -> None:
    """MQTT-3.8.4-3: when a subscription is replaced by one to the same filter, the
    retained messages it matches are sent again (the subscription itself goes on)."""
    b = start_broker(MQTT)
    pub = Raw(b.mqtt_port)
    pub.connect("ret-pub")
    pub.send(Publish("ra/state", b"on", 1, True, False, 1))
    assert pub.recv() == PubAck(1)
    raw = Raw(b.mqtt_port)
    raw.connect("ret-again")
    for packet_id in (1, 2):
        raw.send(Subscribe(packet_id, (("ra/#", qos),)))
        seen = []
        while len(seen) < 2:
            p = raw.recv()
            seen.append(p)
            if isinstance(p, Publish) and p.qos:
                raw.send(PubAck(p.packet_id))
        sub = [p for p in seen if isinstance(p, SubAck)]
        ret = [p for p in seen if isinstance(p, Publish)]
        assert sub == [SubAck(packet_id, (qos,))], seen
        assert [(p.payload, p.retain) for p in ret] == [(b"on", True)], seen
    _nothing_more(raw)
    raw.disconnect()
    pub.disconnect()


def test_a_qos1_subscription_made_qos0_piles_nothing_up(start_broker) -> None:
    """A persistent session replaces its QoS 1 subscription by a QoS 0 one: the session's
    durable group on it is what delivers at QoS 0 (its backlog kept, MQTT-3.8.4-3), each
    message done as it is sent. It piles nothing up, and sends nothing again once the
    client subscribes at QoS 1 once more (as a group kept beside a QoS 0 queue once did)."""
    b = start_broker(MQTT)
    assert b.mqtt_port is not None
    c = Raw(b.mqtt_port)
    c.connect("downgrade", clean=False)
    c.send(Subscribe(1, (("d/1", 1),)))
    assert c.recv() == SubAck(1, (1,))
    c.send(Subscribe(2, (("d/1", 0),)))
    assert c.recv() == SubAck(2, (0,))
    for n in range(3):
        assert b.cli("pub", "d/1", f"m{n}", "-q", "1").returncode == 0
        packet = c.recv()
        assert isinstance(packet, Publish) and packet.payload == f"m{n}".encode(), packet
    groups = b.cli("groups", "--json")
    assert groups.returncode == 0, groups.stderr
    [group] = [g for g in json.loads(groups.stdout)["groups"] if g["filter"] == "d/1"]
    assert (group["group"], group["backlog"], group["in_flight"]) == (
        group_name("downgrade"), 0, 0)  # nothing piled up
    c.send(Subscribe(3, (("d/1", 1),)))
    assert c.recv() == SubAck(3, (1,))
    assert b.cli("pub", "d/1", "new", "-q", "1").returncode == 0
    packet = c.recv()
    assert isinstance(packet, Publish) and packet.payload == b"new", packet  # not m0 again


# ------------------------------------------- overlapping subscriptions whose sender changes

OVERLAP_N = 100  # more than mqtt.max_inflight (64): the rest waits in the cursors


def _overlap_publish(b, name: str) -> None:
    pub = Paho(b.mqtt_port, f"{name}-pub")
    for i in range(OVERLAP_N):
        pub.publish(f"{name}/x", f"{i}", 1)


def _unacked(raw: Raw) -> list[Publish]:
    """The deliveries that come before a PINGRESP, not acknowledged."""
    raw.send(PingReq())
    got: list[Publish] = []
    while not isinstance(packet := raw.recv(), PingResp):  # bounded by recv's timeout
        assert isinstance(packet, Publish), packet
        got.append(packet)
    return got


def _ack_all(raw: Raw, got: list[Publish], quiet: float = 1.5) -> set[bytes]:
    """Acknowledge ``got`` and everything that comes after it (PUBACK; PUBREC and PUBCOMP at
    QoS 2) until nothing came for ``quiet`` s; the payloads seen."""
    seen: set[bytes] = set()
    pending = list(got)
    while True:  # bounded: each turn waits at most ``quiet`` for a packet
        for m in pending:
            seen.add(m.payload)
            raw.send(PubRec(m.packet_id) if m.qos == 2 else PubAck(m.packet_id))
        pending = []
        try:
            packet = raw.recv(quiet)
        except AssertionError:
            return seen
        if isinstance(packet, Publish):
            pending.append(packet)
        elif isinstance(packet, PubRel):
            raw.send(PubComp(packet.packet_id))


@pytest.mark.parametrize("then", ["reconnect", "restart"])
def test_overlapping_subscriptions_lose_nothing_when_a_resubscribe_changes_the_sender(
        start_broker, then: str) -> None:
    """Two overlapping QoS 1 subscriptions of a persistent session deliver one copy, from
    one of them; the other's copies were acked as soon as they were passed over. A
    re-SUBSCRIBE (as resuming clients do) changed which one sends after a reconnect or a
    restart, and all 100 messages were lost (64 sent, none acked): MQTT-4.4.0-1, and
    MQTT-3.1.2-5 (QoS 1 messages of a persistent session are kept)."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("flip-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "flip/#", 1, 1)
    _subscribe(raw, "flip/+", 1, 2)
    _subscribe(raw, "flip/#", 1, 3)
    _overlap_publish(b, "flip")
    first = _unacked(raw)
    assert 0 < len(first) < OVERLAP_N and len({m.payload for m in first}) == len(first)
    raw.close()
    if then == "restart":
        assert b.stop() == 0
        b = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b.mqtt_port)
    assert raw.connect("flip-1", clean=False) == ConnAck(True, 0)
    seen = _ack_all(raw, [])
    assert seen == {f"{i}".encode() for i in range(OVERLAP_N)}, (
        f"{OVERLAP_N - len(seen)} never delivered")


@pytest.mark.parametrize("change", ["upgrade", "unsubscribe"])
def test_overlapping_subscriptions_lose_nothing_when_the_sender_is_replaced_or_ends(
        start_broker, change: str) -> None:
    """The same within one connection of a clean session: the other subscription raised to
    QoS 2 (it sends from then on), or the sending one unsubscribed while 64 deliveries wait
    for their PUBACK: the 36 messages past that window were never delivered either way,
    as the other subscription had acked its copies when it passed them over."""
    b = start_broker(FAST_RETRY)
    raw = Raw(b.mqtt_port)
    assert raw.connect("chg-1", clean=True) == ConnAck(False, 0)
    _subscribe(raw, "chg/#", 1, 1)
    _subscribe(raw, "chg/+", 1, 2)
    _overlap_publish(b, "chg")
    first = _unacked(raw)
    assert 0 < len(first) < OVERLAP_N
    if change == "upgrade":
        raw.send(Subscribe(3, (("chg/+", 2),)))
    else:
        raw.send(Unsubscribe(3, ("chg/#",)))
    later: list[Publish] = []
    while not isinstance(packet := raw.recv(), SubAck | UnsubAck):  # bounded by recv
        assert isinstance(packet, Publish), packet
        later.append(packet)
    seen = _ack_all(raw, first + later)
    assert seen == {f"{i}".encode() for i in range(OVERLAP_N)}, (
        f"{OVERLAP_N - len(seen)} never delivered")


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "persistent"])
def test_a_pubreced_message_is_not_sent_again_by_the_other_subscription(
        start_broker, clean: bool) -> None:
    """h21 D2: ``o/+`` (QoS 2) sends a message ``o/#`` (QoS 1) matches too; the client
    PUBRECs it, then UNSUBSCRIBEs ``o/+`` before its PUBCOMP. A clean session's ``o/#``
    sent it again (QoS 1, DUP): its kept-back copy was let go only at PUBCOMP, and the
    UNSUBSCRIBE handed it back. The client has a message once it PUBRECed it."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("ovq2", clean=clean) == ConnAck(False, 0)
    raw.send(Subscribe(1, (("o/+", 2), ("o/#", 1))))
    assert raw.expect(SubAck) == SubAck(1, (2, 1))
    pub = Paho(b.mqtt_port, "ovq2-pub")
    pub.publish("o/a", "only once", 2)
    first = raw.expect(Publish)
    assert (first.payload, first.qos) == (b"only once", 2)
    raw.send(PubRec(first.packet_id))
    assert raw.recv() == PubRel(first.packet_id)
    raw.send(Unsubscribe(2, ("o/+",)), PubComp(first.packet_id))
    assert raw.expect(UnsubAck) == UnsubAck(2)
    pub.publish("o/b", "after", 1)  # o/#'s next: a copy sent again would come before it
    packet = raw.expect(Publish)
    assert packet.payload == b"after", f"sent again: {packet!r}"
    raw.send(PubAck(packet.packet_id))
    _nothing_more(raw)


def test_the_wrong_acknowledgement_of_a_delivery_is_ignored(start_broker) -> None:
    """h21 D6: a PUBREC for a QoS 1 delivery was taken as its ack and turned it into a
    QoS 2 exchange: a PUBREL, owed across reconnects, and the delivery counted in flight
    until a PUBCOMP. Now it is ignored (as mosquitto does), and so is a PUBACK for a QoS 2
    delivery: each stays in flight until its own acknowledgement."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("wrongack", clean=False) == ConnAck(False, 0)
    raw.send(Subscribe(1, (("wa/1", 1), ("wa/2", 2))))
    assert raw.expect(SubAck) == SubAck(1, (1, 2))
    assert b.cli("pub", "wa/1", "one", "-q", "1").returncode == 0
    one = raw.expect(Publish)
    assert one.qos == 1
    raw.send(PubRec(one.packet_id))
    _nothing_more(raw)  # no PUBREL
    Paho(b.mqtt_port, "wrongack-pub").publish("wa/2", "two", 2)
    two = raw.expect(Publish)
    assert two.qos == 2
    raw.send(PubAck(two.packet_id))
    _nothing_more(raw)
    assert b.metric("blipmq_mqtt_inflight") == 2
    raw.send(PubAck(one.packet_id), PubRec(two.packet_id))
    assert raw.recv() == PubRel(two.packet_id)
    raw.send(PubComp(two.packet_id))
    _nothing_more(raw)
    assert b.metric("blipmq_mqtt_inflight") == 0
    raw.disconnect()
    back = Raw(b.mqtt_port)
    assert back.connect("wrongack", clean=False) == ConnAck(True, 0)
    _nothing_more(back)  # nothing owed: no PUBREL, no PUBLISH


def test_a_share_cannot_join_a_persistent_sessions_group(start_broker) -> None:
    """``$share/mqtt.<hash of a client id>/...`` names another client's persistent-session
    group: it is a share of its own, and takes none of that session's queued messages
    (it drained them before)."""
    b = start_broker(MQTT)
    assert b.mqtt_port is not None
    victim = Raw(b.mqtt_port)
    victim.connect("victim", clean=False)
    _subscribe(victim, "vs/#", 1)
    victim.disconnect()
    for n in range(5):
        assert b.cli("pub", "vs/x", f"m{n}", "-q", "1").returncode == 0
    thief = Raw(b.mqtt_port)
    thief.connect("thief")
    _subscribe(thief, f"$share/{group_name('victim')}/vs/#", 1)
    _nothing_more(thief)
    thief.disconnect()
    back = Raw(b.mqtt_port)
    assert back.connect("victim", clean=False).session_present
    got = []
    for _ in range(5):
        packet = back.expect(Publish)
        got.append(packet.payload)
        back.send(PubAck(packet.packet_id))
    assert got == [f"m{n}".encode() for n in range(5)]



@pytest.mark.slow
def test_overlapping_subscriptions_far_apart_deliver_one_copy_each(start_broker) -> None:
    """A persistent session subscribed to ``lag/#`` (QoS 2) and ``+/x`` (QoS 1) comes back
    to 6,000 messages on ``other/x`` (``+/x``'s alone) then 6,000 on ``lag/x`` (both's):
    ``+/x`` reaches its copies of ``lag/x`` long after ``lag/#`` sent and settled them.
    Each message comes once: the copies follow the sending subscription's cursor (a
    memory of the last 8,192 acks forgot them, and 2,217 of 5,000 came twice)."""
    n = 6000
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("far-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "lag/#", 2, 1)
    _subscribe(raw, "+/x", 1, 2)
    raw.close()
    lines = b"".join(b"%d\n" % i for i in range(n))
    for topic in ("other/x", "lag/x"):
        assert b.cli("pub", topic, "-", "--lines", "--qos", "1", input=lines).returncode == 0
    raw = Raw(b.mqtt_port)
    assert raw.connect("far-1", clean=False) == ConnAck(True, 0)
    seen: dict[tuple[str, bytes], int] = {}
    while len(seen) < 2 * n:  # bounded by recv's timeout
        packet = raw.recv()
        if isinstance(packet, PubRel):
            raw.send(PubComp(packet.packet_id))
            continue
        assert isinstance(packet, Publish), packet
        key = (packet.topic, packet.payload)
        seen[key] = seen.get(key, 0) + 1
        raw.send(PubRec(packet.packet_id) if packet.qos == 2 else PubAck(packet.packet_id))
    raw.send(PingReq())  # and whatever else came before its answer
    while not isinstance(packet := raw.recv(), PingResp):  # bounded by recv's timeout
        if isinstance(packet, Publish):
            key = (packet.topic, packet.payload)
            seen[key] = seen.get(key, 0) + 1
    twice = sum(1 for count in seen.values() if count > 1)
    assert twice == 0 and len(seen) == 2 * n, f"{twice} came twice, {len(seen)} distinct"


def test_no_native_client_joins_or_deletes_a_persistent_sessions_group(start_broker) -> None:
    """A persistent session's QoS 1 subscriptions are the durable group
    ``mqtt.<hash of its client id>``: ``blipmq sub --group`` with that name took the
    session's queued messages (without authentication, or within one key), and ``blipmq
    unsub --group`` could end it; and a native group so named was deleted at every start
    as an orphan. Names starting with ``mqtt.`` are refused to native clients."""
    from blipmq_server.mqtt.state import group_name

    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("victim", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "jobs/v", 1)
    raw.close()
    assert b.cli("pub", "jobs/v", "queued", "--qos", "1").returncode == 0
    group = group_name("victim")
    joined = b.cli("sub", "jobs/v", "--group", group, "-q", "1", "-C", "1", "-W", "2")
    assert joined.returncode != 0 and b"MQTT persistent sessions" in joined.stderr, joined
    assert joined.stdout == b""
    deleted = b.cli("unsub", "jobs/v", "--group", group)
    assert deleted.returncode != 0 and b"MQTT persistent sessions" in deleted.stderr, deleted
    raw = Raw(b.mqtt_port)
    assert raw.connect("victim", clean=False) == ConnAck(True, 0)
    got = raw.expect(Publish)
    assert got.payload == b"queued"


def test_a_qos2_share_delivery_never_goes_to_a_second_member(start_broker) -> None:
    """MQTT-4.8.2-4, -5 (MQTT 5's rule for shared subscriptions; 3.1.1 has none): a QoS 2
    message a member has PUBRECed never goes to another member when it drops off (a clean
    session's cursor moves on at PUBREC too), and one a persistent member had not PUBRECed
    waits for that member's session: it comes again to it, DUP and with its packet id, on
    its return, not to the member that is there meanwhile."""
    b = start_broker(MQTT)
    assert b.mqtt_port is not None
    pub = Raw(b.mqtt_port)
    pub.connect("q2s-pub")

    def publish(topic: str, payload: bytes, pid: int) -> None:
        pub.send(Publish(topic, payload, 2, packet_id=pid))
        pub.expect(PubRec)
        pub.send(PubRel(pid))
        pub.expect(PubComp)

    def online(n: int) -> None:
        b.wait_metric("blipmq_mqtt_sessions", n, state="online")

    for clean, pubrec in ((True, True), (False, False)):
        share = f"$share/q2{int(clean)}/q2{int(clean)}/#"
        topic = f"q2{int(clean)}/x"
        m1 = Raw(b.mqtt_port)
        m1.connect(f"q2-m1-{clean}", clean=clean)
        _subscribe(m1, share, 2)
        publish(topic, b"once", 1)
        first = m1.expect(Publish)
        assert (first.payload, first.qos) == (b"once", 2)
        if pubrec:
            m1.send(PubRec(first.packet_id))
            assert m1.expect(PubRel) == PubRel(first.packet_id)
        m1.close()  # no PUBCOMP, no DISCONNECT
        online(1)
        m2 = Raw(b.mqtt_port)
        m2.connect(f"q2-m2-{clean}")
        _subscribe(m2, share, 2)
        _nothing_more(m2)  # before: the message again, DUP, to the second member
        publish(topic, b"next", 2)  # m2 is a member: it takes the new ones
        nxt = m2.expect(Publish)
        assert nxt.payload == b"next"
        m2.send(PubRec(nxt.packet_id))
        m2.expect(PubRel)
        m2.send(PubComp(nxt.packet_id))
        if not clean:
            back = Raw(b.mqtt_port)
            assert back.connect(f"q2-m1-{clean}", clean=False).session_present
            again = back.expect(Publish)
            assert (again.payload, again.dup, again.packet_id) == (
                b"once", True, first.packet_id)
            back.send(PubRec(again.packet_id))
            assert back.expect(PubRel) == PubRel(again.packet_id)
            back.send(PubComp(again.packet_id))
            _nothing_more(back)
            back.disconnect()
        _nothing_more(m2)
        m2.disconnect()
        online(1)
    pub.disconnect()


def test_a_qos0_resubscribe_of_a_persistent_session_keeps_its_backlog(start_broker) -> None:
    """MQTT-3.8.4-3: a SUBSCRIBE to a filter the session has replaces the subscription "but
    the flow of publications MUST NOT be interrupted": a persistent QoS 1 session that
    subscribes again at QoS 0 gets its whole queued backlog, at QoS 0 once the in-flight
    window is out (before: the window, 64 of 200, and the rest dropped, uncounted), and
    its durable group goes on queueing for it while it is away."""
    b = start_broker(MQTT)
    assert b.mqtt_port is not None
    client = Raw(b.mqtt_port)
    client.connect("dg-1", clean=False)
    _subscribe(client, "dg/#", 1)
    client.disconnect()
    pub = Raw(b.mqtt_port)
    pub.connect("dg-pub")
    n = 200
    for i in range(n):
        pub.send(Publish("dg/x", f"m{i}".encode(), 1, packet_id=i + 1))
    for _ in range(n):
        pub.expect(PubAck)
    back = Raw(b.mqtt_port)
    assert back.connect("dg-1", clean=False).session_present
    back.send(Subscribe(2, (("dg/#", 0),)))
    got: list[bytes] = []
    while True:
        packet = back.recv()
        if isinstance(packet, SubAck):
            assert packet == SubAck(2, (0,))
            continue
        assert isinstance(packet, Publish), packet
        got.append(packet.payload)
        if packet.qos:
            back.send(PubAck(packet.packet_id))
        if len(set(got)) == n:
            break
    assert sorted(set(got)) == sorted(f"m{i}".encode() for i in range(n))
    _nothing_more(back)
    back.disconnect()
    pub.send(Publish("dg/x", b"while away", 1, packet_id=1))
    pub.expect(PubAck)
    again = Raw(b.mqtt_port)
    assert again.connect("dg-1", clean=False).session_present
    packet = again.expect(Publish)
    assert (packet.payload, packet.qos) == (b"while away", 0)
    _nothing_more(again)
    again.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("then", ["reconnect", "restart"])
def test_overlapping_live_and_log_subscriptions_at_qos0_lose_nothing_offline(
        start_broker, then: str) -> None:
    """A persistent session with ``+/x`` at QoS 0 (live: nothing waits for it offline) and
    ``a/+`` made QoS 0 after QoS 2 (its durable group goes on, at QoS 0): messages to
    ``a/x`` published while the client is away were owned by the older live subscription,
    which never had them, and the log's copies were acked as if sent: all 20 lost. At the
    same QoS a log cursor sends before a live queue."""
    b = start_broker(MQTT)
    raw = Raw(b.mqtt_port)
    assert raw.connect("mix-1", clean=False) == ConnAck(False, 0)
    _subscribe(raw, "+/x", 0, 1)
    _subscribe(raw, "a/+", 2, 2)
    _subscribe(raw, "a/+", 0, 3)
    raw.close()
    lines = b"".join(b"off %d\n" % i for i in range(20))
    assert b.cli("pub", "a/x", "-", "--lines", "--qos", "1", input=lines).returncode == 0
    if then == "restart":
        assert b.stop() == 0
        b = start_broker(MQTT, data_dir=b.data_dir)
    raw = Raw(b.mqtt_port)
    assert raw.connect("mix-1", clean=False) == ConnAck(True, 0)
    got = [raw.expect(Publish) for _ in range(20)]
    assert [m.payload for m in got] == [b"off %d" % i for i in range(20)]
    _nothing_more(raw)
