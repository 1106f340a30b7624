"""Idle memory of the broker and where it goes; prints figures, never fails on them.

    .venv/bin/python bench/memory.py [--blipmq PATH] [--runs 3]

Starts ``blipmq start`` (the one next to this interpreter, or ``--blipmq``) on loopback
twice: with the benchmark's configuration (bench/run.py: metrics off) and with the
defaults (metrics on), waits until it accepts a connection and one more second, and reads
/proc/PID/status and /proc/PID/smaps_rollup: RSS, and how much of it is the process's own
memory (anonymous) and how much mapped files (the interpreter, shared libraries: shared
with every other Python process using them), and PSS (shared pages divided among the
processes sharing them). For a onefile executable it measures the broker (the
bootloader's child) and reports the bootloader apart. Then, in a fresh interpreter, it imports the
start path's modules one group at a time and prints the RSS each group adds (the
breakdown in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port, wait_port  # bench/ports.py

HERE = Path(__file__).resolve().parent
BLIPMQ = str(Path(sys.executable).with_name("blipmq"))

# groups of modules, in the order ``blipmq start`` first needs them
_STEPS = [
    ("argument parsing (blipmq_cli.main, fast)", ["blipmq_cli.main", "blipmq_cli.fast"]),
    ("daemon, logging", ["blipmq_server.daemon", "logging"]),
    ("config (tomllib, dataclasses)", ["blipmq_server.config", "blipmq_server.logs"]),
    ("write-ahead log (crc32c)", ["blipmq_server.wal.log"]),
    ("broker core", ["blipmq_server.broker.core"]),
    ("trio (ctypes, attrs, idna; ssl and hmac deferred)", ["blipmq_server.deferred", "trio"]),
    ("server shell", ["blipmq_server.server.app"]),
    ("metrics (HTTP listener), only with metrics on", ["blipmq_server.server.http"]),
]

_BREAKDOWN = """
import json, re, sys
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
rows = [["interpreter and site", rss(), len(sys.modules)]]
for name, modules in json.loads(sys.argv[1]):
    for m in modules:
        __import__(m)
        if m == "blipmq_server.deferred":
            sys.modules[m].defer()  # as blipmq_server.daemon does before it imports trio
    rows.append([name, rss(), len(sys.modules)])
print(json.dumps(rows))
"""


def kib(text: str, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def idle(blipmq: str, work: Path, metrics: bool) -> dict:
    port = free_port()
    cfg = work / f"idle-{port}.toml"
    cfg.write_text(f"[server]\nport = {port}\n"
                   + ("[metrics]\nport = 0\n" if metrics else "[metrics]\nenabled = false\n")
                   + "[queues]\ncapacity = 65536\noverflow = \"block\"\n")
    proc = subprocess.Popen(
        [blipmq, "start", "--config", str(cfg), "--data-dir", str(work / f"data-{port}"),
         "--log-format", "plain", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        if not wait_port(port, proc):
            raise SystemExit(f"the broker exited with {proc.returncode}" if proc.poll()
                             is not None else f"nothing listens on port {port}")
        time.sleep(1.0)  # what bench/run.py waits before it reads the idle RSS
        # a onefile executable is a bootloader with the broker as its child: measure the child
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pid = int(kids[0]) if kids else proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        children = Path(f"/proc/{pid}/task").iterdir()
        boot = Path(f"/proc/{proc.pid}/status").read_text() if kids else ""
        boot_rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text() if kids else ""
        return {"rss_mb": round(kib(status, "VmRSS") / 1024, 1),
                "pss_mb": round(kib(rollup, "Pss") / 1024, 1),
                "anon_mb": round(kib(rollup, "Anonymous") / 1024, 1),
                "file_mb": round((kib(rollup, "Rss") - kib(rollup, "Anonymous")) / 1024, 1),
                "threads": sum(1 for _ in children),
                "bootloader_rss_mb": round(kib(boot, "VmRSS") / 1024, 1) if boot else 0.0,
                "bootloader_pss_mb": round(kib(boot_rollup, "Pss") / 1024, 1)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group: a onefile bootloader ignores signals
        proc.wait(30)


def breakdown() -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", _BREAKDOWN, json.dumps(_STEPS)],
        capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(),
    ).stdout
    rows = json.loads(out)
    result = []
    prev = 0
    for name, rss, modules in rows:
        result.append({"step": name, "rss_mb": round(rss / 1024, 1),
                       "adds_mb": round((rss - prev) / 1024, 1), "modules": modules})
        prev = rss
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blipmq", default=BLIPMQ)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    report: dict = {"python": sys.version.split()[0],
                    "bytecode_cache": not os.environ.get("PYTHONDONTWRITEBYTECODE")}
    with tempfile.TemporaryDirectory(prefix="blipmq-memory-") as tmp:
        work = Path(tmp)
        for metrics in (False, True):
            key = "metrics_on" if metrics else "metrics_off"
            runs = [idle(args.blipmq, work, metrics) for _ in range(args.runs)]
            report[key] = {"runs": runs,
                           "median_rss_mb": sorted(r["rss_mb"] for r in runs)[len(runs) // 2]}
            print(f"idle, {key}: RSS {[r['rss_mb'] for r in runs]} MB "
                  f"(anonymous {[r['anon_mb'] for r in runs]}, "
                  f"files {[r['file_mb'] for r in runs]}; "
                  f"PSS {[r['pss_mb'] for r in runs]})", file=sys.stderr)
            if any(r["bootloader_rss_mb"] for r in runs):
                print(f"  onefile bootloader: RSS {[r['bootloader_rss_mb'] for r in runs]} MB, "
                      f"PSS {[r['bootloader_pss_mb'] for r in runs]} MB", file=sys.stderr)
    if args.blipmq == BLIPMQ:  # the breakdown is of this interpreter's modules
        report["breakdown"] = breakdown()
        for row in report["breakdown"]:
            print(f"  {row['step']:<52} {row['rss_mb']:5.1f} MB  +{row['adds_mb']:4.1f}"
                  f"  ({row['modules']} modules)", file=sys.stderr)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
