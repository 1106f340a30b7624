"""Broker memory with a durable group 1,000,000 messages behind; prints figures.

    .venv/bin/python bench/backlog.py [--messages 1000000]

Creates a durable (QoS 1) group, publishes N 100-byte messages that nobody consumes, and
reads the broker's RSS before, after, and while a consumer works through the backlog.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import BLIPMQ, Blipmq, result, worker

from blipmq_cli.client import Client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=1_000_000)
    args = ap.parse_args()
    report: dict = {"messages": args.messages}
    with tempfile.TemporaryDirectory(prefix="blipmq-backlog-", dir=os.getcwd()) as tmp:
        broker = Blipmq(Path(tmp), 'fsync = "interval_ms:200"\nretention_bytes = 0')
        try:
            env = {**os.environ, "BLIPMQ_ADDR": broker.addr}
            subprocess.run([BLIPMQ, "sub", "backlog", "--group", "g", "--qos", "1",
                            "--timeout", "0.2"], env=env, capture_output=True)
            report["rss_before_mb"] = round(broker.rss_mb(), 1)
            result(worker("pub", broker.addr, "backlog", args.messages, 100))
            time.sleep(1)
            report["rss_with_backlog_mb"] = round(broker.rss_mb(), 1)
            peak = 0.0
            consumed = 0
            started = time.monotonic()
            with Client(broker.addr) as client:
                sub = client.subscribe("backlog", group="g", qos=1)
                while consumed < min(args.messages, 200_000):
                    batch = sub.next_batch(30)
                    assert batch is not None
                    sub.ack(*batch)
                    consumed += len(batch)
                    if consumed % 20_000 < len(batch):
                        peak = max(peak, broker.rss_mb())
            elapsed = time.monotonic() - started
            report["consumed_with_acks"] = consumed
            report["consume_msg_per_s"] = round(consumed / elapsed)
            report["rss_peak_while_consuming_mb"] = round(peak, 1)
        finally:
            broker.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
