"""QoS 2 bridging against a real mosquitto upstream: out exactly once (with and without link
cuts and blackholes), in exactly once (a link cut in the middle), at least once across a
SIGKILL of the local broker; the local copy keeps QoS 2 for local MQTT subscribers."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from tests.faultproxy import FaultProxy
from tests.test_bridge import KEEPALIVE, bridge_table, publish_numbers, wait_status
from tests.upstream import HOST, Collector, Mosquitto, Received, numbered

# mosquitto must keep whatever waits for a session (its default drops past 1,000)
_UNLIMITED = ["max_queued_messages 0"]


class QosCollector(Collector):
    """A Collector that also notes the QoS each message came at."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qos_seen: set[int] = set()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self.qos_seen.add(msg.qos)
        self._record(Received(msg.topic, bytes(msg.payload), time.time_ns(), bool(msg.dup)))


def test_out_qos2_reaches_mosquitto_exactly_once(start_broker) -> None:
    total = 2_000
    with Mosquitto(extra=_UNLIMITED) as up, \
            QosCollector(up.port, "site1/#", qos=2) as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["sensors/# out 2 '' site1/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        publish_numbers(bp, 0, total)
        assert seen.wait_distinct(total, 20), seen.tally(total)
        final = wait_status(bp, "cloud", lambda b: b["forwarded"] == total
                            and b["in_flight"] == 0 and b["backlog_messages"] == 0)
        assert seen.wait_quiet(0.5, 10)
        result = seen.tally(total)
        assert result.complete and result.duplicates == 0, result
        assert seen.qos_seen == {2}
        assert final["unexpected_acks"] == 0 and final["redelivered"] == 0, final


def test_the_window_covers_every_out_rule(start_broker) -> None:
    """Four out rules (QoS 2 and 1) with a backlog each, the default window of 20: never
    more than 20 unacknowledged in all, so mosquitto (which drops what comes past its
    max_inflight_messages of 20, acknowledging it with reason 0x97, which a 3.1.1 client
    reads as a success) gets every message."""
    total = 400
    rules = ["sensors/t0 out 2 '' site1/", "sensors/t1 out 2 '' site1/",
             "sensors/t2 out 1 '' site1/", "sensors/t3 out 1 '' site1/"]
    with Mosquitto(extra=_UNLIMITED) as up, FaultProxy(up.address) as proxy, \
            QosCollector(up.port, "site1/#", qos=2) as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{proxy.port}"], rules)]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        proxy.refuse()
        wait_status(bp, "cloud", lambda b: not b["connected"])
        publish_numbers(bp, 0, total)  # a backlog on every rule
        proxy.restore()
        assert seen.wait_distinct(total, 30), seen.tally(total)
        result = seen.tally(total)
        assert result.complete, result.missing[:20]


@pytest.mark.slow
def test_out_qos2_through_cuts_and_blackholes_no_loss_no_duplicates(start_broker) -> None:
    """Within one run the upstream session outlives each link: what had its PUBREC gets
    PUBREL again, the rest goes out again under the same packet id, so mosquitto delivers
    each message once however the links end."""
    total = 3_000
    with Mosquitto(extra=_UNLIMITED) as up, FaultProxy(up.address) as proxy, \
            Collector(up.port, "site1/#", qos=2) as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{proxy.port}"], ["sensors/# out 2 '' site1/"],
            max_rate=1000)]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        publish_numbers(bp, 0, total)
        broken = 0
        for step, at in enumerate((400, 1000, 1600, 2200)):
            wait_status(bp, "cloud", lambda b, n=at: b["forwarded"] >= n and b["connected"])
            if step % 2:
                proxy.blackhole()  # silent: only the keepalive notices
                wait_status(bp, "cloud", lambda b: not b["connected"],
                            timeout=3 * KEEPALIVE + 5)
                proxy.restore()
            else:
                proxy.cut()  # RST mid-stream
            broken += 1
        assert seen.wait_distinct(total, 30), seen.tally(total)
        final = wait_status(bp, "cloud", lambda b: b["forwarded"] == total
                            and b["backlog_messages"] == 0 and b["in_flight"] == 0)
        assert seen.wait_quiet(1.0, 10)
        result = seen.tally(total)
        print(f"\nout 2 through {broken} broken links: {result.distinct} distinct, "
              f"{result.duplicates} duplicates, {final['reconnects']} reconnects, "
              f"{final['redelivered']} sent again")
        assert final["reconnects"] >= broken
        assert result.complete, result.missing[:20]
        assert result.duplicates == 0, result


