"""The pure broker core: routing, overflow policies, groups, TTL. No event loop, no sleeps."""

import pytest

from blipmq_server.broker.access import Access, Identity
from blipmq_server.broker.core import Blocked, Broker, Detached, Ended, Limits
from blipmq_server.broker.queue import Overflow
from blipmq_server.broker.registry import Consumer
from blipmq_server.broker.storage import MemoryLog
from blipmq_server.protocol.codec import (
    DELIVERY_PREFIX,
    ErrorCode,
    Message,
    RawMessage,
    Start,
    decode_one,
    encode_deliver,
    encode_publish,
    message_record,
)


def raw(topic: str, payload: bytes = b"x", ttl: int = 0, qos: int = 0) -> RawMessage:
    frame = decode_one(encode_publish([message_record(Message(topic, payload, qos, ttl))]))
    return frame.messages[0]  # type: ignore[union-attr]


def payloads(records: list[bytes]) -> list[bytes]:
    frame = decode_one(encode_deliver(1, records))
    return [d.payload for d in frame.messages]  # type: ignore[union-attr]


def sub(b: Broker, *args, **kwargs) -> Consumer:
    """Subscribe and return the core's consumer object."""
    consumer = b.consumer(b.subscribe(*args, **kwargs).sub_id)
    assert consumer is not None
    return consumer


def take_all(b: Broker, consumer, now: int = 0) -> list[bytes]:
    return payloads(b.take(consumer, 10_000, 1 << 30, now))


def test_publish_routes_to_matching_subscriptions_only() -> None:
    b = Broker()
    exact = sub(b, "c1", "sensors/kitchen/temp")
    plus = sub(b, "c2", "sensors/+/temp")
    hash_ = sub(b, "c3", "sensors/#")
    other = sub(b, "c4", "alerts")
    res = b.publish([raw("sensors/kitchen/temp", b"21"), raw("sensors/hall/temp", b"19")], 0)
    assert res.accepted == 2 and res.refusal is None
    assert take_all(b, exact) == [b"21"]
    assert take_all(b, plus) == [b"21", b"19"]
    assert take_all(b, hash_) == [b"21", b"19"]
    assert take_all(b, other) == []
    assert b.counters.published == 2 and b.counters.delivered == 5


def test_offsets_increase_and_records_carry_them() -> None:
    b = Broker()
    c = sub(b, "c", "t")
    b.publish([raw("t"), raw("nobody/listens"), raw("t")], 0)
    records = b.take(c, 10, 1 << 20, 0)
    offsets = [DELIVERY_PREFIX.unpack_from(r)[0] for r in records]
    assert offsets == [1, 3]
    assert b.counters.unrouted == 1


def test_drop_oldest_keeps_the_newest() -> None:
    b = Broker(Limits(capacity=3, overflow=Overflow.DROP_OLDEST))
    c = sub(b, "c", "t")
    b.publish([raw("t", bytes([i])) for i in range(5)], 0)
    assert take_all(b, c) == [b"\x02", b"\x03", b"\x04"]
    assert b.counters.dropped_oldest == 2


def test_drop_new_keeps_the_oldest() -> None:
    b = Broker(Limits(capacity=3, overflow=Overflow.DROP_NEW))
    c = sub(b, "c", "t")
    res = b.publish([raw("t", bytes([i])) for i in range(5)], 0)
    assert res.accepted == 5
    assert take_all(b, c) == [b"\x00", b"\x01", b"\x02"]
    assert b.counters.dropped_new == 2


def test_block_stops_the_batch_at_the_full_queue() -> None:
    b = Broker(Limits(capacity=2, overflow=Overflow.BLOCK))
    c = sub(b, "c", "t")
    msgs = [raw("t", bytes([i])) for i in range(5)]
    res = b.publish(msgs, 0)
    assert res.accepted == 2 and res.blocked == Blocked(c.queue.id, "subscription on 't'", ("c",))
    assert res.wake == {"c"}
    assert take_all(b, c) == [b"\x00", b"\x01"]
    res = b.publish(msgs[2:], 0)
    assert res.accepted == 2 and res.blocked is not None and res.blocked.queue == c.queue.id


