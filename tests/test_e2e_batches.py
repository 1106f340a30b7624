"""DELIVER frames stay within delivery.max_batch_bytes (one larger message goes alone), for
in-memory queues, durable groups and replays alike, against a real broker process."""

from __future__ import annotations

import hashlib

from blipmq_cli.client import Client
from blipmq_server.protocol.codec import Message, Start


def test_durable_group_backlog_of_large_messages_is_delivered_in_bounded_frames(
    start_broker,
) -> None:
    # 300 x 40 KiB was one DELIVER frame of 10.5 MB: the consumer dropped it, the group stuck
    b = start_broker()
    with Client(b.addr) as c:
        c.subscribe("big", group="g", qos=1).unsubscribe()  # the group exists, empty
        payloads = [bytes([i % 251]) * 40_960 for i in range(300)]
        c.publish_many(Message("big", p, qos=1) for p in payloads)
        c.wait_confirms()
    assert c.confirmed == 300
    got: list[bytes] = []
    with Client(b.addr) as c:
        sub = c.subscribe("big", group="g", qos=1)
        while len(got) < 300:
            batch = sub.next_batch(timeout=20)
            assert batch is not None
            assert sum(len(d.payload) for d in batch) <= 262_144  # delivery.max_batch_bytes
            got += [d.payload for d in batch]
            sub.ack(*batch)
    assert got == payloads
    assert b.metric("blipmq_group_in_flight", filter="big", group="g") == 0


def test_replay_of_two_max_size_messages(start_broker) -> None:
    # two 8 MiB messages replayed in one frame exceeded what the client accepts (QoS 0 too)
    b = start_broker()
    size = 8 * 1024 * 1024  # server.max_message_bytes
    payloads = [b"a" * size, b"b" * size]
    with Client(b.addr) as c:
        for p in payloads:
            c.publish("fw", p)
        c.flush()
    res = b.shell("blipmq sub fw --from earliest --count 2 --format raw | sha256sum")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0].decode() == hashlib.sha256(b"".join(payloads)).hexdigest()
    with Client(b.addr) as c:  # a QoS 1 cursor without a group, too
        sub = c.subscribe("fw", qos=1, start=Start.EARLIEST)
        got = []
        while len(got) < 2:
            batch = sub.next_batch(timeout=20)
            assert batch is not None and len(batch) == 1  # each goes alone
            got.append(batch[0].payload)
            sub.ack(*batch)
    assert got == payloads
