"""Named keys with permissions, attacked from outside: the real broker on loopback, driven
by the `blipmq` CLI and the Python client (native protocol) and by paho-mqtt and a raw
socket (MQTT 3.1.1).

Every test has (at least) two identities, one of which must not see, change or delete the
other's data. Refusals are checked where a client sees them (exit code 5 and one stderr
line; SUBACK 0x80; CONNACK 5) and their absence of effect where the data would show: a
permitted subscriber, an admin's replay of the whole log (`sub '#' --from earliest -e`),
the retained values, the statistics. No test sleeps to wait for the broker: it waits for a
message, an exit, a metric, each with a deadline; "nothing else arrived" is shown with a
marker published after the attack (it arrives first, or the attack went through).

The keys here are minted as `blipmq keys new` mints them (the config holds
"blake2b:<BLAKE2b-512 hex>", computed with hashlib, independently of the broker), and at the
end of every test the clear keys are looked for in the broker's log output, its config file
and every file of its data directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomlkit
from conftest import BLIPMQ, BrokerProcess
from mqttpeer import Paho, Raw

from blipmq_cli.client import Client, Subscription
from blipmq_server.errors import BrokerError
from blipmq_server.mqtt.codec import Will
from blipmq_server.mqtt.packets import (
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
)
from blipmq_server.protocol.codec import ErrorCode, Start
from blipmq_server.protocol.message import Delivery

FORBIDDEN_EXIT = 5
SUBACK_FAILURE = 0x80
CONNACK_SERVER_UNAVAILABLE = 3
CONNACK_NOT_AUTHORIZED = 5
WAIT = 10.0


# ------------------------------------------------------------------------------ keys


@dataclass(frozen=True)
class Key:
    """A named key: its clear text (what a client offers) and its [[auth.keys]] entry."""

    name: str
    key: str
    perms: dict = field(default_factory=dict)

    @property
    def hash(self) -> str:
        return "blake2b:" + hashlib.blake2b(self.key.encode("utf-8")).hexdigest()

    def stanza(self) -> dict:
        return {"name": self.name, "hash": self.hash, **self.perms}

    @property
    def env(self) -> dict[str, str]:
        return {"BLIPMQ_API_KEY": self.key}


def make(name: str, *, publish: Sequence[str] = (), subscribe: Sequence[str] = (),
         publish_deny: Sequence[str] = (), subscribe_deny: Sequence[str] = (),
         admin: bool = False) -> Key:
    perms: dict = {"publish": list(publish), "subscribe": list(subscribe)}
    if publish_deny:
        perms["publish_deny"] = list(publish_deny)
    if subscribe_deny:
        perms["subscribe_deny"] = list(subscribe_deny)
    if admin:
        perms["admin"] = True
    return Key(name, "bmq_" + secrets.token_urlsafe(32), perms)


def root() -> Key:
    """An admin that may read everything, dead letters included."""
    return make("root", publish=["#"], subscribe=["#", "$dlq/#"], admin=True)


@pytest.fixture
def keyed(start_broker) -> Iterator[Callable[..., BrokerProcess]]:
    """Start a broker with these named keys (and ``api_keys``, the older full-access
    list); afterwards, no clear key may be found in its log output, its config file or
    its data directory."""
    started: list[tuple[BrokerProcess, list[str], list[str]]] = []

    def start(*keys: Key, api_keys: Sequence[str] = (), mqtt: bool = True,
              **sections: dict) -> BrokerProcess:
        config: dict = {"auth": {"keys": [k.stanza() for k in keys]}, **sections}
        if api_keys:
            config["auth"]["api_keys"] = list(api_keys)
        if mqtt:
            config["mqtt"] = {"enabled": True, "port": 0}
        b = start_broker(config)
        started.append((b, [k.key for k in keys], list(api_keys)))
        return b

    yield start
    for b, named, legacy in started:
        assert_nowhere(b, named, legacy)


def assert_nowhere(b: BrokerProcess, named: Sequence[str], legacy: Sequence[str] = ()
                   ) -> None:
    """No clear key in the broker's log output or data; none of the named keys in its
    config (which holds their hashes; ``auth.api_keys`` are clear text by design)."""
    log = "\n".join(b.log)
    config = b.config_path.read_text()
    for key in named:
        assert key not in config, "a clear key is in the config file"
    for key in [*named, *legacy]:
        assert key not in log, "a clear key is in the broker's log output"
        for path in b.data_dir.rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes(), f"a clear key is in {path}"


# ------------------------------------------------------------------------------- CLI


def run(b: BrokerProcess, who: Key | str, *args: str) -> subprocess.CompletedProcess[bytes]:
    key = who.key if isinstance(who, Key) else who
    return b.cli(*args, timeout=WAIT * 2, BLIPMQ_API_KEY=key)


def run_many(b: BrokerProcess, calls: Sequence[tuple[Key, Sequence[str]]]
             ) -> list[subprocess.CompletedProcess[bytes]]:
    """Several `blipmq` commands at once (each costs a process start); results in order."""
    procs = [b.spawn(*args, **who.env) for who, args in calls]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=WAIT * 2)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def forbidden(res: subprocess.CompletedProcess[bytes], *mentions: str) -> str:
    """Exit 5, nothing on stdout, one stderr line naming ``mentions``; returns the line."""
    err = res.stderr.decode()
    assert res.returncode == FORBIDDEN_EXIT, (res.args, res.returncode, err, res.stdout)
    assert res.stdout == b"", (res.args, res.stdout)
    lines = err.splitlines()
    assert len(lines) == 1, (res.args, err)
    for text in mentions:
        assert text in lines[0], (res.args, text, lines[0])
    return lines[0]


def ok(res: subprocess.CompletedProcess[bytes]) -> list[str]:
    assert res.returncode == 0, (res.args, res.returncode, res.stderr.decode())
    return res.stdout.decode().splitlines()


def whole_log(b: BrokerProcess, admin: Key) -> list[str]:
    """Every message of the log, as an admin replays it: 'topic payload' lines."""
    return ok(run(b, admin, "sub", "#", "--from", "earliest", "-e", "-v"))


# ------------------------------------------------------------------- native observers


def take(sub: Subscription, n: int, timeout: float = WAIT) -> list[Delivery]:
    deadline = time.monotonic() + timeout
    got: list[Delivery] = []
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{len(got)} of {n} deliveries arrived: {got}")
        try:
            batch = sub.next_batch(left)
        except TimeoutError:
            raise AssertionError(f"{len(got)} of {n} deliveries arrived: {got}") from None
        assert batch is not None, "the subscription ended"
        got.extend(batch)
    return got


def pairs(deliveries: Sequence[Delivery]) -> list[tuple[str, bytes]]:
    return [(d.topic, d.payload) for d in deliveries]


def forbidden_error(fn: Callable[[], object]) -> str:
    with pytest.raises(BrokerError) as caught:
        fn()
    assert caught.value.code == ErrorCode.FORBIDDEN, caught.value
    return str(caught.value)


def metric(b: BrokerProcess, name: str, **labels: str) -> float:
    try:
        return b.metric(name, **labels)
    except KeyError:
        return 0.0


def mqtt_forbidden(b: BrokerProcess) -> float:
    return metric(b, "blipmq_mqtt_protocol_errors_total", reason="forbidden")


def mqtt_client(b: BrokerProcess, who: Key, client_id: str, **kw: object) -> Paho:
    return Paho(b.mqtt_port, client_id, username=who.name, password=who.key, **kw)


# =============================================================== 1. publishing denied


def test_native_publish_to_a_denied_topic_is_refused_and_goes_nowhere(keyed) -> None:
    kitchen = make("kitchen", publish=["sensors/kitchen/#"],
                   publish_deny=["sensors/kitchen/oven"], subscribe=["sensors/kitchen/#"])
    hall = make("hall", publish=["sensors/hall/#"], subscribe=["sensors/hall/#"])
    admin = root()
    b = keyed(kitchen, hall, admin)
    with Client(b.addr, admin.key) as ac, Client(b.addr, hall.key) as hc:
        everything = ac.subscribe("#")
        halls = hc.subscribe("sensors/hall/#")
        # the route of sensors/hall/t is known (cached) before the attack: the fast path
        hc.publish("sensors/hall/t", b"warm", qos=1)
        assert pairs(take(halls, 1)) == [("sensors/hall/t", b"warm")]
        assert pairs(take(everything, 1)) == [("sensors/hall/t", b"warm")]

        attacks = [("sensors/hall/t", "-q", "1"), ("sensors/hall/t",),
                   ("sensors/kitchen/oven", "-q", "1"), ("sensors/kitchen/oven", "-r"),
                   ("sensors/hall/new", "-r", "-q", "1")]
        results = run_many(b, [(kitchen, ("pub", a[0], f"stolen-{i}", *a[1:]))
                               for i, a in enumerate(attacks)])
        for a, res in zip(attacks, results, strict=True):
            forbidden(res, a[0])
        # a batch with a forbidden message in the middle: the one before is taken, the
        # forbidden one and the rest are not
        with Client(b.addr, kitchen.key) as kc:
            kc.publish_many([("sensors/kitchen/a", b"batch-1"),
                             ("sensors/hall/t", b"stolen-batch"),
                             ("sensors/kitchen/b", b"stolen-after")])
            assert "sensors/hall/t" in forbidden_error(kc.flush)
        # the key still works for its own topics
        ok(run(b, kitchen, "pub", "sensors/kitchen/t", "mine", "-q", "1"))
        hc.publish("sensors/hall/marker", b"marker", qos=1)
        assert pairs(take(halls, 1)) == [("sensors/hall/marker", b"marker")]
        assert pairs(take(everything, 3)) == [("sensors/kitchen/a", b"batch-1"),
                                              ("sensors/kitchen/t", b"mine"),
                                              ("sensors/hall/marker", b"marker")]
        stats = ac.stats()
    assert stats["retained"]["topics"] == 0
    assert whole_log(b, admin) == ["sensors/hall/t warm", "sensors/kitchen/a batch-1",
                                   "sensors/kitchen/t mine", "sensors/hall/marker marker"]
    assert not any("stolen" in line for line in b.log)


def test_mqtt_publish_to_a_denied_topic_is_acknowledged_and_goes_nowhere(keyed) -> None:
    """QoS 0: dropped; QoS 1 and 2: PUBACK / PUBREC+PUBCOMP, not routed (3.1.1 has no
    negative acknowledgement); each counted as protocol error "forbidden"; the connection
    stays up and its permitted publishes still go through, in a batch too."""
    kitchen = make("kitchen", publish=["sensors/kitchen/#"],
                   publish_deny=["sensors/kitchen/oven"], subscribe=["sensors/kitchen/#"])
    hall = make("hall", publish=["sensors/hall/#"], subscribe=["sensors/hall/#"])
    admin = root()
    b = keyed(kitchen, hall, admin)
    watcher = mqtt_client(b, hall, "hall-watch")
    assert watcher.subscribe(("sensors/hall/#", 2)) == [2]
    everything = mqtt_client(b, admin, "root-watch")
    assert everything.subscribe(("#", 2)) == [2]
    hall_pub = mqtt_client(b, hall, "hall-pub")
    hall_pub.publish("sensors/hall/t", "warm", 1)  # the route is known before the attack
    assert watcher.get().payload == b"warm"
    assert everything.get().payload == b"warm"

    attacker = mqtt_client(b, kitchen, "kitchen-dev")
    attacker.publish("sensors/hall/t", "stolen-q0", 0)
    attacker.publish("sensors/hall/t", "stolen-q1", 1)  # waits for its PUBACK
    attacker.publish("sensors/hall/t", "stolen-q2", 2)  # ... for PUBREC, PUBREL, PUBCOMP
    attacker.publish("sensors/kitchen/oven", "stolen-oven", 1, retain=True)
    attacker.publish("sensors/hall/new", "stolen-retained", 0, retain=True)
    # a run of publishes the broker takes as one batch, forbidden ones in the middle
    infos = [attacker.publish(t, p, q, wait=False) for t, p, q in [
        ("sensors/kitchen/a", "batch-1", 1), ("sensors/hall/t", "stolen-b1", 1),
        ("sensors/kitchen/b", "batch-2", 0), ("sensors/hall/t", "stolen-b2", 0),
        ("sensors/kitchen/c", "batch-3", 1)]]
    for info in infos:
        info.wait_for_publish(WAIT)
        assert info.is_published()
    b.wait_metric("blipmq_mqtt_protocol_errors_total", 7, reason="forbidden")
    attacker.sync()
    assert not attacker.disconnected.is_set()
    # a will to a topic the key may not publish to: CONNACK 5, and no will
    raw = Raw(b.mqtt_port)
    ack = raw.connect("kitchen-will", username=kitchen.name, password=kitchen.key.encode(),
                      will=Will("sensors/hall/t", b"stolen-will", 1, True))
    assert ack.code == CONNACK_NOT_AUTHORIZED
    raw.wait_closed()
    raw.close()

    hall_pub.publish("sensors/hall/marker", "marker", 1)
    m = watcher.get()
    assert (m.topic, m.payload) == ("sensors/hall/marker", b"marker")
    watcher.sync()
    assert watcher.drained() == []
    got = [(m.topic, m.payload) for m in everything.take(4)]
    assert got == [("sensors/kitchen/a", b"batch-1"), ("sensors/kitchen/b", b"batch-2"),
                   ("sensors/kitchen/c", b"batch-3"), ("sensors/hall/marker", b"marker")]
    everything.sync()
    assert everything.drained() == []
    assert b.metric("blipmq_retained_topics") == 0
    assert whole_log(b, admin) == [
        "sensors/hall/t warm", "sensors/kitchen/a batch-1", "sensors/kitchen/b batch-2",
        "sensors/kitchen/c batch-3", "sensors/hall/marker marker"]
    for c in (watcher, everything, hall_pub, attacker):
        c.disconnect()


# =================================================================== 2. subscribing


READER = dict(subscribe=["sensors/kitchen/#", "sensors/lab/#"],
              subscribe_deny=["sensors/lab/secret"])
# filters the reader may not subscribe to: a topic it may not read, wider than allowed,
# overlapping the deny
REFUSED = ["sensors/hall/t", "sensors/#", "#", "+/kitchen/#", "sensors/+/t",
           "sensors/lab/+", "sensors/lab/#", "sensors/lab/secret", "+/+/secret"]
ALLOWED = ["sensors/kitchen/#", "sensors/lab/open"]


def test_native_subscribe_wider_than_allowed_or_overlapping_a_deny_is_refused(keyed) -> None:
    reader = make("reader", **READER)
    admin = root()
    b = keyed(reader, admin)
    results = run_many(b, [(reader, ("sub", f, "-e")) for f in REFUSED]
                       + [(reader, ("sub", "sensors/kitchen/+/t", "--from", "earliest", "-e")),
                          (reader, ("sub", "sensors/#", "--group", "g", "-q", "1", "-e")),
                          (reader, ("sub", "sensors/kitchen/#", "sensors/hall/t", "-e"))])
    for f, res in zip([*REFUSED, None, "sensors/#", "sensors/hall/t"], results, strict=True):
        if f is None:
            ok(res)
        else:
            forbidden(res, f)
    b.wait_subscribers(0)  # a refused SUBSCRIBE leaves nothing behind
    assert b.metric("blipmq_durable_groups") == 0

    sub = b.spawn("sub", "-v", "-C", "2", *ALLOWED, **reader.env)
    try:
        b.wait_subscribers(2)
        with Client(b.addr, admin.key) as ac:
            for topic in ["sensors/hall/t", "sensors/lab/secret", "sensors/lab/x",
                          "sensors/kitchen/t", "sensors/lab/open"]:
                ac.publish(topic, b"v-" + topic.encode(), qos=1)
        out, err = sub.communicate(timeout=WAIT)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert sub.returncode == 0, err
    assert out.decode().splitlines() == ["sensors/kitchen/t v-sensors/kitchen/t",
                                         "sensors/lab/open v-sensors/lab/open"]


def test_mqtt_acknowledgements_of_denied_publishes_keep_the_order(keyed) -> None:
    """MQTT-4.6.0-2 and -3: PUBACKs and PUBRECs go out in the order the PUBLISHes came, the
    one of a denied publish too (it waits behind the allowed ones' fsync)."""
    kitchen = make("kitchen", publish=["sensors/kitchen/#"], subscribe=["sensors/kitchen/#"])
    b = keyed(kitchen, wal={"fsync": "always"})
    raw = Raw(b.mqtt_port)
    assert raw.connect("order-dev", username=kitchen.name,
                       password=kitchen.key.encode()).code == 0
    for round_ in range(5):  # each round one write: allowed, denied, allowed, denied
        base = round_ * 4
        raw.send(Publish("sensors/kitchen/a", b"ok-1", 1, False, False, base + 1),
                 Publish("sensors/hall/a", b"no-1", 1, False, False, base + 2),
                 Publish("sensors/kitchen/b", b"ok-2", 2, False, False, base + 3),
                 Publish("sensors/hall/b", b"no-2", 2, False, False, base + 4))
        got = [raw.recv() for _ in range(4)]
        assert got == [PubAck(base + 1), PubAck(base + 2), PubRec(base + 3),
                       PubRec(base + 4)], got
        raw.send(PubRel(base + 3), PubRel(base + 4))
        assert [raw.recv(), raw.recv()] == [PubComp(base + 3), PubComp(base + 4)]
    raw.close()


def test_mqtt_subscribe_wider_than_allowed_or_overlapping_a_deny_gets_0x80(keyed) -> None:
    reader = make("reader", **READER)
    admin = root()
    b = keyed(reader, admin)
    c = mqtt_client(b, reader, "reader")
    asked = [*REFUSED, "$share/g/sensors/#", "$share/g/sensors/lab/+", *ALLOWED,
             "sensors/kitchen/+/t", "$share/k/sensors/kitchen/#"]
    codes = c.subscribe(*[(f, 1) for f in asked])
    assert codes == [SUBACK_FAILURE] * (len(REFUSED) + 2) + [1] * (len(ALLOWED) + 2)
    b.wait_metric("blipmq_mqtt_protocol_errors_total", len(REFUSED) + 2, reason="forbidden")
    pub = mqtt_client(b, admin, "root-pub")
    for topic in ["sensors/hall/t", "sensors/lab/secret", "sensors/lab/x", "sensors/kitchen/t",
                  "sensors/lab/open"]:
        pub.publish(topic, "v-" + topic, 1)
    got = sorted((m.topic, m.payload) for m in c.take(3))
    # sensors/kitchen/t once by the plain filters (one copy), once by the $share group
    assert got == [("sensors/kitchen/t", b"v-sensors/kitchen/t"),
                   ("sensors/kitchen/t", b"v-sensors/kitchen/t"),
                   ("sensors/lab/open", b"v-sensors/lab/open")]
    c.sync()
    assert c.drained() == []
    c.disconnect()
    pub.disconnect()
    # the MQTT user name is only a label: the key (password) decides
    posing = Paho(b.mqtt_port, "posing", username=admin.name, password=reader.key)
    assert posing.subscribe(("#", 1), ("sensors/kitchen/#", 1)) == [SUBACK_FAILURE, 1]
    posing.disconnect()


# ======================================================================= 3. retained


SECRET = ("sensors/kitchen/secret", b"kitchen-secret")


def _retained_setup(b: BrokerProcess, kitchen: Key, hall: Key) -> None:
    with Client(b.addr, kitchen.key) as kc, Client(b.addr, hall.key) as hc:
        kc.publish(*SECRET, qos=1, retain=True)
        kc.publish("sensors/kitchen/log", b"kitchen-log", qos=1)
        hc.publish("sensors/hall/t", b"hall-value", qos=1, retain=True)
        hc.publish("sensors/hall/log", b"hall-log", qos=1)


def test_native_retained_and_replay_never_reach_a_key_that_may_not_read_them(keyed) -> None:
    kitchen = make("kitchen", publish=["sensors/kitchen/#"], subscribe=["sensors/kitchen/#"])
    hall = make("hall", publish=["sensors/hall/#"], subscribe=["sensors/hall/#"])
    # may read sensors/# except the kitchen: a wide allow with a deny inside it
    nosy = make("nosy", subscribe=["sensors/#"], subscribe_deny=["sensors/kitchen/#"])
    b = keyed(kitchen, hall, nosy)
    _retained_setup(b, kitchen, hall)
    ways = [dict(), dict(qos=1), dict(start=Start.EARLIEST), dict(start=Start.EARLIEST, qos=1),
            dict(start=Start.TIME, start_time_ms=int(time.time() * 1000) - 3_600_000),
            dict(group="g", qos=1, start=Start.EARLIEST), dict(group="g0")]
    for who, refused in [(hall, ["#", "sensors/#", "sensors/+/secret", "+/kitchen/#",
                                 "sensors/kitchen/secret", "sensors/+/+", "+/+/+"]),
                         (nosy, ["#", "sensors/#", "sensors/+/secret", "+/kitchen/#",
                                 "sensors/kitchen/secret", "sensors/+/+", "+/+/+"])]:
        with Client(b.addr, who.key) as c:
            for f in refused:
                for way in ways:
                    forbidden_error(lambda f=f, way=way: c.subscribe(f, **way))
    # what they may subscribe to carries their topics only, retained value and replay
    for who in (hall, nosy):
        calls = [("sub", "sensors/hall/#", "-e", "-v"),
                 ("sub", "sensors/hall/#", "-q", "1", "-e", "-v"),
                 ("sub", "sensors/hall/#", "--from", "earliest", "-e", "-v"),
                 ("sub", "sensors/hall/#", "--since", "1h", "-e", "-v"),
                 ("sub", "sensors/#", "--since", "1h", "-e", "-v"),
                 ("sub", "#", "--from", "earliest", "-e", "-v")]
        live, qos1, earliest, since, wide_since, everything = run_many(
            b, [(who, args) for args in calls])
        assert ok(live) == ok(qos1) == ["sensors/hall/t hall-value"]
        assert ok(earliest) == ok(since) == ["sensors/hall/t hall-value",
                                             "sensors/hall/log hall-log"]
        forbidden(wide_since, "sensors/#")
        forbidden(everything, "'#'")
    # nosy's wide allow still works where the deny does not reach
    assert ok(run(b, nosy, "sub", "sensors/lab/#", "--from", "earliest", "-e")) == []


def test_mqtt_retained_never_reaches_a_key_that_may_not_read_it(keyed) -> None:
    kitchen = make("kitchen", publish=["sensors/kitchen/#"], subscribe=["sensors/kitchen/#"])
    hall = make("hall", publish=["sensors/hall/#"], subscribe=["sensors/hall/#"])
    b = keyed(kitchen, hall)
    k = mqtt_client(b, kitchen, "kitchen")
    k.publish(SECRET[0], SECRET[1], 1, retain=True)
    k.publish("sensors/kitchen/log", "kitchen-log", 1)
    h = mqtt_client(b, hall, "hall")
    h.publish("sensors/hall/t", "hall-value", 1, retain=True)
    asked = ["#", "sensors/#", "sensors/+/secret", "+/kitchen/#", "sensors/kitchen/secret",
             "$share/g/sensors/#", "$share/g/sensors/kitchen/secret"]
    codes = h.subscribe(*[(f, 1) for f in asked], ("sensors/hall/#", 1))
    assert codes == [SUBACK_FAILURE] * len(asked) + [1]
    m = h.get()
    assert (m.topic, m.payload, m.retain) == ("sensors/hall/t", b"hall-value", True)
    h.sync()
    assert h.drained() == []
    # a persistent session's queue, filled while it is away: its own topics only
    p = mqtt_client(b, hall, "hall-persistent", clean=False)
    assert p.subscribe(("#", 1), ("sensors/hall/#", 1)) == [SUBACK_FAILURE, 1]
    assert p.get().payload == b"hall-value"
    p.disconnect()
    k.publish(SECRET[0], "kitchen-secret-2", 1, retain=True)
    h.publish("sensors/hall/t", "hall-2", 1)
    p = mqtt_client(b, hall, "hall-persistent", clean=False)
    assert p.session_present
    m = p.get()
    assert (m.topic, m.payload) == ("sensors/hall/t", b"hall-2")
    p.sync()
    assert p.drained() == []
    for c in (k, h, p):
        c.disconnect()


# ===================================================== 4. somebody else's durable group


def test_a_durable_group_cannot_be_taken_over_by_another_key(keyed) -> None:
    """Both keys may read jobs/#: only the group's ownership stands between them."""
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["jobs/#"], subscribe=["jobs/#"])
    admin = root()
    b = keyed(alice, mallory, admin)
    with Client(b.addr, alice.key) as ac:
        mine = ac.subscribe("jobs/#", group="g", qos=1)  # alice's group
        ac.publish("jobs/1", b"alice-job", qos=1)
        (d,) = take(mine, 1)
        assert (d.topic, d.payload, d.delivery_count) == ("jobs/1", b"alice-job", 1)
        # mallory, connected meanwhile, acks and nacks alice's delivery by its ids
        with Client(b.addr, mallory.key) as mc:
            mc.ack(mine.sub_id, d)
            mc.nack(mine.sub_id, d)
            mc.flush()
        # ... which did nothing: alice leaves without acking, and it comes back
    results = run_many(b, [
        (mallory, ("sub", "jobs/#", "--group", "g", "-q", "1", "-e")),
        (mallory, ("sub", "jobs/#", "--group", "g", "-q", "1", "--from", "earliest", "-e")),
        (mallory, ("sub", "jobs/#", "--group", "g", "-e")),
        (mallory, ("unsub", "jobs/#", "--group", "g")),
        (alice, ("stats",))])
    for res in results[:4]:
        forbidden(res, "'g'")
    forbidden(results[4], "admin")
    with Client(b.addr, admin.key) as ac:
        (group,) = [g for g in ac.stats()["groups"] if g["group"] == "g"]
    assert group["consumers"] == 0
    with Client(b.addr, alice.key) as ac:
        mine = ac.subscribe("jobs/#", group="g", qos=1)
        (d,) = take(mine, 1)
        assert (d.payload, d.delivery_count) == (b"alice-job", 2)
        mine.ack_at_close(d)
    # the admin may do what mallory may not
    with Client(b.addr, alice.key) as ac:
        ac.publish("jobs/2", b"for-the-admin", qos=1)
    assert ok(run(b, admin, "sub", "jobs/#", "--group", "g", "-q", "1", "-C", "1", "-v")
              ) == ["jobs/2 for-the-admin"]  # (alice acked jobs/1)
    ok(run(b, admin, "unsub", "jobs/#", "--group", "g"))
    assert b.metric("blipmq_durable_groups") == 0