def _mosquitto_pub(port: int, topic: str, lines: bytes) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["mosquitto_pub", "-h", HOST, "-p", str(port), "-V", "mqttv311", "-q", "2", "-l",
         "-t", topic], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    assert proc.stdin is not None

    def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(lines)
            proc.stdin.close()
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    return proc


def test_in_qos2_each_message_logged_once_through_a_cut(start_broker) -> None:
    total = 2_000
    with Mosquitto(extra=_UNLIMITED) as up, FaultProxy(up.address) as proxy:
        bp = start_broker({"mqtt": {"enabled": True, "port": 0}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{proxy.port}"], ["cmd/# in 2 '' site1/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        assert bp.mqtt_port is not None
        with QosCollector(bp.mqtt_port, "cmd/#", qos=2, clean_session=True) as local:
            lines = b"".join(numbered(n, 40) + b"\n" for n in range(total))
            pub = _mosquitto_pub(up.port, "site1/cmd/x", lines)
            cuts = 0
            for at in (300, 900, 1500):
                wait_status(bp, "cloud", lambda b, n=at: b["received"] >= n and b["connected"])
                proxy.cut()
                cuts += 1
            assert pub.wait(30) == 0, pub.stderr.read() if pub.stderr else ""
            assert local.wait_distinct(total, 30), local.tally(total)
            final = wait_status(bp, "cloud", lambda b: b["received"] == total
                                and b["connected"])
            assert local.wait_quiet(1.0, 10)
            result = local.tally(total)
            print(f"\nin 2 through {cuts} cuts: {result.distinct} distinct, "
                  f"{result.duplicates} duplicates; {final['duplicates_in']} copies sent "
                  f"again by the upstream and not logged twice")
            assert result.complete, result.missing[:20]
            assert result.duplicates == 0, result
            assert local.qos_seen == {2}  # logged as QoS 2: local subscribers get QoS 2
        # the log holds each once too
        out = bp.cli("sub", "cmd/#", "--from", "earliest", "-W", "2", timeout=60)
        logged = out.stdout.splitlines()
        assert len(logged) == total and len(set(logged)) == total, len(logged)


def test_both_at_qos2_does_not_loop(start_broker) -> None:
    with Mosquitto(extra=_UNLIMITED) as up, Collector(up.port, "shared/#", qos=2) as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["shared/# both 2"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        assert bp.cli("pub", "shared/a", "from-edge", "-q", "1").returncode == 0
        pub = _mosquitto_pub(up.port, "shared/b", b"from-cloud\n")
        assert pub.wait(10) == 0
        wait_status(bp, "cloud", lambda b: b["received"] == 1 and b["forwarded"] == 1
                    and b["skipped"] == 1)
        assert seen.wait_quiet(1.0, 10)
        assert sorted((m.topic, m.payload) for m in seen.messages()) == [
            ("shared/a", b"from-edge"), ("shared/b", b"from-cloud")]


@pytest.mark.slow
def test_out_qos2_across_a_local_sigkill_is_at_least_once(start_broker,
                                                           tmp_path: Path) -> None:
    """The QoS 2 link state is not kept across a restart here: the first link after it
    releases what the upstream may hold from before (PUBREL), then what was not PUBCOMPed
    is sent again. Failed twice in about 80 runs before that: see the next test."""
    total = 3_000
    with Mosquitto(extra=_UNLIMITED) as up, Collector(up.port, "site1/#", qos=2) as seen:
        config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{up.port}"],
                                          ["sensors/# out 2 '' site1/"],
                                          max_rate=2000)]}
        data = tmp_path / "edge"
        bp = start_broker(config, data_dir=data)
        wait_status(bp, "cloud", lambda b: b["connected"])
        publish_numbers(bp, 0, total)
        wait_status(bp, "cloud", lambda b: b["forwarded"] >= 1000)
        bp.proc.send_signal(signal.SIGKILL)
        bp.proc.wait(10)
        bp = start_broker(config, data_dir=data)
        assert seen.wait_distinct(total, 30), seen.tally(total)
        final = wait_status(bp, "cloud", lambda b: b["backlog_messages"] == 0
                            and b["in_flight"] == 0)
        assert seen.wait_quiet(1.0, 10)
        result = seen.tally(total)
        print(f"\nout 2 across a SIGKILL: {result.distinct} distinct, "
              f"{result.duplicates} duplicates")
        assert result.complete, result.missing[:20]
        # what was not PUBCOMPed at the kill (the window, 20; released then and sent
        # again), and PUBCOMPs whose ack was not in the log yet: measured 5-28 in 8 runs;
        # three windows is the sanity bound
        assert result.duplicates <= 3 * 20, result
        assert final["unexpected_acks"] == 0, final


