"""Group commit: one write, and by policy one sync, for every append since the last batch.

Publishers append to the log in memory (``Broker.publish``) and wake the flusher. The
flusher takes everything appended so far as one batch and writes it in a worker thread
(``trio.to_thread``), so the event loop never waits on the disk; appends arriving meanwhile
form the next batch. A sync (``Log.take_sync`` / ``Batch.plan``) fsyncs every segment file
written since the last one, and the directory after a file was created, in one trip to a
worker thread.

When a batch is synced (docs/OPERATIONS.md, "Durability"):

- ``always``: when a QoS 1 publisher waits on one of its records (``confirm_later`` is called
  in the same synchronous step as the append, before the flusher can take the batch), when
  it fills a segment (a sealed segment is durable), and otherwise at the latest
  ``unconfirmed_sync_ms`` after the first write nobody waited on (QoS 0 messages, group and
  ack records);
- ``every_n:N`` / ``interval_ms:M``: as the policy says; ``none``: only at shutdown.

A batch nobody waits for (no QoS 1 publisher, no sync wanted, no message in it for a
consumer reading the log's tail, ``tailing``, and acks of less than half a consumer's window,
``acks_due``: a bridge draining a backlog acks hundreds of times a second) is held back up
to ``LINGER_S`` while it stays small: a trip to a worker
thread costs the process 200-600 us of CPU on a small machine (``trio.to_thread``, the
thread's wake-up, the report back through the event loop), so at low rates QoS 0 traffic
would otherwise pay it every few messages. A publisher that starts waiting, or a batch that
grows to ``LINGER_RECORDS`` records or ``LINGER_BYTES`` bytes, ends the linger at once.

Appends do not wait for the disk, so a flood of publishes faster than it would hold ever
more records in memory. Readers ask ``room`` before each read: while more than
``wal.max_unwritten_bytes`` of records wait for a batch, they wait until the flusher takes
them, so memory holds at most that twice (the pending records, and the batch being written)
plus the frame each connection is reading, and TCP pushes back on the publishers.

After a batch lands (and, under ``always``, is synced), QoS 1 publishers whose records it
held get their PUB_ACK, in offset order; if the disk fails, they get ERROR STORAGE instead
and the broker keeps serving (the next batch tries the disk again). A batch is landed only
once its files were found where a restart reads them (``Batch.write``): files deleted under
the broker are written back first; the segments that could not be leave the log, with one
line, and ``on_restored`` restates what they held. ``close`` waits for the
batch in flight, then writes and syncs what is left, whatever the policy.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from operator import itemgetter
from typing import Protocol

import trio

from blipmq_server.counters import WalCounters
from blipmq_server.server import heap
from blipmq_server.wal.disk import Restored
from blipmq_server.wal.log import Batch, Log, Segment, Sync
from blipmq_server.wal.policy import FsyncPolicy


class Waiter(Protocol):
    """What waits on the flusher: a session (its QoS 1 confirms) or one reply it holds
    back until the log holds what the reply stands for (``session.HeldReply``)."""

    def confirmed(self, request_id: int, count: int) -> None: ...

    def confirm_failed(self, request_id: int, count: int, text: str) -> None: ...


log = logging.getLogger("blipmq.wal")
_offset = itemgetter(0)
LINGER_S = 0.2  # longest a batch nobody waits for is held back to grow (docs/PERFORMANCE.md)
LINGER_RECORDS = 8192  # ... unless it holds this many records (docs/PERFORMANCE.md)
LINGER_BYTES = 1 << 20  # ... or this many bytes
RETRY_S = 0.2  # after a failed write or sync, before the next try
TRIM_BATCH_BYTES = 4 << 20  # a batch this big: the heap is trimmed once the log is idle
FAILING_UNWRITTEN = 64 << 10  # the input bound while the disk refuses writes


class Flusher:
    def __init__(
        self,
        wal: Log,
        policy: FsyncPolicy,
        on_commit: Callable[[], None] | None = None,
        unconfirmed_sync_ms: int = 1000,
        tailing: Callable[[], bool] | None = None,
        acks_due: Callable[[], bool] | None = None,
        on_lost: Callable[[int, int], None] | None = None,
        on_restored: Callable[[list[Segment]], None] | None = None,
    ) -> None:
        self.wal = wal
        self.policy = policy
        self.on_commit = on_commit  # new records are readable (durable groups may deliver)
        self.tailing = tailing  # does a consumer wait for new records to become readable?
        self.acks_due = acks_due  # do the pending acks hold enough to go now (the core says)?
        # the disk refused the records first..last: the core restates what they said
        self.on_lost = on_lost
        # segments deleted under the broker left the log: the core restates what they held
        self.on_restored = on_restored
        self.unconfirmed_sync = unconfirmed_sync_ms / 1000
        self.counters = WalCounters()
        self._wake = trio.Event()
        self._hurry = trio.Event()  # ends a linger: a waiter, a big batch, shutdown
        self._waiters: deque[tuple[int, Waiter, int, int]] = deque()  # by offset
        self._lock = trio.Lock()  # one batch or sync at a time
        self._closing = False
        self._last_sync = 0.0
        self._unsynced_since: float | None = None  # first write not synced yet
        self._sync_wanted = False  # a waiter's records are written but not synced yet
        self._look = False  # check the log's files with nothing to write (``look``)
        self._lingering = False  # run() holds a small batch back (ended by _hurry)
        self._taken: trio.Event | None = None  # readers wait for the next batch (``room``)
        self.failing = False
        self.holding = False  # readers wait whatever is pending (``hold``)
        self._trim = False  # a big batch was written: trim the heap once idle

    def trim_soon(self) -> None:
        """Much memory was let go of elsewhere (log cursors that ended): trim the heap once
        the log is idle, as after a big batch."""
        self._trim = True
        self._wake.set()

    def appended(self) -> None:
        self._wake.set()
        if self._grown() or (self._lingering and self._awaited()):
            self._hurry.set()  # a lingering batch now holds what somebody waits for

    def full(self, limit: int) -> bool:
        """More than ``limit`` bytes of appended records wait for a batch (while the disk
        refuses writes, more than ``FAILING_UNWRITTEN``: the batch that tries again must
        be small enough for the room retention can make, see ``Log.release_reserve``), or
        readers are held (``hold``)."""
        return self.holding or self.wal.pending_bytes > (
            min(limit, FAILING_UNWRITTEN) if self.failing else limit)

    def hold(self) -> None:
        """Readers wait before their next read until ``let_go``, whatever is pending: the
        room the log's reserve made on a full disk is for retention's records, and a flood
        read meanwhile would take it first."""
        self.holding = True

    def let_go(self) -> None:
        self.holding = False
        if self._taken is not None:
            self._taken.set()  # the readers ``room`` holds look again
            self._taken = None

    async def room(self, limit: int) -> None:
        """Wait until ``full`` says no (the flusher took a batch): a reader's back-pressure
        when publishers outrun the disk."""
        if self.full(limit):
            self.counters.read_waits += 1
        while self.full(limit):  # each turn waits for a batch to be taken
            if self._taken is None:
                self._taken = trio.Event()
            self.appended()  # it is past lingering's size: no reason to hold it back
            await self._taken.wait()

    def _grown(self) -> bool:
        """What is pending is big enough to go without lingering."""
        wal = self.wal
        return wal.pending_records >= LINGER_RECORDS or wal.pending_bytes >= LINGER_BYTES

    def confirm_later(
        self, offset: int, session: Waiter, request_id: int, count: int, first: int = 0
    ) -> None:
        """Send PUB_ACK(count) for ``request_id`` once the log holds ``offset`` (durably,
        under ``always``). ``first`` is the publisher's first record: one that waited for
        room may have had some records in a batch the disk refused meanwhile, before it
        asked; then it gets ERROR STORAGE and PUB_ACK 0 at once."""
        if first and self.wal.lost_between(first, offset):
            session.confirm_failed(request_id, count, "the log could not store some of these "
                                   "messages (a write failed while the publisher waited for "
                                   "room)")
            return
        if offset <= self._confirmable():
            session.confirmed(request_id, count)
            return
        entry = (offset, session, request_id, count)
        waiters = self._waiters
        if waiters and offset < waiters[-1][0]:  # a publisher that waited for room
            bisect.insort(waiters, entry, key=_offset)
        else:
            waiters.append(entry)
        if offset <= self.wal.written_offset:  # written already, by a batch nobody awaited
            self._sync_wanted = True
        self._wake.set()
        self._hurry.set()

    def _confirmable(self) -> int:
        """The highest offset a confirm may be sent for."""
        wal = self.wal
        return wal.synced_offset if self.policy.confirms_after_fsync else wal.written_offset

    def durable(self, offset: int) -> bool:
        """Whether a confirm for ``offset`` may go out now (the log holds it, durably under
        ``always``)."""
        return offset <= self._confirmable()

    def _awaited(self) -> bool:
        """Pending messages a consumer reading the log's tail waits for, or acks the core
        wants written now."""
        return bool((self.wal.pending_messages and self.tailing is not None and self.tailing())
                    or (self.acks_due is not None and self.acks_due()))

    def _may_linger(self) -> bool:
        """Nobody waits for what is pending, and it is small: let it grow a little."""
        return (not self._waiters and not self._sync_wanted and not self._closing
                and not self._grown() and not self._awaited())

    def _sync_due(self) -> float:
        """When what is written but not synced must be synced (trio time; inf: not by time)."""
        if not self.wal.unsynced:
            return math.inf
        kind = self.policy.kind
        if kind == "always":
            since = self._unsynced_since
            return trio.current_time() if since is None else since + self.unconfirmed_sync
        if kind == "interval_ms":
            return self._last_sync + self.policy.value / 1000
        return math.inf

    def _sync_batch(self, batch: Batch) -> bool:
        """Should this batch be synced as it is written?"""
        now = trio.current_time()
        waiters = self._waiters
        since = self._unsynced_since
        return self.policy.sync_now(
            self.counters.unsynced + batch.records,
            int((now - self._last_sync) * 1000),
            awaited=(bool(waiters) and waiters[0][0] <= batch.last_offset) or self._sync_wanted
            or batch.seals,
            ms_unsynced=0 if since is None else int((now - since) * 1000),
            unconfirmed_sync_ms=int(self.unconfirmed_sync * 1000),
        )

    async def run(self) -> None:
        self._last_sync = trio.current_time()
        if self.wal.unsynced:  # what the last run wrote may not be on stable storage
            self._unsynced_since = self._last_sync
        while True:
            if not self.wal.pending_records and not self._sync_wanted and not self._look:
                if self._trim:  # a flood is over: what its batches held goes back
                    self._trim = False
                    await trio.to_thread.run_sync(heap.trim)
                    continue  # appends may have come meanwhile
                timeout = max(0.0, self._sync_due() - trio.current_time())
                with trio.move_on_after(timeout):
                    await self._wake.wait()
                self._wake = trio.Event()
            if self.wal.pending_records and self._may_linger():
                self._hurry = trio.Event()  # what hurried an earlier batch is settled
                self._lingering = True
                with trio.move_on_after(LINGER_S):
                    await self._hurry.wait()
                self._lingering = False
            if self._closing:
                return
            if self.failing:
                # the last write failed: the next try waits a little, so a disk that stays
                # full is not tried in a loop (what ``on_lost`` restated is pending again)
                await trio.sleep(RETRY_S)
                if self._closing:
                    return
            # Not ``async with``: acquiring yields, and the batch should be taken now. Only
            # close() takes the lock otherwise, and it sets _closing first.
            self._lock.acquire_nowait()
            try:
                if self.wal.pending_records:
                    await self.flush_once()
                elif self._sync_wanted or trio.current_time() >= self._sync_due():
                    await self.sync()
                elif self._look:
                    await self._check()
            finally:
                self._lock.release()

    def look(self) -> None:
        """Check soon, with nothing to write, that the log's files are where a restart reads
        them, and write back what was deleted (each batch and sync checks anyway: this is
        for a broker that writes nothing for a while, asked at each maintenance round)."""
        self._look = True
        self._wake.set()

    async def _check(self) -> None:
        self._look = False
        plan = Sync([], None, self.wal.directory)  # nothing to fsync: the check alone
        try:
            await trio.to_thread.run_sync(plan.run, self.wal.disk, abandon_on_cancel=True)
        except OSError as exc:
            exc.__traceback__ = None  # as in ``flush_once``
            self.counters.failures += 1
            self._failed(exc, "files of the log deleted under the broker are not written back")
        if plan.restored is not None:
            await self._restored(plan.restored)

    async def flush_once(self, force_sync: bool = False) -> None:
        """Write one batch (syncing it by policy, or if ``force_sync``); with nothing to
        write and ``force_sync``, sync what is written."""
        batch = self.wal.take_batch()
        if self._taken is not None:
            self._taken.set()  # readers held back for room may read again
            self._taken = None
        if batch is None:
            if force_sync:
                await self.sync()
            return
        sync = force_sync or self._sync_batch(batch)
        try:
            # abandon_on_cancel: only shutdown cancels this task, once its deadline passed;
            # a write still stuck then ends with the process, and recovery handles the rest.
            await trio.to_thread.run_sync(batch.write, self.wal.disk, sync,
                                          abandon_on_cancel=True)
        except OSError as exc:
            # its traceback holds the worker's frames, and through them the batch's bytes, in
            # a reference cycle only a full collection frees: not kept, a retry at a time
            exc.__traceback__ = None
            self.wal.abort(batch)
            self.counters.failures += 1
            self.counters.records_lost += batch.records
            self._failed(exc, f"{batch.records} record(s) not stored")
            if self.on_lost is not None:
                self.on_lost(batch.first_offset, batch.last_offset)
            self._settle(batch.last_offset, f"the log could not be written: {exc.strerror or exc}")
            if batch.restored is not None or isinstance(exc, FileNotFoundError):
                await self._restored(batch.restored)
            return
        if self.failing:
            log.warning("write-ahead log writes succeed again")
            self.failing = False
        self.wal.commit(batch)
        c = self.counters
        c.batches += 1
        c.records += batch.records
        size = sum(len(part.data) for part in batch.parts)
        c.bytes += size
        if size >= TRIM_BATCH_BYTES:
            self._trim = True
        if batch.synced:
            self._synced(batch.plan.calls)
        else:
            self.counters.unsynced += batch.records
            if self._unsynced_since is None:
                self._unsynced_since = trio.current_time()
        if batch.restored is not None:  # the log as it is now, before anybody hears of it
            await self._restored(batch.restored)
        self._settle(self._confirmable(), None)
        if self._waiters and self._waiters[0][0] <= self.wal.written_offset:
            self._sync_wanted = True  # a publisher started waiting once its batch was taken
        if self.on_commit is not None:
            self.on_commit()

    async def sync(self) -> None:
        """fsync everything written and not synced yet (segments, directory), in one go."""
        plan = self.wal.take_sync()
        if plan is None:
            self._synced(0)
            return
        try:
            await trio.to_thread.run_sync(plan.run, self.wal.disk, abandon_on_cancel=True)
        except OSError as exc:
            exc.__traceback__ = None  # as in ``flush_once``
            self.wal.sync_failed(plan)
            self.counters.failures += 1
            self._failed(exc, "written records are not synced")
            self._sync_wanted = False  # retried by the next batch or the timer, not at once
            self._unsynced_since = trio.current_time()
            self._settle(self.wal.written_offset,
                         f"the log could not be synced: {exc.strerror or exc}")
            if plan.restored is not None or isinstance(exc, FileNotFoundError):
                await self._restored(plan.restored)
            return
        self.wal.synced(plan)
        self._synced(plan.calls)
        if plan.restored is not None:
            await self._restored(plan.restored)
        self._settle(self._confirmable(), None)

    async def _restored(self, restored: Restored | None) -> None:
        """Files of the log were deleted under the broker (what ``restored`` wrote back, or
        a file not found): the segments whose files are gone leave the log, one line says
        what happened, and ``on_restored`` restates what those segments held."""
        wal = self.wal
        if restored is not None and not (restored.made or restored.names):
            restored = None  # a file retention closed and deleted meanwhile: nothing put back
        gone = wal.drop(await trio.to_thread.run_sync(wal.missing))
        if restored is None and not gone:
            return
        self.counters.restores += 1
        lost = sum(seg.count for seg in gone)
        (log.error if lost else log.warning)("write-ahead log: %s",
                                             deleted_line(wal.directory, restored, gone))
        if self.on_restored is not None and gone:
            self.on_restored(gone)

    def _synced(self, calls: int) -> None:
        c = self.counters
        if calls:
            c.syncs += 1
            c.fsyncs += calls
        self.counters.unsynced = 0
        self._last_sync = trio.current_time()
        self._unsynced_since = None
        self._sync_wanted = False

    def _failed(self, exc: OSError, what: str) -> None:
        if not self.failing:
            log.error("write-ahead log write failed: %s; %s", exc.strerror or exc, what)
        self.failing = True

    def _settle(self, through: int, failure: str | None) -> None:
        """Answer every waiting publisher whose records are at or below ``through``."""
        waiters = self._waiters
        while waiters and waiters[0][0] <= through:
            _, session, request_id, count = waiters.popleft()
            if failure is None:
                session.confirmed(request_id, count)
            else:
                session.confirm_failed(request_id, count, failure)

    async def close(self, timeout: float) -> bool:
        """Shutdown, once nothing appends any more: wait for the batch in flight, then write
        and sync whatever is left, whatever the policy, within ``timeout`` seconds.

        Returns whether everything appended is written and synced. The files are closed
        unless the deadline passed (a write may then still run in its worker thread).
        """
        self._closing = True
        self._wake.set()
        self._hurry.set()
        with trio.move_on_after(timeout) as deadline:
            async with self._lock:
                while self.wal.pending_records:
                    await self.flush_once(force_sync=True)
                    if self.failing:
                        break
                await self.sync()
        if deadline.cancelled_caught:
            return False
        done = not self.wal.pending_records and not self.wal.unsynced
        self.wal.close()
        return done


def deleted_line(directory: str, restored: Restored | None, gone: list[Segment]) -> str:
    """What was deleted under the broker, what was put back and what is lost, in one line."""
    back = restored.names if restored is not None else ()
    size = restored.size if restored is not None else 0
    if restored is not None and restored.made:
        said = f"{directory} was deleted while the broker ran: made it again"
        if back:
            said += f", and wrote {', '.join(back)} back ({size} bytes, all written to it)"
    elif back:
        said = (f"{', '.join(back)} was deleted while the broker ran: written back ({size} "
                "bytes, all written to it)")
    else:
        said = f"{', '.join(os.path.basename(seg.path) for seg in gone)} was deleted while " \
               "the broker ran"
    if gone and (back or (restored is not None and restored.made)):
        said += f"; {len(gone)} older segment file(s) went with it"
    held = [seg for seg in gone if seg.count]
    if held:
        said += (f"; their {sum(seg.count for seg in held)} record(s), offsets "
                 f"{min(seg.first for seg in held)} to {max(seg.last for seg in held)}, "
                 "are lost")
    return said
