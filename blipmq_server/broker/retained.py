"""Retained values: each topic's last message published with the retain flag.

A new subscription without a group gets the retained value of every topic its filter
matches before anything else (MQTT's retained messages: device status, configuration,
feature flags). An empty retained publish clears the topic's value. The store is bounded
by a number of topics and by bytes of message records; a retained publish that would pass
either bound is refused (``refusal``), the rest of the broker is unaffected.

Durability is the log's: a retained publish is a MESSAGE record with the retain flag; the
log hands such records to ``recover`` on start. So that retention never deletes a topic's
current value, maintenance carries each value whose latest record (its ``anchor``) is not
in the newest segment forward into a RETAINED record (``carry_body``), which cursors skip.
The latest record of a topic, MESSAGE or RETAINED, is its value.

    RETAINED body: | offset u64 | timestamp_ms u64 | message record |

``offset`` and ``timestamp_ms`` are the original publish's, so a subscriber sees the same
offset and time however often the value was carried.

The values are indexed by topic level (a tree: level -> the levels under it, a topic's
value at its last level), so that a filter walks only the branches it can match: an exact
level follows one branch, ``+`` each of one level's, ``#`` one subtree. A SUBSCRIBE's
filter that matches nothing costs a few steps, however many values the broker holds.
Values with a time to live are also kept by expiry (a heap), so that every expired one
goes at the next ``matching`` without a pass over the others, and before a retained
publish is refused at a bound (``refusal``): an expired value holds no room. Pure: no
trio, no clock (the caller passes the wall clock).
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterator
from typing import NamedTuple

from blipmq_server.protocol.message import HEAD_SIZE, MSG_HEAD

_CARRY = struct.Struct(">QQ")  # offset, timestamp_ms


class Value(NamedTuple):
    """A topic's retained value: the original publish's offset and time, its record."""

    offset: int
    timestamp_ms: int
    record: bytes  # the message record, as published (retain flag set)
    levels: tuple[str, ...]
    expires_ms: int  # wall clock; 0: never (the message's own TTL, if it had one)
    anchor: int  # log offset of its latest record (the publish, or a carried copy)


def _by_offset(item: tuple[bytes, Value]) -> int:
    """A (topic, value)'s place: the order of their publishes."""
    return item[1].offset


def topic_of(record: bytes) -> bytes:
    """The topic bytes of a message record."""
    tlen = MSG_HEAD.unpack_from(record)[2]
    return record[HEAD_SIZE : HEAD_SIZE + tlen]


def carry_body(value: Value) -> bytes:
    return _CARRY.pack(value.offset, value.timestamp_ms) + value.record


def parse_carry(body: bytes) -> tuple[int, int, bytes]:
    offset, timestamp_ms = _CARRY.unpack_from(body)
    return offset, timestamp_ms, body[_CARRY.size :]


class _Level:
    """A topic prefix of retained values: the levels that follow it (None: none), and the
    topic that ends here when it has a value."""

    __slots__ = ("children", "topic")

    def __init__(self) -> None:
        self.children: dict[str, _Level] | None = None
        self.topic: bytes | None = None


