"""MQTT end to end as real devices and deployments use it: device profiles (Tasmota,
ESPHome, Node-RED, Shelly Gen2), mqtt.queue_qos0, wills on broker shutdown, the connection
limit shared with the native protocol, a client that never reads, the refusal of an open
MQTT port without authentication, shared subscriptions across both protocols (and QoS 0
shares left behind), and what /metrics and `blipmq stats` say about MQTT.

The real broker on loopback (docs/MQTT.md is what it promises); paho-mqtt, the mosquitto
clients, the `blipmq` CLI and a raw socket as clients. No test sleeps to wait for the
broker: it waits for a CONNACK, a SUBACK, a message, a metric or a log line, each with a
deadline. "Nothing else arrived" is shown with a round trip (``Paho.sync``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BLIPMQ
from mqttpeer import Paho, Raw, mosquitto, mosquitto_spawn, raw_small_window, reap, track

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
from blipmq_server.mqtt.state import group_name

MQTT = {"mqtt": {"enabled": True, "port": 0}}


@pytest.fixture(autouse=True)
def _reap_clients() -> Iterator[None]:
    """mosquitto and blipmq clients a failed test left running are killed."""
    yield
    reap()


def wait_for(what: str, check, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric_or_0(b, name: str, **labels: str) -> float:
    """A sample that is absent until its label was first seen counts 0."""
    try:
        return b.metric(name, **labels)
    except KeyError:
        return 0.0


def mqtt_stats(b) -> dict:
    res = b.cli("stats", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["mqtt"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------- 1. device profiles


def test_tasmota_profile(start_broker) -> None:
    """Tasmota: keepalive 30, a retained will tele/<t>/LWT = "Offline", the retained birth
    "Online" published once connected, QoS 0 telemetry on tele/<t>/STATE, commands on
    cmnd/<t>/# subscribed at QoS 1. A later subscriber to tele/+/LWT sees "Online" while the
    device is up and "Offline" once its socket is dropped; "Online" again when it is back."""
    b = start_broker(MQTT)
    t = "tasmota_4F2A1C"
    lwt = f"tele/{t}/LWT"

    def boot() -> Paho:
        dev = Paho(b.mqtt_port, f"DVES_{t[-6:]}", keepalive=30, username="DVES_USER",
                   will=Will(lwt, b"Offline", 1, True))
        dev.publish(lwt, "Online", 1, retain=True)
        assert dev.subscribe((f"cmnd/{t}/#", 1)) == [1]
        return dev

    dev = boot()
    ha = Paho(b.mqtt_port, "ha-tasmota")
    assert ha.subscribe((f"tele/{t}/STATE", 0)) == [0]
    for i in range(5):  # QoS 0 telemetry, as Tasmota sends it every TelePeriod
        dev.publish(f"tele/{t}/STATE", json.dumps({"UptimeSec": i, "POWER": "OFF"}), 0)
    got = ha.take(5)
    assert [json.loads(m.payload)["UptimeSec"] for m in got] == list(range(5))
    assert {(m.qos, m.retain) for m in got} == {(0, False)}

    ha.publish(f"cmnd/{t}/POWER", "ON", 1)  # a command reaches the device at QoS 1
    m = dev.get()
    assert (m.topic, m.payload, m.qos) == (f"cmnd/{t}/POWER", b"ON", 1)

    late = Paho(b.mqtt_port, "ha-lwt-1")
    assert late.subscribe(("tele/+/LWT", 1)) == [1]
    m = late.get()
    assert (m.topic, m.payload, m.retain) == (lwt, b"Online", True)

    dev.stop()  # power cut: no DISCONNECT
    m = late.get()
    assert (m.topic, m.payload, m.qos, m.retain) == (lwt, b"Offline", 1, False)
    later = Paho(b.mqtt_port, "ha-lwt-2")
    assert later.subscribe(("tele/+/LWT", 1)) == [1]
    m = later.get()
    assert (m.topic, m.payload, m.retain) == (lwt, b"Offline", True)

    dev = boot()  # back: its birth message replaces the will's value
    m = late.get()
    assert (m.topic, m.payload, m.retain) == (lwt, b"Online", False)
    again = Paho(b.mqtt_port, "ha-lwt-3")
    assert again.subscribe(("tele/+/LWT", 1)) == [1]
    m = again.get()
    assert (m.topic, m.payload, m.retain) == (lwt, b"Online", True)
    again.sync()
    assert again.drained() == []


def test_esphome_profile(start_broker) -> None:
    """ESPHome: clean session 0 from the very first connect (session present 0 then),
    keepalive 15, retained discovery config under homeassistant/, a retained birth and will
    on <node>/status. A command published while the device sleeps waits for it: on its
    return CONNACK says session present 1 and the command arrives without a SUBSCRIBE."""
    b = start_broker(MQTT)
    node = "livingroom-th"
    status = f"{node}/status"
    cmd = f"{node}/switch/relay/command"
    config_topic = f"homeassistant/switch/{node}/relay/config"
    config = json.dumps({"name": "Relay", "stat_t": f"{node}/switch/relay/state",
                         "cmd_t": cmd, "avty_t": status}).encode()

    def boot() -> Paho:
        return Paho(b.mqtt_port, node, clean=False, keepalive=15,
                    will=Will(status, b"offline", 1, True))

    dev = boot()
    assert dev.session_present is False  # a new persistent session
    dev.publish(status, "online", 1, retain=True)
    dev.publish(config_topic, config, 1, retain=True)
    assert dev.subscribe((cmd, 1)) == [1]
    assert b.metric("blipmq_mqtt_sessions", state="online") == 1

    ha = Paho(b.mqtt_port, "ha-esphome")
    assert ha.subscribe(("homeassistant/#", 1), (status, 1)) == [1, 1]
    got = {m.topic: (m.payload, m.retain) for m in ha.take(2)}
    assert got == {config_topic: (config, True), status: (b"online", True)}

    dev.stop()  # deep sleep: the radio goes off, no DISCONNECT
    m = ha.get()
    assert (m.topic, m.payload) == (status, b"offline")
    b.wait_metric("blipmq_mqtt_sessions", 1, state="offline")
    ha.publish(cmd, "ON", 1)  # while it sleeps
    ha.publish(cmd, "OFF", 1)

    dev = boot()
    assert dev.session_present is True
    got = dev.take(2)
    assert [(m.topic, m.payload, m.qos) for m in got] == [(cmd, b"ON", 1), (cmd, b"OFF", 1)]
    dev.publish(status, "online", 1, retain=True)
    m = ha.get()
    assert (m.topic, m.payload) == (status, b"online")
    dev.sync()
    assert dev.drained() == []  # each command once
    assert b.metric("blipmq_mqtt_sessions", state="offline") == 0


def test_node_red_profile_qos2_exactly_once(start_broker) -> None:
    """Node-RED's mqtt-in node subscribes at QoS 2; QoS 2 publishes (from an mqtt-out node
    and from mosquitto_pub) reach it exactly once each, in order, logged once each."""
    b = start_broker(MQTT)
    red = Paho(b.mqtt_port, "nodered_8c1f3d2e", keepalive=60)
    assert red.subscribe(("flows/+/in", 2)) == [2]
    out = Paho(b.mqtt_port, "nodered_out")
    n = 100
    for i in range(n):
        out.publish("flows/a/in", f"msg {i}", 2, wait=False)
    res = mosquitto("mosquitto_pub", b.mqtt_port, "-i", "red-mosq", "-q", "2",
                    "-t", "flows/b/in", "-l",
                    input="".join(f"line {i}\n" for i in range(20)).encode())
    assert res.returncode == 0, res.stderr
    got = red.take(n + 20)
    assert [m.payload for m in got if m.topic == "flows/a/in"] == [
        f"msg {i}".encode() for i in range(n)]
    assert [m.payload for m in got if m.topic == "flows/b/in"] == [
        f"line {i}".encode() for i in range(20)]
    assert {(m.qos, m.dup) for m in got} == {(2, False)}
    red.sync()
    assert red.drained() == []
    assert b.metric("blipmq_messages_published_total") == n + 20
    wait_for("no QoS 2 delivery in flight", lambda: b.metric("blipmq_mqtt_inflight") == 0)


def test_shelly_gen2_profile_every_puback_arrives(start_broker) -> None:
    """Shelly Gen2 uses QoS 1 only: it subscribes to <id>/rpc at QoS 1 and publishes its
    events and status at QoS 1, many in a row. Every PUBLISH gets its PUBACK (its own
    packet id, each once); commands reach it at QoS 1 and its PUBACKs clear them."""
    b = start_broker(MQTT)
    dev_id = "shellyplus1pm-a8032ab12345"
    shelly = Raw(b.mqtt_port)
    assert shelly.connect(dev_id, keepalive=60,
                          will=Will(f"{dev_id}/online", b"false", 1, True)) == ConnAck(False, 0)
    shelly.send(Subscribe(1, ((f"{dev_id}/rpc", 1),)))
    assert shelly.expect(SubAck) == SubAck(1, (1,))
    ha = Paho(b.mqtt_port, "ha-shelly")
    assert ha.subscribe((f"{dev_id}/#", 1)) == [1]

    n = 300
    shelly.send(Publish(f"{dev_id}/online", b"true", 1, True, False, 1),
                *(Publish(f"{dev_id}/events/rpc", json.dumps({"seq": i}).encode(), 1,
                          False, False, i + 2) for i in range(n)))
    acks = [shelly.expect(PubAck).packet_id for _ in range(n + 1)]
    assert sorted(acks) == list(range(1, n + 2))
    got = ha.take(n + 1)
    assert [json.loads(m.payload)["seq"] for m in got[1:]] == list(range(n))
    assert {m.qos for m in got} == {1}

    for i in range(3):
        ha.publish(f"{dev_id}/rpc", json.dumps({"id": i, "method": "Switch.Toggle"}), 1)
    pids = []
    for i in range(3):
        p = shelly.expect(Publish)
        assert (p.topic, json.loads(p.payload)["id"], p.qos) == (f"{dev_id}/rpc", i, 1)
        pids.append(p.packet_id)
    assert b.metric("blipmq_mqtt_inflight") >= 1
    shelly.send(*(PubAck(pid) for pid in pids))
    wait_for("the commands' PUBACKs", lambda: b.metric("blipmq_mqtt_inflight") == 0)
    shelly.close()  # the will: online = false, retained
    late = Paho(b.mqtt_port, "ha-shelly-late")
    wait_for("the will", lambda: b.metric("blipmq_mqtt_wills_published_total") == 1)
    assert late.subscribe((f"{dev_id}/online", 1)) == [1]
    m = late.get()
    assert (m.payload, m.retain) == (b"false", True)


# ------------------------------------------------------------------- 2. mqtt.queue_qos0


@pytest.mark.parametrize("queue_qos0", [True, False])
def test_queue_qos0_keeps_qos0_for_an_offline_persistent_session(start_broker,
                                                                 queue_qos0: bool) -> None:
    """mqtt.queue_qos0 = true: a persistent session's QoS 0 subscription gets, at QoS 0, the
    messages published while it was offline (more than mqtt.max_inflight of them, each
    once). Off (the default): it gets none of them, and live ones again once back."""
    b = start_broker({"mqtt": {"enabled": True, "port": 0, "queue_qos0": queue_qos0,
                               "max_inflight": 8}})
    client = Paho(b.mqtt_port, "q0-sensor", clean=False)
    assert client.subscribe(("q0/t", 0)) == [0]
    client.disconnect()
    b.wait_metric("blipmq_mqtt_sessions", 1, state="offline")
    pub = Paho(b.mqtt_port, "q0-pub")
    n = 20
    for i in range(n):
        pub.publish("q0/t", f"away {i}", 0)
    pub.publish("q0/t", "away qos1", 1)
    back = Paho(b.mqtt_port, "q0-sensor", clean=False)
    assert back.session_present is True
    if queue_qos0:
        got = back.take(n + 1)
        assert [m.payload for m in got] == [f"away {i}".encode() for i in range(n)] + [
            b"away qos1"]
        assert {(m.qos, m.dup) for m in got} == {(0, False)}
    pub.publish("q0/t", "live", 1)
    m = back.get()
    assert (m.topic, m.payload, m.qos) == ("q0/t", b"live", 0)
    back.sync()
    assert back.drained() == []
    if queue_qos0:  # delivered at QoS 0 is done: nothing waits in the session's group
        group = group_name("q0-sensor")
        wait_for("nothing in flight or waiting in the session's group", lambda: (
            b.metric("blipmq_group_in_flight", filter="q0/t", group=group),
            b.metric("blipmq_group_backlog", filter="q0/t", group=group)) == (0, 0))
        back.disconnect()
        again = Paho(b.mqtt_port, "q0-sensor", clean=False)
        again.sync()
        assert again.drained() == []


# --------------------------------------------------------------- 3. wills at shutdown


def test_broker_shutdown_publishes_the_wills(start_broker) -> None:
    """docs/MQTT.md: a will is published on every close that was not a DISCONNECT, broker
    shutdown included. SIGTERM with two clients connected: after a restart on the same data
    the QoS 1 will is in the log (`blipmq sub --from earliest -e`) and the retained one is
    the topic's value; a client that sent DISCONNECT left no will."""
    b = start_broker(MQTT)
    logged = Paho(b.mqtt_port, "sd-logged", will=Will("sd/logged", b"gone at shutdown", 1,
                                                      False))
    kept = Raw(b.mqtt_port)
    assert kept.connect("sd-kept", keepalive=60,
                        will=Will("sd/kept", b"retained will", 0, True)).code == 0
    polite = Raw(b.mqtt_port)
    assert polite.connect("sd-polite", will=Will("sd/polite", b"never", 1, True)).code == 0
    polite.disconnect()
    b.wait_metric("blipmq_connections_closed_total", 1, reason="goodbye")
    logged.sync()
    assert b.stop(signal.SIGTERM) == 0
    logged.wait_closed()
    assert kept.wait_closed() == []
    assert any("stopped" in line for line in b.log)

    b2 = start_broker(MQTT, data_dir=b.data_dir)
    res = b2.cli("sub", "sd/#", "--from", "earliest", "-e", "--format", "json", "--timeout",
                 "10")
    assert res.returncode == 0, res.stderr
    got = sorted((d["topic"], d["payload"]) for d in map(json.loads, res.stdout.splitlines()))
    assert ("sd/logged", "gone at shutdown") in got, got
    assert ("sd/kept", "retained will") in got, got
    assert all(topic != "sd/polite" for topic, _ in got), got
    reader = Paho(b2.mqtt_port, "sd-reader")
    assert reader.subscribe(("sd/#", 1)) == [1]
    m = reader.get()
    assert (m.topic, m.payload, m.retain) == ("sd/kept", b"retained will", True)
    reader.sync()
    assert reader.drained() == []


