"""The frames of the BlipMQ wire protocol (docs/PROTOCOL.md): their types, fields and codes.

Every frame is::

    +-----------+---------+----------------+------------------+
    | length u32| type u8 | request_id u32 | body (length-5)  |
    +-----------+---------+----------------+------------------+

``length`` counts the bytes after itself, so a frame occupies ``4 + length`` bytes. The
bodies' byte layout is in ``codec`` (encoding and decoding) and, for the messages inside
PUBLISH and DELIVER, in ``message``. Standard library only; no I/O.
"""

# Annotations are evaluated here (no `from __future__ import annotations`): as strings,
# typing compiles each NamedTuple field's into a ForwardRef, ~5 us a field on every start.

import struct
from enum import IntEnum
from typing import NamedTuple

from blipmq_server.protocol.message import Delivery, Message, RawMessage, message_from_record

VERSION = 2  # 2: deliveries carry a timestamp and flags; retain; STATS; Start.TIME
HEADER = struct.Struct(">IBI")  # length, type, request id
HEADER_SIZE = HEADER.size  # 9
MIN_LENGTH = 5  # type + request id
DEFAULT_MAX_FRAME = 1 << 20
MAX_BATCH = 0xFFFF


class ErrorCode(IntEnum):
    """Numeric codes carried by ERROR and GOODBYE frames."""

    PROTOCOL = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    NOT_AUTHENTICATED = 4
    AUTH_FAILED = 5
    MESSAGE_TOO_LARGE = 6
    INVALID_TOPIC = 7
    INVALID_REQUEST = 8
    NOT_FOUND = 9
    QUEUE_FULL = 10
    TOO_MANY_CONNECTIONS = 11
    SHUTTING_DOWN = 12
    UNSUPPORTED = 13
    GROUP_DELETED = 14
    TIMEOUT = 15
    NORMAL = 16  # GOODBYE only: a plain, intended close
    STORAGE = 17  # the write-ahead log could not store a message; it was not confirmed
    LIMIT = 18  # a configured broker bound refuses it (retained.max_topics, retained.max_bytes)
    FORBIDDEN = 19  # the connection's key may not do this (publish/subscribe permissions, admin)


class FrameType(IntEnum):
    HELLO = 0x01
    WELCOME = 0x02
    AUTH = 0x03
    AUTH_OK = 0x04
    PUBLISH = 0x10
    PUB_ACK = 0x11
    SUBSCRIBE = 0x20
    SUBSCRIBED = 0x21
    UNSUBSCRIBE = 0x22
    UNSUBSCRIBED = 0x23
    DELIVER = 0x30
    ACK = 0x31
    NACK = 0x32
    CREDIT = 0x33
    PING = 0x40
    PONG = 0x41
    GOODBYE = 0x42
    STATS = 0x43
    STATS_REPORT = 0x44
    ERROR = 0x7F


class Start(IntEnum):
    """Where a SUBSCRIBE starts reading: a new durable group, or a replaying subscriber."""

    LATEST = 0  # only what is published from now on (the default)
    EARLIEST = 1  # the oldest record still in the log
    OFFSET = 2  # the given log offset
    TIME = 3  # the first record at or after a wall-clock time (ms since the epoch)


# ---------------------------------------------------------------------------------- frames
# Frames are NamedTuples, not dataclasses: defining sixteen frozen slotted dataclasses costs
# about 15 ms at import, a sixth of the budget of a one-shot `blipmq pub`. Compare frames with
# their type as well (a NamedTuple equals any tuple with the same fields).


class Hello(NamedTuple):
    TYPE = FrameType.HELLO
    version: int = VERSION
    client: str = ""
    request_id: int = 0


class Welcome(NamedTuple):
    TYPE = FrameType.WELCOME
    version: int
    max_frame: int
    max_message: int
    server: str = ""
    request_id: int = 0


class Auth(NamedTuple):
    TYPE = FrameType.AUTH
    api_key: str = ""
    request_id: int = 0


