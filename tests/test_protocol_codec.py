"""The sans-IO wire codec: round trips, incremental decoding, malformed input, exact layout."""

from __future__ import annotations

import json
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.protocol import report as stats_report
from blipmq_server.protocol.codec import (
    DEFAULT_MAX_FRAME,
    MAX_BATCH,
    SUBSCRIBE_UNTIL_END,
    Ack,
    Auth,
    AuthOk,
    Credit,
    DeadLetter,
    Decoder,
    Deliver,
    Delivery,
    Error,
    ErrorCode,
    Frame,
    FrameType,
    Goodbye,
    Hello,
    Message,
    Nack,
    Ping,
    Pong,
    PubAck,
    Publish,
    RawMessage,
    Start,
    Stats,
    StatsReport,
    Subscribe,
    Subscribed,
    Unsubscribe,
    Unsubscribed,
    Welcome,
    decode_one,
    delivery_record,
    encode,
    encode_deliver,
    encode_publish,
    message_record,
)

# ----------------------------------------------------------------------------- helpers


def typed(frame: object) -> tuple[type, object]:
    """Frames are NamedTuples, equal to any tuple with the same fields: compare types too."""
    return type(frame), frame


def raw(ftype: int, body: bytes, request_id: int = 0, length: int | None = None) -> bytes:
    """A frame assembled by hand (independent of the codec's own header packing)."""
    if length is None:
        length = 5 + len(body)
    return struct.pack(">IBI", length, ftype, request_id) + body


def msg_bytes(
    topic: bytes, payload: bytes = b"", flags: int = 0, ttl: int = 0, key: bytes = b""
) -> bytes:
    """One message record assembled by hand."""
    head = struct.pack(">BIHHI", flags, ttl, len(topic), len(key), len(payload))
    return head + topic + key + payload


