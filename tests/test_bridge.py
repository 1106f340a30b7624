"""Bridges against real upstreams (mosquitto 2.0, a second BlipMQ) through a proxy that
refuses, cuts and blackholes the link; the local broker SIGKILLed mid-drain."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess
from tests.faultproxy import FaultProxy
from tests.mqttpeer import Paho
from tests.upstream import Collector, Mosquitto, free_port, mqtt_client, numbered, wait_until

KEEPALIVE = 2  # seconds: a blackholed link must be noticed within 1.5 x this


def bridge_table(name: str, addresses: list[str], topics: list[str], **extra: object) -> dict:
    return {"name": name, "addresses": addresses, "topics": topics, "keepalive_s": KEEPALIVE,
            "backoff_min_ms": 100, "backoff_max_ms": 1000, "connect_timeout_ms": 2000,
            **extra}


def status(bp: BrokerProcess, name: str) -> dict:
    out = bp.cli("bridges", "--json")
    assert out.returncode == 0, out.stderr
    found = [b for b in json.loads(out.stdout)["bridges"] if b["name"] == name]
    assert found, out.stdout
    return found[0]


def logged_at(line: str) -> float:
    """When the broker wrote a plain log line ("2026-11-24T10:00:00.123Z INFO ..."), in s
    since the epoch."""
    stamp = datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%fZ")
    return stamp.replace(tzinfo=UTC).timestamp()


def wait_status(bp: BrokerProcess, name: str, check, timeout: float = 20) -> dict:
    last: dict = {}

    def ok() -> bool:
        nonlocal last
        last = status(bp, name)
        return bool(check(last))

    assert wait_until(ok, timeout, interval=0.05), last
    return last


def publish_numbers(bp: BrokerProcess, first: int, last: int, topics: int = 4) -> None:
    """Numbers first..last-1 as QoS 1 messages on sensors/t0..t<topics-1>, each number on
    topic n % topics, every one confirmed by the broker."""
    for t in range(topics):
        lines = b"\n".join(numbered(n, 60) for n in range(first, last) if n % topics == t)
        if not lines:
            continue
        out = bp.cli("pub", f"sensors/t{t}", "-q", "1", "-l", input=lines + b"\n", timeout=60)
        assert out.returncode == 0, out.stderr


def local_numbers(bp: BrokerProcess, topic_filter: str, expected: int) -> set[bytes]:
    """The distinct payloads the broker's log holds on ``topic_filter`` once there are
    ``expected`` of them (read from the start, again until then; at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        out = bp.cli("sub", topic_filter, "--from", "earliest", "-W", "1", timeout=60)
        assert out.returncode in (0, 4), out.stderr
        got = set(out.stdout.splitlines())
        if len(got) >= expected or time.monotonic() > deadline:
            return got


def test_a_bad_bridge_table_stops_the_start_with_one_line(start_broker) -> None:
    for table, says in (
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": ["a/# sideways 1"]},
         "direction must be out, in or both"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": ["a/# out 3"]},
         "qos must be 0, 1 or 2"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "protocol": "blipmq",
          "topics": ["a/# out 2"]}, 'QoS 2 rules need protocol = "mqtt"'),
        ({"name": "x", "addresses": ["nowhere"], "topics": ["a/#"], "colour": "red"},
         "unknown field 'colour'"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "protocol": "blipmq",
          "topics": ["a/# both 1"]}, "goes both ways: over the native protocol"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": ["a/# out 1 a/+/ b/"]},
         "a prefix may not hold wildcards"),
        ({"name": "x", "addresses": ["mqtt.example..net:1883"], "topics": ["a/#"]},
         "bad address 'mqtt.example..net:1883'"),
        ({"name": "x", "addresses": ["127.0.0.1:1", "backup.example.net:1883:1883"],
          "topics": ["a/#"]}, "bad address 'backup.example.net:1883:1883'"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": [f"{'a' * 80}/# out 1"]},
         "server.max_topic_bytes is 64"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": ["a/#"], "wal": False},
         "wal.enabled must be true"),
        ({"name": "x", "addresses": ["127.0.0.1:1"], "topics": ["a/#"],
          "client_id": "c" * 70000}, "bridge[0] (x): client_id is 70000 bytes long"),
    ):
        wal = table.pop("wal", True)
        bp = start_broker({"bridge": [table], "server": {"max_topic_bytes": 64},
                           "wal": {"enabled": wal}}, expect_ready=False)
        assert bp.proc.wait(20) == 2
        bp.log_ended.wait(5)
        text = "\n".join(bp.log)
        assert says in text and "config error: bridge" in text, text
        assert "Traceback" not in text


