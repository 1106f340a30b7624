"""What one client may make the broker hold: subscriptions per connection
(``server.max_subscriptions``), durable groups in all (``queues.max_durable_groups``),
persistent MQTT sessions in all (``mqtt.max_sessions``), and each key's share of durable
groups, sessions and retained values (docs/SECURITY.md, "Shares"), through the real broker
process, over MQTT and the native protocol. Without them a client subscribing to distinct
filters grew the broker by about 3 KB each (630 MB for 200,000); one restricted key made
100,000 durable groups in 18 s, 60,000 persistent sessions at 1,750/s, or filled the retained
values in 0.1 s, and every other key, admin included, was refused them from then on."""

from __future__ import annotations

import hashlib
import secrets

import pytest
from mqttpeer import Raw

from blipmq_cli import BrokerError, Client
from blipmq_server.mqtt.codec import Will
from blipmq_server.mqtt.packets import (
    ConnAck,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from blipmq_server.protocol.codec import ErrorCode

SERVER_UNAVAILABLE = 3
LIMIT_EXIT = 9


def key(name: str, *, admin: bool = False, **fields: object) -> tuple[str, dict]:
    """A named key: its clear text, and its [[auth.keys]] stanza."""
    clear = "bmq_" + secrets.token_urlsafe(32)
    digest = "blake2b:" + hashlib.blake2b(clear.encode()).hexdigest()
    return clear, {"name": name, "hash": digest, "admin": admin, **fields}


ROOT, ROOT_STANZA = key("root", admin=True, publish=["#"], subscribe=["#"])
SENSOR, SENSOR_STANZA = key("sensor", publish=["sensors/hall/#"], subscribe=["cmd/hall/#"])
KITCHEN, KITCHEN_STANZA = key("kitchen", publish=["sensors/kitchen/#"],
                              subscribe=["sensors/kitchen/#"])

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


def keyed(**sections: dict) -> dict:
    """A configuration with root (admin), sensor and kitchen: three keys, so a non-admin
    key's default share is a third of each cap."""
    return {"auth": {"keys": [ROOT_STANZA, SENSOR_STANZA, KITCHEN_STANZA]},
            "mqtt": {"enabled": True, "port": 0}, **sections}


def test_a_key_at_its_share_of_durable_groups_leaves_the_others_theirs(start_broker) -> None:
    """Finding 2 of the h34 review: a restricted key made durable groups on its own filter
    ($share/hogN/..., SUBSCRIBE then UNSUBSCRIBE: the group stays) until the broker-wide
    cap, and everyone else was refused one from then on, across restarts. Now the key
    stops at its share (a third of 9 here) and the others are served."""
    bp = start_broker(keyed(queues={"max_durable_groups": 9}))
    assert bp.mqtt_port is not None
    hog = Raw(bp.mqtt_port)
    assert hog.connect("hog", username="d", password=SENSOR.encode()) == ConnAck(False, 0)
    codes = []
    for n in range(5):
        hog.send(Subscribe(n + 1, ((f"$share/hog{n}/cmd/hall/#", 1),)))
        ack = hog.expect(SubAck)
        codes += ack.codes  # type: ignore[attr-defined]
        hog.send(Unsubscribe(n + 1, (f"$share/hog{n}/cmd/hall/#",)))
        hog.expect(UnsubAck)
    assert codes == [1, 1, 1, 0x80, 0x80], codes
    said = bp.wait_log("key 'sensor' holds 3 durable groups, the most its share allows (3: "
                       "max_durable_groups")
    assert "'$share/hog3/cmd/hall/#'" in said
    # native: the same key, the same refusal, one line and the limit's exit code
    sub = bp.cli("sub", "cmd/hall/#", "--group", "more", "-q", "1", "-W", "1",
                 BLIPMQ_API_KEY=SENSOR)
    assert sub.returncode == LIMIT_EXIT and b"key 'sensor' holds 3" in sub.stderr, sub
    assert len(sub.stderr.strip().splitlines()) == 1, sub.stderr
    # the others: a persistent session's QoS 1 subscription, an admin's named group
    kitchen = Raw(bp.mqtt_port)
    assert kitchen.connect("kitchen-dev", clean=False, username="d",
                           password=KITCHEN.encode()).code == 0
    kitchen.send(Subscribe(1, (("sensors/kitchen/#", 1),)))
    assert kitchen.expect(SubAck) == SubAck(1, (1,))
    with Client(bp.addr, ROOT) as admin:
        admin.subscribe("jobs/#", group="workers", qos=1)
    assert bp.metric("blipmq_limit_refusals_total", limit="auth.keys.max_durable_groups") == 3
    assert bp.metric("blipmq_limit_refusals_total", limit="queues.max_durable_groups") == 0
    # a restart counts each key's groups again from their owners' records
    for c in (hog, kitchen):
        c.sock.close()
    assert bp.stop() == 0
    bp = start_broker(keyed(queues={"max_durable_groups": 9}), data_dir=bp.data_dir)
    sub = bp.cli("sub", "cmd/hall/#", "--group", "more", "-q", "1", "-W", "1",
                 BLIPMQ_API_KEY=SENSOR)
    assert sub.returncode == LIMIT_EXIT and b"key 'sensor' holds 3" in sub.stderr, sub
    with Client(bp.addr, KITCHEN) as kitchen_svc:
        kitchen_svc.subscribe("sensors/kitchen/#", group="svc", qos=1)
    # an admin deletes one of the hog's groups: the key has room for one again
    assert bp.cli("unsub", "cmd/hall/#", "--group", "hog0", BLIPMQ_API_KEY=ROOT
                  ).returncode == 0
    assert bp.cli("sub", "cmd/hall/#", "--group", "more", "-q", "1", "-e",
                  BLIPMQ_API_KEY=SENSOR).returncode == 0


def test_a_keys_own_limit_replaces_its_share(start_broker) -> None:
    """max_durable_groups in a key's entry: its limit, whatever its share would be."""
    clear, stanza = key("svc", subscribe=["jobs/#"], max_durable_groups=1)
    bp = start_broker({"auth": {"keys": [stanza]}})  # the only key: its share is all
    assert bp.cli("sub", "jobs/#", "--group", "a", "-q", "1", "-e",
                  BLIPMQ_API_KEY=clear).returncode == 0
    sub = bp.cli("sub", "jobs/#", "--group", "b", "-q", "1", "-W", "1", BLIPMQ_API_KEY=clear)
    assert sub.returncode == LIMIT_EXIT and b"(1: max_durable_groups" in sub.stderr, sub


def test_persistent_sessions_are_bounded_in_all_and_per_key(start_broker) -> None:
    """Finding 3 of the h34 review: persistent sessions were unbounded (one key left 60,000
    behind, ~1.1 KB each, kept a week across restarts). Now mqtt.max_sessions bounds them
    all (CONNACK 3 past it) and each key its share (a third of 6 here); resuming a session
    kept, and clean sessions, go on; refusals are counted and logged once a minute per
    source."""
    bp = start_broker(keyed(mqtt={"enabled": True, "port": 0, "max_sessions": 6}))
    assert bp.mqtt_port is not None

    def connect(cid: str, secret: str, clean: bool = False) -> ConnAck:
        c = Raw(bp.mqtt_port)  # type: ignore[arg-type]
        ack = c.connect(cid, clean=clean, username="d", password=secret.encode())
        c.sock.close()
        return ack

    assert [connect(f"junk-{n}", SENSOR).code for n in range(4)] == [0, 0, SERVER_UNAVAILABLE,
                                                                     SERVER_UNAVAILABLE]
    said = bp.wait_log("key 'sensor' keeps 2 persistent sessions, the most its share allows "
                       "(2: max_sessions")
    assert "refused (CONNACK 3" in said and "'junk-2'" in said
    assert sum("persistent sessions" in line for line in bp.log) == 1, bp.log  # hushed
    assert connect("junk-0", SENSOR) == ConnAck(True, 0)  # its own, kept: resumed
    assert connect("junk-9", SENSOR, clean=True).code == 0  # a clean session: never kept
    assert [connect(f"kitchen-{n}", KITCHEN).code for n in range(2)] == [0, 0]
    assert [connect(f"root-{n}", ROOT).code for n in range(3)] == [0, 0, SERVER_UNAVAILABLE]
    bp.wait_log("the broker keeps 6 persistent sessions, the most mqtt.max_sessions allows")
    assert bp.metric("blipmq_limit_refusals_total", limit="auth.keys.max_sessions") == 2
    assert bp.metric("blipmq_limit_refusals_total", limit="mqtt.max_sessions") == 1
    assert bp.metric("blipmq_connections_closed_total", reason="limit") == 3
    # ending one (clean session 1 with its id) makes room, for its key too
    assert connect("junk-1", SENSOR, clean=True) == ConnAck(False, 0)
    assert connect("junk-5", SENSOR).code == 0
    # restored at start, they count again
    assert bp.stop() == 0
    bp = start_broker(keyed(mqtt={"enabled": True, "port": 0, "max_sessions": 6}),
                      data_dir=bp.data_dir)
    assert connect("junk-6", SENSOR).code == SERVER_UNAVAILABLE
    assert connect("root-9", ROOT).code == SERVER_UNAVAILABLE
    assert connect("junk-5", SENSOR) == ConnAck(True, 0)


def test_without_keys_sessions_are_bounded_by_mqtt_max_sessions(start_broker) -> None:
    bp = start_broker({"mqtt": {"enabled": True, "port": 0, "max_sessions": 2}})
    assert bp.mqtt_port is not None
    acks = []
    for cid in ("a", "b", "c"):
        c = Raw(bp.mqtt_port)
        acks.append(c.connect(cid, clean=False).code)
        c.sock.close()
    assert acks == [0, 0, SERVER_UNAVAILABLE]
    bp.wait_log("the broker keeps 2 persistent sessions, the most mqtt.max_sessions allows")


def test_a_key_at_its_share_of_retained_values_leaves_the_others_theirs(start_broker) -> None:
    """Finding 4 of the h34 review: a restricted key filled retained.max_topics in 0.1 s;
    then another device's retained QoS 1 publish closed its connection (each time it
    reconnected), and retained wills were lost. Now the key stops at its share (a third of
    9 here), and the others' retained values and wills are kept."""
    bp = start_broker(keyed(retained={"max_topics": 9}))
    assert bp.mqtt_port is not None
    hog = Raw(bp.mqtt_port)
    assert hog.connect("ret-hog", username="d", password=SENSOR.encode()).code == 0
    for n in range(5):
        hog.send(Publish(f"sensors/hall/r{n}", b"v", 0, True))
    hog.send(Publish("sensors/hall/last", b"v", 1, True, packet_id=1))
    # QoS 1 retained past its share: delivered, not kept as the retained value (h33 F2)
    assert hog.expect(PubAck) == PubAck(1)
    bp.wait_log("retained value for 'sensors/hall/r3' not kept: key 'sensor' keeps "
                "retained values for 3 topics, the most its share allows (3: "
                "max_retained_topics")
    pub = bp.cli("pub", "-r", "sensors/hall/native", "v", BLIPMQ_API_KEY=SENSOR)
    assert pub.returncode == LIMIT_EXIT and b"key 'sensor' keeps" in pub.stderr, pub
    # another device: its retained state at QoS 1 is acknowledged and kept, and so is its
    # retained will
    kitchen = Raw(bp.mqtt_port)
    assert kitchen.connect("kitchen-dev", username="d", password=KITCHEN.encode(), will=Will(
        "sensors/kitchen/online", b"0", 1, True)).code == 0
    kitchen.send(Publish("sensors/kitchen/state", b"on", 1, True, packet_id=7))
    assert kitchen.expect(PubAck) == PubAck(7)
    kitchen.sock.close()  # no DISCONNECT: the will is published
    bp.wait_metric("blipmq_mqtt_wills_published_total", 1)
    got = bp.cli("sub", "sensors/#", "-e", "-F", "%t=%p", BLIPMQ_API_KEY=ROOT)
    kept = set(got.stdout.decode().split())
    assert {"sensors/kitchen/state=on", "sensors/kitchen/online=0"} <= kept, got
    assert len([t for t in kept if t.startswith("sensors/hall/")]) == 3, kept
    # two QoS 0 publishes dropped, the QoS 1 one, the native one
    assert bp.metric("blipmq_limit_refusals_total", limit="auth.keys.max_retained_topics") == 4


def test_a_reload_lowers_a_share_for_what_is_made_after_it(start_broker) -> None:
    """SIGHUP with a lower max_durable_groups: the key's new groups are refused, the groups
    it holds stay (nothing is deleted), and the reload line names the key as changed; a key
    whose default share changed only because a key was added is not named."""
    import signal

    import tomlkit

    clear, stanza = key("svc", subscribe=["jobs/#"], max_durable_groups=3)
    bp = start_broker({"auth": {"keys": [stanza]}})
    for g in ("a", "b"):
        assert bp.cli("sub", "jobs/#", "--group", g, "-q", "1", "-e",
                      BLIPMQ_API_KEY=clear).returncode == 0
    doc = tomlkit.parse(bp.config_path.read_text())
    doc["auth"]["keys"] = [{**stanza, "max_durable_groups": 1}, ROOT_STANZA]  # type: ignore[index]
    bp.config_path.write_text(tomlkit.dumps(doc))
    bp.proc.send_signal(signal.SIGHUP)
    said = bp.wait_log("reloaded: keys:")
    assert "(+root, ~svc)" in said, said
    sub = bp.cli("sub", "jobs/#", "--group", "c", "-q", "1", "-W", "1", BLIPMQ_API_KEY=clear)
    assert sub.returncode == LIMIT_EXIT and b"key 'svc' holds 2 durable groups" in sub.stderr
    assert bp.metric("blipmq_durable_groups") == 2  # kept
    assert bp.cli("sub", "jobs/#", "--group", "a", "-q", "1", "-e",
                  BLIPMQ_API_KEY=clear).returncode == 0  # joining one it holds: fine
    doc["auth"]["keys"] = [{**stanza, "max_durable_groups": 1}, ROOT_STANZA,  # type: ignore[index]
                           KITCHEN_STANZA]
    bp.config_path.write_text(tomlkit.dumps(doc))
    bp.proc.send_signal(signal.SIGHUP)
    assert "keys: 3 (+kitchen); " in bp.wait_log("reloaded: keys: 3")