class AuthOk(NamedTuple):
    TYPE = FrameType.AUTH_OK
    request_id: int = 0


class Publish(NamedTuple):
    TYPE = FrameType.PUBLISH
    messages: tuple[RawMessage, ...]
    request_id: int = 0

    def decoded(self) -> list[Message]:
        """The batch as full Message values (tests and tools; the broker uses ``messages``)."""
        return [message_from_record(m.record) for m in self.messages]


class PubAck(NamedTuple):
    TYPE = FrameType.PUB_ACK
    count: int
    request_id: int = 0


SUBSCRIBE_UNTIL_END = 0x01  # SUBSCRIBE flags bit 0 (docs/PROTOCOL.md, "Until the end")


class Subscribe(NamedTuple):
    TYPE = FrameType.SUBSCRIBE
    topic_filter: str
    group: str = ""
    qos: int = 0
    credit: int = 0  # 0 = the broker's default window (QoS 1)
    start: int = Start.LATEST
    start_offset: int = 0  # with Start.OFFSET; with Start.TIME: ms since the epoch
    request_id: int = 0
    flags: int = 0  # SUBSCRIBE_UNTIL_END: SUBSCRIBED says the log's end; a mark on reaching it


class Subscribed(NamedTuple):
    TYPE = FrameType.SUBSCRIBED
    sub_id: int
    request_id: int = 0
    end: int | None = None  # asked with SUBSCRIBE_UNTIL_END: the log's next offset then


class Unsubscribe(NamedTuple):
    TYPE = FrameType.UNSUBSCRIBE
    sub_id: int = 0  # non-zero: end that subscription of this connection
    topic_filter: str = ""
    group: str = ""
    request_id: int = 0


class Unsubscribed(NamedTuple):
    TYPE = FrameType.UNSUBSCRIBED
    count: int
    request_id: int = 0


class Deliver(NamedTuple):
    TYPE = FrameType.DELIVER
    sub_id: int
    messages: tuple[Delivery, ...]
    request_id: int = 0


class Ack(NamedTuple):
    TYPE = FrameType.ACK
    sub_id: int
    offsets: tuple[int, ...]
    request_id: int = 0


class Nack(NamedTuple):
    """Give deliveries back: redelivered now (``delay_ms`` 0) or after ``delay_ms``;
    ``reason`` (optional) is what a dead letter made by this NACK says."""

    TYPE = FrameType.NACK
    sub_id: int
    offsets: tuple[int, ...]
    delay_ms: int = 0
    request_id: int = 0
    reason: str = ""


class Credit(NamedTuple):
    """Set a QoS 1 subscription's window of unacked deliveries (0: send nothing new)."""

    TYPE = FrameType.CREDIT
    sub_id: int
    credit: int
    request_id: int = 0


class Ping(NamedTuple):
    TYPE = FrameType.PING
    data: bytes = b""
    request_id: int = 0


class Pong(NamedTuple):
    TYPE = FrameType.PONG
    data: bytes = b""
    request_id: int = 0


class Goodbye(NamedTuple):
    TYPE = FrameType.GOODBYE
    code: int = ErrorCode.NORMAL
    text: str = ""
    request_id: int = 0


class Stats(NamedTuple):
    """Ask the broker for its statistics (answered with STATS_REPORT)."""

    TYPE = FrameType.STATS
    request_id: int = 0


class StatsReport(NamedTuple):
    """The broker's statistics: a UTF-8 JSON object (docs/PROTOCOL.md, "Statistics")."""

    TYPE = FrameType.STATS_REPORT
    data: bytes = b"{}"
    request_id: int = 0


class Error(NamedTuple):
    TYPE = FrameType.ERROR
    code: int
    text: str
    request_id: int = 0


Frame = (
    Hello | Welcome | Auth | AuthOk | Publish | PubAck | Subscribe | Subscribed | Unsubscribe
    | Unsubscribed | Deliver | Ack | Nack | Credit | Ping | Pong | Goodbye | Stats | StatsReport
    | Error
)