def test_out_and_in_through_mosquitto_with_state_and_no_loops(start_broker) -> None:
    with Mosquitto() as up, Collector(up.port, "#") as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"],
            ["sensors/# out 1 '' site1/", "cmd/# in 1 '' site1/",
             "shared/# both 1", "'' out 0 status/local status/remote"],
            state_topic="bridges/site1/state")]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        assert seen.wait_count(1, 10)  # the birth message on the state topic
        assert any(m.topic == "bridges/site1/state" and m.payload == b"1"
                   for m in seen.messages())
        state = bp.cli("sub", "$SYS/bridge/cloud/state", "-C", "1", "-W", "5")
        assert state.stdout == b"1\n", state  # retained, up
        seen.clear()
        # out, with the prefixes mapped; one topic through an empty pattern
        assert bp.cli("pub", "sensors/hall", "21.5", "-q", "1").returncode == 0
        assert bp.cli("pub", "status/local", "ok").returncode == 0
        assert seen.wait_count(2, 10)
        got = {(m.topic, m.payload) for m in seen.messages()}
        assert got == {("site1/sensors/hall", b"21.5"), ("status/remote", b"ok")}
        # in: written to the local log under the local prefix
        pub = mqtt_client(up.port)
        pub.publish("site1/cmd/lamp", b"on", qos=1).wait_for_publish(5)
        assert local_numbers(bp, "cmd/#", 1) == {b"on"}
        # both: a local message goes up once; an upstream one comes in and not back out
        seen.clear()
        assert bp.cli("pub", "shared/a", "from-edge", "-q", "1").returncode == 0
        pub.publish("shared/b", b"from-cloud", qos=1).wait_for_publish(5)
        assert local_numbers(bp, "shared/#", 2) == {b"from-edge", b"from-cloud"}
        wait_status(bp, "cloud", lambda b: b["skipped"] >= 1)
        assert seen.wait_quiet(1.0, 10)
        topics = sorted(m.topic for m in seen.messages())
        assert topics == ["shared/a", "shared/b"], topics  # each once: no echo, no loop
        pub.disconnect()
        # the table a person reads
        table = bp.cli("bridges")
        assert table.returncode == 0, table.stderr
        assert b"cloud" in table.stdout and b"up 127.0.0.1" in table.stdout
        metrics = bp.metrics()
        assert 'blipmq_bridge_connected{bridge="cloud"} 1.0' in metrics
        assert 'blipmq_bridge_received_total{bridge="cloud"}' in metrics
        # the bridge stops: its state upstream says so before it leaves
        seen.clear()
        assert bp.stop() == 0
        assert seen.wait_count(1, 10)
        assert [(m.topic, m.payload) for m in seen.messages()] == [
            ("bridges/site1/state", b"0")]


def test_device_shadow_topics_go_out_and_in_as_aws_iot_names_them(start_broker) -> None:
    """The gateway's job for devices made for AWS IoT: their shadow updates
    ($aws/things/<name>/shadow/update, published here over MQTT) go up under the same
    name, and the cloud's shadow deltas come down to them. These topics were refused here
    as the broker's own (a QoS 1 one closed the device's connection)."""
    with Mosquitto() as up, Collector(up.port, "$aws/things/+/shadow/update") as seen:
        bp = start_broker({"mqtt": {"enabled": True, "port": 0}, "bridge": [bridge_table(
            "aws", [f"127.0.0.1:{up.port}"],
            ["$aws/things/+/shadow/update out 1", "$aws/things/+/shadow/update/delta in 1"])]})
        wait_status(bp, "aws", lambda b: b["connected"])
        device = Paho(bp.mqtt_port, "lamp-1")
        assert device.subscribe(("$aws/things/lamp-1/shadow/update/delta", 1)) == [1]
        device.publish("$aws/things/lamp-1/shadow/update", b'{"state":{"reported":{}}}', 1)
        assert seen.wait_count(1, 10)
        assert [(m.topic, m.payload) for m in seen.messages()] == [
            ("$aws/things/lamp-1/shadow/update", b'{"state":{"reported":{}}}')]
        cloud = mqtt_client(up.port)
        cloud.publish("$aws/things/lamp-1/shadow/update/delta", b'{"state":{"on":1}}',
                      qos=1).wait_for_publish(5)
        got = device.get()
        assert (got.topic, got.payload) == ("$aws/things/lamp-1/shadow/update/delta",
                                            b'{"state":{"on":1}}')
        cloud.disconnect()
        device.disconnect()


