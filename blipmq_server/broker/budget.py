"""The memory log cursors hold for speed, all together: records read ahead of their
consumers, and the topics they know to match or not (``durable.DurableGroup``).

Each cursor bounds its own (two disk reads ahead, ``durable.MATCHES_BYTES`` of topics), but
a client may run as many cursors as ``server.max_subscriptions`` lets it on each connection,
and a consumer that does not take what was read for it (a QoS 1 window full, a socket not
read) would keep it. Past ``limit`` bytes (``wal.read_ahead_bytes``) the cursors used least
recently (read for, or taken from, with room to take) let go of theirs: a consumer that
takes again reads again, from where its cursor is. Nothing is lost, nobody waits: only a
read may be done twice. Pure: no trio, no clock.
"""

from __future__ import annotations

from typing import Protocol


class Holder(Protocol):
    """A cursor, as the budget sees it."""

    memory: int  # bytes it holds, as charged

    def shed(self) -> None:
        """Let go of all it holds (``Budget.release`` is told)."""
        ...


class Budget:
    __slots__ = ("_holders", "held", "limit", "shed_bytes", "sheds")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes charged, all cursors together
        self.sheds = 0  # cursors made to let go of theirs, for the metrics
        self.shed_bytes = 0  # let go of by ``shed``: cursors that ended, or made to
        self._holders: dict[Holder, None] = {}  # cursors holding any, least recently used first

    def charge(self, holder: Holder, n: int) -> None:
        """``holder`` took ``n`` bytes more (already in ``holder.memory``); past the limit,
        the others used least recently let go of theirs."""
        self.held += n
        holders = self._holders
        holders.pop(holder, None)  # the most recently used now
        holders[holder] = None
        while self.held > self.limit:
            victim = next(iter(holders))
            if victim is holder:  # the only one left: it keeps one read at most (its own bound)
                break
            victim.shed()
            holders.pop(victim, None)  # in case it held nothing charged
            self.sheds += 1

    def release(self, holder: Holder, n: int) -> None:
        """``holder`` let go of ``n`` bytes (already off ``holder.memory``)."""
        self.held -= n
        if holder.memory <= 0:
            self._holders.pop(holder, None)

    def touch(self, holder: Holder) -> None:
        """``holder``'s consumer takes from it: the most recently used."""
        holders = self._holders
        if holder in holders:
            del holders[holder]
            holders[holder] = None

    def __len__(self) -> int:
        return len(self._holders)
