"""A subscription's bounded queue and its overflow policy.

One ``Queue`` exists per ephemeral subscription and per consumer group. Items are
``(delivery_record, expires_at_ms)`` pairs: the record is encoded once at publish and shared
by every queue it lands in, so fan-out costs one append per subscriber.
Pure and synchronous; no trio.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum
from typing import Any

Item = tuple[bytes, int]  # (delivery record, expires_at_ms; 0 = never)


class Overflow(StrEnum):
    DROP_OLDEST = "drop_oldest"
    DROP_NEW = "drop_new"
    BLOCK = "block"


class Queue:
    """Messages waiting for one subscription (or one group), in publish order."""

    durable = False  # see broker.durable.DurableGroup for the log-backed kind

    __slots__ = (
        "capacity",
        "consumers",
        "dropped_new",
        "dropped_oldest",
        "dropped_ttl",
        "expiring",
        "filter",
        "group",
        "items",
        "levels",
        "overflow",
        "waiter",
    )

    def __init__(
        self, topic_filter: str, group: str | None, capacity: int, overflow: Overflow
    ) -> None:
        self.filter = topic_filter
        self.levels = tuple(topic_filter.split("/"))
        self.group = group
        self.capacity = capacity
        self.overflow = overflow
        self.items: deque[Item] = deque()
        self.consumers: list[Any] = []  # Consumer objects (see broker.core)
        self.expiring = False  # some item may carry an expiry: the ticker scans this queue
        self.dropped_oldest = 0
        self.dropped_new = 0
        self.dropped_ttl = 0
        # Set by the shell while a blocked publisher waits for room; the broker never reads it.
        self.waiter: Any = None

    def __repr__(self) -> str:
        return f"Queue({self.filter!r}, group={self.group!r}, depth={len(self.items)})"

    @property
    def full(self) -> bool:
        return len(self.items) >= self.capacity

    def purge_expired(self, now_ms: int) -> int:
        """Remove every expired item; returns how many. Clears ``expiring`` when none are left."""
        if not self.expiring:
            return 0
        before = len(self.items)
        kept = [it for it in self.items if not (it[1] and it[1] <= now_ms)]
        removed = before - len(kept)
        if removed:
            self.items = deque(kept)
            self.dropped_ttl += removed
        self.expiring = any(it[1] for it in kept)
        return removed