@pytest.mark.slow
def test_mosquitto_upstream_100k_through_outages_restart_and_sigkill(
        start_broker, tmp_path: Path) -> None:
    total = 100_000
    # the collector's session must not drop what waits for it (mosquitto's default keeps
    # 1,000 queued messages per client and drops the rest)
    up = Mosquitto(persistence=True, directory=tmp_path / "up",
                   extra=["max_queued_messages 0"])
    up.start()
    try:
        with FaultProxy(up.address) as proxy, Collector(up.port, "site1/#",
                                                        client_id="collector") as seen:
            table = bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                 ["sensors/# out 1 '' site1/"], inflight=100)
            config = {"bridge": [table]}
            data = tmp_path / "edge"
            bp = start_broker(config, data_dir=data)
            wait_status(bp, "cloud", lambda b: b["connected"])
            publish_numbers(bp, 0, 20_000)  # link up
            proxy.refuse()  # connections refused, the current one reset
            publish_numbers(bp, 20_000, 40_000)
            wait_status(bp, "cloud", lambda b: not b["connected"])
            proxy.restore()
            wait_status(bp, "cloud", lambda b: b["forwarded"] > 0 and b["connected"])
            proxy.cut()  # RST mid-drain
            publish_numbers(bp, 40_000, 60_000)
            wait_status(bp, "cloud", lambda b: b["connected"])
            seen_before = len(bp.log)
            cut_at = time.time()
            proxy.blackhole()  # silent: no FIN, no RST
            wait_status(bp, "cloud", lambda b: not b["connected"], timeout=3 * KEEPALIVE + 5)
            # timed by the broker's own log line, not by when a status poll (a `blipmq
            # bridges` process, slow to start on a busy machine) saw it
            lost = next(x for x in bp.log[seen_before:]
                        if f"bridge cloud: link to 127.0.0.1:{proxy.port} lost" in x)
            noticed = logged_at(lost) - cut_at
            publish_numbers(bp, 60_000, 80_000)  # during the outage that follows
            proxy.restore()
            up.restart()  # SIGTERM: mosquitto keeps the collector's session
            wait_status(bp, "cloud", lambda b: b["connected"] and b["forwarded"] > 1000,
                        timeout=30)
            bp.proc.send_signal(signal.SIGKILL)  # mid-drain
            bp.proc.wait(10)
            bp = start_broker(config, data_dir=data)
            publish_numbers(bp, 80_000, total)
            assert seen.wait_distinct(total, 120), seen.tally(total)
            result = seen.tally(total)
            print(f"\n100k through outages: {result.distinct} distinct, {result.duplicates} "
                  f"duplicates, blackhole noticed after {noticed:.1f} s")
            reconnects = 6  # refuse, cut, blackhole, upstream restart, SIGKILL, slack
            assert result.complete, result.missing[:20]
            assert result.duplicates <= 100 * reconnects, result
            assert noticed <= 1.5 * KEEPALIVE + 0.4, noticed  # + a busy machine's scheduling
            final = status(bp, "cloud")
            assert final["backlog_messages"] == 0 and final["dead_lettered"] == 0
    finally:
        up.close()


@pytest.mark.slow
def test_inflight_one_keeps_per_topic_order_through_cuts(start_broker, tmp_path: Path) -> None:
    total = 3_000
    with Mosquitto(extra=["max_queued_messages 0"]) as up, FaultProxy(up.address) as proxy, \
            Collector(up.port, "site1/#") as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{proxy.port}"], ["sensors/# out 1 '' site1/"],
            inflight=1)]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        publish_numbers(bp, 0, total, topics=2)
        for _ in range(3):
            wait_status(bp, "cloud", lambda b: b["in_flight"] > 0 or b["backlog_messages"] == 0)
            proxy.cut()
            wait_status(bp, "cloud", lambda b: b["connected"], timeout=10)
        assert seen.wait_distinct(total, 60), seen.tally(total)
        result = seen.tally(total)
        assert result.complete and result.out_of_order == 0, result
        assert result.duplicates <= 3, result  # one in flight per cut


def test_blipmq_upstream_native_outage_restart_and_dead_letter(start_broker,
                                                               tmp_path: Path) -> None:
    port = free_port()
    up_config = {"server": {"port": port, "max_message_bytes": 2048}}
    up = start_broker(up_config, data_dir=tmp_path / "up")
    with FaultProxy(("127.0.0.1", port)) as proxy:
        bp = start_broker({"server": {"max_topic_bytes": 4096}, "bridge": [bridge_table(
            "site", [f"127.0.0.1:{proxy.port}"], ["sensors/# out 1 '' gw1/"],
            protocol="blipmq", inflight=500, max_retries=2)]})
        wait_status(bp, "site", lambda b: b["connected"])
        publish_numbers(bp, 0, 3_000)
        # two messages the upstream refuses for good, among the rest: one larger than it
        # announces (never sent), one whose topic is longer than it takes (its ERROR)
        big = bp.cli("pub", "sensors/t0", "-", "-q", "1", input=b"x" * 5000)
        assert big.returncode == 0, big.stderr
        long_topic = "sensors/" + "y" * 1100
        long = bp.cli("pub", long_topic, "too long upstream", "-q", "1")
        assert long.returncode == 0, long.stderr
        proxy.refuse()
        publish_numbers(bp, 3_000, 6_000)
        wait_status(bp, "site", lambda b: not b["connected"])
        up.stop()
        proxy.restore()
        up = start_broker(up_config, data_dir=tmp_path / "up")
        publish_numbers(bp, 6_000, 9_000)
        final = wait_status(bp, "site", lambda b: b["backlog_messages"] == 0
                            and b["dead_lettered"] == 2, timeout=30)
        assert final["forwarded"] >= 9_000
        got = local_numbers(up, "gw1/#", 9_000)
        assert len({int(line.split()[0]) for line in got}) == 9_000
        dead = bp.cli("sub", "$dlq/#", "--from", "earliest", "-C", "2", "-W", "10",
                      "-F", "json")
        assert dead.returncode == 0, dead.stderr
        letters = [json.loads(line) for line in dead.stdout.splitlines()]
        assert sorted(x["topic"] for x in letters) == sorted(
            ["$dlq/sensors/t0", f"$dlq/{long_topic}"])
        assert all("bridge site" in json.dumps(x) for x in letters), letters


