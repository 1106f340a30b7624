"""The bytes a QoS 1 consumer holds unacked are bounded by `delivery.max_inflight_bytes`,
whatever window (credit) it asked for: the broker keeps each of them in memory until its
ack. Real broker, real client."""

from __future__ import annotations

from blipmq_cli import Client, Start, Subscription

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