# ------------------------------------------------------------------ 4. max_connections


def test_max_connections_counts_mqtt_and_native_together(start_broker) -> None:
    """server.max_connections is one limit for both protocols: with 3, two MQTT clients and
    one native subscriber fill it; a 4th MQTT CONNECT gets CONNACK 0x03 (or a close) and a
    native client is refused too, while the three go on working. One leaves: room again."""
    b = start_broker({**MQTT, "server": {"max_connections": 3}})
    sub = Paho(b.mqtt_port, "mc-sub")
    assert sub.subscribe(("mc/#", 1)) == [1]
    pub = Paho(b.mqtt_port, "mc-pub")
    native = track(b.spawn("sub", "mc/#", "--format", "lines", "--count", "1"))
    b.wait_metric("blipmq_subscriptions", 2)
    assert b.metric("blipmq_connections_open") == 3

    for i in range(3):
        extra = Raw(b.mqtt_port)
        try:
            extra.send(Connect("MQTT", 4, True, 30, f"mc-extra-{i}"))
        except OSError:
            pass  # closed before our CONNECT got in: a refusal too
        # CONNACK 0x03 (server unavailable), or only the close when the reset of our unread
        # CONNECT overtook it
        assert extra.wait_closed() in ([], [ConnAck(False, 3)])
        extra.close()
    res = mosquitto("mosquitto_pub", b.mqtt_port, "-i", "mc-mosq", "-t", "mc/x", "-m", "no")
    assert res.returncode != 0
    refused_native = b.cli("pub", "mc/x", "no")
    assert refused_native.returncode != 0
    assert b"max_connections" in refused_native.stderr, refused_native.stderr
    assert b.metric("blipmq_connections_refused_total") >= 5

    pub.publish("mc/ok", "still served", 1)  # the three go on
    m = sub.get()
    assert (m.topic, m.payload) == ("mc/ok", b"still served")
    out, err = native.communicate(timeout=10)
    assert (native.returncode, out) == (0, b"still served\n"), err
    b.wait_metric("blipmq_connections_open", 2)
    newcomer = Paho(b.mqtt_port, "mc-newcomer")
    assert newcomer.subscribe(("mc/#", 0)) == [0]
    assert b.metric("blipmq_connections_open") == 3


