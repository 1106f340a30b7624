"""The message record: one message on the wire and in the log, and the delivery prefix.

This module alone knows the layout. A message record is what PUBLISH batches, what the log
stores as a MESSAGE body, and what DELIVER forwards behind a delivery prefix::

    | flags u8 | ttl_ms u32 | topic_len u16 | key_len u16 | payload_len u32 |   (13 bytes)
    | topic (UTF-8) | key | payload | [dead-letter trailer] |

    flags: bit 0 QoS 1, bit 1 the message has a key, bit 2 a dead letter (broker-made:
    the payload is followed by | deliveries u16 | reason_len u8 | reason (UTF-8) |),
    bit 3 retain (the topic's last value: kept and handed to new subscribers),
    bit 4 QoS 2 (an MQTT client published it at QoS 2; bit 0 is set too, so to everything
    but MQTT subscribers it is a QoS 1 message), bit 5 bridged in (a bridge wrote it from
    its upstream broker, or a bridge connected to the MQTT listener published it: bridges
    that bring its topic in do not send it back out, bridge sessions are not sent it)

    delivery record: | offset u64 | delivery_count u16 | timestamp_ms u64 | dflags u8 |
                     | message record |                                   (prefix: 19 bytes)

    timestamp_ms: the log record's timestamp (the broker's receive time without the log);
    dflags: bit 0 a retained value handed to a new subscriber (not a live publish)

Integers are big-endian. Standard library only; no I/O.
"""

# Annotations are evaluated here (no `from __future__ import annotations`): as strings,
# typing compiles each NamedTuple field's into a ForwardRef, ~5 us a field on every start.

import struct
from typing import NamedTuple

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.protocol.names import WIRE_TOPIC_BYTES

MSG_HEAD = struct.Struct(">BIHHI")  # flags, ttl_ms, topic_len, key_len, payload_len
HEAD_SIZE = MSG_HEAD.size  # 13: the topic starts here
DELIVERY_PREFIX = struct.Struct(">QHQB")  # offset, delivery_count, timestamp_ms, dflags
PREFIX_SIZE = DELIVERY_PREFIX.size  # 19: a delivery record is this plus its message record
FLAG_QOS1 = 0x01
FLAG_KEY = 0x02
FLAG_DEAD = 0x04
FLAG_RETAIN = 0x08
FLAG_QOS2 = 0x10
FLAG_BRIDGED = 0x20
FLAGS_PUBLISHABLE = FLAG_QOS1 | FLAG_KEY | FLAG_RETAIN  # what a client may set
DELIVERED_RETAINED = 0x01  # dflags: the topic's retained value, sent on subscribing
DEAD_HEAD = struct.Struct(">HB")  # dead-letter trailer head: deliveries, reason_len
DEAD_PREFIX = b"$dlq/"  # a dead letter's topic is this and its original's
# the most a record adds to its payload: head, longest topic and key, dead-letter trailer
MESSAGE_OVERHEAD = HEAD_SIZE + WIRE_TOPIC_BYTES + 0xFFFF + DEAD_HEAD.size + 0xFF


class DeadLetter(NamedTuple):
    """What a dead letter carries about its original: deliveries made and why it gave up."""

    deliveries: int
    reason: str


class Message(NamedTuple):
    """A message as a publisher states it."""

    topic: str
    payload: bytes
    qos: int = 0
    ttl_ms: int = 0
    key: bytes | None = None
    retain: bool = False  # keep as the topic's last value (an empty payload clears it)


class RawMessage(NamedTuple):
    """A decoded PUBLISH message, as the broker needs it: routing fields plus its raw bytes."""

    topic: bytes  # UTF-8 bytes, not yet validated as a name
    qos: int
    ttl_ms: int
    payload_len: int
    record: bytes  # the message's wire bytes, flags through payload
    retain: int = 0  # FLAG_RETAIN when set


class Delivery(NamedTuple):
    """A decoded DELIVER message, as a subscriber sees it."""

    offset: int
    delivery_count: int
    topic: str
    payload: bytes
    qos: int
    ttl_ms: int
    key: bytes | None
    dead: DeadLetter | None = None
    timestamp_ms: int = 0  # the log record's timestamp (receive time without the log)
    retained: bool = False  # the topic's retained value, sent because we subscribed
    retain: bool = False  # published with retain (live: it is now the topic's retained value)


# ---------------------------------------------------------------------------------- making


def message_record(msg: Message, topic_bytes: bytes | None = None) -> bytes:
    """The wire bytes of one message (the unit PUBLISH batches)."""
    topic = topic_bytes if topic_bytes is not None else msg.topic.encode("utf-8")
    key = msg.key
    flags = ((FLAG_QOS1 if msg.qos else 0) | (FLAG_KEY if key is not None else 0)
             | (FLAG_RETAIN if msg.retain else 0))
    if msg.qos not in (0, 1):
        raise LocalProtocolError(f"qos must be 0 or 1, not {msg.qos}")
    if len(topic) > 0xFFFF or (key is not None and len(key) > 0xFFFF):
        raise LocalProtocolError("topic or key longer than 65535 bytes")
    if not 0 <= msg.ttl_ms <= 0xFFFFFFFF:
        raise LocalProtocolError(f"ttl_ms {msg.ttl_ms} is out of range for u32")
    head = MSG_HEAD.pack(flags, msg.ttl_ms, len(topic), len(key or b""), len(msg.payload))
    return b"".join((head, topic, key or b"", msg.payload))


