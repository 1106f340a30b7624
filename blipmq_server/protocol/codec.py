"""Bytes to frames and frames to bytes: the sans-IO codec of the wire protocol.

Frames and their codes are declared in ``frames``; the message record inside PUBLISH and
DELIVER in ``message``. Both are re-exported here, so ``codec`` is the one import a peer
needs. Every integer is big-endian; a frame's length is checked against the maximum frame
size before its body is read. No I/O here, and nothing outside the standard library.
"""

from __future__ import annotations

import struct

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.protocol.frames import (
    DEFAULT_MAX_FRAME,
    HEADER,
    HEADER_SIZE,
    MAX_BATCH,
    MIN_LENGTH,
    SUBSCRIBE_UNTIL_END,
    VERSION,
    Ack,
    Auth,
    AuthOk,
    Credit,
    Deliver,
    Error,
    ErrorCode,
    Frame,
    FrameType,
    Goodbye,
    Hello,
    Nack,
    Ping,
    Pong,
    PubAck,
    Publish,
    Start,
    Stats,
    StatsReport,
    Subscribe,
    Subscribed,
    Unsubscribe,
    Unsubscribed,
    Welcome,
)
from blipmq_server.protocol.message import (
    DELIVERED_RETAINED,
    DELIVERY_PREFIX,
    FLAG_DEAD,
    FLAG_KEY,
    FLAG_QOS1,
    FLAG_RETAIN,
    FLAGS_PUBLISHABLE,
    HEAD_SIZE,
    MESSAGE_OVERHEAD,
    MSG_HEAD,
    PREFIX_SIZE,
    DeadLetter,
    Delivery,
    Message,
    RawMessage,
    dead_at,
    dead_letter,
    dead_trailer,
    delivery_message,
    delivery_record,
    message_record,
    record_size,
)

__all__ = [
    "DEFAULT_MAX_FRAME", "DELIVERED_RETAINED", "DELIVERY_PREFIX", "FLAG_DEAD", "FLAG_KEY",
    "FLAG_QOS1", "FLAG_RETAIN", "HEADER",
    "HEADER_SIZE", "MAX_BATCH", "MESSAGE_OVERHEAD", "MIN_LENGTH", "MSG_HEAD", "SUBSCRIBE_UNTIL_END",
    "VERSION", "Ack",
    "Auth", "AuthOk", "Credit", "DeadLetter", "Decoder", "Deliver", "Delivery", "Error",
    "ErrorCode", "Frame", "FrameType", "Goodbye", "Hello", "Message", "Nack", "Ping", "Pong",
    "PubAck", "Publish", "RawMessage", "Start", "Stats", "StatsReport", "Subscribe",
    "Subscribed", "Unsubscribe",
    "Unsubscribed", "Welcome", "dead_letter", "dead_trailer", "decode_one", "delivery_record",
    "encode", "encode_deliver", "encode_publish", "frame_limit", "message_record",
    "record_size",
]

_U16 = struct.Struct(">H")
_PUBLISH_HEAD = struct.Struct(">IBIH")  # the frame header and the message count
_DELIVER_HEAD = struct.Struct(">IBIIH")  # the frame header, the subscription, the count
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_SUB = struct.Struct(">BIBQ")  # qos, credit, start, start_offset
_ACK_HEAD = struct.Struct(">IH")  # sub_id, count (ACK, and DELIVER's head)
_NACK_HEAD = struct.Struct(">IIH")  # sub_id, delay_ms, count
_CREDIT = struct.Struct(">II")  # sub_id, credit
_HELLO = struct.Struct(">H")
_WELCOME = struct.Struct(">HII")
_ERROR = struct.Struct(">H")
_DELIVERY_HEAD = PREFIX_SIZE + HEAD_SIZE  # 32: a delivery record before its topic
# a delivery record's prefix and message head, read in one call
_RECORD_HEAD = struct.Struct(">" + DELIVERY_PREFIX.format[1:] + MSG_HEAD.format[1:])
assert _RECORD_HEAD.size == _DELIVERY_HEAD
_KEY_OR_DEAD = FLAG_KEY | FLAG_DEAD
_DELIVER = int(FrameType.DELIVER)
_PUBLISH = int(FrameType.PUBLISH)
# NamedTuples made per message on the hot paths skip their generated ``__new__`` (a Python
# call) and are built as the tuples they are, fields in declaration order
_tuple_new = tuple.__new__


def frame_limit(max_message_bytes: int, max_batch_bytes: int = 0) -> int:
    """The largest frame ``length`` a broker with these limits sends or accepts.

    A DELIVER frame holds up to ``max_batch_bytes`` of delivery records, or one record alone
    when it is larger; a PUBLISH frame holds at least one message. Both sides decode with this
    limit (the broker announces it in WELCOME), so any message the broker accepts can reach
    every subscriber.
    """
    one = PREFIX_SIZE + MESSAGE_OVERHEAD + max_message_bytes
    return MIN_LENGTH + _ACK_HEAD.size + max(one, max_batch_bytes)


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