# ------------------------------------------------------------- 5. a client that never reads


def test_a_client_that_never_reads_is_cut_and_its_will_published(start_broker) -> None:
    """A raw client subscribes at QoS 0 to a busy topic and never reads. The broker stops
    writing to it once its socket is full, goes on serving the others meanwhile, cuts it as
    a slow consumer after server.write_timeout_ms and publishes its will; the broker's
    memory stays bounded."""
    b = start_broker({**MQTT, "server": {"write_timeout_ms": 500,
                                         "max_pending_bytes": 64 * 1024}})
    watcher = Paho(b.mqtt_port, "slow-watch")
    assert watcher.subscribe(("slow/will", 1), ("slow/ping", 1)) == [1, 1]
    before = rss_kib(b.proc.pid)

    slow = raw_small_window(b.mqtt_port)
    assert slow.connect("slow-reader", will=Will("slow/will", b"cut", 1, False)).code == 0
    slow.send(Subscribe(1, (("slow/busy", 0),)))
    assert slow.expect(SubAck) == SubAck(1, (0,))
    # from here on it reads nothing

    flood = Paho(b.mqtt_port, "slow-flood")
    payload = os.urandom(16 * 1024)
    started = time.monotonic()
    pings = 0
    will = None
    while will is None:
        assert time.monotonic() - started < 15, "the slow client was never cut"
        for _ in range(50):  # 800 KiB a round, QoS 0
            flood.publish("slow/busy", payload, 0)
        flood.sync()
        t0 = time.monotonic()  # others are served meanwhile, and promptly
        watcher.publish("slow/ping", str(pings), 1)
        while True:
            m = watcher.get(timeout=2)
            if m.topic == "slow/will":
                will = m
                continue
            assert (m.topic, m.payload) == ("slow/ping", str(pings).encode())
            break
        assert time.monotonic() - t0 < 1.0, f"a round trip took {time.monotonic() - t0} s"
        pings += 1
    assert (will.topic, will.payload, will.qos) == ("slow/will", b"cut", 1)
    assert pings > 1  # the socket took some before it was full
    assert b.metric("blipmq_connections_closed_total", reason="slow_consumer") == 1
    assert b.metric("blipmq_mqtt_wills_published_total") == 1
    b.wait_log("closed as a slow consumer")
    after = rss_kib(b.proc.pid)
    assert after - before < 200 * 1024, f"RSS grew {(after - before) // 1024} MiB"
    watcher.publish("slow/ping", "after", 1)
    assert watcher.get().payload == b"after"
    slow.close()


