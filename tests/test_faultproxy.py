"""tests/faultproxy.py does what each mode says, seen from plain sockets, and with
tests/upstream.py drives a real mosquitto through it."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator

import paho.mqtt.client as mqtt
import pytest

from tests.faultproxy import FaultProxy
from tests.upstream import (
    Collector,
    Mosquitto,
    Received,
    mqtt_client,
    number_of,
    numbered,
    tally,
    wait_until,
)

QUIET = 0.3  # s a socket waits to show that nothing arrives (a recv timeout, not a sleep)


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            while data := sock.recv(65536):
                sock.sendall(data)
        except OSError:
            return


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = _EchoServer(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield ("127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    with FaultProxy(echo) as p:
        yield p


def connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(proxy.address, timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:  # each recv returns at least one byte or raises / returns EOF
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def echoes(sock: socket.socket, data: bytes = b"ping") -> bool:
    sock.sendall(data)
    return recv_exactly(sock, len(data)) == data


def settles(check: Callable[[], bool], timeout: float = 5) -> bool:
    """Whether ``check`` becomes true within ``timeout`` s (polled, for counters that are
    updated by the proxy's thread a moment after the bytes moved)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def silent(sock: socket.socket) -> bool:
    """Nothing arrives, not even EOF or a reset, within QUIET seconds."""
    old = sock.gettimeout()
    sock.settimeout(QUIET)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(old)
    return False


def test_pass_through_echoes_and_counts(proxy: FaultProxy) -> None:
    with connect(proxy) as a, connect(proxy) as b:
        assert echoes(a, b"hello")
        assert echoes(b, b"world!")
        big = bytes(range(256)) * 4096  # 1 MiB: more than the proxy's queues hold
        sender = threading.Thread(target=a.sendall, args=(big,))
        sender.start()
        assert recv_exactly(a, len(big)) == big
        sender.join(5)
        total = 5 + 6 + len(big)
        # the proxy counts a write once it returns, which may be just after the peer read it
        assert settles(lambda: proxy.stats().bytes_down == total)
        stats = proxy.stats()
        assert stats.accepted == 2 and stats.current == 2
        assert stats.bytes_up == total
        # a half-close passes through: the echo server sees EOF and closes, we see EOF
        a.shutdown(socket.SHUT_WR)
        assert a.recv(1) == b""
    assert proxy.mode == "pass"


def test_refuse_resets_current_connections_and_refuses_new_ones(proxy: FaultProxy) -> None:
    with connect(proxy) as a:
        assert echoes(a)
        proxy.refuse()
        with pytest.raises(ConnectionResetError):
            a.recv(1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=5)
    assert proxy.stats().current == 0
    proxy.restore()
    with connect(proxy) as b:  # the same port listens again
        assert echoes(b)


def test_cut_resets_current_connections_and_accepts_new_ones(proxy: FaultProxy) -> None:
    with connect(proxy) as a, connect(proxy) as b:
        assert echoes(a) and echoes(b)
        proxy.cut()
        for sock in (a, b):
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
    with connect(proxy) as c:
        assert echoes(c)
    assert proxy.stats().resets == 2


def test_cut_after_resets_each_new_connection_that_long_after_it_was_accepted(
        proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        assert echoes(old)  # accepted by the proxy before the change
        proxy.cut_after(0.3)
        with connect(proxy) as a:
            accepted = time.monotonic()
            assert echoes(a)  # forwarded until its time is up
            a.settimeout(5)
            with pytest.raises(ConnectionResetError):
                a.recv(1)
            assert time.monotonic() - accepted >= 0.3
        assert echoes(old) and silent(old)  # opened before: left alone
        with connect(proxy) as b:  # and so is every new one
            b.settimeout(5)
            with pytest.raises(ConnectionResetError):
                b.recv(1)
        proxy.restore()
        with connect(proxy) as c:
            assert echoes(c) and silent(c)
    assert proxy.stats().resets == 2


def test_blackhole_is_a_silent_dead_link_until_restored(proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        assert echoes(old)
        proxy.blackhole()
        old.sendall(b"into the void")
        assert silent(old)
        old.sendall(b"still open")  # no reset either: sending still works
        with connect(proxy) as new:  # new connections are accepted, and dead as well
            new.sendall(b"x" * 1000)
            assert silent(new)
            new.shutdown(socket.SHUT_WR)  # our FIN does not come back as theirs
            assert silent(new)
        proxy.restore()
        with connect(proxy) as fresh:
            assert echoes(fresh)
        assert silent(old)  # a connection that lost bytes stays dead after the link is back
        stats = proxy.stats()
        assert stats.bytes_dropped >= len(b"into the void") + 1000
        proxy.cut()  # what a peer's keepalive timeout would come to
        with pytest.raises(ConnectionResetError):
            old.recv(1)


def test_delay_adds_at_least_the_delay_each_way_and_keeps_order(proxy: FaultProxy) -> None:
    with connect(proxy) as a:
        proxy.delay(100)
        start = time.monotonic()
        for i in range(5):  # five writes in flight at once come back in order
            a.sendall(b"%d;" % i)
        assert recv_exactly(a, 10) == b"0;1;2;3;4;"
        assert time.monotonic() - start >= 0.2  # 100 ms there, 100 ms back
        assert proxy.stats().delay_ms == 100
        proxy.restore()
        assert echoes(a)
        assert proxy.stats().delay_ms == 0


def test_connections_over_the_limit_are_reset(echo: tuple[str, int]) -> None:
    with FaultProxy(echo, max_connections=2) as proxy:
        with connect(proxy) as a, connect(proxy) as b:
            assert echoes(a) and echoes(b)
            with pytest.raises((ConnectionResetError, EOFError)):  # at connect() or after
                with connect(proxy) as c:
                    echoes(c)
            assert proxy.stats().over_limit == 1


def test_an_unreachable_target_resets_the_client() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connecting to it is refused
        with FaultProxy(("127.0.0.1", port)) as proxy:
            with pytest.raises((ConnectionResetError, EOFError)):  # at connect() or after
                with connect(proxy) as a:
                    recv_exactly(a, 1)
            assert settles(lambda: proxy.stats().upstream_failures == 1)


def test_close_resets_connections_and_frees_the_port(echo: tuple[str, int]) -> None:
    proxy = FaultProxy(echo).start()
    a = connect(proxy)
    assert echoes(a)
    proxy.close()
    with a, pytest.raises(ConnectionResetError):
        a.recv(1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=5)
    with pytest.raises(RuntimeError):
        proxy.cut()


def test_only_loopback_targets() -> None:
    with pytest.raises(ValueError):
        FaultProxy(("192.0.2.1", 1883))


# --- with a real mosquitto behind the proxy (tests/upstream.py) ----------------------------


@pytest.fixture
def upstream() -> Iterator[Mosquitto]:
    with Mosquitto(persistence=True) as m:
        yield m


def publish_numbers(client: mqtt.Client, topic: str, numbers: range) -> list[mqtt.MQTTMessageInfo]:
    """QoS 1 publishes, queued by paho while it is disconnected and sent when it is back."""
    return [client.publish(topic, numbered(n), qos=1) for n in numbers]


def stop(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def test_qos1_through_a_cut_link_all_arrive(upstream: Mosquitto) -> None:
    with Collector(upstream.port, "seq/#") as collector, FaultProxy(upstream.address) as proxy:
        pub = mqtt_client(proxy.port, "pub-cut", clean_session=False)
        try:
            first = publish_numbers(pub, "seq/a", range(300))
            first[-1].wait_for_publish(10)  # PUBACKed by mosquitto, through the proxy
            proxy.cut()
            publish_numbers(pub, "seq/a", range(300, 600))  # while paho notices and reconnects
            assert collector.wait_distinct(600, 20), collector.tally(600)
        finally:
            stop(pub)
        result = collector.tally(600)
        assert result.complete and result.unexpected == 0
        assert result.duplicates <= 100  # at most paho's in-flight window is sent again
        stats = proxy.stats()
        assert stats.accepted >= 2 and stats.resets >= 1


def test_blackhole_refuse_and_an_upstream_restart_lose_nothing(upstream: Mosquitto) -> None:
    with Collector(upstream.port, "seq/#") as collector, FaultProxy(upstream.address) as proxy:
        pub = mqtt_client(proxy.port, "pub-dark", clean_session=False, keepalive=1)
        try:
            publish_numbers(pub, "seq/b", range(100))[-1].wait_for_publish(10)
            proxy.blackhole()
            lost = publish_numbers(pub, "seq/b", range(100, 200))
            # paho's keepalive (1 s) notices the silent link: its connection is given up
            assert wait_until(lambda: not pub.is_connected(), 10)
            assert not lost[-1].is_published()
            proxy.refuse()
            upstream.restart()  # SIGTERM: the collector's session and queue are saved
            proxy.restore()
            publish_numbers(pub, "seq/b", range(200, 300))
            assert collector.wait_distinct(300, 20), collector.tally(300)
        finally:
            stop(pub)
        result = collector.tally(300)
        assert result.complete and result.unexpected == 0
        assert collector.connects >= 2  # it came back after the restart on its own
        assert proxy.stats().bytes_dropped > 0


def test_tally_counts_missing_duplicates_and_order() -> None:
    def got(topic: str, *numbers: int) -> list[Received]:
        return [Received(topic, numbered(n), 0) for n in numbers]

    arrivals = [*got("a", 0, 1, 2, 1, 2, 3), *got("b", 5, 4, 6), *got("a", 99),
                Received("a", b"?", 0)]
    t = tally(arrivals, 8)
    assert t.missing == (7,) and not t.complete
    assert t.distinct == 7 and t.received == 9 and t.duplicates == 2
    assert t.unexpected == 2  # 99 is out of range, b"?" has no number
    assert t.out_of_order == 1  # 4 first arrived after 5 on topic b; a's redeliveries are not
    assert t.regressions == 2  # 2 -> 1 on a (a redelivery), 5 -> 4 on b
    assert number_of(numbered(12, 40)) == 12 and len(numbered(12, 40)) == 40
