"""The floor under an MQTT broker's latency on this machine: how much of BlipMQ's MQTT
latency at 2,000 msg/s is Trio's, and how much is the broker's.

    .venv/bin/python bench/floor.py                    # 3 rounds of 10,000 messages, ~2 min
    .venv/bin/python bench/floor.py --rounds 5 --kinds trio,blipmq

Beside BlipMQ's MQTT listener and mosquitto it runs two forwarders that are not brokers, only
the least a process must do to pass an MQTT PUBLISH from one socket to another: CONNACK to a
CONNECT, a SUBACK granting QoS 0 to a SUBSCRIBE, PINGRESP to a PINGREQ, and every PUBLISH
written as it came to every connection that subscribed (no topic matching, no log, no
queue, no limits). ``trio`` does it in a Trio task per connection (wait_readable, os.read,
os.write: the calls BlipMQ's reader makes); ``epoll`` in a plain epoll loop of the same
Python. The same paho-mqtt publisher and subscriber as ``bench/compare.py --workloads
mqtt-latency`` (bench/drive.py, one publisher at 2,000 msg/s, 100-byte QoS 0 messages, the
latency read from a timestamp in each payload) drive each in turn, in rounds, each run on
a new process. Prints p50 / p99 and the server's CPU a message (from /proc), and the
ratios to mosquitto's; never fails on the figures.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

_CONNACK = b"\x20\x02\x00\x00"
_PINGRESP = b"\xd0\x00"


def _split(buf: bytes) -> tuple[list[bytes], bytes]:
    """Whole MQTT packets at the start of ``buf``, and the rest."""
    packets: list[bytes] = []
    i = 0
    while len(buf) - i >= 2:
        length, mult, j = 0, 1, i + 1
        while True:
            if j >= len(buf) or j - i > 4:
                return packets, buf[i:]
            b = buf[j]
            j += 1
            length += (b & 0x7F) * mult
            mult <<= 7
            if not b & 0x80:
                break
        if len(buf) - j < length:
            break
        packets.append(buf[i:j + length])
        i = j + length
    return packets, buf[i:]


def _answer(packet: bytes) -> bytes:
    """What the forwarder writes back to a packet that is not a PUBLISH."""
    kind = packet[0] >> 4
    if kind == 1:
        return _CONNACK
    if kind == 12:
        return _PINGRESP
    if kind == 8:  # SUBSCRIBE: packet id, then (length, filter, QoS) per filter
        start = 2
        while packet[start - 1] & 0x80:
            start += 1
        at, granted = start + 2, 0
        while at + 2 <= len(packet):
            at += 2 + int.from_bytes(packet[at:at + 2], "big") + 1
            granted += 1
        body = packet[start:start + 2] + b"\x00" * granted
        return bytes((0x90, len(body))) + body  # fewer than 126 filters: one length byte
    return b""


def _forward(fd: int, buf: bytes, subscribers: list[int]) -> bytes:
    """The whole packets in what came on ``fd``: each PUBLISH written to every subscriber,
    anything else answered; the rest, an unfinished packet, is returned."""
    packets, rest = _split(buf)
    for packet in packets:
        if packet[0] >> 4 == 3:
            for sub in subscribers:
                os.write(sub, packet)
            continue
        if packet[0] >> 4 == 8:
            subscribers.append(fd)
        if reply := _answer(packet):
            os.write(fd, reply)
    return rest


def serve_epoll(port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    listener.setblocking(False)
    poll = select.epoll()
    poll.register(listener.fileno(), select.EPOLLIN)
    conns: dict[int, socket.socket] = {}
    rests: dict[int, bytes] = {}
    subscribers: list[int] = []
    print("ready", flush=True)
    while True:
        for fd, _ in poll.poll():
            if fd == listener.fileno():
                conn, _ = listener.accept()
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[conn.fileno()] = conn
                rests[conn.fileno()] = b""
                poll.register(conn.fileno(), select.EPOLLIN)
                continue
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                poll.unregister(fd)
                conns.pop(fd).close()
                if fd in subscribers:
                    subscribers.remove(fd)
                continue
            rests[fd] = _forward(fd, rests[fd] + data, subscribers)


def serve_trio(port: int) -> None:
    import trio

    subscribers: list[int] = []

    async def connection(stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fd = stream.socket.fileno()
        rest = b""
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                rest = _forward(fd, rest + data, subscribers)
        finally:
            if fd in subscribers:
                subscribers.remove(fd)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_tcp, connection, port)
            print("ready", flush=True)

    trio.run(main)


def measure(kinds: list[str], rounds: int, count: int, rate: int) -> dict[str, list[dict]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compare  # bench/compare.py: the brokers, the paho workers and fanout
    from ports import free_port

    work = Path(tempfile.mkdtemp(prefix="floor-"))
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for turn in range(rounds):
            for kind in kinds[turn % len(kinds):] + kinds[:turn % len(kinds)]:
                os.sync()
                if kind in ("trio", "epoll"):
                    port = free_port()
                    server = compare.Broker(kind, [sys.executable, __file__, "--serve", kind,
                                                   str(port)], port, work)
                else:
                    server = compare.start_broker(kind, work, mqtt=True)
                try:
                    time.sleep(0.5)  # as compare.py's latency rounds: start-up settles
                    r = compare.fanout(server, "paho", 1, count, 100, rate=rate,
                                       url=server.mqtt_url)
                finally:
                    server.stop()
                runs[kind].append(r)
                print(f"  {kind}: p50 {r['p50_us']} us, p99 {r['p99_us']} us, "
                      f"{r['cpu_us_per_delivery']} us CPU a message, lost {r['lost']}",
                      file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


def report(runs: dict[str, list[dict]]) -> str:
    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    base = "mosquitto" if "mosquitto" in runs else None
    lines = ["| server | p50, us | p99, us | CPU a message, us | p50 / mosquitto's | lost |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind in runs:
        ratio = f"{median(kind, 'p50_us') / median(base, 'p50_us'):.2f}x" if base else "-"
        lines.append(f"| {kind} | {median(kind, 'p50_us'):,.1f} | {median(kind, 'p99_us'):,.1f}"
                     f" | {median(kind, 'cpu_us_per_delivery'):,.1f} | {ratio} | "
                     f"{sum(r['lost'] for r in runs[kind])} |")
    lines.append("(medians of " + ", ".join(f"{k}: {len(v)}" for k, v in runs.items())
                 + " runs; every run's p50: " + "; ".join(
                     f"{k} " + " / ".join(f"{r['p50_us']:.0f}" for r in v)
                     for k, v in runs.items()) + ")")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        (serve_trio if sys.argv[2] == "trio" else serve_epoll)(int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="epoll,trio,blipmq,mosquitto",
                   help="servers, in the order of the first round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", type=int, default=10_000, help="messages a run")
    p.add_argument("--rate", type=int, default=2000, help="messages a second")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - {"epoll", "trio", "blipmq", "mosquitto"}
    if unknown:
        p.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    if "mosquitto" in kinds and shutil.which("mosquitto") is None and not Path(
            "/usr/sbin/mosquitto").exists():
        print("mosquitto is not installed (apt-get install mosquitto): left out",
              file=sys.stderr)
        kinds.remove("mosquitto")
    print(report(measure(kinds, args.rounds, args.count, args.rate)))


if __name__ == "__main__":
    main()
