"""Retained values in the pure core: kept, cleared, bounded, handed to new subscribers first,
and rebuilt from the log (also after retention deleted the segment of the original)."""

from __future__ import annotations

import random
from pathlib import Path

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.broker.queue import Overflow
from blipmq_server.broker.registry import Consumer
from blipmq_server.broker.retained import Retained
from blipmq_server.broker.storage import MemoryLog
from blipmq_server.broker.topics import matches
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import (
    FLAG_RETAIN,
    Delivery,
    ErrorCode,
    Message,
    RawMessage,
    Start,
    decode_one,
    encode_deliver,
    encode_publish,
    message_record,
)
from blipmq_server.wal.log import Log, LogOptions


def raw(topic: str, payload: bytes, *, retain: bool = True, qos: int = 0, ttl: int = 0
        ) -> RawMessage:
    record = message_record(Message(topic, payload, qos, ttl, retain=retain))
    return decode_one(encode_publish([record])).messages[0]  # type: ignore[union-attr]


def sub(b: Broker, *args, **kwargs) -> Consumer:
    consumer = b.consumer(b.subscribe(*args, **kwargs).sub_id)
    assert consumer is not None
    return consumer


def deliveries(b: Broker, consumer: Consumer) -> list[Delivery]:
    records = b.take(consumer, 10_000, 1 << 30, 0, 0)
    if not records:
        return []
    return list(decode_one(encode_deliver(1, records)).messages)  # type: ignore[union-attr]


def test_a_new_subscriber_gets_the_retained_value_of_every_matching_topic_first() -> None:
    b = Broker(log=MemoryLog())
    live = sub(b, 1, "status/#")
    b.publish([raw("status/a", b"up"), raw("status/b", b"down"), raw("other", b"x")], 0, 1000)
    b.publish([raw("status/a", b"up again")], 0, 2000)
    b.publish([raw("status/b", b"plain", retain=False)], 0, 3000)  # not retained: no change
    got = deliveries(b, live)
    assert [(d.payload, d.retained) for d in got] == [
        (b"up", False), (b"down", False), (b"up again", False), (b"plain", False)]
    newcomer = sub(b, 2, "status/+", timestamp_ms=5000)
    got = deliveries(b, newcomer)
    assert [(d.topic, d.payload, d.retained, d.timestamp_ms) for d in got] == [
        ("status/b", b"down", True, 1000), ("status/a", b"up again", True, 2000)]
    assert [d.offset for d in got] == [2, 4]  # the original publishes' log offsets
    b.publish([raw("status/a", b"live", retain=False)], 0, 6000)
    assert [(d.payload, d.retained) for d in deliveries(b, newcomer)] == [(b"live", False)]
    assert b.counters.retained_sent == 2


def test_an_empty_retained_publish_clears_the_value() -> None:
    b = Broker(log=MemoryLog())
    b.publish([raw("cfg/x", b"1"), raw("cfg/y", b"2")], 0, 1)
    live = sub(b, 1, "cfg/x")
    b.publish([raw("cfg/x", b"")], 0, 2)
    # the value, then the clearing publish (delivered like any message, as in MQTT)
    assert [(d.payload, d.retained) for d in deliveries(b, live)] == [(b"1", True), (b"", False)]
    assert [d.payload for d in deliveries(b, sub(b, 2, "cfg/#"))] == [b"2"]
    assert len(b.retained) == 1


def test_groups_do_not_get_retained_values() -> None:
    b = Broker(log=MemoryLog())
    b.publish([raw("jobs/a", b"r")], 0, 1)
    assert deliveries(b, sub(b, 1, "jobs/#", "workers")) == []
    assert deliveries(b, sub(b, 2, "jobs/#", "durable", qos=1)) == []
    assert [d.payload for d in deliveries(b, sub(b, 3, "jobs/#"))] == [b"r"]


def test_a_qos1_subscriber_acks_retained_values_like_any_delivery() -> None:
    log = MemoryLog()
    b = Broker(log=log)
    b.publish([raw("s/a", b"on", qos=1)], 0, 7)
    log.store()
    c = sub(b, 1, "s/#", qos=1)
    got = deliveries(b, c)
    assert [(d.payload, d.retained, d.delivery_count, d.timestamp_ms) for d in got] == [
        (b"on", True, 1, 7)]
    assert b.ack(1, c.sub_id, (got[0].offset,), 8)
    assert c.queue.inflight == {}


