"""The Trio client (``AsyncClient``) against a real broker process: publish and subscribe,
QoS 1 confirms, acks and nacks in a durable group, request/reply, refusals, flow control
(credit and prefetch) and the slow-consumer cut, and TLS with the same addresses as the
sync client."""

from __future__ import annotations

import os
import signal

import pytest
import trio
import trio.testing
from pki import Pki, broker_tls, make_pki

import blipmq_cli
from blipmq_cli import (
    AsyncClient,
    BrokerError,
    Client,
    ConfigError,
    ConnectError,
    ErrorCode,
    Gap,
    Message,
    Reconnect,
    Start,
    TlsError,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_the_public_names_come_from_one_place() -> None:
    from blipmq_server.protocol import codec

    assert blipmq_cli.Start is codec.Start and blipmq_cli.Message is codec.Message
    for name in blipmq_cli.__all__:
        assert getattr(blipmq_cli, name) is not None
    # the same calls on both clients
    for name in ("publish", "publish_many", "flush", "subscribe", "unsubscribe", "stats",
                 "ping", "close", "max_message"):
        assert hasattr(Client, name) and hasattr(AsyncClient, name), name
    for name in ("next_batch", "ack", "ack_at_close", "nack", "set_credit", "credit",
                 "unsubscribe"):
        assert hasattr(blipmq_cli.Subscription, name), name
        assert hasattr(blipmq_cli.AsyncSubscription, name), name


async def test_publish_subscribe_and_async_for(start_broker) -> None:
    b = start_broker()
    async with AsyncClient(b.addr) as sub_client, AsyncClient(b.addr) as pub:
        sub = await sub_client.subscribe("data/#")
        sent = await pub.publish_many((f"data/{i % 3}", b"%d" % i) for i in range(3000))
        await pub.publish("data/x", b"last", ttl_ms=60000, key=b"k")
        await pub.flush()
        got = []
        with trio.fail_after(10):
            async for d in sub:
                got.append(d)
                if len(got) == sent + 1:
                    break
        assert [d.payload for d in got[:-1]] == [b"%d" % i for i in range(3000)]
        assert got[-1].key == b"k" and got[-1].ttl_ms == 60000 and got[-1].topic == "data/x"
        assert sub.last_offset == got[-1].offset
        await sub.unsubscribe()
        assert await sub.next_batch() is None
        assert await pub.ping() >= 0
        stats = await pub.stats()
        assert stats["connections"] >= 2


async def test_qos1_confirms_and_a_durable_group_with_acks_and_nacks(start_broker) -> None:
    b = start_broker()
    async with AsyncClient(b.addr) as c:
        sub = await c.subscribe("jobs", group="workers", qos=1, start=Start.EARLIEST)
        for i in range(5):
            await c.publish("jobs", b"job %d" % i, qos=1)  # returns once durable
        assert c.pending == (0, 0)
        batch = []
        with trio.fail_after(10):
            while len(batch) < 5:
                got = await sub.next_batch()
                assert got is not None
                batch.extend(got)
        await sub.nack(batch[0], reason="later")
        await sub.ack(*batch[1:])
        with trio.fail_after(10):
            again = await sub.next_batch()
        assert again is not None and again[0].payload == b"job 0"
        assert again[0].delivery_count == 2
        await sub.ack(*again)
        await c.flush()
    # the group's cursor is past all five: a new member gets nothing of them
    async with AsyncClient(b.addr) as c:
        stats = await c.stats()
        groups = {g["group"]: g for g in stats["groups"]}
        assert groups["workers"]["backlog"] == 0 and groups["workers"]["in_flight"] == 0


async def test_ack_at_close_takes_no_more_than_it_acks(start_broker) -> None:
    b = start_broker()
    async with AsyncClient(b.addr) as c:
        await c.publish_many(Message("q", b"%d" % i, qos=1) for i in range(20))
        await c.flush()
    async with AsyncClient(b.addr) as c:
        sub = await c.subscribe("q", group="one-at-a-time", qos=1, credit=1,
                                start=Start.EARLIEST)
        with trio.fail_after(10):
            (first,) = await sub.next_batch() or ()
        await sub.ack_at_close(first)
    async with AsyncClient(b.addr) as c:
        # one taken and acked, none again (a group's backlog is counted off the event loop
        # after it changes hands: read until the count is in)
        with trio.fail_after(10):
            while True:
                groups = {g["group"]: g for g in (await c.stats())["groups"]}
                if groups["one-at-a-time"]["backlog"] == 19:
                    break
                assert groups["one-at-a-time"]["backlog"] in (0, 19), groups
                await trio.sleep(0.02)
        sub = await c.subscribe("q", group="one-at-a-time", qos=1)
        with trio.fail_after(10):
            batch = await sub.next_batch()
        assert batch and batch[0].payload == b"1" and batch[0].delivery_count == 1


async def test_refusals_are_one_clear_error(start_broker) -> None:
    b = start_broker({"server": {"max_message_bytes": 100}, "wal": {"enabled": False}})
    async with AsyncClient(b.addr) as c:
        with pytest.raises(BrokerError) as info:
            await c.publish("t", b"x" * 101)  # checked against WELCOME before sending
        assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE
        with pytest.raises(BrokerError) as info:
            await c.publish("bad/+", b"x")
        assert info.value.code == ErrorCode.INVALID_TOPIC
        with pytest.raises(BrokerError) as info:
            await c.publish("ok", b"1", qos=1)  # no log: the broker refuses QoS 1
        assert info.value.code == ErrorCode.UNSUPPORTED
        await c.publish_many([Message("ok", b"2")])
        await c.flush()
        with pytest.raises(BrokerError) as info:
            await c.unsubscribe("t", group="missing")
        assert info.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(ConnectError, match=r"cannot connect to 127\.0\.0\.1:1"):
        async with AsyncClient("127.0.0.1:1"):
            pass


async def test_credit_bounds_what_a_qos1_consumer_holds(start_broker) -> None:
    b = start_broker()
    async with AsyncClient(b.addr) as c:
        sub = await c.subscribe("work", group="g", qos=1, credit=3)
        assert sub.credit == 3
        await c.publish_many(Message("work", b"%d" % i, qos=1) for i in range(10))
        await c.flush()
        held = []
        with trio.fail_after(10):
            while len(held) < 3:
                held.extend(await sub.next_batch() or ())
        await c.ping()  # any delivery the broker had sent is here now
        with pytest.raises(TimeoutError):
            await sub.next_batch(timeout=0.2)  # the window is full: nothing more comes
        assert len(held) == 3
        await sub.set_credit(10)
        assert sub.credit == 10
        await sub.ack(*held)
        with trio.fail_after(10):
            while len(held) < 10:
                held.extend(await sub.next_batch() or ())
        assert sorted(int(d.payload) for d in held) == list(range(10))


async def test_a_consumer_that_takes_nothing_is_cut_as_a_slow_consumer(start_broker) -> None:
    """The client reads at most ``prefetch`` deliveries ahead of the application; past that
    TCP pushes back, the broker's queue fills, and after queues.block_timeout_ms the broker
    closes the connection as a slow consumer (docs/OPERATIONS.md, "Slow consumers")."""
    b = start_broker({"queues": {"capacity": 50, "overflow": "block",
                                 "block_timeout_ms": 300}})
    lost: list[str] = []
    async with AsyncClient(b.addr, prefetch=20, reconnect=False,
                           on_disconnect=lambda e: lost.append(str(e))) as slow, \
            AsyncClient(b.addr) as pub:
        sub = await slow.subscribe("firehose")
        payload = b"x" * 2000
        with trio.fail_after(30):
            while "slow consumer" not in "\n".join(b.log):
                await pub.publish_many(("firehose", payload) for _ in range(500))
                await pub.flush()
        assert slow.prefetch == 20
        with trio.fail_after(10), pytest.raises(ConnectError):
            while True:  # what was read before the cut, then the error
                await sub.next_batch()
        assert not slow.connected


async def test_a_slow_consumer_cut_with_reconnects_on_comes_back_with_a_gap(
        start_broker) -> None:
    """A consumer that stalls is cut; once it reads again it takes what it had, notices
    the cut, reconnects and reports the gap; what is published after that reaches it."""
    b = start_broker({"queues": {"capacity": 50, "overflow": "block",
                                 "block_timeout_ms": 300}})
    gaps: list[Gap] = []
    back = trio.Event()
    async with AsyncClient(b.addr, prefetch=20, on_gap=gaps.append,
                           on_reconnect=lambda a: back.set(),
                           reconnect=Reconnect(initial=0.01, maximum=0.1)) as slow, \
            AsyncClient(b.addr) as pub:
        sub = await slow.subscribe("firehose")
        with trio.fail_after(30):
            while "slow consumer" not in "\n".join(b.log):  # the application is stuck
                await pub.publish_many(("firehose", b"x" * 2000) for _ in range(500))
                await pub.flush()
        seen: list[bytes] = []

        async def reads() -> None:  # the application goes on
            async for d in sub:
                seen.append(d.payload)
                if d.payload == b"after":
                    return

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reads)
                await back.wait()
                await pub.publish("firehose", b"after")
        assert gaps == sub.gaps and gaps[0].topic_filter == "firehose"
        assert slow.reconnects == 1 and len(seen) > 1


