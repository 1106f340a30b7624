"""Start-up figures of the frozen executable against the pip install: one-shot commands and `start`.

    .venv/bin/python bench/dist.py [--binary dist/blipmq-V-linux-ARCH] [--runs 31]

Prints, each as a median over --runs (with min and max):
- one-shot ``blipmq pub t hello`` against a running broker: onefile (unpacking into a
  directory on disk, and into /dev/shm), onedir (unpacked from
  the tarball next to the binary), the pip install in this venv with and without
  PYTHONDONTWRITEBYTECODE (set, nothing is cached and every run compiles blipmq's modules);
- ``blipmq start`` from the onefile: spawn -> the first accepted TCP connection, and the RSS
  of its two processes (bootloader parent, broker child) after 2 s idle.
Runs after one untimed warm-up each. Loopback only; everything it starts it ends.
Not a test: it gates nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ports import free_port  # bench/ports.py

TOP = Path(__file__).resolve().parent.parent
PIP_BLIPMQ = Path(sys.executable).with_name("blipmq")


def summary(label: str, samples: list[float], unit: str = "ms") -> None:
    print(f"{label:<48} median {statistics.median(samples):7.1f} {unit}   "
          f"min {min(samples):7.1f}   max {max(samples):7.1f}   (n={len(samples)})")


def timed(fn: Callable[[], None], runs: int) -> list[float]:
    fn()  # warm-up: page cache, and the pyc cache where one is written
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BLIPMQ_", "PYTHON"))}
    env.update(extra)
    return env


def one_shot(cmd: list[str], env: dict[str, str]) -> Callable[[], None]:
    def run() -> None:
        subprocess.run([*cmd, "pub", "t", "hello"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    return run


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def start_broker(binary: Path, data: Path, port: int, env: dict[str, str]
                 ) -> tuple[subprocess.Popen[bytes], float]:
    """Spawn ``start`` and return it with the ms until it accepted a TCP connection."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(binary), "start", "--data-dir", str(data), "--bind", f"127.0.0.1:{port}",
         "--metrics-bind", f"127.0.0.1:{free_port()}", "--log-format", "plain"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=env, start_new_session=True,
    )
    deadline = t0 + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, (time.perf_counter() - t0) * 1000
        except OSError:
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"broker did not accept (exit {proc.returncode})") from None
            time.sleep(0.002)


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    if proc.wait(60) != 0:
        raise RuntimeError(f"broker exited {proc.returncode} on SIGTERM")


def main() -> int:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                        platform.machine())
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", type=Path, default=None, help="onefile executable")
    p.add_argument("--runs", type=int, default=31)
    args = p.parse_args()
    binary = args.binary or next(iter(sorted((TOP / "dist").glob(f"blipmq-*-linux-{arch}"))),
                                 None)
    if binary is None or not binary.exists():
        p.error("no executable: run `make dist` or pass --binary")
    tarball = binary.with_name(binary.name + "-onedir.tar.gz")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = clean_env(TMPDIR=str(work))
        print(f"{binary.name}: {binary.stat().st_size / 1e6:.2f} MB "
              f"({binary.stat().st_size} bytes)")
        print(subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             env=env).stdout.strip())

        starts, rss = [], []
        for i in range(max(3, args.runs // 3)):
            proc, ms = start_broker(binary, work / f"data-{i}", free_port(), env)
            starts.append(ms)
            time.sleep(2)
            kids = children(proc.pid)
            rss.append((rss_kib(proc.pid), sum(rss_kib(k) for k in kids)))
            stop(proc)
        summary("start -> accepting (onefile)", starts)
        summary("idle RSS, bootloader parent", [p / 1024 for p, _ in rss], "MiB")
        summary("idle RSS, broker child", [c / 1024 for _, c in rss], "MiB")

        port = free_port()
        broker, _ = start_broker(binary, work / "data", port, env)
        addr = {"BLIPMQ_ADDR": f"127.0.0.1:{port}"}
        try:
            summary("pub t hello, onefile (TMPDIR on disk)",
                    timed(one_shot([str(binary)], {**env, **addr}), args.runs))
            if Path("/dev/shm").is_dir():
                summary("pub t hello, onefile (TMPDIR=/dev/shm)",
                        timed(one_shot([str(binary)], {**env, **addr, "TMPDIR": "/dev/shm"}),
                              args.runs))
            if tarball.exists():
                with tarfile.open(tarball) as tar:
                    tar.extractall(work / "onedir", filter="data")
                onedir = next((work / "onedir").iterdir()) / "blipmq"
                summary("pub t hello, onedir", timed(one_shot([str(onedir)], {**env, **addr}),
                                                     args.runs))
            if PIP_BLIPMQ.exists():
                summary("pub t hello, pip install, PYTHONDONTWRITEBYTECODE=1",
                        timed(one_shot([str(PIP_BLIPMQ)],
                                       {**env, **addr, "PYTHONDONTWRITEBYTECODE": "1"}),
                              args.runs))
                summary("pub t hello, pip install, bytecode cached",
                        timed(one_shot([str(PIP_BLIPMQ)], {**env, **addr}), args.runs))
        finally:
            stop(broker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