def test_a_subscription_may_drop_instead_of_blocking() -> None:
    """h33 F6: MQTT QoS 0 subscriptions take ``mqtt.qos0_overflow`` (``overflow``): a full
    one drops rather than hold publishers; the others keep ``limits.overflow``, and the
    queues that dropped are handed to the shell once, to say so."""
    b = Broker(Limits(capacity=2, overflow=Overflow.BLOCK))
    dropping = b.consumer(b.subscribe("m", "t", overflow=Overflow.DROP_OLDEST).sub_id)
    res = b.publish([raw("t", bytes([i])) for i in range(5)], 0)
    assert res.accepted == 5 and res.blocked is None
    assert take_all(b, dropping) == [b"\x03", b"\x04"]
    assert b.counters.dropped_oldest == 3
    assert b.take_dropping() == [dropping.queue] and b.take_dropping() == []
    blocking = sub(b, "n", "t")  # without ``overflow``: limits.overflow, block
    res = b.publish([raw("t", bytes([i])) for i in range(5)], 0)
    assert res.accepted == 2 and res.blocked is not None
    assert res.blocked.queue == blocking.queue.id


def test_block_without_a_consumer_keeps_the_newest() -> None:
    # a QoS 0 group whose consumer left must not stop the topic for everyone
    b = Broker(Limits(capacity=3, overflow=Overflow.BLOCK))
    gone = sub(b, 1, "t", group="dash")
    b.disconnect(1)
    live = sub(b, 2, "t")
    res = b.publish([raw("t", bytes([i])) for i in range(5)], 0)
    assert res.accepted == 3 and res.blocked == Blocked(live.queue.id, "subscription on 't'", (2,))
    assert take_all(b, live) == [b"\x00", b"\x01", b"\x02"]
    assert b.publish([raw("t", bytes([i])) for i in range(3, 5)], 0).blocked is None
    assert b.counters.dropped_no_consumer == 2 and gone.queue.dropped_no_consumer == 2
    again = sub(b, 3, "t", group="dash")
    assert take_all(b, again) == [b"\x02", b"\x03", b"\x04"]  # its newest, in order
    b.disconnect(2)
    b.publish([raw("t", bytes([i])) for i in range(10)], 0)
    res = b.publish([raw("t", b"more")], 0)
    assert res.blocked is not None and res.blocked.name == "group 'dash' on 't'"


def test_qos0_groups_without_consumers_are_bounded() -> None:
    # group names used once and left must not each keep a queue for good
    b = Broker(Limits(capacity=10, max_idle_groups=2))
    for i in range(50):
        sub(b, i, "t", group=f"g{i}")
        b.disconnect(i)
    assert [q.group for q in b.queues] == ["g48", "g49"]  # the two left last
    assert b.counters.idle_groups_dropped == 48
    for _ in range(3):
        b.publish([raw("t", bytes([i])) for i in range(20)], 0)
    assert sum(len(q.items) for q in b.queues) == 20  # two groups, full
    # a consumer joining an idle group keeps it; the one left longest ago goes first
    kept = sub(b, 100, "t", group="g48")
    sub(b, 101, "t", group="new")
    b.disconnect(101)
    sub(b, 102, "t", group="newer")
    res = b.disconnect(102)
    assert sorted(q.group for q in b.queues) == ["g48", "new", "newer"]
    assert b.counters.idle_groups_dropped == 49
    # the publishes' 2 x 50 made room in full groups, then g49 went with its 10
    assert b.counters.dropped_no_consumer == 100 + 10
    assert res.released[-1] not in {q.id for q in b.queues}  # g49's queue: gone
    assert take_all(b, kept) == [bytes([i]) for i in range(10, 20)]  # g48 kept its newest
    b.disconnect(100)  # g48 is idle again, now the latest: 'new' goes
    assert sorted(q.group for q in b.queues) == ["g48", "newer"]


