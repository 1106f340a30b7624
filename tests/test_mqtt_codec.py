"""The sans-IO MQTT codec: round trips, incremental decoding, refused input, paho as oracle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.mqtt.codec import (
    MAX_REMAINING,
    REASONS,
    SUBACK_FAILURE,
    ConnAck,
    ConnackCode,
    Connect,
    Decoder,
    Disconnect,
    MqttError,
    OversizePublish,
    Packet,
    PacketType,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    Will,
    encode,
    encode_publish,
    publish_head,
    remaining_length,
)

# ----------------------------------------------------------------------------- helpers


def typed(packet: object) -> tuple[type, object]:
    """Publish is a NamedTuple, equal to any tuple with the same fields: compare types too."""
    return type(packet), packet


def decode(data: bytes, *, step: int = 0, max_packet: int = MAX_REMAINING) -> list[Packet]:
    """Every packet in ``data``, fed whole (``step`` 0) or ``step`` bytes at a time; the
    decoder must end with nothing buffered."""
    decoder = Decoder(max_packet)
    out: list[Packet] = []
    if not step:
        decoder.feed(data)
        out += decoder.packets()
    else:
        for i in range(0, len(data), step):
            decoder.feed(data[i : i + step])
            out += decoder.packets()
    assert decoder.buffered == 0
    return out


def refused(data: bytes, reason: str, max_packet: int = MAX_REMAINING) -> MqttError:
    """Feed ``data`` whole: no packet comes out, and an MqttError with ``reason`` does."""
    decoder = Decoder(max_packet)
    decoder.feed(data)
    with pytest.raises(MqttError) as info:
        decoder.packets()
    assert info.value.reason == reason, info.value
    assert isinstance(info.value, RemoteProtocolError)
    return info.value


def packet(first: int, body: bytes) -> bytes:
    """A packet built by hand: the first byte, the remaining length, the body."""
    return bytes((first,)) + remaining_length(len(body)) + body


def s16(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


def connect_body(flags: int, payload: bytes, name: bytes = b"MQTT", level: int = 4) -> bytes:
    return s16(name) + bytes((level, flags)) + b"\x00\x3c" + payload


SAMPLES: list[Packet] = [
    Connect("MQTT", 4),
    Connect("MQTT", 4, False, 60, "dev-1", Will("dev/1/status", b"gone", 2, True), "alice",
            b"\x00\xffpw"),
    Connect("MQIsdp", 3, True, 65535, "legacy", None, "bob", None),
    Connect("MQTT", 0x84, False, 60, "blipmq-bridge-cloud", None, None, None),
    Connect("MQIsdp", 0x83, True, 30, "old-bridge", None, None, None),
    Connect("MQTT", 5),
    Connect("MQIsdp", 4),
    ConnAck(False, ConnackCode.ACCEPTED),
    ConnAck(True, 0),
    ConnAck(False, ConnackCode.NOT_AUTHORIZED),
    Publish("a/b", b"hello"),
    Publish("/a//b/", b"", 0, True),
    Publish("caf\u00e9/\U0001f600", b"\x00" * 64, 1, False, True, 1),
    Publish("t", b"x" * 200, 2, True, False, 65535),
    Publish("big", b"y" * 20_000, 1, False, False, 9),
    PubAck(1),
    PubRec(2),
    PubRel(3),
    PubComp(65535),
    Subscribe(7, (("a/+/c", 0), ("#", 1), ("x", 2))),
    SubAck(7, (0, 1, 2, SUBACK_FAILURE)),
    Unsubscribe(8, ("a/+/c", "#")),
    UnsubAck(8),
    PingReq(),
    PingResp(),
    Disconnect(),
]
IDS = [f"{i}-{type(p).__name__}" for i, p in enumerate(SAMPLES)]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_round_trip_whole_and_byte_at_a_time(sample: Packet) -> None:
    data = encode(sample)
    for step in (0, 1, 7):
        assert list(map(typed, decode(data, step=step))) == [typed(sample)]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_another_packet_or_a_part_of_one_behind(sample: Packet) -> None:
    data = encode(sample)
    decoder = Decoder()
    decoder.feed(data + encode(PingReq()) + b"\x30\x0a\x00")  # and the start of a PUBLISH
    assert list(map(typed, decoder.packets())) == [typed(sample), typed(PingReq())]
    assert decoder.buffered == 3
    decoder.feed(b"\x01t" + b"p" * 7)
    assert decoder.packets() == [Publish("t", b"p" * 7)]
    assert decoder.buffered == 0


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_trailing_garbage_comes_after_the_good_packet(sample: Packet) -> None:
    decoder = Decoder()
    decoder.feed(encode(sample) + b"\xf0garbage")  # type 15
    assert decoder.packets() == [sample]
    with pytest.raises(MqttError) as info:
        decoder.packets()
    assert info.value.reason == "packet_type"


def test_every_packet_type_is_sampled() -> None:
    names = {type(p).__name__.upper() for p in SAMPLES}
    assert {t.name.replace("_", "") for t in PacketType} == names


def test_a_stream_of_everything_in_any_split() -> None:
    data = b"".join(map(encode, SAMPLES)) * 3
    expected = list(map(typed, SAMPLES * 3))
    for step in (1, 2, 3, 5, 64, 1000, len(data)):
        assert list(map(typed, decode(data, step=step))) == expected


def test_many_publishes_in_one_chunk_and_a_partial_one_kept() -> None:
    pub = Publish("site/7/sensor/0042/t", bytes(range(64)), 1, False, False, 4242)
    wire = encode(pub)
    decoder = Decoder()
    decoder.feed(wire * 1000 + wire[:50])
    assert decoder.packets() == [pub] * 1000
    assert decoder.buffered == 50
    assert decoder.packets() == []
    decoder.feed(wire[50:] + wire)
    assert decoder.packets() == [pub, pub]
    assert decoder.buffered == 0


def test_feed_takes_bytearray_and_memoryview() -> None:
    wire = encode(Publish("a", b"b", 1, packet_id=5))
    decoder = Decoder()
    decoder.feed(bytearray(wire[:3]))
    decoder.feed(memoryview(wire)[3:])
    decoder.feed(bytearray(wire))
    assert decoder.packets() == [Publish("a", b"b", 1, packet_id=5)] * 2
    decoder.feed(b"")
    assert decoder.packets() == [] and decoder.buffered == 0


def test_payloads_are_bytes_and_ids_plain() -> None:
    decoder = Decoder()
    decoder.feed(bytearray(encode(Publish("a", b"xyz", 2, True, True, 9))))
    (pub,) = decoder.packets()
    assert type(pub) is Publish and type(pub.payload) is bytes
    assert (pub.retain, pub.dup) == (True, True)


# ----------------------------------------------------------------------------- exact bytes


@pytest.mark.parametrize(
    ("n", "wire"),
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (16_383, b"\xff\x7f"),
        (16_384, b"\x80\x80\x01"),
        (2_097_151, b"\xff\xff\x7f"),
        (2_097_152, b"\x80\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_remaining_length_table_of_the_spec(n: int, wire: bytes) -> None:
    assert remaining_length(n) == wire
    body = b"\x00\x01t" + b"\x00" * (n - 3) if 3 <= n <= 20_000 else None
    if body is not None:
        assert decode(b"\x30" + wire + body) == [Publish("t", body[3:])]


@pytest.mark.parametrize("n", [-1, MAX_REMAINING + 1])
def test_remaining_length_out_of_range(n: int) -> None:
    with pytest.raises(LocalProtocolError):
        remaining_length(n)


def test_exact_layouts() -> None:
    assert encode(Publish("a/b", b"hi", 1, True, True, 10)) == (
        b"\x3b\x09\x00\x03a/b\x00\x0ahi")
    assert encode(Publish("a/b", b"hi")) == b"\x30\x07\x00\x03a/bhi"
    assert encode_publish(b"a/b", b"hi", 2, False, False, 258) == b"\x34\x09\x00\x03a/b\x01\x02hi"
    assert encode(ConnAck(True, 0)) == b"\x20\x02\x01\x00"
    assert encode(PubRel(1)) == b"\x62\x02\x00\x01"
    assert encode(Subscribe(1, (("a", 1),))) == b"\x82\x06\x00\x01\x00\x01a\x01"
    assert encode(SubAck(1, (1, 0x80))) == b"\x90\x04\x00\x01\x01\x80"
    assert encode(Unsubscribe(2, ("a",))) == b"\xa2\x05\x00\x02\x00\x01a"
    assert encode(UnsubAck(2)) == b"\xb0\x02\x00\x02"
    assert (encode(PingReq()), encode(PingResp()), encode(Disconnect())) == (
        b"\xc0\x00", b"\xd0\x00", b"\xe0\x00")
    assert encode(Connect("MQTT", 4, True, 60, "c")) == (
        b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01c")
    assert encode(Connect("MQTT", 4, False, 10, "c", Will("w", b"!", 1, True), "u", b"p")) == (
        b"\x10\x19\x00\x04MQTT\x04\xec\x00\x0a\x00\x01c\x00\x01w\x00\x01!\x00\x01u\x00\x01p")


def test_encode_publish_long_forms_match_encode() -> None:
    for size in (0, 100, 123, 124, 125, 200, 16_400):
        for qos, pid in ((0, 0), (1, 3), (2, 4)):
            pub = Publish("t/x", b"p" * size, qos, True, qos > 0, pid)
            wire = encode_publish(b"t/x", pub.payload, qos, True, qos > 0, pid)
            assert wire == encode(pub)
            assert decode(wire) == [pub]


def test_publish_head_is_encode_publish_before_the_packet_id() -> None:
    """A bridge, and a delivery to an MQTT subscriber, send a known record's PUBLISH as its
    kept head + packet id + payload (QoS 0: head + payload)."""
    for size in (0, 100, 123, 124, 125, 126, 200, 16_400, 2_097_200):
        for qos in (0, 1, 2):
            for retain in (False, True):
                payload = b"p" * size
                wire = encode_publish(b"t/x", payload, qos, retain, False, 0x0102 if qos else 0)
                pid = b"\x01\x02" if qos else b""
                assert publish_head(b"t/x", size, qos, retain) + pid + payload == wire
    for args in ((b"", 1, 1, False), (b"t", 1, -1, False), (b"t", 1, 3, False),
                 (b"t" * 65_536, 1, 1, False)):
        with pytest.raises(LocalProtocolError):
            publish_head(*args)


# ----------------------------------------------------------------------------- refused input


def test_http_request_is_refused_at_the_first_byte() -> None:
    request = b"GET / HTTP/1.1\r\nHost: broker\r\nUpgrade: websocket\r\n\r\n"
    assert refused(request, "reserved_flags")  # 'G' is 0x47: PUBACK with flags 0b0111
    decoder = Decoder()
    decoder.feed(request[:1])
    with pytest.raises(MqttError):
        decoder.packets()
    for other in (b"PO", b"POST /x HTTP/1.1\r\n\r\n", b"PUT / HTTP/1.0\r\n\r\n",
                  b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"SSH-2.0-OpenSSH_9.6\r\n"):
        decoder = Decoder()
        decoder.feed(other)
        with pytest.raises(MqttError):
            decoder.packets()


@pytest.mark.parametrize("first", [0x00, 0x0F, 0xF0, 0xFF])
def test_reserved_packet_types(first: int) -> None:
    refused(bytes((first, 0)), "packet_type")


@pytest.mark.parametrize(
    "first",
    [0x11, 0x18, 0x21, 0x41, 0x48, 0x51, 0x60, 0x63, 0x71, 0x80, 0x83, 0x8A, 0x91, 0xA0, 0xA3,
     0xB1, 0xC1, 0xD2, 0xE4, 0xEF],
)
def test_reserved_fixed_header_flags(first: int) -> None:
    refused(bytes((first, 2, 0, 1)), "reserved_flags")


@pytest.mark.parametrize("first", [0x36, 0x37, 0x3E, 0x3F, 0x38, 0x39])
def test_publish_qos_3_or_dup_at_qos_0(first: int) -> None:
    refused(bytes((first, 5, 0, 1)) + b"t\x00\x01", "malformed")


def test_too_large_is_refused_from_the_fixed_header_alone() -> None:
    # 16 MiB announced, a 1 MiB limit: refused with five bytes in, the body never awaited
    decoder = Decoder(max_packet=1 << 20)
    decoder.feed(b"\x30\xff\xff")
    assert decoder.packets() == []
    decoder.feed(b"\xff\x07")
    with pytest.raises(MqttError) as info:
        decoder.packets()
    assert info.value.reason == "too_large"
    assert decoder.buffered == 0
    # the protocol's largest length, with the default limit: over it with the header counted
    refused(b"\x30\xff\xff\xff\x7f", "too_large")
    # max_packet counts the whole packet: 2 + 10 bytes fit 12, not 11
    wire = encode(Publish("t", b"x" * 7))
    assert decode(wire, max_packet=12) == [Publish("t", b"x" * 7)]
    refused(wire, "too_large", max_packet=11)


def test_refused_before_the_body_when_the_header_says_enough() -> None:
    refused(b"\x30\xff", "too_large", max_packet=100)  # a length of at least 127 to come
    refused(b"\x40\x10", "malformed")  # a PUBACK is 2 bytes long, not 16
    refused(b"\xe0\x01", "malformed")  # a DISCONNECT is empty
    refused(b"\x20\x80\x01", "malformed")  # a CONNACK is 2 bytes long, not 128
    decoder = Decoder(max_packet=100)
    decoder.feed(b"\x30\x80")  # non-minimal, but could still be 0 long
    assert decoder.packets() == []


def test_two_gib_needs_a_fifth_length_byte() -> None:
    refused(b"\x30\x80\x80\x80\x80\x08", "remaining_length")  # 2**31
    refused(b"\x30\xff\xff\xff\xff", "remaining_length")  # refused before the fifth byte
    decoder = Decoder()
    decoder.feed(b"\x30\xff\xff\xff")
    assert decoder.packets() == []


def test_memory_stays_bounded_while_a_large_packet_arrives() -> None:
    big = encode(Publish("t", b"z" * 50_000, 1, packet_id=1))
    decoder = Decoder(max_packet=60_000)
    out: list[Packet] = []
    for i in range(0, len(big), 1000):
        decoder.feed(big[i : i + 1000])
        out += decoder.packets()
        assert decoder.buffered <= len(big)
    assert out == [Publish("t", b"z" * 50_000, 1, packet_id=1)]
    refused(big, "too_large", max_packet=50_000)


# ------------------------------------------------------- skip_oversize (a bridge's link)

BEHIND = [encode(Publish("s/1", b"small", 1, packet_id=8)), encode(PubRel(9)),
          encode(Publish("s/2", b"", 0))]  # what follows the oversize PUBLISH
DECODED_BEHIND = [Publish("s/1", b"small", 1, packet_id=8), PubRel(9), Publish("s/2", b"")]


def skipped(data: bytes, max_packet: int, splits: list[int]) -> list[object]:
    """``data`` fed in pieces cut at ``splits`` to a decoder with ``skip_oversize``, packets
    taken after each; it ends with nothing buffered, nothing left to skip."""
    decoder = Decoder(max_packet, skip_oversize=True)
    out: list[object] = []
    for a, b in zip([0, *splits], [*splits, len(data)], strict=True):
        decoder.feed(data[a:b])
        out += decoder.packets()
        assert decoder.buffered <= max(max_packet, 65_544)
    assert decoder.buffered == 0 and decoder.skipping == 0
    return out


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_skip_oversize_passes_a_publish_over_whole_or_a_byte_at_a_time(qos: int) -> None:
    big = encode(Publish("up/big", b"B" * 1000, qos, True, qos > 0, 77 if qos else 0))
    wire = big + b"".join(BEHIND)
    want = [OversizePublish("up/big", qos, 77 if qos else 0, len(big)), *DECODED_BEHIND]
    assert skipped(wire, 100, []) == want
    assert skipped(wire, 100, list(range(1, len(wire)))) == want
    assert skipped(wire, 100, list(range(1, len(wire), 333))) == want
    # the limit counts the whole packet: one byte under it is decoded as ever
    assert skipped(big, len(big), []) == [Publish("up/big", b"B" * 1000, qos, True, qos > 0,
                                                  77 if qos else 0)]
    assert skipped(big, len(big) - 1, []) == want[:1]
    # without skip_oversize (the MQTT listener) it is refused as ever
    refused(wire, "too_large", max_packet=100)


def test_skip_oversize_split_at_every_place_in_the_header() -> None:
    topic = "t" * 300  # a topic longer than the limit, which is read all the same
    big = encode(Publish(topic, b"P" * 70_000, 2, packet_id=0x1234))
    head = 1 + 3 + 2 + len(topic) + 2  # first byte, length, topic, packet id
    wire = big + b"".join(BEHIND)
    want = [OversizePublish(topic, 2, 0x1234, len(big)), *DECODED_BEHIND]
    for at in range(1, head + 2):
        assert skipped(wire, 200, [at]) == want, at
        assert skipped(wire, 200, [at, at + 1, len(big) - 1, len(big)]) == want, at
    # the event waits for the packet's last byte; then the rest is decoded as it comes
    decoder = Decoder(200, skip_oversize=True)
    decoder.feed(wire[:head])
    assert decoder.packets() == []
    assert decoder.skipping == len(big) - head and decoder.buffered == 0
    decoder.feed(wire[head : len(big) - 1])
    assert decoder.packets() == [] and decoder.skipping == 1
    decoder.feed(wire[len(big) - 1 : len(big) + 3])
    assert decoder.packets() == want[:1] and decoder.buffered == 3
    decoder.feed(wire[len(big) + 3 :])
    assert decoder.packets() == DECODED_BEHIND


def test_skip_oversize_keeps_no_payload() -> None:
    # 16 MiB in 64 KiB reads: nothing of the payload is held, and it comes out once
    chunk = b"\0" * 65536
    decoder = Decoder(1 << 16, skip_oversize=True)
    head = b"\x32" + remaining_length(2 + 3 + 2 + (16 << 20)) + b"\x00\x03a/b\x00\x05"
    decoder.feed(head)
    assert decoder.packets() == []
    for _ in range(256):
        assert decoder.skipping
        decoder.feed(chunk)
        assert decoder.buffered == 0
        assert decoder.packets() == ([] if decoder.skipping else [
            OversizePublish("a/b", 1, 5, len(head) + (16 << 20))])
    assert decoder.skipping == 0
    decoder.feed(encode(PingResp()))
    assert decoder.packets() == [PingResp()]


@pytest.mark.parametrize(("wire", "reason"), [
    (b"\x82\xff\x7f" + b"\0" * 200, "too_large"),  # a SUBSCRIBE over the limit
    (b"\x90\xff\x7f", "too_large"),  # a SUBACK, refused from its header
    (b"\x30\xff\xff\xff\xff", "remaining_length"),  # a fifth length byte
    (b"\x36\xff\x7f", "malformed"),  # QoS 3
    (b"\x32\xff\x7f\x00\x01t\x00\x00", "malformed"),  # packet id 0
    (b"\x32\xff\x7f\x00\x01#\x00\x01", "malformed"),  # a wildcard topic
    (b"\x30\xff\x7f\x00\x02\xc3\x28", "bad_utf8"),
    (b"\x30\xff\x01\xff\xff", "malformed"),  # a topic longer than the packet
    (b"\x32\xc8\x01\x00\xc6" + b"t" * 198, "malformed"),  # ... or than its packet id
])
def test_skip_oversize_still_refuses(wire: bytes, reason: str) -> None:
    decoder = Decoder(100, skip_oversize=True)
    decoder.feed(wire)
    with pytest.raises(MqttError) as info:
        decoder.packets()
    assert info.value.reason == reason, info.value


def test_good_packets_first_then_the_error_for_good() -> None:
    decoder = Decoder()
    decoder.feed(encode(PingReq()) + encode(PubAck(3)) + b"\x40\x03\x00\x01\x00")
    assert decoder.packets() == [PingReq(), PubAck(3)]
    for _ in range(2):
        with pytest.raises(MqttError) as info:
            decoder.packets()
        assert info.value.reason == "malformed"
    decoder.feed(encode(PingReq()))  # a refused stream keeps nothing more
    assert decoder.buffered == 0
    with pytest.raises(MqttError):
        decoder.packets()


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        # fixed-length packets of another length
        (b"\x40\x03\x00\x01\x00", "malformed"),
        (b"\x40\x01\x00", "malformed"),
        (b"\x62\x00", "malformed"),
        (b"\xb0\x04\x00\x01\x00\x00", "malformed"),
        (b"\xc0\x01\x00", "malformed"),
        (b"\xd0\x01\x00", "malformed"),
        (b"\xe0\x02\x00\x00", "malformed"),
        (b"\x20\x03\x00\x00\x00", "malformed"),
        (b"\x20\x01\x00", "malformed"),
        # packet id 0
        (b"\x40\x02\x00\x00", "malformed"),
        (b"\x70\x02\x00\x00", "malformed"),
        (b"\x34\x07\x00\x01t\x00\x00hi", "malformed"),
        (b"\x82\x06\x00\x00\x00\x01a\x00", "malformed"),
        (b"\xa2\x05\x00\x00\x00\x01a", "malformed"),
        # CONNACK reserved ack flags; a refusal with a session
        (b"\x20\x02\x02\x00", "reserved_flags"),
        (b"\x20\x02\x01\x05", "malformed"),
        # PUBLISH: empty topic, topic past the end, no room for the id, wildcards, no topic
        (b"\x30\x02\x00\x00", "malformed"),
        (b"\x30\x03\x00\x05a", "malformed"),
        (b"\x32\x03\x00\x01a", "malformed"),
        (b"\x32\x04\x00\x01a\x00", "malformed"),
        (b"\x30\x05\x00\x03a/+", "malformed"),
        (b"\x30\x05\x00\x03a/#", "malformed"),
        (b"\x30\x06\x00\x04a#bc", "malformed"),
        (b"\x30\x01\x00", "malformed"),
        (b"\x30\x00", "malformed"),
        # PUBLISH topics that are not UTF-8 or hold U+0000
        (b"\x30\x04\x00\x02\xc3\x28", "bad_utf8"),
        (b"\x30\x05\x00\x03\xed\xa0\x80", "bad_utf8"),  # a UTF-16 surrogate
        (b"\x30\x04\x00\x02\xc0\x80", "bad_utf8"),  # an overlong U+0000
        (b"\x30\x05\x00\x03a\x00b", "bad_utf8"),
        # SUBSCRIBE: no filter, empty filter, qos 3, reserved qos bits, filter past the end
        (b"\x82\x02\x00\x01", "malformed"),
        (b"\x82\x05\x00\x01\x00\x00\x00", "malformed"),
        (b"\x82\x06\x00\x01\x00\x01a\x03", "malformed"),
        (b"\x82\x06\x00\x01\x00\x01a\x41", "malformed"),
        (b"\x82\x06\x00\x01\x00\x01a\x80", "malformed"),
        (b"\x82\x05\x00\x01\x00\x01a", "malformed"),
        (b"\x82\x05\x00\x01\x00\x02a", "malformed"),
        (b"\x82\x06\x00\x01\x00\x01\xff\x00", "bad_utf8"),
        # SUBACK: no code, a code out of the four
        (b"\x90\x02\x00\x01", "malformed"),
        (b"\x90\x03\x00\x01\x03", "malformed"),
        (b"\x90\x04\x00\x01\x00\x81", "malformed"),
        # UNSUBSCRIBE: no filter, an empty filter, a filter cut short, bad UTF-8
        (b"\xa2\x02\x00\x01", "malformed"),
        (b"\xa2\x04\x00\x01\x00\x00", "malformed"),
        (b"\xa2\x05\x00\x01\x00\x05a", "malformed"),
        (b"\xa2\x05\x00\x01\x00\x01\x80", "bad_utf8"),
    ],
)
def test_refused_bodies(wire: bytes, reason: str) -> None:
    refused(wire, reason)


def test_connect_protocol_name() -> None:
    refused(packet(0x10, connect_body(0x02, s16(b"c"), b"MQTX")), "protocol_name")
    refused(packet(0x10, connect_body(0x02, s16(b"c"), b"mqtt")), "protocol_name")
    refused(packet(0x10, connect_body(0x02, s16(b"c"), b"\xff\xfe")), "protocol_name")
    refused(packet(0x10, b"\x00\x04MQ"), "malformed")  # the name cut short
    refused(packet(0x10, b"\x00\x04MQTT"), "malformed")  # no level


@pytest.mark.parametrize(("name", "level"), [("MQTT", 5), ("MQTT", 3), ("MQIsdp", 4),
                                             ("MQTT", 0), ("MQTT", 255), ("MQTT", 0x85),
                                             ("MQTT", 0x83), ("MQIsdp", 0x84)])
def test_connect_of_another_level_is_returned_unread(name: str, level: int) -> None:
    # an MQTT 5 CONNECT: properties after the keepalive, which this codec does not read
    body = s16(name.encode()) + bytes((level, 0xC2)) + b"\x00\x3c\x05\x11\x00\x00\x0e\x10\xff"
    assert decode(packet(0x10, body)) == [Connect(name, level)]


def test_mqisdp_level_3_is_accepted() -> None:
    body = connect_body(0xC2, s16(b"old-client") + s16(b"user") + s16(b"pass"), b"MQIsdp", 3)
    assert decode(packet(0x10, body)) == [
        Connect("MQIsdp", 3, True, 60, "old-client", None, "user", b"pass")]


@pytest.mark.parametrize(
    ("flags", "payload", "reason"),
    [
        (0x03, s16(b"c"), "reserved_flags"),
        (0x00 | 0x40, s16(b"c") + s16(b"pw"), "malformed"),  # password without username
        (0x04 | 0x18, s16(b"c") + s16(b"w") + s16(b"m"), "malformed"),  # will QoS 3
        (0x08, s16(b"c"), "malformed"),  # will QoS without a will
        (0x20, s16(b"c"), "malformed"),  # will retain without a will
        (0x02, s16(b"c") + b"\x00", "malformed"),  # a byte after the payload
        (0x80, s16(b"c"), "malformed"),  # username flag, no username
        (0xC0, s16(b"c") + s16(b"u"), "malformed"),  # password flag, no password
        (0x04, s16(b"c") + s16(b"w"), "malformed"),  # will flag, no will payload
        (0x04, s16(b"c") + s16(b"w/+") + s16(b"m"), "malformed"),  # a wildcard will topic
        (0x04, s16(b"c") + s16(b"") + s16(b"m"), "malformed"),  # an empty will topic
        (0x02, s16(b"\xc3"), "bad_utf8"),
        (0x02, s16(b"a\x00b"), "bad_utf8"),
        (0x82, s16(b"c") + s16(b"\xff"), "bad_utf8"),
        (0x02, b"\x00", "malformed"),  # the client id length cut short
    ],
)
def test_connect_refused(flags: int, payload: bytes, reason: str) -> None:
    refused(packet(0x10, connect_body(flags, payload)), reason)
    refused(packet(0x10, connect_body(flags, payload, b"MQIsdp", 3)), reason)


def test_connect_without_keepalive_is_malformed() -> None:
    refused(packet(0x10, s16(b"MQTT") + b"\x04\x02\x00"), "malformed")


def test_connect_fields() -> None:
    client_id = "\u00e9" * 30_000  # a client id of 60,000 bytes: any length is fine
    body = connect_body(0x02, s16(client_id.encode()))
    assert decode(packet(0x10, body)) == [Connect("MQTT", 4, True, 60, client_id)]
    body = connect_body(0x80, s16(b"") + s16(b""))  # an empty client id and username
    assert decode(packet(0x10, body)) == [Connect("MQTT", 4, False, 60, "", None, "")]


def test_every_reason_is_tested_and_listed() -> None:
    assert set(REASONS) == {"malformed", "reserved_flags", "remaining_length", "too_large",
                            "protocol_name", "bad_utf8", "packet_type"}
    assert issubclass(MqttError, RemoteProtocolError)


def test_a_cached_topic_is_still_checked_once() -> None:
    wire = encode(Publish("cached/topic", b"1"))
    assert decode(wire * 2) == [Publish("cached/topic", b"1")] * 2
    refused(b"\x30\x04\x00\x02a+", "malformed")
    refused(b"\x30\x04\x00\x02a+", "malformed")  # not remembered as a good one


# ----------------------------------------------------------------------------- encoding refused


@pytest.mark.parametrize(
    "bad",
    [
        Publish("", b"x"),
        Publish("a/+", b"x"),
        Publish("a/#", b"x"),
        Publish("a\0b", b"x"),
        Publish("\ud800", b"x"),
        Publish("t" * 65_536, b"x"),
        Publish("t", b"x", 3, packet_id=1),
        Publish("t", b"x", -1, packet_id=1),
        Publish("t", b"x", 1),
        Publish("t", b"x", 1, packet_id=65_536),
        Publish("t", b"x", 0, packet_id=1),
        Publish("t", b"x", 0, dup=True),
        Publish("t", b"x" * MAX_REMAINING, 0),
        PubAck(0),
        PubRec(65_536),
        PubRel(0),
        PubComp(-1),
        UnsubAck(0),
        ConnAck(True, 4),
        ConnAck(False, 256),
        Subscribe(0, (("a", 0),)),
        Subscribe(1, ()),
        Subscribe(1, (("", 0),)),
        Subscribe(1, (("a", 3),)),
        SubAck(1, ()),
        SubAck(1, (3,)),
        SubAck(0, (0,)),
        Unsubscribe(1, ()),
        Unsubscribe(1, ("",)),
        Unsubscribe(0, ("a",)),
        Connect("MQTT", 4, password=b"pw"),
        Connect("MQTT", 4, client_id="c" * 65_536),
        Connect("MQTT", 4, username="\0"),
        Connect("MQTT", 4, password=b"p" * 65_536, username="u"),
        Connect("MQTT", 4, will=Will("w", b"m", 3, False)),
        Connect("MQTT", 4, will=Will("w/#", b"m", 0, False)),
        Connect("MQTT", 4, will=Will("w", b"m" * 65_536, 0, False)),
        Connect("MQTT", 4, keepalive=65_536),
        Connect("MQTT", 256),
        Connect("HTTP", 4),
    ],
)
def test_encode_refuses_what_mqtt_cannot_carry(bad: Packet) -> None:
    with pytest.raises(LocalProtocolError):
        encode(bad)


def test_encode_refuses_what_is_not_a_packet() -> None:
    with pytest.raises(LocalProtocolError):
        encode(("a", b"b"))  # type: ignore[arg-type]


def test_encode_publish_refuses() -> None:
    for args in ((b"", b"", 0, False, False, 0), (b"t", b"", 1, False, False, 0),
                 (b"t", b"", 3, False, False, 1), (b"t", b"", 0, False, True, 0),
                 (b"t" * 65_536, b"", 0, False, False, 0)):
        with pytest.raises(LocalProtocolError):
            encode_publish(*args)


# ----------------------------------------------------------------------------- paho as oracle

paho_client = pytest.importorskip("paho.mqtt.client")


class FakeSocket:
    """Stands for paho's TCP socket: keeps what paho writes, hands it what we queue."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.inbox = bytearray()

    def setblocking(self, flag: bool) -> None:
        pass

    def send(self, data: bytes) -> int:
        self.sent += data
        return len(data)

    def recv(self, size: int) -> bytes:
        if not self.inbox:
            raise BlockingIOError
        out = bytes(self.inbox[:size])
        del self.inbox[:size]
        return out

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def take(self) -> bytes:
        out = bytes(self.sent)
        self.sent.clear()
        return out