class Retained:
    def __init__(self, max_topics: int, max_bytes: int) -> None:
        self.max_topics = max_topics
        self.max_bytes = max_bytes
        self.values: dict[bytes, Value] = {}  # read by others; changed only here
        self.size = 0  # bytes of the records held
        self.refused = 0  # retained publishes refused at a bound
        self._root = _Level()  # the values' topics by level (``matching``)
        # (expires_ms, topic) of the values with a time to live, soonest first; an entry
        # whose value has been replaced or cleared since is skipped when it comes up
        self._expiry: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self.values)

    def refusal(self, topic: bytes, record_size: int, payload_len: int, wall_ms: int
                ) -> str | None:
        """Why a retained publish of ``record_size`` bytes to ``topic`` at ``wall_ms`` cannot
        be kept, or None. Clearing a value (an empty payload) is always accepted. Before
        refusing, the values expired by ``wall_ms`` are dropped (``expire``): an expired
        value counts against no bound."""
        if not payload_len:
            return None
        why = self._over(topic, record_size)
        if why is not None and self.expire(wall_ms):
            why = self._over(topic, record_size)
        if why is not None:
            self.refused += 1
        return why

    def _over(self, topic: bytes, record_size: int) -> str | None:
        old = self.values.get(topic)
        if old is None and len(self.values) >= self.max_topics:
            return (f"the broker keeps retained values for at most {self.max_topics} topics "
                    "(retained.max_topics)")
        if self.size + record_size - (len(old.record) if old else 0) > self.max_bytes:
            return (f"retained values would take more than {self.max_bytes} bytes "
                    "(retained.max_bytes, at most half of wal.segment_bytes)")
        return None

    def put(self, topic: bytes, offset: int, timestamp_ms: int, record: bytes, anchor: int
            ) -> None:
        """Keep ``record`` as the topic's value (an empty payload clears it)."""
        old = self.values.pop(topic, None)
        if old is not None:
            self.size -= len(old.record)
        _, ttl, _, _, plen = MSG_HEAD.unpack_from(record)
        if not plen:
            if old is not None:
                self._unlink(old.levels)
            return
        levels = old.levels if old is not None else tuple(
            topic.decode("utf-8", "replace").split("/"))
        expires = timestamp_ms + ttl if ttl else 0
        self.values[topic] = Value(offset, timestamp_ms, record, levels, expires, anchor)
        self.size += len(record)
        if old is None:
            self._link(levels, topic)
        if expires:
            expiry = self._expiry
            heapq.heappush(expiry, (expires, topic))
            if len(expiry) > 2 * len(self.values) + 64:  # mostly replaced values' entries
                self._expiry = [(v.expires_ms, t) for t, v in self.values.items()
                                if v.expires_ms]
                heapq.heapify(self._expiry)

    def matching(self, topic_filter: str, wall_ms: int) -> list[Value]:
        """The live values of topics ``topic_filter`` matches, oldest publish first
        (expired ones are dropped first). As in MQTT (``topics.matches``), ``a/#`` matches
        ``a`` too, and a filter whose first level is a wildcard no topic starting with
        '$'."""
        return [value for _, value in self.matching_topics(topic_filter, wall_ms)]

    def matching_topics(self, topic_filter: str, wall_ms: int) -> list[tuple[bytes, Value]]:
        """``matching``'s values with their topics: (topic, value), oldest publish first."""
        self.expire(wall_ms)
        levels = topic_filter.split("/")
        last = len(levels)
        found: list[bytes] = []
        todo = [(self._root, 0)]
        while todo:
            node, i = todo.pop()
            if i == last:
                if node.topic is not None:
                    found.append(node.topic)
                continue
            children = node.children
            level = levels[i]
            if level == "#":
                self._under(node, i == 0, found)
            elif children is None:
                continue
            elif level == "+":
                if i + 1 == last:  # the last level: the topics right below, no step more
                    found.extend(child.topic for name, child in children.items()
                                 if child.topic is not None and (i or name[:1] != "$"))
                else:
                    todo.extend((child, i + 1) for name, child in children.items()
                                if i or name[:1] != "$")
            else:
                child = children.get(level)
                if child is not None:
                    todo.append((child, i + 1))
        values = self.values
        out = [(topic, values[topic]) for topic in found]
        out.sort(key=_by_offset)
        return out

    def stale(self, below: int) -> Iterator[tuple[bytes, Value]]:
        """Values whose latest record is below offset ``below`` (to carry forward)."""
        return ((t, v) for t, v in list(self.values.items()) if v.anchor < below)

    def moved(self, topic: bytes, anchor: int) -> None:
        """The topic's value was carried forward into the record at ``anchor``."""
        value = self.values.get(topic)
        if value is not None:
            self.values[topic] = value._replace(anchor=anchor)

    def newest_anchor(self) -> int:
        return max((v.anchor for v in self.values.values()), default=0)

    @staticmethod
    def _under(node: _Level, top: bool, found: list[bytes]) -> None:
        """Into ``found``: the topics at ``node`` and below it (``top``: the root, whose
        '$' branches a '#' does not match)."""
        if node.topic is not None:
            found.append(node.topic)
        children = node.children
        if children is None:
            return
        todo = [child for name, child in children.items() if not top or name[:1] != "$"]
        while todo:
            node = todo.pop()
            if node.topic is not None:
                found.append(node.topic)
            if node.children is not None:
                todo.extend(node.children.values())

    def expire(self, wall_ms: int) -> int:
        """Drop the values whose time to live has passed by ``wall_ms``; returns how many.
        Costs a look at the expiry heap's top when none has."""
        expiry = self._expiry
        values = self.values
        n = 0
        while expiry and expiry[0][0] <= wall_ms:
            _, topic = heapq.heappop(expiry)
            value = values.get(topic)
            if value is not None and value.expires_ms and value.expires_ms <= wall_ms:
                del values[topic]
                self.size -= len(value.record)
                self._unlink(value.levels)
                n += 1
        return n

    def _link(self, levels: tuple[str, ...], topic: bytes) -> None:
        node = self._root
        for level in levels:
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(level)
            if child is None:
                child = children[level] = _Level()
            node = child
        node.topic = topic

    def _unlink(self, levels: tuple[str, ...]) -> None:
        """The topic at ``levels`` has no value any more: its levels that lead to no other
        value go too."""
        path = [self._root]
        for level in levels:
            children = path[-1].children
            child = None if children is None else children.get(level)
            if child is None:
                return
            path.append(child)
        path[-1].topic = None
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.topic is not None or node.children:
                return
            parent = path[depth - 1]
            del parent.children[levels[depth - 1]]  # type: ignore[union-attr]
            if not parent.children:
                parent.children = None