def test_qos0_groups_go_with_their_last_consumer_with_max_idle_groups_0() -> None:
    b = Broker(Limits(max_idle_groups=0))
    a1 = sub(b, 1, "t", group="g")
    sub(b, 2, "t", group="g")
    b.disconnect(2)
    assert b.group("t", "g") is a1.queue  # a consumer is left
    b.unsubscribe(1, a1.sub_id)
    assert b.group("t", "g") is None and b.queues == ()
    b.publish([raw("t")], 0)
    assert b.counters.unrouted == 1


def test_a_dropped_idle_group_frees_its_name() -> None:
    b = Broker(Limits(max_idle_groups=1))
    alice, bob = (Access(Identity(n, subscribe=("#",))) for n in ("alice", "bob"))
    assert b.subscribe(1, "t", "mine", access=alice).refusal is None
    b.disconnect(1)
    assert b.subscribe(2, "t", "mine", access=bob).refusal.code == ErrorCode.FORBIDDEN
    assert b.subscribe(1, "t", "other", access=alice).refusal is None
    b.disconnect(1)  # 'mine' was left longest ago: dropped, and its owner with it
    assert b.group("t", "mine") is None and b.group_owner("t", "mine") == ""
    assert b.subscribe(2, "t", "mine", access=bob).refusal is None
    assert b.group_owner("t", "mine") == "bob"


def test_a_refused_group_subscription_claims_no_name() -> None:
    b = Broker()  # no log: a replay is refused
    alice = Access(Identity("alice", subscribe=("#",)))
    res = b.subscribe(1, "t", "g", start=Start.EARLIEST, access=alice)
    assert res.refusal is not None and res.refusal.code == ErrorCode.UNSUPPORTED
    assert b.group_owner("t", "g") == ""
    bob = Access(Identity("bob", subscribe=("#",)))
    assert b.subscribe(2, "t", "g", access=bob).refusal is None
    assert b.group_owner("t", "g") == "bob"


@pytest.mark.parametrize("policy", list(Overflow))
def test_queue_bytes_are_bounded(policy: Overflow) -> None:
    b = Broker(Limits(capacity=1000, capacity_bytes=1000, overflow=policy))
    c = sub(b, 1, "t")
    for i in range(20):
        b.publish([raw("t", bytes([i]) * 300)], 0)
        assert c.queue.size == sum(len(r) for r, _ in c.queue.items) <= 1000
    assert len(c.queue.items) == 3  # 3 x ~324 bytes
    b.publish([raw("t", b"x" * 5000)], 0)  # larger than the bound: only into an empty queue
    take_all(b, c)
    assert c.queue.size == 0
    b.publish([raw("t", b"x" * 5000)], 0)
    assert len(c.queue.items) == 1


def test_refusals_stop_the_batch_and_say_why() -> None:
    b = Broker(Limits(max_message_bytes=10))
    res = b.publish([raw("ok"), raw("bad/#")], 0)
    assert res.accepted == 1 and res.refusal is not None
    assert res.refusal.code == ErrorCode.INVALID_TOPIC and "wildcard" in res.refusal.text
    res = b.publish([raw("ok", b"x" * 11)], 0)
    assert res.accepted == 0 and res.refusal.code == ErrorCode.MESSAGE_TOO_LARGE
    assert b.publish([raw("a/+")], 0).refusal.code == ErrorCode.INVALID_TOPIC
    assert b.publish([raw("$dlq/x")], 0).refusal.code == ErrorCode.INVALID_TOPIC
    assert b.publish([raw("ok", qos=1)], 0).refusal.code == ErrorCode.UNSUPPORTED
    assert b.counters.published == 1


def test_the_size_limits_are_stated_once_and_refusals_counted_by_the_core() -> None:
    """``Limits.size_refusal`` is what ``publish`` refuses an oversized payload with, and
    what an MQTT will and a bridged-in message are checked with before they reach it;
    ``refuse`` counts a refusal made before ``publish`` as ``publish`` counts its own."""
    limits = Limits(max_message_bytes=10, max_topic_bytes=8)
    b = Broker(limits)
    assert limits.size_refusal(8, 10) is None
    assert limits.size_refusal(9, 0) == (ErrorCode.INVALID_TOPIC,
                                          "topic is 9 bytes long, "
                                          "server.max_topic_bytes is 8")
    too_big = limits.size_refusal(0, 11)
    assert b.publish([raw("ok", b"x" * 11)], 0).refusal == too_big
    assert too_big == (ErrorCode.MESSAGE_TOO_LARGE,
                       "message of 11 bytes exceeds max_message_bytes (10)")
    assert b.counters.refused == 1
    assert b.refuse(too_big) is too_big and b.counters.refused == 2


