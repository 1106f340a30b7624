"""Retained-value lookup micro-benchmark: what one filter of a SUBSCRIBE costs as the retained
values grow; prints figures.

    .venv/bin/python bench/retained.py [--values 10000,100000]

In-process, the core's retained store alone (``broker/retained.py``): N values on topics
``sensors/hall/r<i>``, then ``Retained.matching`` (what a new subscription, or one made
again, asks for) with a filter that matches none of them, one, and all of them (``#``, and
``sensors/+/+``). Milliseconds of CPU per call (``time.process_time``), so other busy
processes on the machine matter less than for wall-clock figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blipmq_server.broker.retained import Retained
from blipmq_server.protocol.codec import Message, message_record

_CASES = (("none", "cmd/hall/#"), ("one", "sensors/hall/r77"), ("all", "#"),
          ("all", "sensors/+/+"))
_CPU_S = 0.5  # per case: calls are repeated for about this long


def store(n: int) -> Retained:
    retained = Retained(1 << 40, 1 << 50)
    for i in range(n):
        topic = f"sensors/hall/r{i}"
        record = message_record(Message(topic, b"v", 0, 0, retain=True))
        retained.put(topic.encode(), i + 1, 1000 + i, record, i + 1)
    return retained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="10000,100000",
                        help="retained values, comma-separated counts")
    args = parser.parse_args()
    print("| values | filter | matches | ms per call |")
    print("|---:|---|---:|---:|")
    for n in (int(x) for x in args.values.split(",")):
        retained = store(n)
        for _, topic_filter in _CASES:
            calls = 0
            start = time.process_time()
            while True:
                found = retained.matching(topic_filter, 5000)
                calls += 1
                spent = time.process_time() - start
                if spent >= _CPU_S:
                    break
            print(f"| {n:,} | `{topic_filter}` | {len(found):,} | {spent / calls * 1000:.3f} |")


if __name__ == "__main__":
    main()