def paho(protocol: int, sock: FakeSocket, **options: object) -> object:
    """A paho client whose connect() talks to ``sock`` (paho builds its socket in the
    private ``_create_socket``; replacing it is the smallest way in)."""
    client = paho_client.Client(paho_client.CallbackAPIVersion.VERSION2, protocol=protocol,
                                **options)
    client._create_socket = lambda: sock
    return client


def server_says(client: object, sock: FakeSocket, *packets: Packet) -> None:
    sock.inbox += b"".join(map(encode, packets))
    while sock.inbox:
        assert client.loop_read() == 0


def check_canonical(wire: bytes, expected: list[Packet]) -> None:
    """paho's bytes decode to ``expected``, fed whole and a byte at a time, and our
    encoding of each of them is paho's, byte for byte."""
    assert list(map(typed, decode(wire))) == list(map(typed, expected))
    assert decode(wire, step=1) == expected
    assert b"".join(map(encode, expected)) == wire


@pytest.mark.parametrize(("protocol", "name", "level"),
                         [("MQTTv311", "MQTT", 4), ("MQTTv31", "MQIsdp", 3)])
def test_paho_conversation(protocol: str, name: str, level: int) -> None:
    sock = FakeSocket()
    client = paho(getattr(paho_client, protocol), sock, client_id="dev-1", clean_session=False)
    client.username_pw_set("alice", "s3cret")
    client.will_set("dev/1/status", b"gone", qos=1, retain=True)
    seen: list[tuple[str, object]] = []
    client.on_connect = lambda c, u, flags, rc, props: seen.append(
        ("connect", (flags.session_present, rc.value)))
    client.on_subscribe = lambda c, u, mid, codes, props: seen.append(
        ("subscribe", (mid, [code.value for code in codes])))
    client.on_unsubscribe = lambda c, u, mid, codes, props: seen.append(("unsubscribe", mid))
    client.on_publish = lambda c, u, mid, rc, props: seen.append(("published", mid))
    client.on_message = lambda c, u, msg: seen.append(
        ("message", (msg.topic, msg.payload, msg.qos, msg.retain)))

    client.connect("broker.invalid", 1883, keepalive=30)
    check_canonical(sock.take(), [
        Connect(name, level, False, 30, "dev-1", Will("dev/1/status", b"gone", 1, True),
                "alice", b"s3cret")])
    server_says(client, sock, ConnAck(True, 0))
    assert seen.pop() == ("connect", (True, 0))

    client.subscribe([("a/+", 1), ("b/#", 2), ("c", 0)])
    client.publish("t/0", b"zero", qos=0)
    client.publish("t/1", b"one", qos=1, retain=True)
    client.publish("t/2", b"\x00two", qos=2)
    client.publish("t/\u00e9", b"", qos=1)
    client.unsubscribe(["a/+", "b/#"])
    client._send_pingreq()
    check_canonical(sock.take(), [
        Subscribe(1, (("a/+", 1), ("b/#", 2), ("c", 0))),
        Publish("t/0", b"zero"),
        Publish("t/1", b"one", 1, True, False, 3),
        Publish("t/2", b"\x00two", 2, False, False, 4),
        Publish("t/\u00e9", b"", 1, False, False, 5),
        Unsubscribe(6, ("a/+", "b/#")),
        PingReq(),
    ])
    seen.clear()

    # the server's side, through paho's own parser
    server_says(client, sock, SubAck(1, (1, 2, SUBACK_FAILURE)), PubAck(3), PubRec(4),
                PubAck(5), UnsubAck(6), PingResp())
    assert ("subscribe", (1, [1, 2, 0x80])) in seen
    assert ("published", 3) in seen and ("published", 5) in seen
    assert ("unsubscribe", 6) in seen
    check_canonical(sock.take(), [PubRel(4)])
    server_says(client, sock, PubComp(4))
    assert ("published", 4) in seen

    seen.clear()
    server_says(client, sock, Publish("n/0", b"a"), Publish("n/1", b"b", 1, True, False, 77),
                Publish("n/2", b"c" * 300, 2, False, True, 78))
    check_canonical(sock.take(), [PubAck(77), PubRec(78)])
    server_says(client, sock, PubRel(78))
    check_canonical(sock.take(), [PubComp(78)])
    assert seen == [("message", ("n/0", b"a", 0, False)), ("message", ("n/1", b"b", 1, True)),
                    ("message", ("n/2", b"c" * 300, 2, False))]

    client.disconnect()
    check_canonical(sock.take(), [Disconnect()])