def test_a_refused_group_is_not_said_to_be_another_keys(keyed) -> None:
    """SUBSCRIBE and UNSUBSCRIBE refuse another key's group in the same neutral words;
    UNSUBSCRIBE says the same of a group that does not exist."""
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["jobs/#"], subscribe=["jobs/#"])
    b = keyed(alice, mallory)
    ok(run(b, alice, "sub", "jobs/#", "--group", "g", "-q", "1", "-e"))
    sub, unsub, unsub_none = (forbidden(res, "'g'" if i < 2 else "'none'", "'jobs/#'")
                              for i, res in enumerate(run_many(b, [
                                  (mallory, ("sub", "jobs/#", "--group", "g", "-q", "1", "-e")),
                                  (mallory, ("unsub", "jobs/#", "--group", "g")),
                                  (mallory, ("unsub", "jobs/#", "--group", "none"))])))
    assert unsub.replace("'g'", "'none'") == unsub_none
    for line in (sub, unsub):
        assert "another" not in line and "belongs" not in line, line
    assert "this key may not use group 'g' on 'jobs/#'" in sub, sub


def test_mqtt_share_cannot_join_another_keys_group(keyed) -> None:
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["jobs/#"], subscribe=["jobs/#"])
    b = keyed(alice, mallory)
    with Client(b.addr, alice.key) as ac:
        ac.subscribe("jobs/#", group="g", qos=1)  # alice's group
    live = Client(b.addr, alice.key)  # and her QoS 0 group, in memory
    try:
        mine = live.subscribe("jobs/#", group="live")
        forbidden(run(b, mallory, "sub", "jobs/#", "--group", "live", "-e"), "'live'")
        m = mqtt_client(b, mallory, "mallory")
        assert m.subscribe(("$share/g/jobs/#", 1), ("$share/g/jobs/#", 0),
                           ("$share/live/jobs/#", 0), ("$share/live/jobs/#", 1)
                           ) == [SUBACK_FAILURE] * 4
        with Client(b.addr, alice.key) as ac:
            ac.publish("jobs/1", b"alice-job", qos=1)
        assert pairs(take(mine, 1)) == [("jobs/1", b"alice-job")]
        m.sync()
        assert m.drained() == []
        m.disconnect()
    finally:
        live.close()
    assert ok(run(b, alice, "sub", "jobs/#", "--group", "g", "-q", "1", "-C", "1", "-v")
              ) == ["jobs/1 alice-job"]


