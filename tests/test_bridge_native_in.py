"""In rules over the native protocol: a second BlipMQ as the upstream, its durable group
holding what comes while the link is cut or the local broker is down (SIGKILLed)."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess
from tests.faultproxy import FaultProxy
from tests.test_bridge import bridge_table, local_numbers, wait_status
from tests.upstream import free_port, numbered


def _publish_up(up: BrokerProcess, first: int, last: int) -> None:
    lines = b"".join(numbered(n, 40) + b"\n" for n in range(first, last))
    out = up.cli("pub", "site1/cmd/x", "-q", "1", "-l", input=lines, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_native_in_rule_loses_nothing_through_cuts_and_a_local_sigkill(
        start_broker, tmp_path: Path) -> None:
    total = 3_000
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    with FaultProxy(("127.0.0.1", port)) as proxy:
        config = {"bridge": [bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                          ["cmd/# in 1 '' site1/"], protocol="blipmq")]}
        data = tmp_path / "edge"
        bp = start_broker(config, data_dir=data)
        wait_status(bp, "cloud", lambda b: b["connected"])
        _publish_up(up, 0, 1_000)
        wait_status(bp, "cloud", lambda b: b["received"] > 100)
        proxy.cut()  # mid-stream: what was not ACKed yet comes again on the next link
        _publish_up(up, 1_000, 2_000)
        wait_status(bp, "cloud", lambda b: b["connected"] and b["received"] >= 1_500)
        bp.proc.send_signal(signal.SIGKILL)
        bp.proc.wait(10)
        _publish_up(up, 2_000, total)  # the upstream's group keeps them meanwhile
        bp = start_broker(config, data_dir=data)
        got = local_numbers(bp, "cmd/#", total)
        assert {int(line.split()[0]) for line in got} == set(range(total))
        st = wait_status(bp, "cloud", lambda b: b["connected"])
        assert st["refused"] == 0


def test_native_in_keeps_retain_and_out_rules_forward_only_local_messages(
        start_broker, tmp_path: Path) -> None:
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    bp = start_broker({"bridge": [bridge_table(
        "cloud", [f"127.0.0.1:{port}"], ["cmd/# in 1 '' site1/", "sensors/# out 1 '' site1/"],
        protocol="blipmq")]})
    wait_status(bp, "cloud", lambda b: b["connected"])
    out = up.cli("pub", "site1/cmd/lamp", "on", "-q", "1", "-r")
    assert out.returncode == 0, out.stderr
    wait_status(bp, "cloud", lambda b: b["received"] == 1)
    # a new local subscriber gets the value as the topic's retained one
    got = bp.cli("sub", "cmd/lamp", "-C", "1", "-W", "10", "-v")
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == b"cmd/lamp on"
    # the out rule forwards local messages, never the one that came in
    pub = bp.cli("pub", "sensors/t", "local", "-q", "1")
    assert pub.returncode == 0, pub.stderr
    wait_status(bp, "cloud", lambda b: b["forwarded"] == 1 and b["backlog_messages"] == 0)
    seen = up.cli("sub", "site1/#", "--from", "earliest", "-W", "1", "-v")
    assert sorted(seen.stdout.splitlines()) == [b"site1/cmd/lamp on", b"site1/sensors/t local"]
    # the upstream's group deleted under the bridge: it subscribes again and goes on
    gone = up.cli("unsub", "site1/cmd/#", "--group", "blipmq-bridge-cloud")
    assert gone.returncode == 0, gone.stderr
    wait_status(bp, "cloud", lambda b: b["reconnects"] == 1 and b["connected"])
    out = up.cli("pub", "site1/cmd/lamp", "off", "-q", "1")
    assert out.returncode == 0, out.stderr
    wait_status(bp, "cloud", lambda b: b["received"] == 2)


def test_a_refused_native_in_subscription_is_named_and_the_out_rules_still_flow(
        start_broker, tmp_path: Path) -> None:
    port = free_port()
    digest = "blake2b:" + hashlib.blake2b(b"k-edge").hexdigest()
    keys = {"auth": {"keys": [{"name": "edge", "hash": digest, "publish": ["site1/#"],
                               "subscribe": ["site1/sensors/#"]}]}}
    up = start_broker({"server": {"port": port}, **keys}, data_dir=tmp_path / "up")
    bp = start_broker({"bridge": [bridge_table(
        "cloud", [f"127.0.0.1:{port}"], ["cmd/# in 1 '' site1/", "sensors/# out 1 '' site1/"],
        protocol="blipmq", password="k-edge")]})
    st = wait_status(bp, "cloud", lambda b: b["connected"] and "refused" in b["last_error"])
    assert "site1/cmd/#" in st["last_error"]
    pub = bp.cli("pub", "sensors/t", "still flows", "-q", "1")
    assert pub.returncode == 0, pub.stderr
    wait_status(bp, "cloud", lambda b: b["forwarded"] == 1)
    assert up.proc.poll() is None


def test_a_native_in_message_on_a_local_topic_too_long_is_refused_and_acked(
        start_broker, tmp_path: Path) -> None:
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    bp = start_broker({"server": {"max_topic_bytes": 40}, "bridge": [bridge_table(
        "cloud", [f"127.0.0.1:{port}"], ["# in 1 long/ r2/"], protocol="blipmq")]})
    wait_status(bp, "cloud", lambda b: b["connected"])
    for topic, payload in (("r2/" + "x" * 60, "too long here"), ("r2/ok", "fine")):
        out = up.cli("pub", topic, payload, "-q", "1")
        assert out.returncode == 0, out.stderr
    wait_status(bp, "cloud", lambda b: b["received"] == 2 and b["refused"] == 1)
    assert bp.metric("blipmq_messages_refused_total") == 1  # as any refusal
    got = bp.cli("sub", "#", "--from", "earliest", "-W", "1", "-v")
    assert got.stdout.splitlines() == [b"long/ok fine"], got.stdout
    # both were acked upstream: the group there holds nothing more for the bridge
    groups = up.cli("groups", "--json")
    assert groups.returncode == 0, groups.stderr
    (group,) = json.loads(groups.stdout)["groups"]
    assert (group["group"], group["backlog"], group["in_flight"]) == (
        "blipmq-bridge-cloud", 0, 0), group


def test_a_backlog_waiting_upstream_comes_in_once_without_a_stall(start_broker,
                                                                 tmp_path: Path) -> None:
    """What the upstream's group held while the link was down comes in at once, each
    message once: deliveries that arrive with the SUBSCRIBED reply are stored, not left
    until the upstream sends them again (after its retry backoff, a second copy)."""
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    with FaultProxy(("127.0.0.1", port)) as proxy:
        bp = start_broker({"bridge": [bridge_table("cloud", [f"127.0.0.1:{proxy.port}"],
                                                   ["cmd/# in 1 '' site1/"],
                                                   protocol="blipmq", keepalive_s=60,
                                                   backoff_max_ms=300)]})
        # keepalive 60 s: no PING's answer wakes the reader soon after the connect, which
        # would hide deliveries left unread since the SUBSCRIBED reply
        wait_status(bp, "cloud", lambda b: b["connected"])
        proxy.refuse()
        wait_status(bp, "cloud", lambda b: not b["connected"])
        _publish_up(up, 0, 500)
        proxy.restore()
        # within the upstream's retry backoff (delivery.retry_backoff_ms, 5 s)
        st = wait_status(bp, "cloud", lambda b: b["received"] >= 500, timeout=4)
        assert st["received"] == 500, st
        got = bp.cli("sub", "cmd/#", "--from", "earliest", "-W", "1")
        assert len(got.stdout.splitlines()) == 500


def test_a_refused_message_in_a_batch_from_the_upstream_is_counted_once(
        start_broker, tmp_path: Path) -> None:
    """A batch from the upstream with a message the local broker refuses (over its
    server.max_message_bytes) in the middle: the bridge stores those after it (publishing
    the rest again), and blipmq_messages_refused_total counted the refused one and the rest
    of the batch, which then went in after all. Now the core counts the one it refused."""
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    with FaultProxy(("127.0.0.1", port)) as proxy:
        bp = start_broker({"server": {"max_message_bytes": 1024}, "bridge": [bridge_table(
            "cloud", [f"127.0.0.1:{proxy.port}"], ["cmd/# in 1 '' site1/"],
            protocol="blipmq", keepalive_s=60, backoff_max_ms=300)]})
        wait_status(bp, "cloud", lambda b: b["connected"])
        proxy.refuse()
        wait_status(bp, "cloud", lambda b: not b["connected"])
        # waiting upstream while the link is down: they come in as one batch
        lines = b"ok0\n" + b"x" * 2000 + b"\nok1\nok2\n"
        out = up.cli("pub", "site1/cmd/x", "-q", "1", "-l", input=lines, timeout=60)
        assert out.returncode == 0, out.stderr
        proxy.restore()
        st = wait_status(bp, "cloud", lambda b: b["received"] == 4 and b["refused"] == 1)
        assert st["connected"], st
        got = bp.cli("sub", "cmd/#", "--from", "earliest", "-W", "1")
        assert got.stdout.splitlines() == [b"ok0", b"ok1", b"ok2"], got.stdout
        assert bp.metric("blipmq_messages_refused_total") == 1


def test_native_retained_messages_in_past_the_local_retained_cap_are_stored_without_retain(
        start_broker, tmp_path: Path) -> None:
    """As over MQTT (test_bridge): the local retained store is full (the bridge's own state
    holds its one topic), and a retained message from a BlipMQ upstream was refused and
    ACKed, lost; now it is stored and delivered without retain."""
    port = free_port()
    up = start_broker({"server": {"port": port}}, data_dir=tmp_path / "up")
    bp = start_broker({"retained": {"max_topics": 1}, "bridge": [bridge_table(
        "cloud", [f"127.0.0.1:{port}"], ["cmd/# in 1 '' site1/"], protocol="blipmq")]})
    wait_status(bp, "cloud", lambda b: b["connected"])
    for n in range(3):
        out = up.cli("pub", f"site1/cmd/lamp{n}", f"on{n}", "-q", "1", "-r")
        assert out.returncode == 0, out.stderr
    st = wait_status(bp, "cloud", lambda b: b["received"] == 3)
    assert st["refused"] == 0, st
    got = bp.cli("sub", "cmd/#", "--from", "earliest", "-W", "1", "-v")
    assert sorted(got.stdout.splitlines()) == [b"cmd/lamp0 on0", b"cmd/lamp1 on1",
                                               b"cmd/lamp2 on2"], got
    kept = bp.cli("sub", "cmd/#", "-W", "1")  # retained values only
    assert kept.stdout == b"", kept.stdout
    assert bp.metric("blipmq_retained_refused_total") == 3
