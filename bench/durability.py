"""What durability costs: fsync rate, QoS 1 group commit, log on/off, restart; prints figures.

    .venv/bin/python bench/durability.py [--records 1000000]

In one run, on the disk that holds the temporary directory:
  1. this disk's raw fsync rate: append 100 bytes + fsync, one message per fsync;
  2. QoS 1 publishes with fsync = always (group commit), 4 publishers pipelining;
  3. QoS 0, 1 publisher -> 1 subscriber, with the log on and off;
  4. restart with N records of 100 bytes in the log: time until the port accepts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import Blipmq, fanout, result, worker

from blipmq_server.protocol.codec import Message, message_record
from blipmq_server.wal.log import Log
from blipmq_server.wal.record import Kind


def raw_fsync(directory: Path, n: int = 1000) -> dict:
    path = directory / "fsync.probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            os.write(fd, b"x" * 100)
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    p50 = statistics.median(times)
    return {"fsyncs": n, "p50_ms": round(p50 * 1000, 3),
            "p99_ms": round(sorted(times)[int(0.99 * n)] * 1000, 3),
            "per_s": round(n / sum(times))}


def qos1(work: Path, publishers: int, n: int, batch: int) -> dict:
    broker = Blipmq(work, 'fsync = "always"', data="qos1-data")
    try:
        procs = [worker("pub1", broker.addr, f"q{i}", n, batch) for i in range(publishers)]
        got = [result(p) for p in procs]
    finally:
        broker.stop()
    elapsed = max(g["end"] for g in got) - min(g["start"] for g in got)
    confirmed = sum(g["confirmed"] for g in got)
    return {"publishers": publishers, "messages": publishers * n, "confirmed": confirmed,
            "batch": batch, "seconds": round(elapsed, 3),
            "confirmed_per_s": round(confirmed / elapsed)}


def qos0(work: Path, wal: str, n: int, data: str) -> dict:
    broker = Blipmq(work, wal, data=data)
    try:
        return fanout(broker.addr, 1, n)
    finally:
        broker.stop()


def restart(work: Path, records: int) -> dict:
    data = work / "restart-data"
    wal = Log(str(data / "wal"))
    wal.open()
    body = message_record(Message("restart/test", b"r" * 100))
    written = 0
    while written < records:
        for _ in range(min(10_000, records - written)):
            wal.append(Kind.MESSAGE, body, 0)
        batch = wal.take_batch()
        assert batch is not None
        batch.write(wal.disk, sync=False)
        wal.commit(batch)
        written += batch.records
    size = wal.total_bytes
    wal.close()
    broker = Blipmq(work, "", data="restart-data")
    ready = broker.ready_after
    broker.stop()
    return {"records": records, "log_bytes": size, "seconds_to_accept": round(ready, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--qos1-messages", type=int, default=50_000, help="per publisher")
    ap.add_argument("--qos0-messages", type=int, default=300_000)
    args = ap.parse_args()
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="blipmq-durability-", dir=os.getcwd()) as tmp:
        work = Path(tmp)
        report["raw_fsync"] = raw_fsync(work)
        report["qos1_always_4_publishers"] = qos1(work, 4, args.qos1_messages, 100)
        report["raw_fsync_after"] = raw_fsync(work, 300)
        rate = report["qos1_always_4_publishers"]["confirmed_per_s"]
        report["qos1_vs_one_fsync_per_message"] = round(rate / report["raw_fsync"]["per_s"], 1)
        on = qos0(work, "enabled = true", args.qos0_messages, "qos0-on")
        off = qos0(work, "enabled = false", args.qos0_messages, "qos0-off")
        report["qos0_log_on"], report["qos0_log_off"] = on, off
        report["qos0_on_vs_off"] = round(on["deliveries_per_s"] / off["deliveries_per_s"], 2)
        report["restart"] = restart(work, args.records)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
