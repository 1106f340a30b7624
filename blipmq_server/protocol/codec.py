"""Frames of the BlipMQ wire protocol and their byte encoding (docs/PROTOCOL.md).

Every frame is::

    +-----------+---------+----------------+------------------+
    | length u32| type u8 | request_id u32 | body (length-5)  |
    +-----------+---------+----------------+------------------+

All integers are big-endian. ``length`` counts the bytes after itself, so a frame occupies
``4 + length`` bytes; it is checked against the maximum frame size before the body is read.

A message inside PUBLISH (and, behind an offset and a delivery count, inside DELIVER) is::

    | flags u8 | ttl_ms u32 | topic_len u16 | key_len u16 | payload_len u32 |
    | topic (UTF-8) | key | payload |

flags: bit 0 = QoS 1, bit 1 = the message has a key, bit 2 = a dead letter (only the broker
sets it); other bits must be zero. A dead letter's payload is followed by a trailer::

    | deliveries u16 | reason_len u8 | reason (UTF-8) |

The broker forwards the message bytes of a PUBLISH unchanged into DELIVER frames, prefixed
with ``offset u64, delivery_count u16``: that is why ``RawMessage.record`` exists.
No I/O here, and nothing outside the standard library.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.protocol.names import MAX_TOPIC_BYTES

VERSION = 1
HEADER = struct.Struct(">IBI")  # length, type, request id
HEADER_SIZE = HEADER.size  # 9
MIN_LENGTH = 5  # type + request id
MSG_HEAD = struct.Struct(">BIHHI")  # flags, ttl_ms, topic_len, key_len, payload_len
DELIVERY_PREFIX = struct.Struct(">QH")  # offset, delivery_count
DEFAULT_MAX_FRAME = 1 << 20
MAX_BATCH = 0xFFFF
FLAG_QOS1 = 0x01
FLAG_KEY = 0x02
FLAG_DEAD = 0x04
_FLAGS_KNOWN = FLAG_QOS1 | FLAG_KEY  # what a client may publish
_DEAD = struct.Struct(">HB")  # dead-letter trailer head: deliveries, reason_len

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
# the most a message record adds to its payload: head, topic, key, dead-letter trailer
MESSAGE_OVERHEAD = MSG_HEAD.size + MAX_TOPIC_BYTES + 0xFFFF + _DEAD.size + 0xFF
_SUB = struct.Struct(">BIBQ")  # qos, credit, start, start_offset
_ACK_HEAD = struct.Struct(">IH")  # sub_id, count
_NACK_HEAD = struct.Struct(">IIH")  # sub_id, delay_ms, count
_CREDIT = struct.Struct(">II")  # sub_id, credit
_HELLO = struct.Struct(">H")
_WELCOME = struct.Struct(">HII")
_ERROR = struct.Struct(">H")


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
    ERROR = 0x7F


class Start(IntEnum):
    """Where a SUBSCRIBE starts reading: a new durable group, or a replaying subscriber."""

    LATEST = 0  # only what is published from now on (the default)
    EARLIEST = 1  # the oldest record still in the log
    OFFSET = 2  # the given log offset


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


class RawMessage(NamedTuple):
    """A decoded PUBLISH message, as the broker needs it: routing fields plus its raw bytes."""

    topic: bytes  # UTF-8 bytes, not yet validated as a name
    qos: int
    ttl_ms: int
    payload_len: int
    record: bytes  # the message's wire bytes, flags through payload


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




def frame_limit(max_message_bytes: int, max_batch_bytes: int = 0) -> int:
    """The largest frame ``length`` a broker with these limits sends or accepts.

    A DELIVER frame holds up to ``max_batch_bytes`` of delivery records, or one record alone
    when it is larger; a PUBLISH frame holds at least one message. Both sides decode with this
    limit (the broker announces it in WELCOME), so any message the broker accepts can reach
    every subscriber.
    """
    one = DELIVERY_PREFIX.size + MESSAGE_OVERHEAD + max_message_bytes
    return MIN_LENGTH + _ACK_HEAD.size + max(one, max_batch_bytes)


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
        return [_message_from_record(m.record) for m in self.messages]


class PubAck(NamedTuple):
    TYPE = FrameType.PUB_ACK
    count: int
    request_id: int = 0


class Subscribe(NamedTuple):
    TYPE = FrameType.SUBSCRIBE
    topic_filter: str
    group: str = ""
    qos: int = 0
    credit: int = 0  # 0 = the broker's default window (QoS 1)
    start: int = Start.LATEST
    start_offset: int = 0  # with Start.OFFSET
    request_id: int = 0


class Subscribed(NamedTuple):
    TYPE = FrameType.SUBSCRIBED
    sub_id: int
    request_id: int = 0


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
    """Give deliveries back: redelivered now (``delay_ms`` 0) or after ``delay_ms``."""

    TYPE = FrameType.NACK
    sub_id: int
    offsets: tuple[int, ...]
    delay_ms: int = 0
    request_id: int = 0


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


class Error(NamedTuple):
    TYPE = FrameType.ERROR
    code: int
    text: str
    request_id: int = 0


Frame = (
    Hello | Welcome | Auth | AuthOk | Publish | PubAck | Subscribe | Subscribed | Unsubscribe
    | Unsubscribed | Deliver | Ack | Nack | Credit | Ping | Pong | Goodbye | Error
)

# -------------------------------------------------------------------------------- encoding


def _str16(text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > 0xFFFF:
        raise LocalProtocolError(f"string of {len(data)} bytes does not fit a u16 length")
    return _U16.pack(len(data)) + data


def _u(value: int, bits: int, what: str) -> int:
    if not 0 <= value < (1 << bits):
        raise LocalProtocolError(f"{what} {value} is out of range for u{bits}")
    return value


def message_record(msg: Message, topic_bytes: bytes | None = None) -> bytes:
    """The wire bytes of one message (the unit PUBLISH batches)."""
    topic = topic_bytes if topic_bytes is not None else msg.topic.encode("utf-8")
    key = msg.key
    flags = (FLAG_QOS1 if msg.qos else 0) | (FLAG_KEY if key is not None else 0)
    if msg.qos not in (0, 1):
        raise LocalProtocolError(f"qos must be 0 or 1, not {msg.qos}")
    if len(topic) > 0xFFFF or (key is not None and len(key) > 0xFFFF):
        raise LocalProtocolError("topic or key longer than 65535 bytes")
    _u(msg.ttl_ms, 32, "ttl_ms")
    head = MSG_HEAD.pack(flags, msg.ttl_ms, len(topic), len(key or b""), len(msg.payload))
    return b"".join((head, topic, key or b"", msg.payload))


def dead_trailer(dead: DeadLetter) -> bytes:
    """The bytes behind a dead letter's payload (the reason is cut to 255 bytes)."""
    reason = dead.reason.encode("utf-8")[:255].decode("utf-8", "ignore").encode("utf-8")
    return _DEAD.pack(min(dead.deliveries, 0xFFFF), len(reason)) + reason


