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
and read none. All the queues together hold ``max_bytes_total`` (their ``total``, one
``Pool`` for all): past it a connection holding its share of it or more (the total over
the connections with a pool) takes no more, so whoever holds the most waits or drops, not
those that keep up, and a queue nobody reads drops its oldest. Pure and synchronous; no
trio.
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
    """The bytes waiting in the queues of one connection, all together (or in every queue:
    a queue's ``total``)."""

    __slots__ = ("blocking", "limit", "queues", "size")

    def __init__(self, limit: int = 1 << 62) -> None:
        self.limit = limit  # its bound (the total's: 1 << 62 when there is none)
        self.size = 0  # the ``size`` of every queue it reads from, summed
        # how many queues it reads from (the pool goes with the last); the total's: how
        # many connection pools there are, to share it out (``share``)
        self.queues = 0
        # the queues that held publishers back for this pool's room: released by a take
        self.blocking: set[int] = set()

    def share(self) -> int:
        """The total's: what a connection may hold once all the queues hold its limit."""
        return self.limit // (self.queues or 1)


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
        "total",
    )

    def __init__(
        self, queue_id: int, topic_filter: str, group: str | None, capacity: int,
        overflow: Overflow, capacity_bytes: int = 1 << 62, total: Pool | None = None,
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
        self.total = Pool() if total is None else total  # every queue's bytes together
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

    def over(self, size: int) -> bool:
        """Whether ``size`` more bytes would take a pool of its past its limit, or all the
        queues past the total's and a pool of its past its share of that (a queue nobody
        reads: holding anything). An empty pool takes one message of any size, as an empty
        queue does."""
        total = self.total
        if total.size + size > total.limit:
            if not self.pools:
                return bool(self.items)
            share = total.share()
            return any(p.size and p.size + size > min(p.limit, share) for p in self.pools)
        return any(p.size and p.size + size > p.limit for p in self.pools)

    def shrink(self, n: int) -> None:
        """``n`` bytes of its items went: off its size, its pools' and the total."""
        self.size -= n
        self.total.size -= n
        for pool in self.pools:
            pool.size -= n

    def make_room(self, size: int) -> int:
        """Drop the oldest items until a record of ``size`` bytes fits, in its own bounds
        and in its pools' (``over``); returns how many."""
        items = self.items
        n = 0
        while items and (not self.fits(size) or self.over(size)):
            self.shrink(len(items.popleft()[0]))
            n += 1
        return n

    def frees(self, size: int) -> bool:
        """Whether dropping all its items would let its pools take ``size`` more bytes."""
        mine = self.size
        total = self.total
        share = total.share() if total.size - mine + size > total.limit else total.limit
        return not any(p.size - mine and p.size - mine + size > min(p.limit, share)
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
