"""What one connection's subscriptions start with is bounded: `retained.max_per_connection`.

Every subscription made at the latest position starts with the retained value of each
topic it matches, each waiting in the broker's memory until sent (a reference to the
stored value and its bookkeeping, 100-200 bytes). A connection may hold
`server.max_subscriptions` subscriptions, so one making thousands of them, each matching
thousands of retained topics, held the broker to that product. Real broker; the native
client, the CLI and paho."""

from __future__ import annotations

import pytest
from mqttpeer import Paho

from blipmq_cli import BrokerError, Client
from blipmq_server.protocol.codec import ErrorCode

LIMITED = {"retained": {"max_per_connection": 50}, "mqtt": {"enabled": True, "port": 0}}


def _retain(b, n: int) -> None:
    with Client(b.addr) as c:
        for i in range(n):
            c.publish(f"r/{i}", b"v%d" % i, qos=1, retain=True)
        c.flush()


def test_a_connection_starts_its_subscriptions_with_at_most_its_share(start_broker) -> None:
    b = start_broker(LIMITED)
    _retain(b, 20)
    with Client(b.addr) as c:
        first = c.subscribe("r/#", qos=1)
        c.subscribe("+/#")
        with pytest.raises(BrokerError) as refused:  # 20 + 20 + 20 > 50
            c.subscribe("#", qos=1)
        assert refused.value.code == ErrorCode.LIMIT
        assert "retained.max_per_connection is 50" in str(refused.value)
        c.subscribe("s/#")  # matches no retained topic: nothing to wait
        other = Client(b.addr)  # another connection has its own
        other.subscribe("#")
        other.close()
        first.unsubscribe()  # what it started with no longer counts
        got = c.subscribe("#", qos=1)
        values = []
        while len(values) < 20:
            batch = got.next_batch(timeout=10)
            assert batch
            got.ack(*batch)
            values += batch
        assert sorted(d.payload for d in values) == sorted(b"v%d" % i for i in range(20))
    res = b.cli("sub", "r/#", "+/#", "#", "--count", "1", "--timeout", "5")
    assert res.returncode == 9, res
    err = res.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "retained.max_per_connection" in err[0], err
    assert b.metric("blipmq_limit_refusals_total", limit="retained.max_per_connection") == 2


def test_an_mqtt_subscribe_past_it_gets_0x80_for_that_filter_only(start_broker) -> None:
    b = start_broker(LIMITED)
    _retain(b, 20)
    sub = Paho(b.mqtt_port, "many-filters")
    try:
        assert sub.subscribe(("r/#", 1), ("+/#", 0), ("#", 1), ("s/#", 1)) == [1, 0, 0x80, 1]
        got = {m.payload for m in sub.take(20)}  # the granted filters' retained values
        assert got == {b"v%d" % i for i in range(20)}
    finally:
        sub.disconnect()


def test_all_connections_together_start_with_at_most_max_all_connections(start_broker) -> None:
    # the cap per connection multiplied by server.max_connections: 1,024 x 100,000 values
    b = start_broker({"retained": {"max_all_connections": 50}})
    _retain(b, 20)
    clients = [Client(b.addr) for _ in range(3)]
    try:
        first = clients[0].subscribe("r/#")
        clients[1].subscribe("r/#", qos=1)
        with pytest.raises(BrokerError) as refused:  # 20 + 20 + 20 > 50, each under its own
            clients[2].subscribe("r/#")
        assert refused.value.code == ErrorCode.LIMIT
        assert "retained.max_all_connections is 50" in str(refused.value)
        clients[2].subscribe("s/#")  # nothing to start with: granted
        first.unsubscribe()  # what it started with no longer counts
        got = clients[2].subscribe("r/#")
        values = []
        while len(values) < 20:
            batch = got.next_batch(timeout=10)
            assert batch
            values += batch
        assert sorted(d.payload for d in values) == sorted(b"v%d" % i for i in range(20))
    finally:
        for c in clients:
            c.close()
    assert b.metric("blipmq_limit_refusals_total", limit="retained.max_all_connections") == 1