def test_a_stalled_qos0_subscriber_need_not_hold_its_publishers(start_broker) -> None:
    """h33 F6: one stalled QoS 0 subscriber on '#' (a paused ``mosquitto_sub | less``) held
    every QoS 0 publisher it matched for queues.block_timeout_ms each time its queue was
    full (queues.overflow = block): 20,000 messages took 5.3 s, and the publishers'
    PINGREQs went unanswered meanwhile, with no way to choose otherwise for MQTT. With
    mqtt.qos0_overflow = drop_oldest an MQTT QoS 0 subscription's full queue drops,
    counted and logged once: the publisher goes on at once, a healthy subscriber gets
    everything. (``block``, the default, keeps a merely slow subscriber from losing any:
    the next test.)"""
    b = start_broker({"mqtt": {**MQTT["mqtt"], "qos0_overflow": "drop_oldest"},
                      "queues": {"capacity": 16, "block_timeout_ms": 60_000},
                      "server": {"write_timeout_ms": 60_000, "max_pending_bytes": 64 * 1024}})
    stalled = raw_small_window(b.mqtt_port)
    assert stalled.connect("paused-less").code == 0
    stalled.send(Subscribe(1, (("#", 0),)))
    assert stalled.expect(SubAck) == SubAck(1, (0,))
    # from here on it reads nothing
    healthy = Paho(b.mqtt_port, "healthy")  # at QoS 1: nothing dropped however loaded
    assert healthy.subscribe(("flood/#", 1)) == [1]
    device = Raw(b.mqtt_port)
    assert device.connect("device").code == 0
    payload = b"x" * 1000
    n = 2000  # ~2 MB: far more than the stalled one's queue and socket take
    started = time.monotonic()
    device.send_bytes(b"".join(encode(Publish("flood/a", payload + b"%d" % i, 0, False))
                               for i in range(n)))
    device.send(PingReq())
    assert device.expect(PingResp, timeout=20) == PingResp()
    took = time.monotonic() - started
    assert took < 10, f"the publisher was held {took:.1f} s"
    got = healthy.take(n, timeout=30)
    assert [m.payload for m in got] == [payload + b"%d" % i for i in range(n)]
    assert b.metric("blipmq_messages_dropped_total", reason="drop_oldest") > 0
    line = b.wait_log("does not keep up")
    assert "'paused-less'" in line and "mqtt.qos0_overflow" in line
    device.disconnect()
    healthy.disconnect()
    stalled.close()


