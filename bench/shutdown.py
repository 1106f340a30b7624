"""Shutdown stress: SIGTERM under QoS 1 load with redelivery active; prints a summary.

    .venv/bin/python bench/shutdown.py [--trials 50] [--publishers 3]

Each trial, on a fresh data directory:
  1. start the broker with a short redelivery backoff (50 ms);
  2. a durable-group QoS 1 subscriber takes deliveries with a large window and never acks,
     so the redelivery loop keeps redelivering (and dead-lettering) while
  3. several publishers pipeline QoS 1 batches of 100 messages (a confirm wait every 10);
  4. once /metrics shows redeliveries and confirmed publishes, SIGTERM the broker;
  5. check: exit code 0, no "Traceback" on stderr, and every message a publisher saw
     confirmed is in the log (read back with the log's own reader).
Exits 1 if any trial failed. Unlike the other scripts under bench/, the checks gate: this
is a repeatable stress run, not a timing benchmark.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from blipmq_server.protocol import codec
from blipmq_server.wal.log import Log

PY = sys.executable
BLIPMQ = str(Path(PY).with_name("blipmq"))
_LISTENING = re.compile(r"listening on [\d.]+:(\d+), metrics on http://[\d.]+:(\d+)/metrics")

PUBLISHER = r"""
import sys
from blipmq_cli.client import Client
from blipmq_server.protocol.codec import Message
name, addr = sys.argv[1], sys.argv[2]
c = Client(addr)
sent = 0
try:
    for round_ in range(100_000):  # bounded: the broker's shutdown ends it long before
        c.publish_many(Message("t", f"{name}:{sent + i}".encode(), qos=1) for i in range(100))
        sent += 100
        if round_ % 10 == 9:
            c.wait_confirms()
finally:
    # confirms arrive in publish order on one connection: the first `confirmed` are stored
    print(c.confirmed, flush=True)
"""

SUBSCRIBER = r"""
import sys
from blipmq_cli.client import Client
c = Client(sys.argv[1])
sub = c.subscribe("t", group="g", qos=1, credit=60000)
print("subscribed", flush=True)
for _ in range(10_000_000):  # bounded; ends when the broker says GOODBYE
    if sub.next_batch(30) is None:
        break
"""


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def trial(work: Path, n: int, publishers: int) -> str | None:
    """One trial; None when it passed, else what went wrong."""
    data = work / f"data-{n}"
    cfg = work / f"broker-{n}.toml"
    cfg.write_text(
        "[server]\nport = 0\nshutdown_grace_ms = 3000\n[metrics]\nport = 0\n"
        "[delivery]\nretry_backoff_ms = 50\nretry_backoff_max_ms = 50\nmax_retries = 1000\n"
    )
    broker = subprocess.Popen(
        [BLIPMQ, "start", "--config", str(cfg), "--data-dir", str(data), "--log-format",
         "plain"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    lines: list[str] = []
    found = threading.Event()
    ports: list[int] = []

    def drain() -> None:
        assert broker.stderr is not None
        for raw in broker.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            m = _LISTENING.search(line)
            if m and not found.is_set():
                ports.extend((int(m.group(1)), int(m.group(2))))
                found.set()
        found.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    others: list[subprocess.Popen[str]] = []
    try:
        if not found.wait(30) or not ports:
            return "broker did not start:\n" + "\n".join(lines)
        port, mport = ports
        addr = f"127.0.0.1:{port}"
        sub = subprocess.Popen([PY, "-c", SUBSCRIBER, addr], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        others.append(sub)
        assert sub.stdout is not None
        if sub.stdout.readline().strip() != "subscribed":
            return "the subscriber did not subscribe"
        pubs = [subprocess.Popen([PY, "-c", PUBLISHER, f"p{i}", addr], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
                for i in range(publishers)]
        others += pubs
        deadline = time.monotonic() + 30
        while (metric(mport, "blipmq_messages_redelivered_total") < 1
               or metric(mport, "blipmq_wal_records_total") < 2000):
            if time.monotonic() > deadline:
                return "no redelivery under load within 30 s"
            time.sleep(0.02)
        broker.send_signal(signal.SIGTERM)
        try:
            code = broker.wait(60)
        except subprocess.TimeoutExpired:
            return "the broker did not exit within 60 s of SIGTERM"
        reader.join(10)
        confirmed: dict[str, int] = {}
        for i, p in enumerate(pubs):
            out, _ = p.communicate(timeout=30)
            confirmed[f"p{i}"] = int(out.split()[-1]) if out.split() else 0
        sub.communicate(timeout=30)
        log_text = "\n".join(lines)
        if code != 0 or "Traceback" in log_text:
            return f"exit {code}:\n{log_text[-3000:]}"
        wal = Log(str(data / "wal"))
        wal.open()
        stored = set()
        offset = 0
        for _ in range(100_000):  # bounded read loop
            records = wal.read(offset + 1, max_records=10_000, max_bytes=1 << 26)
            if not records:
                break
            offset = records[-1].offset
            stored.update(m.payload for m in
                          codec.decode_one(codec.encode_publish([r.body for r in records
                                                                 if r.kind == 1])).decoded())
        wal.close()
        missing = [f"{name}:{i}" for name, count in confirmed.items() for i in range(count)
                   if f"{name}:{i}".encode() not in stored]
        if missing:
            return f"{len(missing)} confirmed message(s) missing from the log, e.g. {missing[:3]}"
        if sum(confirmed.values()) == 0:
            return "no publish was confirmed"
        return None
    finally:
        for p in [broker, *others]:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--publishers", type=int, default=3)
    args = ap.parse_args()
    failures = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="blipmq-shutdown-", dir=os.getcwd()) as tmp:
        for n in range(args.trials):
            problem = trial(Path(tmp), n, args.publishers)
            if problem is not None:
                failures += 1
                print(f"trial {n + 1}: FAILED: {problem}", flush=True)
    clean = args.trials - failures
    print(f"{clean} of {args.trials} trials exited cleanly with every confirmed message "
          f"logged ({time.monotonic() - started:.0f} s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
