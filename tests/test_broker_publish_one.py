"""``Broker.publish`` of one message takes a short way (``_publish_one``) when nothing about
it is special. The same script of publishes, run once as it is and once with the short way
turned off, must leave both brokers in the same state: results, counters, queues, per-topic
usage, durable backlogs, the log's records. Each step is one PUBLISH of one message, so
every one of them reaches the short way first."""

from __future__ import annotations

from pathlib import Path

import pytest

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.broker.queue import Overflow
from blipmq_server.protocol.codec import (
    Message,
    RawMessage,
    decode_one,
    encode_publish,
    message_record,
)
from blipmq_server.wal.log import Log


def raw(topic: str, payload: bytes, qos: int = 0, ttl: int = 0,
        retain: bool = False) -> RawMessage:
    record = message_record(Message(topic, payload, qos, ttl, None, retain))
    return decode_one(encode_publish([record])).messages[0]  # type: ignore[union-attr]


def script(b: Broker) -> list[object]:
    """Subscriptions, then single-message publishes of every kind, with takes between."""
    seen: list[object] = []
    plain = b.subscribe(1, "a/+", credit=0).sub_id
    b.subscribe(2, "a/x", group="g")
    b.subscribe(3, "b", qos=1, group="durable", timestamp_ms=5)
    steps = [
        raw("a/x", b"first"),  # a topic never routed: the general way
        raw("a/x", b"second"),  # routed before: the short way
        raw("a/y", b"ttl", ttl=50),
        raw("b", b"durable", qos=1),
        raw("b", b"plain to a durable group"),
        raw("nobody", b"unrouted"),
        raw("nobody", b"unrouted again"),
        raw("a/x", b"kept", retain=True),  # retain: always the general way
        raw("a/x", b"x" * 300),  # over the queue's bytes: full, the general way
        raw("a/x", b"after"),
        raw("a/y", b"fills"),
        raw("a/y", b"one more than fits"),  # capacity 4: drop_oldest makes room
        raw("bad/+", b"invalid topic"),  # refused
        raw("a/y", b"expires", ttl=20),
        raw("a/x", b"lives"),
    ]
    for i, m in enumerate(steps):
        result = b.publish([m], now_ms=100 + i, timestamp_ms=1000 + i)
        seen.append(tuple(result))
        if i == 5:  # a durable group created between publishes: usage regroups
            b.subscribe(4, "nobody", qos=1, group="late", timestamp_ms=1005)
        if i in (3, 9):
            taken = b.deliver(1, 2, 1 << 20, 100 + i, 1000 + i)
            seen.append((taken.batches, taken.released))
    seen.append(b.tick(150))  # the expired messages of queues marked as expiring
    seen.append(b.deliver(1, 100, 1 << 20, 200, 2000).batches)
    seen.append(b.deliver(2, 100, 1 << 20, 200, 2000).batches)
    seen.append(b.counters)
    seen.append(b.usage.rows())
    seen.append(sorted((g.group, g.backlog) for g in b.durable_groups))
    seen.append(b.offset)
    seen.append(plain)
    return seen


def run(path: Path, short_way: bool, log_qos0: bool) -> tuple[list[object], list[bytes]]:
    log = Log(str(path))
    log.open()
    limits = Limits(capacity=4, capacity_bytes=400, overflow=Overflow.DROP_OLDEST,
                    log_qos0=log_qos0)
    b = Broker(limits, log=log)
    if not short_way:
        b._publish_one = lambda *args: None  # type: ignore[method-assign]
    seen = script(b)
    records = [seg_record for seg in log.segments for seg_record in seg.pending]
    log.close()
    return seen, records


@pytest.mark.parametrize("log_qos0", [True, False], ids=["qos0-logged", "qos0-not-logged"])
def test_one_message_the_short_way_is_the_general_way(tmp_path: Path, log_qos0: bool) -> None:
    short, short_records = run(tmp_path / "short", True, log_qos0)
    general, general_records = run(tmp_path / "general", False, log_qos0)
    assert short == general
    assert short_records == general_records
    assert any(isinstance(x, tuple) and x and x[0] == 1 for x in short)  # publishes happened
