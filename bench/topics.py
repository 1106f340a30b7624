"""Topic resolution micro-benchmark: the cost of a new topic as subscriptions grow; prints figures.

    .venv/bin/python bench/topics.py [--topics 1000] [--subscriptions 1,100,10000]

In-process, the broker core alone (no sockets, no log file): for each count of
subscriptions, exact filters and a wildcard mix, the CPU time per topic the broker has not
seen before, measured two ways:

  resolve   the core's routing decision for the topic (which queues it goes to);
  publish   a whole first publish to the topic: routing, the per-topic usage entry and the
            enqueue (with a log in memory and as many durable QoS 1 groups as
            subscriptions, so the durable groups' filters are matched too).

Each topic is resolved exactly once (all topics are distinct), so nothing comes from the
route cache. CPU time (``time.process_time``), so other busy processes on the machine
matter less than for wall-clock figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blipmq_server.broker.core import Broker, Limits
from blipmq_server.broker.storage import MemoryLog
from blipmq_server.protocol.codec import Message, RawMessage, Start, message_record

_CPU_BUDGET_S = 2.0  # per case: the old linear scan is slow, stop early and say so


def filters(kind: str, n: int) -> list[str]:
    """``n`` subscription filters: exact ones, or a mix of '+', '#' and exact ones."""
    if kind == "exact":
        return [f"dev/{i}/temp" for i in range(n)]
    out = []
    for i in range(n):
        r = i % 4
        if r == 0:
            out.append(f"dev/{i}/+")
        elif r == 1:
            out.append(f"dev/+/{i}")
        elif r == 2:
            out.append(f"site/{i}/#")
        else:
            out.append(f"dev/{i}/temp")
    return out


def topics(kind: str, n_subs: int, count: int) -> list[bytes]:
    """``count`` distinct topics, most matching one or two filters, some none."""
    out = []
    for j in range(count):
        k = j % max(n_subs, 1)
        r = j % 5
        if r == 0:
            t = f"dev/{k}/temp/{j}" if kind == "exact" else f"site/{k}/a/{j}"
        elif r == 1:
            t = f"dev/{k}/x{j}"
        elif r == 2:
            t = f"other/{j}/temp"
        elif r == 3:
            t = f"$dlq/dev/{k}/temp/{j}"  # broker-made: wildcards at the root skip it
        else:
            t = f"dev/{k}/temp" if j < n_subs else f"dev/{j}/temp"
        out.append(t.encode())
    return list(dict.fromkeys(out))  # distinct, in order


def raw(topic: bytes) -> RawMessage:
    record = message_record(Message(topic.decode(), b"x" * 100))
    return RawMessage(topic, 0, 0, 100, record)


def measure_resolve(kind: str, n_subs: int, count: int) -> dict:
    broker = Broker(Limits(capacity=1 << 20))
    for i, f in enumerate(filters(kind, n_subs)):
        broker.subscribe(1 + i % 64, f)
    resolve = broker.registry.resolve
    names = topics(kind, n_subs, count)
    matched = done = 0
    gc.collect()
    start = time.process_time()
    for t in names:
        matched += len(resolve(t, t[:1] == b"$").targets)
        done += 1
        if time.process_time() - start > _CPU_BUDGET_S:
            break
    cpu = time.process_time() - start
    return {"topics": done, "matched": matched, "us_per_topic": round(cpu / done * 1e6, 2)}


def measure_publish(kind: str, n_subs: int, count: int) -> dict:
    broker = Broker(Limits(capacity=1 << 20), log=MemoryLog())
    for i, f in enumerate(filters(kind, n_subs)):
        if i % 2:
            broker.subscribe(1 + i % 64, f)
        else:
            broker.subscribe(1 + i % 64, f, group=f"g{i}", qos=1, start=Start.LATEST)
    messages = [raw(t) for t in topics(kind, n_subs, count)]
    done = 0
    gc.collect()
    start = time.process_time()
    for m in messages:
        broker.publish((m,), 0, 0, internal=m.topic[:1] == b"$")
        done += 1
        if time.process_time() - start > _CPU_BUDGET_S:
            break
    cpu = time.process_time() - start
    return {"topics": done, "us_per_topic": round(cpu / done * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topics", type=int, default=1000, help="new topics per case")
    parser.add_argument("--subscriptions", default="1,100,10000",
                        help="comma-separated subscription counts")
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.subscriptions.split(",")):
        for kind in ("exact", "wildcard"):
            r = measure_resolve(kind, n, args.topics)
            p = measure_publish(kind, n, args.topics)
            rows.append({"subscriptions": n, "filters": kind, "resolve": r, "publish": p})
            print(f"{n:>6} subscriptions, {kind:<8}  resolve {r['us_per_topic']:>9.2f} us/topic"
                  f" ({r['topics']} topics)   first publish {p['us_per_topic']:>9.2f} us/topic"
                  f" ({p['topics']} topics; half the subscriptions durable QoS 1 groups)",
                  file=sys.stderr)
    print(json.dumps({"python": sys.version.split()[0], "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
