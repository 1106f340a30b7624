"""The bytes a QoS 1 consumer holds unacked are bounded by `delivery.max_inflight_bytes`,
whatever window (credit) it asked for: the broker keeps each of them in memory until its
ack. Real broker, real client."""

from __future__ import annotations

import time

from blipmq_cli import Client, Start, Subscription
from blipmq_server.mqtt.codec import Publish, SubAck, Subscribe
from tests.mqttpeer import Raw

_SIZE = 128 * 1024


def _publish(b, count: int, size: int) -> None:
    """``count`` QoS 1 messages of ``size`` bytes on big/t, each starting with its number."""
    with Client(b.addr) as c:
        for i in range(count):
            c.publish("big/t", b"%02d" % i + b"x" * (size - 2), qos=1)
        c.flush()


def _until_quiet(sub: Subscription) -> list:
    """What the subscription gets until a second passes with nothing more."""
    held: list = []
    while True:
        try:
            held += sub.next_batch(timeout=1.0) or ()
        except TimeoutError:
            return held


def test_a_consumer_that_never_acks_holds_at_most_max_inflight_bytes(start_broker) -> None:
    """40 messages of 128 KiB, a window of 1,000, `max_inflight_bytes` 1 MiB: 8 come, then
    nothing until acks make room (was: all 40, and a backlog's worth of memory for a
    consumer that reads everything and acks nothing)."""
    b = start_broker({"delivery": {"max_inflight_bytes": 1024 * 1024}})
    _publish(b, 40, _SIZE)
    with Client(b.addr) as c:
        sub = c.subscribe("big/#", group="g", qos=1, credit=1000, start=Start.EARLIEST)
        held = _until_quiet(sub)
        assert [d.payload[:2] for d in held] == [b"%02d" % i for i in range(8)]
        got = list(held)
        while len(got) < 40:  # acks make room: the rest come, in order
            sub.ack(*held)
            held = list(sub.next_batch(timeout=10) or ())
            assert held, f"{len(got)} of 40"
            assert sum(len(d.payload) for d in held) <= 1024 * 1024 + _SIZE
            got += held
        assert [d.payload[:2] for d in got] == [b"%02d" % i for i in range(40)]


def test_by_default_a_consumer_holds_16_mib_unacked_whatever_its_window(start_broker) -> None:
    """The default limit, with a window of 100,000 and 24 MiB of messages that it reads and
    never acks: about 16 MiB of them come (was: all 24 MiB, each held in memory)."""
    b = start_broker()
    _publish(b, 96, 256 * 1024)
    with Client(b.addr) as c:
        sub = c.subscribe("big/#", group="g", qos=1, credit=100_000, start=Start.EARLIEST)
        held = _until_quiet(sub)
        assert 16 * 4 - 1 <= len(held) <= 16 * 4 + 1, len(held)


def _until_all_quiet(subs: list[Subscription]) -> list[list]:
    """What each subscription gets until a second passes with nothing more for any."""
    held: list[list] = [[] for _ in subs]
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 1.0:
        for i, sub in enumerate(subs):
            try:
                got = sub.next_batch(timeout=0.05) or ()
            except TimeoutError:
                continue
            if got:
                held[i] += got
                quiet_since = time.monotonic()
    return held


def test_the_consumers_of_one_connection_hold_max_inflight_bytes_together(start_broker) -> None:
    """One connection, five groups reading the same 40 messages of 128 KiB from the start,
    never acking: about 1 MiB comes to all five together (was: 1 MiB to each, so a client
    with `server.max_subscriptions` of them could bring the log into memory thousands of
    times over). Acking then lets every group through to the end, in order."""
    # no redelivery while the test runs (a slow machine): each message comes once
    b = start_broker({"delivery": {"max_inflight_bytes": 1024 * 1024,
                                   "retry_backoff_ms": 600_000}})
    _publish(b, 40, _SIZE)
    with Client(b.addr) as c:
        subs = [c.subscribe("big/#", group=f"g{i}", qos=1, credit=1000, start=Start.EARLIEST)
                for i in range(5)]
        held = _until_all_quiet(subs)
        size = sum(len(d.payload) for got in held for d in got)
        assert 7 * _SIZE <= size <= 1024 * 1024 + _SIZE, [len(got) for got in held]
        got: list[list] = [list(h) for h in held]
        deadline = time.monotonic() + 60
        while any(len(g) < 40 for g in got):
            assert time.monotonic() < deadline, [len(g) for g in got]
            for sub, h in zip(subs, held, strict=True):
                if h:
                    sub.ack(*h)
            held = _until_all_quiet(subs)
            for g, h in zip(got, held, strict=True):
                g += h
        for g in got:
            assert [d.payload[:2] for d in g] == [b"%02d" % i for i in range(40)]