def test_invalid_utf8_topic_is_refused() -> None:
    b = Broker()
    bad = raw("t")._replace(topic=b"\xff\xfe")
    assert b.publish([bad], 0).refusal.code == ErrorCode.INVALID_TOPIC


def test_ttl_expired_messages_are_never_taken() -> None:
    b = Broker()
    c = sub(b, "c", "t")
    b.publish([raw("t", b"short", ttl=100), raw("t", b"forever"), raw("t", b"long", ttl=5000)], 0)
    assert take_all(b, c, now=1000) == [b"forever", b"long"]
    assert b.counters.dropped_ttl == 1


def test_default_ttl_applies_when_message_has_none() -> None:
    b = Broker(Limits(default_ttl_ms=50))
    c = sub(b, "c", "t")
    b.publish([raw("t", b"a"), raw("t", b"b", ttl=500)], 0)
    assert b.tick(100) == 1
    assert take_all(b, c, now=100) == [b"b"]


def test_tick_frees_capacity_taken_by_expired_messages() -> None:
    b = Broker(Limits(capacity=2, overflow=Overflow.DROP_NEW))
    c = sub(b, "c", "t")
    b.publish([raw("t", b"1", ttl=10), raw("t", b"2", ttl=10)], 0)
    assert b.tick(5) == 0
    assert b.tick(20) == 2
    b.publish([raw("t", b"3")], 20)
    assert take_all(b, c, now=20) == [b"3"]
    assert b.counters.dropped_new == 0


def test_group_members_share_and_groups_each_get_everything() -> None:
    b = Broker()
    a1 = sub(b, "conn1", "jobs", group="workers")
    a2 = sub(b, "conn2", "jobs", group="workers")
    other = sub(b, "conn3", "jobs", group="audit")
    assert a1.queue is a2.queue and other.queue is not a1.queue
    b.publish([raw("jobs", str(i).encode()) for i in range(10)], 0)
    first: list[bytes] = []
    second: list[bytes] = []
    while a1.queue.items:  # members take turns, each a fair share of what waits
        first += take_all(b, a1)
        second += take_all(b, a2)
    assert 4 <= len(first) <= 6 and 4 <= len(second) <= 6
    assert sorted(first + second) == sorted(str(i).encode() for i in range(10))
    assert len(take_all(b, other)) == 10


def test_group_outlives_its_consumers_until_unsub() -> None:
    b = Broker()
    b.subscribe("conn1", "jobs", group="g")
    b.disconnect("conn1")
    b.publish([raw("jobs", b"queued while away")], 0)
    again = sub(b, "conn2", "jobs", group="g")
    assert take_all(b, again) == [b"queued while away"]
    res = b.unsubscribe("conn3", topic_filter="jobs", group="g")
    assert res.count == 1 and res.ended == (Ended("conn2", 0, "group 'g' on 'jobs'"),)
    assert res.detached.released == (again.queue.id,)
    assert b.group("jobs", "g") is None
    gone = b.unsubscribe("conn3", topic_filter="jobs", group="g")
    assert gone.refusal.code == ErrorCode.NOT_FOUND


def test_ephemeral_subscription_ends_with_its_connection() -> None:
    b = Broker()
    c = sub(b, "conn", "t")
    assert b.disconnect("conn") == Detached(released=(c.queue.id,))
    assert b.queues == ()
    assert b.publish([raw("t")], 0).wake == set()


def test_unsubscribe_by_id_checks_the_owner() -> None:
    b = Broker()
    c = sub(b, "conn", "t")
    assert b.unsubscribe("intruder", sub_id=c.sub_id).refusal.code == ErrorCode.NOT_FOUND
    assert b.unsubscribe("conn", sub_id=c.sub_id).count == 1
    assert b.queues == ()


