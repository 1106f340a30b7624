"""One broker, its own clients: throughput, fan-out, latency, CLI pipe; prints figures.

    .venv/bin/python bench/run.py [--messages N] [--skip-mosquitto]

Starts its own brokers on loopback (BlipMQ, and Debian's mosquitto when installed), runs:
  1. client library, 1 publisher -> 1 subscriber, 100-byte QoS 0 messages, batched;
  2. 1 publisher -> 4 subscribers (deliveries/s);
  3. latency at an open-loop 2,000 msg/s (p50, p99);
  4. CLI pipe: `blipmq pub --lines -` -> `blipmq sub --count` vs `mosquitto_pub -l` ->
     `mosquitto_sub -C`, 200,000 lines, in the same run;
  5. broker idle RSS and one-shot `blipmq pub t hello` wall time.
Every worker runs in its own process. Nothing is lost is checked, not assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port, wait_port  # bench/ports.py

HERE = Path(__file__).resolve().parent
PY = sys.executable
BLIPMQ = str(Path(PY).with_name("blipmq"))
WORKER = str(HERE / "worker.py")


class Blipmq:
    def __init__(self, workdir: Path, wal: str = "", data: str = "data") -> None:
        """A broker for benchmarks; ``wal`` is extra TOML for the [wal] section."""
        self.port = free_port()
        cfg = workdir / "bench.toml"
        cfg.write_text(
            f"[server]\nport = {self.port}\n[metrics]\nenabled = false\n"
            "[queues]\ncapacity = 65536\noverflow = \"block\"\nblock_timeout_ms = 30000\n"
            f"[wal]\n{wal}\n"
        )
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [BLIPMQ, "start", "--config", str(cfg), "--data-dir", str(workdir / data),
             "--log-format", "plain", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        if not wait_port(self.port):
            raise SystemExit(f"nothing listens on port {self.port}")
        self.ready_after = time.monotonic() - self.started
        self.addr = f"127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def worker(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, WORKER, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise SystemExit(f"worker failed to subscribe: {line!r}")


def result(proc: subprocess.Popen[str]) -> dict:
    out, _ = proc.communicate(timeout=600)
    return json.loads(out.strip().splitlines()[-1])


def fanout(addr: str, subscribers: int, n: int) -> dict:
    subs = [worker("sub", addr, "bench", n) for _ in range(subscribers)]
    for s in subs:
        ready(s)
    pub = result(worker("pub", addr, "bench", n, 100))
    got = [result(s) for s in subs]
    elapsed = max(g["last"] for g in got) - pub["start"]
    received = sum(g["received"] for g in got)
    return {
        "subscribers": subscribers,
        "messages": n,
        "delivered": received,
        "lost": subscribers * n - received,
        "out_of_order": sum(g["gaps"] for g in got),
        "seconds": round(elapsed, 3),
        "deliveries_per_s": round(received / elapsed),
    }


def latency(addr: str, rate: int, n: int) -> dict:
    sub = worker("lat-sub", addr, "lat", n)
    ready(sub)
    result(worker("lat-pub", addr, "lat", rate, n))
    return {"rate": rate, **result(sub)}


def pipe_blipmq(addr: str, lines_file: Path, n: int) -> dict:
    env = {**os.environ, "BLIPMQ_ADDR": addr}
    received = lines_file.with_suffix(".blipmq.out")
    with open(received, "wb") as sink:
        sub = subprocess.Popen(
            [BLIPMQ, "sub", "pipe", "--count", str(n), "--format", "lines"], stdout=sink, env=env
        )
        time.sleep(0.5)  # the CLI has no "ready" signal; half a second is ample on loopback
        start = time.monotonic()
        with open(lines_file, "rb") as f:
            subprocess.run([BLIPMQ, "pub", "pipe", "--lines", "-"], stdin=f, env=env, check=True)
        sub.wait(300)
        elapsed = time.monotonic() - start
    got = received.read_bytes().count(b"\n")
    return {"lines": got, "lost": n - got, "seconds": round(elapsed, 3),
            "msg_per_s": round(got / elapsed)}


def pipe_mosquitto(workdir: Path, lines_file: Path, n: int) -> dict | str:
    broker = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(broker).exists() or not shutil.which("mosquitto_pub"):
        return "mosquitto not installed (apt-get install mosquitto mosquitto-clients)"
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
    proc = subprocess.Popen([broker, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        if not wait_port(port):
            raise SystemExit(f"nothing listens on port {port}")
        received = lines_file.with_suffix(".mosquitto.out")
        with open(received, "wb") as sink:
            sub = subprocess.Popen(
                ["mosquitto_sub", "-p", str(port), "-h", "127.0.0.1", "-t", "pipe", "-C", str(n),
                 "-W", "60"],
                stdout=sink,
            )
            time.sleep(0.5)
            start = time.monotonic()
            with open(lines_file, "rb") as f:
                subprocess.run(["mosquitto_pub", "-p", str(port), "-h", "127.0.0.1", "-t", "pipe",
                                "-l"], stdin=f, check=True)
            sub.wait(120)
            elapsed = time.monotonic() - start
        got = received.read_bytes().count(b"\n")
        return {"lines": got, "lost": n - got, "seconds": round(elapsed, 3),
                "msg_per_s": round(got / elapsed),
                "version": subprocess.run([broker, "-h"], capture_output=True, text=True)
                .stdout.splitlines()[0]}
    finally:
        proc.terminate()
        proc.wait(10)


def one_shot(addr: str, runs: int = 20) -> dict:
    env = {**os.environ, "BLIPMQ_ADDR": addr}
    times = []
    for _ in range(runs):
        start = time.monotonic()
        subprocess.run([BLIPMQ, "pub", "t", "hello"], env=env, check=True)
        times.append((time.monotonic() - start) * 1000)
    return {"runs": runs, "median_ms": round(statistics.median(times), 1),
            "min_ms": round(min(times), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=500_000, help="messages for 1->1 (1->4: /2)")
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--skip-mosquitto", action="store_true")
    args = ap.parse_args()
    report: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="blipmq-bench-") as tmp:
        work = Path(tmp)
        broker = Blipmq(work)
        try:
            time.sleep(1.0)
            report["idle_rss_mb"] = round(broker.rss_mb(), 1)
            report["one_shot_pub"] = one_shot(broker.addr)
            report["fanout_1_1"] = fanout(broker.addr, 1, args.messages)
            report["fanout_1_4"] = fanout(broker.addr, 4, args.messages // 2)
            report["latency"] = latency(broker.addr, 2000, 10_000)
            lines = work / "lines.txt"
            lines.write_bytes(b"".join(b"line %d of the pipe benchmark\n" % i
                                       for i in range(args.lines)))
            report["cli_pipe_blipmq"] = pipe_blipmq(broker.addr, lines, args.lines)
            report["rss_after_mb"] = round(broker.rss_mb(), 1)
        finally:
            broker.stop()
        if not args.skip_mosquitto:
            report["cli_pipe_mosquitto"] = pipe_mosquitto(work, lines, args.lines)
            mine, theirs = report["cli_pipe_blipmq"], report["cli_pipe_mosquitto"]
            if isinstance(theirs, dict) and theirs["msg_per_s"]:
                report["cli_pipe_ratio"] = round(mine["msg_per_s"] / theirs["msg_per_s"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
