"""Log cursors in the pure core over the in-memory log (broker.storage.MemoryLog): the disk
reads they ask for, what the results say to wake, and dead letters. No files, no loop."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.broker.durable import DurableGroup
from blipmq_server.broker.results import Fetch
from blipmq_server.broker.storage import READ_AHEAD_BYTES, READ_AHEAD_RECORDS, MemoryLog
from blipmq_server.broker.topics import matches, split
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import (
    Message,
    Start,
    decode_one,
    encode_deliver,
    encode_publish,
    message_record,
)


def publish(b: Broker, topic: str, *payloads: bytes, qos: int = 1) -> None:
    recs = [message_record(Message(topic, p, qos)) for p in payloads]
    assert b.publish(decode_one(encode_publish(recs)).messages, 0, 1000).refusal is None


def payloads(records: list[bytes]) -> list[bytes]:
    return [d.payload for d in decode_one(encode_deliver(1, records)).messages]  # type: ignore


def test_a_cursor_on_records_only_on_disk_asks_once_and_waits() -> None:
    log = MemoryLog(cached_from=10**9)  # nothing is in memory: every read is a disk read
    b = Broker(Limits(), log=log)
    sub = b.subscribe(7, "t", "g", qos=1)
    publish(b, "t", b"a", b"b")
    log.store()
    assert b.pending(7)
    got = b.deliver(7, 100, 1 << 20, 0, 0)
    # from the first message (offset 2): the group's own GROUP record (1) is passed over,
    # as a cursor that had read to the end moves to the first message of its topics
    assert got.batches == [] and got.fetches == [Fetch(got.fetches[0].key, 2)]
    assert not b.pending(7)  # waits for the read: the writer sleeps, no busy loop
    assert b.deliver(7, 100, 1 << 20, 0, 0).fetches == []  # asked once
    [fetch] = got.fetches
    records = log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES)
    assert b.fill(fetch.key, records) == {7}
    [(sub_id, batch)] = b.deliver(7, 100, 1 << 20, 0, 0).batches
    assert sub_id == sub.sub_id and payloads(batch) == [b"a", b"b"]


def test_the_next_disk_read_starts_while_the_read_ahead_still_has_records() -> None:
    """A cursor reading a backlog from disk asks for the next read once half of its
    read-ahead is gone, not once all of it is (the consumer would wait for the disk between
    reads); the two reads join up with nothing missing and nothing twice."""
    log = MemoryLog(cached_from=10**9)
    b = Broker(Limits(), log=log)
    b.subscribe(7, "t", "g", qos=1, credit=10**6)
    n = READ_AHEAD_RECORDS * 3
    for start in range(0, n, 500):
        publish(b, "t", *(b"%d" % i for i in range(start, min(n, start + 500))))
    log.store()
    [fetch] = b.deliver(7, 100, 1 << 20, 0, 0).fetches  # nothing read yet: the first read
    got: list[bytes] = []
    reads = 0
    while fetch is not None:
        reads += 1
        assert reads <= n // 100  # bounded
        b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
        fetch = None
        while fetch is None and len(got) < n:
            taken = b.deliver(7, 100, 1 << 20, 0, 0)
            batch = [r for _, records in taken.batches for r in records]
            assert batch, f"the read-ahead ran dry after {len(got)} records"
            got += payloads(batch)
            assert len(taken.fetches) <= 1  # one read under way at a time
            fetch = taken.fetches[0] if taken.fetches else None
            if fetch is not None and len(got) < n:  # the read is under way: records remain
                more = [r for _, rs in b.deliver(7, 100, 1 << 20, 0, 0).batches for r in rs]
                assert more, f"the next read was asked for only after {len(got)} records"
                got += payloads(more)
    assert got == [b"%d" % i for i in range(n)]
    assert b.deliver(7, 100, 1 << 20, 0, 0).batches == []


def test_records_in_memory_are_read_at_once() -> None:
    log = MemoryLog()  # everything cached
    b = Broker(Limits(), log=log)
    b.subscribe(1, "t", start=Start.EARLIEST)
    publish(b, "t", b"x", qos=0)
    assert not b.pending(1)  # appended, not yet stored: nothing to read
    log.store()
    got = b.deliver(1, 100, 1 << 20, 0, 0)
    assert got.fetches == [] and [payloads(r) for _, r in got.batches] == [[b"x"]]


def test_an_empty_read_below_the_log_moves_the_replay_on() -> None:
    log = MemoryLog(cached_from=10**9)
    b = Broker(Limits(), log=log)
    publish(b, "t", b"old", b"older", qos=0)
    log.store()
    b.subscribe(1, "t", start=Start.EARLIEST)
    [fetch] = b.deliver(1, 100, 1 << 20, 0, 0).fetches
    publish(b, "t", b"new", qos=0)
    log.store()
    log.drop_below(3)  # retention took the first two while the read was under way
    assert b.fill(fetch.key, []) == {1}  # the segment was gone: nothing read
    [fetch] = b.deliver(1, 100, 1 << 20, 0, 0).fetches
    assert fetch.offset == 3
    b.fill(fetch.key, log.read(3))
    [(_, batch)] = b.deliver(1, 100, 1 << 20, 0, 0).batches
    assert payloads(batch) == [b"new"]


def test_dead_letters_wake_their_subscribers() -> None:
    log = MemoryLog()
    b = Broker(Limits(max_retries=1), log=log)
    sub = b.subscribe(1, "t", "g", qos=1)
    b.subscribe(2, "$dlq/t")  # an in-memory subscriber of the dead letters
    publish(b, "t", b"poison")
    log.store()
    [(_, batch)] = b.deliver(1, 100, 1 << 20, 0, 0).batches
    offset = decode_one(encode_deliver(1, batch)).messages[0].offset  # type: ignore
    assert b.nack(1, sub.sub_id, (offset,), 0, 0, 0) == {1, 2}
    [(_, dead)] = b.deliver(2, 100, 1 << 20, 0, 0).batches
    [letter] = decode_one(encode_deliver(1, dead)).messages  # type: ignore
    assert (letter.topic, letter.payload, letter.dead) == ("$dlq/t", b"poison", (1, "nacked"))
    # the dead letter is logged before the ACK that ends its original for the group
    assert [r.kind for r in log.records] == [Kind.GROUP, Kind.MESSAGE, Kind.MESSAGE, Kind.ACK]


def test_a_closing_connection_takes_no_qos1_deliveries() -> None:
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    b.subscribe(1, "q0")
    b.subscribe(1, "q1", qos=1)
    publish(b, "q0", b"a", qos=0)
    publish(b, "q1", b"b")
    log.store()
    assert b.pending(1) and b.pending(1, qos0_only=True)
    got = b.deliver(1, 100, 1 << 20, 0, 0, qos0_only=True)
    assert [payloads(r) for _, r in got.batches] == [[b"a"]]
    assert not b.pending(1, qos0_only=True) and b.pending(1)


def test_a_cursor_more_than_a_batch_behind_says_so() -> None:
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    b.subscribe(1, "t", start=Start.EARLIEST)  # a replay
    b.subscribe(2, "t")  # live, from a queue: never "behind"
    publish(b, "t", *(b"%d" % i for i in range(25)), qos=0)
    log.store()
    assert b.deliver(2, 10, 1 << 20, 0, 0).behind is False
    steps = [(len(got.batches[0][1]), got.behind)
             for got in (b.deliver(1, 10, 1 << 20, 0, 0) for _ in range(3))]
    # 25 records behind, 10 taken: 15 left (more than a batch), then 5, then none
    assert steps == [(10, True), (10, False), (5, False)]
    assert b.deliver(1, 10, 1 << 20, 0, 0).behind is False  # nothing taken


def test_tailing_while_a_consumer_reads_from_a_cursor() -> None:
    b = Broker(Limits(), log=MemoryLog())
    b.subscribe(1, "live")  # a queue: reads nothing from the log
    assert not b.tailing()
    b.subscribe(2, "t", group="g", qos=1)
    assert b.tailing()
    b.disconnect(2, 0)  # the durable group stays, with nobody reading it
    assert not b.tailing() and b.cursors is not None and b.cursors.durable


def test_a_replay_from_a_time_starts_at_the_first_record_stamped_then() -> None:
    log = MemoryLog()
    b = Broker(log=log)
    for ts, payload in ((100, b"a"), (200, b"b"), (200, b"c"), (300, b"d")):
        record = message_record(Message("t", payload))
        b.publish(decode_one(encode_publish([record])).messages, 0, ts)
    log.store()

    def replay(at: int) -> list[tuple[bytes, int]]:
        c = b.consumer(b.subscribe(1, "t", start=Start.TIME, start_offset=at).sub_id)
        records = b.take(c, 100, 1 << 20, 0, 0)
        if not records:
            return []
        frame = decode_one(encode_deliver(1, records))
        return [(d.payload, d.timestamp_ms) for d in frame.messages]

    assert replay(150) == [(b"b", 200), (b"c", 200), (b"d", 300)]
    assert replay(200) == [(b"b", 200), (b"c", 200), (b"d", 300)]
    assert replay(0) == [(b"a", 100), (b"b", 200), (b"c", 200), (b"d", 300)]
    assert replay(301) == []


class CountingLog(MemoryLog):
    """A MemoryLog that counts the records cursors read."""

    def __init__(self) -> None:
        super().__init__()
        self.read_records = 0

    def read(self, from_offset: int, max_records: int = 1000, max_bytes: int = 1 << 20):  # type: ignore[override]
        got = super().read(from_offset, max_records, max_bytes)
        self.read_records += len(got)
        return got


def test_a_durable_group_does_not_read_through_other_topics() -> None:
    # many durable groups (an MQTT persistent session each), traffic for one of them: the
    # others' cursors skip to the end instead of reading every record
    log = CountingLog()
    b = Broker(Limits(), log=log)
    for conn in range(1, 101):
        b.subscribe(conn, f"dev/{conn}/cmd", f"g{conn}", qos=1)
    for i in range(50):
        publish(b, "dev/1/cmd", b"%d" % i)
        log.store()
        for conn in range(1, 101):
            for _, records in b.deliver(conn, 100, 1 << 20, 0, 0).batches:
                b.ack(conn, 1, tuple(d.offset for d in decode_one(
                    encode_deliver(1, records)).messages), 0)  # type: ignore[union-attr]
    # dev/1's cursor reads its messages and the ack records between them, about twice;
    # without the skip every one of the 100 cursors read every record (over 10,000 reads)
    assert log.read_records <= 400
    # a message for another group after all that is still found
    publish(b, "dev/77/cmd", b"late")
    log.store()
    [(_, records)] = b.deliver(77, 100, 1 << 20, 0, 0).batches
    assert payloads(records) == [b"late"]


@given(st.lists(st.tuples(st.sampled_from(["pub", "pub", "pub", "take", "store", "leave"]),
                          st.integers(0, 5), st.integers(0, 3)), max_size=80))
@settings(max_examples=200, deadline=None)
def test_skipping_to_the_end_never_skips_a_message_of_the_group(ops) -> None:
    # durable groups on overlapping filters, publishes, partial takes, consumers that come
    # and go: each group gets exactly the messages of its topics published after it began
    topics = ["a/x", "a/y", "b/x", "b/y", "c", "a/x/deep"]
    filters = ["a/+", "+/x", "c", "#"]
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    subs = {conn: b.subscribe(conn, f, f"g{conn}", qos=1).sub_id
            for conn, f in enumerate(filters, 1)}
    want: dict[int, list[bytes]] = {conn: [] for conn in subs}
    got: dict[int, list[bytes]] = {conn: [] for conn in subs}
    n = 0
    for op, t, c in ops:
        conn = c + 1
        if op == "pub":
            n += 1
            topic = topics[t]
            publish(b, topic, b"%d" % n)
            for k, f in enumerate(filters, 1):
                if matches(split(f), split(topic)):
                    want[k].append(b"%d" % n)
        elif op == "store":
            log.store()
        elif op == "leave" and subs[conn]:
            b.unsubscribe(conn, subs[conn])
            subs[conn] = 0
        elif op == "take":
            if not subs[conn]:
                subs[conn] = b.subscribe(conn, filters[c], f"g{conn}", qos=1).sub_id
            drain(b, conn, subs[conn], got[conn], limit=t + 1)
    log.store()
    for conn in subs:
        if not subs[conn]:
            subs[conn] = b.subscribe(conn, filters[conn - 1], f"g{conn}", qos=1).sub_id
        drain(b, conn, subs[conn], got[conn], limit=10_000)
        assert got[conn] == want[conn], filters[conn - 1]


def drain(b: Broker, conn: int, sub_id: int, into: list[bytes], limit: int) -> None:
    for _ in range(limit):
        batches = b.deliver(conn, 2, 1 << 20, 0, 0).batches
        if not batches:
            return
        for _, records in batches:
            msgs = decode_one(encode_deliver(1, records)).messages  # type: ignore[union-attr]
            into.extend(m.payload for m in msgs)
            b.ack(conn, sub_id, tuple(m.offset for m in msgs), 0)


def test_acks_are_due_once_they_ack_half_the_consumers_window() -> None:
    # A consumer's acks may wait to be written with others (a bridge acks hundreds of times
    # a second), but never more than half its window: a crash loses what is unwritten, and
    # each of those deliveries comes again.
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    sub = b.subscribe(7, "t", "g", qos=1, credit=10)
    publish(b, "t", *[bytes([i]) for i in range(10)])
    log.store()
    [(_, batch)] = b.deliver(7, 100, 1 << 20, 0, 0).batches
    offsets = [r.offset for r in log.records if r.kind == Kind.MESSAGE]
    assert len(batch) == len(offsets) == 10 and not b.acks_due()
    for offset in offsets[:4]:
        b.ack(7, sub.sub_id, (offset,), 1000)
    assert not b.acks_due()  # 4 of a window of 10: they may wait
    b.ack(7, sub.sub_id, (offsets[4],), 1000)
    assert b.acks_due()  # 5: half the window
    log.store()
    assert not b.acks_due()  # written
    b.ack(7, sub.sub_id, tuple(offsets[5:]), 1000)
    assert b.acks_due()


def test_a_dozing_consumer_sleeps_until_its_topic_and_a_missed_wake_up_costs_a_second() -> None:
    """A log-cursor consumer with nothing to take whose cursor is idle and quiet dozes (no
    delivery pass asks it); an append of its topic rouses it; another topic's does not. Had
    a wake-up been missed (here: the cursor made busy behind the core's back), the next
    ``redeliver`` a second later rouses it; an idle one it leaves dozing."""
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    mine = b.subscribe(7, "t", "", qos=1, credit=10)
    b.subscribe(8, "u", "", qos=1, credit=10)
    publish(b, "t", b"a")
    log.store()
    [(sub_id, batch)] = b.deliver(7, 100, 1 << 20, 0, 0).batches
    assert sub_id == mine.sub_id and payloads(batch) == [b"a"]
    b.ack(7, mine.sub_id, (decode_one(encode_deliver(1, batch)).messages[0].offset,), 0)
    assert not b.pending(7) and not b.pending(8)
    assert b.registry.candidates(7) == [] and b.registry.candidates(8) == []  # dozing
    publish(b, "u", b"x")  # another topic's: 7 dozes on
    log.store()
    assert b.registry.candidates(7) == []
    [(other, batch)] = b.deliver(8, 100, 1 << 20, 0, 0).batches
    b.ack(8, other, (decode_one(encode_deliver(1, batch)).messages[0].offset,), 0)
    assert not b.pending(8)
    publish(b, "t", b"b")  # its own: roused
    log.store()
    assert b.pending(7)
    [(_, batch)] = b.deliver(7, 100, 1 << 20, 0, 0).batches
    assert payloads(batch) == [b"b"]
    b.ack(7, mine.sub_id, (decode_one(encode_deliver(1, batch)).messages[0].offset,), 0)
    assert not b.pending(7) and b.registry.candidates(7) == []
    consumer = b.registry.consumers[mine.sub_id]
    consumer.queue.quiet_from = None  # as if an append of "t" had not roused it
    assert b.redeliver(500, 0) == frozenset()  # not yet a second
    assert 7 in b.redeliver(1500, 0) and b.registry.candidates(7) == [consumer]
    assert b.registry.candidates(8) == []  # idle: left dozing


def test_a_redelivery_pass_looks_only_at_cursors_with_deliveries_in_flight() -> None:
    """Regression: every 100 ms ``redeliver`` went through every cursor of the broker: with
    10,000 offline persistent MQTT sessions (a durable group each) an idle broker spent 105
    ms of CPU a second on it (6 ms after). Only cursors that put deliveries in flight are
    looked at, until a pass finds them with none; what comes due still comes back."""
    log = MemoryLog()
    b = Broker(Limits(retry_backoff_ms=100, max_retries=10), log=log)
    for i in range(1000):  # idle groups, as offline sessions' are
        b.subscribe(100 + i, f"idle/{i}", f"g{i}", qos=1)
    sub = b.subscribe(1, "t", "g", qos=1)
    publish(b, "t", b"a", b"b")
    log.store()
    [(_, batch)] = b.deliver(1, 100, 1 << 20, 0, 0).batches
    assert len(batch) == 2
    looked: list[str] = []
    expire = DurableGroup.expire

    def counted(self: DurableGroup, now_ms: int) -> tuple[list[int], int]:
        looked.append(self.group)
        return expire(self, now_ms)

    DurableGroup.expire = counted  # type: ignore[method-assign]
    try:
        assert b.redeliver(50, 0) == frozenset() and looked == ["g"]  # not due yet
        assert b.redeliver(150, 0) == {1}  # due: back to the group, its consumer woken
        [(_, again)] = b.deliver(1, 100, 1 << 20, 150, 0).batches
        offsets = tuple(m.offset for m in decode_one(encode_deliver(1, again)).messages)  # type: ignore
        assert len(offsets) == 2
        b.ack(1, sub.sub_id, offsets[:1], 0)
        b.nack(1, sub.sub_id, offsets[1:], 30, 200, 0)  # the other again after 30 ms
        looked.clear()
        assert b.redeliver(240, 0) == {1} and looked == ["g"]
        [(_, last)] = b.deliver(1, 100, 1 << 20, 240, 0).batches
        assert [m.offset for m in decode_one(encode_deliver(1, last)).messages] == [  # type: ignore
            offsets[1]]
        b.ack(1, sub.sub_id, offsets[1:], 0)
        looked.clear()
        assert b.redeliver(1000, 0) == frozenset() and looked == []  # none in flight: gone
        publish(b, "t", b"c")  # in flight again: looked at again
        log.store()
        assert b.deliver(1, 100, 1 << 20, 1000, 0).batches
        assert b.redeliver(1200, 0) == {1} and looked == ["g"]
    finally:
        DurableGroup.expire = expire  # type: ignore[method-assign]


def test_deliveries_left_by_a_gone_consumer_cost_the_redelivery_tick_nothing() -> None:
    """h32: a cursor whose in-flight deliveries all wait in ``ready`` (their consumer left:
    offline MQTT sessions that dropped with unacked QoS 1 messages) stayed among those a
    tick walks, every flight looked at every 100 ms (10,000 such groups: 38-46 ms of CPU a
    second). Nothing of them can come due until they are handed out again."""
    log = MemoryLog()
    b = Broker(Limits(retry_backoff_ms=100, max_retries=10), log=log)
    b.subscribe(1, "t", "g", qos=1)
    publish(b, "t", b"a", b"b")
    log.store()
    assert len(b.deliver(1, 100, 1 << 20, 0, 0).batches[0][1]) == 2
    b.disconnect(1)  # gone with both unacked: back to the group's ready queue
    looked: list[str] = []
    expire = DurableGroup.expire

    def counted(self: DurableGroup, now_ms: int) -> tuple[list[int], int, int]:
        looked.append(self.group)
        return expire(self, now_ms)

    DurableGroup.expire = counted  # type: ignore[method-assign]
    try:
        b.redeliver(10, 0)
        looked.clear()
        assert b.redeliver(20, 0) == frozenset() and looked == []  # nothing can come due
        sub = b.subscribe(2, "t", "g", qos=1)  # back: handed out again, due again
        [(_, again)] = b.deliver(2, 100, 1 << 20, 30, 0).batches
        offsets = tuple(m.offset for m in decode_one(encode_deliver(1, again)).messages)  # type: ignore
        assert len(offsets) == 2
        assert 2 in b.redeliver(400, 0) and looked == ["g"]  # not acked in time: again
        assert b.deliver(2, 100, 1 << 20, 400, 0).batches  # taken again
        assert b.nack(2, sub.sub_id, offsets, 50, 410, 0)  # nacked with a delay of 50 ms
        b.redeliver(415, 0)  # back from the consumer: delayed, not due yet
        looked.clear()
        assert b.redeliver(420, 0) == frozenset() and looked == ["g"]  # still looked at
        assert 2 in b.redeliver(460, 0)  # due: ready again
    finally:
        DurableGroup.expire = expire  # type: ignore[method-assign]



def test_a_held_window_is_looked_through_only_once_its_first_deadline_passes() -> None:
    """A consumer holds 1,000 deliveries due in 100 ms: each tick looked at every one of
    them (10,000 flights a second for one such window, the whole window of each QoS 1
    consumer of the broker). The ticks before the first deadline now look at none; the
    one after it finds them all late, and the next deadline is looked for from then."""
    log = MemoryLog()
    b = Broker(Limits(retry_backoff_ms=100, max_retries=10), log=log)
    sub = b.consumer(b.subscribe(1, "t", "g", qos=1, credit=1000).sub_id)
    assert sub is not None
    publish(b, "t", *[b"%d" % i for i in range(1000)])
    log.store()
    taken = b.deliver(1, 1000, 1 << 30, 0, 0)
    assert sum(len(records) for _, records in taken.batches) == 1000
    looks: list[int] = []

    class Counted(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            looks.append(len(self))
            return super().items()

    group = sub.queue
    group.inflight = Counted(group.inflight)
    for now in (10, 50, 99):
        assert b.redeliver(now, 0) == frozenset()
    assert looks == []
    assert 1 in b.redeliver(100, 0) and looks == [1000]  # all late: back to the group
    again = b.deliver(1, 1000, 1 << 30, 100, 0)  # their second deadline: 100 + 200
    offsets = tuple(m.offset for _, records in again.batches
                    for m in decode_one(encode_deliver(1, records)).messages)  # type: ignore
    assert b.ack(1, sub.sub_id, offsets[:999], 0)
    looks.clear()
    assert b.redeliver(299, 0) == frozenset() and looks == []
    assert 1 in b.redeliver(300, 0) and looks == [1]  # the one left unacked comes again

# ------------------------------------------------ what cursors hold in memory (h34 finding 7)

_MATCH_COST = 80  # what ``durable`` charges a remembered topic besides its bytes
_READ_AHEAD_LIMIT = getattr(Limits(), "read_ahead_bytes", 64 << 20)  # wal.read_ahead_bytes


def _cursor(b: Broker, conn: int) -> DurableGroup:
    [consumer] = b.registry.of(conn)
    assert isinstance(consumer.queue, DurableGroup)
    return consumer.queue


def _publish_to_many(b: Broker, topics: list[str]) -> None:
    for k in range(0, len(topics), 512):
        recs = [message_record(Message(t, b"", 0)) for t in topics[k : k + 512]]
        assert b.publish(decode_one(encode_publish(recs)).messages, 0, 1000).refusal is None


def _read_to_the_end(b: Broker, conn: int, log: MemoryLog) -> list[bytes]:
    """Deliveries to ``conn`` until its cursors read the whole log, its disk reads served."""
    got: list[bytes] = []
    for _ in range(10_000):
        taken = b.deliver(conn, 256, 1 << 20, 0, 0)
        got += payloads([r for _, records in taken.batches for r in records])
        for fetch in taken.fetches:
            b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
        if not taken.batches and not taken.fetches:
            return got
    raise AssertionError("never read to the end")


def test_a_replay_past_many_long_topics_remembers_a_bounded_number_of_bytes() -> None:
    """h34 finding 7: a cursor remembered, for each topic it read past, whether its filter
    matched, up to 4,096 topics whatever their length: with topics of 1 KB, 3.8 MB a
    cursor, and a key may run 10,000 replays on a connection (1,000 of them from EARLIEST
    took a broker to 3.9 GB). Now a cursor remembers at most 256 KiB of topics
    (``durable.MATCHES_BYTES``, each charged its length and ~80 B). A few thousand short
    topics, as a fleet has, still fit: a replay does not match each record again."""
    log = MemoryLog()
    b = Broker(Limits(), log=log)
    _publish_to_many(b, [f"sensors/hall/{'z' * 950}/{i}" for i in range(4096)])
    log.store()
    b.subscribe(1, "cmd/hall/#", qos=1, start=Start.EARLIEST)  # matches none of them
    assert _read_to_the_end(b, 1, log) == []
    cursor = _cursor(b, 1)
    assert cursor.next == log.written_offset + 1
    remembered = sum(len(t) + _MATCH_COST for t in cursor._matches)
    assert remembered <= 256 * 1024, f"{len(cursor._matches)} topics, {remembered} bytes"

    short = MemoryLog()
    b = Broker(Limits(), log=short)
    _publish_to_many(b, [f"r/d{i:04d}" for i in range(2000)] * 2)
    short.store()
    b.subscribe(1, "r/#", qos=1, credit=10**6, start=Start.EARLIEST)
    assert len(_read_to_the_end(b, 1, short)) == 4000
    assert len(_cursor(b, 1)._matches) == 2000  # all of them known at once: no matching again


def test_cursors_whose_consumers_do_not_take_hold_at_most_the_read_ahead_budget() -> None:
    """h34 finding 7: each replay whose consumer takes one message and then nothing more (a
    QoS 1 window of one, never acked) kept a disk read of 256 KiB ahead; 400 of them held
    about 100 MB, and a connection may have 10,000. All cursors together now hold at most
    ``wal.read_ahead_bytes`` (64 MiB) and one read: the ones used least recently let go
    of theirs. One that takes again reads again, from where it was."""
    log = MemoryLog(cached_from=10**9)  # every read is a disk read
    b = Broker(Limits(), log=log)
    publish(b, "t", *(b"%05d" % i + b"x" * 300 for i in range(2000)), qos=0)
    log.store()
    n = 400
    for conn in range(1, n + 1):
        b.subscribe(conn, "t", qos=1, credit=1, start=Start.EARLIEST)
        [fetch] = b.deliver(conn, 100, 1 << 20, 0, 0).fetches
        b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
        [(_, batch)] = b.deliver(conn, 100, 1 << 20, 0, 0).batches
        assert [p[:5] for p in payloads(batch)] == [b"00000"]
    cursors = [_cursor(b, conn) for conn in range(1, n + 1)]
    held = sum(len(r.body) for c in cursors for r in c.ahead)
    assert held <= _READ_AHEAD_LIMIT + READ_AHEAD_BYTES, f"{held / 2**20:.1f} MiB read ahead"
    assert not cursors[0].ahead  # used least recently: let go of first
    # its consumer acks and takes again: the next message, read again from the log
    [consumer] = b.registry.of(1)
    b.ack(1, consumer.sub_id, (cursors[0].next - 1,), 0)
    [fetch] = b.deliver(1, 100, 1 << 20, 0, 0).fetches
    b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
    [(_, again)] = b.deliver(1, 100, 1 << 20, 0, 0).batches
    assert [p[:5] for p in payloads(again)] == [b"00001"]


def test_consumers_reading_past_a_small_budget_get_everything_once_in_order() -> None:
    """Ten replays and a durable group read a log from disk at once with a budget of one
    MiB, so that they make each other let go of their read-aheads all the time: each gets
    every message once, in order, and the budget holds (one read over it at most)."""
    from blipmq_server.broker.durable import RECORD_COST

    log = MemoryLog(cached_from=10**9)
    b = Broker(Limits(read_ahead_bytes=1 << 20), log=log)  # type: ignore[call-arg]
    b.subscribe(1, "t", "g", qos=1, credit=10**6)
    n = 3000
    publish(b, "t", *(b"%05d" % i + b"y" * 200 for i in range(n)), qos=0)
    log.store()
    for _ in range(10):
        b.subscribe(1, "t", qos=1, credit=10**6, start=Start.EARLIEST)
    budget = b.cursors.budget  # type: ignore[union-attr]
    got: dict[int, list[bytes]] = {}
    waiting: list[Fetch] = []
    for _ in range(10_000):
        taken = b.deliver(1, 100, 1 << 20, 0, 0)
        for sub_id, records in taken.batches:
            got.setdefault(sub_id, []).extend(p[:5] for p in payloads(records))
            offsets = [m.offset for m in decode_one(encode_deliver(1, records)).messages]  # type: ignore
            b.ack(1, sub_id, tuple(offsets), 0)
        waiting += taken.fetches
        if waiting:  # one read at a time, oldest first, as the prefetcher does
            fetch = waiting.pop(0)
            b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
            assert budget.held <= (1 << 20) + READ_AHEAD_BYTES + READ_AHEAD_RECORDS * RECORD_COST
        elif not taken.batches:
            break
    assert len(got) == 11 and budget.sheds > 0
    assert all(g == [b"%05d" % i for i in range(n)] for g in got.values())


def test_a_cursor_lets_go_of_its_read_ahead_when_its_consumer_leaves() -> None:
    """h34 finding 7: a durable group whose consumer left kept its read-ahead and its
    remembered topics for as long as it exists (until it is deleted or expires). Now they
    go when its last consumer does, as a replay's go with its subscription; the group
    reads again, from where it was, when a consumer comes back."""
    log = MemoryLog(cached_from=10**9)
    b = Broker(Limits(), log=log)
    b.subscribe(1, "t", "g", qos=1, credit=1)
    publish(b, "t", *(b"%05d" % i for i in range(2000)), qos=0)
    log.store()
    [fetch] = b.deliver(1, 100, 1 << 20, 0, 0).fetches
    b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
    assert len(b.deliver(1, 100, 1 << 20, 0, 0).batches) == 1
    group = b.cursors.durable[("t", "g")]  # type: ignore[union-attr]
    assert group.ahead and group._matches
    b.subscribe(2, "t", qos=1, credit=1, start=Start.EARLIEST)  # and a replay
    replay = _cursor(b, 2)
    [fetch] = b.deliver(2, 100, 1 << 20, 0, 0).fetches
    b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
    assert replay.ahead
    b.disconnect(1)
    b.disconnect(2)
    assert not group.ahead and not group._matches
    assert not replay.ahead and not replay._matches
    assert b.cursors.budget.held == 0  # type: ignore[union-attr]
    b.subscribe(3, "t", "g", qos=1, credit=10**6)  # back: the unacked one first, then on
    assert _read_to_the_end(b, 3, log) == [b"%05d" % i for i in range(2000)]


def test_a_read_under_way_when_the_read_ahead_goes_is_dropped_leaving_no_gap() -> None:
    """The next read starts at the end of the read-ahead; should the read-ahead go while
    it is under way (the budget), the read would join on after a gap: it is dropped, and
    the cursor reads again from where it is."""
    log = MemoryLog(cached_from=10**9)
    b = Broker(Limits(), log=log)
    b.subscribe(7, "t", "g", qos=1, credit=10**6)
    n = READ_AHEAD_RECORDS * 2
    publish(b, "t", *(b"%d" % i for i in range(n)), qos=0)
    log.store()
    [fetch] = b.deliver(7, 100, 1 << 20, 0, 0).fetches
    b.fill(fetch.key, log.read(fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
    got: list[bytes] = []
    fetches: list[Fetch] = []
    while not fetches:  # until the read-ahead runs low and the next read starts
        taken = b.deliver(7, 100, 1 << 20, 0, 0)
        got += payloads([r for _, records in taken.batches for r in records])
        fetches = taken.fetches
    group = _cursor(b, 7)
    assert group.ahead and fetches[0].offset > group.next
    group.shed()  # as the budget makes the cursor used least recently do
    b.fill(fetches[0].key, log.read(fetches[0].offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES))
    assert not group.ahead
    got += _read_to_the_end(b, 7, log)
    assert got == [b"%d" % i for i in range(n)]