def test_replays_do_not_get_retained_values_ahead_of_the_log() -> None:
    log = MemoryLog()
    b = Broker(log=log)
    b.publish([raw("s/a", b"on")], 0, 7)
    log.store()
    got = deliveries(b, sub(b, 1, "s/#", start=Start.EARLIEST))
    assert [(d.payload, d.retained) for d in got] == [(b"on", False)]  # read from the log


def test_an_expired_retained_value_is_not_handed_out() -> None:
    b = Broker(log=MemoryLog())
    b.publish([raw("s/a", b"short", ttl=100), raw("s/b", b"long")], 0, 1000)
    assert [d.payload for d in deliveries(b, sub(b, 1, "s/#", timestamp_ms=1050))] == [
        b"short", b"long"]
    assert [d.payload for d in deliveries(b, sub(b, 2, "s/#", timestamp_ms=1100))] == [b"long"]
    assert len(b.retained) == 1


def test_retained_values_are_bounded_by_topics_and_bytes() -> None:
    b = Broker(Limits(retained_max_topics=2, retained_max_bytes=200), log=MemoryLog())
    assert b.publish([raw("a", b"1"), raw("b", b"2")], 0, 1).refusal is None
    res = b.publish([raw("a", b"new"), raw("c", b"3"), raw("d", b"4")], 0, 2)
    assert res.accepted == 1 and res.refusal is not None
    assert res.refusal.code == ErrorCode.LIMIT and "retained.max_topics" in res.refusal.text
    assert b.publish([raw("c", b"plain", retain=False)], 0, 3).refusal is None
    assert b.publish([raw("b", b"")], 0, 4).refusal is None  # clearing makes room
    assert b.publish([raw("c", b"3")], 0, 5).refusal is None
    res = b.publish([raw("c", b"x" * 300)], 0, 6)
    assert res.refusal is not None and "retained.max_bytes" in res.refusal.text
    assert len(b.retained) == 2 and b.retained.size <= 200
    assert b.counters.refused == 2  # the messages refused (a batch's rest is its caller's)


def test_the_core_counts_each_refused_message_once_not_the_rest_of_its_batch() -> None:
    """The core counted a refused message and the rest of its batch as refused, and the
    MQTT front took back the rest, which it publishes (MqttSession._goes_on). Now the core
    counts the message it refused; the rest of a batch was not looked at, and is the
    caller's to count (the native session counts it refused with it)."""
    b = Broker(Limits(retained_max_topics=1), log=MemoryLog())
    res = b.publish([raw("a", b"1"), raw("b", b"2"), raw("c", b"3"), raw("d", b"4")], 0, 1)
    assert res.accepted == 1 and res.refusal is not None
    assert b.counters.refused == 1 and b.counters.published == 1
    res = b.publish([raw("ok", b"", retain=False), raw("$SYS/bad", b"x", retain=False),
                     raw("later", b"y", retain=False)], 0, 2)
    assert res.accepted == 1 and res.refusal is not None
    assert res.refusal.code == ErrorCode.INVALID_TOPIC
    assert b.counters.refused == 2 and b.counters.published == 2


def test_unkept_routes_a_retained_message_past_the_cap_without_retain() -> None:
    """``publish(unkept=True)`` (the MQTT front's publishes and wills): a retained message
    the store has no room for is routed and logged as a live one, only its value not kept;
    counted as a retained refusal, not as a refused message."""
    log = MemoryLog()
    b = Broker(Limits(retained_max_topics=1), log=log)
    live = sub(b, 1, "#")
    res = b.publish([raw("a", b"1"), raw("b", b"2", qos=1), raw("c", b"3")], 0, 1,
                    unkept=True)
    assert (res.accepted, res.refusal, res.unkept, res.confirms) == (3, None, 2, 1)
    assert "retained.max_topics" in res.unkept_text
    assert b.counters.refused == 0 and b.retained.refused == 2
    assert list(b.retained.values) == [b"a"]
    assert [(d.topic, d.payload, d.retain) for d in deliveries(b, live)] == [
        ("a", b"1", True), ("b", b"2", False), ("c", b"3", False)]
    assert [r.body[0] & FLAG_RETAIN for r in log.records] == [FLAG_RETAIN, 0, 0]


