"""Shutdown while the flusher is writing: the in-process server on loopback, with a Disk
whose writes wait at a gate the test opens (the log's file layer, real files underneath)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import trio
from test_server import connect, make_config, publish, publish_qos1

from blipmq_server.protocol import codec
from blipmq_server.server.app import Bound, Server
from blipmq_server.wal.disk import Disk
from blipmq_server.wal.log import Log


class GateDisk(Disk):
    """A real Disk whose appends wait until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def append(self, path: str, data: bytes) -> None:
        self.entered.set()
        self.gate.wait(30)
        super().append(path, data)


async def start_gated(
    nursery: trio.Nursery, tmp_path: Path, **wal: object
) -> tuple[Server, GateDisk, int, trio.Event]:
    cfg = make_config(wal={"enabled": True, **wal}, storage={"data_dir": str(tmp_path)},
                      server={"shutdown_grace_ms": 200})
    server = Server(cfg)
    disk = GateDisk()
    assert server.wal is not None
    server.wal.disk = disk
    stopped = trio.Event()

    async def serve(task_status: trio.TaskStatus[Bound]) -> None:
        await server.serve(task_status=task_status)
        stopped.set()

    bound: Bound = await nursery.start(serve)
    return server, disk, bound.port, stopped


async def batch_in_flight_then_shutdown(server: Server, disk: GateDisk, port: int) -> None:
    """One batch stuck in its worker thread, one more record appended, then SIGTERM's path:
    wait until the log's final step (Flusher.close) has begun."""
    conn = await connect(port)
    await conn.send(publish_qos1(("t", b"in flight"), rid=1))
    await trio.to_thread.run_sync(disk.entered.wait, 10)
    await conn.send(publish(("t", b"appended meanwhile"), rid=2), codec.Ping(b"", 3))
    await conn.expect(codec.Pong)
    assert server.wal is not None and server.wal.pending_records == 1
    server.shutdown.set()
    with trio.fail_after(10):
        while not getattr(server.flusher, "_closing", True):
            await trio.sleep(0.01)


def logged(tmp_path: Path) -> list[bytes]:
    log = Log(str(tmp_path / "wal"))
    found = log.open()
    assert found.torn_bytes == 0 and not found.quarantined
    return [codec.decode_one(codec.encode_publish([r.body])).decoded()[0].payload
            for r in log.read(0)]


async def test_shutdown_waits_for_the_batch_in_flight_then_writes_the_rest(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    server, disk, port, stopped = await start_gated(nursery, tmp_path)
    await batch_in_flight_then_shutdown(server, disk, port)
    disk.gate.set()  # the batch in flight lands; then the final write and sync
    with trio.fail_after(10):
        await stopped.wait()  # serve returned (the old broker raised WalError here)
    assert logged(tmp_path) == [b"in flight", b"appended meanwhile"]


async def test_shutdown_gives_up_on_a_stuck_disk_after_its_deadline(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, disk, port, stopped = await start_gated(nursery, tmp_path, shutdown_timeout_ms=300)
    await batch_in_flight_then_shutdown(server, disk, port)
    try:
        with trio.fail_after(10), caplog.at_level(logging.ERROR, "blipmq"):
            await stopped.wait()  # without the disk ever answering
        assert any("not fully written and synced" in r.getMessage() for r in caplog.records)
    finally:
        disk.gate.set()  # let the abandoned worker thread finish
