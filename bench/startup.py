"""Start-up of ``blipmq start`` with an empty data directory, beside mosquitto and nats-server.

    .venv/bin/python bench/startup.py [--runs 15] [--blipmq PATH] [--binary dist/blipmq-...]
    .venv/bin/python bench/startup.py --stages [--runs 15]
    .venv/bin/python bench/startup.py --against OLD [--blipmq NEW] [--runs 21]

For each broker, each run: spawn it on a free loopback port with a fresh empty data
directory, then time spawn -> the first TCP connection it accepts (and, for BlipMQ, spawn ->
its "listening on" line), read its idle memory once it accepts plus 1 s (RSS; of it the
anonymous part, the process's own; and PSS, shared pages divided among their sharers), and
end it with SIGTERM. Prints the median, min and max of the times, the medians of memory.
BlipMQ runs from the pip install next to this interpreter (``--blipmq`` names another),
with its bytecode cached (this script compiles blipmq's modules once first, as a pip
install does) and, if ``--binary`` is given, from the onefile executable too (its memory is
the broker child's plus the bootloader's). mosquitto and nats-server run when they are on
the PATH, with no persistence configured. Metrics stay on (the default): the HTTP listener
is part of what ``start`` brings up. Loopback only; it ends everything it starts. Not a
test: it gates nothing.

``--stages`` says where the time goes instead: the bare interpreter (``python -c pass``),
then, in a fresh interpreter each run, the start path's imports one group at a time in the
order ``blipmq start`` needs them, the part of it spent making trio's attrs classes (code
generated and compiled per class), and the RSS each group adds.

``--against`` compares two BlipMQ commands (each a ``blipmq`` executable or script, say of
a checkout before a change and one after) in turn, run by run, so both see the same
machine: its speed drifts by 10-20% within the hour, more than most changes save. Prints
each one's median, min and max and the median of the per-pair differences; nothing else.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ports import free_port  # bench/ports.py

TOP = Path(__file__).resolve().parent.parent
PIP_BLIPMQ = Path(sys.executable).with_name("blipmq")


def rss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def rollup_kib(pid: int) -> tuple[int, int]:
    """(anonymous, PSS) in KiB: the process's own memory, and its fair share of what it
    shares with other processes (the interpreter and libraries, mapped from files)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except FileNotFoundError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:]}
    return fields.get("Anonymous", 0), fields.get("Pss", 0)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class Run:
    """One start of one broker: the times to its ready line and first accept, its RSS."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str], cwd: Path,
                 settle_s: float = 1) -> None:
        self.ready_ms: float | None = None
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

        def read() -> None:
            assert self.proc.stderr is not None
            for raw in self.proc.stderr:
                if self.ready_ms is None and b"listening on" in raw:
                    self.ready_ms = (time.perf_counter() - t0) * 1000

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 20
        while not accepts(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not accept on port {port}")
            time.sleep(0.001)
        self.accept_ms = (time.perf_counter() - t0) * 1000
        time.sleep(settle_s)
        pids = [self.proc.pid, *children(self.proc.pid)]
        self.rss_kib = sum(rss_kib(pid) for pid in pids)
        self.anon_kib = sum(rollup_kib(pid)[0] for pid in pids)
        self.pss_kib = sum(rollup_kib(pid)[1] for pid in pids)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def blipmq(binary: str) -> Callable[[Path, int], tuple[list[str], Path]]:
    def argv(data: Path, port: int) -> tuple[list[str], Path]:
        return ([binary, "start", "--data-dir", str(data / "blipmq"),
                 "--bind", f"127.0.0.1:{port}", "--metrics-bind", f"127.0.0.1:{free_port()}",
                 "--mqtt-bind", "off", "--log-format", "plain"], data)
    return argv


def mosquitto(binary: str) -> Callable[[Path, int], tuple[list[str], Path]]:
    def argv(data: Path, port: int) -> tuple[list[str], Path]:
        conf = data / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
        return [binary, "-c", str(conf)], data
    return argv


def nats(binary: str) -> Callable[[Path, int], tuple[list[str], Path]]:
    def argv(data: Path, port: int) -> tuple[list[str], Path]:
        return [binary, "-a", "127.0.0.1", "-p", str(port)], data
    return argv


def compare(old: str, new: str, runs: int, env: dict[str, str]) -> None:
    """Start ``old`` and ``new`` in turn (which goes first alternates), ``runs`` pairs after
    one untimed pair; print both medians and the median per-pair difference."""
    times: dict[str, list[float]] = {old: [], new: []}
    for i in range(runs + 1):
        for binary in (old, new) if i % 2 else (new, old):
            with tempfile.TemporaryDirectory(prefix="blipmq-startup-") as tmp:
                port = free_port()
                argv, cwd = blipmq(binary)(Path(tmp), port)
                run = Run(argv, port, env, cwd, settle_s=0)
                run.stop()
                if i:
                    times[binary].append(run.accept_ms)
    med = statistics.median
    for label, binary in (("old", old), ("new", new)):
        xs = times[binary]
        print(f"{label} {binary}: accepting {med(xs):6.1f} ms (min {min(xs):.1f}, "
              f"max {max(xs):.1f})  n={len(xs)}")
    diffs = [a - b for a, b in zip(times[old], times[new], strict=True)]
    print(f"old - new, median of the {len(diffs)} pairs: {med(diffs):.1f} ms")


def measure(label: str, make: Callable[[Path, int], tuple[list[str], Path]], runs: int,
            env: dict[str, str]) -> None:
    accept, ready, rss, anon, pss = [], [], [], [], []
    for i in range(runs + 1):  # the first is an untimed warm-up (page cache, pyc files)
        with tempfile.TemporaryDirectory(prefix="blipmq-startup-") as tmp:
            port = free_port()
            argv, cwd = make(Path(tmp), port)
            run = Run(argv, port, env, cwd)
            run.stop()
            if i:
                accept.append(run.accept_ms)
                rss.append(run.rss_kib / 1024)
                anon.append(run.anon_kib / 1024)
                pss.append(run.pss_kib / 1024)
                if run.ready_ms is not None:
                    ready.append(run.ready_ms)

    def fmt(xs: list[float], unit: str) -> str:
        return (f"{statistics.median(xs):6.1f} {unit} (min {min(xs):.1f}, max {max(xs):.1f})"
                if xs else "-")

    med = statistics.median
    print(f"{label:<28} accepting {fmt(accept, 'ms')}  ready line {fmt(ready, 'ms')}\n"
          f"{'':<28} idle RSS {med(rss):.1f} MiB (anonymous {med(anon):.1f}, "
          f"PSS {med(pss):.1f})  n={len(accept)}", flush=True)


# The start path's imports, grouped as ``blipmq start`` first needs them.
_STAGES = """
import gc, json, re, sys, time
gc.disable()  # as blipmq_cli/main.py does for `start`
made = {"attrs": 0.0}
def timed(kind, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            made[kind] += time.perf_counter() - t
    return wrapper
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
rows = []
def stage(name, t0, r0):
    rows.append([name, (time.perf_counter() - t0) * 1000, (rss() - r0) / 1024])
t, r = time.perf_counter(), rss()
from blipmq_cli import main, fast
fast.parser("start")
stage("argument parsing (blipmq_cli.main, fast: argparse, enum, the codec)", t, r)
t, r = time.perf_counter(), rss()
from blipmq_server import daemon, deferred
deferred.defer()  # as daemon.start does, first
from blipmq_server import logs
stage("daemon, logging", t, r)
t, r = time.perf_counter(), rss()
from blipmq_server import config
stage("config (NamedTuples; tomllib only with a file)", t, r)
t, r = time.perf_counter(), rss()
import attr._make
attr._make._ClassBuilder.build_class = timed("attrs", attr._make._ClassBuilder.build_class)
import trio
stage("trio (attrs, ctypes, subprocess; ssl, hmac, shutil, ... deferred)", t, r)
t, r = time.perf_counter(), rss()
import blipmq_server.wal.log, blipmq_server.broker.core
stage("write-ahead log, broker core", t, r)
t, r = time.perf_counter(), rss()
from blipmq_server.server import app
stage("server shell (the MQTT front end only with MQTT on: not here)", t, r)
t, r = time.perf_counter(), rss()
from blipmq_server.server import http
stage("metrics HTTP listener", t, r)
t = time.perf_counter()
gc.collect()
after = (time.perf_counter() - t) * 1000
print(json.dumps({"rows": rows, "after_ms": after, "modules": len(sys.modules),
                  "made_ms": {k: v * 1000 for k, v in made.items()},
                  "dataclasses": "dataclasses" in sys.modules}))
"""


def stages(runs: int, env: dict[str, str]) -> None:
    bare = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        bare.append((time.perf_counter() - t0) * 1000)
    samples = []
    for _ in range(runs + 1):
        out = subprocess.run([sys.executable, "-c", _STAGES], env=env, check=True,
                             capture_output=True, text=True, cwd=TOP).stdout
        samples.append(json.loads(out))
    samples = samples[1:]
    med = statistics.median
    print(f"{runs} runs each, medians; load average {os.getloadavg()[0]:.2f}")
    print(f"{'bare interpreter (python -c pass, spawn to exit)':<70} {med(bare[1:]):6.1f} ms")
    total = 0.0
    for i, (name, _ms, _mb) in enumerate(samples[0]["rows"]):
        ms = med(s["rows"][i][1] for s in samples)
        mb = med(s["rows"][i][2] for s in samples)
        total += ms
        print(f"{name:<70} {ms:6.1f} ms  +{mb:4.1f} MiB")
    print(f"{'total in Python, before the server runs':<70} {total:6.1f} ms")
    after = med(s["after_ms"] for s in samples)
    print(f"{'then, once accepting: gc.collect() (server/app.py, _settle_heap)':<70} "
          f"{after:6.1f} ms")
    ms = med(s["made_ms"]["attrs"] for s in samples)
    print(f"  of which making attrs classes (trio's){'':<31} {ms:6.1f} ms")
    print(f"  modules loaded: {samples[0]['modules']}; dataclasses among them: "
          f"{'yes' if samples[0]['dataclasses'] else 'no'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--blipmq", default=str(PIP_BLIPMQ), type=lambda s: str(Path(s).resolve()),
                   help="the pip-installed blipmq")
    p.add_argument("--binary", default=None, type=lambda s: str(Path(s).resolve()),
                   help="a onefile executable to measure too")
    p.add_argument("--stages", action="store_true", help="where the start-up time goes")
    p.add_argument("--against", default=None, type=lambda s: str(Path(s).resolve()),
                   help="another blipmq to start in turn with --blipmq (before/after)")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLIPMQ_", "PYTHONDONTWRITEBYTECODE"))}
    for package in ("blipmq_cli", "blipmq_server"):  # as pip does on install
        compileall.compile_dir(str(TOP / package), quiet=1)
    if args.stages:
        stages(args.runs, env)
        return 0
    if args.against:
        print(f"{args.runs} pairs, after one warm-up; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        compare(args.against, args.blipmq, args.runs, env)
        return 0
    print(f"{args.runs} runs each, after one warm-up; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    measure("blipmq start (pip install)", blipmq(args.blipmq), args.runs, env)
    if args.binary:
        with tempfile.TemporaryDirectory(prefix="blipmq-unpack-") as unpack:
            measure("blipmq start (onefile)", blipmq(args.binary), args.runs,
                    {**env, "TMPDIR": unpack})
    for label, name, make in (("mosquitto", "mosquitto", mosquitto),
                              ("nats-server", "nats-server", nats)):
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
        if found:
            measure(label, make(found), args.runs, env)
        else:
            print(f"{label:<28} not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