def dead_trailer(dead: DeadLetter) -> bytes:
    """The bytes behind a dead letter's payload (the reason is cut to 255 bytes)."""
    reason = dead.reason.encode("utf-8")[:255].decode("utf-8", "ignore").encode("utf-8")
    return DEAD_HEAD.pack(min(dead.deliveries, 0xFFFF), len(reason)) + reason


def dead_letter(record: bytes, dead: DeadLetter) -> RawMessage:
    """The dead letter of a message record: topic ``$dlq/<topic>``, the dead flag, and a
    trailer with ``dead`` (one an earlier dead letter carried is replaced). The retain flag
    is dropped: a dead letter is not its topic's last value."""
    flags, ttl, tlen, klen, plen = MSG_HEAD.unpack_from(record)
    flags &= ~FLAG_RETAIN
    topic = DEAD_PREFIX + record[HEAD_SIZE : HEAD_SIZE + tlen]
    rest = record[HEAD_SIZE + tlen : HEAD_SIZE + tlen + klen + plen]
    out = b"".join((MSG_HEAD.pack(flags | FLAG_DEAD, ttl, len(topic), klen, plen), topic, rest,
                    dead_trailer(dead)))
    return RawMessage(topic, flags & FLAG_QOS1, ttl, plen, out)


def is_dead_letter(record: bytes, pos: int = 0) -> bool:
    """Whether the message record at ``pos`` is a dead letter: its topic is ``$dlq/...``.
    The topic, not the dead flag, says so: the broker's own dead letters have both, but a
    bridge's ``in`` rule may bring one in under a ``$dlq/`` name, rebuilt without the flag
    and trailer (clients may not publish into ``$dlq/``)."""
    return record.startswith(DEAD_PREFIX, pos + HEAD_SIZE)


def delivery_record(offset: int, delivery_count: int, record: bytes, timestamp_ms: int = 0,
                    dflags: int = 0) -> bytes:
    return DELIVERY_PREFIX.pack(offset, delivery_count, timestamp_ms, dflags) + record


def delivery_message(d: Delivery) -> bytes:
    """The message record a Delivery was decoded from (trailer included)."""
    record = message_record(Message(d.topic, d.payload, d.qos, d.ttl_ms, d.key,
                                    d.retain or d.retained))
    if d.dead is None:
        return record
    return bytes((record[0] | FLAG_DEAD,)) + record[1:] + dead_trailer(d.dead)


# --------------------------------------------------------------------------------- reading


def message_from_record(record: bytes, pos: int = 0) -> Message:
    flags, ttl, tlen, klen, plen = MSG_HEAD.unpack_from(record, pos)
    p = pos + HEAD_SIZE
    topic = record[p : p + tlen].decode("utf-8", "replace")
    p += tlen
    key = record[p : p + klen] if flags & FLAG_KEY else None
    p += klen
    return Message(topic, record[p : p + plen], flags & FLAG_QOS1, ttl, key,
                   bool(flags & FLAG_RETAIN))


def dead_at(data: bytes, pos: int, end: int) -> tuple[DeadLetter, int]:
    """The dead-letter trailer at ``pos``, and where it ends."""
    if pos + DEAD_HEAD.size > end:
        raise RemoteProtocolError("dead-letter trailer ends early")
    deliveries, n = DEAD_HEAD.unpack_from(data, pos)
    stop = pos + DEAD_HEAD.size + n
    if stop > end:
        raise RemoteProtocolError("dead-letter reason ends early")
    try:
        reason = data[pos + DEAD_HEAD.size : stop].decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("dead-letter reason is not valid UTF-8") from None
    return DeadLetter(deliveries, reason), stop


def record_size(record: bytes, pos: int = 0) -> int:
    """Bytes of the message record at ``pos`` (trailer included)."""
    flags, _, tlen, klen, plen = MSG_HEAD.unpack_from(record, pos)
    size = HEAD_SIZE + tlen + klen + plen
    if flags & FLAG_DEAD:
        size += DEAD_HEAD.size + record[pos + size + 2]
    return size


def dead_of(record: bytes, pos: int = 0) -> DeadLetter | None:
    """The dead-letter trailer of the message record at ``pos``, or None if it has none."""
    flags, _, tlen, klen, plen = MSG_HEAD.unpack_from(record, pos)
    if not flags & FLAG_DEAD:
        return None
    start = pos + HEAD_SIZE + tlen + klen + plen
    return dead_at(record, start, len(record))[0]
