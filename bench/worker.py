"""One side of a benchmark, run as its own process by bench/run.py.

    worker.py sub ADDR TOPIC N            receive N messages, check order, report timings
    worker.py pub ADDR TOPIC N SIZE       publish N messages of SIZE bytes in batches
    worker.py pub1 ADDR TOPIC N BATCH     QoS 1: pipeline frames of BATCH, wait for confirms
    worker.py lat-sub ADDR TOPIC N        receive N timestamped messages, report latencies
    worker.py lat-pub ADDR TOPIC RATE N   publish N timestamped messages open-loop at RATE/s
    worker.py drain ADDR TOPIC N          consume N messages of durable group "g" with acks

Each prints one JSON line on stdout when done (sub workers print "ready" first).
Payloads start with an 8-byte sequence number (or send time), so losses are counted.
"""

from __future__ import annotations

import json
import struct
import sys
import time

from blipmq_cli.client import Client
from blipmq_server.protocol.codec import Message

SEQ = struct.Struct(">Q")


def sub(addr: str, topic: str, n: int) -> dict:
    client = Client(addr)
    subscription = client.subscribe(topic)
    print("ready", flush=True)
    received = 0
    expected = 0
    out_of_order = 0
    first = last = 0.0
    while received < n:
        batch = subscription.next_batch(60)
        if batch is None:
            break
        if not received:
            first = time.monotonic()
        for d in batch:
            seq = SEQ.unpack_from(d.payload)[0]
            if seq != expected:
                out_of_order += 1
            expected = seq + 1
        received += len(batch)
    last = time.monotonic()
    client.abort()
    return {"received": received, "first": first, "last": last, "gaps": out_of_order}


def pub(addr: str, topic: str, n: int, size: int) -> dict:
    client = Client(addr)
    filler = b"x" * (size - SEQ.size)
    chunk = 2000
    start = time.monotonic()
    for base in range(0, n, chunk):
        client.publish_many(
            [(topic, SEQ.pack(i) + filler) for i in range(base, min(base + chunk, n))]
        )
    client.flush(timeout=120)
    end = time.monotonic()
    client.close()
    return {"start": start, "end": end}


def pub1(addr: str, topic: str, n: int, batch: int) -> dict:
    """QoS 1: pipeline PUBLISH frames of ``batch`` messages, then wait for every confirm."""
    client = Client(addr)
    filler = b"x" * (100 - SEQ.size)
    start = time.monotonic()
    for base in range(0, n, batch):
        client.publish_many(
            [Message(topic, SEQ.pack(i) + filler, qos=1) for i in range(base, min(base + batch, n))]
        )
        client.check()
    client.wait_confirms(timeout=300)
    end = time.monotonic()
    confirmed = client.confirmed
    client.close()
    return {"start": start, "end": end, "confirmed": confirmed}


def lat_sub(addr: str, topic: str, n: int) -> dict:
    client = Client(addr)
    subscription = client.subscribe(topic)
    print("ready", flush=True)
    latencies: list[int] = []
    while len(latencies) < n:
        batch = subscription.next_batch(30)
        if batch is None:
            break
        now = time.monotonic_ns()
        latencies += [now - SEQ.unpack_from(d.payload)[0] for d in batch]
    client.abort()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1000  # noqa: E731
    return {"received": len(latencies), "p50_us": pick(0.50), "p99_us": pick(0.99),
            "max_us": latencies[-1] / 1000 if latencies else None}


def lat_pub(addr: str, topic: str, rate: int, n: int) -> dict:
    client = Client(addr)
    filler = b"x" * (100 - SEQ.size)
    interval = 1_000_000_000 // rate
    start = time.monotonic_ns()
    for i in range(n):
        due = start + i * interval
        while (now := time.monotonic_ns()) < due:
            if due - now > 200_000:
                time.sleep((due - now - 100_000) / 1e9)
        client.publish(topic, SEQ.pack(time.monotonic_ns()) + filler)
    client.flush()
    client.close()
    return {"sent": n}


def drain(addr: str, topic: str, n: int) -> dict:
    client = Client(addr)
    subscription = client.subscribe(topic, group="g", qos=1, credit=4096)
    print("ready", flush=True)
    received = 0
    start = time.monotonic()
    while received < n:
        batch = subscription.next_batch(60)
        if batch is None:
            break
        subscription.ack(*batch)
        received += len(batch)
    end = time.monotonic()
    client.close()
    return {"received": received, "start": start, "end": end}


def main() -> None:
    mode, addr, topic, *rest = sys.argv[1:]
    nums = [int(x) for x in rest]
    modes = {"sub": sub, "pub": pub, "pub1": pub1, "lat-sub": lat_sub, "lat-pub": lat_pub,
             "drain": drain}
    result = modes[mode](
        addr, topic, *nums
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