def test_a_slow_qos0_subscriber_that_reads_loses_nothing(start_broker) -> None:
    """A QoS 0 subscriber slower than its publisher but reading (mosquitto_sub behind a fast
    mosquitto_pub -l) holds the publisher to its pace and loses nothing by default: issue
    22's 0 lost through the C tools. With drop_oldest as the default (a first fix of h33 F6
    this stop) it lost most of them (98,532 of 200,000 in bench/compare.py's C tools row),
    and a stall rule tried after it (drop once nothing was taken for 500 ms) took a slow
    steady reader for a stalled one (h36): both reverted."""
    b = start_broker({**MQTT, "queues": {"capacity": 16}})
    n = 20_000
    sub = mosquitto_spawn("mosquitto_sub", b.mqtt_port, "-t", "pace/#", "-C", str(n))
    b.wait_metric("blipmq_subscriptions", 1)
    lines = b"".join(b"%d\n" % i for i in range(n))
    pub = mosquitto("mosquitto_pub", b.mqtt_port, "-t", "pace/a", "-l", input=lines)
    assert pub.returncode == 0, pub.stderr
    out, err = sub.communicate(timeout=60)
    assert out.splitlines() == [b"%d" % i for i in range(n)], err
    assert b.metric("blipmq_messages_dropped_total", reason="drop_oldest") == 0


