"""How fast the analytics path is: the shared record decoder into Arrow batches, and
`blipmq export` end to end.

    .venv/bin/python bench/analytics.py decode [--records N] [--runs R]
    .venv/bin/python bench/analytics.py export [--mb 200] [--devices 8] [--runs R]
    .venv/bin/python bench/analytics.py phases [--mb 200] [--devices 8]

``decode`` builds one segment of N records with 100-byte payloads (the log's own encoder) and
times, in this process, ``wal.reader.check`` plus ``spark_tools.batches.segment_batches``
(what each Spark task does), and for comparison the per-record path of ``blipmq wal cat``
(``record.decode_at`` + ``message.message_from_record``). ``export`` writes ``--devices``
data directories holding ``--mb`` MB of such records in all, times the single-process decode
of the same files, then ``blipmq export`` on them (local Spark on every core), and prints
rows/s and the ratio of the two. ``phases`` runs the same export in this process
(``spark_tools.job.export``) and prints each phase's wall time, and the CPU time of the whole
process tree (this process, Spark's JVM, its Python workers) for Spark's start and for the
export: on a shared machine CPU seconds move less than wall seconds. Medians of ``--runs``;
the machine is shared, so repeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from blipmq_server.protocol.message import Message, message_from_record, message_record
from blipmq_server.wal import reader
from blipmq_server.wal import record as rec
from spark_tools.batches import segment_batches

TS = 1_795_363_200_000


def segment(records: int, first: int = 1, device: int = 0) -> bytes:
    bodies = [message_record(Message(f"sensors/dev{device}/t{i % 40}", os.urandom(100),
                                     i % 2)) for i in range(records)]
    return rec.header(first) + b"".join(rec.encode_many(1, first, TS, bodies))


def decode_arrow(data: bytes) -> int:
    checked = reader.check(data, "00000000000000000001.seg")
    return sum(b.num_rows for b in segment_batches(data, checked, "d", "s"))


def decode_python(data: bytes) -> int:
    checked = reader.check(data, "00000000000000000001.seg")
    n = 0
    for r in reader.records(data, checked):
        message_from_record(r.body)
        n += 1
    return n


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def decode(records: int, runs: int) -> None:
    data = segment(records)
    print(f"one segment: {records:,} records, {len(data) / 1e6:.1f} MB "
          f"({len(data) / records:.0f} bytes each, 100-byte payloads)")
    for name, fn in (("check + Arrow batches (the Spark source)", decode_arrow),
                     ("check + per-record decode (wal cat)", decode_python)):
        times = [timed(fn, data) for _ in range(runs)]
        rates = sorted(records / t for t in times)
        print(f"{name}: median {statistics.median(rates):,.0f} records/s "
              f"(min {rates[0]:,.0f}, max {rates[-1]:,.0f}, {runs} runs)")


def fleet(where: str, mb: int, devices: int) -> tuple[list[str], int]:
    """``devices`` data directories holding ``mb`` MB of records in all."""
    per_device = mb * 1_000_000 // devices // 156
    paths = []
    for d in range(devices):
        wal = os.path.join(where, "fleet", f"device-{d}", "wal")
        os.makedirs(wal)
        path = os.path.join(wal, "00000000000000000001.seg")
        with open(path, "wb") as f:
            f.write(segment(per_device, device=d))
        paths.append(path)
    total = per_device * devices
    size = sum(os.path.getsize(p) for p in paths)
    print(f"{devices} devices, {total:,} records, {size / 1e6:.0f} MB")
    return paths, total


def single(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            decode_arrow(f.read())


def export(mb: int, devices: int, runs: int) -> None:
    where = tempfile.mkdtemp(prefix="blipmq-bench-")
    try:
        paths, total = fleet(where, mb, devices)
        one = statistics.median(timed(single, paths) for _ in range(runs))
        print(f"single-process decode: {one:.1f} s, {total / one:,.0f} records/s")
        blipmq = os.path.join(os.path.dirname(sys.executable), "blipmq")
        walls = []
        for i in range(runs):
            out = os.path.join(where, f"out-{i}")
            start = time.perf_counter()
            res = subprocess.run([blipmq, "export", os.path.join(where, "fleet"), "--output",
                                  out], capture_output=True, env={**os.environ,
                                                                  "SPARK_LOCAL_IP": "127.0.0.1"})
            walls.append(time.perf_counter() - start)
            if res.returncode:
                sys.exit(res.stderr.decode())
            shutil.rmtree(out)
        wall = statistics.median(walls)
        print(f"blipmq export: median {wall:.1f} s ({', '.join(f'{w:.1f}' for w in walls)}), "
              f"{total / wall:,.0f} rows/s, {wall / one:.2f}x the single-process decode")
    finally:
        shutil.rmtree(where, ignore_errors=True)


def tree_cpu() -> float:
    """CPU seconds of this process and every descendant (reaped children included)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[tuple[int, float]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        cpu = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        parents.setdefault(int(fields[1]), []).append((int(name), cpu))
    mine = os.times()
    total, todo = mine.user + mine.system, [os.getpid()]
    while todo:
        for child, cpu in parents.get(todo.pop(), []):
            total += cpu
            todo.append(child)
    return total


def phases(mb: int, devices: int) -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from spark_tools import job

    where = tempfile.mkdtemp(prefix="blipmq-bench-")
    try:
        paths, total = fleet(where, mb, devices)
        cpu0 = time.process_time()
        one = timed(single, paths)
        print(f"single-process decode: {one:.1f} s wall, {time.process_time() - cpu0:.1f} s "
              f"CPU, {total / one:,.0f} records/s")
        start, cpu = time.perf_counter(), tree_cpu()
        spark = job.session(None, (), job.spark_log())
        started, cpu_started = time.perf_counter(), tree_cpu()
        try:
            done = job.export(spark, job.ExportOptions((os.path.join(where, "fleet"),),
                                                       os.path.join(where, "out")))
        finally:
            end, cpu_end = time.perf_counter(), tree_cpu()
            spark.stop()
        assert done.rows == total, (done.rows, total)
        print(f"Spark start: {started - start:.1f} s wall, {cpu_started - cpu:.1f} s CPU")
        for name, seconds in done.timings.items():
            print(f"  {name}: {seconds:.1f} s")
        work = end - started
        print(f"export without the start: {work:.1f} s wall, {cpu_end - cpu_started:.1f} s CPU, "
              f"{total / work:,.0f} rows/s, {work / one:.2f}x the single-process decode")
        print(f"with the start: {end - start:.1f} s, {total / (end - start):,.0f} rows/s, "
              f"{(end - start) / one:.2f}x")
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("decode", "export", "phases"))
    p.add_argument("--records", type=int, default=400_000)
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    if args.what == "decode":
        decode(args.records, args.runs)
    elif args.what == "export":
        export(args.mb, args.devices, args.runs)
    else:
        phases(args.mb, args.devices)


if __name__ == "__main__":
    main()