def encode_publish(records: list[bytes], request_id: int = 0) -> bytes:
    """A PUBLISH frame from message records made by :func:`message_record`."""
    count = len(records)
    if not 1 <= count <= MAX_BATCH:
        raise LocalProtocolError(f"a PUBLISH carries 1 to {MAX_BATCH} messages, not {count}")
    if not 0 <= request_id <= 0xFFFFFFFF:
        raise LocalProtocolError(f"request_id {request_id} is out of range for u32")
    return b"".join((_PUBLISH_HEAD.pack(7 + sum(map(len, records)), _PUBLISH, request_id, count),
                     *records))


def deliver_head(sub_id: int, records: list[bytes], request_id: int = 0) -> bytes:
    """The bytes of a DELIVER frame before its records, which follow it as they are (the
    broker's writer joins heads and records of several frames with one copy)."""
    try:
        return _DELIVER_HEAD.pack(11 + sum(map(len, records)), _DELIVER, request_id, sub_id,
                                  len(records))
    except struct.error:  # a u32 or the u16 count out of range
        raise LocalProtocolError(f"DELIVER of {len(records)} record(s) for subscription "
                                 f"{sub_id}, request {request_id}: out of range") from None


def encode_deliver(sub_id: int, records: list[bytes], request_id: int = 0) -> bytes:
    """A DELIVER frame from delivery records (``DELIVERY_PREFIX`` + message record)."""
    return b"".join([deliver_head(sub_id, records, request_id), *records])


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
        case AuthOk() | Stats():
            return b""
        case StatsReport():
            return frame.data
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
            if frame.flags & ~SUBSCRIBE_UNTIL_END:
                raise LocalProtocolError(f"unknown SUBSCRIBE flags {frame.flags:#x}")
            return (
                _SUB.pack(frame.qos, _u(frame.credit, 32, "credit"), frame.start,
                          _u(frame.start_offset, 64, "start_offset"))
                + _str16(frame.topic_filter) + _str16(frame.group)
                + (bytes((_u(frame.flags, 8, "flags"),)) if frame.flags else b"")
            )
        case Subscribed():
            return _U32.pack(_u(frame.sub_id, 32, "sub_id")) + (
                b"" if frame.end is None else _U64.pack(_u(frame.end, 64, "end")))
        case Unsubscribe():
            return (
                _U32.pack(_u(frame.sub_id, 32, "sub_id"))
                + _str16(frame.topic_filter) + _str16(frame.group)
            )
        case Unsubscribed():
            return _U32.pack(_u(frame.count, 32, "count"))
        case Deliver():
            records = [
                delivery_record(d.offset, d.delivery_count, delivery_message(d), d.timestamp_ms,
                                DELIVERED_RETAINED if d.retained else 0)
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
            ) + struct.pack(f">{n}Q", *frame.offsets) + (
                _str16(frame.reason) if frame.reason else b"")
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
    new, raw = _tuple_new, RawMessage
    for _ in range(count):
        if pos + head_size > end:
            raise RemoteProtocolError("PUBLISH message header ends early")
        flags, ttl, tlen, klen, plen = unpack(data, pos)
        stop = pos + head_size + tlen + klen + plen
        if stop > end:
            raise RemoteProtocolError("PUBLISH message ends early")
        if flags & ~FLAGS_PUBLISHABLE or (klen and not flags & FLAG_KEY):
            raise RemoteProtocolError(f"PUBLISH message has invalid flags {flags:#04x}")
        tstart = pos + head_size
        out.append(new(raw, (data[tstart : tstart + tlen], flags & FLAG_QOS1, ttl, plen,
                             data[pos:stop], flags & FLAG_RETAIN)))
        pos = stop
    if pos != end:
        raise RemoteProtocolError(f"{end - pos} unexpected bytes after PUBLISH messages")
    return tuple(out)


# topics of DELIVER records as text, by their bytes: a subscriber sees the same few again and
# again (a few hundred kept; past that the cache starts over)
_TOPICS: dict[bytes, str] = {}
_TOPICS_KEPT = 512


