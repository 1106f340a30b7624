"""What the real broker fsyncs, seen from outside: strace on the broker process, and the
fsync counter on /metrics.

strace comes from scripts/test-deps (run by `make test`); without it these tests fail and
say so.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# one strace line: "pid call(fd</path>, ...) = result" (-y puts the path after each fd),
# or "pid openat(AT_FDCWD</cwd>, "/path", flags...) = fd</path>"
_CALL = re.compile(r'^(?:\d+\s+)?(\w+)\((?:\d+<([^>]*)>|AT_FDCWD(?:<[^>]*>)?, "([^"]*)")(.*)$')


def strace() -> str:
    path = shutil.which("strace")
    if path is None:
        pytest.fail("strace is not installed: run scripts/test-deps as root (make test does)")
    return path


def attach(pid: int, out: Path, calls: str = "write,pwrite64,writev,fsync,fdatasync,openat",
           names: str = "-y") -> subprocess.Popen[bytes]:
    """Trace every thread of ``pid`` (writes, fsyncs, file creations) into ``out``;
    ``names``: -y for the path of each descriptor, -yy for sockets' addresses too."""
    tracer = subprocess.Popen(
        [strace(), "-f", names, "-s", "0", "-o", str(out), "-p", str(pid),
         "-e", f"trace={calls}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    assert tracer.stderr is not None
    for _ in range(200):  # strace says when it has attached; bounded
        line = tracer.stderr.readline().decode()
        if f"Process {pid} attached" in line:
            return tracer
        if not line:
            break
    tracer.kill()
    pytest.fail(f"strace could not attach to the broker: {line!r}")


@contextlib.contextmanager
def traced(pid: int, out: Path, calls: str = "write,pwrite64,writev,fsync,fdatasync,openat",
           names: str = "-y") -> Iterator[None]:
    """``attach`` for the block, which ends the traced process (strace then ends too);
    strace is killed if it is still there."""
    tracer = attach(pid, out, calls, names)
    try:
        yield
        tracer.wait(30)
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()


def not_durable(trace: str, wal: Path) -> list[str]:
    """Segment files written after their last fsync, and "<dir>" if a segment file was
    created after the last fsync of the wal directory."""
    last_write: dict[str, int] = {}
    last_sync: dict[str, int] = {}
    created = dir_synced = -1
    wal_dir = str(wal)
    for i, line in enumerate(trace.splitlines()):
        m = _CALL.match(line)
        if m is None:  # "<... resumed>" halves: the call started on an earlier line
            continue
        call, fd_path, open_path, rest = m.groups()
        path = fd_path or open_path or ""
        if call == "openat" and path.endswith(".seg") and "O_CREAT" in rest:
            created = i
        elif call in ("write", "pwrite64", "writev") and path.endswith(".seg"):
            last_write[path] = i
        elif call in ("fsync", "fdatasync"):
            if path == wal_dir:
                dir_synced = i
            else:
                last_sync[path] = i
    assert created >= 0, "the trace shows no segment file created"
    late = sorted(Path(p).name for p, i in last_write.items() if last_sync.get(p, -1) < i)
    return late + (["<dir>"] if created > dir_synced else [])


def payload_lines(n: int, size: int = 100) -> bytes:
    return b"".join(b"%06d" % i + b"x" * (size - 6) + b"\n" for i in range(n))


@pytest.mark.parametrize("fsync", ["every_n:1000", "interval_ms:200", "none"])
def test_sigterm_fsyncs_every_rotated_segment_and_the_directory(
    start_broker, tmp_path: Path, fsync: str
) -> None:
    b = start_broker({"wal": {"segment_bytes": 4096, "fsync": fsync}})
    out = tmp_path / "strace.txt"
    with traced(b.proc.pid, out):
        pub = b.cli("pub", "t", "-", "--qos", "1", "--lines", input=payload_lines(2500),
                    timeout=120)
        assert pub.returncode == 0, pub.stderr
        assert b.stop(timeout=60) == 0
    wal = b.data_dir / "wal"
    segments = sorted(p.name for p in wal.glob("*.seg"))
    assert len(segments) > 50  # many rotations
    trace = out.read_text()
    written = {Path(m.group(2)).name for m in map(_CALL.match, trace.splitlines())
               if m and m.group(1) == "write" and (m.group(2) or "").endswith(".seg")}
    assert written == set(segments)  # the trace saw every segment's writes
    assert not_durable(trace, wal) == []


def test_one_shot_qos0_publishes_share_fsyncs_with_the_default_config(start_broker) -> None:
    """fsync = always (the default) must not cost one fsync per QoS 0 publish."""
    b = start_broker()
    assert b.metric("blipmq_wal_fsyncs_total") == 0
    started = time.monotonic()
    for i in range(20):
        res = b.cli("pub", "t", f"reading {i}")
        assert res.returncode == 0, res.stderr
    elapsed = time.monotonic() - started
    b.wait_metric("blipmq_wal_records_total", 20)
    fsyncs = b.metric("blipmq_wal_fsyncs_total")
    # at most one sync a second (wal.unconfirmed_sync_ms), plus the directory's fsync for
    # the new segment file; the old broker made one per publish
    assert fsyncs < 20 and fsyncs <= elapsed + 3, (fsyncs, elapsed)
    b.wait_metric("blipmq_wal_unsynced_records", 0)  # and they are synced soon after
    assert b.metric("blipmq_wal_syncs_total") >= 1
    assert b.stop() == 0


def test_retention_deletes_segment_files_off_the_event_loop(start_broker, tmp_path: Path) -> None:
    """Unlinking a 64 MiB segment takes the kernel 5-20 ms; retention used to do it on the
    event loop, which stalled every connection (a p99 of 81 ms at 2,000 msg/s in
    bench/compare.py). The files must be deleted by a worker thread, never the main one."""
    b = start_broker({"wal": {"segment_bytes": 4096, "retention_bytes": 16384,
                              "maintenance_interval_ms": 100}})
    out = tmp_path / "strace.txt"
    with traced(b.proc.pid, out, "unlink,unlinkat"):
        pub = b.cli("pub", "t", "-", "--lines", input=payload_lines(2500), timeout=120)
        assert pub.returncode == 0, pub.stderr
        deadline = time.monotonic() + 30
        while b.metric("blipmq_wal_segments") > 6:  # retention keeps about 16 KiB of 4 KiB
            assert time.monotonic() < deadline, "retention did not run"
            time.sleep(0.05)
        assert b.stop() == 0
    unlinks = [line.split()[0] for line in out.read_text().splitlines()
               if re.search(r"unlink(at)?\(.*\.seg", line)]
    assert len(unlinks) > 20  # the trace saw retention at work
    assert str(b.proc.pid) not in unlinks  # the main thread (its id is the pid) unlinked none