def test_all_connections_together_hold_max_inflight_bytes_total(start_broker) -> None:
    """Connections reading 40 messages of 128 KiB each from the start, never acking, with
    1 MiB for each and 2 MiB for all: three take the 2 MiB (was: 1 MiB each, so as many
    connections as `server.max_connections` allows multiplied the memory). Three more that
    come then hold none, so each still gets one, and no more. Once the first three leave,
    those waiting are woken and take the room back."""
    # no redelivery while the test runs: held deliveries coming due free room by themselves
    b = start_broker({"delivery": {"max_inflight_bytes": 1024 * 1024,
                                   "max_inflight_bytes_total": 2 * 1024 * 1024,
                                   "retry_backoff_ms": 600_000}})
    _publish(b, 40, _SIZE)
    clients = [Client(b.addr) for _ in range(6)]
    try:
        subs = [cl.subscribe("big/#", group=f"g{i}", qos=1, credit=1000, start=Start.EARLIEST)
                for i, cl in enumerate(clients[:3])]
        first = _until_all_quiet(subs)
        size = sum(len(d.payload) for got in first for d in got)
        # the total, overshot by at most one record per connection (each batch's first)
        assert 2 * 1024 * 1024 <= size <= 2 * 1024 * 1024 + 3 * _SIZE, [len(g) for g in first]
        late = [cl.subscribe("big/#", group=f"g{i}", qos=1, credit=1000, start=Start.EARLIEST)
                for i, cl in enumerate(clients[3:], 3)]
        assert [len(g) for g in _until_all_quiet(late)] == [1, 1, 1]  # one each, no more
        for sub in subs:  # what they held goes back to their groups: room for the others
            sub.unsubscribe()
        more = _until_all_quiet(late)  # woken on the broker's next tick
        assert all(more) and sum(len(d.payload) for g in more for d in g) >= 8 * _SIZE, [
            len(g) for g in more]
    finally:
        for cl in clients:
            cl.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_groups_left_with_their_window_full_do_not_keep_it_in_memory(start_broker) -> None:
    """Eight groups, one after the other: each reads 16 MiB of a 24 MiB backlog, acks
    nothing, and its client leaves. What a group's consumers had not acked waited in memory
    for its next consumer, 16 MiB a group (was: the broker grew by about 128 MiB); now the
    groups without a consumer keep 16 MiB of it in all, the rest by offset. A consumer
    coming back gets every message once acked, in order."""
    b = start_broker()
    _publish(b, 96, 256 * 1024)
    before = _rss_mib(b.proc.pid)
    for i in range(8):
        with Client(b.addr) as c:
            sub = c.subscribe("big/#", group=f"g{i}", qos=1, credit=100_000,
                              start=Start.EARLIEST)
            assert len(_until_quiet(sub)) >= 60
    grown = _rss_mib(b.proc.pid) - before
    assert grown < 70, f"the broker grew by {grown:.0f} MiB"
    for i in (0, 7):  # the first kept its deliveries in memory, the last by offset
        with Client(b.addr) as c:
            sub = c.subscribe("big/#", group=f"g{i}", qos=1, credit=100_000)
            got: list = []
            while len(got) < 96:
                batch = sub.next_batch(timeout=10)
                assert batch, f"g{i}: {len(got)} of 96"
                sub.ack(*batch)
                got += batch
            assert [d.payload[:2] for d in got] == [b"%02d" % n for n in range(96)]


def test_mqtt_subscribers_waiting_for_room_get_it_within_a_tick(start_broker) -> None:
    """MQTT QoS 1 subscribers that never PUBACK hold `max_inflight_bytes_total` (1 MiB): the
    first takes about 1 MiB, the second one message or two, then waits for room. When the
    first goes, the second gets its next message within about a redelivery tick (0.1 s),
    four times (was: up to a second: an MQTT subscriber's deliveries never come due, so
    with only those in flight the redelivery ticker dozed, and it is its tick that wakes
    connections waiting for room)."""
    b = start_broker({"mqtt": {"enabled": True, "port": 0},
                      "delivery": {"max_inflight_bytes": 1024 * 1024,
                                   "max_inflight_bytes_total": 1024 * 1024}})
    waits = []
    for round_ in range(4):
        topic = f"room/{round_}"
        holder, waiter = Raw(b.mqtt_port), Raw(b.mqtt_port)
        try:
            for i, raw in enumerate((holder, waiter)):
                raw.connect(f"room-{round_}-{i}")
                raw.send(Subscribe(1, ((topic, 1),)))
                assert raw.expect(SubAck) == SubAck(1, (1,))
                _publish_to(b, topic, 8)  # 2 MiB in all: room for about half
            assert _until_quiet_raw(holder) >= 6
            assert _until_quiet_raw(waiter) >= 1  # and nothing more: it waits for room
            holder.close()  # what it held goes back to its subscription, ended with it
            gone = time.monotonic()
            assert isinstance(waiter.recv(), Publish)
            waits.append(time.monotonic() - gone)
        finally:
            holder.close()
            waiter.close()
    assert max(waits) < 0.25, [f"{w:.3f}" for w in waits]


def _until_quiet_raw(raw: Raw) -> int:
    """How many PUBLISHes come until 0.3 s pass with none."""
    n = 0
    while True:
        try:
            packet = raw.recv(timeout=0.3)
        except AssertionError:
            return n
        assert isinstance(packet, Publish), packet
        n += 1


def _publish_to(b, topic: str, count: int) -> None:
    with Client(b.addr) as c:
        for i in range(count):
            c.publish(topic, b"%02d" % i + b"x" * (_SIZE - 2), qos=1)
        c.flush()