def _deliveries(data: bytes, pos: int, end: int) -> tuple[int, tuple[Delivery, ...]]:
    """A DELIVER body: the subscription and its deliveries. One unpack reads a record's
    prefix and message head together; a record without key, dead-letter trailer or
    delivery flags (the usual one) takes the short way."""
    if pos + _ACK_HEAD.size > end:
        raise RemoteProtocolError("frame body ends early")
    sub_id, count = _ACK_HEAD.unpack_from(data, pos)
    pos += _ACK_HEAD.size
    out = []
    head = _RECORD_HEAD.unpack_from
    topics = _TOPICS
    if len(topics) > _TOPICS_KEPT:
        topics.clear()
    new, delivery = _tuple_new, Delivery
    for _ in range(count):
        if pos + _DELIVERY_HEAD > end:
            raise RemoteProtocolError("DELIVER message header ends early")
        offset, dcount, ts, dflags, flags, ttl, tlen, klen, plen = head(data, pos)
        p = pos + _DELIVERY_HEAD
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
        if not (dflags or flags & _KEY_OR_DEAD):
            out.append(new(delivery, (offset, dcount, topic, data[p + tlen : pos],
                                      flags & FLAG_QOS1, ttl, None, None, ts, False,
                                      flags & FLAG_RETAIN != 0)))
            continue
        if dflags and dflags != DELIVERED_RETAINED:
            raise RemoteProtocolError(f"DELIVER record has invalid delivery flags {dflags:#04x}")
        p += tlen
        key = data[p : p + klen] if flags & FLAG_KEY else None
        p += klen
        dead = None
        if flags & FLAG_DEAD:
            dead, stop = dead_at(data, pos, end)
            payload, pos = data[p:pos], stop
        else:
            payload = data[p:pos]
        out.append(new(delivery, (offset, dcount, topic, payload, flags & FLAG_QOS1, ttl, key,
                                  dead, ts, dflags != 0, flags & FLAG_RETAIN != 0)))
    if pos != end:
        raise RemoteProtocolError(f"{end - pos} unexpected bytes after frame body")
    return sub_id, tuple(out)


def _decode_body(ftype: int, rid: int, data: bytes, pos: int, end: int) -> Frame:
    """Every frame but PUBLISH and DELIVER, which ``Decoder.frames`` builds itself (the hot
    path, as the tuples they are: ``_tuple_new``)."""
    r = _Reader(data, pos, end)
    frame: Frame
    if ftype == FrameType.ACK:
        sub_id, n = r.unpack(_ACK_HEAD)
        frame = Ack(sub_id, r.unpack(struct.Struct(f">{n}Q")), rid)
    elif ftype == FrameType.NACK:
        sub_id, delay_ms, n = r.unpack(_NACK_HEAD)
        offsets = r.unpack(struct.Struct(f">{n}Q"))
        frame = Nack(sub_id, offsets, delay_ms, rid, r.str16() if r.pos < end else "")
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
        if start > Start.TIME:
            raise RemoteProtocolError(f"SUBSCRIBE start must be 0 to 3, not {start}")
        topic_filter, group = r.str16(), r.str16()
        flags = r.take(1)[0] if r.pos < end else 0
        if flags & ~SUBSCRIBE_UNTIL_END:
            raise RemoteProtocolError(f"SUBSCRIBE flags {flags:#04x}: only bit 0 is defined")
        frame = Subscribe(topic_filter, group, qos, credit, start, start_offset, rid, flags)
    elif ftype == FrameType.SUBSCRIBED:
        (sub_id,) = r.unpack(_U32)
        frame = Subscribed(sub_id, rid, r.unpack(_U64)[0] if r.pos < end else None)
    elif ftype == FrameType.UNSUBSCRIBE:
        (sub_id,) = r.unpack(_U32)
        frame = Unsubscribe(sub_id, r.str16(), r.str16(), rid)
    elif ftype == FrameType.UNSUBSCRIBED:
        frame = Unsubscribed(r.unpack(_U32)[0], rid)
    elif ftype == FrameType.PING:
        frame = Ping(r.rest(), rid)
    elif ftype == FrameType.PONG:
        frame = Pong(r.rest(), rid)
    elif ftype == FrameType.STATS:
        frame = Stats(rid)
    elif ftype == FrameType.STATS_REPORT:
        frame = StatsReport(r.rest(), rid)
    elif ftype in (FrameType.GOODBYE, FrameType.ERROR):
        (code,) = r.unpack(_ERROR)
        cls = Goodbye if ftype == FrameType.GOODBYE else Error
        frame = cls(code, r.str16(), rid)
    else:
        raise RemoteProtocolError(f"unknown frame type {ftype:#04x}")
    r.done()
    return frame


_KEEP_CHUNK = 1024  # a fed chunk this big is kept as it is; smaller ones are gathered
_SMALL_LIMIT = 65536  # gathered small chunks become one chunk at this size


