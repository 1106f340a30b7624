"""The QoS 0 queues one connection reads from hold ``max_bytes_per_connection`` together
(``queue.Pool``): pure core, no event loop."""

from blipmq_server.broker.core import Blocked, Broker, Limits
from blipmq_server.broker.queue import Overflow, Queue
from blipmq_server.broker.registry import Consumer
from blipmq_server.protocol.codec import PREFIX_SIZE
from tests.test_broker_core import payloads, raw, sub, take_all

SIZE = len(raw("t/a", b"x" * 100).record) + PREFIX_SIZE  # a message to t/a, t/b, t/c


def broker(overflow: Overflow, per_conn: int, **limits: int) -> Broker:
    return Broker(Limits(overflow=overflow, max_bytes_per_connection=per_conn, **limits))


def msg(topic: str, n: int) -> object:
    return raw(topic, b"%03d" % n + b"x" * 97)


def books(b: Broker) -> dict[object, int]:
    """Every pool's size, checked against what its connection's queues hold."""
    sizes: dict[object, int] = {}
    for conn, consumers in b.registry.by_conn.items():
        queues = [c.queue for c in consumers if isinstance(c.queue, Queue)]
        pool = b.registry.pools.get(conn)
        if not queues:
            assert pool is None
            continue
        assert pool is not None and pool.size == sum(q.size for q in queues)
        assert pool.queues == len(queues)
        sizes[conn] = pool.size
    assert set(b.registry.pools) == set(sizes)
    return sizes