async def test_async_client_over_tls(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki))
    tls = f"tls://127.0.0.1:{b.tls_port}"
    async with AsyncClient(tls, ssl_context=pki.client_context()) as c:
        sub = await c.subscribe("secure/#")
        big = bytes(range(256)) * 800  # crosses TLS records
        await c.publish("secure/a", big, qos=1)
        await c.publish_many(("secure/b", b"%d" % i) for i in range(2000))
        got = []
        with trio.fail_after(10):
            async for d in sub:
                got.append(d)
                if len(got) == 2001:
                    break
        assert got[0].payload == big and got[-1].payload == b"1999"
        assert c.addr == f"tls://127.0.0.1:{b.tls_port}"
    with pytest.raises(TlsError, match="not trusted"):
        async with AsyncClient(tls, ssl_context=pki.client_context(pki.other_ca)):
            pass
    with pytest.raises(ConnectError, match="tls://"):
        async with AsyncClient(f"127.0.0.1:{b.tls_port}", timeout=3):
            pass


def fast() -> Reconnect:
    return Reconnect(attempts=200, initial=0.02, maximum=0.2)


async def test_connect_under_a_cancel_scope_connects_or_times_out_cleanly(
        start_broker) -> None:
    """``connect(nursery)``: a surrounding fail_after bounds the connect alone; the client's
    task runs in the nursery given, so the scope may end while the client goes on."""
    b = start_broker()
    async with trio.open_nursery() as nursery:
        client = AsyncClient(b.addr)
        with trio.fail_after(5):
            await client.connect(nursery)
        assert client.connected and await client.ping() < 5
        await client.publish("scoped", b"x", qos=1)
        await client.close()
        assert not client.connected
    # a listener that never answers the handshake: the scope runs out first, cleanly
    with trio.socket.socket() as quiet:
        await quiet.bind(("127.0.0.1", 0))
        quiet.listen(8)
        where = f"127.0.0.1:{quiet.getsockname()[1]}"
        async with trio.open_nursery() as nursery:
            client = AsyncClient(where, timeout=30)
            with pytest.raises(trio.TooSlowError), trio.fail_after(0.3):
                await client.connect(nursery)
            with trio.move_on_after(0.3) as scope:
                await client.connect(nursery)
            assert scope.cancelled_caught and not client.connected
            await client.close()
        # ``async with`` inside a scope that runs out: the same
        with trio.move_on_after(0.3) as scope:
            async with AsyncClient(where, timeout=30):
                raise AssertionError("connected to a listener that never answers")
        assert scope.cancelled_caught


