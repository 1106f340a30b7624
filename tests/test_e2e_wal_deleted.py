"""The log's directory deleted under the running broker (an operator's ``rm -rf data/wal``, a
tmp cleaner): the real broker, QoS 1 publishes before and after, SIGKILL, restart."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path


def _payloads(b) -> list[str]:
    got = b.cli("sub", "t", "--from", "earliest", "--timeout", "2", "--format", "json")
    return [json.loads(line)["payload"] for line in got.stdout.decode().splitlines()]


def test_a_deleted_log_directory_is_made_again_and_nothing_confirmed_is_lost(
        start_broker, tmp_path: Path) -> None:
    """Each QoS 1 publish after the deletion is confirmed only once its record is in a file a
    restart reads: the directory is made again and the segment being written (still open,
    so still readable) is written back, with what was confirmed before the deletion. One
    line says so, and a metric counts it."""
    data = tmp_path / "data"
    config = {"wal": {"segment_bytes": 65536}}
    b = start_broker(config, data_dir=data)
    assert b.cli("pub", "t", "before", "--qos", "1").returncode == 0
    shutil.rmtree(data / "wal")
    after = b.cli("pub", "t", "after", "--qos", "1")
    assert after.returncode == 0, after.stderr
    said = b.wait_log("was deleted while the broker ran")
    assert "WARNING" in said and "made it again" in said, said
    assert b.metric("blipmq_wal_restores_total") == 1
    # then more than a segment's worth: the log rotates in the directory made again
    lines = b"".join(b"%04d" % i + b"x" * 996 + b"\n" for i in range(100))
    flood = b.cli("pub", "t", "-", "--qos", "1", "--lines", input=lines)
    assert flood.returncode == 0, flood.stderr
    assert len(list((data / "wal").glob("*.seg"))) >= 2
    assert b.metric("blipmq_wal_write_failures_total") == 0
    assert len([line for line in b.log if "was deleted while the broker ran" in line]) == 1
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    b2 = start_broker(config, data_dir=data)
    payloads = _payloads(b2)
    assert payloads[:2] == ["before", "after"], payloads[:3]
    assert [int(p[:4]) for p in payloads[2:]] == list(range(100))
    assert not [line for line in b2.log if "WARNING" in line], b2.log
    assert b2.stop() == 0


def test_a_log_directory_that_cannot_be_made_again_refuses_confirms_until_it_can(
        start_broker, tmp_path: Path) -> None:
    """A file where the directory was: the directory cannot be made again, so QoS 1
    publishes are refused (ERROR STORAGE, as on a full disk) and nothing is confirmed into
    a file that is gone; once the file is removed, the next write makes the directory
    again, and what was confirmed before the deletion is still there after a SIGKILL."""
    data = tmp_path / "data"
    b = start_broker(data_dir=data)
    assert b.cli("pub", "t", "before", "--qos", "1").returncode == 0
    shutil.rmtree(data / "wal")
    (data / "wal").write_bytes(b"not a directory")
    refused = b.cli("pub", "t", "refused", "--qos", "1")
    assert refused.returncode != 0
    assert "could not be written" in refused.stderr.decode(), refused.stderr
    b.wait_log("write-ahead log write failed")
    (data / "wal").unlink()
    after = b.cli("pub", "t", "after", "--qos", "1", timeout=10)
    assert after.returncode == 0, after.stderr
    b.wait_log("write-ahead log writes succeed again")
    b.wait_log("was deleted while the broker ran")
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    b2 = start_broker(data_dir=data)
    assert _payloads(b2) == ["before", "after"]
    assert b2.stop() == 0