# ---------------------------------------------------------- 6. open port without auth


def _start_cli(tmp_path: Path, mqtt_bind: str, **env: str) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
    return subprocess.Popen(
        [BLIPMQ, "start", "--mqtt-bind", mqtt_bind, "--data-dir", str(tmp_path / "data"),
         "--bind", "127.0.0.1:0", "--metrics-bind", "127.0.0.1:0", "--log-format", "plain"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**clean, **env})


def test_start_refuses_a_non_loopback_mqtt_address_without_auth(tmp_path: Path) -> None:
    """As mosquitto 2.0: MQTT on 0.0.0.0 with auth.api_keys empty is refused at start, exit
    code 2 and one line naming mqtt.allow_anonymous, no traceback, nothing bound. (Allowed:
    a loopback address other than 127.0.0.1 with BLIPMQ_MQTT_ALLOW_ANONYMOUS=true.)"""
    proc = track(_start_cli(tmp_path, "0.0.0.0:0"))
    out, err = proc.communicate(timeout=20)
    text = err.decode()
    assert proc.returncode == 2, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "allow_anonymous" in lines[0]
    assert "Traceback" not in text and out == b""

    proc = track(_start_cli(tmp_path, "127.0.0.2:0", BLIPMQ_MQTT_ALLOW_ANONYMOUS="true"))
    assert proc.stderr is not None
    deadline = time.monotonic() + 20
    ready = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline().decode()
        if not line or "listening on" in line:
            ready = line
            break
    assert "mqtt on 127.0.0.2:" in ready, ready
    port = int(ready.split("mqtt on 127.0.0.2:")[1].split(";")[0])
    with socket.create_connection(("127.0.0.2", port), timeout=10) as s:
        s.sendall(encode(Connect("MQTT", 4, True, 0, "lo2")))
        assert s.recv(4) == b"\x20\x02\x00\x00"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode == 0


