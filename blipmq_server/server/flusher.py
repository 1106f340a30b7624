"""Group commit: one write, and by policy one fsync, for every append since the last batch.

Publishers append to the log in memory (``Broker.publish``) and wake the flusher. The
flusher takes everything appended so far as one batch and writes it in a worker thread
(``trio.to_thread``), so the event loop never waits on the disk; appends arriving meanwhile
form the next batch. After a batch lands, QoS 1 publishers whose records it held get their
PUB_ACK, in offset order; if the disk fails, they get ERROR STORAGE instead and the broker
keeps serving (the next batch tries the disk again).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.wal.log import Log
from blipmq_server.wal.policy import FsyncPolicy

if TYPE_CHECKING:
    from blipmq_server.server.session import Session

log = logging.getLogger("blipmq.wal")


@dataclass(slots=True)
class WalCounters:
    batches: int = 0
    records: int = 0
    bytes: int = 0
    fsyncs: int = 0
    failures: int = 0
    records_lost: int = 0  # appended but never written because the disk failed


class Flusher:
    def __init__(
        self, wal: Log, policy: FsyncPolicy, on_commit: Callable[[], None] | None = None
    ) -> None:
        self.wal = wal
        self.policy = policy
        self.on_commit = on_commit  # new records are readable (durable groups may deliver)
        self.counters = WalCounters()
        self._wake = trio.Event()
        self._waiters: deque[tuple[int, Session, int, int]] = deque()
        self._unsynced = 0
        self._last_sync = 0.0
        self.failing = False

    def appended(self) -> None:
        self._wake.set()

    def confirm_later(self, offset: int, session: Session, request_id: int, count: int) -> None:
        """Send PUB_ACK(count) for ``request_id`` once the log holds ``offset``."""
        self._waiters.append((offset, session, request_id, count))
        self._wake.set()

    async def run(self) -> None:
        self._last_sync = trio.current_time()
        while True:
            if not self.wal.pending_records:
                timeout = math.inf
                if self._unsynced and self.policy.kind == "interval_ms":
                    due = self._last_sync + self.policy.value / 1000
                    timeout = max(0.0, due - trio.current_time())
                with trio.move_on_after(timeout):
                    await self._wake.wait()
                self._wake = trio.Event()
                if not self.wal.pending_records:
                    if self._unsynced and self.policy.kind == "interval_ms":
                        await self._sync_written()
                    continue
            await self.flush_once()

    async def flush_once(self, force_sync: bool = False) -> None:
        batch = self.wal.take_batch()
        if batch is None:
            if force_sync and self._unsynced:
                await self._sync_written()
            return
        elapsed_ms = int((trio.current_time() - self._last_sync) * 1000)
        sync = force_sync or self.policy.sync_now(self._unsynced + batch.records, elapsed_ms)
        try:
            await trio.to_thread.run_sync(batch.write, self.wal.disk, sync)
        except OSError as exc:
            self.wal.abort(batch)
            self.counters.failures += 1
            self.counters.records_lost += batch.records
            if not self.failing:
                log.error("write-ahead log write failed: %s; %d record(s) not stored",
                          exc.strerror or exc, batch.records)
            self.failing = True
            self._settle(batch.last_offset, f"the log could not be written: {exc.strerror or exc}")
            return
        if self.failing:
            log.warning("write-ahead log writes succeed again")
            self.failing = False
        self.wal.commit(batch)
        c = self.counters
        c.batches += 1
        c.records += batch.records
        c.bytes += sum(len(part.data) for part in batch.parts)
        if sync:
            c.fsyncs += 1
            self._unsynced = 0
            self._last_sync = trio.current_time()
        else:
            self._unsynced += batch.records
        self._settle(batch.last_offset, None)
        if self.on_commit is not None:
            self.on_commit()

    async def _sync_written(self) -> None:
        seg = self.wal.segments[-1] if self.wal.segments else None
        if seg is None or not seg.created:
            self._unsynced = 0
            return
        try:
            await trio.to_thread.run_sync(self.wal.disk.fsync, seg.path)
        except OSError as exc:
            self.counters.failures += 1
            log.error("write-ahead log fsync failed: %s", exc.strerror or exc)
            return
        self.counters.fsyncs += 1
        self._unsynced = 0
        self._last_sync = trio.current_time()

    def _settle(self, through: int, failure: str | None) -> None:
        """Answer every waiting publisher whose records are at or below ``through``."""
        waiters = self._waiters
        while waiters and waiters[0][0] <= through:
            _, session, request_id, count = waiters.popleft()
            if failure is None:
                session.send(codec.PubAck(count, request_id))
            else:
                session.error(ErrorCode.STORAGE, failure, request_id)
                session.send(codec.PubAck(0, request_id))

    async def close(self) -> None:
        """Shutdown: write and fsync whatever is left, whatever the policy."""
        while self.wal.pending_records:
            await self.flush_once(force_sync=True)
            if self.failing:
                break
        if self._unsynced:
            await self._sync_written()
        self.wal.close()