def test_a_retained_publish_is_logged_even_when_qos0_is_not() -> None:
    log = MemoryLog()
    b = Broker(Limits(log_qos0=False), log=log)
    b.publish([raw("s", b"kept"), raw("s", b"gone", retain=False)], 0, 1)
    assert [r.body[0] & FLAG_RETAIN for r in log.records] == [FLAG_RETAIN]


def test_without_a_log_retained_values_live_in_memory() -> None:
    b = Broker()
    b.publish([raw("s", b"v")], 0, 42)
    (d,) = deliveries(b, sub(b, 1, "s", timestamp_ms=50))
    assert (d.payload, d.retained, d.timestamp_ms, d.offset) == (b"v", True, 42, 1)



class _Looked(dict):
    """A store's values that count how many of them are looked at."""

    looked = 0

    def items(self):  # type: ignore[override]
        self.looked += len(self)
        return super().items()

    def values(self):  # type: ignore[override]
        self.looked += len(self)
        return super().values()

    def __iter__(self):  # type: ignore[override]
        self.looked += len(self)
        return super().__iter__()

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        self.looked += 1
        return super().__getitem__(key)

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        self.looked += 1
        return super().get(key, default)


def _store(topics: list[str]) -> Retained:
    r = Retained(1 << 30, 1 << 40)
    for i, topic in enumerate(topics):
        record = raw(topic, b"v").record
        r.put(topic.encode(), i + 1, 1000 + i, record, i + 1)
    return r


def test_a_filter_looks_only_at_the_values_it_can_match() -> None:
    """h34 #6: ``matching`` copied and walked every retained value for each filter (2 ms a
    filter at 10,000 values, 72 ms at 100,000, for a filter that matches none), and a
    SUBSCRIBE does it once per filter. Now a filter walks the branches of the topic levels
    it can match: a filter matching none or one of 10,000 values looks at one at most."""
    r = _store([f"sensors/hall/r{i}" for i in range(10_000)] + ["cmd/other/x"])
    r.values = looked = _Looked(r.values)
    for topic_filter, expected in (("cmd/hall/#", 0), ("cmd/hall/+", 0), ("x/+/y", 0),
                                   ("sensors/hall/r77", 1), ("+/hall/r9999", 1),
                                   ("cmd/#", 1), ("+/other/+", 1)):
        looked.looked = 0
        got = r.matching(topic_filter, 5000)
        assert len(got) == expected, topic_filter
        assert looked.looked <= expected, (topic_filter, looked.looked)
    assert len(r.matching("#", 5000)) == 10_001
    assert [v.offset for v in r.matching("sensors/+/+", 5000)] == list(range(1, 10_001))