def dead_letter(record: bytes, dead: DeadLetter) -> RawMessage:
    """The dead letter of a message record: topic ``$dlq/<topic>``, the dead flag, and a
    trailer with ``dead`` (one an earlier dead letter carried is replaced)."""
    flags, ttl, tlen, klen, plen = MSG_HEAD.unpack_from(record)
    head = MSG_HEAD.size
    topic = b"$dlq/" + record[head : head + tlen]
    rest = record[head + tlen : head + tlen + klen + plen]
    out = b"".join((MSG_HEAD.pack(flags | FLAG_DEAD, ttl, len(topic), klen, plen), topic, rest,
                    dead_trailer(dead)))
    return RawMessage(topic, flags & FLAG_QOS1, ttl, plen, out)


def encode_publish(records: list[bytes], request_id: int = 0) -> bytes:
    """A PUBLISH frame from message records made by :func:`message_record`."""
    if not 1 <= len(records) <= MAX_BATCH:
        raise LocalProtocolError(f"a PUBLISH carries 1 to {MAX_BATCH} messages, not {len(records)}")
    body = b"".join(records)
    head = HEADER.pack(7 + len(body), FrameType.PUBLISH, _u(request_id, 32, "request_id"))
    return head + _U16.pack(len(records)) + body


def encode_deliver(sub_id: int, records: list[bytes], request_id: int = 0) -> bytes:
    """A DELIVER frame from delivery records (``DELIVERY_PREFIX`` + message record)."""
    body = b"".join(records)
    return (
        HEADER.pack(11 + len(body), FrameType.DELIVER, _u(request_id, 32, "request_id"))
        + _ACK_HEAD.pack(_u(sub_id, 32, "sub_id"), _u(len(records), 16, "DELIVER count"))
        + body
    )


def _delivery_message(d: Delivery) -> bytes:
    record = message_record(Message(d.topic, d.payload, d.qos, d.ttl_ms, d.key))
    if d.dead is None:
        return record
    return bytes((record[0] | FLAG_DEAD,)) + record[1:] + dead_trailer(d.dead)


