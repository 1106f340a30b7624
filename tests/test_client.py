"""The sync client library against a real broker process, and its timeouts and failure
paths against a scripted peer that plays a silent or misbehaving broker."""

from __future__ import annotations

import os
import select
import signal
import socket
import time

import pytest
from peer import Link, Peer, greet, silent_after_subscribe

from blipmq_cli.client import Client, parse_addr
from blipmq_server.errors import BlipError, BrokerError, ConfigError, ConnectError
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import ErrorCode, Message
from blipmq_server.protocol.connection import Reconnect


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
    ("localhost", ("localhost", 7878)), ("[::1]", ("::1", 7878)),
])
def test_parse_addr(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", [":80", "h:0", "h:99999", "h:x", "[::1]:"])
def test_parse_addr_refuses(addr: str) -> None:
    with pytest.raises(ValueError):
        parse_addr(addr)


# ------------------------------------------------------------------ timeouts and failures
# Against a scripted peer on 127.0.0.1 (tests/peer.py): the real broker cannot be made silent.


def test_handshake_with_a_silent_listener_times_out() -> None:
    with Peer(None) as peer:  # accepts nothing: connect succeeds, the handshake never does
        started = time.monotonic()
        with pytest.raises(ConnectError) as info:
            Client(peer.addr, timeout=0.5)
        elapsed = time.monotonic() - started
    assert 0.4 < elapsed < 3
    assert str(info.value) == (
        f"cannot connect to {peer.addr}: the broker did not finish the handshake within 0.5 s"
    )


def test_handshake_stuck_after_welcome_times_out() -> None:
    def welcome_only(frame: codec.Frame, link: Link) -> None:
        if not isinstance(frame, codec.Auth):
            greet(frame, link)

    with Peer(welcome_only) as peer:
        started = time.monotonic()
        with pytest.raises(ConnectError, match="handshake"):
            Client(peer.addr, timeout=0.5)
        assert 0.4 < time.monotonic() - started < 3


def test_a_subscriber_gives_up_on_a_silent_broker_after_twice_the_timeout() -> None:
    with Peer(silent_after_subscribe) as peer:
        c = Client(peer.addr, timeout=0.4)
        sub = c.subscribe("quiet")
        started = time.monotonic()
        with pytest.raises(ConnectError) as info:
            sub.next_batch()
        elapsed = time.monotonic() - started
        c.abort()
    assert 0.7 < elapsed < 3
    assert str(info.value) == f"no answer from the broker at {peer.addr} for 0.8 s"
    pings = [f for f in peer.frames() if isinstance(f, codec.Ping)]
    assert len(pings) == 1  # one keepalive probe, then it gave up


def test_keepalive_pings_keep_a_quiet_subscription_waiting() -> None:
    answered: list[int] = []

    def pongs_then_deliver(frame: codec.Frame, link: Link) -> None:
        silent_after_subscribe(frame, link)
        if isinstance(frame, codec.Ping):
            link.send(codec.Pong(frame.data, frame.request_id))
            answered.append(frame.request_id)
            if len(answered) == 3:
                msg = codec.Delivery(1, 1, "quiet", b"at last", 0, 0, None)
                link.send(codec.Deliver(7, (msg,)))

    with Peer(pongs_then_deliver) as peer:
        c = Client(peer.addr, timeout=0.25)
        started = time.monotonic()
        batch = c.subscribe("quiet").next_batch()
        elapsed = time.monotonic() - started
        c.abort()
    assert batch is not None and [d.payload for d in batch] == [b"at last"]
    assert len(answered) == 3 and elapsed >= 0.7  # a probe after each 0.25 s of silence


def test_requests_wait_no_longer_than_the_timeout() -> None:
    with Peer(greet) as peer:  # the handshake, and nothing else ever again
        c = Client(peer.addr, timeout=0.3)
        for call in (lambda: c.subscribe("t"), c.flush, lambda: c.unsubscribe("t", group="g")):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=peer.addr):
                call()
            assert 0.25 < time.monotonic() - started < 3
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            c.flush(timeout=0.1)  # the caller's own timeout wins
        assert time.monotonic() - started < 0.3 + 0.5
        c.abort()