def test_paho_connect_minimal_and_large_publish() -> None:
    sock = FakeSocket()
    client = paho(paho_client.MQTTv311, sock, client_id="")
    client.connect("broker.invalid", 1883, keepalive=0)
    check_canonical(sock.take(), [Connect("MQTT", 4, True, 0, "")])
    server_says(client, sock, ConnAck(False, 0))
    for size in (100, 16_400, 2_100_000):
        client.publish("big/x", b"q" * size, qos=1)
    check_canonical(sock.take(), [Publish("big/x", b"q" * size, 1, False, False, i)
                                  for i, size in enumerate((100, 16_400, 2_100_000), 1)])


# ----------------------------------------------------------------------------- hypothesis

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")
texts = st.text(_CHARS, max_size=12)
names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0+#"),
                min_size=1, max_size=12)
filters = st.text(_CHARS, min_size=1, max_size=12)
qos_levels = st.integers(0, 2)
packet_ids = st.integers(1, 0xFFFF)


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    qos = draw(qos_levels)
    return Publish(draw(names), draw(st.binary(max_size=300)), qos, draw(st.booleans()),
                   qos > 0 and draw(st.booleans()), draw(packet_ids) if qos else 0)


@st.composite
def connects(draw: st.DrawFn) -> Connect:
    name, level = draw(st.sampled_from([("MQTT", 4), ("MQIsdp", 3)]))
    username = draw(st.none() | texts)
    return Connect(
        name, level, draw(st.booleans()), draw(st.integers(0, 0xFFFF)), draw(texts),
        draw(st.none() | st.builds(Will, names, st.binary(max_size=40), qos_levels,
                                   st.booleans())),
        username, None if username is None else draw(st.none() | st.binary(max_size=20)))