def test_matching_agrees_with_the_filter_rules_however_values_come_and_go() -> None:
    """The index by topic levels answers as ``topics.matches`` over every value, oldest
    publish first: '$' topics only for filters naming their first level, ``a/#`` matching
    ``a``, empty levels; values replaced, cleared and expired on the way."""
    rng = random.Random(34)
    words = ["a", "b", "", "$SYS", "$x", "c"]
    r = Retained(1 << 30, 1 << 40)
    kept: dict[str, tuple[int, int]] = {}  # topic -> (offset, expires_ms)
    offset = 0
    for step in range(3000):
        topic = "/".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        if topic.startswith("/") and rng.random() < 0.5:
            topic = topic.lstrip("/") or "a"
        offset += 1
        if rng.random() < 0.2:  # cleared
            r.put(topic.encode(), offset, step, raw(topic, b"").record, offset)
            kept.pop(topic, None)
        else:
            ttl = rng.choice((0, 0, 50, 500))
            r.put(topic.encode(), offset, step, raw(topic, b"v", ttl=ttl).record, offset)
            kept[topic] = (offset, step + ttl if ttl else 0)
        if step % 17 == 0:
            parts = [rng.choice([*words, "+", "+"]) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.4:
                parts.append("#")
            topic_filter = "/".join(parts)
            levels = tuple(topic_filter.split("/"))
            kept = {t: v for t, v in kept.items() if not v[1] or v[1] > step}
            want = sorted(v[0] for t, v in kept.items() if matches(levels, tuple(t.split("/"))))
            assert [v.offset for v in r.matching(topic_filter, step)] == want, topic_filter
            assert len(r) == len(kept)
    assert r.size == sum(len(v.record) for v in r.values.values())
    for topic in list(kept):  # every value cleared: nothing is left of the index
        r.put(topic.encode(), offset + 1, 0, raw(topic, b"").record, offset + 1)
    assert r.matching("#", 0) == [] and len(r) == 0 and r.size == 0
    assert r._root.children is None

# ------------------------------------------------------------------ durability (real log)


def open_broker(path: Path, options: LogOptions) -> tuple[Broker, Log]:
    log = Log(str(path), options)
    broker = Broker(log=log)
    log.open(on_record=broker.recover, message_flags=FLAG_RETAIN)
    broker.recovered(0)
    return broker, log


def commit(log: Log) -> None:
    batch = log.take_batch()
    if batch is not None:
        batch.write(log.disk, True)
        log.commit(batch)


def test_retained_values_come_back_from_the_log_and_outlive_retention(tmp_path: Path) -> None:
    options = LogOptions(segment_bytes=4096, retention_bytes=8192)
    b, log = open_broker(tmp_path, options)
    b.publish([raw("dev/1", b"online"), raw("dev/2", b"online"), raw("dev/3", b"x")], 0, 10)
    b.publish([raw("dev/3", b"")], 0, 11)  # cleared
    for i in range(200):  # enough traffic to fill several segments
        b.publish([raw("noise", b"n" * 100, retain=False)], 0, 20 + i)
        commit(log)
    first = log.segments[0]
    # what maintenance does: carry values forward, then retention may delete old segments
    newest = log.segments[-1].base
    assert b.carry_retained(500, newest) > 0
    commit(log)
    assert b.retained.newest_anchor() <= log.written_offset
    assert log.retain(1000, b.durable_floor()).removed
    assert log.first_offset > 3 and first not in log.segments  # the originals are gone
    log.close()

    b2, log2 = open_broker(tmp_path, options)
    got = deliveries(b2, sub(b2, 1, "dev/#", timestamp_ms=2000))
    assert [(d.topic, d.payload, d.offset, d.timestamp_ms, d.retained) for d in got] == [
        ("dev/1", b"online", 1, 10, True), ("dev/2", b"online", 2, 10, True)]
    # cursors skip the carried copies: a replay sees only messages
    kinds = {r.kind for r in log2.read(log2.first_offset, 10_000)}
    assert Kind.RETAINED in kinds
    replay = sub(b2, 2, "dev/#", start=Start.EARLIEST)
    assert deliveries(b2, replay) == []
    log2.close()


def test_a_value_set_after_its_carried_copy_wins_on_recovery(tmp_path: Path) -> None:
    options = LogOptions(segment_bytes=4096)
    b, log = open_broker(tmp_path, options)
    b.publish([raw("cfg", b"old")], 0, 1)
    commit(log)
    b.carry_retained(2, log.next_offset)  # carried: a RETAINED record after the original
    b.publish([raw("cfg", b"new")], 0, 3)
    commit(log)
    log.close()
    b2, log2 = open_broker(tmp_path, options)
    assert [d.payload for d in deliveries(b2, sub(b2, 1, "cfg"))] == [b"new"]
    assert b2.offset == 3  # the last message; the carried copy is not one
    log2.close()


def test_a_key_keeps_retained_values_within_its_share() -> None:
    """docs/SECURITY.md, "Shares": a key's retained values count against its quota (topics
    and bytes), the latest publisher's; another key, and a clear, go on. Values that expire
    give their count back."""
    from blipmq_server.broker.access import Access, Identity, Quota

    b = Broker(Limits(retained_max_topics=100), log=MemoryLog())
    hog = Access(Identity("hog", publish=("#",), quota=Quota(retained_topics=2,
                                                             retained_bytes=300)))
    other = Access(Identity("other", publish=("#",), quota=Quota(retained_topics=2)))
    assert b.publish([raw("h/1", b"1"), raw("h/2", b"2")], 0, 1, access=hog).refusal is None
    res = b.publish([raw("h/1", b"again"), raw("h/3", b"3")], 0, 2, access=hog)
    assert res.accepted == 1 and res.refusal is not None  # its own topic again: fine
    assert res.refusal.code == ErrorCode.LIMIT
    assert res.refusal.text.startswith("key 'hog' keeps retained values for 2 topics, the most "
                                       "its share allows (2: max_retained_topics"), res.refusal
    assert b.publish([raw("o/1", b"mine")], 0, 3, access=other).refusal is None
    assert b.publish([raw("h/1", b"")], 0, 4, access=hog).refusal is None  # a clear
    assert b.publish([raw("h/3", b"3")], 0, 5, access=hog).refusal is None  # room again
    # a value published over another key's is the publisher's now
    assert b.publish([raw("h/3", b"taken")], 0, 6, access=other).refusal is None
    size = {t: len(v.record) for t, v in b.retained.values.items()}
    assert b.retained_shares.held == {"hog": [1, size[b"h/2"]],
                                      "other": [2, size[b"o/1"] + size[b"h/3"]]}
    over = b.publish([raw("h/4", b"x" * 400)], 0, 7, access=hog)
    assert over.refusal is not None and "max_retained_bytes" in over.refusal.text
    assert b.counters.limited == {"auth.keys.max_retained_topics": 1,
                                  "auth.keys.max_retained_bytes": 1}
    assert b.retained.refused == 2
    # expiry (found on the way by a subscription) gives the count back
    assert b.publish([raw("h/5", b"brief", ttl=10)], 0, 10, access=hog).refusal is None
    assert b.publish([raw("h/6", b"no")], 0, 11, access=hog).refusal is not None
    sub(b, 1, "h/#", timestamp_ms=100)
    assert b.publish([raw("h/6", b"yes")], 0, 101, access=hog).refusal is None


def test_recovered_retained_values_are_nobodys() -> None:
    """A record does not say who published it: at start every key's count is zero."""
    from blipmq_server.broker.access import Access, Identity, Quota

    log = MemoryLog()
    b = Broker(log=log)
    hog = Access(Identity("hog", publish=("#",), quota=Quota(retained_topics=1)))
    assert b.publish([raw("h/1", b"1")], 0, 1, access=hog).refusal is None
    assert b.publish([raw("h/2", b"2")], 0, 1, access=hog).refusal is not None
    again = Broker(log=MemoryLog())
    for record in log.records:
        assert again.recover(record) is None
    assert len(again.retained) == 1 and again.retained_shares.held == {}
    assert again.publish([raw("h/2", b"2")], 0, 2, access=hog).refusal is None
    assert again.publish([raw("h/3", b"3")], 0, 2, access=hog).refusal is not None


def test_a_new_subscription_gets_every_retained_value_whatever_its_queue_capacity() -> None:
    """h33 F7: the retained values went into the subscription's bounded queue at once, the
    ones past ``capacity`` dropped as drop_new (8,192 of 10,000 with the defaults). Now they
    wait as the store's topics (the values looked up when taken) and are taken before the
    queue's items, as its reader takes them; live messages published meanwhile come after
    them and have the whole queue."""
    b = Broker(Limits(capacity=3, overflow=Overflow.BLOCK), log=MemoryLog())
    b.publish([raw(f"disc/dev{i}/config", b"%d" % i) for i in range(10)], 0, 1)
    newcomer = sub(b, 1, "disc/#", timestamp_ms=2)
    queue = newcomer.queue
    values = b.retained.values
    assert [(topic, offset) for topic, offset in queue.retained.items()] == [
        (f"disc/dev{i}/config".encode(), values[f"disc/dev{i}/config".encode()].offset)
        for i in range(10)]  # topics, no copies of the values
    live = b.publish([raw("disc/dev0/config", b"new", retain=False)] * 3, 0, 3)
    assert live.accepted == 3 and live.blocked is None  # the queue's room is the live one's
    got: list[Delivery] = []
    while batch := b.take(newcomer, 4, 1 << 20, 0, 0):
        got += decode_one(encode_deliver(1, batch)).messages  # type: ignore[union-attr]
    assert [(d.payload, d.retained) for d in got] == (
        [(b"%d" % i, True) for i in range(10)] + [(b"new", False)] * 3)
    assert b.counters.dropped_new == 0 and b.counters.retained_sent == 10
    assert queue.backlog == 0 and queue.size == 0


def test_pending_retained_values_are_paced_by_the_batch_bounds() -> None:
    b = Broker(Limits(capacity=2), log=MemoryLog())
    b.publish([raw(f"r/{i}", b"x" * 100) for i in range(5)], 0, 1)
    consumer = sub(b, 1, "r/#", until_end=True)
    assert consumer.until == 5
    assert b.has_work(consumer)
    first = b.deliver(1, 100, 250, 0, 0).batches  # two records of ~150 bytes fit in 250
    assert [len(records) for _, records in first] == [1]
    assert consumer.queue.backlog == 4
    rest = b.deliver(1, 100, 1 << 20, 0, 0).batches
    assert [len(records) for _, records in rest] == [4, 0]  # then the end mark
    assert not b.has_work(consumer)


def test_expired_retained_values_count_against_no_limit_when_nobody_subscribes() -> None:
    """h35 F2: expired values were dropped only when a SUBSCRIBE looked for values, so until
    then they still counted against the key's share and the broker-wide bounds, and a
    publish was refused by values that no longer exist (docs/SECURITY.md: a value counts
    "until it ... expires"). The publish path drops them before refusing."""
    from blipmq_server.broker.access import Access, Identity, Quota

    b = Broker(Limits(retained_max_topics=100), log=MemoryLog())
    dev = Access(Identity("dev", publish=("#",), quota=Quota(retained_topics=3,
                                                             retained_bytes=400)))
    brief = [raw(f"d/{i}", b"x" * 60, ttl=1000) for i in range(3)]
    assert b.publish(brief, 0, 1000, access=dev).refusal is None
    assert b.publish([raw("d/3", b"on")], 0, 1500, access=dev).refusal is not None  # live
    assert b.retained.refused == 1
    # 3 s later all three expired: the share holds none of them (no SUBSCRIBE in between)
    assert b.publish([raw("d/3", b"on")], 0, 4000, access=dev).refusal is None
    assert b.publish([raw("d/4", b"y" * 200)], 0, 4001, access=dev).refusal is None
    assert set(b.retained.values) == {b"d/3", b"d/4"}
    size = {t: len(v.record) for t, v in b.retained.values.items()}
    assert b.retained_shares.held == {"dev": [2, size[b"d/3"] + size[b"d/4"]]}
    assert b.retained_shares.owner.keys() == {b"d/3", b"d/4"}
    assert b.retained.refused == 1 and b.counters.limited == {
        "auth.keys.max_retained_topics": 1}

    # the broker-wide bounds, topics and bytes, the same way
    c = Broker(Limits(retained_max_topics=2, retained_max_bytes=300), log=MemoryLog())
    assert c.publish([raw("a", b"1", ttl=10), raw("b", b"2", ttl=10)], 0, 100).refusal is None
    assert c.publish([raw("c", b"3")], 0, 105).refusal is not None
    assert c.publish([raw("c", b"3")], 0, 110).refusal is None
    assert set(c.retained.values) == {b"c"}
    assert c.publish([raw("big", b"z" * 200, ttl=10)], 0, 120).refusal is None
    assert c.publish([raw("d", b"w" * 150)], 0, 125).refusal is not None  # bytes, live
    assert c.publish([raw("d", b"w" * 150)], 0, 130).refusal is None
    assert set(c.retained.values) == {b"c", b"d"} and c.retained.size <= 300
    assert c.retained.refused == 2


def _held_bytes(pending: object, store: object) -> int:
    """Bytes of the objects reachable from ``pending`` that ``store`` does not reach (what
    the pending list alone keeps in memory)."""
    import gc
    import sys

    def reach(root: object) -> dict[int, object]:
        seen: dict[int, object] = {}
        todo = [root]
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type):
                continue
            seen[id(obj)] = obj
            todo.extend(gc.get_referents(obj))
        return seen

    shared = reach(store)
    return sum(sys.getsizeof(o) for k, o in reach(pending).items() if k not in shared)


