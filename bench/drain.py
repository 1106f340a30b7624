"""Unrelated traffic while a durable group drains a big backlog; prints figures.

    .venv/bin/python bench/drain.py [--backlog 1000000] [--rate 1000] [--seconds 5]

A durable (QoS 1) group falls 1,000,000 100-byte messages behind. Then QoS 0 traffic on
another topic runs open-loop at 1,000 msg/s twice: once alone (the baseline) and once while
a consumer drains the group with acks. The drain reads the log from disk (far more than the
recent-records cache holds); the question is whether those reads stall everyone else.
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

from run import BLIPMQ, Blipmq, latency, ready, result, worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backlog", type=int, default=1_000_000)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=5)
    args = ap.parse_args()
    n = int(args.rate * args.seconds)
    report: dict = {"backlog": args.backlog, "rate": args.rate, "messages": n}
    with tempfile.TemporaryDirectory(prefix="blipmq-drain-", dir=os.getcwd()) as tmp:
        broker = Blipmq(Path(tmp), 'fsync = "interval_ms:200"\nretention_bytes = 0')
        try:
            env = {**os.environ, "BLIPMQ_ADDR": broker.addr}
            subprocess.run([BLIPMQ, "sub", "backlog", "--group", "g", "--qos", "1",
                            "--timeout", "0.2"], env=env, capture_output=True, check=False)
            result(worker("pub", broker.addr, "backlog", args.backlog, 100))
            time.sleep(1)
            report["baseline"] = latency(broker.addr, args.rate, n)
            drainer = worker("drain", broker.addr, "backlog", args.backlog)
            ready(drainer)
            started = time.monotonic()
            report["while_draining"] = latency(broker.addr, args.rate, n)
            overlap = time.monotonic() - started
            drained = result(drainer)
            took = drained["end"] - drained["start"]
            report["drain"] = {"received": drained["received"], "seconds": round(took, 2),
                               "msg_per_s": round(drained["received"] / took),
                               "covered_the_latency_run": took >= overlap}
            base, busy = report["baseline"], report["while_draining"]
            report["p99_increase_ms"] = round((busy["p99_us"] - base["p99_us"]) / 1000, 2)
        finally:
            broker.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