async def test_a_client_whose_nursery_is_cancelled_says_so(start_broker) -> None:
    b = start_broker()
    client = AsyncClient(b.addr)
    async with trio.open_nursery() as nursery:
        await client.connect(nursery)
        nursery.cancel_scope.cancel()
    with pytest.raises(ConnectError, match="stopped: the nursery it ran in was cancelled"):
        await client.ping()
    await client.close()


async def test_a_closed_client_does_not_connect_again(start_broker) -> None:
    b = start_broker()
    client = AsyncClient(b.addr)
    async with client:
        assert await client.ping() < 5
    with pytest.raises(ConnectError, match="was closed: make a new AsyncClient"):
        async with client:
            pass
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConnectError, match="was closed: make a new AsyncClient"):
            await client.connect(nursery)
    assert not client.connected
    await client.close()  # a second close does nothing
    with pytest.raises(ConnectError, match="is not connected: use async with"):
        await AsyncClient(b.addr).ping()


async def test_close_says_when_it_drops_held_messages(start_broker) -> None:
    """Messages held while the broker is down are lost if close() cannot hand them over
    within ``timeout``: close() raises ConnectError saying how many, not returns."""
    b = start_broker()
    down = trio.Event()
    with pytest.raises(ConnectError, match=r"closed with 5 messages \(\d+ bytes\) that "
                                           r"the broker at .* has not taken, now dropped"):
        async with AsyncClient(b.addr, timeout=0.5, reconnect=fast(),
                               on_disconnect=lambda e: down.set()) as c:
            await c.publish("held", b"before", qos=1)
            b.proc.kill()
            b.proc.wait()
            with trio.fail_after(10):
                await down.wait()
            for i in range(5):
                await c.publish("held", b"held-%d" % i)
            assert c.pending[0] == 5
    assert not c.connected
    # nothing held: a close while the broker is down is quiet
    b = start_broker()
    down = trio.Event()
    async with AsyncClient(b.addr, timeout=0.5, reconnect=fast(),
                           on_disconnect=lambda e: down.set()) as c:
        b.proc.kill()
        b.proc.wait()
        with trio.fail_after(10):
            await down.wait()