def s16(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def publish_frame(messages: list[Message], request_id: int = 0) -> tuple[bytes, Publish]:
    """PUBLISH bytes plus the frame a decoder must produce for them, built independently."""
    records = [message_record(m) for m in messages]
    expected = Publish(
        tuple(
            RawMessage(m.topic.encode(), m.qos, m.ttl_ms, len(m.payload), rec,
                       0x08 if m.retain else 0)
            for m, rec in zip(messages, records, strict=True)
        ),
        request_id,
    )
    return encode_publish(records, request_id), expected


def decode_all(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> list[Frame]:
    dec = Decoder(max_frame)
    dec.feed(data)
    out = dec.frames()
    assert dec.buffered == 0
    return out


def decode_error(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> RemoteProtocolError:
    """The error a fresh decoder raises on ``data`` (which must be a whole frame or more)."""
    dec = Decoder(max_frame)
    dec.feed(data)
    with pytest.raises(RemoteProtocolError) as info:
        dec.frames()
    return info.value


SUB0 = struct.pack(">BIBQ", 2, 0, 0, 0)  # a SUBSCRIBE head with qos 2
DELIVERIES = (
    Delivery(1, 1, "a/b", b"payload", 0, 0, None),
    Delivery(2**64 - 1, 65535, "ünï/код/🚀", b"", 1, 2**32 - 1, b"key"),
    Delivery(7, 2, "k/empty", b"\x00\xff", 0, 5, b""),
    Delivery(8, 1, "$dlq/a", b"p", 1, 0, b"k", DeadLetter(5, "not acked in time — ✗")),
    Delivery(9, 1, "$dlq/b", b"", 0, 0, None, DeadLetter(65535, "")),
)

SAMPLE_FRAMES: list[Frame] = [
    Hello(),
    Hello(1, "blipmq-py/0.1 ✓", 1),
    Stats(9),
    StatsReport(b'{"topics": []}', 9),
    Welcome(1, DEFAULT_MAX_FRAME, 65536, "blipmq", 1),
    Welcome(65535, 2**32 - 1, 0, "", 2**32 - 1),
    Auth(""),
    Auth("s3cr3t-κλειδί", 2),
    AuthOk(2),
    PubAck(0),
    PubAck(2**32 - 1, 9),
    Subscribe("a/+/c"),
    Subscribe("a/#", "workers", 1, 100, request_id=4),
    Subscribe("a/#", "", 0, 0, Start.EARLIEST, 0, 5),
    Subscribe("a/#", "g", 1, 2**32 - 1, Start.OFFSET, 2**64 - 1, 6),
    Subscribed(1, 4),
    Subscribe("a/#", "", 0, 0, Start.EARLIEST, 0, 7, SUBSCRIBE_UNTIL_END),
    Subscribed(2, 7, 0),
    Subscribed(3, 8, 2**64 - 1),
    Unsubscribe(3, request_id=5),
    Unsubscribe(0, "a/#", "workers", 6),
    Unsubscribed(0),
    Unsubscribed(12, 6),
    Deliver(1, ()),
    Deliver(2**32 - 1, DELIVERIES[:1], 0),
    Deliver(42, DELIVERIES, 3),
    Ack(1, ()),
    Ack(9, tuple(range(0, 2**64, 2**60)), 3),
    Ack(9, (0, 2**64 - 1)),
    Nack(1, ()),
    Nack(9, (3, 2**64 - 1), 2**32 - 1, 7),
    Credit(1, 0),
    Credit(2**32 - 1, 2**32 - 1, 5),
    Ping(),
    Ping(b"\x00\x01\xff" * 10, 8),
    Pong(b"hi", 8),
    Goodbye(),
    Goodbye(ErrorCode.SHUTTING_DOWN, "bye ☃ — à bientôt", 1),
    Error(ErrorCode.GROUP_DELETED, "группа удалена 🗑", 77),
    Error(ErrorCode.PROTOCOL, ""),
]


def sample_stream() -> tuple[bytes, list[Frame]]:
    parts = [encode(f) for f in SAMPLE_FRAMES]
    expected = list(SAMPLE_FRAMES)
    for i, batch in enumerate(
        [
            [Message("a/b", b"x")],
            [Message("t/ü", b"\x00" * 300, 1, 1000, b"k"), Message("z", b"", 0, 0, b"")],
        ]
    ):
        data, frame = publish_frame(batch, 100 + i)
        parts.append(data)
        expected.append(frame)
    # interleave so frame types mix in the byte stream
    order = list(range(len(parts)))
    random.Random(1).shuffle(order)
    return b"".join(parts[i] for i in order), [expected[i] for i in order]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("frame", SAMPLE_FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: Frame) -> None:
    data = encode(frame)
    assert struct.unpack_from(">I", data)[0] == len(data) - 4
    assert data[4] == frame.TYPE
    assert typed(decode_one(data)) == typed(frame)


def test_sample_frames_cover_every_frame_type() -> None:
    covered = {f.TYPE for f in SAMPLE_FRAMES} | {FrameType.PUBLISH}
    assert covered == set(FrameType)


@pytest.mark.parametrize(
    "messages",
    [
        [Message("a", b"")],
        [Message("sensors/kitchen/temp", b"21.5", 0, 0, None)],
        [Message("q/1", b"x" * 1000, 1, 2**32 - 1, b"device-7")],
        [Message("k", b"p", 0, 10, b"")],  # empty key is a key, not "no key"
        [Message(f"t/{i}", bytes([i]) * i, i % 2, i, None if i % 3 else b"k%d" % i)
         for i in range(50)],
    ],
    ids=["tiny", "plain", "qos1-key-maxttl", "empty-key", "batch-50"],
)
def test_publish_round_trip(messages: list[Message]) -> None:
    data, expected = publish_frame(messages, 99)
    frame = decode_one(data)
    assert frame == expected
    assert isinstance(frame, Publish)
    assert frame.decoded() == messages
    # the Publish dataclass encodes to the same bytes as encode_publish
    assert encode(frame) == data


def test_publish_empty_key_differs_from_no_key() -> None:
    with_key = decode_one(encode_publish([message_record(Message("t", b"", key=b""))]))
    without = decode_one(encode_publish([message_record(Message("t", b""))]))
    assert isinstance(with_key, Publish) and isinstance(without, Publish)
    assert with_key.decoded()[0].key == b""
    assert without.decoded()[0].key is None


def test_message_record_topic_bytes_override() -> None:
    rec = message_record(Message("ignored", b"p"), topic_bytes=b"real/topic")
    frame = decode_one(encode_publish([rec]))
    assert isinstance(frame, Publish)
    assert frame.messages[0].topic == b"real/topic"
    assert frame.decoded() == [Message("real/topic", b"p")]


@pytest.mark.parametrize("key", [None, b"", b"k", b"\x00" * 300])
def test_deliver_keys_round_trip(key: bytes | None) -> None:
    frame = Deliver(5, (Delivery(10, 3, "a/b", b"data", 0, 0, key),), 1)
    decoded = decode_one(encode(frame))
    assert typed(decoded) == typed(frame)
    assert isinstance(decoded, Deliver)
    assert decoded.messages[0].key == key


def test_encode_deliver_matches_dataclass_encoding() -> None:
    records = [
        delivery_record(d.offset, d.delivery_count,
                        message_record(Message(d.topic, d.payload, d.qos, d.ttl_ms, d.key)))
        for d in DELIVERIES if d.dead is None
    ]
    data = encode_deliver(42, records, 3)
    plain = tuple(d for d in DELIVERIES if d.dead is None)
    assert data == encode(Deliver(42, plain, 3))
    assert decode_one(data) == Deliver(42, plain, 3)


def test_broker_forwarding_publish_record_into_deliver() -> None:
    """The broker copies a PUBLISH message's bytes verbatim behind a delivery prefix."""
    msg = Message("x/y", b"body", 0, 30, b"kk")
    pub = decode_one(encode_publish([message_record(msg)]))
    assert isinstance(pub, Publish)
    data = encode_deliver(8, [delivery_record(123, 1, pub.messages[0].record)])
    assert decode_one(data) == Deliver(8, (Delivery(123, 1, "x/y", b"body", 0, 30, b"kk"),))


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_ack_offsets_round_trip(n: int) -> None:
    frame = Ack(3, tuple(range(10**12, 10**12 + n)), 4)
    data = encode(frame)
    assert len(data) == 4 + 5 + 6 + 8 * n
    assert typed(decode_one(data)) == typed(frame)


# --------------------------------------------------------------------------- exact layout


def test_layout_ping() -> None:
    assert encode(Ping(b"hi", request_id=7)) == bytes.fromhex("0000000740000000076869")


def test_layout_publish_one_message() -> None:
    record = message_record(Message("a/b", b"xy", qos=0, ttl_ms=1000, key=b"k"))
    expected = bytes.fromhex(
        "0000001a"  # length 26 = 5 + 2 + 19
        "10"  # PUBLISH
        "00000001"  # request id
        "0001"  # count
        "02"  # flags: key
        "000003e8"  # ttl 1000
        "0003"  # topic_len
        "0001"  # key_len
        "00000002"  # payload_len
        "612f62"  # "a/b"
        "6b"  # "k"
        "7879"  # "xy"
    )
    assert encode_publish([record], request_id=1) == expected


def test_layout_deliver_one_message() -> None:
    frame = Deliver(2, (Delivery(5, 1, "t", b"z", 1, 0, None, None, 1795363200000),), 0)
    expected = bytes.fromhex(
        "0000002d"  # length 45 = 5 + 6 + 32 + 2
        "30" "00000000"  # DELIVER, request id 0
        "00000002" "0001"  # sub_id 2, count 1
        "0000000000000005" "0001"  # offset 5, delivery_count 1
        "000001a203fc5c00" "00"  # timestamp_ms 2026-11-22T16:00:00Z, not a retained value
        "01" "00000000" "0001" "0000" "00000001"  # flags qos1, ttl, topic, key, payload lens
        "74" "7a"  # "t", "z"
    )
    assert encode(frame) == expected
    assert decode_one(expected) == frame


def test_layout_deliver_retained_value() -> None:
    """dflags bit 0 marks a retained value sent on subscribing; the record keeps bit 3."""
    frame = Deliver(2, (Delivery(5, 1, "t", b"on", 0, 0, None, None, 7, True, True),), 0)
    data = encode(frame)
    prefix = data[15 : 15 + 19]
    assert prefix == bytes.fromhex("0000000000000005" "0001" "0000000000000007" "01")
    assert data[15 + 19] == 0x08  # FLAG_RETAIN
    assert decode_one(data) == frame


def test_a_live_delivery_says_whether_it_was_published_with_retain() -> None:
    """A live message published with retain (the topic's new retained value) keeps the
    record's bit 3 and no delivery flag: ``retain`` without ``retained``."""
    frame = Deliver(2, (Delivery(6, 1, "t", b"off", 0, 0, None, None, 7, False, True),
                        Delivery(7, 1, "t", b"x", 0, 0, None, None, 7)), 0)
    data = encode(frame)
    assert data[15 + 18] == 0 and data[15 + 19] == 0x08
    decoded = decode_one(data)
    assert decoded == frame
    assert [(d.retain, d.retained) for d in decoded.messages] == [(True, False), (False, False)]


def test_deliver_with_unknown_delivery_flags_is_malformed() -> None:
    data = bytearray(encode(Deliver(2, (Delivery(5, 1, "t", b"on", 0, 0, None),), 0)))
    data[15 + 18] = 0x02
    with pytest.raises(RemoteProtocolError, match="delivery flags"):
        decode_one(bytes(data))


def test_publish_retain_flag_round_trips() -> None:
    record = message_record(Message("status/a", b"up", retain=True))
    assert record[0] == 0x08
    pub = decode_one(encode_publish([record]))
    assert pub.messages[0].retain == 0x08
    assert pub.decoded() == [Message("status/a", b"up", retain=True)]


def test_layout_small_frames() -> None:
    assert encode(Hello(1, "c", 3)) == bytes.fromhex("0000000a" "01" "00000003" "0001" "0001" "63")
    assert encode(AuthOk(9)) == bytes.fromhex("00000005" "04" "00000009")
    assert encode(Subscribe("a", "g", 1, 16, Start.OFFSET, 5, 2)) == bytes.fromhex(
        "00000019" "20" "00000002" "01" "00000010" "02" "0000000000000005" "0001" "61" "0001" "67"
    )
    # the optional trailing fields: SUBSCRIBE's flags byte, SUBSCRIBED's end u64
    assert encode(Subscribe("a", "", 0, 0, Start.EARLIEST, 0, 2, SUBSCRIBE_UNTIL_END)
                  ) == bytes.fromhex("00000019" "20" "00000002" "00" "00000000" "01"
                                     "0000000000000000" "0001" "61" "0000" "01")
    assert encode(Subscribed(7, 2, 12)) == bytes.fromhex(
        "00000011" "21" "00000002" "00000007" "000000000000000c")
    assert encode(Subscribed(7, 2)) == bytes.fromhex("00000009" "21" "00000002" "00000007")
    assert encode(Nack(1, (2,), 300)) == bytes.fromhex(
        "00000017" "32" "00000000" "00000001" "0000012c" "0001" "0000000000000002"
    )
    assert encode(Credit(3, 10)) == bytes.fromhex("0000000d" "33" "00000000" "00000003" "0000000a")
    assert encode(Ack(1, (2,))) == bytes.fromhex(
        "00000013" "31" "00000000" "00000001" "0001" "0000000000000002"
    )
    assert encode(Error(ErrorCode.NOT_FOUND, "é", 4)) == bytes.fromhex(
        "0000000b" "7f" "00000004" "0009" "0002" "c3a9"
    )


def test_error_code_values_are_pinned() -> None:
    assert {c.name: c.value for c in ErrorCode} == {
        "PROTOCOL": 1, "FRAME_TOO_LARGE": 2, "UNSUPPORTED_VERSION": 3, "NOT_AUTHENTICATED": 4,
        "AUTH_FAILED": 5, "MESSAGE_TOO_LARGE": 6, "INVALID_TOPIC": 7, "INVALID_REQUEST": 8,
        "NOT_FOUND": 9, "QUEUE_FULL": 10, "TOO_MANY_CONNECTIONS": 11, "SHUTTING_DOWN": 12,
        "UNSUPPORTED": 13, "GROUP_DELETED": 14, "TIMEOUT": 15, "NORMAL": 16, "STORAGE": 17,
        "LIMIT": 18, "FORBIDDEN": 19,
    }


def test_frame_type_values_are_pinned() -> None:
    assert {t.name: t.value for t in FrameType} == {
        "HELLO": 0x01, "WELCOME": 0x02, "AUTH": 0x03, "AUTH_OK": 0x04, "PUBLISH": 0x10,
        "PUB_ACK": 0x11, "SUBSCRIBE": 0x20, "SUBSCRIBED": 0x21, "UNSUBSCRIBE": 0x22,
        "UNSUBSCRIBED": 0x23, "DELIVER": 0x30, "ACK": 0x31, "NACK": 0x32, "CREDIT": 0x33,
        "PING": 0x40, "PONG": 0x41,
        "GOODBYE": 0x42, "STATS": 0x43, "STATS_REPORT": 0x44, "ERROR": 0x7F,
    }


# ---------------------------------------------------------------------- incremental decoding


def test_stream_fed_whole() -> None:
    data, expected = sample_stream()
    assert [typed(f) for f in decode_all(data)] == [typed(f) for f in expected]


def test_stream_fed_byte_by_byte() -> None:
    data, expected = sample_stream()
    dec = Decoder()
    got: list[Frame] = []
    for i in range(len(data)):
        dec.feed(data[i : i + 1])
        got.extend(dec.frames())
    assert [typed(f) for f in got] == [typed(f) for f in expected]
    assert dec.buffered == 0


@pytest.mark.parametrize("seed", range(20))
def test_stream_fed_in_random_chunks(seed: int) -> None:
    data, expected = sample_stream()
    rng = random.Random(seed)
    dec = Decoder()
    got: list[Frame] = []
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 200)
        dec.feed(data[pos : pos + n])
        pos += n
        got.extend(dec.frames())
    assert [typed(f) for f in got] == [typed(f) for f in expected]
    assert dec.buffered == 0


def test_incomplete_frame_is_kept_buffered() -> None:
    first = encode(Ping(b"one", 1))
    second = encode(Pong(b"two", 2))
    dec = Decoder()
    dec.feed(first + second[:-1])
    assert dec.frames() == [Ping(b"one", 1)]
    assert dec.buffered == len(second) - 1
    assert dec.frames() == []  # nothing new: still waiting
    dec.feed(second[-1:])
    assert dec.frames() == [Pong(b"two", 2)]
    assert dec.buffered == 0


@pytest.mark.parametrize("cut", [1, 3, 4, 8, 9])
def test_partial_header_waits(cut: int) -> None:
    data = encode(Ping(b"abc", 5))
    dec = Decoder()
    dec.feed(data[:cut])
    assert dec.frames() == []
    assert dec.buffered == cut
    dec.feed(data[cut:])
    assert dec.frames() == [Ping(b"abc", 5)]


def test_junk_after_valid_frame_fed_separately() -> None:
    good = encode(Ping(b"ok", 1))
    dec = Decoder(max_frame=1024)
    dec.feed(good)
    assert dec.frames() == [Ping(b"ok", 1)]
    dec.feed(b"\xff\xff\xff\xff" + b"junk")
    with pytest.raises(RemoteProtocolError) as info:
        dec.frames()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_junk_after_valid_frame_fed_together() -> None:
    good = encode(Ping(b"ok", 1))
    dec = Decoder(max_frame=1024)
    dec.feed(good + b"\x7f\x00\x00\x00" + b"junk")
    assert dec.frames() == [Ping(b"ok", 1)]  # the good frame first ...
    with pytest.raises(RemoteProtocolError) as info:  # ... the error on the next call
        dec.frames()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(RemoteProtocolError):  # and the decoder stays failed
        dec.frames()


def test_malformed_after_valid_frames_fed_together() -> None:
    good = encode(AuthOk(1)) + encode(Ping(b"", 2))
    dec = Decoder()
    dec.feed(good + raw(0x55, b"", 3))
    assert dec.frames() == [AuthOk(1), Ping(b"", 2)]
    with pytest.raises(RemoteProtocolError, match="unknown frame type") as info:
        dec.frames()
    assert info.value.code == ErrorCode.PROTOCOL


@pytest.mark.parametrize("max_frame", [5, 100, DEFAULT_MAX_FRAME])
def test_max_frame_checked_from_length_prefix_alone(max_frame: int) -> None:
    dec = Decoder(max_frame)
    dec.feed(struct.pack(">I", max_frame + 1))
    with pytest.raises(RemoteProtocolError) as info:
        dec.frames()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


def test_max_frame_boundary_is_inclusive() -> None:
    frame = Ping(b"x" * 95)  # length = 5 + 95 = 100
    assert typed(decode_one(encode(frame), max_frame=100)) == typed(frame)
    err = decode_error(encode(frame), max_frame=99)
    assert err.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("length", [0, 1, 4])
def test_length_below_minimum_checked_from_prefix_alone(length: int) -> None:
    dec = Decoder()
    dec.feed(struct.pack(">I", length))
    with pytest.raises(RemoteProtocolError, match="below the minimum") as info:
        dec.frames()
    assert info.value.code == ErrorCode.PROTOCOL


def test_decode_one_refuses_partial_and_extra() -> None:
    data = encode(Ping(b"p"))
    assert decode_one(data) == Ping(b"p")
    with pytest.raises(RemoteProtocolError):
        decode_one(data[:-1])
    with pytest.raises(RemoteProtocolError):
        decode_one(data + data)


# ---------------------------------------------------------------------------- malformed


DELIVER_ONE = struct.pack(">IHQHQB", 1, 1, 0, 1, 0, 0)  # sub 1, 1 record: offset 0, count 1

MALFORMED: dict[str, bytes] = {
    "unknown-type": raw(0x55, b""),
    "unknown-type-zero": raw(0x00, b"\x00\x01"),
    "hello-too-short": raw(FrameType.HELLO, b"\x00"),
    "hello-string-cut": raw(FrameType.HELLO, b"\x00\x01" + b"\x00\x05abc"),
    "welcome-too-short": raw(FrameType.WELCOME, b"\x00\x01\x00\x00"),
    "pub-ack-too-short": raw(FrameType.PUB_ACK, b"\x00\x00\x01"),
    "subscribed-too-short": raw(FrameType.SUBSCRIBED, b""),
    "error-too-short": raw(FrameType.ERROR, b"\x00"),
    "ack-offsets-missing": raw(FrameType.ACK, struct.pack(">IHQQ", 1, 3, 1, 2)),
    "auth-ok-extra": raw(FrameType.AUTH_OK, b"\x00"),
    "hello-extra": raw(FrameType.HELLO, b"\x00\x01" + s16(b"c") + b"!"),
    "subscribed-extra": raw(FrameType.SUBSCRIBED, b"\x00\x00\x00\x01\x00"),
    "goodbye-extra": raw(FrameType.GOODBYE, b"\x00\x10" + s16(b"") + b"\x00"),
    "ack-extra": raw(FrameType.ACK, struct.pack(">IHQ", 1, 1, 7) + b"\x00"),
    "publish-empty-body": raw(FrameType.PUBLISH, b""),
    "publish-count-0": raw(FrameType.PUBLISH, b"\x00\x00"),
    "publish-count-0-with-data": raw(FrameType.PUBLISH, b"\x00\x00" + msg_bytes(b"t")),
    "publish-count-2-one-message": raw(FrameType.PUBLISH, b"\x00\x02" + msg_bytes(b"t")),
    "publish-header-cut": raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t")[:12]),
    "publish-payload-cut": raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", b"xyz")[:-1]),
    "publish-extra": raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t") + b"\x00"),
    "publish-flag-0x04": raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", flags=0x04)),
    "publish-flag-0x80": raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", flags=0x81)),
    "publish-key-without-flag": raw(
        FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", b"p", flags=0x00, key=b"k")
    ),
    "publish-2nd-message-bad-flags": raw(
        FrameType.PUBLISH, b"\x00\x02" + msg_bytes(b"t") + msg_bytes(b"t", flags=0x10)
    ),
    "subscribe-qos-2": raw(FrameType.SUBSCRIBE, SUB0 + s16(b"a") + s16(b"")),
    "subscribe-qos-255": raw(
        FrameType.SUBSCRIBE, struct.pack(">BIBQ", 255, 0, 0, 0) + s16(b"a") + s16(b"")
    ),
    "subscribe-start-4": raw(
        FrameType.SUBSCRIBE, struct.pack(">BIBQ", 0, 0, 4, 0) + s16(b"a") + s16(b"")
    ),
    "subscribe-old-layout": raw(FrameType.SUBSCRIBE, struct.pack(">BI", 0, 0) + s16(b"a")
                                + s16(b"")),
    "nack-offsets-cut": raw(FrameType.NACK, struct.pack(">IIHQ", 1, 0, 2, 1)),
    "credit-cut": raw(FrameType.CREDIT, struct.pack(">IH", 1, 0)),
    "credit-trailing": raw(FrameType.CREDIT, struct.pack(">III", 1, 2, 3)),
    "deliver-dead-trailer-missing": raw(
        FrameType.DELIVER, DELIVER_ONE + msg_bytes(b"t", b"p", flags=0x04)
    ),
    "deliver-dead-reason-cut": raw(
        FrameType.DELIVER,
        DELIVER_ONE + msg_bytes(b"t", b"p", flags=0x04) + b"\x00\x05\x09ab",
    ),
    "utf8-dead-reason": raw(
        FrameType.DELIVER,
        DELIVER_ONE + msg_bytes(b"t", b"p", flags=0x04) + b"\x00\x05\x01\xff",
    ),
    "subscribe-group-missing": raw(FrameType.SUBSCRIBE, struct.pack(">BIBQ", 0, 0, 0, 0)
                                     + s16(b"a")),
    "deliver-header-cut": raw(FrameType.DELIVER, struct.pack(">IH", 1, 1) + b"\x00" * 31),
    "deliver-payload-cut": raw(
        FrameType.DELIVER,
        DELIVER_ONE + msg_bytes(b"t", b"abc")[:-1],
    ),
    "deliver-extra": raw(
        FrameType.DELIVER, DELIVER_ONE + msg_bytes(b"t") + b"\x00"
    ),
    "utf8-hello": raw(FrameType.HELLO, b"\x00\x01" + s16(b"\xff")),
    "utf8-welcome": raw(FrameType.WELCOME, struct.pack(">HII", 1, 2, 3) + s16(b"\xc3")),
    "utf8-auth": raw(FrameType.AUTH, s16(b"key\x80")),
    "utf8-subscribe-filter": raw(
        FrameType.SUBSCRIBE, b"\x00" * 14 + s16(b"\xed\xa0\x80") + s16(b"")
    ),
    "utf8-subscribe-group": raw(FrameType.SUBSCRIBE, b"\x00" * 14 + s16(b"a") + s16(b"\xfe")),
    "utf8-unsubscribe": raw(FrameType.UNSUBSCRIBE, b"\x00" * 4 + s16(b"\xc0\xaf") + s16(b"")),
    "utf8-goodbye": raw(FrameType.GOODBYE, b"\x00\x10" + s16(b"\xff\xfe")),
    "utf8-error": raw(FrameType.ERROR, b"\x00\x01" + s16(b"bad \xe2\x82")),
    "utf8-deliver-topic": raw(
        FrameType.DELIVER, DELIVER_ONE + msg_bytes(b"\xff")
    ),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frame_is_protocol_error(data: bytes) -> None:
    assert struct.unpack_from(">I", data)[0] == len(data) - 4  # a whole frame, so no waiting
    err = decode_error(data)
    assert err.code == ErrorCode.PROTOCOL


@pytest.mark.parametrize(
    "data",
    [
        raw(FrameType.HELLO, b"\x00\x01" + s16(b"c")),
        raw(FrameType.AUTH_OK, b""),
        raw(FrameType.ACK, struct.pack(">IHQQ", 1, 2, 1, 2)),
        raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", flags=0x03, key=b"k")),
        raw(FrameType.PUBLISH, b"\x00\x02" + msg_bytes(b"t") + msg_bytes(b"u", b"p")),
        raw(FrameType.SUBSCRIBE, struct.pack(">BIBQ", 1, 0, 0, 0) + s16(b"a") + s16(b"")),
        raw(FrameType.DELIVER, DELIVER_ONE + msg_bytes(b"t", b"abc")),
        raw(FrameType.ERROR, b"\x00\x01" + s16("bad €".encode())),
    ],
)
def test_well_formed_twins_of_malformed_frames_decode(data: bytes) -> None:
    """Controls for the table above: the same shapes, made valid, are accepted."""
    assert len(decode_all(data)) == 1


def test_malformed_publish_messages_are_named() -> None:
    with pytest.raises(RemoteProtocolError, match="no messages"):
        decode_one(raw(FrameType.PUBLISH, b"\x00\x00"))
    with pytest.raises(RemoteProtocolError, match="invalid flags 0x04"):
        decode_one(raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", flags=0x04)))
    with pytest.raises(RemoteProtocolError, match="invalid flags 0x00"):
        decode_one(raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"t", key=b"k")))
    with pytest.raises(RemoteProtocolError, match="qos must be 0 or 1"):
        decode_one(raw(FrameType.SUBSCRIBE, SUB0 + s16(b"a") + s16(b"")))
    with pytest.raises(RemoteProtocolError, match="UTF-8"):
        decode_one(raw(FrameType.AUTH, s16(b"\xff")))


def test_publish_topic_bytes_are_not_validated_by_the_codec() -> None:
    """PUBLISH topics stay raw bytes: the broker validates them (and answers INVALID_TOPIC)."""
    frame = decode_one(raw(FrameType.PUBLISH, b"\x00\x01" + msg_bytes(b"\xff/x", b"p")))
    assert isinstance(frame, Publish)
    assert frame.messages[0].topic == b"\xff/x"
    assert frame.messages[0].payload_len == 1


# ------------------------------------------------------------------------ encoding refusals


REFUSED = {
    "record-qos-2": lambda: message_record(Message("t", b"", qos=2)),
    "record-qos-neg": lambda: message_record(Message("t", b"", qos=-1)),
    "record-ttl-2**32": lambda: message_record(Message("t", b"", ttl_ms=2**32)),
    "record-ttl-neg": lambda: message_record(Message("t", b"", ttl_ms=-1)),
    "record-topic-65536": lambda: message_record(Message("t" * 65536, b"")),
    "record-key-65536": lambda: message_record(Message("t", b"", key=b"k" * 65536)),
    "subscribe-qos-2": lambda: encode(Subscribe("a", qos=2)),
    "ping-request-id-2**32": lambda: encode(Ping(b"", request_id=2**32)),
    "auth-request-id-neg": lambda: encode(Auth("", request_id=-1)),
    "publish-request-id-2**32": lambda: encode_publish(
        [message_record(Message("t", b""))], request_id=2**32
    ),
    "deliver-request-id-2**32": lambda: encode_deliver(1, [], request_id=2**32),
    "deliver-sub-id-2**32": lambda: encode_deliver(2**32, []),
    "deliver-count-65536": lambda: encode_deliver(1, [b""] * 65536),
    "encode-publish-0": lambda: encode_publish([]),
    "encode-publish-65536": lambda: encode_publish([message_record(Message("t", b""))] * 65536),
    "publish-frame-0": lambda: encode(Publish(())),
    "publish-frame-65536": lambda: encode(
        Publish((RawMessage(b"t", 0, 0, 0, message_record(Message("t", b""))),) * 65536)
    ),
    "deliver-frame-sub-id": lambda: encode(Deliver(2**32, ())),
    "deliver-frame-offset": lambda: encode(Deliver(1, (Delivery(2**64, 1, "t", b"", 0, 0, None),))),
    "deliver-frame-qos-2": lambda: encode(Deliver(1, (Delivery(1, 1, "t", b"", 2, 0, None),))),
    "ack-offset-2**64": lambda: encode(Ack(1, (2**64,))),
    "ack-65536-offsets": lambda: encode(Ack(1, (0,) * 65536)),
    "welcome-version": lambda: encode(Welcome(65536, 1, 1)),
    "welcome-max-frame": lambda: encode(Welcome(1, 2**32, 1)),
    "hello-version": lambda: encode(Hello(65536)),
    "subscribe-credit": lambda: encode(Subscribe("a", credit=2**32)),
    "subscribe-flags": lambda: encode(Subscribe("a", flags=2)),
    "subscribe-filter-too-long": lambda: encode(Subscribe("é" * 32768)),
    "error-code": lambda: encode(Error(65536, "x")),
    "goodbye-text-too-long": lambda: encode(Goodbye(ErrorCode.NORMAL, "x" * 65536)),
    "pub-ack-count": lambda: encode(PubAck(-1)),
    "unsubscribed-count": lambda: encode(Unsubscribed(2**32)),
}


@pytest.mark.parametrize("make", REFUSED.values(), ids=REFUSED.keys())
def test_encoding_out_of_range_is_local_protocol_error(make) -> None:
    with pytest.raises(LocalProtocolError):
        make()


def test_encoding_limits_themselves_are_accepted() -> None:
    big = Message("t" * 65535, b"", qos=1, ttl_ms=2**32 - 1, key=b"k" * 65535)
    frame = decode_one(encode_publish([message_record(big)]))
    assert isinstance(frame, Publish)
    assert frame.decoded() == [big]
    assert typed(decode_one(encode(Ping(b"", request_id=2**32 - 1)))) == typed(Ping(b"", 2**32 - 1))
    rec = message_record(Message("t", b"", key=b"k"))
    data = encode_publish([rec] * MAX_BATCH, request_id=2**32 - 1)
    frame = decode_one(data, max_frame=len(data))
    assert isinstance(frame, Publish)
    assert len(frame.messages) == MAX_BATCH
    assert frame.request_id == 2**32 - 1
    assert encode(Subscribe("é" * 32767, qos=1, credit=2**32 - 1))


def test_encode_rejects_non_frames() -> None:
    with pytest.raises(LocalProtocolError):
        encode(object())  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- hypothesis

u32 = st.integers(0, 2**32 - 1)
u16 = st.integers(0, 2**16 - 1)
topics = st.text(max_size=40)
messages_st = st.builds(
    Message,
    topic=topics,
    payload=st.binary(max_size=200),
    qos=st.sampled_from([0, 1]),
    ttl_ms=u32,
    key=st.none() | st.binary(max_size=30),
)
deliveries_st = st.builds(
    Delivery,
    offset=st.integers(0, 2**64 - 1),
    delivery_count=u16,
    topic=topics,
    payload=st.binary(max_size=200),
    qos=st.sampled_from([0, 1]),
    ttl_ms=u32,
    key=st.none() | st.binary(max_size=30),
    dead=st.none() | st.builds(DeadLetter, st.integers(0, 2**16 - 1), st.text(max_size=20)),
    timestamp_ms=st.integers(0, 2**64 - 1),
    retained=st.booleans(),
    retain=st.booleans(),
).map(lambda d: d._replace(retain=d.retain or d.retained))  # a retained value is one
deliver_st = st.builds(
    Deliver,
    sub_id=u32,
    messages=st.lists(deliveries_st, max_size=8).map(tuple),
    request_id=u32,
)
text_st = st.text(max_size=30)
frames_st = st.one_of(
    st.builds(Hello, u16, text_st, u32),
    st.builds(Welcome, u16, u32, u32, text_st, u32),
    st.builds(Auth, text_st, u32),
    st.builds(AuthOk, u32),
    st.builds(PubAck, u32, u32),
    st.builds(Subscribe, text_st, text_st, st.sampled_from([0, 1]), u32,
              st.sampled_from(list(Start)), st.integers(0, 2**64 - 1), u32,
              st.sampled_from([0, SUBSCRIBE_UNTIL_END])),
    st.builds(Subscribed, u32, u32, st.none() | st.integers(0, 2**64 - 1)),
    st.builds(Unsubscribe, u32, text_st, text_st, u32),
    st.builds(Unsubscribed, u32, u32),
    deliver_st,
    st.builds(Ack, u32, st.lists(st.integers(0, 2**64 - 1), max_size=20).map(tuple), u32),
    st.builds(Nack, u32, st.lists(st.integers(0, 2**64 - 1), max_size=20).map(tuple), u32, u32),
    st.builds(Credit, u32, u32, u32),
    st.builds(Ping, st.binary(max_size=50), u32),
    st.builds(Pong, st.binary(max_size=50), u32),
    st.builds(Stats, u32),
    st.builds(StatsReport, st.binary(max_size=50), u32),
    st.builds(Goodbye, u16, text_st, u32),
    st.builds(Error, u16, text_st, u32),
)


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(messages_st, min_size=1, max_size=20), request_id=u32)
def test_hypothesis_publish_round_trip(batch: list[Message], request_id: int) -> None:
    data, expected = publish_frame(batch, request_id)
    dec = Decoder()
    dec.feed(data)
    (frame,) = dec.frames()
    assert dec.buffered == 0
    assert frame == expected
    assert isinstance(frame, Publish)
    assert frame.decoded() == batch


@settings(max_examples=300, deadline=None)
@given(frame=deliver_st)
def test_hypothesis_deliver_round_trip(frame: Deliver) -> None:
    assert typed(decode_one(encode(frame))) == typed(frame)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(frames_st, max_size=15), data=st.data())