def test_subscribe_validates_filter_group_and_qos() -> None:
    b = Broker()
    assert b.subscribe("c", "a/#/b").refusal.code == ErrorCode.INVALID_TOPIC
    assert b.subscribe("c", "a", group="bad name").refusal.code == ErrorCode.INVALID_REQUEST
    assert b.subscribe("c", "a", qos=1).refusal.code == ErrorCode.UNSUPPORTED


def test_take_respects_batch_limits() -> None:
    b = Broker()
    c = sub(b, "c", "t")
    b.publish([raw("t", b"x" * 100) for _ in range(10)], 0)
    assert len(b.take(c, 3, 1 << 20, 0)) == 3
    assert len(b.take(c, 100, 270, 0)) == 2  # two 133-byte records fit in 270 bytes
    assert len(b.take(c, 100, 1, 0)) == 1  # always at least one, however large
    assert len(c.queue.items) == 4


@pytest.mark.parametrize("policy", list(Overflow))
def test_queue_never_exceeds_capacity(policy: Overflow) -> None:
    b = Broker(Limits(capacity=7, overflow=policy))
    c = sub(b, "c", "t")
    for i in range(50):
        b.publish([raw("t", bytes([i]))], 0)
        assert len(c.queue.items) <= 7


@pytest.mark.parametrize("policy", list(Overflow))
def test_random_batches_keep_every_bound_and_account_for_every_copy(policy: Overflow) -> None:
    # mixed topics with overlapping filters exercise the route-room fast path and its exits
    import random

    rng = random.Random(11)
    b = Broker(Limits(capacity=7, capacity_bytes=2000, overflow=policy))
    subs = [sub(b, i, f) for i, f in enumerate(("a/x", "a/+", "#", "b/x"))]
    b.disconnect(3)  # "b/x" has no consumer any more
    queues = [c.queue for c in subs]
    for _ in range(400):
        batch = [raw(rng.choice(("a/x", "a/y", "b/x")), b"p" * rng.choice((1, 50, 300, 900)))
                 for _ in range(rng.randint(1, 12))]
        res = b.publish(batch, 0)
        for q in queues:
            assert len(q.items) <= 7 and (q.size <= 2000 or len(q.items) == 1)
            assert q.size == sum(len(r) for r, _ in q.items)
        if res.blocked is not None:  # only a full queue with a consumer blocks
            q = next(q for q in queues if q.id == res.blocked.queue)
            assert q.consumers and policy is Overflow.BLOCK
            nxt = batch[res.accepted]
            size = len(nxt.record) + 10
            assert len(q.items) >= 7 or q.size + size > 2000
        if rng.random() < 0.3:
            for c in subs[:3]:
                b.take(c, rng.randint(1, 5), 1 << 20, 0)
    c = b.counters
    waiting = sum(len(q.items) for q in queues)
    assert c.enqueued - (c.dropped_oldest + c.dropped_no_consumer) == c.delivered + waiting


def test_a_delivery_pass_looks_only_at_subscriptions_that_may_have_something() -> None:
    b = Broker()
    quiet = [sub(b, 1, f"dev/{i}/status") for i in range(1000)]
    b.deliver(1, 256, 1 << 20, 0, 0)  # the new subscriptions had nothing
    assert b.registry.candidates(1) == [] and not b.pending(1)
    b.publish([raw("dev/500/status", b"on"), raw("dev/7/status", b"off")], 0)
    assert b.registry.candidates(1) == [quiet[500], quiet[7]]  # marked, in publish order
    got = b.deliver(1, 256, 1 << 20, 0, 0)
    assert [(s, payloads(r)) for s, r in got.batches] == [
        (quiet[500].sub_id, [b"on"]), (quiet[7].sub_id, [b"off"])]
    assert b.registry.candidates(1) == [] and not b.pending(1)
    # a member joining a group's queue that holds items has something at once
    first = sub(b, 2, "jobs", group="g")
    b.publish([raw("jobs", b"%d" % i) for i in range(4)], 0)
    b.disconnect(2)
    late = sub(b, 3, "jobs", group="g")
    assert b.pending(3) and payloads(b.deliver(3, 256, 1 << 20, 0, 0).batches[0][1]) == [
        b"0", b"1", b"2", b"3"]
    assert first.sub_id != late.sub_id and not b.pending(3)