# ==================================================== MQTT client ids of another key


def _persistent_session_of(b: BrokerProcess, alice: Key) -> None:
    """alice's persistent session "dev-1" subscribed to jobs/# at QoS 1, offline, with
    one message waiting for it."""
    a = mqtt_client(b, alice, "dev-1", clean=False)
    assert a.subscribe(("jobs/#", 1)) == [1]
    a.disconnect()
    p = mqtt_client(b, alice, "alice-pub")
    p.publish("jobs/1", "for-alice", 1)
    p.disconnect()


def _alice_still_gets_her_message(b: BrokerProcess, alice: Key) -> None:
    a = mqtt_client(b, alice, "dev-1", clean=False)
    assert a.session_present
    m = a.get(timeout=3)
    assert (m.topic, m.payload) == ("jobs/1", b"for-alice")
    a.disconnect()


def test_mqtt_clean_connect_with_another_keys_client_id_does_not_delete_its_session(
        keyed) -> None:
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["other/#"], subscribe=["other/#"])
    b = keyed(alice, mallory)
    _persistent_session_of(b, alice)
    raw = Raw(b.mqtt_port)
    ack = raw.connect("dev-1", clean=True, username="mallory", password=mallory.key.encode())
    if ack.code == 0:
        raw.disconnect()
    _alice_still_gets_her_message(b, alice)


