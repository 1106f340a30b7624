"""Unrelated traffic while a durable group drains a big backlog; prints figures.

    .venv/bin/python bench/drain.py [--backlog 1000000] [--rate 1000] [--seconds 5] [--control]

A durable (QoS 1) group falls 1,000,000 100-byte messages behind. Then QoS 0 traffic on
another topic runs open-loop at 1,000 msg/s twice: once alone (the baseline) and once while
a consumer drains the group with acks. The drain reads the log from disk (far more than the
recent-records cache holds); the question is whether those reads stall everyone else.

The drain keeps the broker's event loop and the draining client busy: on a 2-core machine
that alone delays the latency clients' own processes. ``--control`` measures how much: the
same QoS 0 traffic against the idle broker while one busy-loop process per core runs.
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
    ap.add_argument("--control", action="store_true",
                    help="also measure the traffic with every core kept busy, broker idle")
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
            if args.control:
                report["cores_busy_broker_idle"] = busy_cores(broker.addr, args.rate, n)
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
            if args.control:
                control = report["cores_busy_broker_idle"]
                report["control_p99_increase_ms"] = round(
                    (control["p99_us"] - base["p99_us"]) / 1000, 2)
        finally:
            broker.stop()
    print(json.dumps(report, indent=2))


def busy_cores(addr: str, rate: int, n: int) -> dict:
    """The latency run while one bounded busy loop per core spins (ended by PID after)."""
    spin = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        return latency(addr, rate, n)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