async def test_publish_many_keeps_to_max_pending(start_broker) -> None:
    from test_client_reconnect import free_port, read_log, restart

    port = free_port()
    b = start_broker({"server": {"port": port}})
    down, up = trio.Event(), trio.Event()
    most = 0

    async with AsyncClient(b.addr, max_pending=10, max_pending_bytes=1000, block=False,
                           reconnect=fast(), on_disconnect=lambda e: down.set(),
                           on_reconnect=lambda a: up.set()) as c:

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, c.pending[0])
                await trio.lowlevel.checkpoint()

        # connected: QoS 1 messages are pending until confirmed, and only 10 may be
        with pytest.raises(ConnectError, match=r"max_pending reached \(publish_many queued "
                                               r"10 of its messages before this one\)"):
            await c.publish_many(Message("pm", b"c%d" % i, qos=1) for i in range(500))
        await c.flush()
        # block=True: it waits for room instead, and all go out
        c.block = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            with trio.fail_after(20):
                assert await c.publish_many(
                    Message("pm", b"w%d" % i, qos=1) for i in range(300)) == 300
                await c.flush()
            nursery.cancel_scope.cancel()
        assert most <= 10
        c.block = False
        b.proc.kill()
        b.proc.wait()
        with trio.fail_after(10):
            await down.wait()
        # disconnected: a batch far past the bound takes 10 and says so (and holds no more)
        with pytest.raises(ConnectError, match="publish_many queued 10 of its"):
            await c.publish_many(Message("pm", b"d%d" % i, qos=1) for i in range(100_000))
        assert c.pending[0] == 10
        with pytest.raises(ConnectError, match="max_pending reached"):
            await c.publish("pm", b"one more")
        b = await restart(start_broker, b, port)
        with trio.fail_after(20):
            await up.wait()
            await c.flush()
        # bytes: 200-byte payloads, 1000 bytes held at most
        b.proc.kill()
        b.proc.wait()
        down = trio.Event()
        with trio.fail_after(10):
            await down.wait()
        with pytest.raises(ConnectError, match="publish_many queued 4 of its"):
            await c.publish_many(("pm/big", b"b" * 200) for _ in range(10))
        assert c.pending[0] == 4 and c.pending[1] <= 1000
        b = await restart(start_broker, b, port)
        with trio.fail_after(20):
            await c.flush()
    logged = await read_log(b.addr, "pm")
    assert logged == ([b"c%d" % i for i in range(10)] + [b"w%d" % i for i in range(300)]
                      + [b"d%d" % i for i in range(10)])


async def test_bad_arguments_are_one_config_error(start_broker) -> None:
    b = start_broker()
    async with AsyncClient(b.addr) as c:
        sub = await c.subscribe("args", group="g", qos=1)
        bad = [
            (c.publish("args", "text"), "payload: must be bytes, not str"),
            (c.publish("args", b"x", qos="1"), "qos: must be 0 or 1, not '1'"),
            (c.publish("args", b"x", key="k"), "key: must be bytes, not str"),
            (c.publish_many([("args", "text")]), "payload: must be bytes"),
            (c.publish_many([Message("args", b"x", qos=5)]), "qos: must be 0 or 1, not 5"),
            (c.subscribe("args", qos=5), "qos: must be 0 or 1, not 5"),
            (c.subscribe("args", qos=1, credit=-1), "credit: must be a whole number"),
            (sub.set_credit(-1), "credit: must be a whole number"),
            (sub.nack(delay_ms=-1), "delay_ms: must be a whole number"),
        ]
        for call, text in bad:
            with pytest.raises(ConfigError) as info:
                await call
            assert text in str(info.value), text
        await c.flush()
        assert sub.credit == 0 and c.pending == (0, 0)
    with pytest.raises(ConfigError, match="timeout: must be a positive number"):
        AsyncClient(b.addr, timeout=0)
    with pytest.raises(ConfigError, match="holds a comma"):
        AsyncClient("127.0.0.1:1,127.0.0.1:2")


