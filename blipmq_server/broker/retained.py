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
offset and time however often the value was carried. Pure: no trio, no clock.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

from blipmq_server.broker.topics import matches
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


def topic_of(record: bytes) -> bytes:
    """The topic bytes of a message record."""
    tlen = MSG_HEAD.unpack_from(record)[2]
    return record[HEAD_SIZE : HEAD_SIZE + tlen]


def carry_body(value: Value) -> bytes:
    return _CARRY.pack(value.offset, value.timestamp_ms) + value.record


def parse_carry(body: bytes) -> tuple[int, int, bytes]:
    offset, timestamp_ms = _CARRY.unpack_from(body)
    return offset, timestamp_ms, body[_CARRY.size :]


class Retained:
    def __init__(self, max_topics: int, max_bytes: int) -> None:
        self.max_topics = max_topics
        self.max_bytes = max_bytes
        self.values: dict[bytes, Value] = {}
        self.size = 0  # bytes of the records held
        self.refused = 0  # retained publishes refused at a bound

    def __len__(self) -> int:
        return len(self.values)

    def refusal(self, topic: bytes, record_size: int, payload_len: int) -> str | None:
        """Why a retained publish of ``record_size`` bytes to ``topic`` cannot be kept, or
        None. Clearing a value (an empty payload) is always accepted."""
        if not payload_len:
            return None
        old = self.values.get(topic)
        if old is None and len(self.values) >= self.max_topics:
            self.refused += 1
            return (f"the broker keeps retained values for at most {self.max_topics} topics "
                    "(retained.max_topics)")
        if self.size + record_size - (len(old.record) if old else 0) > self.max_bytes:
            self.refused += 1
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
            return
        levels = tuple(topic.decode("utf-8", "replace").split("/"))
        self.values[topic] = Value(offset, timestamp_ms, record, levels,
                                   timestamp_ms + ttl if ttl else 0, anchor)
        self.size += len(record)

    def matching(self, topic_filter: str, wall_ms: int) -> list[Value]:
        """The live values of topics ``topic_filter`` matches, oldest publish first
        (expired ones are dropped on the way)."""
        levels = tuple(topic_filter.split("/"))
        out = []
        for topic, value in list(self.values.items()):
            if value.expires_ms and value.expires_ms <= wall_ms:
                del self.values[topic]
                self.size -= len(value.record)
                continue
            if matches(levels, value.levels):
                out.append(value)
        out.sort()
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