def test_a_native_bridge_forwards_key_ttl_and_retain_of_every_message_on_a_topic(
        start_broker, tmp_path: Path) -> None:
    """Three keyed, retained QoS 1 messages with a TTL on one topic, to a BlipMQ upstream:
    the first takes the full way, the next two the short one (the upstream's record head
    kept from the first, ``_Link.heads``); each arrives with its key, TTL and payload, in
    order, and the upstream's retained value is the last."""
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    bp = start_broker({"bridge": [bridge_table(
        "site", [f"127.0.0.1:{port}"], ["sensors/# out 1 '' gw1/"], protocol="blipmq")]})
    wait_status(bp, "site", lambda b: b["connected"])
    for value in ("v1", "v2", "v3"):
        out = bp.cli("pub", "sensors/k", value, "-q", "1", "-r", "--key", "K1",
                     "--ttl", "600000")
        assert out.returncode == 0, out.stderr
    final = wait_status(bp, "site", lambda b: b["forwarded"] == 3
                        and b["backlog_messages"] == 0)
    assert final["refused"] == 0 and final["redelivered"] == 0, final  # each went once
    logged = up.cli("sub", "gw1/#", "--from", "earliest", "-C", "3", "-W", "10", "-F", "json")
    assert logged.returncode == 0, logged.stderr
    got = [json.loads(line) for line in logged.stdout.splitlines()]
    assert [(x["topic"], x["payload"], x["key"], x["ttl_ms"], x["qos"]) for x in got] == [
        ("gw1/sensors/k", v, "K1", 600000, 1) for v in ("v1", "v2", "v3")]
    kept = up.cli("sub", "gw1/sensors/k", "-C", "1", "-W", "10", "-F", "json")
    assert kept.returncode == 0, kept.stderr
    value = json.loads(kept.stdout)
    assert (value["payload"], value["key"], value.get("retained")) == ("v3", "K1", True)

def test_a_dead_letter_the_upstream_cannot_take_is_dropped_not_dead_lettered_again(
        start_broker, tmp_path: Path) -> None:
    """An out rule forwards the dead letters (`$dlq/#`) to an upstream that cannot take a
    message (larger than it announces): the bridge gives the original up to `$dlq/<topic>`
    as ever, and that dead letter, given up in its turn, is dropped from the bridge's
    group, not dead-lettered again (it went round `$dlq/$dlq/...` for good)."""
    port = free_port()
    up = start_broker({"server": {"port": port, "max_message_bytes": 2048}},
                      data_dir=tmp_path / "up")
    bp = start_broker({"bridge": [bridge_table(
        "site", [f"127.0.0.1:{port}"], ["sensors/# out 1 '' gw1/", "$dlq/# out 1 '' gw1/"],
        protocol="blipmq")]})
    wait_status(bp, "site", lambda b: b["connected"])
    big = bp.cli("pub", "sensors/t0", "-", "-q", "1", input=b"x" * 5000)
    assert big.returncode == 0, big.stderr
    bp.wait_dead_letters(1, 1)
    small = bp.cli("pub", "sensors/t1", "small", "-q", "1")
    assert small.returncode == 0, small.stderr
    assert local_numbers(up, "gw1/#", 1) == {b"small"}
    final = wait_status(bp, "site", lambda b: b["backlog_messages"] == 0)
    assert final["dead_lettered"] == 1 and final["forwarded"] == 1, final
    dead = bp.cli("sub", "$dlq/#", "--from", "earliest", "-W", "1", "-F", "json")
    assert [json.loads(line)["topic"] for line in dead.stdout.splitlines()] == [
        "$dlq/sensors/t0"]