def delivery_record(offset: int, delivery_count: int, record: bytes) -> bytes:
    return DELIVERY_PREFIX.pack(offset, delivery_count) + record


def _body(frame: Frame) -> bytes:
    match frame:
        case Hello():
            return _HELLO.pack(_u(frame.version, 16, "version")) + _str16(frame.client)
        case Welcome():
            return _WELCOME.pack(
                frame.version, _u(frame.max_frame, 32, "max_frame"),
                _u(frame.max_message, 32, "max_message"),
            ) + _str16(frame.server)
        case Auth():
            return _str16(frame.api_key)
        case AuthOk():
            return b""
        case Publish():
            if not 1 <= len(frame.messages) <= MAX_BATCH:
                raise LocalProtocolError(
                    f"a PUBLISH carries 1 to {MAX_BATCH} messages, not {len(frame.messages)}"
                )
            return _U16.pack(len(frame.messages)) + b"".join(m.record for m in frame.messages)
        case PubAck():
            return _U32.pack(_u(frame.count, 32, "count"))
        case Subscribe():
            if frame.qos not in (0, 1):
                raise LocalProtocolError(f"qos must be 0 or 1, not {frame.qos}")
            if frame.start not in tuple(Start):
                raise LocalProtocolError(f"unknown SUBSCRIBE start {frame.start}")
            return (
                _SUB.pack(frame.qos, _u(frame.credit, 32, "credit"), frame.start,
                          _u(frame.start_offset, 64, "start_offset"))
                + _str16(frame.topic_filter) + _str16(frame.group)
            )
        case Subscribed():
            return _U32.pack(_u(frame.sub_id, 32, "sub_id"))
        case Unsubscribe():
            return (
                _U32.pack(_u(frame.sub_id, 32, "sub_id"))
                + _str16(frame.topic_filter) + _str16(frame.group)
            )
        case Unsubscribed():
            return _U32.pack(_u(frame.count, 32, "count"))
        case Deliver():
            records = [
                delivery_record(d.offset, d.delivery_count, _delivery_message(d))
                for d in frame.messages
            ]
            return _ACK_HEAD.pack(frame.sub_id, len(records)) + b"".join(records)
        case Ack():
            n = len(frame.offsets)
            return _ACK_HEAD.pack(frame.sub_id, _u(n, 16, "ack count")) + struct.pack(
                f">{n}Q", *frame.offsets
            )
        case Nack():
            n = len(frame.offsets)
            return _NACK_HEAD.pack(
                frame.sub_id, _u(frame.delay_ms, 32, "delay_ms"), _u(n, 16, "nack count")
            ) + struct.pack(f">{n}Q", *frame.offsets)
        case Credit():
            return _CREDIT.pack(_u(frame.sub_id, 32, "sub_id"), _u(frame.credit, 32, "credit"))
        case Ping() | Pong():
            return frame.data
        case Goodbye() | Error():
            return _ERROR.pack(_u(frame.code, 16, "code")) + _str16(frame.text)
    raise LocalProtocolError(f"cannot encode {frame!r}")


def encode(frame: Frame) -> bytes:
    """The bytes of one frame."""
    try:
        body = _body(frame)
    except struct.error as exc:  # a field the struct formats above cannot carry
        raise LocalProtocolError(f"cannot encode {type(frame).__name__}: {exc}") from None
    return HEADER.pack(5 + len(body), frame.TYPE, _u(frame.request_id, 32, "request_id")) + body


# -------------------------------------------------------------------------------- decoding


class _Reader:
    """Cursor over one frame body; every read is bounds-checked."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise RemoteProtocolError("frame body ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple:
        if self.pos + st.size > self.end:
            raise RemoteProtocolError("frame body ends early")
        out = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return out

    def str16(self) -> str:
        (n,) = self.unpack(_U16)
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("string is not valid UTF-8") from None

    def rest(self) -> bytes:
        return self.take(self.end - self.pos)

    def done(self) -> None:
        if self.pos != self.end:
            raise RemoteProtocolError(f"{self.end - self.pos} unexpected bytes after frame body")


def _publish_messages(data: bytes, pos: int, end: int) -> tuple[RawMessage, ...]:
    """Split a PUBLISH body into messages. The broker's hot path: keep it lean."""
    if pos + 2 > end:
        raise RemoteProtocolError("PUBLISH body ends early")
    (count,) = _U16.unpack_from(data, pos)
    if count == 0:
        raise RemoteProtocolError("PUBLISH carries no messages")
    pos += 2
    out = []
    unpack = MSG_HEAD.unpack_from
    head_size = MSG_HEAD.size
    for _ in range(count):
        if pos + head_size > end:
            raise RemoteProtocolError("PUBLISH message header ends early")
        flags, ttl, tlen, klen, plen = unpack(data, pos)
        stop = pos + head_size + tlen + klen + plen
        if stop > end:
            raise RemoteProtocolError("PUBLISH message ends early")
        if flags & ~_FLAGS_KNOWN or (klen and not flags & FLAG_KEY):
            raise RemoteProtocolError(f"PUBLISH message has invalid flags {flags:#04x}")
        tstart = pos + head_size
        out.append(
            RawMessage(data[tstart : tstart + tlen], flags & FLAG_QOS1, ttl, plen, data[pos:stop])
        )
        pos = stop
    if pos != end:
        raise RemoteProtocolError(f"{end - pos} unexpected bytes after PUBLISH messages")
    return tuple(out)


