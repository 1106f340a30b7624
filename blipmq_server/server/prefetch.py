"""Disk reads for log cursors, off the event loop.

A cursor (durable group, QoS 1 subscription, replay) whose next records are no longer in the
log's recent-records cache gets nothing from ``Broker.take``; the core queues a ``Fetch``
instead. The session that asked hands the fetches here; one task reads them in a worker
thread, one at a time (``Log.read_files`` is safe there), and gives the records back to the
core with ``Broker.fill``, which names the connections to wake. Each cursor has at most one
read under way, asked for when half a read's records are left in its read-ahead (so two
reads of ``READ_AHEAD_BYTES`` at most in memory), so memory stays bounded however far behind
a consumer is; all cursors together hold at most ``wal.read_ahead_bytes`` (``broker.budget``:
past it the least recently used let go of theirs, and read again when their consumer takes).

The same task counts the backlog of durable groups that start behind the end of the log
(``Count``: a group created to replay, every group after a restart, a group retention
skipped) with a ``broker.tally.Tally``: one pass over the segment files for every count
waiting, from the lowest position on, a read's worth of records (``READ_AHEAD_*``) at a
time in a worker thread. A consumer's read always goes first: it waits for at most the one
step of counting under way, never for the counting (after a restart that once read the
log once per group, the reads waiting behind it all: 28 s until a reconnecting session got
its backlog, with 200 sessions and 200,000 records in the log).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from blipmq_server.broker.core import Broker
from blipmq_server.broker.results import Count, Fetch
from blipmq_server.broker.storage import READ_AHEAD_BYTES, READ_AHEAD_RECORDS
from blipmq_server.broker.tally import Tally
from blipmq_server.errors import WalError
from blipmq_server.wal.log import Log

log = logging.getLogger("blipmq.wal")
_RETRY_S = 0.5  # after a failed read, before the cursor asks again
_WRITTEN_WAIT_S, _WRITTEN_WAITS = 0.01, 200  # a pass waits for its records' write: 2 s at most


class Prefetcher:
    def __init__(self, wal: Log, broker: Broker, wake: Callable[[frozenset[int]], None]) -> None:
        self.wal = wal
        self.broker = broker
        self.wake = wake
        # one at most per cursor: a cursor asks again only after its last read was filled
        self._fetches: deque[Fetch] = deque()
        self._counts: list[Count] = []  # not in a pass yet
        self._tally: Tally | None = None  # the counting pass under way
        self._waits = 0  # steps of the pass spent waiting for records to be written
        self._work = trio.Event()
        self.reads = 0
        self.failures = 0
        self._failing = False

    def request(self, fetches: list[Fetch] | list[Count]) -> None:
        for fetch in fetches:
            if isinstance(fetch, Count):
                self._counts.append(fetch)
            else:
                self._fetches.append(fetch)
        self._work.set()

    async def run(self) -> None:
        while True:
            if self._fetches:
                await self._read(self._fetches.popleft())
            elif self._tally is not None or self._counts:
                await self._count_step()
            else:
                self._work = trio.Event()
                await self._work.wait()

    async def _read(self, fetch: Fetch) -> None:
        try:
            records = await trio.to_thread.run_sync(
                self.wal.read_files, fetch.offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES)
        except (OSError, WalError) as exc:
            exc.__traceback__ = None  # the worker's frames, and what they read: not kept
            # a segment retention deleted meanwhile, or a disk fault: an empty read moves
            # a cursor that fell below the log's start; otherwise it asks again later
            self.failures += 1
            if self.wal.first_offset <= fetch.offset:  # a fault, not a removed segment
                if not self._failing:
                    log.error("log read for a consumer failed: %s; retrying", exc)
                    self._failing = True
                await trio.sleep(_RETRY_S)
            records = []
        else:
            self.reads += 1
            if self._failing:
                log.info("log reads for consumers succeed again")
                self._failing = False
        self.wake(self.broker.fill(fetch.key, records))

    async def _count_step(self) -> None:
        """One read's worth of the counting pass (a new pass takes every count waiting;
        a pass under way takes those that start where it has not read yet)."""
        tally = self._tally
        if tally is None:
            tally = self._tally = Tally(self._counts)
            self._counts = []
            self._waits = 0
        elif self._counts:
            self._counts = [c for c in self._counts if not tally.add(c)]
        wal = self.wal
        if tally.position > tally.last:
            self._end_pass()
            return
        if tally.position > wal.written_offset:
            # a recount after retention reaches records still in the write buffer: the
            # flusher writes them in a few ms; bounded, should the disk fail
            self._waits += 1
            if self._waits > _WRITTEN_WAITS:
                self._end_pass()
                return
            self._work = trio.Event()
            with trio.move_on_after(_WRITTEN_WAIT_S):
                await self._work.wait()  # a consumer's read goes first meanwhile
            return
        at = tally.position
        try:
            read = await trio.to_thread.run_sync(self._count_read, tally)
        except (OSError, WalError) as exc:
            exc.__traceback__ = None
            if at < wal.first_offset:  # retention removed the segment: no backlog there
                tally.position = max(tally.position, wal.first_offset)
                return
            log.warning("counting durable groups' backlogs stopped at offset %d: %s; "
                        "their backlog figures are low until they read on", at, exc)
            self._end_pass()
            return
        self._hand_back(tally.take_done())
        if not read:  # nothing more in the log
            self._end_pass()

    def _count_read(self, tally: Tally) -> bool:
        """Blocking: the pass's next records, counted; False when the log had none."""
        records = self.wal.read_files(tally.position, READ_AHEAD_RECORDS, READ_AHEAD_BYTES)
        tally.feed(records)
        return bool(records)

    def _end_pass(self) -> None:
        assert self._tally is not None
        self._hand_back(self._tally.finish())
        self._tally = None

    def _hand_back(self, done: list[tuple[Count, int]]) -> None:
        for count, n in done:
            self.broker.counted(count.key, n, count.epoch)