def test_a_puback_does_not_end_a_qos2_message(start_broker) -> None:
    """A broken upstream that answers a QoS 2 PUBLISH with PUBACK (and PUBACKs an id
    nothing waits for): neither counts as forwarded; both are unexpected_acks, and the
    message stays in flight for its PUBREC."""
    from blipmq_server.mqtt import codec as mqtt_codec
    from blipmq_server.mqtt.packets import PubAck
    from tests.upstream import StandIn

    published = threading.Event()

    def puback(conn: Any, packet: Any) -> None:
        if packet.qos == 2:
            conn.sendall(mqtt_codec.encode(PubAck(packet.packet_id))
                         + mqtt_codec.encode(PubAck(packet.packet_id % 65535 + 7)))
            published.set()

    up = StandIn(on_publish=puback)
    try:
        bp = start_broker({"bridge": [bridge_table(
            "broken", [f"127.0.0.1:{up.port}"], ["sensors/# out 2"])]})
        wait_status(bp, "broken", lambda b: b["connected"])
        assert bp.cli("pub", "sensors/a", "one", "-q", "1").returncode == 0
        assert published.wait(10)
        final = wait_status(bp, "broken", lambda b: b["unexpected_acks"] >= 2)
        assert final["forwarded"] == 0 and final["in_flight"] == 1, final
        bp.wait_log("PUBACK for packet id")
    finally:
        up.close()


def _hold_pubrecs(port: int, client_id: str, messages: list[tuple[int, str, bytes]]) -> None:
    """What a bridge killed mid-window leaves in the upstream's session: QoS 2 PUBLISHes
    (packet id, topic, payload) PUBRECed there and never released. Sent under the bridge's
    client id, clean session 0; the connection then ends without a PUBREL."""
    from blipmq_server.mqtt import codec as mqtt_codec
    from blipmq_server.mqtt.packets import PubRec
    from tests.mqttpeer import Raw

    raw = Raw(port)
    try:
        raw.connect(client_id, clean=False, keepalive=60)
        raw.send_bytes(b"".join(mqtt_codec.encode_publish(topic.encode(), payload, 2, False,
                                                          False, pid)
                                for pid, topic, payload in messages))
        recs = {raw.expect(PubRec).packet_id for _ in messages}
        assert recs == {pid for pid, _, _ in messages}
    finally:
        raw.close()