def test_a_slow_subscriptions_pending_retained_values_hold_no_replaced_value() -> None:
    """h35 F5: a QoS 0 subscription's retained values still to send were the ``Value``s as
    they were at the SUBSCRIBE: once replaced in the store they were copies held outside
    every byte bound (13 MB per slow subscriber when all 4,000 values of 3 KB were
    replaced). Now the list holds topics; a value replaced while still listed goes into the
    queue's items, counted in its bytes, before the publish that replaced it."""
    b = Broker(Limits(capacity=1000), log=MemoryLog())
    n, payload = 50, 3000
    b.publish([raw(f"r/{i}", b"a" * payload) for i in range(n)], 0, 1)
    slow = sub(b, 1, "r/#", timestamp_ms=2)
    queue = slow.queue
    first = b.take(slow, 5, 1 << 20, 0, 0)  # it has read 5 of them so far
    assert len(first) == 5
    before = _held_bytes(queue.retained, b.retained.values)
    assert before < n * 200  # no record: topics and offsets
    b.publish([raw(f"r/{i}", b"b" * payload) for i in range(n)], 0, 3)  # all replaced
    assert _held_bytes(queue.retained, b.retained.values) <= before
    assert not queue.retained
    # the 45 old values wait in the queue, before the live publishes that replaced them,
    # counted in its bytes (what queues.capacity_bytes and blipmq_queue_bytes see)
    assert queue.size == sum(len(record) for record, _ in queue.items)
    assert len(queue.items) == 45 + n and queue.size > 95 * payload
    got: list[Delivery] = []
    while batch := b.take(slow, 7, 1 << 20, 0, 0):
        got += decode_one(encode_deliver(1, batch)).messages  # type: ignore[union-attr]
    assert queue.size == 0
    old = [(d.topic, d.payload[:1], d.retained) for d in got if d.retained]
    assert sorted(old) == sorted((f"r/{i}", b"a", True) for i in range(5, n))
    assert [(d.topic, d.payload[:1]) for d in got if not d.retained] == [
        (f"r/{i}", b"b") for i in range(n)]
    assert got.index(next(d for d in got if not d.retained)) == 45  # old ones first
    assert b.counters.retained_sent == n