# ------------------------------------------------------ 7. shared across both protocols


def test_a_shared_group_spans_mqtt_and_native_members(start_broker) -> None:
    """$share/g/jobs/# at QoS 1 from two MQTT clients and `blipmq sub jobs/# --group g -q 1`
    are three members of one consumer group: each message goes to exactly one of them (how
many each gets is not promised); once the MQTT members leave, the native one gets all."""
    b = start_broker(MQTT)
    members = [Paho(b.mqtt_port, f"worker-{i}") for i in range(2)]
    for member in members:
        assert member.subscribe(("$share/g/jobs/#", 1)) == [1]
    native = track(b.spawn("sub", "jobs/#", "--group", "g", "--qos", "1", "--format",
                           "lines"))
    b.wait_metric("blipmq_subscriptions", 3)
    pub = Paho(b.mqtt_port, "jobs-pub")
    n = 150
    for i in range(n):
        pub.publish(f"jobs/{i % 3}", f"job {i}", 1, wait=False)
    pub.sync()
    res = b.cli("pub", "-q", "1", "jobs/native", "job native")
    assert res.returncode == 0, res.stderr
    b.wait_metric("blipmq_messages_acked_total", n + 1)
    for member in members:
        member.sync()
    mqtt_got = [[m.payload.decode() for m in member.drained()] for member in members]
    for member in members:  # the group goes on with its native member alone
        member.disconnect()
    b.wait_metric("blipmq_subscriptions", 1)
    for i in range(10):
        res = b.cli("pub", "-q", "1", "jobs/late", f"late {i}")
        assert res.returncode == 0, res.stderr
    b.wait_metric("blipmq_messages_acked_total", n + 11)
    native.send_signal(signal.SIGINT)
    out, _ = native.communicate(timeout=10)
    native_got = out.decode().splitlines()
    everything = [x for got in [*mqtt_got, native_got] for x in got]
    assert len(set(everything)) == len(everything)  # disjoint: none twice
    assert sorted(everything) == sorted([f"job {i}" for i in range(n)] + ["job native"]
                                        + [f"late {i}" for i in range(10)])
    assert native_got[-10:] == [f"late {i}" for i in range(10)]


def test_qos0_shares_left_behind_stay_bounded(start_broker) -> None:
    """A client that takes QoS 0 shares under ever new names and leaves (a random share name
    per run) leaves at most queues.max_idle_groups (256) groups behind: past that, the one
    left longest ago goes with its messages, so memory does not grow with the names ever
    used. One left recently keeps its newest messages for its next member, as any QoS 0
    group does."""
    b = start_broker(MQTT)
    n, kept = 300, 256
    roaming = Paho(b.mqtt_port, "roaming")
    assert roaming.subscribe(*((f"$share/run{i}/t/x", 0) for i in range(n))) == [0] * n
    b.wait_metric("blipmq_subscriptions", n)
    roaming.disconnect()
    b.wait_metric("blipmq_subscriptions", 0)
    assert b.metric("blipmq_queues") == kept
    assert b.metric("blipmq_idle_groups_dropped_total") == n - kept
    pub = Paho(b.mqtt_port, "pub")
    for i in range(10):
        pub.publish("t/x", f"m{i}")
    pub.sync()
    b.wait_metric("blipmq_queue_depth", kept * 10)
    back = Paho(b.mqtt_port, "back")
    assert back.subscribe((f"$share/run{n - 1}/t/x", 0)) == [0]
    assert [m.payload for m in back.take(10)] == [f"m{i}".encode() for i in range(10)]
    back.sync()
    assert back.drained() == []


