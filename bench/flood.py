"""What a flooding client costs the broker in memory. Prints figures, asserts none.

    .venv/bin/python bench/flood.py [--seconds 6] [--size 8192] [--connections 1]
                                    [--subscriptions 0 [--deliver 0]] [--keep-limit]
                                    [--fsync none]
                                    [--max-unwritten-bytes B]

Starts ``blipmq start`` (the pip install beside this interpreter) with MQTT on free loopback
ports and an empty data directory, then, from raw MQTT sockets:

- publish flood: QoS 0 PUBLISHes of ``--size`` bytes as fast as the socket takes them for
  ``--seconds`` s, from ``--connections`` sockets at once (one thread each); the broker's RSS
  and anonymous RSS are sampled every 0.1 s during the flood and every 0.25 s for 3 s after
  it (a PINGREQ answered on each socket says it read everything), and the peak and the last
  sample are printed, with how much was sent;
- ``--subscriptions N``: instead, N distinct QoS 1 filters in SUBSCRIBEs of 100 on a clean
  session, each SUBACK awaited; RSS before and after, per subscription, and how many the
  broker refused (0x80: ``server.max_subscriptions`` is raised to N for the run unless
  ``--keep-limit``). With ``--deliver M`` that client then takes (and PUBACKs) M QoS 1
  messages published one at a time to topics each of which one of its filters matches,
  while another client's PINGREQ round trip is timed: the broker's CPU per message and the
  round trip's median and maximum say what one client's subscriptions cost everyone.

Loopback only; it ends the broker it started, by PID.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ports import free_port, wait_port  # noqa: E402  (bench/ports.py)

from blipmq_server.mqtt import codec  # noqa: E402
from blipmq_server.mqtt.packets import Connect, PubAck, Publish, Subscribe  # noqa: E402


def memory(pid: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) in KiB."""
    rss = anon = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("RssAnon:"):
            anon = int(line.split()[1])
    return rss, anon


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def connect(port: int, client_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(codec.encode(Connect("MQTT", 4, True, 0, client_id)))
    if sock.recv(4)[:1] != b"\x20":
        raise RuntimeError("no CONNACK")
    return sock


def publish_flood(pid: int, port: int, seconds: float, size: int, connections: int) -> None:
    socks = [connect(port, f"flooder{i}") for i in range(connections)]
    chunk = codec.encode(Publish("flood/x", b"p" * size)) * max(1, (1 << 20) // (size + 12))
    sent = [0] * connections
    read = [0.0] * connections
    start = time.monotonic()
    deadline = start + seconds

    def flood(i: int) -> None:
        sock = socks[i]
        while time.monotonic() < deadline:  # bounded by --seconds
            sock.sendall(chunk)
            sent[i] += len(chunk)
        sock.sendall(b"\xc0\x00")  # PINGREQ: answered once everything before it was read
        sock.recv(2)
        read[i] = time.monotonic() - start

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    peak = peak_anon = 0
    while any(thread.is_alive() for thread in threads):  # bounded by --seconds and the reads
        rss, anon = memory(pid)
        peak, peak_anon = max(peak, rss), max(peak_anon, anon)
        time.sleep(0.1)
    read_s = max(read)
    for _ in range(12):  # 3 s after the flood
        rss, anon = memory(pid)
        peak, peak_anon = max(peak, rss), max(peak_anon, anon)
        time.sleep(0.25)
    for sock in socks:
        sock.close()
    total = sum(sent)
    print(f"sent {total / 1e6:,.0f} MB of {size}-byte QoS 0 PUBLISHes from {connections} "
          f"connection(s), read in {read_s:.1f} s ({total / 1e6 / read_s:,.0f} MB/s)")
    print(f"peak RSS {mib(peak)} (anonymous {mib(peak_anon)}); 3 s after: RSS {mib(rss)} "
          f"(anonymous {mib(anon)})")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def deliver(pid: int, port: int, sock: socket.socket, decoder: codec.Decoder, n: int,
            m: int) -> None:
    """``m`` QoS 1 messages, one at a time, to topics ``sub/<i>/x`` (filter ``i``'s alone),
    each taken and PUBACKed by ``sock``; another client pings meanwhile."""
    pub, pinger = connect(port, "publisher"), connect(port, "pinger")
    trips: list[float] = []
    done = threading.Event()

    def ping() -> None:  # bounded: until the deliveries are done
        while not done.is_set():
            start = time.monotonic()
            pinger.sendall(b"\xc0\x00")
            pinger.recv(2)
            trips.append(time.monotonic() - start)
            done.wait(0.02)

    pinging = threading.Thread(target=ping)
    before = cpu_s(pid)
    start = time.monotonic()
    pinging.start()
    got = 0
    for k in range(m):
        pub.sendall(codec.encode(Publish(f"sub/{k % n}/x", b"m", 1, False, False, k % 65535 + 1)))
        while True:  # bounded by the socket's timeout: its PUBLISH, PUBACKed
            packets = decoder.packets()
            if not packets:
                decoder.feed(sock.recv(65536))
                continue
            for packet in packets:
                if isinstance(packet, Publish):
                    sock.sendall(codec.encode(PubAck(packet.packet_id)))
                    got += 1
            if got > k:
                break
    seconds = time.monotonic() - start
    spent = cpu_s(pid) - before
    done.set()
    pinging.join()
    for s in (pub, pinger):
        s.close()
    trips.sort()
    print(f"{m:,} QoS 1 messages to it, one at a time: {seconds:.2f} s, broker CPU "
          f"{spent * 1e6 / m:,.0f} us a message; another client's PINGREQ round trip "
          f"median {trips[len(trips) // 2] * 1e3:.1f} ms, max {trips[-1] * 1e3:.1f} ms")


def subscription_flood(pid: int, port: int, n: int, m: int = 0) -> None:
    sock = connect(port, "subscriber")
    decoder = codec.Decoder()
    before = memory(pid)[1]
    refused = 0
    for first in range(0, n, 100):
        pid_ = first // 100 + 1
        sock.sendall(codec.encode(Subscribe(pid_, tuple(
            (f"sub/{i}/#", 1) for i in range(first, min(n, first + 100))))))
        acks: list[object] = []
        while not acks:  # bounded by the socket's timeout
            decoder.feed(sock.recv(65536))
            acks = decoder.packets()
        refused += sum(code == 0x80 for code in acks[0].codes)  # type: ignore[attr-defined]
    after = memory(pid)[1]
    print(f"{n:,} QoS 1 subscriptions ({refused:,} refused): anonymous RSS {mib(before)} -> "
          f"{mib(after)}, {(after - before) * 1024 / max(1, n - refused):,.0f} bytes each")
    if m:
        deliver(pid, port, sock, decoder, n, m)
    sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--connections", type=int, default=1,
                    help="publish flood: this many connections at once, each a thread")
    ap.add_argument("--subscriptions", type=int, default=0)
    ap.add_argument("--deliver", type=int, default=0,
                    help="with --subscriptions: this many QoS 1 messages to that client")
    ap.add_argument("--keep-limit", action="store_true",
                    help="leave server.max_subscriptions at its default")
    ap.add_argument("--fsync", default="none", help="wal.fsync for the run")
    ap.add_argument("--max-unwritten-bytes", type=int, default=None,
                    help="wal.max_unwritten_bytes (default: the broker's, 16 MiB)")
    args = ap.parse_args()
    blipmq = str(Path(sys.executable).with_name("blipmq"))
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        native, mqtt_port = free_port(), free_port()
        limit = "" if args.keep_limit or not args.subscriptions else (
            f"max_subscriptions = {max(args.subscriptions, 1)}\n")
        config = Path(tmp) / "blipmq.toml"
        config.write_text(
            f"[server]\nport = {native}\n{limit}[mqtt]\nenabled = true\nport = {mqtt_port}\n"
            f"[metrics]\nenabled = false\n[storage]\ndata_dir = \"{tmp}/data\"\n"
            f"[wal]\nfsync = \"{args.fsync}\"\n" + (
                "" if args.max_unwritten_bytes is None
                else f"max_unwritten_bytes = {args.max_unwritten_bytes}\n"))
        proc = subprocess.Popen([blipmq, "start", "--config", str(config)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            if not wait_port(mqtt_port, proc):
                raise SystemExit("the broker did not start")
            print(f"broker idle: RSS {mib(memory(proc.pid)[0])}")
            if args.subscriptions:
                subscription_flood(proc.pid, mqtt_port, args.subscriptions, args.deliver)
            else:
                publish_flood(proc.pid, mqtt_port, args.seconds, args.size,
                              args.connections)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