def test_the_topic_cap_is_the_configured_one() -> None:
    b = Broker(Limits(max_topic_bytes=10))
    assert b.publish([raw("a" * 10)], 0).refusal is None
    res = b.publish([raw("a" * 11)], 0)
    assert res.refusal is not None and "the limit is 10" in res.refusal.text
    assert b.subscribe(1, "b" * 11).refusal is not None
    wide = Broker(Limits(max_topic_bytes=0xFFFF))
    long_topic = "/".join(["level"] * 10_000)  # 59,999 bytes: MQTT's wire allows 65,535
    sub = wide.subscribe(1, long_topic[:-5] + "#")
    assert sub.refusal is None
    assert wide.publish([raw(long_topic)], 0).wake == {1}


def test_a_connection_holds_at_most_max_subscriptions() -> None:
    b = Broker(Limits(max_subscriptions=3))
    ids = [b.subscribe(1, f"t/{n}").sub_id for n in range(3)]
    assert all(ids)
    over = b.subscribe(1, "t/3")
    assert over.refusal is not None and over.refusal.code == ErrorCode.LIMIT
    assert "server.max_subscriptions" in over.refusal.text
    assert b.subscribe(2, "t/3").sub_id  # another connection has its own
    b.unsubscribe(1, ids[0])
    assert b.subscribe(1, "t/3").sub_id  # room again


def test_stats_lists_the_groups_with_most_backlog_first_and_counts_the_rest() -> None:
    # h29: every group listed made a report too large for a frame (blipmq stats broke);
    # the core ranks them and lists at most max_groups, without a row for the others
    b = Broker()
    for i, backlog in enumerate((1, 0, 3, 3, 2)):
        sub(b, i, f"t{i}", group=f"g{i}")
        if backlog:
            b.publish([raw(f"t{i}", bytes([n])) for n in range(backlog)], 0)
    everything = b.stats()
    assert [(g["group"], g["backlog"]) for g in everything["groups"]] == [
        ("g2", 3), ("g3", 3), ("g4", 2), ("g0", 1), ("g1", 0)]  # ties: by filter, group
    assert everything["groups_omitted"] == 0
    report = b.stats(max_groups=2)
    assert [g["group"] for g in report["groups"]] == ["g2", "g3"]
    assert report["groups_omitted"] == 3
    assert report["groups"] == everything["groups"][:2]
    assert b.stats(max_groups=0)["groups"] == [] and b.stats(max_groups=0)["groups_omitted"] == 5


def test_a_stats_report_ranks_many_groups_without_holding_the_loop() -> None:
    """h32: STATS listed as many groups as the frame could hold (78,282 of 100,000), ranked
    by building a tuple for every group on the event loop: each STATS held every connection
    up 0.7-1.3 s (PING max 766-1,190 ms). Now at most ``report.LISTED`` (1,000) per list,
    chosen in two passes over the backlogs: 31-38 ms per STATS at 100,000 groups. The most
    backlog first; of those tied with the last one kept, the oldest."""
    from blipmq_server.protocol import report

    assert report.most(8 << 20) == report.LISTED == 1000
    assert report.most(2000) * report.ENTRY_MIN <= 2000
    log = MemoryLog()
    b = Broker(Limits(max_subscriptions=10_000), log=log)
    for i in range(30):
        b.subscribe(1, f"t/{i}", f"g{i:02d}", qos=1)
    for i in (7, 3, 3, 12):  # backlogs: t/7 one, t/3 two, t/12 one
        b.publish([raw(f"t/{i}", qos=1)], 0, 1000)
    got = b.stats(max_groups=4)
    assert [(g["group"], g["backlog"]) for g in got["groups"]] == [
        ("g03", 2), ("g12", 1), ("g07", 1), ("g00", 0)]  # of the 0s, the oldest
    assert got["groups_omitted"] == 26
    assert len(b.stats()["groups"]) == 30 and b.stats(max_groups=0)["groups"] == []