def test_a_value_replaced_while_pending_keeps_its_order_within_the_queue_bounds() -> None:
    """A replaced pending value comes before anything published on its topic after the
    SUBSCRIBE, if the queue has room for it and the publish that replaces it; if not, it
    is dropped (counted as the queue's policy drops) and the newer value comes live."""
    b = Broker(Limits(capacity=4, overflow=Overflow.DROP_OLDEST), log=MemoryLog())
    b.publish([raw("t/a", b"a0"), raw("t/b", b"b0")], 0, 1)
    s = sub(b, 1, "t/#", timestamp_ms=2)
    b.publish([raw("t/b", b"live", retain=False), raw("t/b", b"b1")], 0, 3)
    b.publish([raw("t/a", b"")], 0, 4)  # cleared: no room for a0 and the clear
    assert [(d.payload, d.retained) for d in deliveries(b, s)] == [
        (b"b0", True), (b"live", False), (b"b1", False), (b"", False)]
    assert s.queue.dropped_oldest == 1 and s.queue.size == 0
    s2 = sub(b, 2, "t/#", timestamp_ms=5)
    b.publish([raw("t/b", b"b2")], 0, 6)
    assert [(d.payload, d.retained) for d in deliveries(b, s2)] == [
        (b"b1", True), (b"b2", False)]
    # a full queue that blocks: the replacing publish is held back, or taken whole
    c = Broker(Limits(capacity=2, overflow=Overflow.BLOCK), log=MemoryLog())
    c.publish([raw("u/a", b"a0"), raw("u/b", b"b0")], 0, 1)
    s3 = sub(c, 1, "u/#", timestamp_ms=2)
    assert c.publish([raw("u/x", b"live", retain=False)], 0, 3).accepted == 1
    res = c.publish([raw("u/a", b"a1")], 0, 4)
    assert res.accepted == 1 and res.blocked is None
    assert s3.queue.dropped_new == 1  # a0 had no room beside a1: a1 comes instead
    assert [(d.payload, d.retained) for d in deliveries(c, s3)] == [
        (b"b0", True), (b"live", False), (b"a1", False)]
