"""Durable QoS 1 groups in the pure core, over a real log in a temporary directory."""

from __future__ import annotations

from pathlib import Path

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.protocol.codec import (
    ErrorCode,
    Message,
    decode_one,
    encode_deliver,
    encode_publish,
    message_record,
)
from blipmq_server.wal.log import Log


class Setup:
    def __init__(self, path: Path, **limits: int) -> None:
        self.path = path
        self.log = Log(str(path))
        self.broker = Broker(Limits(**limits), log=self.log)
        self.found = self.log.open(on_record=self.broker.recover)

    def publish(self, topic: str, *payloads: bytes, qos: int = 1, ttl: int = 0) -> None:
        recs = [message_record(Message(topic, p, qos, ttl)) for p in payloads]
        res = self.broker.publish(decode_one(encode_publish(recs)).messages, 0, 1000)
        assert res.refusal is None

    def commit(self) -> None:
        batch = self.log.take_batch()
        if batch is not None:
            batch.write(self.log.disk, True)
            self.log.commit(batch)

    def take(self, consumer, now: int = 0, limit: int = 1000) -> list[tuple[int, int, bytes]]:
        records = self.broker.take(consumer, limit, 1 << 30, now, 1000)
        if not records:
            return []
        frame = decode_one(encode_deliver(consumer.sub_id, records))
        return [(d.offset, d.delivery_count, d.payload) for d in frame.messages]

    def reopen(self, **limits: int) -> Setup:
        self.commit()
        self.log.close()
        return Setup(self.path, **limits)


def test_group_reads_from_the_log_and_survives_a_restart(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.broker.subscribe("conn", "jobs", "g", qos=1).consumer
    s.publish("jobs", b"a", b"b", b"c")
    s.publish("other", b"x")
    assert s.take(c) == []  # nothing is delivered before it is in the log
    s.commit()
    got = s.take(c)
    assert [(p, n) for _, n, p in got] == [(b"a", 1), (b"b", 1), (b"c", 1)]
    assert s.broker.ack("conn", c.sub_id, (got[0][0],), 0)
    s2 = s.reopen()
    assert [g.group for g in s2.broker.durable_groups] == ["g"]
    c2 = s2.broker.subscribe("conn2", "jobs", "g", qos=1).consumer
    again = s2.take(c2)
    assert [p for _, _, p in again] == [b"b", b"c"]  # acked "a" is not delivered again


def test_group_created_after_messages_starts_at_the_end(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.publish("jobs", b"old")
    s.commit()
    c = s.broker.subscribe("conn", "jobs", "g", qos=1).consumer
    s.publish("jobs", b"new")
    s.commit()
    assert [p for _, _, p in s.take(c)] == [b"new"]


def test_credit_window_and_ack(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.broker.subscribe("conn", "t", "g", qos=1, credit=2).consumer
    s.publish("t", b"1", b"2", b"3", b"4")
    s.commit()
    first = s.take(c)
    assert [p for _, _, p in first] == [b"1", b"2"]
    assert not s.broker.has_work(c) and s.take(c) == []
    assert s.broker.ack("conn", c.sub_id, (first[0][0],), 0)
    assert s.broker.has_work(c)
    assert [p for _, _, p in s.take(c)] == [b"3"]


def test_unacked_deliveries_come_back_with_backoff_then_dead_letter(tmp_path: Path) -> None:
    s = Setup(tmp_path, retry_backoff_ms=100, retry_backoff_max_ms=1000, max_retries=3)
    c = s.broker.subscribe("conn", "t", "g", qos=1).consumer
    dlq = s.broker.subscribe("ops", "$dlq/t").consumer
    s.publish("t", b"poison")
    s.commit()
    assert [n for _, n, _ in s.take(c, now=0)] == [1]
    assert s.broker.redeliver(99, 0) == [] and s.take(c, now=99) == []
    assert s.broker.redeliver(100, 0)  # deadline 100 ms after the first delivery
    assert [n for _, n, _ in s.take(c, now=100)] == [2]
    assert s.broker.redeliver(299, 0) == []  # the second deadline is 200 ms later
    s.broker.redeliver(300, 0)
    assert [n for _, n, _ in s.take(c, now=300)] == [3]
    s.broker.redeliver(700, 0)  # third delivery unacked: max_retries reached
    assert s.take(c, now=700) == []
    assert [p for _, _, p in s.take(dlq)] == [b"poison"]
    assert s.broker.counters.dead_lettered == 1 and s.broker.counters.redelivered == 2


def test_disconnect_returns_deliveries_to_the_group(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    first = s.broker.subscribe("c1", "t", "g", qos=1).consumer
    second = s.broker.subscribe("c2", "t", "g", qos=1).consumer
    s.publish("t", b"x", b"y")
    s.commit()
    assert len(s.take(first)) == 2
    s.broker.disconnect("c1")
    back = s.take(second)
    assert [(p, n) for _, n, p in back] == [(b"x", 2), (b"y", 2)]
    assert not s.broker.ack("c1", first.sub_id, (back[0][0],), 0)  # gone: not its ack


def test_unsub_deletes_a_durable_group_durably(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.broker.subscribe("conn", "t", "g", qos=1)
    assert s.broker.unsubscribe("admin", topic_filter="t", group="g").count == 1
    s2 = s.reopen()
    assert s2.broker.durable_groups == ()


def test_qos1_needs_a_group_and_the_log(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    assert s.broker.subscribe("c", "t", qos=1).refusal.code == ErrorCode.UNSUPPORTED
    no_log = Broker()
    assert no_log.subscribe("c", "t", "g", qos=1).refusal.code == ErrorCode.UNSUPPORTED


def test_floor_bounds_retention(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.broker.subscribe("conn", "t", "g", qos=1).consumer
    s.publish("t", b"1", b"2")
    s.commit()
    got = s.take(c)
    assert s.broker.durable_floor() == got[0][0]
    s.broker.ack("conn", c.sub_id, tuple(o for o, _, _ in got), 0)
    assert s.broker.durable_floor() == got[-1][0] + 1