def test_mqtt_persistent_connect_with_another_keys_client_id_does_not_rewrite_its_session(
        keyed) -> None:
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["other/#"], subscribe=["other/#"])
    b = keyed(alice, mallory)
    _persistent_session_of(b, alice)
    raw = Raw(b.mqtt_port)
    ack = raw.connect("dev-1", clean=False, username="mallory",
                      password=mallory.key.encode())
    if ack.code == 0:
        raw.disconnect()
    _alice_still_gets_her_message(b, alice)


def test_mqtt_a_clean_connect_ending_its_persistent_session_keeps_the_id_its_keys(
        keyed) -> None:
    """alice ends her persistent session "dev-1" with a clean CONNECT and stays online:
    her connection is still hers. mallory's CONNECT with that id is refused (0x05); it
    took alice's connection over (her will published) when ending the session dropped
    the id's owner."""
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    mallory = make("mallory", publish=["other/#"], subscribe=["other/#"])
    b = keyed(alice, mallory)
    _persistent_session_of(b, alice)
    a = Raw(b.mqtt_port)
    assert a.connect("dev-1", clean=True, username="alice",
                     password=alice.key.encode()).code == 0
    m = Raw(b.mqtt_port)
    assert m.connect("dev-1", clean=True, username="mallory",
                     password=mallory.key.encode()).code == 5
    a.send(PingReq())
    assert a.recv() == PingResp()  # alice's connection goes on
    a.disconnect()


def test_mqtt_a_restored_filter_the_key_lost_leaves_no_group_behind(keyed) -> None:
    """alice's persistent session has secret/# and pub/# at QoS 1, and messages wait on
    secret/#. A reload takes secret/# away from her key: on resume that filter is refused,
    and its durable group goes with it (it stayed, its backlog growing for good, through
    the session's expiry and restarts)."""
    alice = make("alice", publish=["#"], subscribe=["#"])
    admin = root()
    b = keyed(alice, admin)
    a = mqtt_client(b, alice, "dev-9", clean=False)
    assert a.subscribe(("secret/#", 1), ("pub/#", 1)) == [1, 1]
    a.disconnect()
    with Client(b.addr, admin.key) as ac:
        for n in range(3):
            ac.publish("secret/x", f"s{n}".encode(), qos=1)

    def groups() -> list[str]:
        listed = json.loads(ok(run(b, admin, "groups", "--json"))[0])["groups"]
        return sorted(g["filter"] for g in listed)

    assert groups() == ["pub/#", "secret/#"]
    narrowed = Key(alice.name, alice.key, {"publish": ["#"], "subscribe": ["pub/#"]})
    reload_keys(b, narrowed, admin)
    back = mqtt_client(b, narrowed, "dev-9", clean=False)
    assert back.session_present
    b.wait_log("refused (0x80)")
    assert groups() == ["pub/#"]
    with Client(b.addr, admin.key) as ac:
        ac.publish("pub/x", b"p", qos=1)
    m = back.get()
    assert (m.topic, m.payload) == ("pub/x", b"p")
    back.disconnect()


def test_mqtt_a_restored_share_the_key_lost_gives_back_what_it_kept(keyed) -> None:
    """alice's persistent session is a QoS 2 member of ``$share/s/q/#``: it got a message,
    did not PUBREC it and went away, so the message waits for her session (MQTT-4.8.2-5),
    not for the other member (an admin's: no other key may join a group alice's key made).
    A reload takes q/# away from her key: on resume the filter is refused, and the message
    goes to the other member (it stayed kept for good)."""
    from blipmq_server.mqtt.packets import Subscribe

    alice = make("alice", publish=["#"], subscribe=["#"])
    admin = root()
    b = keyed(alice, admin)

    def member(key: Key, client_id: str, clean: bool) -> Raw:
        raw = Raw(b.mqtt_port)
        assert raw.connect(client_id, clean=clean, username=key.name,
                           password=key.key.encode()).code == 0
        raw.send(Subscribe(1, (("$share/s/q/#", 2),)))
        acked = raw.recv()
        assert acked.codes == (2,), (acked, b.log[-5:])  # type: ignore[attr-defined]
        return raw

    a = member(alice, "dev-11", clean=False)
    pub = Raw(b.mqtt_port)
    assert pub.connect("pub-11", username=admin.name, password=admin.key.encode()).code == 0
    pub.send(Publish("q/x", b"kept", 2, False, False, 1))
    assert pub.recv() == PubRec(1)
    pub.send(PubRel(1))
    assert pub.recv() == PubComp(1)
    got = a.recv()
    assert isinstance(got, Publish) and got.payload == b"kept"
    a.close()  # no PUBREC
    other = member(admin, "other-1", clean=True)
    other.send(PingReq())
    assert other.recv() == PingResp()  # kept for alice: nothing for bob
    narrowed = Key(alice.name, alice.key, {"publish": ["#"], "subscribe": ["pub/#"]})
    reload_keys(b, narrowed, admin)
    back = Raw(b.mqtt_port)
    assert back.connect("dev-11", clean=False, username=alice.name,
                        password=alice.key.encode()).session_present
    b.wait_log("refused (0x80)")
    given = other.recv()
    assert isinstance(given, Publish) and given.payload == b"kept", given
    other.send(PubRec(given.packet_id))
    back.close()
    other.close()
    pub.close()


# ==================================================================== 5. dead letters