# ------------------------------------------------------------------------ 8. /metrics


def test_mqtt_metrics_and_stats_move_as_expected(start_broker) -> None:
    """blipmq_mqtt_sessions{state}, blipmq_mqtt_wills_published_total and
    blipmq_mqtt_protocol_errors_total{reason} follow what clients do, and `blipmq stats
    --json` has the same figures in its "mqtt" section."""
    b = start_broker(MQTT)

    def sessions() -> tuple[float, float]:
        return (b.metric("blipmq_mqtt_sessions", state="online"),
                b.metric("blipmq_mqtt_sessions", state="offline"))

    assert sessions() == (0, 0)
    assert b.metric("blipmq_mqtt_wills_published_total") == 0
    persistent = Paho(b.mqtt_port, "met-persistent", clean=False,
                      will=Will("met/will", b"p", 0, False))
    assert persistent.subscribe(("met/t", 1)) == [1]
    clean = Paho(b.mqtt_port, "met-clean", will=Will("met/will", b"c", 0, False))
    assert sessions() == (2, 0)
    persistent.disconnect()  # DISCONNECT: offline, no will
    wait_for("offline 1", lambda: sessions() == (1, 1))
    clean.stop()  # dropped: its will; a clean session is gone
    wait_for("online 0", lambda: sessions() == (0, 1))
    b.wait_metric("blipmq_mqtt_wills_published_total", 1)
    back = Paho(b.mqtt_port, "met-persistent", clean=False)
    assert back.session_present is True
    assert sessions() == (1, 0)

    errors = {r: metric_or_0(b, "blipmq_mqtt_protocol_errors_total", reason=r)
              for r in ("second_connect", "reserved_topic", "bad_share", "not_connect_first")}
    assert errors == dict.fromkeys(errors, 0)
    back.publish("$SYS/x", "no", 0)  # dropped, counted, connection kept
    shared = Raw(b.mqtt_port)  # paho refuses to send a malformed $share filter
    assert shared.connect("met-share").code == 0
    shared.send(Subscribe(1, (("$share/bad+name/x", 1), ("met/ok", 0))))
    assert shared.expect(SubAck) == SubAck(1, (0x80, 0))  # and the connection stays
    shared.send(Subscribe(2, (("met/ok2", 1),)))
    assert shared.expect(SubAck) == SubAck(2, (1,))
    back.sync()
    second = Raw(b.mqtt_port)
    assert second.connect("met-second").code == 0
    second.send(Connect("MQTT", 4, True, 0, "met-second"))
    assert second.wait_closed() == []
    first = Raw(b.mqtt_port)
    first.send_bytes(b"\xc0\x00")  # PINGREQ before CONNECT
    assert first.wait_closed() == []
    wait_for("protocol_errors", lambda: {
        r: metric_or_0(b, "blipmq_mqtt_protocol_errors_total", reason=r) for r in errors} == {
        "second_connect": 1, "reserved_topic": 1, "bad_share": 1, "not_connect_first": 1})
    assert b.metric("blipmq_mqtt_wills_published_total") == 1  # no will on those

    stats = mqtt_stats(b)
    assert (stats["online"], stats["offline"]) == sessions()
    assert stats["wills_published"] == b.metric("blipmq_mqtt_wills_published_total")
    assert stats["inflight"] == b.metric("blipmq_mqtt_inflight")
    assert stats["sessions_expired"] == 0
    assert stats["protocol_errors"] == {"second_connect": 1, "reserved_topic": 1,
                                        "bad_share": 1, "not_connect_first": 1}
