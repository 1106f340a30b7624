"""Retained values end to end: `blipmq pub -r` against a real broker, SIGKILL restarts,
retention, and the bound on retained topics."""

from __future__ import annotations

import json
import signal

from blipmq_cli.exits import Exit


def json_lines(out: bytes) -> list[dict]:
    return [json.loads(line) for line in out.decode().splitlines()]


def test_retained_value_survives_sigkill_and_goes_to_new_subscribers_first(start_broker
                                                                            ) -> None:
    b = start_broker()
    for topic, value in [("dev/1/status", "online"), ("dev/2/status", "online"),
                         ("dev/1/status", "offline")]:
        res = b.cli("pub", "-r", "--qos", "1", topic, value)  # confirmed: durable
        assert res.returncode == 0, res.stderr
    assert b.cli("pub", "dev/2/status", "not retained").returncode == 0
    b.wait_metric("blipmq_retained_topics", 2)
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL

    b2 = start_broker(data_dir=b.data_dir)
    assert b2.metric("blipmq_retained_topics") == 2
    sub = b2.spawn("sub", "dev/+/status", "--count", "3", "--format", "json")
    b2.wait_metric("blipmq_retained_sent_total", 2)
    assert b2.cli("pub", "dev/3/status", "booting").returncode == 0
    out, err = sub.communicate(timeout=15)
    assert sub.returncode == 0, err
    got = json_lines(out)
    assert [(m["topic"], m["payload"], m.get("retained", False)) for m in got] == [
        ("dev/2/status", "online", True), ("dev/1/status", "offline", True),
        ("dev/3/status", "booting", False)]
    assert all(m["timestamp_ms"] > 1_700_000_000_000 for m in got)


def test_an_empty_retained_publish_clears_the_topic(start_broker) -> None:
    b = start_broker()
    assert b.cli("pub", "--retain", "flags/dark", "on").returncode == 0
    assert b.cli("pub", "--retain", "flags/beta", "on").returncode == 0
    assert b.cli("pub", "-r", "flags/dark", "").returncode == 0
    b.wait_metric("blipmq_retained_topics", 1)
    res = b.cli("sub", "flags/#", "--count", "1", "--format", "json", "--timeout", "10")
    assert res.returncode == 0, res.stderr
    assert [(m["topic"], m["payload"]) for m in json_lines(res.stdout)] == [("flags/beta", "on")]


def test_retention_keeps_the_current_value(start_broker) -> None:
    cfg = {"wal": {"segment_bytes": 4096, "retention_bytes": 16384,
                   "maintenance_interval_ms": 100}}
    b = start_broker(cfg)
    assert b.cli("pub", "-r", "--qos", "1", "cfg/rate", "5").returncode == 0
    first = b.metric("blipmq_wal_size_bytes")
    noise = "".join(f"noise line {i:05d} padded to about sixty bytes ........\n"
                    for i in range(2000))
    assert b.cli("pub", "noise", "--lines", "--qos", "1", "-",
                 input=noise.encode()).returncode == 0
    assert b.metric("blipmq_wal_size_bytes") > first
    # wait until retention has deleted the segment the original publish was in
    b.wait_log("wal retention removed 00000000000000000001.seg")
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b2 = start_broker(cfg, data_dir=b.data_dir)
    res = b2.cli("sub", "cfg/rate", "--count", "1", "--format", "json", "--timeout", "10")
    assert res.returncode == 0, res.stderr
    (m,) = json_lines(res.stdout)
    assert (m["payload"], m["offset"], m["retained"]) == ("5", 1, True)


def test_retained_topics_past_the_bound_are_refused_with_one_line(start_broker) -> None:
    b = start_broker({"retained": {"max_topics": 1}})
    assert b.cli("pub", "-r", "a", "1").returncode == 0
    res = b.cli("pub", "-r", "b", "1")
    assert res.returncode == Exit.REFUSED
    assert res.stderr.decode().count("\n") == 1 and "retained.max_topics" in res.stderr.decode()
    assert b.cli("pub", "-r", "a", "2").returncode == 0  # a topic that has one may change it
    assert b.cli("pub", "b", "not retained").returncode == 0
    assert b.metric("blipmq_retained_refused_total") == 1