def test_what_the_upstream_holds_from_before_a_restart_does_not_stall_the_link(
        start_broker, tmp_path: Path) -> None:
    """A bridge killed with a window of QoS 2 messages PUBRECed and not yet released, while
    the acks of the messages before them were not durable yet, comes back with those older
    ones first: new to mosquitto, which counts each against the 20 it lets a client have
    unreleased, all taken by what it still holds from before (they come later in the log).
    Past 20 it refuses (0x97) and closes the link, on every link again (a 3.1.1 client reads
    such a PUBREC as success: what it got through was lost). The old code either lost
    the first message or forwarded nothing for 30 s, reconnecting every second. The bridge
    now releases what the upstream may hold from before its start (PUBREL, each id) before
    it sends anything."""
    total = 200
    with Mosquitto(extra=_UNLIMITED) as up, FaultProxy(up.address) as proxy, \
            Collector(up.port, "site1/#", qos=2) as seen:
        config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                          ["sensors/# out 2 '' site1/"])]}
        data = tmp_path / "edge"
        proxy.refuse()
        bp = start_broker(config, data_dir=data)
        publish_numbers(bp, 0, total, topics=1)
        out = bp.cli("sub", "sensors/#", "--from", "earliest", "-W", "1", "-F",
                     "{offset} {topic} {payload}")
        logged = [line.split(" ", 2) for line in out.stdout.decode().splitlines()]
        assert len(logged) == total, out
        bp.proc.send_signal(signal.SIGKILL)
        bp.proc.wait(10)
        # the 20 after the first 20 were in flight, PUBRECed, at the kill
        _hold_pubrecs(up.port, "blipmq-bridge-cloud",
                      [(int(offset) % 65535 + 1, "site1/" + topic, payload.encode())
                       for offset, topic, payload in logged[20:40]])
        bp = start_broker(config, data_dir=data)
        proxy.restore()
        assert seen.wait_distinct(total, 30), seen.tally(total)
        final = wait_status(bp, "cloud", lambda b: b["backlog_messages"] == 0
                            and b["in_flight"] == 0)
        result = seen.tally(total)
        assert result.complete, result.missing[:20]
        # each of the 20 released is delivered then, and once more when its turn comes
        assert result.duplicates <= 20, result
        assert final["unexpected_acks"] == 0, final


def test_a_qos2_drain_at_the_default_window_is_not_held_by_delayed_acks(start_broker) -> None:
    """mosquitto leaves Nagle's algorithm on (``set_tcp_nodelay false``): it holds its next
    PUBREC or PUBCOMP until the TCP ACK of what it sent last, and with its window full the
    bridge sent nothing that ACK could ride on, so it came as a delayed ACK, up to 40 ms
    later. The old code forwarded these 20,000 QoS 2 messages at the default window (20)
    in 82 s, about 240 a second; now it ACKs at once while its window is full: 3-4 s here.
    The 30 s bound leaves the slowest machine room and still fails the old code."""
    total = 20_000
    with Mosquitto(extra=_UNLIMITED) as up, Collector(up.port, "site1/#", qos=0) as seen:
        bp = start_broker({"bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{up.port}"], ["sensors/# out 2 '' site1/"])]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        publish_numbers(bp, 0, total, topics=1)
        assert seen.wait_distinct(total, 30), seen.tally(total)
        final = wait_status(bp, "cloud", lambda b: b["forwarded"] == total)
        assert final["redelivered"] == 0 and final["reconnects"] == 0, final


def _killed_with_a_backlog(start_broker, tmp_path: Path, proxy: FaultProxy, total: int,
                           **extra: object) -> tuple[Path, dict]:
    """A bridge whose upstream (behind ``proxy``) kept its session, with ``total`` QoS 2
    messages queued while the link was refused, killed and not started again yet: returns
    its data directory and config."""
    config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                      ["sensors/# out 2 '' site1/"], **extra)]}
    data = tmp_path / "edge"
    bp = start_broker(config, data_dir=data)
    wait_status(bp, "cloud", lambda b: b["connected"])  # the upstream has the session
    proxy.refuse()
    wait_status(bp, "cloud", lambda b: not b["connected"])
    publish_numbers(bp, 0, total, topics=1)
    bp.proc.send_signal(signal.SIGKILL)
    bp.proc.wait(10)
    return data, config


