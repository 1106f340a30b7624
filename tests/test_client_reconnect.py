"""``AsyncClient`` reconnects against a real broker killed with SIGKILL and restarted on the
same port and data directory: no confirmed message lost (each one a QoS 1 ``publish()``
returned for is read back from the log), subscriptions restored (a durable group at its
cursor, a live one with a ``Gap``), several addresses, the bounded buffer while
disconnected, and giving up."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from blipmq_cli import AsyncClient, Client, ConnectError, Gap, Message, Reconnect, Start
from tests.upstream import free_port


def fast() -> Reconnect:
    return Reconnect(attempts=200, initial=0.02, maximum=0.2)


async def restart(start_broker, old, port: int):
    """SIGKILL the broker, then start a new one on the same port and data directory."""
    old.proc.kill()
    old.proc.wait()
    return await trio.to_thread.run_sync(
        lambda: start_broker({"server": {"port": port}}, data_dir=old.data_dir))


async def read_log(addr: str, topic_filter: str) -> list[bytes]:
    """Every payload the log holds on ``topic_filter``, oldest first."""
    async with AsyncClient(addr, reconnect=False) as c:
        sub = await c.subscribe(topic_filter, start=Start.EARLIEST, until_end=True)
        with trio.fail_after(30):
            return [d.payload async for d in sub]


def test_backoff_grows_to_its_cap_with_jitter_below_it() -> None:
    r = Reconnect(initial=0.1, maximum=2.0, jitter=0.5)
    assert [r.delay(n, 0.0) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert r.delay(3, 0.999) == pytest.approx(0.8 * 0.5005)
    assert r.delay(10_000, 0.5) == 1.5


async def test_sigkill_mid_stream_loses_no_confirmed_message(start_broker) -> None:
    port = free_port()
    b = start_broker({"server": {"port": port}})
    events: list[str] = []
    gaps: list[Gap] = []
    confirmed: set[int] = set()
    n, tasks = 600, 4

    async with AsyncClient(b.addr, reconnect=fast(),
                           on_disconnect=lambda e: events.append("down"),
                           on_reconnect=lambda a: events.append("up"),
                           on_gap=gaps.append) as c:
        group = await c.subscribe("orders", group="billing", qos=1, credit=50)
        live = await c.subscribe("orders")
        seen_by_group: set[int] = set()

        async def publisher(first: int) -> None:
            for seq in range(first, n, tasks):
                await c.publish("orders", b"%d" % seq, qos=1)
                confirmed.add(seq)  # publish() returned: the broker said it is durable

        async def consumer() -> None:
            while len(seen_by_group) < n:
                batch = await group.next_batch()
                assert batch is not None
                seen_by_group.update(int(d.payload) for d in batch)
                await group.ack(*batch)

        async def drain_live() -> None:
            async for _ in live:
                pass

        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer)
                nursery.start_soon(drain_live)
                async with trio.open_nursery() as pubs:
                    for first in range(tasks):
                        pubs.start_soon(publisher, first)
                    while len(confirmed) < n // 3:  # mid-stream
                        await trio.sleep(0.005)
                    # stopped first, so that QoS 1 messages are surely unconfirmed when
                    # it dies: they must be sent again
                    os.kill(b.proc.pid, signal.SIGSTOP)
                    while c.pending[0] < tasks:
                        await trio.sleep(0.005)
                    b = await restart(start_broker, b, port)
                assert len(confirmed) == n  # every publish() returned, none raised
                while len(seen_by_group) < n:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert events[:2] == ["down", "up"] and c.reconnects >= 1
        assert c.resent >= tasks  # the unconfirmed ones went out again
        # the live subscription was restored at the log's end and said what it may miss
        assert gaps and gaps[0].topic_filter == "orders" and gaps[0].group == ""
        assert live.gaps == gaps
    # every confirmed message is in the log of the restarted broker (duplicates allowed)
    logged = {int(p) for p in await read_log(b.addr, "orders")}
    assert confirmed - logged == set()
    assert seen_by_group == set(range(n))  # the durable group resumed at its cursor


async def test_several_addresses_and_the_bounded_buffer_while_down(start_broker) -> None:
    port = free_port()
    b = start_broker({"server": {"port": port}})
    down, up = trio.Event(), trio.Event()
    dead = f"127.0.0.1:{free_port()}"  # nobody listens there: dialled, refused, skipped
    async with AsyncClient([dead, b.addr], reconnect=fast(), max_pending=100, block=False,
                           on_disconnect=lambda e: down.set(),
                           on_reconnect=lambda a: up.set()) as c:
        assert c.addr == b.addr
        b.proc.kill()
        b.proc.wait()
        with trio.fail_after(10):
            await down.wait()
        for i in range(100):
            await c.publish("held", b"%d" % i)  # held while disconnected
        assert c.pending[0] == 100 and not c.connected
        with pytest.raises(ConnectError, match="max_pending reached"):
            await c.publish("held", b"one too many")
        # block=True: publish waits for room (here: for the reconnect), not raises
        c.block = True
        with trio.move_on_after(0.3) as waited:
            await c.publish("held", b"waits")
        assert waited.cancelled_caught
        b = await restart(start_broker, b, port)
        with trio.fail_after(20):
            await up.wait()
            await c.publish("held", b"after", qos=1)
            await c.flush()
        assert c.addr == b.addr and c.pending == (0, 0)
    logged = await read_log(b.addr, "held")
    assert logged == [b"%d" % i for i in range(100)] + [b"after"]


async def test_it_gives_up_after_the_attempts_and_says_why(start_broker, tmp_path: Path) -> None:
    b = start_broker()
    async with AsyncClient(b.addr, reconnect=Reconnect(attempts=3, initial=0.01)) as c:
        sub = await c.subscribe("t")
        b.proc.kill()
        b.proc.wait()
        with trio.fail_after(20), pytest.raises(ConnectError, match="gave up reconnecting "
                                                                     "after 3 attempts"):
            await sub.next_batch()
        with pytest.raises(ConnectError, match="gave up"):
            await c.publish("t", b"x")


async def test_a_refused_key_on_reconnect_ends_the_async_client_at_once(start_broker) -> None:
    """A broker back with other API keys: dialling again cannot change that answer, so the
    waiting calls raise it at once, as in the sync client (was: dialled again for all of the
    policy's attempts, then ``gave up reconnecting``)."""
    from blipmq_cli import BrokerError

    b = start_broker({"auth": {"api_keys": ["s3cret"]}})
    port = int(b.addr.rsplit(":", 1)[1])
    patient = Reconnect(attempts=200, initial=0.05, maximum=1.0)  # minutes of attempts
    with pytest.raises(BrokerError, match="API key refused"):  # close() says why, too
        async with AsyncClient(b.addr, api_key="s3cret", reconnect=patient) as c:
            sub = await c.subscribe("t")
            b.proc.kill()
            b.proc.wait()
            await trio.to_thread.run_sync(lambda: start_broker(
                {"server": {"port": port}, "auth": {"api_keys": ["other"]}},
                data_dir=b.data_dir))
            with trio.fail_after(20), pytest.raises(BrokerError, match="API key refused"):
                await sub.next_batch()
            assert c.reconnects == 0
            with pytest.raises(BrokerError, match="API key refused"):
                await c.publish("t", b"x")


def test_the_sync_client_reconnects_when_asked(start_broker) -> None:
    """``Client(reconnect=...)``: the call that finds the connection lost (here a flush
    after SIGKILL) dials again, sends the unconfirmed QoS 1 messages again and restores
    the subscriptions, then returns as if nothing happened."""
    port = free_port()
    b = start_broker({"server": {"port": port}})
    down = threading.Event()
    brokers = [b]
    events: list[str] = []
    gaps: list[Gap] = []

    def restart_once_down() -> None:
        if down.wait(30):
            brokers.append(start_broker({"server": {"port": port}}, data_dir=b.data_dir))

    def lost(error: Exception) -> None:
        events.append("down")
        down.set()

    helper = threading.Thread(target=restart_once_down)
    helper.start()
    try:
        with Client(b.addr, reconnect=fast(), on_disconnect=lost,
                    on_reconnect=lambda a: events.append("up"), on_gap=gaps.append) as c:
            group = c.subscribe("sync/orders", group="g", qos=1, credit=500)
            live = c.subscribe("sync/orders")
            for i in range(50):
                c.publish("sync/orders", b"%d" % i, qos=1)
            os.kill(b.proc.pid, signal.SIGSTOP)  # these reach it, unconfirmed
            c.publish_many(Message("sync/orders", b"%d" % i, qos=1) for i in range(50, 200))
            b.proc.kill()
            b.proc.wait()
            c.flush()  # reconnects, sends the 150 again, waits for their confirms
            assert events == ["down", "up"] and c.reconnects == 1 and c.resent == 150
            assert live.gaps == gaps and gaps[0] == Gap("sync/orders", "", None)
            assert group.credit == 500
            seen: set[int] = set()
            deadline = time.monotonic() + 30
            while len(seen) < 200 and time.monotonic() < deadline:
                batch = group.next_batch(timeout=10)
                assert batch is not None
                seen.update(int(d.payload) for d in batch)
                group.ack(*batch)
            assert seen == set(range(200))  # the durable group resumed at its cursor
    finally:
        down.set()
        helper.join()
    with Client(brokers[-1].addr) as c:
        logged = {int(d.payload) for d in c.subscribe("sync/orders", start=Start.EARLIEST,
                                                      until_end=True)}
    assert logged == set(range(200))


async def test_a_deleted_group_is_not_brought_back_by_a_reconnect(start_broker) -> None:
    port = free_port()
    b = start_broker({"server": {"port": port}})
    up = trio.Event()
    sync = Client(b.addr, reconnect=fast())
    try:
        async with AsyncClient(b.addr, reconnect=fast(), on_reconnect=lambda a: up.set()) as c:
            await c.subscribe("jobs", group="gone", qos=1)
            sync.subscribe("jobs", group="gone-too", qos=1)
            kept = await c.subscribe("jobs", group="kept", qos=1)
            async with AsyncClient(b.addr) as admin:
                await admin.unsubscribe("jobs", group="gone")
                await admin.unsubscribe("jobs", group="gone-too")
            await c.ping()
            b = await restart(start_broker, b, port)
            with trio.fail_after(20):
                await up.wait()
            await trio.to_thread.run_sync(sync.ping)  # the sync client reconnects here
            assert sync.reconnects == 1
            groups = {g["group"] for g in (await c.stats())["groups"]}
            assert groups == {"kept"} and kept.sub_id
    finally:
        sync.close()


def _read_back(addr: str, topic: str) -> list[bytes]:
    with Client(addr) as c:
        sub = c.subscribe(topic, start=Start.EARLIEST, until_end=True)
        return [d.payload for d in sub]


def test_the_sync_client_notices_a_silent_link_and_reconnects(start_broker) -> None:
    """A QoS 1 publish whose link went silent (no FIN, no RST: a lost NAT entry) does not
    time out for ever: the keepalive finds the broker silent within 2 x timeout, the
    client reconnects once the network is back, and the publish returns, its message in
    the log."""
    from tests.faultproxy import FaultProxy

    b = start_broker()
    events: list[str] = []
    with FaultProxy(("127.0.0.1", b.port)) as proxy:
        c = Client(f"127.0.0.1:{proxy.port}", timeout=1, reconnect=fast(),
                   on_disconnect=lambda e: events.append(f"down: {e}"),
                   on_reconnect=lambda a: events.append("up"))
        c.publish("silent/t", b"0", qos=1)
        proxy.blackhole()
        threading.Timer(3.0, proxy.restore).start()
        started = time.monotonic()
        c.publish("silent/t", b"1", qos=1)  # returns once stored, across the reconnect
        took = time.monotonic() - started
        c.close()
    assert 3.0 <= took < 10, took
    assert events[0].startswith("down: ") and "no answer" in events[0], events
    assert events[-1] == "up", events
    assert _read_back(b.addr, "silent/t") == [b"0", b"1"]


def test_a_sync_publish_waiting_for_its_ack_returns_after_the_reconnect(start_broker) -> None:
    """The reply's deadline starts again after a reconnect: the message was handed to the
    new connection and confirmed there, so the publish returns (no TimeoutError that would
    have the caller send it again)."""
    from tests.faultproxy import FaultProxy

    b = start_broker()
    with FaultProxy(("127.0.0.1", b.port)) as proxy:
        c = Client(f"127.0.0.1:{proxy.port}", timeout=2, reconnect=fast())
        c.publish("again/t", b"0", qos=1)
        proxy.blackhole()
        threading.Timer(0.5, proxy.refuse).start()
        threading.Timer(3.5, proxy.restore).start()
        c.publish("again/t", b"1", qos=1)
        assert c.reconnects == 1 and c.resent == 1
        c.close()
    assert _read_back(b.addr, "again/t") == [b"0", b"1"]


def test_a_stalled_sync_write_reconnects_when_that_is_on(start_broker) -> None:
    """A write the broker takes nothing of for ``timeout`` is a lost link like any other
    with reconnects on: the cut connection is dropped, the client dials again, and the
    publish returns once its message is stored whole on the new connection."""
    b = start_broker()
    events: list[str] = []

    def down(error: Exception) -> None:
        events.append(f"down: {error}")
        os.kill(b.proc.pid, signal.SIGCONT)  # the broker reads again: the redial works

    c = Client(b.addr, timeout=0.5, reconnect=fast(), on_disconnect=down)
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        c.publish("stall/t", b"A" * 8_000_000, qos=1)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert c.reconnects == 1 and c.resent == 1
    c.publish("stall/t", b"B" * 1000, qos=1)
    c.close()
    assert events == [f"down: the connection to {b.addr} broke off: the broker at {b.addr} "
                      "took no data for 0.5 s"]
    assert _read_back(b.addr, "stall/t") == [b"A" * 8_000_000, b"B" * 1000]


async def test_close_waits_through_a_reconnect_for_what_is_unconfirmed(start_broker) -> None:
    """``close()`` flushes first, waiting for a reconnect: its PING lost with a broker that
    stalled and died is asked again on the new connection, which confirms the QoS 1
    messages that were unconfirmed, and close() drops nothing."""
    port = free_port()
    b = start_broker({"server": {"port": port}})
    c = AsyncClient(b.addr, timeout=20, reconnect=fast())
    async with trio.open_nursery() as nursery:
        await c.connect(nursery)
        os.kill(b.proc.pid, signal.SIGSTOP)  # nothing is confirmed from here on
        await c.publish_many(Message("closing/t", b"%d" % i, qos=1) for i in range(300))
        nursery.start_soon(c.close)
        await trio.testing.wait_all_tasks_blocked()  # the flush waits for its PONG
        b = await restart(start_broker, b, port)
    assert c.reconnects == 1 and c.pending == (0, 0)
    assert await read_log(b.addr, "closing/t") == [b"%d" % i for i in range(300)]
