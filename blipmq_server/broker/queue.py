"""A subscription's bounded queue and its overflow policy.

One ``Queue`` exists per ephemeral subscription and per consumer group. Items are
``(delivery_record, expires_at_ms)`` pairs: the record is encoded once at publish and shared
by every queue it lands in, so fan-out costs one append per subscriber. A queue is bounded
twice: ``capacity`` messages and ``capacity_bytes`` of records (an empty queue still takes
one message of any accepted size).

``block`` means backpressure from a consumer that is there: a queue without consumers (a
group whose members all left) keeps its newest messages up to its bounds and drops the
oldest, counted apart as ``dropped_no_consumer``.

A new subscription's retained values are not in ``items``: ``retained`` lists the topics
whose values are still to send (topic -> the value's offset: no record, the value is looked
up in the store when taken), in the order ``Retained.matching`` gave them at subscribe time,
and ``Broker.take`` takes from it before ``items``. So a subscription gets every retained
value its filter matched, paced by its reader, whatever the queue's bounds, and live
messages published meanwhile come after them. A value replaced or cleared while still
listed leaves the list: the broker puts it at the front of ``items`` then, counted in the
queue's bounds like any message (``Broker.publish``), so the list holds no byte the store
does not.

The queues one connection reads from hold ``max_bytes_per_connection`` together as well:
each queue's ``pools`` lists the ``Pool`` of each of its consumers' connections (a group's
queue counts whole for every member), and every change of ``size`` is made to them too. A
connection may otherwise make as many subscriptions as ``server.max_subscriptions`` lets it
and read none. Pure and synchronous; no trio.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import StrEnum
from typing import Any

Item = tuple[bytes, int]  # (delivery record, expires_at_ms; 0 = never)


class Overflow(StrEnum):
    DROP_OLDEST = "drop_oldest"
    DROP_NEW = "drop_new"
    BLOCK = "block"


class Pool:
    """The bytes waiting in the queues of one connection, all together."""

    __slots__ = ("blocking", "queues", "size")

    def __init__(self) -> None:
        self.size = 0  # the ``size`` of every queue it reads from, summed
        self.queues = 0  # how many it reads from (the pool goes with the last)
        # the queues that held publishers back for this pool's room: released by a take
        self.blocking: set[int] = set()



class Queue:
    """Messages waiting for one subscription (or one group), in publish order."""

    durable = False  # see broker.durable.DurableGroup for the log-backed kind

    __slots__ = (
        "capacity",
        "capacity_bytes",
        "consumers",
        "dropped_new",
        "dropped_no_consumer",
        "dropped_oldest",
        "dropped_ttl",
        "expiring",
        "filter",
        "group",
        "id",
        "items",
        "levels",
        "overflow",
        "pools",
        "retained",
        "size",
    )

    def __init__(
        self, queue_id: int, topic_filter: str, group: str | None, capacity: int,
        overflow: Overflow, capacity_bytes: int = 1 << 62,
    ) -> None:
        self.id = queue_id
        self.filter = topic_filter
        self.levels = tuple(topic_filter.split("/"))
        self.group = group
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.overflow = overflow
        self.items: deque[Item] = deque()
        self.size = 0  # bytes of the records in ``items``
        # topics whose retained values are still to send, before ``items`` (a subscription's
        # start): topic -> the offset of its value then
        self.retained: OrderedDict[bytes, int] = OrderedDict()
        self.consumers: list[Any] = []  # Consumer objects (see broker.core)
        self.pools: list[Pool] = []  # of its consumers' connections (``Registry.add``)
        self.expiring = False  # some item may carry an expiry: the ticker scans this queue
        self.dropped_oldest = 0
        self.dropped_new = 0
        self.dropped_no_consumer = 0
        self.dropped_ttl = 0

    def __repr__(self) -> str:
        return f"Queue({self.filter!r}, group={self.group!r}, depth={len(self.items)})"

    @property
    def backlog(self) -> int:
        """What waits to be taken: the retained values still to send and the items."""
        return len(self.retained) + len(self.items)

    @property
    def name(self) -> str:
        """How errors and logs name it: by group when it has one."""
        if self.group:
            return f"group {self.group!r} on {self.filter!r}"
        return f"subscription on {self.filter!r}"

    def fits(self, size: int) -> bool:
        """Whether a record of ``size`` bytes can be added without dropping anything."""
        items = self.items
        return len(items) < self.capacity and (not items or self.size + size <= self.capacity_bytes)

    def over(self, size: int, limit: int) -> bool:
        """Whether ``size`` more bytes would take a pool of its past ``limit`` (an empty
        pool takes one message of any size, as an empty queue does)."""
        return any(p.size and p.size + size > limit for p in self.pools)

    def shrink(self, n: int) -> None:
        """``n`` bytes of its items went: off its size and its pools'."""
        self.size -= n
        for pool in self.pools:
            pool.size -= n

    def make_room(self, size: int, limit: int = 0) -> int:
        """Drop the oldest items until a record of ``size`` bytes fits, in its own bounds
        and (``limit`` not 0) in its pools'; returns how many."""
        items = self.items
        n = 0
        while items and (not self.fits(size) or (limit and self.over(size, limit))):
            self.shrink(len(items.popleft()[0]))
            n += 1
        return n

    def frees(self, size: int, limit: int) -> bool:
        """Whether dropping all its items would let a pool of its take ``size`` more bytes."""
        return not any(p.size - self.size and p.size - self.size + size > limit
                       for p in self.pools)

    def purge_expired(self, now_ms: int) -> int:
        """Remove every expired item; returns how many. Clears ``expiring`` when none are left."""
        if not self.expiring:
            return 0
        before = len(self.items)
        kept = [it for it in self.items if not (it[1] and it[1] <= now_ms)]
        removed = before - len(kept)
        if removed:
            self.items = deque(kept)
            self.shrink(self.size - sum(len(it[0]) for it in kept))
            self.dropped_ttl += removed
        self.expiring = any(it[1] for it in kept)
        return removed