def _released(bp: Any) -> list[int]:
    """How many ids each link's release began with, from the broker's log."""
    return [int(line.split("releasing the ")[1].split()[0])
            for line in list(bp.log) if "releasing the " in line]


def test_a_blipmq_upstream_answers_the_release_after_a_restart(start_broker,
                                                                tmp_path: Path) -> None:
    """The release of ids after a start against a BlipMQ upstream's MQTT listener, and
    larger than one chunk of PUBRELs: a backlog of 10,000 queued while the link was down
    (the upstream keeps the bridge's session from before), the broker killed, started
    again: every PUBREL has its PUBCOMP and then the backlog flows."""
    total = 10_000
    up = start_broker({"mqtt": {"enabled": True, "port": 0}})
    assert up.mqtt_port is not None
    with FaultProxy(("127.0.0.1", up.mqtt_port)) as proxy, \
            Collector(up.mqtt_port, "site1/#", qos=0) as seen:
        data, config = _killed_with_a_backlog(start_broker, tmp_path, proxy, total)
        bp = start_broker(config, data_dir=data)
        proxy.restore()
        assert seen.wait_distinct(total, 60), seen.tally(total)
        counts = _released(bp)
        assert len(counts) == 1 and counts[0] > total, counts
        final = wait_status(bp, "cloud", lambda b: b["backlog_messages"] == 0)
        assert final["unexpected_acks"] == 0 and final["reconnects"] == 0, final


@pytest.mark.parametrize("link", ["slow", "dropping"])
def test_the_release_after_a_start_ends_over_a_slow_or_dropping_uplink(
        start_broker, tmp_path: Path, link: str) -> None:
    """Three chunks of PUBRELs to release (17,001 ids), over a bad uplink.

    ``slow``: 400 ms each way (a satellite link). The CONNECT and the PINGREQ take 1.6 s
    of the 2 s connect timeout, each chunk 0.8 s more. The whole release was under that
    one timeout: every link timed out in it, and the bridge never forwarded again. Each
    chunk now has the timeout to itself.

    ``dropping``: every connection cut after 1.8 s, 250 ms each way. The CONNECT and the
    PINGREQ take 1 s, each chunk 0.5 s, so a link releases one or two chunks before it is
    cut. The release began again on every link and never ended; the ids already PUBCOMPed
    are now done, and the next link releases only the rest."""
    total = 15_000  # and two windows: 17,001 ids, three chunks
    up = start_broker({"mqtt": {"enabled": True, "port": 0}})
    assert up.mqtt_port is not None
    with FaultProxy(("127.0.0.1", up.mqtt_port)) as proxy, \
            Collector(up.mqtt_port, "site1/#", qos=0) as seen:
        data, config = _killed_with_a_backlog(
            start_broker, tmp_path, proxy, total, inflight=1000,
            connect_timeout_ms=2000 if link == "slow" else 10000)
        if link == "slow":
            proxy.delay(400)
        else:
            proxy.cut_after(1.8, delay_ms=250)
        bp = start_broker(config, data_dir=data)
        wait_status(bp, "cloud", lambda b: b["connected"], timeout=30)
        proxy.restore()
        assert seen.wait_distinct(total, 60), seen.tally(total)
        counts = _released(bp)  # the log's other records (the group's) lie in there too
        assert counts and total + 2001 <= counts[0] < total + 2100, counts
        if link == "slow":
            assert len(counts) == 1, counts
            final = wait_status(bp, "cloud", lambda b: b["backlog_messages"] == 0)
            assert final["unexpected_acks"] == 0 and final["reconnects"] == 0, final
        else:  # each link released the rest of what the one before it left
            assert len(counts) >= 2 and counts == sorted(set(counts), reverse=True), counts
