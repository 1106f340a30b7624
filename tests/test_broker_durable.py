"""Durable QoS 1 groups in the pure core, over a real log in a temporary directory."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.broker.registry import Consumer
from blipmq_server.broker.storage import READ_AHEAD_BYTES, READ_AHEAD_RECORDS
from blipmq_server.protocol.codec import (
    DeadLetter,
    ErrorCode,
    Message,
    Start,
    dead_letter,
    decode_one,
    encode_deliver,
    encode_publish,
    message_record,
)
from blipmq_server.wal.log import Log, LogOptions


class Setup:
    def __init__(self, path: Path, options: LogOptions | None = None, **limits: int) -> None:
        self.path = path
        self.options = options
        self.log = Log(str(path), options) if options else Log(str(path))
        self.broker = Broker(Limits(**limits), log=self.log)
        self.found = self.log.open(on_record=self.broker.recover)

    def sub(self, *args, **kwargs) -> Consumer:
        """Subscribe and return the core's consumer object."""
        consumer = self.broker.consumer(self.broker.subscribe(*args, **kwargs).sub_id)
        assert consumer is not None
        return consumer

    def publish(self, topic: str, *payloads: bytes, qos: int = 1, ttl: int = 0) -> None:
        recs = [message_record(Message(topic, p, qos, ttl)) for p in payloads]
        res = self.broker.publish(decode_one(encode_publish(recs)).messages, 0, 1000)
        assert res.refusal is None

    def commit(self) -> None:
        batch = self.log.take_batch()
        if batch is not None:
            batch.write(self.log.disk, True)
            self.log.commit(batch)

    def take(self, consumer, now: int = 0, limit: int = 1000, max_bytes: int = 1 << 30
             ) -> list[tuple[int, int, bytes]]:
        records = self.broker.take(consumer, limit, max_bytes, now, 1000)
        while not records and (fetches := self.broker.take_fetches()):
            for f in fetches:  # what the shell does off the event loop
                self.broker.fill(f.key, self.log.read_files(f.offset, READ_AHEAD_RECORDS,
                                                            READ_AHEAD_BYTES))
            records = self.broker.take(consumer, limit, max_bytes, now, 1000)
        if not records:
            return []
        frame = decode_one(encode_deliver(consumer.sub_id, records))
        return [(d.offset, d.delivery_count, d.payload) for d in frame.messages]

    def reopen(self, **limits: int) -> Setup:
        self.commit()
        self.log.close()
        return Setup(self.path, self.options, **limits)


