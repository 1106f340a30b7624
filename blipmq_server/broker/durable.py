"""Durable consumer groups: a cursor into the write-ahead log plus an in-flight set.

A durable group (a QoS 1 subscription with a group name) never holds its backlog in
memory: it reads matching messages from the log at its cursor, hands each to one of its
consumers and keeps it in flight until acked. An unacked delivery is redelivered when its
deadline passes (exponential backoff from ``retry_backoff_ms``) or when its consumer goes
away. The group's creation, deletion and acks are log records, so a restart rebuilds it:
everything from its floor (lowest unacked offset) that was not acked is delivered again.

Record bodies (big-endian, inside the wal record of that kind):

    GROUP:  | op u8 (1 create, 2 delete) | start u64 | filter str16 | group str16 |
    ACK:    | group_id u64 | floor u64 | count u16 | offsets u64 * count |

A group's id is the log offset of its GROUP create record. Pure: no trio, no clock.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any, NamedTuple

from blipmq_server.broker.topics import matches
from blipmq_server.protocol.codec import DELIVERY_PREFIX, MSG_HEAD

_GROUP_HEAD = struct.Struct(">BQ")
_ACK_HEAD = struct.Struct(">QQH")
_U16 = struct.Struct(">H")
CREATE, DELETE = 1, 2


class GroupRecord(NamedTuple):
    op: int
    start: int
    topic_filter: str
    group: str


def group_body(op: int, start: int, topic_filter: str, group: str) -> bytes:
    f, g = topic_filter.encode(), group.encode()
    return _GROUP_HEAD.pack(op, start) + _U16.pack(len(f)) + f + _U16.pack(len(g)) + g


def parse_group(body: bytes) -> GroupRecord:
    op, start = _GROUP_HEAD.unpack_from(body)
    pos = _GROUP_HEAD.size
    (n,) = _U16.unpack_from(body, pos)
    topic_filter = body[pos + 2 : pos + 2 + n].decode()
    pos += 2 + n
    (m,) = _U16.unpack_from(body, pos)
    return GroupRecord(op, start, topic_filter, body[pos + 2 : pos + 2 + m].decode())


def ack_body(group_id: int, floor: int, offsets: list[int]) -> bytes:
    return _ACK_HEAD.pack(group_id, floor, len(offsets)) + struct.pack(
        f">{len(offsets)}Q", *offsets
    )


def parse_ack(body: bytes) -> tuple[int, int, tuple[int, ...]]:
    group_id, floor, n = _ACK_HEAD.unpack_from(body)
    return group_id, floor, struct.unpack_from(f">{n}Q", body, _ACK_HEAD.size)


class Flight:
    """One delivered, not yet acked message."""

    __slots__ = ("body", "count", "due", "sub_id")

    def __init__(self, body: bytes, sub_id: int, due: int) -> None:
        self.body = body
        self.count = 1
        self.sub_id = sub_id
        self.due = due


class DurableGroup:
    __slots__ = (
        "_matches",
        "acked",
        "consumers",
        "filter",
        "group",
        "id",
        "inflight",
        "levels",
        "next",
        "ready",
    )

    durable = True

    def __init__(self, group_id: int, topic_filter: str, group: str, start: int) -> None:
        self.id = group_id
        self.filter = topic_filter
        self.levels = tuple(topic_filter.split("/"))
        self.group = group
        self.next = start  # next log offset to read
        self.inflight: dict[int, Flight] = {}
        self.ready: deque[int] = deque()  # in-flight offsets to deliver again now
        self.acked: set[int] = set()  # acked at or above the cursor (known from a restart)
        self.consumers: list[Any] = []
        self._matches: dict[bytes, bool] = {}

    def __repr__(self) -> str:
        return f"DurableGroup({self.filter!r}, {self.group!r}, next={self.next})"

    @property
    def floor(self) -> int:
        """Every offset below this is acked or not for this group."""
        return min(self.inflight, default=self.next) if self.inflight else self.next

    def recover_ack(self, floor: int, offsets: tuple[int, ...]) -> None:
        self.next = max(self.next, floor)
        self.acked = {o for o in self.acked if o >= self.next}
        self.acked.update(o for o in offsets if o >= self.next)

    def wants(self, topic: bytes) -> bool:
        hit = self._matches.get(topic)
        if hit is None:
            try:
                levels = tuple(topic.decode("utf-8").split("/"))
            except UnicodeDecodeError:
                levels = ("",)
            hit = self._matches[topic] = matches(self.levels, levels)
            if len(self._matches) > 4096:
                self._matches.clear()
        return hit

    def take_ready(
        self, sub_id: int, room: int, now_ms: int, backoff: Any
    ) -> list[bytes]:
        out: list[bytes] = []
        while self.ready and len(out) < room:
            offset = self.ready.popleft()
            flight = self.inflight.get(offset)
            if flight is None:
                continue  # acked meanwhile
            flight.count += 1
            flight.sub_id = sub_id
            flight.due = now_ms + backoff(flight.count)
            out.append(DELIVERY_PREFIX.pack(offset, flight.count) + flight.body)
        return out

    def take_new(
        self, sub_id: int, room: int, records: list[Any], now_ms: int, wall_ms: int,
        backoff: Any,
    ) -> tuple[list[bytes], int]:
        """Deliver matching MESSAGE records read at the cursor; returns (records, expired)."""
        out: list[bytes] = []
        expired = 0
        due = now_ms + backoff(1)
        for record in records:
            offset = record.offset
            if offset < self.next:
                continue
            if len(out) >= room:
                break
            self.next = offset + 1
            if record.kind != 1:
                continue
            body = record.body
            _, ttl, tlen, _, _ = MSG_HEAD.unpack_from(body)
            if not self.wants(body[13 : 13 + tlen]):
                continue
            if offset in self.acked:
                self.acked.discard(offset)
                continue
            if ttl and record.timestamp_ms + ttl <= wall_ms:
                expired += 1
                continue
            self.inflight[offset] = Flight(body, sub_id, due)
            out.append(DELIVERY_PREFIX.pack(offset, 1) + body)
        return out, expired

    def ack(self, sub_id: int, offsets: tuple[int, ...]) -> list[int]:
        """Offsets that were in flight for this consumer and are now done."""
        done = []
        for offset in offsets:
            flight = self.inflight.get(offset)
            if flight is not None and flight.sub_id == sub_id:
                del self.inflight[offset]
                done.append(offset)
        return done

    def requeue(self, sub_id: int) -> int:
        """A consumer left: its deliveries go to the others (or wait for the next one)."""
        n = 0
        for offset, flight in self.inflight.items():
            if flight.sub_id == sub_id:
                flight.sub_id = 0
                self.ready.append(offset)
                n += 1
        return n

    def expire(self, now_ms: int) -> list[int]:
        """In-flight deliveries whose deadline passed, moved to ``ready``."""
        late = [o for o, f in self.inflight.items() if f.sub_id and f.due <= now_ms]
        for offset in late:
            self.inflight[offset].sub_id = 0
            self.ready.append(offset)
        return late

    def in_flight_for(self, sub_id: int) -> int:
        return sum(1 for f in self.inflight.values() if f.sub_id == sub_id)