def test_in_rule_across_local_sigkill_and_upstream_restart_loses_nothing(
        start_broker, tmp_path: Path) -> None:
    total = 2_000
    with Mosquitto(persistence=True, extra=["max_queued_messages 0"]) as up:
        config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{up.port}"],
                                          ["cmd/# in 1 '' site1/"])]}
        data = tmp_path / "edge"
        bp = start_broker(config, data_dir=data)
        wait_status(bp, "cloud", lambda b: b["connected"])
        pub = mqtt_client(up.port)
        infos = [pub.publish("site1/cmd/x", numbered(n, 40), qos=1) for n in range(total // 2)]
        wait_status(bp, "cloud", lambda b: b["received"] > 100)
        bp.proc.send_signal(signal.SIGKILL)
        bp.proc.wait(10)
        infos += [pub.publish("site1/cmd/x", numbered(n, 40), qos=1)
                  for n in range(total // 2, total)]
        for info in infos:  # mosquitto holds them for the bridge's session...
            info.wait_for_publish(20)
        pub.disconnect()
        up.restart()  # ... through its own restart too
        bp = start_broker(config, data_dir=data)
        got = local_numbers(bp, "cmd/#", total)
        numbers = {int(line.split()[0]) for line in got}
        assert numbers == set(range(total))


def test_an_in_message_on_a_local_topic_too_long_is_refused_counted_and_acked(
        start_broker) -> None:
    """What comes in is bound by what local clients may publish: a local topic longer than
    server.max_topic_bytes is not stored (counted, logged, PUBACKed), and the rest flows."""
    with Mosquitto() as up:
        bp = start_broker({"server": {"max_topic_bytes": 40}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["# in 1 long/ r2/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        pub = mqtt_client(up.port)
        pub.publish("r2/" + "x" * 60, b"too long here", qos=1).wait_for_publish(10)
        pub.publish("r2/ok", b"fine", qos=1).wait_for_publish(10)
        pub.disconnect()
        st = wait_status(bp, "cloud", lambda b: b["received"] == 2 and b["refused"] == 1)
        assert bp.metric("blipmq_messages_refused_total") == 1  # as any refusal
        assert st["connected"]
        got = bp.cli("sub", "#", "--from", "earliest", "-W", "1", "-v")
        assert got.stdout.splitlines() == [b"long/ok fine"], got.stdout
        assert any("server.max_topic_bytes is 40" in line for line in bp.log)


def test_messages_in_the_local_broker_refuses_are_counted_each_and_logged_once_a_minute(
        start_broker) -> None:
    """Whoever may publish upstream on the bridged topics wrote a WARNING line into the
    local log for each message the local broker refused (h37 #2: 205 lines for 200), and
    one on a local topic too long was missing from blipmq_messages_refused_total and the
    bridge's received (h37 #3). Now each is counted in both, and each kind of refusal is
    logged at most once a minute per bridge."""
    with Mosquitto() as up:
        bp = start_broker({"server": {"max_message_bytes": 100, "max_topic_bytes": 32},
                           "bridge": [bridge_table("cloud", [f"127.0.0.1:{up.port}"],
                                                   ["in/# in 1 '' up/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        pub = mqtt_client(up.port)
        for n in range(30):
            pub.publish(f"up/in/big{n}", b"x" * 200, qos=1).wait_for_publish(10)
        for n in range(5):
            pub.publish(f"up/in/{'y' * 40}{n}", b"long", qos=1).wait_for_publish(10)
        pub.publish("up/in/ok", b"fine", qos=1).wait_for_publish(10)
        pub.disconnect()
        st = wait_status(bp, "cloud", lambda b: b["received"] == 36)
        assert st["refused"] == 35, st
        assert bp.metric("blipmq_messages_refused_total") == 35
        got = bp.cli("sub", "in/#", "--from", "earliest", "-W", "1")
        assert got.stdout == b"fine\n", got.stdout
        said = [line for line in bp.log if "not stored" in line]
        assert len(said) == 2, said  # one for the size, one for the topic


def test_retained_messages_in_past_the_local_retained_cap_are_stored_without_retain(
        start_broker) -> None:
    """The local retained store is full (its one topic holds the bridge's own state): a
    retained message from the upstream was refused, counted, logged and PUBACKed upstream,
    so it was lost. Now it is stored and delivered without retain, as an MQTT client's
    retained publish past the cap; the local retained values stay what they were."""
    with Mosquitto() as up:
        bp = start_broker({"retained": {"max_topics": 1}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["# in 1 '' r2/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        pub = mqtt_client(up.port)
        for n in range(3):
            pub.publish(f"r2/lamp{n}", f"on{n}".encode(), qos=1, retain=True).wait_for_publish(10)
        pub.disconnect()
        st = wait_status(bp, "cloud", lambda b: b["received"] == 3)
        assert st["refused"] == 0, st
        got = bp.cli("sub", "lamp0", "lamp1", "lamp2", "--from", "earliest",
                     "-W", "1", "-v")
        assert sorted(got.stdout.splitlines()) == [b"lamp0 on0", b"lamp1 on1", b"lamp2 on2"], got
        kept = bp.cli("sub", "lamp0", "lamp1", "lamp2", "-W", "1")  # retained values only
        assert kept.stdout == b"", kept.stdout
        assert bp.metric("blipmq_retained_refused_total") == 3
        assert sum("not kept" in line for line in bp.log) == 1  # the first, then counted


def test_an_in_message_over_the_link_limit_is_refused_acked_and_the_rest_flows(
        start_broker) -> None:
    """A PUBLISH from the upstream over the link's packet limit (server.max_message_bytes +
    65,551 bytes, at least 327,739) is not a protocol error: its payload is passed over,
    never buffered, and it is refused, counted and acknowledged (QoS 1: PUBACK; QoS 2:
    PUBREC, PUBREL, PUBCOMP) on the same link, so the messages behind it come in. (It used
    to end the link, and the upstream sent it again on every new one, for good.)"""
    with Mosquitto() as up:
        config = {"server": {"max_message_bytes": 1024}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["cmd/# in 1 '' site1/", "job/# in 2 '' site1/"])]}
        bp = start_broker(config)
        before = wait_status(bp, "cloud", lambda b: b["connected"])
        # over the link's limit of 327,739 bytes, and made of what PUBACKs look like, 4-byte
        # aligned in 64 KiB reads (the topic's 14 bytes make a header of 22): none is one
        big = b"@\x02" * 200_000
        pub = mqtt_client(up.port)
        infos = [pub.publish("site1/cmd/huge", big, qos=1)]
        infos += [pub.publish("site1/cmd/n", b"c%d" % n, qos=1) for n in range(3)]
        infos += [pub.publish("site1/job/huge", big, qos=2)]
        infos += [pub.publish("site1/job/n", b"j%d" % n, qos=2) for n in range(2)]
        for info in infos:
            info.wait_for_publish(10)
        pub.disconnect()
        pub.loop_stop()
        st = wait_status(bp, "cloud", lambda b: b["received"] == 7 and b["refused"] == 2,
                         timeout=15)
        assert st["connected"] and st["reconnects"] == before["reconnects"], st
        assert st["unexpected_acks"] == 0, st
        assert local_numbers(bp, "cmd/#", 3) == {b"c0", b"c1", b"c2"}
        assert local_numbers(bp, "job/#", 2) == {b"j0", b"j1"}
        said = [line for line in bp.log if "over the link's limit of 327739" in line]
        assert len(said) == 1, said  # counted each (refused), logged once a minute
        assert bp.metric("blipmq_messages_refused_total") == 2
        assert not any("protocol error" in line for line in bp.log)
        # acknowledged: the upstream's session for the bridge holds nothing to send again
        bp.stop()
        bp = start_broker(config, data_dir=bp.data_dir)
        wait_status(bp, "cloud", lambda b: b["connected"])
        time.sleep(1)
        st = status(bp, "cloud")
        assert (st["received"], st["refused"], st["duplicates_in"]) == (0, 0, 0), st


def _pressure_config(proxy_port: int, policy: str) -> dict:
    return {"wal": {"segment_bytes": 16384, "retention_bytes": 65536,
                    "maintenance_interval_ms": 100},
            "bridge": [bridge_table("site", [f"127.0.0.1:{proxy_port}"],
                                    ["sensors/# out 1 '' gw1/"], protocol="blipmq",
                                    backlog=policy)]}


def _numbered_lines(first: int, last: int) -> bytes:
    return b"".join(numbered(n, 400) + b"\n" for n in range(first, last))


def _fill_until_held(bp: BrokerProcess) -> tuple[subprocess.Popen[bytes], dict]:
    """Numbers 0..999 (400 KB, over the 64 KB retention) published to the bridged topic
    with its upstream away, until the bridge holds its publishers: the publisher, which may
    still be waiting for its last confirms (what came within one maintenance interval may
    overshoot the cap; the rest waits, longer the slower the machine), and the status."""
    publisher = bp.spawn("pub", "sensors/a", "-q", "1", "-l")
    assert publisher.stdin is not None
    publisher.stdin.write(_numbered_lines(0, 1000))
    publisher.stdin.close()
    return publisher, wait_status(bp, "site", lambda b: b["holding"])


def test_retention_pressure_drop_oldest_counts_and_logs_what_it_dropped(
        start_broker, tmp_path: Path) -> None:
    up = start_broker()
    with FaultProxy(("127.0.0.1", up.port)) as proxy:
        proxy.refuse()
        bp = start_broker(_pressure_config(proxy.port, "drop_oldest"))
        out = bp.cli("pub", "sensors/a", "-q", "1", "-l", input=_numbered_lines(0, 1000))
        assert out.returncode == 0, out.stderr  # every one confirmed, then some dropped
        before = wait_status(bp, "site", lambda b: b["dropped"] > 0)
        bp.wait_log("durable group 'bridge.site'")
        proxy.restore()
        after = wait_status(bp, "site", lambda b: b["connected"]
                            and b["backlog_messages"] == 0)
        got = {int(line.split()[0]) for line in local_numbers(up, "gw1/#", 1)}
        assert 999 in got and len(got) < 1000  # the newest arrived, the oldest went
        assert after["dropped"] >= before["dropped"] > 0
        assert len(got) + after["dropped"] >= 1000


def test_retention_pressure_block_holds_publishers_and_loses_nothing(
        start_broker, tmp_path: Path) -> None:
    up = start_broker()
    with FaultProxy(("127.0.0.1", up.port)) as proxy:
        proxy.refuse()
        bp = start_broker(_pressure_config(proxy.port, "block"))
        first, held = _fill_until_held(bp)
        publisher = bp.spawn("pub", "sensors/a", "-q", "1", "-l")
        assert publisher.stdin is not None
        publisher.stdin.write(_numbered_lines(1000, 2000))
        publisher.stdin.close()
        # other topics flow while the bridge's are held
        other = bp.cli("pub", "elsewhere/x", "fine", "-q", "1", timeout=10)
        assert other.returncode == 0, other.stderr
        assert publisher.poll() is None  # still waiting for its confirms
        assert held["dropped"] == 0
        proxy.restore()
        for pub in (first, publisher):
            assert pub.wait(60) == 0, pub.stderr.read() if pub.stderr else ""
        final = wait_status(bp, "site", lambda b: b["backlog_messages"] == 0
                            and not b["holding"], timeout=30)
        assert final["dropped"] == 0
        got = {int(line.split()[0]) for line in local_numbers(up, "gw1/#", 2000)}
        assert got == set(range(2000))


@pytest.mark.slow
def test_bridge_bench_runs_every_system() -> None:
    """bench/bridge.py end to end with a small backlog: figures, no assertions on them."""
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "bench" / "bridge.py"), "--count", "2000",
                          "--rate", "200", "--seconds", "0.5", "--idle", "0.5", "--json"],
                         capture_output=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    text = out.stdout.decode()
    results = json.loads(text[text.index("\n["):])
    assert [r["system"] for r in results] == [
        "mosquitto bridge", "blipmq bridge (mqtt)", "blipmq bridge (native)"]
    assert all(r["missing"] == 0 and r["complete"] for r in results), results


def test_no_client_joins_or_deletes_a_bridge_group(start_broker) -> None:
    bp = start_broker({"bridge": [bridge_table("cloud", [f"127.0.0.1:{free_port()}"],
                                               ["sensors/# out 1"])]})
    assert bp.cli("pub", "sensors/a", "kept", "-q", "1").returncode == 0
    joined = bp.cli("sub", "sensors/#", "--group", "bridge.cloud", "-q", "1", "-W", "2")
    assert joined.returncode != 0 and b"belong to bridges" in joined.stderr, joined
    deleted = bp.cli("unsub", "sensors/#", "--group", "bridge.cloud")
    assert deleted.returncode != 0 and b"belong to bridges" in deleted.stderr, deleted
    assert status(bp, "cloud")["backlog_messages"] == 1  # still the bridge's to forward


def test_the_group_of_a_bridge_taken_out_of_the_config_is_named_and_may_be_deleted(
        start_broker) -> None:
    config = {"bridge": [bridge_table("gone", [f"127.0.0.1:{free_port()}"], ["g/# out 1"])]}
    bp = start_broker(config)
    for n in range(3):
        assert bp.cli("pub", "g/a", f"m{n}", "-q", "1").returncode == 0
    bp.stop()
    bp = start_broker({}, data_dir=bp.data_dir)  # the [[bridge]] table removed
    said = [line for line in bp.log if "bridge.gone" in line]
    assert len(said) == 1 and "belongs to no configured bridge" in said[0], said
    assert "blipmq unsub 'g/#' --group bridge.gone" in said[0]
    joined = bp.cli("sub", "g/#", "--group", "bridge.gone", "-q", "1", "-W", "1")
    assert joined.returncode != 0 and b"belong to bridges" in joined.stderr, joined
    deleted = bp.cli("unsub", "g/#", "--group", "bridge.gone")
    assert deleted.returncode == 0, deleted.stderr
    groups = bp.cli("groups", "--json")
    assert json.loads(groups.stdout)["groups"] == [], groups.stdout


def test_a_restart_brings_no_older_retained_value_in_from_a_kept_session(start_broker) -> None:
    """`both`: a retained value published here while the link was down must stay the newest
    after a restart. The first link after a start used to SUBSCRIBE again to the session the
    upstream kept, which sent its retained value back in, older than the one here."""
    with Mosquitto() as up, FaultProxy(up.address) as proxy:
        config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                          ["edge/# both 1"])]}
        bp = start_broker(config)
        wait_status(bp, "cloud", lambda b: b["connected"])
        assert bp.cli("pub", "-r", "edge/ret", "v1", "-q", "1").returncode == 0
        wait_status(bp, "cloud", lambda b: b["forwarded"] >= 1)
        proxy.refuse()
        wait_status(bp, "cloud", lambda b: not b["connected"])
        assert bp.cli("pub", "-r", "edge/ret", "v2", "-q", "1").returncode == 0
        assert bp.stop() == 0
        bp = start_broker(config, data_dir=bp.data_dir)
        proxy.restore()
        wait_status(bp, "cloud", lambda b: b["connected"] and b["backlog_messages"] == 0)
        # the kept session still brings new messages in, after anything a SUBSCRIBE sent
        pub = mqtt_client(up.port)
        pub.publish("edge/marker", b"after", qos=1).wait_for_publish(5)
        pub.disconnect()
        pub.loop_stop()
        assert local_numbers(bp, "edge/marker", 1) == {b"after"}
        here = bp.cli("sub", "edge/ret", "-C", "1", "-W", "5")
        assert here.stdout == b"v2\n", here
        with Collector(up.port, "edge/ret") as there:
            assert there.wait_count(1, 10)
            assert [m.payload for m in there.messages()] == [b"v2"]


def test_a_new_session_brings_no_older_retained_value_in_over_one_not_forwarded_yet(
        start_broker) -> None:
    """`both`, a new upstream session (the first link, a failover, a session lost): its
    SUBSCRIBE brings in the upstream's retained values, which are older than one published
    here while the link was down and not forwarded yet. The older one replaced ours here,
    ours then replaced it there: the two brokers disagreed for good (h20 #5; local OLD,
    upstream NEW). It is not stored now (counted as superseded), and both end with NEW."""
    with Mosquitto() as up, FaultProxy(up.address) as proxy:
        pub = mqtt_client(up.port)
        pub.publish("state/lamp", b"OLD", qos=1, retain=True).wait_for_publish(5)
        proxy.refuse()
        bp = start_broker({"bridge": [bridge_table("c", [f"127.0.0.1:{proxy.port}"],
                                                   ["state/# both 1"])]})
        assert bp.cli("pub", "-r", "state/lamp", "NEW", "-q", "1").returncode == 0
        proxy.restore()
        wait_status(bp, "c", lambda b: b["connected"] and b["forwarded"] >= 1
                    and b["superseded"] == 1)
        here = bp.cli("sub", "state/lamp", "-C", "1", "-W", "5")
        assert here.stdout == b"NEW\n", here
        with Collector(up.port, "state/lamp") as there:
            assert there.wait_count(1, 10)
            assert [m.payload for m in there.messages()] == [b"NEW"]
        # a later retained value from the upstream is stored as ever
        pub.publish("state/lamp", b"LATER", qos=1, retain=True).wait_for_publish(5)
        pub.disconnect()
        pub.loop_stop()
        assert local_numbers(bp, "state/lamp", 2) == {b"NEW", b"LATER"}  # never OLD
        here = bp.cli("sub", "state/lamp", "-C", "1", "-W", "5")
        assert here.stdout == b"LATER\n", here
        assert bp.metric("blipmq_bridge_superseded_total", bridge="c") == 1


def test_retention_keeps_its_cap_under_sustained_load_with_a_bridge(start_broker) -> None:
    """A bridge (its upstream down) has a durable group and a retained state topic, carried
    into each new segment: retention waits for those records to be written instead of
    skipping its round, so a log filling a segment or more per round stays near its cap.
    It grew to 70-100 x the cap before, until the publishers stopped."""
    cap = 256 << 10
    bp = start_broker({"wal": {"segment_bytes": 64 << 10, "retention_bytes": cap,
                               "maintenance_interval_ms": 100},
                       "bridge": [bridge_table("down", [f"127.0.0.1:{free_port()}"],
                                               ["s/# out 1"])]})
    wal = bp.data_dir / "wal"
    peak = 0
    lines = b"\n".join(b"%06d" % n + b"x" * 1000 for n in range(512)) + b"\n"
    for _ in range(16):  # 8 MiB of QoS 1 messages on a topic the bridge does not take
        out = bp.cli("pub", "o/x", "-q", "1", "-l", input=lines)
        assert out.returncode == 0, out.stderr
        peak = max(peak, _size(wal))
    assert peak < 16 * cap, f"the log reached {peak} bytes against a cap of {cap}"


def _size(directory: Path) -> int:
    """The bytes of a directory's files (one deleted meanwhile counts 0)."""
    total = 0
    for f in directory.iterdir():
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_a_publisher_held_by_the_block_policy_is_not_closed_as_silent(start_broker) -> None:
    """An MQTT publisher held back by a bridge's hold (`backlog = "block"`): the broker does
    not read it meanwhile, so its PINGREQs wait unread; that silence is the broker's and
    must not close it as a keepalive timeout (it did after 1.5 x its keepalive, and its
    will went out as if the device had died)."""
    from mqttpeer import Raw

    from blipmq_server.mqtt.packets import PingReq, Publish

    config = _pressure_config(free_port(), "block")
    config["mqtt"] = {"enabled": True, "port": 0}
    bp = start_broker(config)
    first, _ = _fill_until_held(bp)
    assert bp.mqtt_port is not None
    c = Raw(bp.mqtt_port)
    c.connect("held-device", keepalive=1)
    c.send(Publish("sensors/a", b"held", qos=1, packet_id=1))
    for _ in range(6):  # 3 s: twice 1.5 x the keepalive, pinging as a device does
        c.send(PingReq())
        with pytest.raises(AssertionError, match="no packet arrived"):
            c.recv(timeout=0.5)  # neither PUBACK nor PINGRESP: nothing is read
    assert bp.metric('blipmq_connections_closed_total{reason="keepalive_timeout"}') == 0
    c.sock.settimeout(0)
    with pytest.raises(BlockingIOError):
        c.sock.recv(1)  # still open (not even an EOF waiting)
    first.kill()  # still held: the upstream never came
    first.wait()