def test_group_reads_from_the_log_and_survives_a_restart(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.sub("conn", "jobs", "g", qos=1)
    s.publish("jobs", b"a", b"b", b"c")
    s.publish("other", b"x")
    assert s.take(c) == []  # nothing is delivered before it is in the log
    s.commit()
    got = s.take(c)
    assert [(p, n) for _, n, p in got] == [(b"a", 1), (b"b", 1), (b"c", 1)]
    assert s.broker.ack("conn", c.sub_id, (got[0][0],), 0)
    s2 = s.reopen()
    assert [g.group for g in s2.broker.durable_groups] == ["g"]
    c2 = s2.sub("conn2", "jobs", "g", qos=1)
    again = s2.take(c2)
    assert [p for _, _, p in again] == [b"b", b"c"]  # acked "a" is not delivered again


def test_group_created_after_messages_starts_at_the_end(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.publish("jobs", b"old")
    s.commit()
    c = s.sub("conn", "jobs", "g", qos=1)
    s.publish("jobs", b"new")
    s.commit()
    assert [p for _, _, p in s.take(c)] == [b"new"]


def test_credit_window_and_ack(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.sub("conn", "t", "g", qos=1, credit=2)
    s.publish("t", b"1", b"2", b"3", b"4")
    s.commit()
    first = s.take(c)
    assert [p for _, _, p in first] == [b"1", b"2"]
    assert not s.broker.has_work(c) and s.take(c) == []
    assert s.broker.ack("conn", c.sub_id, (first[0][0],), 0)
    assert s.broker.has_work(c)
    assert [p for _, _, p in s.take(c)] == [b"3"]


def test_unacked_bytes_are_a_window_of_their_own(tmp_path: Path) -> None:
    """A consumer with a window far larger than the messages it holds unacked: at most
    ``max_inflight_bytes`` of them are held for it (a take's first whatever its size, while
    under the limit), through acks, nacks, redeliveries and a consumer that leaves (was: its
    whole credit, each kept in the broker's memory until acked: a backlog's worth for a
    consumer that never acks)."""
    s = Setup(tmp_path, max_inflight_bytes=10_000, retry_backoff_ms=100)
    c = s.sub("conn", "t", "g", qos=1, credit=100_000)
    s.publish("t", *[b"%d" % i + b"x" * 2_999 for i in range(20)])
    s.commit()
    group = s.broker.cursors.durable[("t", "g")]

    def takes(consumer: Consumer, now: int = 0) -> list[tuple[int, int, bytes]]:
        out: list[tuple[int, int, bytes]] = []
        while got := s.take(consumer, now=now):
            out += got
        return out

    assert len(s.take(c)) == 3  # 3 fit under 10,000 bytes
    first = takes(c)  # held under the limit: one more, whatever its size
    assert len(first) == 1 and group.bytes_for(c.sub_id) > 10_000
    assert not s.broker.has_work(c)
    s.broker.ack("conn", c.sub_id, (first[0][0],), 0)
    assert s.broker.has_work(c)
    again = takes(c)
    assert [p[:1] for _, _, p in again] == [b"4"]  # one ack: room for one
    s.broker.nack("conn", c.sub_id, (again[0][0],), 0, 0, 1000)
    assert [(p[:1], n) for _, n, p in takes(c)] == [(b"4", 2)]  # sent again, 4 held still
    assert s.broker.redeliver(10_000, 0)  # every deadline passed: all back, then again
    assert len(takes(c, now=10_000)) == 4
    held = tuple(o for o, f in group.inflight.items() if f.sub_id == c.sub_id)
    assert len(held) == 4
    s.broker.ack("conn", c.sub_id, held, 0)
    assert group.bytes_for(c.sub_id) == 0 and group.in_flight_for(c.sub_id) == 0
    other = s.sub("c2", "t", "g", qos=1, credit=100_000)
    assert len(takes(c)) == 4
    s.broker.disconnect("conn")  # what it held goes to the other, counted for the other
    assert group.bytes_for(c.sub_id) == 0
    assert len(takes(other)) == 4 and group.bytes_for(other.sub_id) > 10_000
    unlimited = Setup(tmp_path / "u", max_inflight_bytes=0)
    u = unlimited.sub("conn", "t", "g", qos=1, credit=100_000)
    unlimited.publish("t", *[b"y" * 3_000] * 20)
    unlimited.commit()
    assert len(unlimited.take(u)) == 20


def test_credit_frame_shrinks_and_grows_the_window(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.sub("conn", "t", "g", qos=1, credit=3)
    q0 = s.sub("conn", "t")
    s.publish("t", *[b"%d" % i for i in range(6)])
    s.commit()
    first = s.take(c)
    assert len(first) == 3
    assert not s.broker.set_credit("conn", c.sub_id, 1)  # smaller: nothing new to send
    s.broker.ack("conn", c.sub_id, tuple(o for o, _, _ in first), 0)
    assert [p for _, _, p in s.take(c)] == [b"3"]  # one, not three
    assert not s.broker.set_credit("other", c.sub_id, 5)  # not its subscription
    assert not s.broker.set_credit("conn", q0.sub_id, 5)  # QoS 0: no window
    assert s.broker.set_credit("conn", c.sub_id, 2)
    assert [p for _, _, p in s.take(c)] == [b"4"]
    assert s.broker.set_credit("conn", c.sub_id, 0) is False
    s.broker.ack("conn", c.sub_id, (first[0][0] + 3, first[0][0] + 4), 0)
    assert s.take(c) == []  # paused


def test_unacked_deliveries_come_back_with_backoff_then_dead_letter(tmp_path: Path) -> None:
    s = Setup(tmp_path, retry_backoff_ms=100, retry_backoff_max_ms=1000, max_retries=3)
    c = s.sub("conn", "t", "g", qos=1)
    dlq = s.sub("ops", "$dlq/t")
    s.publish("t", b"poison")
    s.commit()
    assert [n for _, n, _ in s.take(c, now=0)] == [1]
    assert not s.broker.redeliver(99, 0) and s.take(c, now=99) == []
    assert s.broker.redeliver(100, 0)  # deadline 100 ms after the first delivery
    assert [n for _, n, _ in s.take(c, now=100)] == [2]
    assert not s.broker.redeliver(299, 0)  # the second deadline is 200 ms later
    s.broker.redeliver(300, 0)
    assert [n for _, n, _ in s.take(c, now=300)] == [3]
    s.broker.redeliver(700, 0)  # third delivery unacked: max_retries reached
    assert s.take(c, now=700) == []
    assert [p for _, _, p in s.take(dlq)] == [b"poison"]
    assert s.broker.counters.dead_lettered == 1 and s.broker.counters.redelivered == 2


def test_disconnect_returns_deliveries_to_the_group(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    first = s.sub("c1", "t", "g", qos=1)
    second = s.sub("c2", "t", "g", qos=1)
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


def test_qos1_and_replay_need_the_log() -> None:
    no_log = Broker()
    assert no_log.subscribe("c", "t", "g", qos=1).refusal.code == ErrorCode.UNSUPPORTED
    assert no_log.subscribe("c", "t", qos=1).refusal.code == ErrorCode.UNSUPPORTED
    assert no_log.subscribe("c", "t", start=Start.EARLIEST).refusal.code == ErrorCode.UNSUPPORTED


def test_qos1_without_a_group_is_acked_but_leaves_no_trace(tmp_path: Path) -> None:
    s = Setup(tmp_path, retry_backoff_ms=100)
    c = s.sub("conn", "t", qos=1, credit=2)
    s.publish("t", b"1", b"2", b"3")
    s.commit()
    got = s.take(c, now=0)
    assert [(p, n) for _, n, p in got] == [(b"1", 1), (b"2", 1)]  # the window is 2
    assert s.broker.ack("conn", c.sub_id, (got[0][0],), 0)
    s.broker.redeliver(100, 0)  # "2" was not acked in time
    assert [(p, n) for _, n, p in s.take(c, now=100)] == [(b"2", 2), (b"3", 1)]
    s.broker.disconnect("conn")
    assert s.broker.all_cursors == () and s.broker.durable_groups == ()
    s2 = s.reopen()
    kinds = [r.kind for r in s2.log.read(0)]
    assert kinds == [1, 1, 1]  # messages only: no GROUP or ACK records


def test_replay_from_earliest_offset_or_latest(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.publish("t", b"a", b"b", b"c")
    s.commit()
    first = s.log.first_offset
    replay = s.sub("c1", "t", start=Start.EARLIEST)
    assert [p for _, _, p in s.take(replay)] == [b"a", b"b", b"c"]
    assert s.broker.ack("c1", replay.sub_id, (first,), 0) is False  # QoS 0: nothing to ack
    from_b = s.sub("c2", "t", "g", qos=1, start=Start.OFFSET,
                                start_offset=first + 1)
    assert [p for _, _, p in s.take(from_b)] == [b"b", b"c"]
    latest = s.sub("c3", "t", "h", qos=1, start=Start.LATEST)
    assert s.take(latest) == []
    past = s.broker.subscribe("c4", "t", "i", qos=1, start=Start.OFFSET,
                              start_offset=s.log.next_offset + 1)
    assert past.refusal.code == ErrorCode.INVALID_REQUEST and "past the end" in past.refusal.text
    s.publish("t", b"d")
    s.commit()
    assert [p for _, _, p in s.take(replay)] == [b"d"]  # then it follows the live log
    # an existing group keeps its cursor whatever the new consumer asks for
    again = s.sub("c5", "t", "h", qos=1, start=Start.EARLIEST)
    assert [p for _, _, p in s.take(again)] == [b"d"]
    zero_group = s.broker.subscribe("c6", "t", "q0", start=Start.EARLIEST)
    assert zero_group.refusal.code == ErrorCode.UNSUPPORTED


def test_a_replayed_group_survives_a_restart_from_its_start(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.publish("t", b"a", b"b")
    s.commit()
    s.broker.subscribe("c", "t", "g", qos=1, start=Start.EARLIEST)
    s2 = s.reopen()
    c = s2.sub("c", "t", "g", qos=1)
    assert [p for _, _, p in s2.take(c)] == [b"a", b"b"]


def test_nack_now_and_with_a_delay(tmp_path: Path) -> None:
    s = Setup(tmp_path, retry_backoff_ms=10_000)
    c = s.sub("conn", "t", "g", qos=1, credit=1)
    s.publish("t", b"x", b"y")
    s.commit()
    [(x, _, _)] = s.take(c, now=0)
    assert not s.broker.nack("other", c.sub_id, (x,), 0, 0, 0)  # not its delivery
    assert s.broker.nack("conn", c.sub_id, (x,), 0, 0, 0) is not None
    assert [(p, n) for _, n, p in s.take(c, now=1)] == [(b"x", 2)]  # at once, before "y"
    assert s.broker.nack("conn", c.sub_id, (x,), 500, 1, 0) is not None
    assert [p for _, _, p in s.take(c, now=2)] == [b"y"]  # the window was freed
    assert s.broker.ack("conn", c.sub_id, (x + 1,), 0)
    assert not s.broker.redeliver(500, 0) and s.take(c, now=500) == []
    assert s.broker.redeliver(501, 0)
    assert [(p, n) for _, n, p in s.take(c, now=501)] == [(b"x", 3)]
    assert s.broker.counters.nacked == 2


def dead_letters(s: Setup, consumer) -> list:
    records = s.broker.take(consumer, 100, 1 << 30, 0, 0)
    return list(decode_one(encode_deliver(consumer.sub_id, records)).messages) if records else []


def test_dead_letters_carry_the_count_and_the_reason(tmp_path: Path) -> None:
    s = Setup(tmp_path, max_retries=2)
    c = s.sub("conn", "t", "g", qos=1)
    dlq = s.sub("ops", "$dlq/#")
    s.publish("t", b"poison", b"fine")
    s.commit()
    got = s.take(c)
    poison = got[0][0]
    s.broker.nack("conn", c.sub_id, (poison,), 0, 0, 0)
    assert [(p, n) for _, n, p in s.take(c)] == [(b"poison", 2)]
    s.broker.nack("conn", c.sub_id, (poison,), 0, 0, 0)  # second delivery: max_retries
    assert s.take(c) == []
    [dead] = dead_letters(s, dlq)
    assert (dead.topic, dead.payload, tuple(dead.dead)) == ("$dlq/t", b"poison", (2, "nacked"))
    # dead_letter() of a dead letter keeps one trailer, the newest (the broker itself never
    # makes one: a dead letter that runs out is dropped, see the test below)
    s.commit()
    again = dead_letter(s.log.read(dead.offset)[0].body, DeadLetter(7, "again"))
    s.broker.publish([again], 0, 0, internal=True)
    [twice] = dead_letters(s, dlq)
    assert (twice.topic, twice.payload, tuple(twice.dead)) == ("$dlq/$dlq/t", b"poison",
                                                               (7, "again"))
    # the dead-lettered offset is done for the group, also after a restart
    s2 = s.reopen()
    c2 = s2.sub("conn", "t", "g", qos=1)
    assert [p for _, _, p in s2.take(c2)] == [b"fine"]


def test_a_full_blocking_dlq_queue_does_not_lose_the_dead_letter(tmp_path: Path) -> None:
    s = Setup(tmp_path, max_retries=1, capacity=1)  # in-memory queues block by default
    c = s.sub("conn", "t", "g", qos=1)
    s.broker.subscribe("ops", "$dlq/#")  # nobody takes from it: full after one
    s.publish("t", b"a", b"b")
    s.commit()
    a, b = (o for o, _, _ in s.take(c))
    s.broker.nack("conn", c.sub_id, (a,), 0, 0, 0)
    s.broker.nack("conn", c.sub_id, (b,), 0, 0, 0)  # its dead letter meets a full queue
    assert s.broker.counters.dead_lettered == 2 and s.broker.counters.dropped_new == 1
    s.commit()
    dead = [r for r in s.log.read(0) if b"$dlq/t" in r.body]
    assert len(dead) == 2  # both are in the log, readable with --from


def test_unsubscribe_by_filter_ends_cursors_without_a_group(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.broker.subscribe("conn", "t", qos=1)
    s.broker.subscribe("conn", "t", start=Start.EARLIEST)
    s.broker.subscribe("conn", "t", "g", qos=1)  # a group: not ended by a filter
    assert len(s.broker.all_cursors) == 3
    assert s.broker.unsubscribe("conn", topic_filter="t").count == 2
    assert [c.group for c in s.broker.all_cursors] == ["g"]


def test_idle_durable_groups_expire(tmp_path: Path) -> None:
    s = Setup(tmp_path, group_expiry_ms=1000)
    kept = s.sub("c1", "t", "kept", qos=1, timestamp_ms=0)
    s.broker.subscribe("c2", "t", "idle", qos=1, timestamp_ms=0)
    s.broker.disconnect("c2", timestamp_ms=5000)
    assert s.broker.expire_groups(5999) == []
    assert [g.group for g in s.broker.expire_groups(6000)] == ["idle"]
    assert kept.queue.idle_since is None and s.broker.expire_groups(10**9) == []
    s.broker.subscribe("c3", "t", "later", qos=1, timestamp_ms=0)
    s.broker.disconnect("c3", timestamp_ms=7000)
    s2 = s.reopen(group_expiry_ms=1000)
    s2.broker.recovered(20_000)
    groups = {g.group: g.idle_since for g in s2.broker.durable_groups}
    # "later" detached at 7000 (an IDLE record); "kept" had a consumer: idle from the restart
    assert groups == {"kept": 20_000, "later": 7000}
    assert [g.group for g in s2.broker.expire_groups(20_999)] == ["later"]
    assert s2.broker.counters.groups_expired == 1
    s3 = s2.reopen()
    assert [g.group for g in s3.broker.durable_groups] == ["kept"]


def test_groups_never_expire_by_default(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.broker.subscribe("c", "t", "g", qos=1)
    s.broker.disconnect("c", timestamp_ms=0)
    assert s.broker.expire_groups(10**12) == []


def test_floor_bounds_retention(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    c = s.sub("conn", "t", "g", qos=1)
    s.publish("t", b"1", b"2")
    s.commit()
    got = s.take(c)
    assert s.broker.durable_floor() == got[0][0]
    s.broker.ack("conn", c.sub_id, tuple(o for o, _, _ in got), 0)
    assert s.broker.durable_floor() == got[-1][0] + 1


def test_checkpoints_let_retention_delete_a_groups_create_record(tmp_path: Path) -> None:
    s = Setup(tmp_path, LogOptions(segment_bytes=4096, retention_bytes=8192))
    c = s.sub("conn", "t", "g", qos=1)
    group = c.queue
    payloads = [b"m%03d" % i + b"." * 96 for i in range(300)]
    for p in payloads:
        s.publish("t", p)
    s.publish("other", b"x" * 100)
    s.commit()
    got: list = []
    while batch := s.take(c):
        got += batch
        s.broker.ack("conn", c.sub_id, tuple(o for o, _, _ in batch), 0)
    assert [p for _, _, p in got] == payloads
    assert s.broker.checkpoint(1000, s.log.segments[-1].base) > 0
    assert s.broker.checkpoint(1000, s.log.segments[-1].base) == 0  # all anchors are new
    s.commit()
    removed = s.log.retain(2000, s.broker.durable_floor()).removed
    assert removed and s.log.first_offset > group.id  # the create record is gone
    s.publish("t", b"after")
    s2 = s.reopen()
    [g2] = s2.broker.durable_groups
    assert (g2.id, g2.filter, g2.group) == (group.id, "t", "g")
    c2 = s2.sub("conn", "t", "g", qos=1)
    assert [p for _, _, p in s2.take(c2)] == [b"after"]


def test_a_checkpoint_keeps_unacked_deliveries_and_later_acks(tmp_path: Path) -> None:
    s = Setup(tmp_path, LogOptions(segment_bytes=4096, retention_bytes=8192))
    c = s.sub("conn", "t", "g", qos=1)
    for i in range(100):
        s.publish("t", b"%03d" % i + b"." * 96)
    s.commit()
    got: list = []
    while batch := s.take(c):
        got += batch
        s.broker.ack("conn", c.sub_id, tuple(o for o, _, p in batch
                                             if p[:3] not in (b"097", b"098")), 0)
    s.broker.checkpoint(1000, s.log.segments[-1].base)
    s.broker.ack("conn", c.sub_id, (got[97][0],), 0)  # after the checkpoint: an ACK record
    s.commit()
    assert s.log.retain(2000, s.broker.durable_floor()).removed
    s2 = s.reopen()
    c2 = s2.sub("conn", "t", "g", qos=1)
    again = s2.take(c2)
    assert [(p[:3], n) for _, n, p in again] == [(b"098", 2)]  # delivered before: count 2
    assert s2.broker.durable_floor() == got[98][0]
    # a size cap that removes what the group still needs: it skips, counted
    s2.broker.ack("conn", c2.sub_id, (got[98][0],), 0)
    skipped = s2.broker.skip_to(c2.queue.next + 5)
    assert skipped == [(c2.queue, 5)] and c2.queue.skipped == 5


def test_a_skip_of_unacked_deliveries_alone_recounts_from_the_cursor(tmp_path: Path) -> None:
    """After a restart a group holds one old unacked delivery (from its checkpoint) and
    reads far past it; the size cap removes the segment holding it. Only that delivery is
    lost (skipped 1), and the backlog is counted again from the cursor: counted from where
    retention cut the log, it held the 90 messages already delivered and acked, for good."""
    s = Setup(tmp_path)
    c = s.sub("conn", "t", "g", qos=1)
    for i in range(100):
        s.publish("t", b"%03d" % i)
    s.commit()
    got: list = []
    while batch := s.take(c):
        got += batch
        s.broker.ack("conn", c.sub_id, tuple(o for o, _, p in batch if p != b"005"), 0)
    s.broker.checkpoint(1000, s.log.segments[-1].base + 1)
    s.commit()
    s2 = s.reopen()
    c2 = s2.sub("conn", "t", "g", qos=1)
    s2.broker.take_counts()  # the restart's own count
    assert s2.broker.skip_to(got[10][0]) == [(c2.queue, 1)]  # only "005" was below
    (count,) = s2.broker.take_counts()
    assert count.first >= c2.queue.next > got[99][0], (count, c2.queue.next)


def test_cursor_batches_stay_within_max_bytes(tmp_path: Path) -> None:
    s = Setup(tmp_path, retry_backoff_ms=100)
    c = s.sub("conn", "t", "g", qos=1)
    replay = s.sub("conn2", "t", start=Start.EARLIEST)
    s.publish("t", *(bytes([65 + i]) * 1000 for i in range(10)))
    s.publish("t", b"z" * 5000)
    s.commit()
    for consumer in (c, replay):
        sizes = []
        while got := s.take(consumer, max_bytes=3500):
            sizes.append([len(p) for _, _, p in got])
        # ~1040-byte delivery records: three fit in 3500 bytes; the 5000-byte one goes alone
        assert sizes == [[1000] * 3, [1000] * 3, [1000] * 3, [1000], [5000]]
    assert s.broker.redeliver(100, 0) == {"conn"}
    again = s.take(c, now=100, max_bytes=2500)  # redeliveries are bounded the same way
    assert [(n, len(p)) for _, n, p in again] == [(2, 1000), (2, 1000)]


def test_a_cursor_behind_the_cache_asks_for_a_disk_read_and_waits_for_it(tmp_path: Path) -> None:
    s = Setup(tmp_path, LogOptions(cache_bytes=0))  # every read would go to the files
    c = s.sub(7, "t", "g", qos=1)
    s.publish("t", b"a", b"b")
    s.commit()
    assert s.broker.has_work(c)
    assert s.broker.take(c, 100, 1 << 20, 0, 0) == []  # nothing read on the caller's thread
    [fetch] = s.broker.take_fetches()
    assert not s.broker.has_work(c)  # waits for the read, no busy loop
    assert s.broker.take_fetches() == []  # asked once
    assert s.broker.fill(fetch.key, s.log.read_files(fetch.offset, 100, 1 << 20)) == {7}
    assert s.broker.has_work(c)
    assert len(s.broker.take(c, 100, 1 << 20, 0, 0)) == 2
    s.broker.unsubscribe(8, topic_filter="t", group="g")
    assert s.broker.fill(fetch.key, []) == frozenset()  # the cursor is gone: ignored


def test_in_flight_counts_per_consumer_stay_exact(tmp_path: Path) -> None:
    # the window check reads a running count; it must equal what is really held, whatever
    # happens (takes, acks, nacks with and without delay, redeliveries, dead letters, leaving)
    import random
    from collections import Counter

    rng = random.Random(7)
    s = Setup(tmp_path, retry_backoff_ms=50, max_retries=3)
    consumers = [s.sub(conn, "t", "g", qos=1, credit=8)
                 for conn in (1, 2, 3)]
    group = consumers[0].queue
    now = 0
    for step in range(600):
        now += rng.choice((0, 10, 60))
        c = rng.choice(consumers)
        op = rng.random()
        if op < 0.2:
            s.publish("t", *(b"m%d" % step for _ in range(rng.randint(1, 5))))
            s.commit()
        elif op < 0.5:
            s.take(c, now=now)
        elif op < 0.7:
            held = [o for o, f in group.inflight.items() if f.sub_id == c.sub_id]
            s.broker.ack(c.conn, c.sub_id, tuple(rng.sample(held, min(len(held), 3))), 0)
        elif op < 0.8:
            held = [o for o, f in group.inflight.items() if f.sub_id == c.sub_id]
            s.broker.nack(c.conn, c.sub_id, tuple(held[:2]), rng.choice((0, 30)), now, 0)
        elif op < 0.95:
            s.broker.redeliver(now, 0)
        else:
            s.broker.disconnect(c.conn)
            consumers.remove(c)
            consumers.append(s.sub(c.conn, "t", "g", qos=1, credit=8))
        really = Counter(f.sub_id for f in group.inflight.values() if f.sub_id > 0)
        assert group.held == dict(really), step
        assert all(n <= 8 for n in really.values())


def test_usage_and_backlog_count_runs_of_topics_and_only_logged_messages(tmp_path: Path
                                                                         ) -> None:
    """Per-topic counts and a durable group's backlog, over batches that switch topics and
    mix logged QoS 1 with unlogged QoS 0 messages (wal.include_qos0 = false)."""
    s = Setup(tmp_path, log_qos0=False)
    g = s.sub(1, "a/#", "g", qos=1)
    recs = [message_record(Message(t, p, q)) for t, p, q in (
        ("a/x", b"1", 1), ("a/x", b"22", 0), ("b", b"333", 1), ("a/y", b"4444", 1),
        ("a/x", b"5", 1))]
    res = s.broker.publish(decode_one(encode_publish(recs)).messages, 0, 1000)
    assert res.accepted == 5
    stats = {t["topic"]: (t["messages"], t["bytes"]) for t in s.broker.stats()["topics"]}
    assert stats == {"a/x": (3, 4), "b": (1, 3), "a/y": (1, 4)}
    group = g.queue
    assert group.backlog == 3  # a/x twice at QoS 1 and a/y: the QoS 0 one is not logged
    s.commit()
    assert [p for _, _, p in s.take(g)] == [b"1", b"4444", b"5"]
    assert group.backlog == 0


def test_a_patient_consumer_keeps_its_deliveries_and_counts_its_own_retries(
        tmp_path: Path) -> None:
    """A bridge's consumer: no deadline makes its deliveries come back; a dropped link gives
    them back without spending a retry; nacks without ``spend`` never dead-letter, and
    ``give_up`` dead-letters at once."""
    s = Setup(tmp_path, retry_backoff_ms=100, max_retries=2)
    c = s.sub("bridge", "t", "bridge.up", qos=1, patient=True)
    dlq = s.sub("ops", "$dlq/#")
    s.publish("t", b"a", b"b")
    s.commit()
    a, b = (offset for offset, _, _ in s.take(c))
    # never due: not even among the cursors the redelivery tick looks at (a bridge's window
    # of thousands was looked through ten times a second)
    assert not s.broker.cursors.flying
    assert not s.broker.redeliver(10**9, 0) and s.take(c, now=10**9) == []
    for count in (2, 3, 4):  # the link drops: back, and taken again with DUP's count
        assert s.broker.requeue("bridge", c.sub_id) == 2
        assert [(o, n) for o, n, _ in s.take(c)] == [(a, count), (b, count)]
    s.broker.nack("bridge", c.sub_id, (b,), 50, 0, 0, "refused", spend=False)
    assert s.broker.cursors.flying  # a delayed nack: the tick brings it back when due
    assert s.take(c, now=10) == [] and s.broker.redeliver(60, 0)
    assert [(o, n) for o, n, _ in s.take(c, now=60)] == [(b, 5)]  # past max_retries: back
    assert s.take(dlq) == []
    s.broker.nack("bridge", c.sub_id, (a,), 0, 0, 0, "refused for good", give_up=True)
    assert [(d.payload, tuple(d.dead)) for d in dead_letters(s, dlq)] == [
        (b"a", (4, "refused for good"))]


def test_a_dead_letter_that_runs_out_is_dropped_not_dead_lettered_again(
        tmp_path: Path) -> None:
    """A dead letter its readers fail on in their turn (ack deadlines, nacks, a bridge's
    ``give_up``) is dropped from each group or QoS 1 subscription that gave up on it and
    counted (``dead_letters_dropped``), never dead-lettered again to ``$dlq/$dlq/...``
    (h21 #5); a durable group logs it as done, so a restart does not deliver it again."""
    s = Setup(tmp_path, retry_backoff_ms=100, retry_backoff_max_ms=100, max_retries=2)
    c = s.sub("conn", "t", "g", qos=1)
    review = s.sub("ops", "$dlq/#", "review", qos=1)
    plain = s.sub("ops", "$dlq/#", qos=1)
    bridge = s.sub("bridge", "$dlq/#", "bridge.up", qos=1, patient=True)
    watch = s.sub("watch", "$dlq/#")  # QoS 0: sees every dead letter once
    s.publish("t", b"a", b"b")
    s.commit()
    for offset, _, _ in s.take(c):
        s.broker.nack("conn", c.sub_id, (offset,), 0, 0, 0, "bad", give_up=True)
    s.commit()
    first, second = (o for o, _, _ in s.take(review))
    s.broker.nack("ops", review.sub_id, (first,), 0, 0, 0)
    assert [(o, n) for o, n, _ in s.take(review)] == [(first, 2)]
    s.broker.nack("ops", review.sub_id, (first,), 0, 0, 0)  # its last delivery
    assert len(s.take(plain)) == 2
    s.broker.nack("bridge", bridge.sub_id, (s.take(bridge)[0][0],), 0, 0, 0, "refused",
                  give_up=True)
    for now in (100, 200):  # the deadlines of the first and the second delivery
        s.broker.redeliver(now, 0)
        s.take(review, now=now)
        s.take(plain, now=now)
    counters = s.broker.counters
    assert counters.dead_lettered == 2  # the two originals' dead letters, and no more
    assert counters.dead_letters_dropped == 5  # by review (3: 2 deadlines, 1 nack), plain, bridge
    assert not s.broker.in_flight("ops", review.sub_id, second)
    assert [(d.topic, d.payload, tuple(d.dead)) for d in dead_letters(s, watch)] == [
        ("$dlq/t", b"a", (1, "bad")), ("$dlq/t", b"b", (1, "bad"))]
    s.commit()
    assert not [r for r in s.log.read(0) if b"$dlq/$dlq/" in r.body]
    s2 = s.reopen(retry_backoff_ms=100, max_retries=2)
    again = s2.sub("ops", "$dlq/#", "review", qos=1)
    assert s2.take(again) == []  # the group moved on past both
    bridge = s2.sub("bridge", "$dlq/#", "bridge.up", qos=1, patient=True)
    assert [p for _, _, p in s2.take(bridge)] == [b"b"]  # the one it did not give up on


def test_bridge_groups_are_closed_to_clients(tmp_path: Path) -> None:
    """No client joins a bridge's group, nor deletes a configured bridge's (``bridged``);
    the group of a bridge no longer configured may be deleted like any other."""
    s = Setup(tmp_path)
    s.broker.bridged = frozenset({"bridge.up"})
    joined = s.broker.subscribe("client", "t", "bridge.up", qos=1)
    assert joined.refusal is not None and "belong to bridges" in joined.refusal.text
    gone = s.broker.unsubscribe("client", topic_filter="t", group="bridge.up")
    assert gone.refusal is not None and "belong to bridges" in gone.refusal.text
    made = s.broker.subscribe("bridge", "t", "bridge.old", qos=1, patient=True)
    assert made.refusal is None
    s.broker.unsubscribe("bridge", made.sub_id)
    deleted = s.broker.unsubscribe("client", topic_filter="t", group="bridge.old")
    assert deleted.refusal is None, deleted


_OPS = st.lists(st.one_of(
    st.tuples(st.just("sub"), st.sampled_from(["a/#", "b"]), st.sampled_from(["g1", "g2"])),
    st.tuples(st.just("del"), st.sampled_from(["a/#", "b"]), st.sampled_from(["g1", "g2"])),
    st.tuples(st.just("state"), st.sampled_from([b"k1", b"k2"]),
              st.sampled_from([b"", b"x", b"y"])),
    st.tuples(st.just("pub"), st.sampled_from(["a/1", "b"]), st.just("")),
    st.tuples(st.just("write"), st.just(""), st.just("")),
    st.tuples(st.just("lose"), st.just(""), st.just("")),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_after_lost_batches_the_log_says_what_memory_does(tmp_path_factory, ops) -> None:
    """Whatever batches the disk refused (``Log.abort``, then ``Broker.relog`` as the
    flusher does), once a write succeeds a restart finds the durable groups and the saved
    states the broker had in memory."""
    path = tmp_path_factory.mktemp("relog")
    s = Setup(path)
    conn = 1
    for op, a, b in ops:
        if op == "sub":
            assert s.broker.subscribe(conn, a, b, qos=1).refusal is None
        elif op == "del":
            s.broker.unsubscribe(conn, topic_filter=a, group=b, timestamp_ms=1)
        elif op == "state":
            s.broker.put_state(a, b, 1)  # type: ignore[arg-type]
        elif op == "pub":
            s.publish(a, b"m")
        elif op == "write":
            s.commit()
        else:
            batch = s.log.take_batch()
            if batch is not None:
                s.log.abort(batch)
                s.broker.relog(batch.first_offset, batch.last_offset, 2)
    s.commit()
    groups = {(g.filter, g.group) for g in s.broker.durable_groups}
    states = dict(s.broker.states)
    s.log.close()
    again = Setup(path)
    again.broker.recovered(3)
    assert {(g.filter, g.group) for g in again.broker.durable_groups} == groups
    assert again.broker.states == states
    again.log.close()


def test_a_group_restated_after_a_lost_batch_keeps_its_idle_time(tmp_path: Path) -> None:
    """A group whose records the disk refused is restated with its idle time, so
    ``delivery.group_expiry_ms`` counts from when its last consumer left, not from the
    next restart."""
    s = Setup(tmp_path)
    s.broker.subscribe(1, "jobs", "g", qos=1)
    s.broker.disconnect(1, timestamp_ms=5_000)  # idle since 5 s
    batch = s.log.take_batch()
    assert batch is not None
    s.log.abort(batch)
    s.broker.relog(batch.first_offset, batch.last_offset, 9_000)
    s.commit()
    s.log.close()
    again = Setup(tmp_path)
    again.broker.recovered(20_000)
    (g,) = again.broker.durable_groups
    assert (g.filter, g.group, g.idle_since) == ("jobs", "g", 5_000)
    again.log.close()


def test_a_key_holds_durable_groups_within_its_share(tmp_path: Path) -> None:
    """docs/SECURITY.md, "Shares": a key's new durable groups count against its quota; at
    it, the key is refused (LIMIT, naming the limit and its count) and others are not; a
    group deleted or expired gives its place back, and a restart counts them again from
    their owners' records."""
    from blipmq_server.broker.access import Access, Identity, Quota

    s = Setup(tmp_path, group_expiry_ms=1000)
    b = s.broker
    hog = Access(Identity("hog", subscribe=("a/#",), quota=Quota(durable_groups=2)))
    other = Access(Identity("other", subscribe=("a/#",), quota=Quota(durable_groups=2)))
    for g in ("g1", "g2"):
        assert b.subscribe(1, "a/#", g, qos=1, access=hog).sub_id
    over = b.subscribe(1, "a/#", "g3", qos=1, access=hog)
    assert over.refusal is not None and over.refusal.code == ErrorCode.LIMIT
    assert over.refusal.text.startswith("key 'hog' holds 2 durable groups, the most its "
                                        "share allows (2: max_durable_groups"), over.refusal
    assert b.subscribe(2, "a/#", "o1", qos=1, access=other).sub_id  # another key: served
    assert b.subscribe(3, "a/#", "g1", qos=1, access=hog).sub_id  # joining its own: fine
    assert b.subscribe(1, "a/#", qos=1, access=hog).sub_id  # a cursor of its own: no group
    assert b.counters.limited == {"auth.keys.max_durable_groups": 1}
    assert b.unsubscribe(1, 0, "a/#", "g2", 0, access=hog).count
    assert b.subscribe(1, "a/#", "g3", qos=1, access=hog).sub_id  # room again
    assert b.groups_held == {"hog": 2, "other": 1}
    s.commit()
    s.log.close()
    again = Setup(tmp_path, group_expiry_ms=1000)
    again.broker.recovered(5_000)
    assert again.broker.groups_held == {"hog": 2, "other": 1}
    assert again.broker.subscribe(1, "a/#", "g4", qos=1, access=hog).refusal is not None
    assert len(again.broker.expire_groups(10_000)) == 3  # nobody consumes: they expire
    assert again.broker.groups_held == {}
    assert again.broker.subscribe(1, "a/#", "g4", qos=1, access=hog).sub_id
    again.log.close()


def test_the_broker_holds_at_most_max_durable_groups(tmp_path: Path) -> None:
    s = Setup(tmp_path, max_durable_groups=2)
    b = s.broker
    assert b.subscribe(1, "a/#", group="g1", qos=1).sub_id
    assert b.subscribe(1, "a/#", group="g2", qos=1).sub_id
    over = b.subscribe(1, "a/#", group="g3", qos=1)
    assert over.refusal is not None and over.refusal.code == ErrorCode.LIMIT
    assert "queues.max_durable_groups" in over.refusal.text
    assert b.subscribe(2, "a/#", group="g1", qos=1).sub_id  # joining one that exists
    assert b.subscribe(2, "b/#", qos=1).sub_id  # a cursor of its own is no group
    assert b.unsubscribe(1, 0, "a/#", "g2", 0).count
    assert b.subscribe(1, "a/#", group="g3", qos=1).sub_id  # room again


def test_subscribing_again_while_a_retained_value_is_held_frees_its_place(tmp_path: Path) -> None:
    """An MQTT client subscribes again to a filter on a live connection (MQTT-3.8.4-3: its
    retained values come again) while the live delivery of a retained publish is still
    unacked: the value's new delivery took the old one's place in flight, but the
    consumer was still counted as holding the old one, one slot of its window and its
    bytes for good (after `mqtt.max_inflight` of those the subscription stalled until a
    reconnect). Subscribing again and again without taking queues each value once."""
    s = Setup(tmp_path)
    c = s.sub(1, "a", "", qos=1, credit=2, patient=True)
    rec = message_record(Message("a", b"v1", 1, 0, None, True))
    assert s.broker.publish(decode_one(encode_publish([rec])).messages, 0, 1000).refusal is None
    s.commit()
    for _ in range(3):
        (offset, _, payload), = s.take(c)
        assert payload == b"v1"
        s.broker.retained_again(1, c.sub_id, 1000)
        assert not s.broker.ack(1, c.sub_id, (offset,), 0)  # the old delivery: replaced
    target = c.queue
    assert target.held == {} and target.held_bytes == {}
    for _ in range(100):
        s.broker.retained_again(1, c.sub_id, 1000)
    assert list(target.ready) == [offset]
    (again, _, _), = s.take(c)
    assert s.broker.ack(1, c.sub_id, (again,), 0)
    assert target.held == {} and not target.inflight
    assert s.broker.cursors.unacked.total == 0
