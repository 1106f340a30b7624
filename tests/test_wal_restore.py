"""Files of the log deleted under it while it runs (``rm -rf data/wal``): a batch is not
reported written before the files it wrote are where a restart reads them. Pure: the log on
real files, no event loop."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from blipmq_server.wal.disk import Disk
from blipmq_server.wal.log import Log, LogOptions
from tests.test_wal_log import MSG, all_bodies, body, reopen, segments


def _write(log: Log, bodies: list[bytes], sync: bool = True):
    for b in bodies:
        log.append(MSG, b, 1000)
    batch = log.take_batch()
    assert batch is not None
    try:
        batch.write(log.disk, sync)
    except OSError:
        log.abort(batch)
        raise
    log.commit(batch)
    return batch


@pytest.mark.parametrize("sync", [True, False])
def test_a_deleted_directory_is_made_again_with_the_segment_being_written(
        tmp_path: Path, sync: bool) -> None:
    where = tmp_path / "wal"
    log = Log(str(where))
    log.open()
    _write(log, [body(i) for i in range(5)])
    shutil.rmtree(where)
    batch = _write(log, [body(i) for i in range(5, 8)], sync)
    assert batch.restored is not None and batch.restored.made
    assert batch.restored.names == ("00000000000000000001.seg",)
    assert log.missing() == []
    assert log.disk.intact()
    log.close()
    again, found = reopen(where)
    assert not found.notes and found.torn_bytes == 0
    assert all_bodies(again) == [body(i) for i in range(8)]


def test_a_deleted_segment_being_written_is_written_back(tmp_path: Path) -> None:
    log = Log(str(tmp_path))
    log.open()
    _write(log, [body(i) for i in range(3)])
    (tmp_path / "00000000000000000001.seg").unlink()
    batch = _write(log, [body(3)])
    assert batch.restored is not None and not batch.restored.made
    assert batch.restored.names == ("00000000000000000001.seg",)
    log.close()
    assert all_bodies(reopen(tmp_path)[0]) == [body(i) for i in range(4)]


def test_the_segment_being_written_after_a_start_is_written_back_before_its_first_write(
        tmp_path: Path) -> None:
    """Recovery hands over the newest segment; it is held open from then on, so a deletion
    before the next write loses nothing of it (opened at that write, it was a new file
    without its header)."""
    log = Log(str(tmp_path))
    log.open()
    _write(log, [body(i) for i in range(3)])
    log.close()
    log, _ = reopen(tmp_path)
    (tmp_path / "00000000000000000001.seg").unlink()
    _write(log, [body(3)])
    log.close()
    assert all_bodies(reopen(tmp_path)[0]) == [body(i) for i in range(4)]


def test_a_batch_that_rotates_into_a_deleted_directory_makes_it_again(tmp_path: Path) -> None:
    """The directory is gone when the batch creates the next segment: it is made again, the
    segment the batch began in is written back from its descriptor, and the batch goes on."""
    where = tmp_path / "wal"
    log = Log(str(where), LogOptions(segment_bytes=1024))
    log.open()
    _write(log, [body(i) for i in range(10)])  # 10 x 65 bytes: one segment
    shutil.rmtree(where)
    batch = _write(log, [body(i) for i in range(10, 60)])  # fills several
    assert batch.restored is not None and batch.restored.made
    assert "00000000000000000001.seg" in batch.restored.names
    assert len(segments(where)) == len(log.segments) > 2
    log.close()
    again, found = reopen(where, LogOptions(segment_bytes=1024))
    assert not found.notes
    assert all_bodies(again) == [body(i) for i in range(60)]


class _DeletingDisk(Disk):
    """Deletes ``victim`` just before its first fsync: the batch's writes went in, every
    file it made and closed with them."""

    def __init__(self, victim: Path) -> None:
        super().__init__()
        self.victim: Path | None = victim

    def fsync(self, path: str) -> None:
        if self.victim is not None:
            shutil.rmtree(self.victim)
            self.victim = None
        super().fsync(path)


def test_segments_a_batch_made_and_closed_are_written_again_from_memory(tmp_path: Path) -> None:
    where = tmp_path / "wal"
    log = Log(str(where), LogOptions(segment_bytes=1024))
    log.open()
    _write(log, [body(i) for i in range(10)])
    log.disk = disk = _DeletingDisk(where)
    batch = _write(log, [body(i) for i in range(10, 60)])
    assert disk.victim is None and batch.restored is not None and batch.restored.made
    assert len(batch.restored.names) == len(log.segments)  # every one: open or in memory
    log.close()
    again, found = reopen(where, LogOptions(segment_bytes=1024))
    assert not found.notes
    assert all_bodies(again) == [body(i) for i in range(60)]


def test_a_directory_that_cannot_be_made_again_fails_the_batch_until_it_can(
        tmp_path: Path) -> None:
    """A file where the directory was: the batch fails (nothing of it is reported written),
    the segment being written stays open, undone to what it held; once the path is free,
    the next batch makes the directory and writes the segment back."""
    where = tmp_path / "wal"
    log = Log(str(where))
    log.open()
    _write(log, [body(i) for i in range(3)])
    shutil.rmtree(where)
    where.write_bytes(b"in the way")
    with pytest.raises(OSError, match="cannot be made again"):
        _write(log, [b"refused"])
    assert log.lost == [(4, 4)]
    where.unlink()
    batch = _write(log, [body(3)])
    assert batch.restored is not None and batch.restored.made
    log.close()
    assert all_bodies(reopen(where)[0]) == [body(i) for i in range(4)]


def test_older_segments_gone_with_the_directory_leave_the_log(tmp_path: Path) -> None:
    where = tmp_path / "wal"
    log = Log(str(where), LogOptions(segment_bytes=1024))
    log.open()
    _write(log, [body(i) for i in range(40)])
    tail = log.segments[-1]
    shutil.rmtree(where)
    _write(log, [body(40)])
    gone = log.missing()
    assert gone == log.segments[:-1]
    assert log.drop(gone) == gone
    assert log.segments == [tail]
    assert log.first_offset == tail.first
    assert [r.body for r in log.read(0)] == [body(i) for i in range(tail.first - 1, 41)]


def test_the_check_is_one_stat_per_file_open_for_appends(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    log = Log(str(tmp_path))
    log.open()
    _write(log, [body(0)])
    calls: list[str] = []
    real = os.stat

    def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted)
    _write(log, [body(1)])
    assert calls == [str(tmp_path / "00000000000000000001.seg")]
