"""The sync client library against a real broker process."""

from __future__ import annotations

import pytest

from blipmq_cli.client import Client, parse_addr
from blipmq_server.errors import BrokerError, ConnectError
from blipmq_server.protocol.codec import ErrorCode, Message


def test_publish_many_and_iterate(start_broker) -> None:
    b = start_broker()
    with Client(b.addr) as sub_client, Client(b.addr) as pub:
        sub = sub_client.subscribe("data/#")
        b.wait_subscribers(1)
        sent = pub.publish_many((f"data/{i % 3}", b"%d" % i) for i in range(1000))
        pub.publish("data/x", b"last", ttl_ms=60000, key=b"k")
        pub.flush()
        got = []
        for d in sub:
            got.append(d)
            if len(got) == sent + 1:
                break
        assert [d.payload for d in got[:-1]] == [b"%d" % i for i in range(1000)]
        assert got[-1].key == b"k" and got[-1].ttl_ms == 60000 and got[-1].topic == "data/x"
        assert [d.offset for d in got] == sorted(d.offset for d in got)
        sub.ack(*got[:3])  # QoS 0: accepted and ignored
        sub.unsubscribe()
        b.wait_subscribers(0)


def test_refusals_surface_at_flush_and_keep_the_connection(start_broker) -> None:
    b = start_broker({"server": {"max_message_bytes": 100}, "wal": {"enabled": False}})
    with Client(b.addr) as c:
        with pytest.raises(BrokerError) as info:
            c.publish("t", b"x" * 101)  # checked against WELCOME before sending
        assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE
        with pytest.raises(BrokerError) as info:
            c.publish("bad/+", b"x")  # checked locally, before sending
        assert info.value.code == ErrorCode.INVALID_TOPIC
        c.publish_many([Message("ok", b"1"), Message("ok", b"2", qos=1)])
        with pytest.raises(BrokerError) as info:
            c.flush()
        assert info.value.code == ErrorCode.UNSUPPORTED
        assert c.ping() >= 0  # still connected
    assert b.metric("blipmq_messages_published_total") == 1


def test_timeout_and_connect_errors(start_broker) -> None:
    b = start_broker()
    with Client(b.addr) as c:
        sub = c.subscribe("quiet")
        with pytest.raises(TimeoutError):
            sub.next_batch(0.2)
    with pytest.raises(ConnectError):
        Client("127.0.0.1:1")
    with pytest.raises(BrokerError) as info:
        Client(b.addr).unsubscribe("t", group="missing")
    assert info.value.code == ErrorCode.NOT_FOUND


@pytest.mark.parametrize(("addr", "expected"), [
    ("127.0.0.1:7878", ("127.0.0.1", 7878)), ("[::1]:9", ("::1", 9)), ("h:65535", ("h", 65535)),
])
def test_parse_addr(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", ["nohost", ":80", "h:0", "h:99999", "h:x"])
def test_parse_addr_refuses(addr: str) -> None:
    with pytest.raises(ValueError):
        parse_addr(addr)