def test_hypothesis_any_frames_in_any_chunks(frames: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(encode(f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    dec = Decoder()
    got: list[Frame] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        dec.feed(stream[prev:cut])
        prev = cut
        got.extend(dec.frames())
    assert [typed(f) for f in got] == [typed(f) for f in frames]
    assert dec.buffered == 0


@settings(max_examples=500, deadline=None)
@given(
    blob=st.binary(max_size=600),
    chunk_sizes=st.lists(st.integers(1, 64), min_size=1, max_size=30),
    max_frame=st.sampled_from([5, 64, 4096, DEFAULT_MAX_FRAME]),
)
def test_hypothesis_random_bytes_only_raise_remote_protocol_error(
    blob: bytes, chunk_sizes: list[int], max_frame: int
) -> None:
    dec = Decoder(max_frame)
    pos = 0
    i = 0
    try:
        while pos < len(blob):
            n = chunk_sizes[i % len(chunk_sizes)]
            i += 1
            dec.feed(blob[pos : pos + n])
            pos += n
            for frame in dec.frames():
                if isinstance(frame, Publish):
                    frame.decoded()
    except RemoteProtocolError as exc:
        assert exc.code in (ErrorCode.PROTOCOL, ErrorCode.FRAME_TOO_LARGE)


@settings(max_examples=300, deadline=None)
@given(
    frame=frames_st,
    max_frame=st.sampled_from([64, 4096]),
    data=st.data(),
)
def test_hypothesis_mutated_frames_only_raise_remote_protocol_error(
    frame: Frame, max_frame: int, data: st.DataObject
) -> None:
    """Valid frames with a byte flipped: closer to real corruption than uniform noise."""
    encoded = bytearray(encode(frame))
    idx = data.draw(st.integers(0, len(encoded) - 1))
    encoded[idx] ^= data.draw(st.integers(1, 255))
    dec = Decoder(max_frame)
    dec.feed(bytes(encoded))
    try:
        dec.frames()
        dec.frames()
    except RemoteProtocolError:
        pass


def test_a_frame_fed_a_byte_at_a_time_costs_about_its_size_in_memory() -> None:
    """A peer that trickles a large frame a byte per read must not make the decoder keep an
    object per byte (server rule: memory stays bounded whatever a client does)."""
    import tracemalloc

    frame = encode(Ping(b"p" * 400_000, 1))
    dec = Decoder()
    tracemalloc.start()
    try:
        for i in range(len(frame) - 1):
            dec.feed(frame[i : i + 1])
            if i % 50_000 == 0:
                assert dec.frames() == []  # incomplete: nothing to give yet
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.buffered == len(frame) - 1
    assert held < 2 * len(frame)
    dec.feed(frame[-1:])
    assert dec.frames() == [Ping(b"p" * 400_000, 1)]
    assert dec.buffered == 0


# ----------------------------------------------------------- STATS_REPORT within a frame


def _group(i: int, width: int = 20) -> dict:
    return {"filter": f"f/{i}/" + "x" * width, "group": f"g{i}", "durable": True,
            "backlog": i, "in_flight": 0, "consumers": 0, "skipped": 0}


def _report(topics: int, groups: int, width: int = 20) -> dict:
    return {"broker": "blipmq", "version": "0.1.0", "uptime_s": 1.5,
            "topics": [{"topic": f"t/{i}", "messages": i, "bytes": i, "retained": False}
                       for i in range(topics)],
            "topics_omitted": 7, "topics_untracked": {"messages": 0, "bytes": 0},
            "groups": [_group(i, width) for i in range(groups)], "groups_omitted": 0,
            "bridges": [], "bridges_omitted": 0, "log": None}


def test_stats_report_that_fits_is_the_report() -> None:
    whole = _report(3, 4)
    assert json.loads(stats_report.fit(whole, 1 << 20)) == whole


def test_stats_report_always_fits_listing_fewer_entries_of_every_list() -> None:
    # h29: a report listing 3,000 groups was sent whole, larger than the client's frame
    # limit, and `blipmq stats` / `groups` failed ("frame of 325470 bytes exceeds ...")
    whole = _report(500, 3000, width=100)
    for limit in (1_000, 20_000, 131_367, 262_150):
        data = stats_report.fit(whole, limit)
        assert len(data) <= limit
        got = json.loads(data)
        for name in ("topics", "groups"):
            kept = got[name]
            assert kept == whole[name][: len(kept)]  # the first ones, in the report's order
            assert got[f"{name}_omitted"] == (whole[f"{name}_omitted"] + len(whole[name])
                                              - len(kept))
        # the lists share the room: many long groups do not crowd the topics out
        assert limit < 20_000 or (got["topics"] and got["groups"])
        assert {k: v for k, v in got.items() if k not in
                ("topics", "groups", "topics_omitted", "groups_omitted")} == {
            k: v for k, v in whole.items() if k not in
            ("topics", "groups", "topics_omitted", "groups_omitted")}


def test_stats_report_entry_larger_than_the_room_ends_its_list_only() -> None:
    whole = _report(2, 0)
    whole["groups"] = [_group(0, 5000), _group(1)]
    got = json.loads(stats_report.fit(whole, 2000))
    assert got["groups"] == [] and got["groups_omitted"] == 2  # a prefix: not g1 alone
    assert len(got["topics"]) == 2 and got["topics_omitted"] == 7
    assert stats_report.most(2000) * stats_report.ENTRY_MIN <= 2000


@settings(max_examples=100, deadline=None)
@given(topics=st.integers(0, 60), groups=st.integers(0, 60), width=st.integers(0, 300),
       limit=st.integers(600, 20_000))
def test_hypothesis_stats_report_fits(topics: int, groups: int, width: int, limit: int
                                      ) -> None:
    whole = _report(topics, groups, width)
    data = stats_report.fit(whole, limit)
    assert len(data) <= limit
    got = json.loads(data)
    assert got["groups"] == whole["groups"][: len(got["groups"])]
    assert len(got["groups"]) + got["groups_omitted"] == groups


def test_stats_report_without_room_for_its_fields_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        stats_report.fit(_report(0, 0), 50)