def test_under_asyncio_it_says_it_runs_under_trio() -> None:
    import asyncio

    async def main() -> None:
        async with AsyncClient("127.0.0.1:1"):
            pass

    with pytest.raises(ConfigError, match="AsyncClient runs under Trio"):
        asyncio.run(main())


async def test_a_subscribe_given_up_leaves_no_subscription_behind(start_broker) -> None:
    """A subscribe() cancelled after its SUBSCRIBE went out: the broker makes the
    subscription all the same, and the client ends it when the reply comes. Its deliveries
    do not pile up against ``prefetch`` (which stopped the client reading its socket: every
    PING and QoS 1 publish after it timed out), and the broker holds nothing for it."""
    from faultproxy import FaultProxy

    b = start_broker()
    proxy = FaultProxy(("127.0.0.1", b.port))
    await trio.to_thread.run_sync(proxy.start)  # its API blocks: it runs its own thread
    try:
        async with AsyncClient(f"127.0.0.1:{proxy.port}", prefetch=100, timeout=5) as c, \
                AsyncClient(b.addr) as pub:
            base = (await pub.stats())["subscriptions"]
            # the SUBSCRIBE and its reply take 0.2 s each way
            await trio.to_thread.run_sync(proxy.delay, 200)
            with trio.move_on_after(0.05) as scope:
                await c.subscribe("given-up/t")
            assert scope.cancelled_caught
            with trio.fail_after(10):
                for want in (base + 1, base):  # the broker makes it, then ends it
                    while (await pub.stats())["subscriptions"] != want:
                        await trio.sleep(0.02)
            await trio.to_thread.run_sync(proxy.delay, 0)
            await pub.publish_many(("given-up/t", b"x" * 10) for _ in range(2000))
            await pub.flush()
            assert await c.ping(timeout=3) < 3
            await c.publish("other/t", b"y", qos=1)
            assert (await pub.stats())["subscriptions"] == base
    finally:
        await trio.to_thread.run_sync(proxy.close)


async def test_close_inside_async_with_from_a_cancel_scope_or_another_task(
        start_broker) -> None:
    """``close()`` may be called inside ``async with`` from a cancel scope or another task
    (a signal handler's, say): the nursery ``async with`` opened is left by ``__aexit__``
    only, so Trio's cancel scopes stay nested as it requires."""
    b = start_broker()
    async with AsyncClient(b.addr) as c:
        await c.publish("close/t", b"x", qos=1)
        with trio.move_on_after(5):
            await c.close()
        assert not c.connected
    async with AsyncClient(b.addr) as c:
        sub = await c.subscribe("close/t")

        async def stopper() -> None:
            await c.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stopper)
            with trio.fail_after(10):
                assert [d async for d in sub] == []  # ends when the client closes


async def test_prefetch_bytes_bounds_what_a_subscriber_that_takes_nothing_holds(
        start_broker) -> None:
    """The reader stops once ``prefetch_bytes`` of payloads wait to be taken (plus the
    frame that crossed it), not only at ``prefetch`` messages; the rest wait in the
    socket and come, in order, once the application takes deliveries."""
    b = start_broker({"wal": {"enabled": False}})
    bound, size, n = 256 << 10, 64 << 10, 200  # 12.5 MiB sent to a 256 KiB prefetch
    async with AsyncClient(b.addr, prefetch_bytes=bound) as c, AsyncClient(b.addr) as pub:
        sub = await c.subscribe("cam/#")
        b.wait_subscribers(1)
        await pub.publish_many(("cam/1", bytes([i]) * size) for i in range(n))
        await pub.flush()
        with trio.fail_after(10):
            while c.buffered[1] < bound:  # the reader reads up to the bound...
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked(0.05)  # ...and then waits
        assert c.buffered[1] <= bound + c._conn.max_frame
        got: list[bytes] = []
        with trio.fail_after(10):
            while len(got) < n:
                got += [d.payload for d in await sub.next_batch() or ()]
        assert got == [bytes([i]) * size for i in range(n)]