def test_qos1_confirms_wait_no_longer_than_the_timeout() -> None:
    with Peer(greet) as peer:  # takes the PUBLISH, never confirms it
        c = Client(peer.addr, timeout=0.3)
        with pytest.raises(TimeoutError, match="PUB_ACK"):
            c.publish("t", b"x", qos=1)
        assert (c.qos1_sent, c.confirmed) == (1, 0)
        c.abort()


def test_a_ping_from_the_broker_is_answered_while_waiting_and_before_publishing() -> None:
    def pinger(frame: codec.Frame, link: Link) -> None:
        silent_after_subscribe(frame, link)
        if isinstance(frame, codec.Subscribe):
            link.send(codec.Ping(b"while you wait", 1001))
        elif isinstance(frame, codec.Pong) and frame.request_id == 1001:
            link.send(codec.Deliver(7, (codec.Delivery(1, 1, "t", b"thanks", 0, 0, None),)))

    with Peer(pinger) as peer:
        c = Client(peer.addr, timeout=5)
        batch = c.subscribe("t").next_batch(5)  # comes only once the PING was answered
        assert batch is not None and batch[0].payload == b"thanks"
        peer.links[0].send(codec.Ping(b"\x00idle\xff", 1002))
        assert select.select([c.sock], [], [], 5)[0]  # it reached the idle client's socket
        c.publish("t", b"after a pause")  # reads before it writes: answers the PING first
        peer.wait_for(lambda frames: isinstance(frames[-1], codec.Publish))
        c.abort()
    answers = [(type(f), f) for f in peer.frames() if isinstance(f, (codec.Pong, codec.Publish))]
    assert answers[:2] == [(codec.Pong, codec.Pong(b"while you wait", 1001)),
                           (codec.Pong, codec.Pong(b"\x00idle\xff", 1002))]
    assert answers[2][0] is codec.Publish


def test_a_publisher_notices_a_closed_connection_before_writing() -> None:
    def bye(frame: codec.Frame, link: Link) -> None:
        greet(frame, link)
        if isinstance(frame, codec.Auth):
            link.send(codec.Goodbye(ErrorCode.SHUTTING_DOWN, "broker is shutting down"))
            link.hang_up()

    with Peer(bye) as peer:
        c = Client(peer.addr, timeout=5)
        peer.hung_up.wait(5)
        with pytest.raises(BrokerError) as info:
            c.publish("t", b"into the void")
        assert info.value.code == ErrorCode.SHUTTING_DOWN
        c.abort()
    assert not any(isinstance(f, codec.Publish) for f in peer.frames())


def test_a_send_the_broker_takes_nothing_of_ends_after_the_timeout() -> None:
    """A broker that stops reading: once the socket's buffers are full, a publish waits
    ``timeout`` seconds for room, then raises ConnectError."""
    def stall(frame: codec.Frame, link: Link) -> None:
        if not greet(frame, link) and isinstance(frame, codec.Publish):
            time.sleep(3)  # reads nothing meanwhile

    with Peer(stall) as peer:
        c = Client(peer.addr, timeout=0.5)
        payload = b"x" * 60_000
        started = time.monotonic()
        with pytest.raises(ConnectError) as info:
            for _ in range(2_000):  # 120 MB at most: far more than the socket buffers hold
                c.publish("t", payload)
        assert time.monotonic() - started < 2.5
        assert str(info.value) == f"the broker at {peer.addr} took no data for 0.5 s"
        c.abort()


def test_the_frame_limit_is_exactly_what_welcome_announced() -> None:
    def small_frames(frame: codec.Frame, link: Link) -> None:
        greet(frame, link, max_frame=4096)
        if isinstance(frame, codec.Ping):  # a PONG one byte over the announced limit
            link.send(codec.Pong(b"x" * (4096 - 4), frame.request_id))

    with Peer(small_frames) as peer:
        c = Client(peer.addr, timeout=5)
        assert c.max_frame == 4096
        c.publish_many(("t", b"%04d" % i * 50) for i in range(100))  # 20 kB in all
        with pytest.raises(ConnectError, match="exceeds the maximum of 4096"):
            c.flush()
        c.abort()
    publishes = [f for f in peer.frames() if isinstance(f, codec.Publish)]
    assert sum(len(f.messages) for f in publishes) == 100
    assert all(len(codec.encode(f)) - 4 <= 4096 for f in publishes)


