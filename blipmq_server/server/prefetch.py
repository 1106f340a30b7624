"""Disk reads for log cursors, off the event loop.

A cursor (durable group, QoS 1 subscription, replay) whose next records are no longer in the
log's recent-records cache gets nothing from ``Broker.take``; the core queues a ``Fetch``
instead. The session that asked hands the fetches here; one task reads them in a worker
thread, one at a time (``Log.read_files`` is safe there), and gives the records back to the
core with ``Broker.fill``, which names the connections to wake. Each cursor has at most one
read under way, asked for when half a read's records are left in its read-ahead (so two
reads of ``READ_AHEAD_BYTES`` at most in memory), so memory stays bounded however far behind
a consumer is.

The same task counts the backlog of durable groups that start behind the end of the log
(``Count``: a group created to replay, every group after a restart), reading the segment
files from the group's position once, in a worker thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from blipmq_server.broker.core import Broker
from blipmq_server.broker.results import Count, Fetch
from blipmq_server.broker.storage import READ_AHEAD_BYTES, READ_AHEAD_RECORDS
from blipmq_server.errors import WalError
from blipmq_server.wal.log import Log

log = logging.getLogger("blipmq.wal")
_RETRY_S = 0.5  # after a failed read, before the cursor asks again
_WRITTEN_WAIT_S, _WRITTEN_WAITS = 0.01, 200  # a count waits for its records' write: 2 s at most


class Prefetcher:
    def __init__(self, wal: Log, broker: Broker, wake: Callable[[frozenset[int]], None]) -> None:
        self.wal = wal
        self.broker = broker
        self.wake = wake
        # unbounded in type only: a cursor asks again only after its last read was filled
        self._send, self._receive = trio.open_memory_channel[Fetch | Count](math.inf)
        self.reads = 0
        self.failures = 0
        self._failing = False

    def request(self, fetches: list[Fetch] | list[Count]) -> None:
        for fetch in fetches:
            self._send.send_nowait(fetch)

    def _count(self, count: Count) -> int:
        """Blocking: messages of the group's topics from ``count.first`` to ``count.last``."""
        n = 0
        offset = count.first
        while offset <= count.last:
            try:
                records = self.wal.read_files(offset, READ_AHEAD_RECORDS, READ_AHEAD_BYTES)
            except (OSError, WalError):
                break  # retention removed the segment: those records are no backlog
            if not records:
                break
            n += self.broker.count_matching(count.key, records, count.last)
            offset = records[-1].offset + 1
        return n

    async def run(self) -> None:
        async for fetch in self._receive:
            if isinstance(fetch, Count):
                # a recount after retention reaches records still in the write buffer: let
                # the flusher write them first (a few ms; bounded, should the disk fail)
                for _ in range(_WRITTEN_WAITS):
                    if self.wal.written_offset >= fetch.last:
                        break
                    await trio.sleep(_WRITTEN_WAIT_S)
                n = await trio.to_thread.run_sync(self._count, fetch)
                self.broker.counted(fetch.key, n, fetch.epoch)
                continue
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