async def test_more_bad_arguments_are_config_errors(start_broker) -> None:
    """As the sync client's: the reconnect policy, connection arguments, subscription
    names and start, acks and a call's own timeout are checked up front."""
    b = start_broker()
    for make, text in [
        (lambda: AsyncClient(b.addr, reconnect=5), "reconnect: must be True, False or a"),
        (lambda: AsyncClient(b.addr, reconnect="yes"), "reconnect: must be True, False or a"),
        (lambda: AsyncClient(12345), "addr: must be a str or a list of them"),
        (lambda: AsyncClient(b.addr, None), "api_key: must be a str"),
        (lambda: AsyncClient(b.addr, "\udc80"), "api_key: must be valid UTF-8"),
        (lambda: AsyncClient(b.addr, name="n" * 70000), "name: must be at most 65535 bytes"),
        (lambda: AsyncClient(b.addr, ssl_context="ctx"), "ssl_context: must be an ssl."),
        (lambda: AsyncClient(b.addr, prefetch_bytes=0), "prefetch_bytes: must be a whole"),
    ]:
        with pytest.raises(ConfigError) as info:
            make()
        assert text in str(info.value), text
    async with AsyncClient(b.addr, timeout=5) as c:
        sub = await c.subscribe("args", group="g", qos=1)
        for call, text in [
            (c.subscribe("a", group="g" * 70000, qos=1), "group: must be at most"),
            (c.subscribe("a", start="EARLIEST"), "start: must be a Start"),
            (sub.ack(5), "deliveries: give the Delivery objects"),
            (sub.nack(None), "deliveries: give the Delivery objects"),
            (c.unsubscribe(None), "topic_filter: must be a str"),
            (sub.next_batch(timeout="1"), "timeout: must be None or a number"),
            (sub.next_batch(timeout=-1), "timeout: must be None or a number"),
            (c.flush(timeout=-1), "timeout: must be None or a number"),
            (c.ping(timeout="5"), "timeout: must be None or a number"),
        ]:
            with pytest.raises(ConfigError) as info:
                await call
            assert text in str(info.value), text
        assert (await c.stats())["connections"] == 1


async def test_a_missing_client_certificate_is_a_tls_error(start_broker, pki: Pki) -> None:
    """A broker that requires a client certificate refuses one missing only after the TLS
    1.3 handshake: AsyncClient says so as a TlsError, as the sync client does."""
    b = start_broker(broker_tls(pki, tls={"ca_file": str(pki.ca), "require_client_cert": True}))
    tls = f"tls://127.0.0.1:{b.tls_port}"
    with pytest.raises(TlsError, match="client certificate"):
        async with AsyncClient(tls, ssl_context=pki.client_context(), timeout=5):
            pass
    with pytest.raises(TlsError, match="client certificate"):
        Client(tls, ssl_context=pki.client_context(), timeout=5)
    async with AsyncClient(tls, ssl_context=pki.client_context(cert=True), timeout=5) as c:
        assert await c.ping() >= 0


async def test_a_publish_after_close_began_is_refused_up_front(start_broker) -> None:
    """Once close() began (its flush waits on a stalled broker here), a publish raises
    ConnectError at once instead of going out behind the flush, where close() would count
    it as dropped though the broker stored it; close() then ends quietly."""
    b = start_broker()
    async with AsyncClient(b.addr, timeout=20) as c:
        await c.publish("closing/t", b"before", qos=1)
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(c.close)
                await trio.testing.wait_all_tasks_blocked()  # its flush waits for a PONG
                for publish in (c.publish("closing/t", b"late"),
                                c.publish("closing/t", b"late", qos=1),
                                c.publish_many([("closing/t", b"late")])):
                    with pytest.raises(ConnectError, match="is closing: publish before close"):
                        await publish
                os.kill(b.proc.pid, signal.SIGCONT)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
    with Client(b.addr) as r:
        logged = [d.payload for d in r.subscribe("closing/t", start=Start.EARLIEST,
                                                 until_end=True)]
    assert logged == [b"before"]