class Decoder:
    """Incremental frame decoder: ``feed`` bytes as they arrive, then ``frames()``.

    Raises :class:`RemoteProtocolError` (with ``code``) on the first malformed or oversized
    frame; after that the decoder is unusable, as the connection should be closed.

    It keeps a chunk that arrives with nothing buffered, and chunks of 1 KiB or more, as
    they came and joins them only once a whole frame is there: a chunk that holds whole
    frames is decoded where it lies, and a large frame that came in several chunks is copied
    once, not once per chunk. Other small chunks gather in a buffer of their own (up to 64
    KiB at a time), so a peer that sends a frame a byte at a time costs about the frame's
    size in memory, not an object per byte.
    """

    __slots__ = ("_chunks", "_error", "_size", "_small", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._chunks: list[bytes] = []
        self._small = bytearray()  # what came after the last chunk, in pieces under 1 KiB
        self._size = 0
        self._error: RemoteProtocolError | None = None
        self.max_frame = max_frame

    def feed(self, data: bytes) -> None:
        if not self._size:  # nothing buffered: whole frames are decoded where they lie
            if data:
                self._chunks.append(data)
                self._size = len(data)
            return
        small = self._small
        if len(data) < _KEEP_CHUNK:
            small += data
            if len(small) >= _SMALL_LIMIT:
                self._chunks.append(bytes(small))
                small.clear()
        else:
            if small:
                self._chunks.append(bytes(small))
                small.clear()
            self._chunks.append(data)
        self._size += len(data)

    @property
    def buffered(self) -> int:
        return self._size

    @property
    def wanted(self) -> int:
        """The whole size of the incomplete frame buffered, its length field included, once
        that field is in (0 before, or with nothing buffered). Meaningful after
        ``frames()``, which leaves only an incomplete frame."""
        if self._size < 4:
            return 0
        chunks = self._chunks
        head = chunks[0] if len(chunks[0]) >= 4 else self._joined()
        return 4 + _U32.unpack_from(head, 0)[0]

    def _joined(self) -> bytes:
        """Everything buffered, as one bytes object (a copy only when it is in pieces)."""
        chunks = self._chunks
        if self._small:
            chunks.append(bytes(self._small))
            self._small.clear()
        if len(chunks) > 1:
            chunks[:] = [b"".join(chunks)]
        return chunks[0]

    def frames(self) -> list[Frame]:
        """Every complete frame buffered so far, in order.

        When a bad frame follows good ones, the good ones are returned first and the error is
        raised by the next call, so the peer's valid requests are still served in order.
        """
        if self._error is not None:
            raise self._error
        size = self._size
        if size < 4:
            return []
        chunks = self._chunks
        if len(chunks) == 1 and not self._small:  # one chunk (the usual): no copy
            data = chunks[0]
        else:
            head = chunks[0] if chunks and len(chunks[0]) >= 4 else self._joined()
            (first,) = _U32.unpack_from(head, 0)
            if MIN_LENGTH <= first <= self.max_frame and size < 4 + first:
                return []  # the first frame is incomplete: do not copy anything yet
            data = self._joined()
        out: list[Frame] = []
        pos = 0
        unpack, max_frame = HEADER.unpack_from, self.max_frame
        try:
            while size - pos >= 4:
                if size - pos >= HEADER_SIZE:
                    length, ftype, rid = unpack(data, pos)
                else:  # a length alone: checked, or the frame is incomplete
                    (length,) = _U32.unpack_from(data, pos)
                if length > max_frame:
                    raise RemoteProtocolError(
                        f"frame of {length} bytes exceeds the maximum of {max_frame}",
                        ErrorCode.FRAME_TOO_LARGE,
                    )
                if length < MIN_LENGTH:
                    raise RemoteProtocolError(f"frame length {length} is below the minimum of 5")
                end = pos + 4 + length
                if end > size:
                    break
                try:
                    if ftype == _PUBLISH:  # the two frames of the hot path, without a call
                        frame = _tuple_new(Publish, (
                            _publish_messages(data, pos + HEADER_SIZE, end), rid))
                    elif ftype == _DELIVER:
                        frame = _tuple_new(Deliver, (
                            *_deliveries(data, pos + HEADER_SIZE, end), rid))
                    else:
                        frame = _decode_body(ftype, rid, data, pos + HEADER_SIZE, end)
                    out.append(frame)
                except struct.error as exc:
                    raise RemoteProtocolError(f"malformed frame: {exc}") from None
                pos = end
        except RemoteProtocolError as exc:
            if not out:
                raise
            self._error = exc
        self._chunks = [data[pos:]] if pos < size else []  # data holds all: _small is empty
        self._size = size - pos
        return out


def decode_one(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> Frame:
    """Decode exactly one whole frame (tests and tools)."""
    dec = Decoder(max_frame)
    dec.feed(data)
    frames = dec.frames()
    if len(frames) != 1 or dec.buffered:
        raise RemoteProtocolError("expected exactly one whole frame")
    return frames[0]