def test_dead_letters_need_their_own_allow(keyed) -> None:
    worker = make("worker", publish=["#"], subscribe=["#"])
    dlq = make("dlq", subscribe=["$dlq/jobs/#"])
    b = keyed(worker, dlq, mqtt=True, delivery={"max_retries": 1})
    results = run_many(b, [(worker, ("sub", "$dlq/#", "-e")),
                           (worker, ("sub", "$dlq/jobs/1", "--from", "earliest", "-e")),
                           (dlq, ("sub", "$dlq/#", "-e")),
                           (dlq, ("sub", "$dlq/other/#", "-e"))])
    for f, res in zip(["$dlq/#", "$dlq/jobs/1", "$dlq/#", "$dlq/other/#"], results,
                      strict=True):
        forbidden(res, f)
    m = mqtt_client(b, worker, "worker-mqtt")
    assert m.subscribe(("$dlq/#", 1), ("#", 1)) == [SUBACK_FAILURE, 1]
    with Client(b.addr, worker.key) as wc, Client(b.addr, dlq.key) as dc:
        everything = wc.subscribe("#")
        plus = wc.subscribe("+/#", qos=1)
        dead = dc.subscribe("$dlq/jobs/#")
        work = wc.subscribe("jobs/#", group="w", qos=1)
        wc.publish("jobs/1", b"doomed", qos=1)
        (d,) = take(work, 1)
        work.nack(d, reason="no")  # max_retries = 1: dead at once
        (letter,) = take(dead, 1)
        assert (letter.topic, letter.payload) == ("$dlq/jobs/1", b"doomed")
        wc.publish("jobs/marker", b"marker", qos=1)
        for sub in (everything, plus):
            assert pairs(take(sub, 2)) == [("jobs/1", b"doomed"), ("jobs/marker", b"marker")]
    got = m.take(2)
    assert [(x.topic, x.payload) for x in got] == [("jobs/1", b"doomed"),
                                                  ("jobs/marker", b"marker")]
    m.sync()
    assert m.drained() == []
    m.disconnect()
    assert whole_log(b, worker) == ["jobs/1 doomed", "jobs/marker marker"]
    assert ok(run(b, dlq, "sub", "$dlq/jobs/#", "--from", "earliest", "-e", "-v")) == [
        "$dlq/jobs/1 doomed"]


# ====================================================================== 6. statistics


def test_stats_and_groups_are_for_admin_keys(keyed) -> None:
    reader = make("reader", publish=["a/#"], subscribe=["a/#"])
    admin = make("ops", subscribe=["a/#"], admin=True)
    b = keyed(reader, admin)
    asked = [("stats",), ("stats", "--json"), ("groups",), ("groups", "--json")]
    results = run_many(b, [(reader, a) for a in asked] + [(admin, a) for a in asked])
    for res in results[:4]:
        forbidden(res, "admin", "reader")
    for res in results[4:]:
        ok(res)
    assert json.loads(results[5].stdout)["subscriptions"] == 0