all_packets = st.one_of(
    connects(),
    st.builds(Connect, st.sampled_from(["MQTT", "MQIsdp"]),
              st.integers(0, 255).filter(lambda n: n not in (3, 4))),
    st.just(ConnAck(True, 0)),
    st.builds(ConnAck, st.just(False), st.integers(0, 255)),
    publishes(),
    *(st.builds(cls, packet_ids) for cls in (PubAck, PubRec, PubRel, PubComp, UnsubAck)),
    st.builds(Subscribe, packet_ids, st.lists(st.tuples(filters, qos_levels), min_size=1,
                                              max_size=4).map(tuple)),
    st.builds(SubAck, packet_ids, st.lists(st.sampled_from([0, 1, 2, SUBACK_FAILURE]),
                                           min_size=1, max_size=6).map(tuple)),
    st.builds(Unsubscribe, packet_ids, st.lists(filters, min_size=1, max_size=4).map(tuple)),
    st.sampled_from([PingReq(), PingResp(), Disconnect()]),
)


@given(st.lists(all_packets, min_size=1, max_size=8), st.integers(1, 40))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_hypothesis_round_trip(packets: list[Packet], step: int) -> None:
    data = b"".join(map(encode, packets))
    assert list(map(typed, decode(data))) == list(map(typed, packets))
    assert list(map(typed, decode(data, step=step))) == list(map(typed, packets))