def test_a_connection_blocks_publishers_once_its_queues_together_are_full() -> None:
    b = broker(Overflow.BLOCK, 5 * SIZE // 2)  # two messages and a half
    a, c = sub(b, 1, "t/a"), sub(b, 1, "t/c")
    other = sub(b, 2, "t/c")  # another connection: its own pool
    assert b.publish([msg("t/a", 1), msg("t/a", 2)], 0).blocked is None
    res = b.publish([msg("t/c", 3), msg("t/c", 4)], 0)
    # t/c's queue of connection 1 is empty, but the connection holds two messages already
    assert res.accepted == 0
    assert res.blocked == Blocked(c.queue.id, c.queue.name, (1,))
    assert books(b) == {1: 2 * SIZE, 2: 0}
    # connection 1 reads t/a: the publisher blocked on t/c may try again
    taken = b.deliver(1, 1, 1 << 20, 0, 0)
    assert c.queue.id in taken.released
    assert payloads(taken.batches[0][1]) == [b"001" + b"x" * 97]
    res = b.publish([msg("t/c", 3), msg("t/c", 4)], 0)
    assert res.accepted == 1 and res.blocked is not None
    assert books(b) == {1: 2 * SIZE, 2: SIZE}
    assert take_all(b, a) == [b"002" + b"x" * 97]
    assert take_all(b, c) == [b"003" + b"x" * 97]
    assert take_all(b, other) == [b"003" + b"x" * 97]
    assert books(b) == {1: 0, 2: 0}


def test_one_publish_to_many_subscriptions_of_one_connection_counts_each_copy() -> None:
    b = broker(Overflow.BLOCK, 10 * SIZE)
    subs = [sub(b, 1, "t/a") for _ in range(4)]
    accepted = 0
    for n in range(10):  # one at a time: the fast path of single publishes
        res = b.publish([msg("t/a", n)], 0)
        accepted += res.accepted
        if res.blocked is not None:
            break
    assert accepted == 2  # 4 copies each: a third would make 12 messages' worth
    assert books(b) == {1: 8 * SIZE}
    assert all(len(take_all(b, s)) == 2 for s in subs)


def test_an_empty_connection_takes_one_message_of_any_size() -> None:
    b = broker(Overflow.BLOCK, 1024)
    s = sub(b, 1, "t/a")
    big = raw("t/a", b"y" * 5000)
    assert b.publish([big], 0).accepted == 1
    res = b.publish([big], 0)
    assert res.accepted == 0 and res.blocked is not None
    assert take_all(b, s) == [b"y" * 5000]
    assert b.publish([big], 0).accepted == 1


def test_drop_oldest_drops_the_subscriptions_own_oldest_or_else_the_new_one() -> None:
    b = broker(Overflow.DROP_OLDEST, 5 * SIZE // 2)
    a, c = sub(b, 1, "t/a"), sub(b, 1, "t/c")
    res = b.publish([msg("t/a", n) for n in range(4)], 0)
    assert res.accepted == 4 and res.blocked is None
    assert books(b) == {1: 2 * SIZE}
    # t/c holds nothing: dropping its own would not make room, so the new one goes
    assert b.publish([msg("t/c", 9)], 0).accepted == 1
    assert b.counters.dropped_oldest == 2 and b.counters.dropped_new == 1
    assert take_all(b, c) == []
    assert take_all(b, a) == [b"002" + b"x" * 97, b"003" + b"x" * 97]
    assert b.publish([msg("t/c", 9)], 0).accepted == 1
    assert take_all(b, c) == [b"009" + b"x" * 97]
    assert books(b) == {1: 0}


def test_drop_new_keeps_what_the_connection_holds() -> None:
    b = broker(Overflow.DROP_NEW, 5 * SIZE // 2)
    a, c = sub(b, 1, "t/a"), sub(b, 1, "t/c")
    b.publish([msg("t/a", 1), msg("t/c", 2), msg("t/a", 3), msg("t/c", 4)], 0)
    assert take_all(b, a) == [b"001" + b"x" * 97]
    assert take_all(b, c) == [b"002" + b"x" * 97]
    assert b.counters.dropped_new == 2


def test_groups_count_for_each_member_and_leaving_gives_the_room_back() -> None:
    b = broker(Overflow.DROP_NEW, 100 * SIZE)
    m1 = sub(b, 1, "t/#", "g")
    own = sub(b, 1, "t/a")
    m2 = sub(b, 2, "t/#", "g")
    b.publish([msg("t/a", n) for n in range(3)], 0)
    assert books(b) == {1: 6 * SIZE, 2: 3 * SIZE}
    assert b.unsubscribe(1, own.sub_id).count == 1
    assert books(b) == {1: 3 * SIZE, 2: 3 * SIZE}
    b.disconnect(2)
    assert books(b) == {1: 3 * SIZE}
    assert len(take_all(b, m1)) == 3
    assert m2.queue is m1.queue
    b.publish([msg("t/a", 7)], 0)
    assert books(b) == {1: SIZE}
    assert b.unsubscribe(9, topic_filter="t/#", group="g").count == 1
    assert books(b) == {} and not b.registry.pools


def test_deleting_a_group_releases_publishers_its_members_held() -> None:
    b = broker(Overflow.BLOCK, 5 * SIZE // 2)
    sub(b, 1, "t/a")
    g = sub(b, 1, "t/c", "g")
    b.publish([msg("t/a", 1), msg("t/a", 2)], 0)
    res = b.publish([msg("t/c", 3)], 0)
    assert res.blocked is not None and res.blocked.queue == g.queue.id
    done = b.unsubscribe(5, topic_filter="t/c", group="g")
    assert g.queue.id in done.detached.released
    assert books(b) == {1: 2 * SIZE}


def test_expired_messages_give_their_room_back() -> None:
    b = broker(Overflow.BLOCK, 5 * SIZE // 2)
    a = sub(b, 1, "t/a")
    b.publish([raw("t/a", b"%03d" % 1 + b"x" * 97, ttl=10), msg("t/a", 2)], 0)
    assert b.tick(100) == 1
    assert books(b) == {1: SIZE}
    assert b.publish([msg("t/a", 3)], 0).accepted == 1
    assert [p[:3] for p in take_all(b, a)] == [b"002", b"003"]


def test_no_pools_when_the_limit_is_off() -> None:
    b = broker(Overflow.BLOCK, 0, capacity=3)
    subs: list[Consumer] = [sub(b, 1, f"t/{n}") for n in range(5)]
    for n in range(5):
        assert b.publish([msg(f"t/{n}", m) for m in range(3)], 0).accepted == 3
    assert not b.registry.pools
    assert all(len(take_all(b, s)) == 3 for s in subs)


def test_all_queues_together_hold_max_bytes_total() -> None:
    b = broker(Overflow.BLOCK, 100 * SIZE, max_bytes_total=3 * SIZE)
    a, c = sub(b, 1, "t/a"), sub(b, 2, "t/c")
    assert b.publish([msg("t/a", n) for n in range(3)], 0).accepted == 3
    res = b.publish([msg("t/a", 3)], 0)  # connection 1 holds some: no more
    assert res.accepted == 0 and res.blocked is not None
    res = b.publish([msg("t/c", 4), msg("t/c", 5)], 0)  # connection 2 holds none: one
    assert res.accepted == 1 and res.blocked == Blocked(c.queue.id, c.queue.name, (2,))
    assert b.registry.total.size == 4 * SIZE
    # connection 1 reading makes room for all: both publishers try again
    taken = b.deliver(1, 10, 1 << 20, 0, 0)
    assert {a.queue.id, c.queue.id} <= set(taken.released)
    assert b.registry.total.size == SIZE
    assert b.publish([msg("t/c", 5), msg("t/a", 6)], 0).accepted == 2
    assert books(b) == {1: SIZE, 2: 2 * SIZE}


def test_at_the_total_a_queue_nobody_reads_drops_its_oldest() -> None:
    b = broker(Overflow.BLOCK, 100 * SIZE, max_bytes_total=3 * SIZE)
    sub(b, 1, "t/a", "g")
    b.disconnect(1)  # the group stays, with nobody reading it
    assert b.publish([msg("t/a", n) for n in range(5)], 0).accepted == 5
    assert b.counters.dropped_no_consumer == 2
    assert b.registry.total.size == 3 * SIZE
    g = sub(b, 2, "t/a", "g")
    assert [p[:3] for p in take_all(b, g)] == [b"002", b"003", b"004"]
    assert b.registry.total.size == 0


def test_at_the_total_drop_oldest_makes_room_from_its_own() -> None:
    b = broker(Overflow.DROP_OLDEST, 100 * SIZE, max_bytes_total=3 * SIZE)
    a, c = sub(b, 1, "t/a"), sub(b, 2, "t/c")
    b.publish([msg("t/a", 0), msg("t/a", 1), msg("t/c", 2)], 0)
    b.publish([msg("t/a", 3), msg("t/c", 4)], 0)
    assert b.counters.dropped_oldest == 2
    assert [p[:3] for p in take_all(b, a)] == [b"001", b"003"]
    assert [p[:3] for p in take_all(b, c)] == [b"004"]
    assert b.registry.total.size == 0


def test_deleted_queues_leave_the_total() -> None:
    b = broker(Overflow.BLOCK, 100 * SIZE, max_bytes_total=100 * SIZE, max_idle_groups=0)
    sub(b, 1, "t/a")
    sub(b, 1, "t/#", "g")
    sub(b, 2, "t/#", "h")
    b.publish([msg("t/a", n) for n in range(2)], 0)
    assert b.registry.total.size == 6 * SIZE
    b.disconnect(1)  # its own queue goes, and group g with its last member
    assert b.registry.total.size == 2 * SIZE
    b.unsubscribe(2, topic_filter="t/#", group="h")
    assert b.registry.total.size == 0


def test_at_the_total_those_under_their_share_go_on_and_the_largest_waits() -> None:
    b = broker(Overflow.BLOCK, 100 * SIZE, max_bytes_total=6 * SIZE)
    a, c = sub(b, 1, "t/a"), sub(b, 2, "t/c")
    assert b.publish([msg("t/a", n) for n in range(5)] + [msg("t/c", 5)], 0).accepted == 6
    # all the queues hold the total: connection 1 is over its share (3 of 6), 2 is not
    res = b.publish([msg("t/a", 6)], 0)
    assert res.accepted == 0 and res.blocked is not None and res.blocked.queue == a.queue.id
    res = b.publish([msg("t/c", n) for n in range(7, 10)], 0)
    assert res.accepted == 2 and res.blocked is not None and res.blocked.queue == c.queue.id
    assert b.registry.total.size == 8 * SIZE  # at most the total and each share
    assert [p[:3] for p in take_all(b, c)] == [b"005", b"007", b"008"]
    assert len(take_all(b, a)) == 5 and books(b) == {1: 0, 2: 0}


def test_one_batch_to_several_topics_sharing_a_pool_stops_at_its_bound() -> None:
    b = broker(Overflow.BLOCK, 5 * SIZE)
    a, c = sub(b, 1, "t/a"), sub(b, 1, "t/c")
    batch = [msg("t/a" if n % 2 else "t/c", n) for n in range(10)]
    res = b.publish(batch, 0)
    assert res.accepted == 5 and res.blocked is not None
    assert books(b) == {1: 5 * SIZE} and b.registry.total.size == 5 * SIZE
    b.publish([msg("t/a", 1), msg("t/a", 1)], 0)  # runs of one route, charged at its end
    assert books(b) == {1: 5 * SIZE}
    assert len(take_all(b, a)) + len(take_all(b, c)) == 5
    res = b.publish([msg("t/a", 1), msg("t/a", 2), msg("t/c", 3)], 0)
    assert res.accepted == 3 and books(b) == {1: 3 * SIZE}
    assert b.registry.total.size == 3 * SIZE