def test_tcp_keepalive_is_on(start_broker) -> None:
    b = start_broker()
    with Client(b.addr, timeout=7) as c:
        assert c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
            assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 7
            assert c.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


def test_a_quiet_subscription_on_a_real_broker_survives_keepalive(start_broker) -> None:
    b = start_broker()
    with Client(b.addr, timeout=0.2) as c:
        sub = c.subscribe("quiet")
        with pytest.raises(TimeoutError):  # not ConnectError: every probe got its PONG
            sub.next_batch(1.5)
        assert c.ping() >= 0


def test_the_client_benchmark_runs_and_prints_figures() -> None:
    """bench/clientbench.py end to end with a tiny count (figures printed, never judged)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "clientbench.py"
    done = subprocess.run([sys.executable, str(script), "-n", "300", "--latency-n", "50",
                           "--rate", "1000", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"blipmq-async", "blipmq-sync"} <= set(report["results"])
    assert set(report["results"]) | set(report["skipped"]) == {"blipmq-async", "blipmq-sync",
                                                              "nats-async"}
    for row in report["results"].values():
        assert row["msg_s"] > 0 and row["p50_ms"] > 0


def test_several_addresses_the_first_that_answers_is_used(start_broker) -> None:
    b = start_broker()
    from tests.upstream import free_port

    dead = f"127.0.0.1:{free_port()}"  # nobody listens there (a port of this worker's own)
    with Client([dead, b.addr]) as c:
        assert c.addr == b.addr and c.ping() >= 0
    with pytest.raises(ConnectError, match="cannot connect to"):
        Client([dead, dead], timeout=2)
    with pytest.raises(ConfigError, match="no broker address"):
        Client([])


def test_bad_arguments_are_one_config_error_before_anything_is_sent(start_broker) -> None:
    """A bad argument is a ConfigError (a BlipError) that names it, raised before anything
    goes out: the connection stays usable and the broker sees nothing of it."""
    b = start_broker()
    with Client(b.addr) as c:
        sub = c.subscribe("args/t", qos=1, group="g", start=codec.Start.EARLIEST)
        bad = [
            (lambda: c.publish("args/t", b"x", qos=5), "qos: must be 0 or 1, not 5"),
            (lambda: c.publish("args/t", b"x", qos="1"), "qos: must be 0 or 1, not '1'"),
            (lambda: c.publish("args/t", "text"), "payload: must be bytes, not str"),
            (lambda: c.publish("args/t", b"x", key="k"), "key: must be bytes, not str"),
            (lambda: c.publish("args/t", b"x", ttl_ms=-1), "ttl_ms: must be a whole number"),
            (lambda: c.publish_many([("args/t", b"ok"), ("args/t", "text")]),
             "payload: must be bytes"),
            (lambda: c.publish_many([Message("args/t", b"x", qos=5)]), "qos: must be 0 or 1"),
            (lambda: c.subscribe("args/t", qos=5), "qos: must be 0 or 1, not 5"),
            (lambda: c.subscribe("args/t", qos=1, credit=-1), "credit: must be a whole"),
            (lambda: sub.set_credit(-1), "credit: must be a whole number"),
            (lambda: sub.nack(delay_ms=-1), "delay_ms: must be a whole number"),
        ]
        for call, text in bad:
            with pytest.raises(ConfigError) as info:
                call()
            assert text in str(info.value) and isinstance(info.value, BlipError), text
        c.flush()  # nothing refused: the bad calls sent nothing
        c.publish("args/t", b"good", qos=1)
        got: list[bytes] = []
        while len(got) < 2:  # bounded: each wait raises after 10 s
            got += [d.payload for d in sub.next_batch(timeout=10) or ()]
        assert got == [b"ok", b"good"]
    with pytest.raises(ConfigError, match="scheme must be tcp:// or tls://"):
        Client("nats://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"holds a comma: give several addresses as a list"):
        Client(f"{b.addr},127.0.0.1:2")
    for timeout in (0, -1, "5"):
        with pytest.raises(ConfigError, match="timeout: must be a positive number"):
            Client(b.addr, timeout=timeout)  # type: ignore[arg-type]


class _Interrupt(Exception):
    """What a Ctrl-C landing mid-write stands for: raised from ``progress``."""


def _log_of(addr: str, topic: str) -> list[bytes]:
    with Client(addr) as c:
        return [d.payload for d in c.subscribe(topic, start=codec.Start.EARLIEST,
                                               until_end=True)]


def test_a_write_interrupted_part_way_breaks_the_connection_off(start_broker) -> None:
    """An exception in the middle of a large publish (here from ``progress``) leaves part
    of a frame on the wire: the client breaks that connection off, so nothing written
    later is read as the rest of the cut frame, and the broker stores nothing mangled."""
    b = start_broker()
    c = Client(b.addr, timeout=5)

    def progress(sent: int) -> None:
        if sent >= 1 << 20:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        c.publish("cut/t", b"A" * 2_000_000, qos=1, progress=progress)
    for _ in range(2):
        with pytest.raises(ConnectError, match="broke off: a write was interrupted part-way"):
            c.publish("cut/t", b"B" * 400_000, qos=1)
    c.close()
    assert _log_of(b.addr, "cut/t") == []


def test_a_stalled_write_breaks_the_connection_off(start_broker) -> None:
    """A write the broker takes nothing of for ``timeout`` raises ConnectError, and the
    connection is over: once the broker reads again, the next publish raises too instead
    of completing the cut frame with its own bytes."""
    b = start_broker()
    c = Client(b.addr, timeout=0.5)
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ConnectError, match=r"took no data for 0\.5 s"):
            c.publish("stall/t", b"A" * 8_000_000, qos=1)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    with pytest.raises(ConnectError, match=r"broke off: the broker .* took no data"):
        c.publish("stall/t", b"B" * 1_000_000, qos=1)
    c.close()
    assert _log_of(b.addr, "stall/t") == []


def test_the_sync_client_reads_ahead_no_more_than_read_ahead(start_broker) -> None:
    """Deliveries nobody takes are read (by request/reply calls and the reads before each
    write) only up to ``read_ahead`` bytes, plus one frame: the rest wait in the socket,
    and a reply behind them raises TimeoutError at once instead of piling them up in
    memory. Taken later, every delivery is there, in order."""
    b = start_broker({"wal": {"enabled": False}})
    bound, size, n = 256 << 10, 64 << 10, 200  # 12.5 MiB sent to a 256 KiB read-ahead
    with Client(b.addr, read_ahead=bound) as c, Client(b.addr) as pub:
        sub = c.subscribe("cam/#")
        b.wait_subscribers(1)
        pub.publish_many(("cam/1", bytes([i]) * size) for i in range(n))
        pub.flush()
        for _ in range(5):  # request/reply calls only, as a busy publisher makes them
            try:
                c.publish("status", b"ok")
                c.ping()
            except TimeoutError as exc:
                assert "read_ahead (262144 bytes) is reached" in str(exc)
            assert c.buffered[1] <= bound + c.max_frame
        got: list[bytes] = []
        while len(got) < n:  # bounded: each wait raises after 10 s
            got += [d.payload for d in sub.next_batch(timeout=10) or ()]
        assert got == [bytes([i]) * size for i in range(n)]
        c.flush()  # the replies behind them came too


def test_close_with_read_ahead_full_drops_what_was_not_taken_and_closes(start_broker) -> None:
    """h28 D4: a client whose own subscription filled ``read_ahead`` could not close: the
    flush behind the unread deliveries raised the same TimeoutError ("take them"). close()
    drops them now (a group's go back to it unacked), flushes and says GOODBYE; every
    QoS 1 message it published is in the log."""
    b = start_broker()
    c = Client(b.addr, timeout=3, read_ahead=10_000)
    c.subscribe("ra/t", qos=1, credit=100_000)
    with pytest.raises(TimeoutError, match="read_ahead"):
        for _ in range(50):
            c.publish("ra/t", b"x" * 1000, qos=1)
        c.wait_confirms(timeout=5)
    sent = c.qos1_sent
    c.close()  # no TimeoutError: the deliveries nobody takes are dropped
    assert c.confirmed == sent
    with Client(b.addr) as reader:
        replay = reader.subscribe("ra/t", start=codec.Start.EARLIEST)
        got = 0
        while got < sent:  # bounded: each wait raises after 10 s
            got += len(replay.next_batch(timeout=10) or ())
    assert got == sent


@pytest.mark.parametrize("draw", [0.0, 0.5, 0.99])
def test_a_reconnect_within_a_window_waits_for_all_of_it(draw: float) -> None:
    """``Reconnect(within=...)`` (``--reconnect-for``): the waits add up to the window, the
    last one what is left of it, whatever the jitter; without it, ``attempts`` waits."""
    policy = Reconnect(attempts=1 << 30, initial=0.1, maximum=2.0, jitter=0.2, within=5.0)
    waits = list(policy.waits(lambda: draw))
    assert sum(waits) == pytest.approx(5.0) and all(0 < w <= 2.0 for w in waits), waits
    assert len(list(Reconnect(attempts=3).waits(lambda: draw))) == 3
    assert list(Reconnect(attempts=2, initial=1, maximum=1, jitter=0, within=1.5).waits(
        lambda: draw)) == [1, 0.5]


@pytest.mark.parametrize("policy", [5, "yes", 1.0, object()])
def test_a_reconnect_that_is_no_policy_is_a_config_error_up_front(policy: object) -> None:
    """``reconnect=5`` used to be taken, then fail with AttributeError at the first lost
    connection; it is refused before anything is dialled (no broker needed)."""
    with pytest.raises(ConfigError, match="reconnect: must be True, False or a Reconnect"):
        Client("127.0.0.1:1", reconnect=policy)  # type: ignore[arg-type]


def test_more_bad_arguments_are_config_errors(start_broker) -> None:
    """Connection arguments, subscription names and start, acks and a call's own timeout:
    one ConfigError naming the argument, not a TypeError, AttributeError,
    UnicodeEncodeError or LocalProtocolError from deep inside."""
    b = start_broker()
    bad_clients = [
        (lambda: Client(12345), "addr: must be a str or a list of them"),  # type: ignore
        (lambda: Client(b.addr, None), "api_key: must be a str"),  # type: ignore
        (lambda: Client(b.addr, "\udc80"), "api_key: must be valid UTF-8"),
        (lambda: Client(b.addr, name=None), "name: must be a str"),  # type: ignore
        (lambda: Client(b.addr, name="n" * 70000), "name: must be at most 65535 bytes"),
        (lambda: Client(b.addr, ssl_context="ctx"), "ssl_context: must be an ssl.SSLContext"),
        (lambda: Client(b.addr, read_ahead=0), "read_ahead: must be a whole number"),
    ]
    with Client(b.addr, timeout=5) as c:
        sub = c.subscribe("args/t", group="g", qos=1)
        bad_calls = [
            (lambda: c.subscribe("a", group="g" * 70000, qos=1), "group: must be at most"),
            (lambda: c.subscribe("a", start="EARLIEST"), "start: must be a Start"),
            (lambda: sub.ack(5), "deliveries: give the Delivery objects"),
            (lambda: sub.nack(None), "deliveries: give the Delivery objects"),
            (lambda: c.unsubscribe(None), "topic_filter: must be a str"),
            (lambda: sub.next_batch(timeout="1"), "timeout: must be None or a number"),
            (lambda: sub.next_batch(timeout=-1), "timeout: must be None or a number"),
            (lambda: c.flush(timeout=-1), "timeout: must be None or a number"),
            (lambda: c.stats(timeout="5"), "timeout: must be None or a number"),
        ]
        for call, text in bad_clients + bad_calls:
            with pytest.raises(ConfigError) as info:
                call()
            assert text in str(info.value), text
        assert c.stats()["connections"] == 1  # the bad calls left the connection usable


def test_any_iterable_of_addresses_is_taken() -> None:
    """h28: the argument checks took only a str, a list or a tuple of addresses, where any
    iterable of them worked before (a deque, a generator)."""
    from collections import deque

    from blipmq_cli.client import targets

    assert [t[:2] for t in targets(deque(["127.0.0.1:1", "127.0.0.1:2"]), None)] == [
        ("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert [t[:2] for t in targets((a for a in ["127.0.0.1:3"]), None)] == [("127.0.0.1", 3)]
    with pytest.raises(ConfigError, match="addr: must be a str or a list of them"):
        targets([1], None)  # type: ignore[list-item]
