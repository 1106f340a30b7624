"""Slow, stuck and silent peers against a real broker process: one forgotten or stopped
consumer never stops a topic for everyone, a peer that does not read cannot grow the broker's
memory, and a silent connection does not hold its slot forever."""

from __future__ import annotations

import signal
import socket
import time

from blipmq_cli.exits import Exit
from blipmq_server.protocol import codec


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def raw_connect(port: int) -> socket.socket:
    """A protocol connection through the handshake, by hand (a peer that may never read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(codec.encode(codec.Hello(codec.VERSION, "raw", 1)) +
                 codec.encode(codec.Auth("", 2)))
    dec = codec.Decoder(1 << 24)
    frames: list[codec.Frame] = []
    while len(frames) < 2:
        dec.feed(sock.recv(65536))
        frames += dec.frames()
    assert isinstance(frames[1], codec.AuthOk), frames
    return sock


def test_a_group_whose_consumer_left_does_not_stop_the_topic(start_broker) -> None:
    b = start_broker({"queues": {"capacity": 100}})
    assert b.cli("sub", "t", "--group", "dash", "--timeout", "0.3").returncode == Exit.TIMEOUT
    pub = b.shell("seq 1 1000 | blipmq pub t --lines -")  # ten times the group's capacity
    assert pub.returncode == 0, pub.stderr
    assert b.metric("blipmq_messages_dropped_total", reason="no_consumer") == 900
    res = b.cli("sub", "t", "--group", "dash", "--count", "100", "--format", "lines")
    assert res.stdout.decode().split() == [str(i) for i in range(901, 1001)]


def test_a_stopped_subscriber_is_disconnected_as_a_slow_consumer(start_broker) -> None:
    b = start_broker({"queues": {"capacity": 64, "block_timeout_ms": 1000}})
    stuck = b.spawn("sub", "t", "--no-reconnect")
    b.wait_subscribers(1)
    stuck.send_signal(signal.SIGSTOP)
    try:
        listener = b.spawn_shell("blipmq sub t --count 20000 --format lines | wc -l")
        b.wait_subscribers(2)
        started = time.monotonic()
        # 20,000 lines of 1 KB: far more than the stopped reader's socket buffers hold
        pub = b.shell("for i in $(seq 1 20000); do printf '%01000d\\n' $i; done"
                      " | blipmq pub t --lines -", timeout=120)
        assert pub.returncode == 0, pub.stderr  # no publisher failed
        assert time.monotonic() - started < 60
        out, err = listener.communicate(timeout=60)
        assert out.split() == [b"20000"], err  # the live subscriber got everything
        assert b.metric("blipmq_connections_closed_total", reason="slow_consumer") == 1
        assert any("closed as a slow consumer" in line and "subscription on 't'" in line
                   for line in b.log)
    finally:
        stuck.send_signal(signal.SIGCONT)
    _, err = stuck.communicate(timeout=30)
    assert stuck.returncode == Exit.UNREACHABLE
    assert err.decode().count("\n") == 1 and "Traceback" not in err.decode()


def test_a_ping_flood_that_never_reads_cannot_grow_the_broker(start_broker) -> None:
    # before: 32 MB -> 1.5 GB in 14 s
    b = start_broker({"server": {"write_timeout_ms": 2000}})
    before = rss_kib(b.proc.pid)
    sock = raw_connect(b.port)
    ping = codec.encode(codec.Ping(b"p" * 65000)) * 16  # ~1 MB per send
    sock.settimeout(10)
    sent = 0
    try:
        for _ in range(4000):  # up to 4 GB of PONGs asked for
            sock.sendall(ping)
            sent += 1
    except (TimeoutError, ConnectionError):
        pass  # the broker stopped reading from us, then closed us
    finally:
        sock.close()
    assert sent < 4000
    b.wait_metric("blipmq_connections_closed_total", 1, reason="slow_consumer")
    assert rss_kib(b.proc.pid) - before < 64 * 1024  # bounded, not GBs
    assert b.cli("pub", "t", "still serving").returncode == 0


def test_qos1_publisher_that_never_reads_its_confirms_is_bounded(start_broker) -> None:
    # before: +3.5 MB/s for as long as it went on
    b = start_broker({"server": {"write_timeout_ms": 2000, "max_pending_bytes": 65536}})
    before = rss_kib(b.proc.pid)
    sock = raw_connect(b.port)
    record = codec.message_record(codec.Message("t", b"x", qos=1))
    frames = b"".join(codec.encode_publish([record], rid) for rid in range(1, 2001))
    sock.settimeout(10)
    sent = 0
    try:
        for _ in range(2000):  # up to 4 M PUB_ACKs owed
            sock.sendall(frames)
            sent += 1
    except (TimeoutError, ConnectionError):
        pass
    finally:
        sock.close()
    assert sent < 2000
    b.wait_metric("blipmq_connections_closed_total", 1, reason="slow_consumer")
    assert rss_kib(b.proc.pid) - before < 64 * 1024


def test_a_silent_connection_is_pinged_then_closed(start_broker) -> None:
    b = start_broker({"server": {"keepalive_ms": 300}})
    sock = raw_connect(b.port)
    sock.settimeout(10)
    dec = codec.Decoder(1 << 20)
    frames: list[codec.Frame] = []
    started = time.monotonic()
    while True:
        data = sock.recv(65536)
        if not data:
            break
        dec.feed(data)
        frames += dec.frames()
    assert [type(f) for f in frames] == [codec.Ping, codec.Goodbye]
    assert frames[1].code == codec.ErrorCode.TIMEOUT  # type: ignore[union-attr]
    assert time.monotonic() - started >= 0.55
    b.wait_metric("blipmq_connections_closed_total", 1, reason="keepalive_timeout")
    b.wait_metric("blipmq_connections_open", 0)


def publish_all(sock: socket.socket, batches: list[list[bytes]]) -> None:
    """Publish QoS 0 batches of message records, then wait until the broker has routed
    them all (the PONG of a PING sent after them)."""
    for records in batches:
        sock.sendall(codec.encode_publish(records, 0))
    sock.sendall(codec.encode(codec.Ping(b"", 9)))
    sock.settimeout(60)
    dec = codec.Decoder(1 << 24)
    while not any(isinstance(f, codec.Pong) for f in dec.frames()):
        data = sock.recv(1 << 20)
        assert data, "the publisher was closed"
        dec.feed(data)


def test_many_quiet_qos0_subscriptions_of_one_connection_hold_one_bound(start_broker) -> None:
    # Before queues.max_bytes_per_connection, each of 2,000 queues kept its own 8,192
    # messages: 8,000 messages of 6 bytes took the broker from 24 to 161 MB and nobody was
    # cut, as no queue was ever full.
    b = start_broker({"queues": {"block_timeout_ms": 1000}})
    sub = raw_connect(b.port)
    for n in range(2000):
        sub.sendall(codec.encode(codec.Subscribe("x", "", 0, 0, request_id=100 + n)))
    sub.sendall(codec.encode(codec.Ping(b"", 7)))
    dec = codec.Decoder(1 << 24)
    while not any(isinstance(f, codec.Pong) for f in dec.frames()):
        dec.feed(sub.recv(1 << 20))
    before = rss_kib(b.proc.pid)
    pub = raw_connect(b.port)
    records = [codec.message_record(codec.Message("x", b"%06d" % i, 0, 0)) for i in range(8000)]
    publish_all(pub, [records[i:i + 100] for i in range(0, len(records), 100)])
    grown = (rss_kib(b.proc.pid) - before) // 1024
    assert grown < 60, f"the broker grew by {grown} MB"
    # its queues filled together, held the publisher, and the reader that did not read was
    # cut after queues.block_timeout_ms
    assert b.metric("blipmq_connections_closed_total", reason="slow_consumer") == 1
    sub.close()
    pub.close()


def test_connections_each_under_their_bound_hold_the_total_together(start_broker) -> None:
    # Six connections that read nothing, each with a QoS 0 subscription to its own topic, and
    # 8 MB published to each: before queues.max_bytes_total each queue kept its own 8 MB
    # (under queues.capacity_bytes), 48 MB in all, and nobody was cut. The stalled ones are
    # cut one after the other, each after queues.block_timeout_ms: a second, so that the
    # reader, slowed by a busy machine, is not taken for one of them.
    b = start_broker({"queues": {"block_timeout_ms": 1000, "max_bytes_total": 1 << 20},
                      "server": {"max_pending_bytes": 64 * 1024}})
    reader = b.spawn_shell("blipmq sub 'x/#' --count 12000 --format lines | wc -l")
    b.wait_subscribers(1)
    stalled = []
    for n in range(6):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", b.port))
        sock.sendall(codec.encode(codec.Hello(codec.VERSION, "raw", 1)) +
                     codec.encode(codec.Auth("", 2)) +
                     codec.encode(codec.Subscribe(f"x/{n}", "", 0, 0, request_id=3)))
        stalled.append(sock)
    b.wait_subscribers(7)
    before = rss_kib(b.proc.pid)
    pub = raw_connect(b.port)
    publish_all(pub, [[
        codec.message_record(codec.Message(f"x/{j % 6}", b"%06d" % j + b"p" * 4000, 0, 0))
        for j in range(i, i + 60)] for i in range(0, 12000, 60)])
    grown = (rss_kib(b.proc.pid) - before) // 1024
    out, err = reader.communicate(timeout=60)
    assert out.split() == [b"12000"], err  # the connection that reads got everything
    assert grown < 30, f"the broker grew by {grown} MB"
    assert b.metric("blipmq_connections_closed_total", reason="slow_consumer") == 6
    assert b.metric("blipmq_queue_bytes") == 0
    for sock in [*stalled, pub]:
        sock.close()
