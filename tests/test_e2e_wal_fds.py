"""File descriptors stay bounded however many segments the log holds: the real broker under
a 256-descriptor limit with hundreds of 4 KiB segments."""

from __future__ import annotations

import json
import os
import subprocess

LIMIT = 256


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_hundreds_of_segments_under_a_256_descriptor_limit(start_broker) -> None:
    b = start_broker({"wal": {"segment_bytes": 4096, "cache_bytes": 0}})
    pid = b.proc.pid
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={LIMIT}:{LIMIT}"], check=True)
    with open(f"/proc/{pid}/limits") as f:
        assert any(line.startswith("Max open files") and f" {LIMIT} " in line for line in f)
    baseline = open_fds(pid)
    lines = b"".join(b"%05d" % i + b"x" * 95 + b"\n" for i in range(10_000))
    pub = b.cli("pub", "t", "-", "--qos", "1", "--lines", input=lines, timeout=120)
    assert pub.returncode == 0, pub.stderr
    segments = len(list((b.data_dir / "wal").glob("*.seg")))
    assert segments > 300
    assert open_fds(pid) <= baseline + 3  # the segment being written, not one per segment
    # reads all over the log (the cache is off: from the files), while publishing goes on
    got = b.cli("sub", "t", "--from", "earliest", "--count", "10000", "--format", "json",
                "--timeout", "60", timeout=120)
    assert got.returncode == 0, got.stderr
    payloads = [json.loads(x)["payload"] for x in got.stdout.decode().splitlines()]
    assert [int(p[:5]) for p in payloads] == list(range(10_000))
    for i in range(20):  # new connections and QoS 1 publishes still work
        res = b.cli("pub", "t", f"after {i}", "--qos", "1")
        assert res.returncode == 0, res.stderr
    assert b.metric("blipmq_wal_write_failures_total") == 0
    assert open_fds(pid) <= baseline + 12  # plus a few cached read descriptors
    assert b.stop() == 0