def _run(data: bytes, step: int, max_packet: int, *, skip: bool = False
         ) -> tuple[list[Packet | OversizePublish], str | None]:
    """Feed ``data`` ``step`` bytes at a time: the packets and the reason it stopped, if any;
    nothing but MqttError may escape, and the buffer stays within its bound."""
    decoder = Decoder(max_packet, skip_oversize=skip)
    out: list[Packet | OversizePublish] = []
    bound = max(max_packet, 65_544) if skip else max_packet
    try:
        for i in range(0, len(data), step):
            decoder.feed(data[i : i + step])
            out += decoder.packets()
            assert decoder.buffered < bound + step
        out += decoder.packets()
    except MqttError as exc:
        assert exc.reason in REASONS
        try:
            decoder.packets()
        except MqttError as again:
            assert again is exc
        return out, exc.reason
    return out, None


@given(st.binary(max_size=600), st.integers(1, 64), st.integers(2, 300), st.booleans())
@settings(max_examples=500)
def test_hypothesis_random_bytes_only_raise_mqtt_error(data: bytes, step: int,
                                                       max_packet: int, skip: bool) -> None:
    whole, whole_reason = _run(data, len(data) or 1, max_packet, skip=skip)
    split, split_reason = _run(data, step, max_packet, skip=skip)
    assert split == whole and split_reason == whole_reason


