"""Many MQTT connections from one process, on raw sockets: the idle-connection and the
persistent-session workloads of bench/compare.py, for any MQTT 3.1.1 broker.

    mqttload.py hold     HOST:PORT N KEEPALIVE  N connections (clean session, KEEPALIVE s), each
                                                subscribed at QoS 0 to idle/<i>; prints
                                                "ready HELD" once all have their SUBACK, then
                                                sends each its PINGREQ every KEEPALIVE s until
                                                stdin closes
    mqttload.py sessions HOST:PORT N PREFIX     creates N persistent sessions: client id
                                                PREFIX<i>, clean session 0, one QoS 1
                                                subscription (sess/<i>), then DISCONNECT
    mqttload.py resume   HOST:PORT N PREFIX [STEP]
                                                connects again as PREFIX<i * STEP>, i < N, with
                                                clean session 0, and counts the CONNACKs saying
                                                "session present" (then DISCONNECT: kept)

Packets are made and read by BlipMQ's MQTT codec (blipmq_server/mqtt/codec.py): no network
thread or client object per connection, so a thousand connections cost this process little.
At most WINDOW handshakes are unanswered at a time (the brokers' accept queues stay short);
every wait has a deadline. 127.0.0.1 only. Each run ends with one JSON line.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from blipmq_server.mqtt.codec import (
    ConnAck,
    Connect,
    Decoder,
    Disconnect,
    PingReq,
    PingResp,
    SubAck,
    Subscribe,
    encode,
)

WINDOW = 200  # handshakes awaiting their answers at once
DEADLINE = 300.0  # s for all the handshakes of a run
_PINGREQ = encode(PingReq())
_DISCONNECT = encode(Disconnect())


class Conn:
    __slots__ = ("acked", "decoder", "i", "next_ping", "present", "sock", "subacked")

    def __init__(self, i: int, sock: socket.socket) -> None:
        self.i, self.sock = i, sock
        self.decoder = Decoder()
        self.acked = self.subacked = self.present = False
        self.next_ping = 0.0


def handshakes(host: str, port: int, n: int, first: Callable[[int], bytes],
               done: Callable[[Conn, object], bool],
               keep: bool) -> tuple[list[Conn], int]:
    """Connects n sockets, sends each ``first(i)`` and feeds its answers to ``done(conn,
    packet)`` (True: this connection's handshake is over). Returns the connections kept open
    (``keep``) and how many failed (refused, reset, or no answer by the deadline)."""
    sel = selectors.DefaultSelector()
    kept: list[Conn] = []
    failed = 0
    pending = 0
    deadline = time.monotonic() + DEADLINE

    def finish(c: Conn, ok: bool) -> None:
        nonlocal pending, failed
        sel.unregister(c.sock)
        pending -= 1
        if ok and keep:
            kept.append(c)
            return
        failed += not ok
        if ok:
            try:
                c.sock.sendall(_DISCONNECT)
            except OSError:
                pass
        c.sock.close()

    def pump(timeout: float) -> None:
        for key, _ in sel.select(timeout):
            c: Conn = key.data
            try:
                data = c.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                finish(c, False)
                continue
            c.decoder.feed(data)
            for packet in c.decoder.packets():
                if done(c, packet):
                    finish(c, True)
                    break

    i = 0
    while (i < n or pending) and time.monotonic() < deadline:
        while i < n and pending < WINDOW:
            try:
                sock = socket.create_connection((host, port), timeout=10)
                sock.sendall(first(i))
            except OSError:
                failed += 1
                i += 1
                continue
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, Conn(i, sock))
            pending += 1
            i += 1
        pump(0.05)
    for key in list(sel.get_map().values()):  # no answer by the deadline
        finish(key.data, False)
    failed += n - i
    sel.close()
    return kept, failed


def hold(host: str, port: int, n: int, keepalive: int) -> dict:
    def first(i: int) -> bytes:
        return (encode(Connect("MQTT", 4, True, keepalive, f"bench-idle-{i}"))
                + encode(Subscribe(1, ((f"idle/{i}", 0),))))

    def done(c: Conn, packet: object) -> bool:
        if isinstance(packet, ConnAck):
            c.acked = packet.code == 0
            c.next_ping = time.monotonic() + keepalive
        elif isinstance(packet, SubAck):
            c.subacked = packet.codes == (0,)
        return c.acked and c.subacked

    conns, _ = handshakes(host, port, n, first, done, keep=True)
    print(f"ready {len(conns)}", flush=True)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    pings = pongs = dropped = 0
    until = time.monotonic() + 3600  # bounded, whatever stdin does
    while not closed.is_set() and time.monotonic() < until:
        now = time.monotonic()
        for c in conns:
            if c.next_ping and now >= c.next_ping:  # as a client library: each keepalive
                try:
                    c.sock.send(_PINGREQ)
                    pings += 1
                except OSError:
                    pass
                c.next_ping += keepalive
        for key, _ in sel.select(0.2):
            c = key.data
            try:
                data = c.sock.recv(65536)
            except OSError:
                data = b""
            if not data:  # the broker closed it
                sel.unregister(c.sock)
                c.next_ping = 0.0
                dropped += 1
                continue
            c.decoder.feed(data)
            pongs += sum(isinstance(p, PingResp) for p in c.decoder.packets())
    for c in conns:
        try:
            c.sock.sendall(_DISCONNECT)
        except OSError:
            pass
        c.sock.close()
    return {"held": len(conns), "pings": pings, "pongs": pongs, "dropped": dropped}


def sessions(host: str, port: int, n: int, prefix: str) -> dict:
    def first(i: int) -> bytes:
        return (encode(Connect("MQTT", 4, False, 30, f"{prefix}{i}"))
                + encode(Subscribe(1, ((f"sess/{i}", 1),))))

    def done(c: Conn, packet: object) -> bool:
        if isinstance(packet, ConnAck):
            c.acked = packet.code == 0
        elif isinstance(packet, SubAck):
            c.subacked = packet.codes == (1,)
        return c.acked and c.subacked

    start = time.monotonic()
    _, failed = handshakes(host, port, n, first, done, keep=False)
    return {"created": n - failed, "seconds": round(time.monotonic() - start, 3)}


def resume(host: str, port: int, n: int, prefix: str, step: int = 1) -> dict:
    def first(i: int) -> bytes:
        return encode(Connect("MQTT", 4, False, 30, f"{prefix}{i * step}"))

    present = 0

    def done(c: Conn, packet: object) -> bool:
        nonlocal present
        if isinstance(packet, ConnAck):
            present += packet.code == 0 and packet.session_present
            return True
        return False

    start = time.monotonic()
    _, failed = handshakes(host, port, n, first, done, keep=False)
    return {"present": present, "failed": failed,
            "seconds": round(time.monotonic() - start, 3)}


def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # hold: 1,000 connections
    mode, addr, count, arg, *more = sys.argv[1:]
    host, port = addr.rsplit(":", 1)
    if host != "127.0.0.1":
        raise SystemExit("mqttload.py: 127.0.0.1 only")
    if mode == "hold":
        out = hold(host, int(port), int(count), int(arg))
    elif mode == "sessions":
        out = sessions(host, int(port), int(count), arg)
    elif mode == "resume":
        out = resume(host, int(port), int(count), arg, *map(int, more))
    else:
        raise SystemExit(f"mqttload.py: no mode {mode!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
