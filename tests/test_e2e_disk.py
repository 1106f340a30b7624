"""A real full disk: the broker's data directory on a tiny tmpfs that runs out of space.

Mounting needs root (CAP_SYS_ADMIN); where the mount is refused the test is skipped with the
reason, and tests/test_server.py still covers write and fsync failures through the log's
file layer (FaultyDisk).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from blipmq_cli.exits import Exit

_SIZE = 1 << 20  # 1 MiB filesystem


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "tiny"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_SIZE}", "tmpfs", str(where)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_refuses_qos1_then_resumes(start_broker, tiny_fs: Path) -> None:
    b = start_broker({"wal": {"segment_bytes": 65536}}, data_dir=tiny_fs / "data")
    assert b.cli("pub", "t", "before", "--qos", "1").returncode == 0
    # fill the filesystem, leaving about 100 KiB
    filler = tiny_fs / "filler"
    st = os.statvfs(tiny_fs)
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 100 * 1024))
    # ~400 KB in publishes of 20 KB (one at once could be a single batch too big to fit)
    confirmed = 0
    for chunk in range(20):
        lines = b"".join(b"%04d" % i + b"x" * 996 + b"\n" for i in range(20 * chunk,
                                                                          20 * chunk + 20))
        full = b.cli("pub", "t", "-", "--qos", "1", "--lines", input=lines)
        if full.returncode != 0:
            break
        confirmed += 20
    assert full.returncode == Exit.REFUSED, full.stderr
    err = full.stderr.decode()
    assert err.count("\n") == 1 and "No space left on device" in err, err
    m = re.search(r"(\d+) of (\d+) messages confirmed", err)
    assert m is not None, err
    confirmed += int(m.group(1))
    assert 0 < confirmed < 400
    assert b.metric("blipmq_wal_write_failures_total") >= 1
    assert b.proc.poll() is None  # the broker keeps running
    filler.unlink()  # the fault clears
    assert b.cli("pub", "t", "after", "--qos", "1").returncode == 0
    assert b.stop() == 0
    b2 = start_broker({"wal": {"segment_bytes": 65536}}, data_dir=tiny_fs / "data")
    res = b2.cli("sub", "t", "--from", "earliest", "--timeout", "2", "--format", "json")
    payloads = [json.loads(x)["payload"] for x in res.stdout.decode().splitlines()]
    assert payloads[0] == "before" and payloads[-1] == "after"
    stored = [int(p[:4]) for p in payloads[1:-1]]
    # every confirmed message is there, in order, and no refused batch left a piece behind
    assert stored[:confirmed] == list(range(confirmed))
    assert stored == sorted(set(stored))
    assert all(len(p) == 1000 for p in payloads[1:-1])