@given(st.lists(all_packets, min_size=1, max_size=8), st.integers(2, 400), st.integers(1, 40))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_hypothesis_skip_oversize_passes_over_every_publish_over_the_limit(
        packets: list[Packet], max_packet: int, step: int) -> None:
    """Each PUBLISH over the limit becomes an OversizePublish in its place, in any split;
    any other packet over it is refused, after the packets before it."""
    wires = [encode(p) for p in packets]
    want: list[object] = []
    reason = None
    for p, wire in zip(packets, wires, strict=True):
        if len(wire) <= max_packet:
            want.append(typed(p))
        elif isinstance(p, Publish):
            want.append(typed(OversizePublish(p.topic, p.qos, p.packet_id, len(wire))))
        else:
            reason = "too_large"
            break
    data = b"".join(wires)
    for s in (len(data), step):
        got, why = _run(data, s, max_packet, skip=True)
        assert (list(map(typed, got)), why) == (want, reason)


@given(st.lists(all_packets, min_size=1, max_size=4), st.data())
@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
def test_hypothesis_damaged_packets_only_raise_mqtt_error(packets: list[Packet],
                                                          data: st.DataObject) -> None:
    wire = bytearray(b"".join(map(encode, packets)))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(wire) - 1))
        action = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if action == "flip":
            wire[at] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set":
            wire[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del wire[at]
        else:
            wire.insert(at, data.draw(st.integers(0, 255)))
        if not wire:
            return
    step = data.draw(st.integers(1, 32))
    whole = _run(bytes(wire), len(wire), 4096)
    assert _run(bytes(wire), step, 4096) == whole
    for decoded in whole[0]:  # whatever decodes encodes back to something that decodes alike
        try:
            again = encode(decoded)
        except LocalProtocolError:
            assert isinstance(decoded, Connect) and (decoded.protocol_name, decoded.level) \
                not in (("MQTT", 4), ("MQIsdp", 3))
            continue
        assert decode(again) == [decoded]
