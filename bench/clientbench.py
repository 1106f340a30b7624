"""The Python clients side by side, 1 -> 1: BlipMQ's ``AsyncClient`` (Trio), its sync
``Client``, and nats-py's asyncio client against nats-server, in one run on loopback.

    .venv/bin/python bench/clientbench.py                    # 100,000 messages of 100 bytes
    .venv/bin/python bench/clientbench.py -n 2000 --latency-n 500 --json

For each client: a subscriber process (this script, ``--role sub``) and a publisher here,
each message sent with the client's one-message call (``publish``). Throughput: messages
over the time from the first publish to the subscriber's last receipt. Latency: one message
every 1/``--rate`` s carrying its send time (``time.time_ns``), one-way, p50/p99/max. The
brokers come from bench/compare.py (BlipMQ with its log on, QoS 0; nats-server core); a
missing nats-server is skipped with the reason. Prints figures; never fails on them.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from compare import find, outcome, start_broker, wait_ready  # bench/compare.py

CLIENTS = ("blipmq-async", "blipmq-sync", "nats-async")
TOPIC = "bench.t"  # a valid name for both brokers
_STAMP = struct.Struct(">q")


def payload(size: int, stamp: bool) -> bytes:
    pad = b"x" * max(0, size - _STAMP.size)
    return (_STAMP.pack(time.time_ns()) if stamp else b"\0" * _STAMP.size) + pad


# ----------------------------------------------------------------------------- subscriber


def subscriber(client: str, addr: str, count: int, stamped: bool) -> dict:
    """Receive ``count`` messages; report when the first and last came, and latencies."""
    lat: list[float] = []
    marks: dict[str, float] = {}

    def got(data: bytes, n: int) -> None:
        now = time.time_ns()
        if n == 1:
            marks["first"] = now / 1e9
        if stamped:
            lat.append((now - _STAMP.unpack_from(data)[0]) / 1e6)
        if n == count:
            marks["last"] = now / 1e9

    if client == "blipmq-sync":
        from blipmq_cli import Client

        with Client(addr) as c:
            sub = c.subscribe(TOPIC)
            print("ready", flush=True)
            n = 0
            for d in sub:
                n += 1
                got(d.payload, n)
                if n == count:
                    break
    elif client == "blipmq-async":
        import trio

        from blipmq_cli import AsyncClient

        async def run() -> None:
            async with AsyncClient(addr) as c:
                sub = await c.subscribe(TOPIC)
                print("ready", flush=True)
                n = 0
                async for d in sub:
                    n += 1
                    got(d.payload, n)
                    if n == count:
                        break

        trio.run(run)
    else:
        import asyncio

        import nats

        async def run_nats() -> None:
            nc = await nats.connect(f"nats://{addr}")
            done = asyncio.Event()
            seen = 0

            async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
                nonlocal seen
                seen += 1
                got(msg.data, seen)
                if seen == count:
                    done.set()

            await nc.subscribe(TOPIC, cb=on_msg, pending_msgs_limit=count + 1,
                               pending_bytes_limit=-1)
            await nc.flush()
            print("ready", flush=True)
            await done.wait()
            await nc.close()

        asyncio.run(run_nats())
    lat.sort()
    return {"first": marks["first"], "last": marks["last"], "got": count,
            "lat": [pct(lat, 0.5), pct(lat, 0.99), lat[-1]] if lat else None}


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


# ------------------------------------------------------------------------------ publisher


def publisher(client: str, addr: str, count: int, size: int, rate: float) -> float:
    """Publish ``count`` messages (at ``rate`` msg/s when given, else flat out); returns
    when the first went out (time.time)."""
    stamped = rate > 0
    gap = 1 / rate if rate else 0.0
    if client == "blipmq-sync":
        from blipmq_cli import Client

        with Client(addr) as c:
            began = time.time()
            for i in range(count):
                if gap:
                    pause(began + i * gap, time.sleep)
                c.publish(TOPIC, payload(size, stamped))
            c.flush()
        return began
    if client == "blipmq-async":
        import trio

        from blipmq_cli import AsyncClient

        async def run() -> float:
            async with AsyncClient(addr) as c:
                began = time.time()
                body = payload(size, False)
                for i in range(count):
                    if gap:
                        await trio.sleep(max(0.0, began + i * gap - time.time()))
                    await c.publish(TOPIC, payload(size, True) if stamped else body)
                await c.flush()
                return began

        return trio.run(run)
    import asyncio

    import nats

    async def run_nats() -> float:
        nc = await nats.connect(f"nats://{addr}")
        began = time.time()
        body = payload(size, False)
        for i in range(count):
            if gap:
                await asyncio.sleep(max(0.0, began + i * gap - time.time()))
            await nc.publish(TOPIC, payload(size, True) if stamped else body)
        await nc.flush()
        await nc.close()
        return began

    return asyncio.run(run_nats())


def pause(until: float, sleep: Callable[[float], None]) -> None:
    left = until - time.time()
    if left > 0:
        sleep(left)


# ----------------------------------------------------------------------------------- runs


def one_run(client: str, addr: str, count: int, size: int, rate: float) -> dict:
    sub = subprocess.Popen(
        [sys.executable, __file__, "--role", "sub", "--client", client, "--addr", addr,
         "-n", str(count), "--stamped", "1" if rate else "0"],
        stdout=subprocess.PIPE, text=True)
    try:
        wait_ready(sub)
        began = publisher(client, addr, count, size, rate)
        report = outcome(sub, timeout=600)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    report["began"] = began
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100, help="payload bytes (at least 8)")
    ap.add_argument("--latency-n", type=int, default=5_000)
    ap.add_argument("--rate", type=float, default=2_000.0, help="msg/s of the latency runs")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--stamped", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "sub":
        print(json.dumps(subscriber(args.client, args.addr, args.messages, args.stamped == "1")))
        return
    wanted = [c for c in args.clients.split(",") if c]
    unknown = sorted(set(wanted) - set(CLIENTS))
    if unknown:
        ap.error(f"unknown clients {unknown}; choose from {', '.join(CLIENTS)}")
    rows: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="clientbench-") as tmp:
        work = Path(tmp)
        for client in wanted:
            kind = "nats" if client.startswith("nats") else "blipmq"
            if kind == "nats" and find("nats-server") is None:
                skipped[client] = "nats-server is not installed (apt-get install nats-server)"
                continue
            broker = start_broker(kind, work)
            try:
                thr = one_run(client, broker.url, args.messages, args.size, 0)
                lat = one_run(client, broker.url, args.latency_n, args.size, args.rate)
            finally:
                broker.stop()
            seconds = thr["last"] - thr["began"]
            rows[client] = {"msg_s": round(args.messages / seconds),
                            "mb_s": round(args.messages * args.size / seconds / 1e6, 2),
                            "p50_ms": round(lat["lat"][0], 3), "p99_ms": round(lat["lat"][1], 3),
                            "max_ms": round(lat["lat"][2], 3)}
    meta = {"messages": args.messages, "size": args.size, "latency_n": args.latency_n,
            "rate": args.rate, "python": sys.version.split()[0]}
    if args.json:
        print(json.dumps({"meta": meta, "results": rows, "skipped": skipped}))
        return
    print(f"1 -> 1, {args.messages:,} messages of {args.size} B (throughput); "
          f"{args.latency_n:,} at {args.rate:g} msg/s (one-way latency)")
    print(f"{'client':<14} {'msg/s':>10} {'MB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for client, r in rows.items():
        print(f"{client:<14} {r['msg_s']:>10,} {r['mb_s']:>7} {r['p50_ms']:>8} "
              f"{r['p99_ms']:>8} {r['max_ms']:>8}")
    for client, why in skipped.items():
        print(f"{client:<14} skipped: {why}")
    if rows.get("blipmq-async") and rows.get("nats-async"):
        a, b = rows["blipmq-async"], rows["nats-async"]
        print(f"AsyncClient / nats-py: {a['msg_s'] / b['msg_s']:.2f}x the rate, "
              f"{a['p50_ms'] / b['p50_ms']:.2f}x the p50")


if __name__ == "__main__":
    main()
