"""The frames connections are part way through reading, bounded together.

A connection reads its peer's frames into its decoder, and a large frame stays there until
its last byte came: 50 connections each sending an 8 MiB batch would hold 400 MiB however
slowly they send. Each connection may hold up to ``FREE`` bytes of an incomplete frame on
its own; a larger one is read only with a grant of its whole declared size from the
broker's ``server.max_reading_bytes``. A connection that must wait stops reading (TCP
pushes back on its peer) until others' large frames are complete. A grant always covers a
whole frame, so a holder never waits for another connection: it only needs its own peer's
bytes, and the bound cannot deadlock. Grants are made in the order they were asked for.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import trio

from blipmq_server.counters import ConnectionCounters

FREE = 65536  # bytes of an incomplete frame a connection holds without a grant


class Partial(Protocol):
    """What a reader's decoder (native or MQTT) says of the frame it is part way through."""

    @property
    def buffered(self) -> int: ...

    @property
    def wanted(self) -> int: ...


class Intake:
    """The broker's budget for large frames in progress (``max_reading_bytes``, at least
    the largest frame) and who holds what of it; grants are by connection id."""

    __slots__ = ("_queue", "capacity", "counters", "held", "used")

    def __init__(self, capacity: int, counters: ConnectionCounters) -> None:
        self.capacity = capacity
        self.counters = counters
        self.used = 0
        self.held: dict[int, int] = {}  # connection id -> bytes granted
        self._queue: deque[tuple[int, int, trio.Event]] = deque()  # (conn, size, granted)

    def take(self, conn: int, size: int) -> bool:
        """Grant ``conn`` ``size`` bytes now (what it held is given back first), or say it
        must ``wait``. Nobody jumps the queue."""
        self.give_back(conn)
        size = min(size, self.capacity)
        if self._queue or self.used + size > self.capacity:
            return False
        self.used += size
        self.held[conn] = size
        return True

    async def wait(self, conn: int, size: int) -> None:
        """Queue for ``size`` bytes and return once granted. A cancelled waiter leaves the
        queue; one granted as it was cancelled keeps its grant until ``give_back``."""
        self.counters.reading_waits += 1
        granted = trio.Event()
        entry = (conn, min(size, self.capacity), granted)
        self._queue.append(entry)
        try:
            await granted.wait()
        finally:
            if not granted.is_set():
                self._queue.remove(entry)
                self._grant()  # one that waited behind it may fit now

    def give_back(self, conn: int) -> None:
        """``conn`` finished its large frame, or closed."""
        size = self.held.pop(conn, 0)
        if size:
            self.used -= size
            self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue and self.used + queue[0][1] <= self.capacity:
            conn, size, granted = queue.popleft()
            self.used += size
            self.held[conn] = size
            granted.set()