def _message_from_record(record: bytes, pos: int = 0) -> Message:
    flags, ttl, tlen, klen, plen = MSG_HEAD.unpack_from(record, pos)
    p = pos + MSG_HEAD.size
    topic = record[p : p + tlen].decode("utf-8", "replace")
    p += tlen
    key = record[p : p + klen] if flags & FLAG_KEY else None
    p += klen
    return Message(topic, record[p : p + plen], flags & FLAG_QOS1, ttl, key)


def _dead_at(data: bytes, pos: int, end: int) -> tuple[DeadLetter, int]:
    """The dead-letter trailer at ``pos``, and where it ends."""
    if pos + _DEAD.size > end:
        raise RemoteProtocolError("dead-letter trailer ends early")
    deliveries, n = _DEAD.unpack_from(data, pos)
    stop = pos + _DEAD.size + n
    if stop > end:
        raise RemoteProtocolError("dead-letter reason ends early")
    try:
        reason = data[pos + _DEAD.size : stop].decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("dead-letter reason is not valid UTF-8") from None
    return DeadLetter(deliveries, reason), stop


def record_size(record: bytes, pos: int = 0) -> int:
    """Bytes of the message record at ``pos`` (trailer included)."""
    flags, _, tlen, klen, plen = MSG_HEAD.unpack_from(record, pos)
    size = MSG_HEAD.size + tlen + klen + plen
    if flags & FLAG_DEAD:
        size += _DEAD.size + record[pos + size + 2]
    return size


def _deliveries(r: _Reader) -> tuple[int, tuple[Delivery, ...]]:
    sub_id, count = r.unpack(_ACK_HEAD)
    data, pos, end = r.data, r.pos, r.end
    out = []
    prefix = DELIVERY_PREFIX.unpack_from
    head = MSG_HEAD.unpack_from
    topics: dict[bytes, str] = {}
    for _ in range(count):
        if pos + 23 > end:
            raise RemoteProtocolError("DELIVER message header ends early")
        offset, dcount = prefix(data, pos)
        flags, ttl, tlen, klen, plen = head(data, pos + 10)
        p = pos + 23
        pos = p + tlen + klen + plen
        if pos > end:
            raise RemoteProtocolError("DELIVER message ends early")
        tb = data[p : p + tlen]
        topic = topics.get(tb)
        if topic is None:
            try:
                topic = topics[tb] = tb.decode("utf-8")
            except UnicodeDecodeError:
                raise RemoteProtocolError("DELIVER topic is not valid UTF-8") from None
        p += tlen
        key = data[p : p + klen] if flags & FLAG_KEY else None
        p += klen
        dead = None
        if flags & FLAG_DEAD:
            dead, stop = _dead_at(data, pos, end)
            payload, pos = data[p:pos], stop
        else:
            payload = data[p:pos]
        out.append(Delivery(offset, dcount, topic, payload, flags & FLAG_QOS1, ttl, key, dead))
    r.pos = pos
    return sub_id, tuple(out)


