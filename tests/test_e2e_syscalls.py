"""The system calls a message costs, seen with strace: the client's publish and the
broker's reader. At 2,000 msg/s every call is on the latency path (docs/PERFORMANCE.md).

strace comes from scripts/test-deps (run by `make test`); without it these tests fail and
say so.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from test_e2e_wal_fsync import attach, strace, traced

from blipmq_cli.client import Client
from blipmq_server.mqtt.packets import PingReq, PingResp
from tests.mqttpeer import Raw

_RESULT = re.compile(r"^(?:\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)(.*)$")


def calls(trace: str, name: str, contains: str = "") -> list[str]:
    """Completed calls of ``name`` whose arguments hold ``contains``, with their results."""
    found = []
    for line in trace.splitlines():
        m = _RESULT.match(line)
        if m and m.group(1) == name and contains in m.group(2):
            found.append(f"{m.group(3)}{m.group(4)}")
    return found


def test_a_publish_costs_the_client_one_look_and_one_send(start_broker, tmp_path: Path) -> None:
    """One publish at a time: a poll that does not wait (did PINGs or a refusal come?),
    then the send. The client used to switch the socket's mode twice per publish (ioctl
    FIONBIO) and poll before every send, as Python sockets with a timeout do: five calls
    instead of two. Then it tried a read before each send, which failed (EAGAIN) nearly
    every time: a raised error costs the publisher 4x what a poll does."""
    b = start_broker()
    n = 300
    script = (f"from blipmq_cli.client import Client\n"
              f"c = Client({b.addr!r})\n"
              f"for i in range({n}):\n"
              f"    c.publish('t', b'reading %d' % i)\n"
              f"c.close()\n")
    out = tmp_path / "client.strace"
    run = subprocess.run(
        [strace(), "-f", "-o", str(out), "-e", "trace=ioctl,poll,ppoll,recvfrom,sendto",
         sys.executable, "-c", script],
        capture_output=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr.decode()
    trace = out.read_text()
    sends = calls(trace, "sendto")
    assert n <= len(sends) <= n + 5  # HELLO, AUTH, the PING of close(), GOODBYE
    reads = calls(trace, "recvfrom")
    assert len(reads) <= 10, reads  # WELCOME, AUTH_OK, PONG: nothing else came
    assert len(calls(trace, "ioctl", "FIONBIO")) <= 3  # set once, at connect
    polls = calls(trace, "poll") + calls(trace, "ppoll")
    looks = [p for p in polls if "Timeout" in p]  # poll(..., 0) that found nothing
    assert n <= len(looks) <= n + 10, (len(looks), n)
    assert len(polls) - len(looks) <= 10, polls  # the handshake's and close()'s waits only


def test_the_broker_waits_before_it_reads(start_broker, tmp_path: Path) -> None:
    """Each chunk a connection sends is read once, after epoll said it came: the broker used
    to try another read after every chunk, which failed (EAGAIN) whenever the client had
    nothing more to send yet, before it went back to waiting."""
    b = start_broker()
    out = tmp_path / "broker.strace"
    rounds = 200
    with traced(b.proc.pid, out, "read,recvfrom", "-yy"):
        with Client(b.addr) as c:
            for i in range(rounds):  # a publish, then a round trip: the link falls quiet
                c.publish("t", b"m %d" % i)
                c.ping()
        assert b.stop() == 0
    # -yy names each descriptor; the client's TCP connections, not trio's wake-up socketpair
    # or the log's files
    trace = out.read_text()
    tcp = [r for name in ("read", "recvfrom") for r in calls(trace, name, "TCP")]
    assert len(tcp) >= rounds, trace[-2000:]
    failed = [r for r in tcp if "EAGAIN" in r]
    assert len(failed) <= rounds // 20, (len(failed), len(tcp))


def test_a_delivery_takes_the_broker_one_turn_of_its_loop(start_broker, tmp_path: Path) -> None:
    """A message routed to an idle subscriber is written in the publisher's reader's turn
    (``Session.deliver_now``): one wait for events (epoll_wait) per message. It used to go
    to the subscriber's writer task through another turn of trio's run loop, one more
    epoll_wait per message."""
    b = start_broker()
    out = tmp_path / "broker.strace"
    rounds = 200
    with traced(b.proc.pid, out, "epoll_wait,epoll_pwait,write,sendto"):
        with Client(b.addr) as sub_client, Client(b.addr) as pub:
            subscription = sub_client.subscribe("t")
            for i in range(rounds):  # one message at a time: each finds the broker idle
                pub.publish("t", b"m %d" % i)
                batch = subscription.next_batch(5)
                assert batch is not None and [d.payload for d in batch] == [b"m %d" % i]
        assert b.stop() == 0
    trace = out.read_text()  # set-up, stop and the log's flushes: a few dozen waits
    waits = calls(trace, "epoll_wait") + calls(trace, "epoll_pwait")
    writes = calls(trace, "write") + calls(trace, "sendto")
    assert len(writes) >= rounds, trace[-2000:]
    assert len(waits) <= rounds * 1.5, (len(waits), rounds)  # the old way: 2.2 a message


def test_an_idle_broker_wakes_about_twice_a_second(start_broker, tmp_path: Path) -> None:
    """With nothing in flight, the redelivery ticker dozes: it looks once a second, not
    ten times. It was most of an idle broker's wake-ups (about 12 epoll_waits a second) and
    of its CPU (5 ms a second here, 1 ms since)."""
    b = start_broker()
    with Client(b.addr) as c:
        c.subscribe("idle/t", group="g", qos=1)  # a cursor, nothing in flight
        out = tmp_path / "idle.strace"
        tracer = attach(b.proc.pid, out, "epoll_wait,epoll_pwait")
        try:
            time.sleep(3)  # the window measured: nothing happens in it
        finally:
            tracer.terminate()
            tracer.wait(10)
    trace = out.read_text()
    waits = calls(trace, "epoll_wait") + calls(trace, "epoll_pwait")
    assert len(waits) <= 3 * 4, (len(waits), trace[-2000:])


def test_a_delivery_taken_while_the_ticker_dozes_is_redelivered_on_time(start_broker) -> None:
    """The first delivery taken after a quiet spell wakes the dozing ticker at once, so an
    unacked one comes again after retry_backoff_ms (300 ms), give or take a 100 ms tick;
    left dozing, the ticker would first look up to a second after the delivery."""
    b = start_broker({"delivery": {"retry_backoff_ms": 300, "retry_backoff_max_ms": 300}})
    with Client(b.addr) as sub_client, Client(b.addr) as pub:
        subscription = sub_client.subscribe("doze/t", group="g", qos=1)
        for i in range(3):
            time.sleep(1.2)  # nothing in flight for more than a doze: the ticker dozes
            pub.publish("doze/t", b"m %d" % i, qos=1)
            first = subscription.next_batch(5)
            took = time.monotonic()
            assert first is not None and [d.payload for d in first] == [b"m %d" % i]
            again = subscription.next_batch(5)  # not acked: redelivered
            late = time.monotonic() - took
            assert again is not None and [d.payload for d in again] == [b"m %d" % i]
            assert 0.25 <= late <= 0.3 + 0.35, (i, late)
            subscription.ack(*again)


def test_a_ping_takes_the_broker_one_turn_of_its_loop(start_broker, tmp_path: Path) -> None:
    """A PINGREQ (MQTT) or a PING (native) is answered in the reader's turn when the writer
    has nothing queued (``Session.reply_now``): one wait for events per ping. The answer
    used to go to the writer task through another turn of trio's run loop: two waits, and
    about 50 us more CPU, a ping (1,000 idle MQTT clients ping 33 times a second)."""
    b = start_broker({"mqtt": {"enabled": True, "port": 0}})
    out = tmp_path / "broker.strace"
    rounds = 200
    with traced(b.proc.pid, out, "epoll_wait,epoll_pwait,write,sendto"):
        device = Raw(b.mqtt_port)
        device.connect(keepalive=60)
        with Client(b.addr) as native:
            for _ in range(rounds):  # one at a time: each finds the broker idle
                device.send(PingReq())
                assert isinstance(device.recv(), PingResp)
                native.ping()
        device.close()
        assert b.stop() == 0
    trace = out.read_text()
    waits = calls(trace, "epoll_wait") + calls(trace, "epoll_pwait")
    writes = calls(trace, "write") + calls(trace, "sendto")
    assert len(writes) >= 2 * rounds, trace[-2000:]
    assert len(waits) <= 2 * rounds * 1.3, (len(waits), 2 * rounds)  # the old way: 2 a ping