def test_a_non_admin_stats_gets_the_restricted_report_the_docs_show(keyed) -> None:
    """STATS from a key that is not an admin's is answered with a restricted STATS_REPORT
    (what `blipmq version` relies on), not ERROR FORBIDDEN as docs/PROTOCOL.md's error
    table and docs/SECURITY.md said: a third-party client read success where the docs
    promised a refusal. The docs now show that report, field for field."""
    reader = make("reader", subscribe=["a/#"])
    b = keyed(reader, mqtt=False)
    with Client(b.addr, reader.key) as rc:
        report = rc.stats()
    assert report["restricted"] is True and report["key"] == "reader", report
    assert report["broker"] == "blipmq" and "topics" not in report and "groups" not in report
    doc = (Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md").read_text()
    shown = re.search(r"```json\n(\{[^`]*\"restricted\": true[^`]*\})\n```", doc)
    assert shown, "docs/PROTOCOL.md shows no restricted STATS report"
    assert sorted(json.loads(shown.group(1))) == sorted(report)
    forbidden_row = next(line for line in doc.splitlines() if "`FORBIDDEN`" in line
                         and line.startswith("| 19"))
    assert "STATS (" not in forbidden_row and "restricted report" in forbidden_row
    security = (Path(__file__).resolve().parent.parent / "docs" / "SECURITY.md").read_text()
    assert "another key gets `ERROR FORBIDDEN`" not in security


def test_any_key_may_ask_the_broker_version(keyed) -> None:
    reader = make("reader", subscribe=["a/#"])
    b = keyed(reader)
    res = b.cli("version", "--json", BLIPMQ_API_KEY=reader.key)
    line = json.loads(ok(res)[0])
    assert line["broker"] and line["broker_protocol"] == line["protocol"]


# ================================================================ 8. legacy api_keys


def test_legacy_api_keys_keep_full_access(keyed) -> None:
    legacy = "legacy-" + secrets.token_hex(16)
    limited = make("limited", publish=["a/#"], subscribe=["a/#"])
    b = keyed(limited, api_keys=[legacy], delivery={"max_retries": 1})
    with Client(b.addr, limited.key) as lc:
        lc.subscribe("a/#", group="g", qos=1)  # limited's group
    results = run_many(b, [
        (limited, ("pub", "b/x", "no")),
        (limited, ("stats",)),
        (Key("legacy", legacy), ("pub", "b/x", "anywhere", "-q", "1", "-r")),
        (Key("legacy", legacy), ("stats", "--json")),
        (Key("legacy", legacy), ("sub", "$dlq/#", "-e")),
    ])
    forbidden(results[0], "b/x")
    forbidden(results[1], "admin")
    for res in results[2:]:
        ok(res)
    assert ok(run(b, legacy, "sub", "#", "--from", "earliest", "-e", "-v")) == [
        "b/x anywhere"]
    ok(run(b, legacy, "unsub", "a/#", "--group", "g"))  # somebody else's group
    m = Paho(b.mqtt_port, "legacy", username="whoever", password=legacy)
    assert m.subscribe(("#", 1), ("$dlq/#", 1)) == [1, 1]
    assert m.get().payload == b"anywhere"
    m.publish("c/d", "mqtt-anywhere", 1)
    assert m.get().payload == b"mqtt-anywhere"
    m.disconnect()


def test_what_an_api_keys_key_makes_is_not_a_named_keys_across_a_restart(keyed, start_broker
                                                                        ) -> None:
    """With authentication on, an api_keys key's MQTT session and groups belong to its
    identity ("*"): while an api_keys client uses them, a named key that may read the same
    topics can neither take the session over (CONNACK 3: not yet) nor use or delete the
    groups, before and after a restart; a key that may not read all the session's filters
    is refused its id (CONNACK 5); an admin uses what it likes."""
    legacy = "legacy-" + secrets.token_hex(16)
    hall = make("hall", publish=["jobs/#"], subscribe=["jobs/#", "cmd/hall/#"])
    narrow = make("narrow", publish=["jobs/#"], subscribe=["cmd/hall/#"])
    admin = root()
    b = keyed(hall, narrow, admin, api_keys=[legacy])
    dev = Paho(b.mqtt_port, "z2m", clean=False, username="z", password=legacy,
               will=Will("z2m/bridge/state", b"offline", 1, True))
    assert dev.subscribe(("jobs/#", 1)) == [1]
    billing = Client(b.addr, legacy)  # a durable group in use
    live = Client(b.addr, legacy)  # and a QoS 0 group, in memory
    try:
        billing.subscribe("jobs/#", group="billing", qos=1)
        live.subscribe("jobs/#", group="live")
        for who, code in ((hall, CONNACK_SERVER_UNAVAILABLE),
                          (narrow, CONNACK_NOT_AUTHORIZED)):
            for clean in (False, True):
                thief = Raw(b.mqtt_port)
                assert thief.connect("z2m", clean=clean, username=who.name,
                                     password=who.key.encode()).code == code
                thief.close()
        results = run_many(b, [
            (hall, ("sub", "jobs/#", "--group", "billing", "-q", "1", "-e")),
            (hall, ("unsub", "jobs/#", "--group", "billing")),
            (hall, ("sub", "jobs/#", "--group", "live", "-e")),
            (hall, ("unsub", "jobs/#", "--group", "live"))])
        for res in results:
            forbidden(res, "group")
        ok(run(b, legacy, "pub", "jobs/1", "job-1", "-q", "1"))
        assert dev.get().payload == b"job-1"  # never taken over
        assert not dev.disconnected.is_set()
    finally:
        live.close()
        billing.close()
    dev.disconnect()
    assert b.stop() == 0

    again = start_broker(tomllib.loads(b.config_path.read_text()), data_dir=b.data_dir)
    thief = Raw(again.mqtt_port)
    assert thief.connect("z2m", clean=False, username="narrow",
                         password=narrow.key.encode()).code == CONNACK_NOT_AUTHORIZED
    thief.close()
    with Client(again.addr, legacy) as billing:  # still '*''s: not hall's to join
        billing.subscribe("jobs/#", group="billing", qos=1, credit=1)
        forbidden(run(again, hall, "sub", "jobs/#", "--group", "billing", "-q", "1", "-e"),
                  "'billing'")
        forbidden(run(again, hall, "unsub", "jobs/#", "--group", "billing"), "'billing'")
    assert ok(run(again, admin, "sub", "jobs/#", "--group", "billing", "-q", "1", "-C", "1",
                  "-v")) == ["jobs/1 job-1"]
    ok(run(again, admin, "unsub", "jobs/#", "--group", "billing"))
    dev = Paho(again.mqtt_port, "z2m", clean=False, username="z", password=legacy)
    assert dev.session_present
    dev.disconnect()
    assert_nowhere(again, [hall.key, narrow.key, admin.key], [legacy])


def test_migrating_from_api_keys_a_named_key_adopts_its_session_and_group(keyed, start_broker
                                                                         ) -> None:
    """docs/SECURITY.md, "Migrating from api_keys": a device's persistent session and a
    service's durable group, made with an api_keys key, are taken over by the named keys
    they get (steps 1-2), whose permissions cover what they subscribe to: the device
    resumes its session (session present, its backlog) with clean session 0, the service
    rejoins its group (its backlog). They were refused before (CONNACK 5, FORBIDDEN). Once
    adopted they are the named keys' (logged once), across emptying api_keys (step 3) and a
    restart: another named key with the same permissions is refused them."""
    legacy = "legacy-" + secrets.token_hex(16)
    admin = root()
    b = keyed(admin, api_keys=[legacy])
    dev = Paho(b.mqtt_port, "esphome-kitchen", clean=False, username="k", password=legacy)
    assert dev.subscribe(("cmd/kitchen/#", 1)) == [1]
    dev.disconnect()
    ok(run(b, legacy, "sub", "sensors/kitchen/#", "--group", "svc", "-q", "1", "-e"))
    ok(run(b, legacy, "pub", "cmd/kitchen/light", "on", "-q", "1"))
    ok(run(b, legacy, "pub", "sensors/kitchen/t", "21", "-q", "1"))

    kitchen = make("kitchen", publish=["sensors/kitchen/#"], subscribe=["cmd/kitchen/#"])
    svc = make("svc", subscribe=["sensors/#"])
    twin = make("twin", subscribe=["cmd/kitchen/#", "sensors/kitchen/#"])
    other = make("other", subscribe=["cmd/hall/#", "sensors/hall/#"])
    reload_keys(b, admin, kitchen, svc, twin, other, api_keys=[legacy])  # steps 1-2
    # a key that may not read what they subscribe to adopts nothing
    raw = Raw(b.mqtt_port)
    assert raw.connect("esphome-kitchen", clean=False, username="other",
                       password=other.key.encode()).code == CONNACK_NOT_AUTHORIZED
    raw.close()
    dev = mqtt_client(b, kitchen, "esphome-kitchen", clean=False)
    assert dev.session_present
    m = dev.get()
    assert (m.topic, m.payload) == ("cmd/kitchen/light", b"on")
    dev.disconnect()
    assert ok(run(b, svc, "sub", "sensors/kitchen/#", "--group", "svc", "-q", "1", "-C", "1",
                  "-v")) == ["sensors/kitchen/t 21"]
    assert "is key 'kitchen''s from now on" in b.wait_log("MQTT session 'esphome-kitchen'")
    assert "is key 'svc''s from now on" in b.wait_log("group 'svc' on 'sensors/kitchen/#'")
    adopted = [line for line in b.log if "from now on" in line]
    assert len(adopted) == 2, adopted  # reload_keys cleared the log: these two only

    reload_keys(b, admin, kitchen, svc, twin, other)  # step 3: api_keys emptied
    assert b.stop() == 0
    again = start_broker(tomllib.loads(b.config_path.read_text()), data_dir=b.data_dir)
    raw = Raw(again.mqtt_port)
    assert raw.connect("esphome-kitchen", clean=False, username="twin",
                       password=twin.key.encode()).code == CONNACK_NOT_AUTHORIZED
    raw.close()
    forbidden(run(again, twin, "sub", "sensors/kitchen/#", "--group", "svc", "-q", "1", "-e"),
              "'svc'")
    dev = mqtt_client(again, kitchen, "esphome-kitchen", clean=False)
    assert dev.session_present
    dev.disconnect()
    ok(run(again, svc, "sub", "sensors/kitchen/#", "--group", "svc", "-q", "1", "-e"))
    assert not [line for line in again.log if "from now on" in line]
    assert_nowhere(again, [admin.key, kitchen.key, svc.key, twin.key, other.key], [legacy])


# ========================================================== 9. refused keys and floods


def _native_refusal(b: BrokerProcess, key: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(BrokerError) as caught:
        Client(b.addr, key, timeout=WAIT).close()
    elapsed = time.monotonic() - t0
    assert caught.value.code == ErrorCode.AUTH_FAILED, caught.value
    return elapsed


def _mqtt_refusal(b: BrokerProcess, user: str, key: str) -> float:
    raw = Raw(b.mqtt_port)
    try:
        t0 = time.monotonic()
        ack = raw.connect("", username=user, password=key.encode())
        elapsed = time.monotonic() - t0
        assert ack.code == CONNACK_NOT_AUTHORIZED, ack
        raw.wait_closed()
    finally:
        raw.close()
    return elapsed


@pytest.mark.slow
def test_refused_keys_wait_a_second_are_counted_and_logged_once(keyed) -> None:
    good = make("good", publish=["t/#"], subscribe=["t/#"])
    b = keyed(good)
    t0 = time.monotonic()
    forbidden(run(b, "bmq_" + secrets.token_urlsafe(32), "ping"), "refused")
    assert time.monotonic() - t0 >= 0.9
    forbidden(run(b, good.key + "x", "pub", "t/x", "y"), "refused")  # a near miss
    assert _native_refusal(b, "") >= 0.9
    assert _mqtt_refusal(b, "good", "not-the-key") >= 0.9
    assert _mqtt_refusal(b, "good", good.key.upper()) >= 0.9
    b.wait_metric("blipmq_auth_failures_total", 5)
    refusals = [line for line in b.log if "refused a key" in line]
    # one line per source and kind (native, MQTT): a flood of one kind cannot hide another
    assert len(refusals) == 2 and all("127.0.0.1" in line for line in refusals), refusals
    assert "(native)" in refusals[0] and "(mqtt)" in refusals[1], refusals

    # the flood: rounds of 100 connections at once (native and MQTT) with bad keys
    rounds, width = 3, 100
    lines_before = len(b.log)
    waited: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        try:
            bad = "bmq_" + secrets.token_urlsafe(32)
            took = _native_refusal(b, bad) if i % 2 else _mqtt_refusal(b, f"u{i}", bad)
            with lock:
                waited.append(took)
        except BaseException as exc:  # reported below
            with lock:
                failures.append(exc)

    flooding = threading.Event()
    flooding.set()

    def flood() -> None:
        try:
            for _ in range(rounds):
                threads = [threading.Thread(target=attempt, args=(i,)) for i in range(width)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(WAIT * 2)
        finally:
            flooding.clear()

    flooder = threading.Thread(target=flood)
    flooder.start()
    ping = b.spawn("ping", "--count", "2", **good.env)
    samples: list[float] = []
    try:
        with Client(b.addr, good.key) as steady:
            deadline = time.monotonic() + 30
            while flooding.is_set() and time.monotonic() < deadline:
                t0 = time.monotonic()
                with Client(b.addr, good.key, timeout=WAIT) as c:  # connect, AUTH, PING
                    c.ping()
                samples.append(time.monotonic() - t0)
                samples.append(steady.ping())
                time.sleep(0.01)
        out, err = ping.communicate(timeout=WAIT)
    finally:
        flooder.join(WAIT * 4)
        if ping.poll() is None:
            ping.kill()
            ping.wait()
    assert not failures, failures[:3]
    assert len(waited) == rounds * width
    assert min(waited) >= 0.9
    assert ping.returncode == 0, err
    times = [float(x) for x in re.findall(rb"time=([\d.]+) ms", out)]
    assert len(times) == 2 and max(times) < 500, out
    samples.sort()
    assert len(samples) >= 50, len(samples)
    p99 = samples[int(len(samples) * 0.99) - 1]
    assert p99 < 0.5, f"p99 {p99 * 1000:.0f} ms, max {samples[-1] * 1000:.0f} ms"
    b.wait_metric("blipmq_auth_failures_total", 5 + rounds * width)
    assert [line for line in b.log if "refused a key" in line] == refusals
    assert len(b.log) - lines_before <= 3, b.log[lines_before:]


# ======================================================== 10. keys never in the clear


def test_keys_new_prints_the_key_once_and_the_broker_keeps_only_its_hash(keyed) -> None:
    res = subprocess.run([BLIPMQ, "keys", "new", "sensor-7", "--publish", "sensors/7/#",
                          "--subscribe", "cmd/7/#"], capture_output=True, timeout=WAIT)
    assert res.returncode == 0, res.stderr
    first, _, stanza_text = res.stdout.decode().partition("\n")
    key = first.strip()
    assert key and key not in stanza_text
    (stanza,) = tomllib.loads(stanza_text)["auth"]["keys"]
    digest = hashlib.blake2b(key.encode()).hexdigest()
    assert stanza["hash"] == "blake2b:" + digest
    if shutil.which("b2sum"):
        b2 = subprocess.run(["b2sum"], input=key.encode(), capture_output=True, check=True)
        assert b2.stdout.split()[0].decode() == digest
    sensor = Key(stanza["name"], key, {k: v for k, v in stanza.items()
                                       if k not in ("name", "hash")})
    assert sensor.hash == stanza["hash"]
    b = keyed(sensor, mqtt=True, log={"level": "debug"})
    results = run_many(b, [(sensor, ("pub", "sensors/7/t", "21.5", "-q", "1")),
                           (sensor, ("pub", "cmd/7/reboot", "now")),
                           (sensor, ("sub", "cmd/7/#", "-e"))])
    ok(results[0])
    forbidden(results[1], "cmd/7/reboot")
    ok(results[2])
    m = mqtt_client(b, sensor, "sensor-7")
    assert m.subscribe(("cmd/7/#", 1), ("sensors/#", 1)) == [1, SUBACK_FAILURE]
    m.disconnect()
    assert stanza["hash"] in b.config_path.read_text()
    # the teardown looks for the key in the log (at debug level), config and data


def test_a_malformed_hash_is_a_config_error_naming_the_entry(start_broker) -> None:
    good = make("good", publish=["a/#"])
    victim = make("victim", publish=["a/#"])
    digest = hashlib.blake2b(victim.key.encode()).hexdigest()
    bad_hashes = [victim.key,  # the key itself pasted as its hash
                  "blake2b:" + digest.upper(), digest,
                  "sha256:" + hashlib.sha256(victim.key.encode()).hexdigest(),
                  "blake2b:" + digest[:64], "blake2b:" + victim.key]
    brokers = [start_broker({"auth": {"keys": [good.stanza(), {**victim.stanza(), "hash": h}]}},
                            expect_ready=False) for h in bad_hashes]
    for b in brokers:
        assert b.proc.wait(WAIT) == 2
        assert b.log_ended.wait(WAIT)
        lines = [line for line in b.log if line.strip()]
        assert len(lines) == 1, lines
        assert "auth.keys[1]" in lines[0], lines[0]
        assert victim.key not in lines[0]


def test_a_named_key_cannot_be_called_star(start_broker) -> None:
    """'*' is the identity of the api_keys keys (the owner of what they make)."""
    star = Key("*", make("x").key, {"subscribe": ["a/#"]})
    b = start_broker({"auth": {"keys": [star.stanza()]}}, expect_ready=False)
    assert b.proc.wait(WAIT) == 2
    assert b.log_ended.wait(WAIT)
    lines = [line for line in b.log if line.strip()]
    assert len(lines) == 1 and "auth.keys[0] (*)" in lines[0], lines


def test_a_key_listed_twice_is_refused_at_start_and_on_reload(start_broker) -> None:
    """The same key in api_keys and in a named entry, or in two named entries, would have
    two sets of permissions: refused with one line naming both entries, at start (exit 2)
    and on SIGHUP (the configuration in force stays)."""
    dev = make("dev", publish=["a/#"], subscribe=["a/#"])
    twin = Key("twin", dev.key, dev.perms)
    for auth, names in (({"api_keys": [dev.key], "keys": [dev.stanza()]},
                         ("auth.keys[0] (dev)", "auth.api_keys[0]")),
                        ({"keys": [make("x").stanza(), dev.stanza(), twin.stanza()]},
                         ("auth.keys[2] (twin)", "auth.keys[1] (dev)"))):
        b = start_broker({"auth": auth}, expect_ready=False)
        assert b.proc.wait(WAIT) == 2
        assert b.log_ended.wait(WAIT)
        lines = [line for line in b.log if line.strip()]
        assert len(lines) == 1 and all(n in lines[0] for n in names), lines
        assert dev.key not in lines[0]

    b = start_broker({"auth": {"keys": [dev.stanza()]}, "mqtt": {"enabled": True, "port": 0}})
    d = mqtt_client(b, dev, "dev-1")
    assert d.subscribe(("#", 0), ("a/#", 0)) == [SUBACK_FAILURE, 0]
    doc = tomllib.loads(b.config_path.read_text())
    doc["auth"]["api_keys"] = [dev.key]  # pasted while migrating, still listed there
    b.config_path.write_text(tomlkit.dumps(doc))
    b.proc.send_signal(signal.SIGHUP)
    line = b.wait_log("reload refused")
    assert "auth.keys[0] (dev)" in line and "auth.api_keys[0]" in line, line
    assert dev.key not in line
    # the connection kept its key's permissions, and so does a new one
    assert d.subscribe(("#", 0), ("$SYS/#", 0)) == [SUBACK_FAILURE, SUBACK_FAILURE]
    d.disconnect()
    again = mqtt_client(b, dev, "dev-2")
    assert again.subscribe(("#", 0), ("a/#", 0)) == [SUBACK_FAILURE, 0]
    again.disconnect()
    assert b.proc.poll() is None


# ===================================================================== 11. reloading


def reload_keys(b: BrokerProcess, *keys: Key, api_keys: Sequence[str] = ()) -> None:
    """Rewrite the config's keys and SIGHUP; returns once the broker says it reloaded."""
    doc = tomlkit.parse(b.config_path.read_text())
    auth = tomlkit.table()
    if api_keys:
        auth["api_keys"] = list(api_keys)
    auth["keys"] = [k.stanza() for k in keys]
    doc["auth"] = auth
    b.config_path.write_text(tomlkit.dumps(doc))
    b.log.clear()
    b.proc.send_signal(signal.SIGHUP)
    b.wait_log("reloaded: ")


def test_a_will_is_published_with_the_keys_permissions_of_the_moment(keyed) -> None:
    """CONNECT checks a will's topic; a reload that narrows the key afterwards makes the
    will one the key may no longer publish (dropped, counted), one still allowed goes out,
    and a connection closed because its key was revoked publishes no will at all (though
    its topic was allowed until then)."""
    hall = make("hall", publish=["sensors/hall/#"], subscribe=["cmd/hall/#"])
    admin = root()
    b = keyed(hall, admin)
    watcher = mqtt_client(b, admin, "watcher")
    assert watcher.subscribe(("sensors/#", 1)) == [1]
    devices = {}
    for cid, topic in (("narrowed", "sensors/hall/narrowed"), ("kept", "sensors/hall/temp"),
                       ("revoked", "sensors/hall/temp")):
        devices[cid] = Raw(b.mqtt_port)
        ack = devices[cid].connect(cid, will=Will(topic, f"will of {cid}".encode(), 1, False),
                                   username="hall", password=hall.key.encode())
        assert ack.code == 0
    narrow = Key("hall", hall.key, {**hall.perms, "publish": ["sensors/hall/temp"]})
    reload_keys(b, narrow, admin)
    before = metric(b, "blipmq_mqtt_protocol_errors_total", reason="forbidden_will")
    devices["narrowed"].close()  # the network connection is lost: the will is due
    devices["kept"].close()
    assert pairs_of(watcher.take(1)) == [("sensors/hall/temp", b"will of kept")]
    b.wait_metric("blipmq_mqtt_protocol_errors_total", before + 1, reason="forbidden_will")
    assert "will to 'sensors/hall/narrowed' not published" in b.wait_log("narrowed")
    reload_keys(b, admin)  # hall's key leaked: revoked
    devices["revoked"].wait_closed()
    b.wait_metric("blipmq_connections_closed_total", 1, reason="revoked")
    marker = mqtt_client(b, admin, "marker")
    marker.publish("sensors/marker", "after", 1)
    marker.disconnect()
    assert pairs_of(watcher.take(1)) == [("sensors/marker", b"after")]
    watcher.sync()
    assert watcher.drained() == []
    watcher.disconnect()


@pytest.mark.parametrize("how", ["renamed", "from api_keys"])
def test_a_reload_rechecks_subscriptions_whatever_the_keys_name(keyed, how: str) -> None:
    """The same key (hash) under a new name, or moved from api_keys to a named entry, with
    narrower permissions: its subscriptions it may no longer make end as when a key keeps
    its name (native: FORBIDDEN; MQTT: the connection closes, and SUBSCRIBE again gets
    0x80); one it may still make goes on."""
    reader = make("reader", publish=["a/#"], subscribe=["a/#"])
    admin = root()
    if how == "renamed":
        b = keyed(reader, admin)
    else:
        b = keyed(admin, api_keys=[reader.key])
    wide = b.spawn("sub", "a/#", "--no-reconnect", **reader.env)
    fine = b.spawn("sub", "a/public/x", "--count", "1", **reader.env)
    try:
        m = mqtt_client(b, reader, "reader-dev")
        assert m.subscribe(("a/#", 0)) == [0]
        b.wait_metric("blipmq_subscriptions", 3)
        narrowed = Key("reader-v2" if how == "renamed" else "reader", reader.key,
                       {"publish": ["a/#"], "subscribe": ["a/public/#"]})
        reload_keys(b, narrowed, admin)
        assert "2 subscription(s) ended" in b.wait_log("reloaded: keys: 2")
        _, err = wide.communicate(timeout=WAIT)
        assert wide.returncode == FORBIDDEN_EXIT and b"may no longer read 'a/#'" in err, err
        m.wait_closed()
        m = mqtt_client(b, narrowed, "reader-dev")
        assert m.subscribe(("a/#", 0), ("a/public/#", 0)) == [SUBACK_FAILURE, 0]
        ok(run(b, admin, "pub", "a/public/x", "still"))
        assert m.get().payload == b"still"
        m.disconnect()
        out, err = fine.communicate(timeout=WAIT)
        assert (fine.returncode, out) == (0, b"still\n"), err
    finally:
        for proc in (wide, fine):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _read_to_end(sock: socket.socket, timeout: float = WAIT) -> bytes:
    """Everything the broker sends on ``sock`` until it closes the connection."""
    sock.setblocking(True)
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the broker kept the connection open ({len(data)} bytes sent)"
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except ConnectionError:
            return data
        if not chunk:
            return data
        data += chunk


AFTER = b"published after the reload"


@pytest.mark.parametrize("how", ["revoked", "narrowed"])
def test_a_backlog_does_not_carry_messages_published_after_the_reload(keyed, how: str
                                                                      ) -> None:
    """Connections with a backlog of 6 MB they have not read when a reload revokes their
    key (native and MQTT), or narrows it below an MQTT subscription: their subscriptions
    end at the reload, so nothing published after it reaches them, however long they take
    to read what they were sent before (the connections close at once; the backlog went
    out while they drained it, with everything published meanwhile)."""
    reader = make("reader", subscribe=["sensors/#"])
    admin = root()
    b = keyed(reader, admin)
    native = Client(b.addr, reader.key) if how == "revoked" else None
    if native is not None:
        native.subscribe("sensors/#")
    m = Raw(b.mqtt_port)
    assert m.connect("reader-dev", username="reader", password=reader.key.encode()).code == 0
    m.send(Subscribe(1, (("sensors/#", 0),)))
    assert m.expect(SubAck).codes == (0,)  # type: ignore[attr-defined]
    b.wait_metric("blipmq_subscriptions", 2 if native is not None else 1)
    with Client(b.addr, admin.key) as publisher:
        for _ in range(100):
            publisher.publish("sensors/before", b"B" * 60_000)
        publisher.flush()
        if how == "revoked":
            reload_keys(b, admin)
        else:
            reload_keys(b, Key("reader", reader.key, {"subscribe": ["sensors/public/#"]}),
                        admin)
            assert "1 subscription(s) ended" in b.wait_log("reloaded: keys: 2 (~reader)")
        for i in range(5):
            publisher.publish("sensors/secret", AFTER + b" %d" % i, qos=1)
        publisher.flush()
    sent = {"mqtt": _read_to_end(m.sock)}
    if native is not None:
        sent["native"] = _read_to_end(native.sock)
    for protocol, data in sent.items():
        assert (protocol, data.count(AFTER)) == (protocol, 0), "sent after the reload"
    b.wait_metric("blipmq_connections_closed_total", len(sent), reason="revoked")


def test_a_revoked_persistent_session_keeps_what_it_had_not_acknowledged(keyed) -> None:
    """Its key revoked while QoS 1 deliveries are on their way (not acknowledged), an MQTT
    persistent session loses none of them: they go back to its durable group with what is
    published while it is away, and all reach it once its key is back."""
    dev = make("dev", subscribe=["jobs/#"])
    admin = root()
    b = keyed(dev, admin)
    m = Raw(b.mqtt_port)
    assert m.connect("dev-1", clean=False, username="dev", password=dev.key.encode()).code == 0
    m.send(Subscribe(1, (("jobs/#", 1),)))
    assert m.expect(SubAck).codes == (1,)  # type: ignore[attr-defined]
    with Client(b.addr, admin.key) as publisher:
        for i in range(30):
            publisher.publish(f"jobs/{i}", b"%d " % i + b"J" * 60_000, qos=1)
        publisher.flush()
        assert isinstance(m.expect(Publish), Publish)  # on their way; none acknowledged
        reload_keys(b, admin)
        m.wait_closed()
        publisher.publish("jobs/30", b"30 while revoked", qos=1)
        publisher.flush()
    reload_keys(b, dev, admin)
    back = mqtt_client(b, dev, "dev-1", clean=False)
    seen: set[str] = set()
    deadline = time.monotonic() + WAIT
    while len(seen) < 31 and time.monotonic() < deadline:
        seen.add(back.get(max(0.1, deadline - time.monotonic())).topic)
    assert seen == {f"jobs/{i}" for i in range(31)}
    back.disconnect()


def test_removing_the_last_key_closes_its_connections(keyed) -> None:
    """The leaked key was the only one: the reload that removes it turns authentication
    off, and closes its connections (native: GOODBYE AUTH_FAILED) instead of leaving them
    open with the full access every client now has. The broker says so in a warning."""
    dev = make("dev", publish=["sensors/dev/#"], subscribe=["cmd/dev/#"])
    b = keyed(dev)
    native = Client(b.addr, dev.key)
    forbidden_error(lambda: native.subscribe("#"))
    m = mqtt_client(b, dev, "dev-1")
    assert m.subscribe(("#", 0)) == [SUBACK_FAILURE]
    reload_keys(b)
    assert "2 connection(s) closed" in b.wait_log("reloaded: keys: 0 (-dev)")
    assert "2 connection(s) made with a key were closed" in b.wait_log("authentication is off")
    m.wait_closed()
    with pytest.raises(BrokerError) as caught:
        native.subscribe("#")
    assert caught.value.code == ErrorCode.AUTH_FAILED and "revoked" in str(caught.value)
    b.wait_metric("blipmq_connections_closed_total", 2, reason="revoked")
    with Client(b.addr, "") as anyone:  # what authentication off means, from now on
        anyone.subscribe("#")


def test_a_demoted_admin_stops_consuming_another_keys_group(keyed) -> None:
    """An admin consuming another key's durable group (native, and an MQTT $share member)
    loses the right at the reload that takes its admin flag away, as a fresh join would:
    the native subscription ends with FORBIDDEN, the MQTT connection closes, and what is
    published after it waits for the group's owner."""
    reader = make("reader", subscribe=["jobs/#"])
    ops = make("ops", publish=["#"], subscribe=["#"], admin=True)
    writer = make("writer", publish=["jobs/#"])
    b = keyed(reader, ops, writer)
    with Client(b.addr, reader.key) as owner:
        owner.subscribe("jobs/#", group="g", qos=1)  # the group is reader's
    oc = Client(b.addr, ops.key)
    sub = oc.subscribe("jobs/#", group="g", qos=1)
    m = mqtt_client(b, ops, "ops-dev")
    assert m.subscribe(("$share/g/jobs/#", 1)) == [1]
    demoted = Key("ops", ops.key, {"publish": ["#"], "subscribe": ["#"]})
    reload_keys(b, reader, demoted, writer)
    assert "2 subscription(s) ended" in b.wait_log("reloaded: keys: 3 (~ops)")
    ok(run(b, writer, "pub", "jobs/x", "for reader's group", "-q", "1"))
    text = forbidden_error(lambda: sub.next_batch(WAIT))
    assert "may no longer use group 'g' on 'jobs/#'" in text, text
    m.wait_closed()
    with Client(b.addr, reader.key) as owner:
        again = owner.subscribe("jobs/#", group="g", qos=1)
        assert pairs(take(again, 1)) == [("jobs/x", b"for reader's group")]
    oc.close()


def pairs_of(messages: Sequence) -> list[tuple[str, bytes]]:
    return [(m.topic, m.payload) for m in messages]


# =========================================================== found on the way: -e


def test_until_end_on_a_durable_group_with_nothing_to_read_ends_at_once(keyed) -> None:
    """`sub --group G -q 1 -e` with nothing of its topics in the log: the end mark is due
    past the group's own bookkeeping records (GROUP, its owner's STATE), which the cursor
    never reads past while no message comes, so the end mark never comes (the CLI waits
    out its timeout, about 10 s, instead of exiting at once)."""
    alice = make("alice", publish=["jobs/#"], subscribe=["jobs/#"])
    b = keyed(alice, mqtt=False)
    with Client(b.addr, alice.key) as ac:
        sub = ac.subscribe("jobs/#", group="g", qos=1, until_end=True)
        try:
            batch = sub.next_batch(3)
        except TimeoutError:
            batch = None
        assert batch == () and sub.at_end, f"no end mark within 3 s (end {sub.end})"


@pytest.mark.slow
def test_a_flood_of_10000_bad_keys_over_100_connections(start_broker) -> None:
    """10,000 refused keys, 100 connections at a time (the refusal delay cut to 1 ms so the
    test takes seconds, not the 100 s the default 1 s would cost): a good client's pings
    stay fast, every refusal is counted, the log holds one refusal line."""
    import socket
    import threading

    from blipmq_server.protocol import codec as native

    good = make("good", publish=["#"], subscribe=["#"])
    b = start_broker({"auth": {"keys": [good.stanza()], "failure_delay_ms": 1}})
    hello = native.encode(native.Hello(native.VERSION, "flood", 1))
    bad_auth = native.encode(native.Auth("bmq_not-a-key", 2))
    refused = [0] * 100

    def attacker(i: int) -> None:
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", b.port), timeout=10) as s:
                s.sendall(hello + bad_auth)
                got = b""
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                if b"refused" in got:
                    refused[i] += 1

    threads = [threading.Thread(target=attacker, args=(i,)) for i in range(100)]
    pings: list[float] = []
    with Client(b.addr, good.key) as client:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and len(pings) < 100_000:
            pings.append(client.ping())
        for t in threads:
            t.join(timeout=120)
    assert sum(refused) == 10_000
    assert b.metric("blipmq_auth_refused_total", reason="native") == 10_000
    pings.sort()
    assert pings and pings[int(len(pings) * 0.99)] < 0.5, pings[-5:]
    assert sum("refused a key" in line for line in b.log) == 1