def _decode_body(ftype: int, rid: int, data: bytes, pos: int, end: int) -> Frame:
    if ftype == FrameType.PUBLISH:
        return Publish(_publish_messages(data, pos, end), rid)
    r = _Reader(data, pos, end)
    frame: Frame
    if ftype == FrameType.DELIVER:
        sub_id, msgs = _deliveries(r)
        frame = Deliver(sub_id, msgs, rid)
    elif ftype == FrameType.ACK:
        sub_id, n = r.unpack(_ACK_HEAD)
        frame = Ack(sub_id, r.unpack(struct.Struct(f">{n}Q")), rid)
    elif ftype == FrameType.NACK:
        sub_id, delay_ms, n = r.unpack(_NACK_HEAD)
        frame = Nack(sub_id, r.unpack(struct.Struct(f">{n}Q")), delay_ms, rid)
    elif ftype == FrameType.CREDIT:
        sub_id, credit = r.unpack(_CREDIT)
        frame = Credit(sub_id, credit, rid)
    elif ftype == FrameType.HELLO:
        (version,) = r.unpack(_HELLO)
        frame = Hello(version, r.str16(), rid)
    elif ftype == FrameType.WELCOME:
        version, max_frame, max_message = r.unpack(_WELCOME)
        frame = Welcome(version, max_frame, max_message, r.str16(), rid)
    elif ftype == FrameType.AUTH:
        frame = Auth(r.str16(), rid)
    elif ftype == FrameType.AUTH_OK:
        frame = AuthOk(rid)
    elif ftype == FrameType.PUB_ACK:
        frame = PubAck(r.unpack(_U32)[0], rid)
    elif ftype == FrameType.SUBSCRIBE:
        qos, credit, start, start_offset = r.unpack(_SUB)
        if qos not in (0, 1):
            raise RemoteProtocolError(f"SUBSCRIBE qos must be 0 or 1, not {qos}")
        if start > Start.OFFSET:
            raise RemoteProtocolError(f"SUBSCRIBE start must be 0, 1 or 2, not {start}")
        frame = Subscribe(r.str16(), r.str16(), qos, credit, start, start_offset, rid)
    elif ftype == FrameType.SUBSCRIBED:
        frame = Subscribed(r.unpack(_U32)[0], rid)
    elif ftype == FrameType.UNSUBSCRIBE:
        (sub_id,) = r.unpack(_U32)
        frame = Unsubscribe(sub_id, r.str16(), r.str16(), rid)
    elif ftype == FrameType.UNSUBSCRIBED:
        frame = Unsubscribed(r.unpack(_U32)[0], rid)
    elif ftype == FrameType.PING:
        frame = Ping(r.rest(), rid)
    elif ftype == FrameType.PONG:
        frame = Pong(r.rest(), rid)
    elif ftype in (FrameType.GOODBYE, FrameType.ERROR):
        (code,) = r.unpack(_ERROR)
        cls = Goodbye if ftype == FrameType.GOODBYE else Error
        frame = cls(code, r.str16(), rid)
    else:
        raise RemoteProtocolError(f"unknown frame type {ftype:#04x}")
    r.done()
    return frame


class Decoder:
    """Incremental frame decoder: ``feed`` bytes as they arrive, then ``frames()``.

    Raises :class:`RemoteProtocolError` (with ``code``) on the first malformed or oversized
    frame; after that the decoder is unusable, as the connection should be closed.
    """

    __slots__ = ("_buf", "_error", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self._error: RemoteProtocolError | None = None
        self.max_frame = max_frame

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def frames(self) -> list[Frame]:
        """Every complete frame buffered so far, in order.

        When a bad frame follows good ones, the good ones are returned first and the error is
        raised by the next call, so the peer's valid requests are still served in order.
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        size = len(buf)
        if size < 4:
            return []
        (first,) = _U32.unpack_from(buf, 0)
        if MIN_LENGTH <= first <= self.max_frame and size < 4 + first:
            return []  # the first frame is incomplete: do not copy the buffer yet
        data = bytes(buf)
        out: list[Frame] = []
        pos = 0
        unpack = HEADER.unpack_from
        try:
            while size - pos >= 4:
                (length,) = _U32.unpack_from(data, pos)
                if length > self.max_frame:
                    raise RemoteProtocolError(
                        f"frame of {length} bytes exceeds the maximum of {self.max_frame}",
                        ErrorCode.FRAME_TOO_LARGE,
                    )
                if length < MIN_LENGTH:
                    raise RemoteProtocolError(f"frame length {length} is below the minimum of 5")
                end = pos + 4 + length
                if end > size:
                    break
                _, ftype, rid = unpack(data, pos)
                try:
                    out.append(_decode_body(ftype, rid, data, pos + HEADER_SIZE, end))
                except struct.error as exc:
                    raise RemoteProtocolError(f"malformed frame: {exc}") from None
                pos = end
        except RemoteProtocolError as exc:
            if not out:
                raise
            self._error = exc
        if pos:
            del buf[:pos]
        return out


def decode_one(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Frame:
    """Decode exactly one whole frame (tests and tools)."""
    dec = Decoder(max_frame)
    dec.feed(data)
    frames = dec.frames()
    if len(frames) != 1 or dec.buffered:
        raise RemoteProtocolError("expected exactly one whole frame")
    return frames[0]
