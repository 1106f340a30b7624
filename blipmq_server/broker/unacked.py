"""Message bytes consumers hold unacknowledged, per connection and all together.

A QoS 1 delivery stays in memory until its ack (``durable.Flight``). Each consumer's window
(its credit, ``mqtt.max_inflight``) bounds how many it holds, not how large they are, and a
connection may hold ``server.max_subscriptions`` consumers, the broker ``server.
max_connections`` connections: a client that reads and never acks could bring a backlog
into memory many times over. So all the consumers of one connection together hold at most
``per_conn`` bytes, and all connections together ``limit`` (0: no limit). A connection that
holds nothing may always take one delivery, whatever its size: every consumer makes
progress, one at a time at worst, while others sit on the rest. A connection refused for
``limit`` is remembered (``starved``) and woken once acks make room (``woken``, on the
broker's redelivery tick); until those have had their turn, the others take nothing more
(one at a time if they hold none), so the ones that acked first cannot take all the room
back at once.
Pure: no trio, no clock.
"""

from __future__ import annotations

_ANY = 1 << 62  # room without a limit


class Unacked:
    __slots__ = ("by_conn", "first", "limit", "per_conn", "starved", "total")

    def __init__(self, per_conn: int, limit: int) -> None:
        self.per_conn = per_conn  # 0: no limit
        self.limit = limit  # all connections together (0: no limit)
        self.total = 0
        self.by_conn: dict[int, int] = {}  # connections holding any: their bytes
        self.starved: set[int] = set()  # refused for ``limit``, to wake when there is room
        self.first: set[int] = set()  # woken for room: they take before those holding some

    def add(self, conn: int, n: int) -> None:
        """``conn``'s consumers hold ``n`` bytes more (or fewer, ``n`` < 0)."""
        self.total += n
        if n > 0:
            self.first.discard(conn)  # had its turn
        held = self.by_conn.get(conn, 0) + n
        if held > 0:
            self.by_conn[conn] = held
        else:
            self.by_conn.pop(conn, None)
            self.starved.discard(conn)  # gets one whatever the total (``room``)

    def room(self, conn: int, exempt: bool = False) -> int:
        """Bytes ``conn``'s consumers may still take unacked (the first record of a batch
        goes whatever its size while this is positive). ``exempt``: only the connection's
        own bound applies (a bridge's link, bounded by its configured window)."""
        held = self.by_conn.get(conn, 0)
        room = self.per_conn - held if self.per_conn else _ANY
        if exempt or not self.limit:
            return room
        left = self.limit - self.total
        if left <= 0 or ((self.starved or self.first) and conn not in self.first):
            # no room, or others wait for theirs: one delivery for a connection holding none
            if held:
                self.starved.add(conn)
                return 0
            return 1
        return min(room, left)

    def woken(self) -> set[int]:
        """The connections refused for ``limit``, once there is room again: they take
        before the others until the next call (each redelivery tick)."""
        self.first = set()
        if not self.starved or self.total >= self.limit:
            return set()
        self.first, self.starved = self.starved, set()
        return set(self.first)
