"""Bytes to MQTT packets and packets to bytes: the sans-IO codec of MQTT 3.1.1 and 3.1.

The packets are declared in ``packets`` and re-exported here, so ``codec`` is the one import
a front end needs. The decoder reads both directions (client to server and back); what a side
may send is the session's business. Every integer is big-endian. Nothing here does I/O, and
nothing outside the standard library and ``blipmq_server.errors`` is imported.

The bodies, after the fixed header (drawn in ``packets``)::

    CONNECT      name str16 | level u8 | flags u8 | keepalive u16 | client id str16
                 (level: 4 for "MQTT", 3 for "MQIsdp"; with bit 7 set, 0x84 / 0x83, a
                 bridge's, as mosquitto's bridges send with ``try_private``)
                 | [will topic str16 | will payload bin16] | [username str16] | [password bin16]
                 flags: 7 username, 6 password, 5 will retain, 4-3 will qos, 2 will,
                        1 clean session, 0 reserved (0)
    CONNACK      ack flags u8 (bit 0: session present, others 0) | return code u8
    PUBLISH      topic str16 | packet id u16 (QoS 1 and 2 only) | payload (the rest)
                 fixed-header flags: 3 dup, 2-1 qos, 0 retain
    PUBACK, PUBREC, PUBREL, PUBCOMP, UNSUBACK    packet id u16
    SUBSCRIBE    packet id u16 | (filter str16 | requested qos u8)+
    SUBACK       packet id u16 | return code u8+ (0, 1, 2 or 0x80)
    UNSUBSCRIBE  packet id u16 | filter str16+
    PINGREQ, PINGRESP, DISCONNECT                (empty)

``str16`` is a u16 length and that many bytes of UTF-8 (well formed, no U+0000); ``bin16`` is
a u16 length and that many bytes. The fixed-header flags are 0b0010 for PUBREL, SUBSCRIBE and
UNSUBSCRIBE and 0 for every other type but PUBLISH.
"""

from __future__ import annotations

import struct

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.mqtt.packets import (
    MAX_REMAINING,
    SUBACK_FAILURE,
    ConnAck,
    ConnackCode,
    Connect,
    Disconnect,
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
)

__all__ = [
    "BRIDGE_LEVEL", "MAX_REMAINING", "REASONS", "SUBACK_FAILURE", "ConnAck", "ConnackCode",
    "Connect", "Decoder", "Disconnect", "MqttError", "OversizePublish", "Packet",
    "PacketType", "PingReq", "PingResp", "PubAck", "PubComp", "PubRec", "PubRel", "Publish",
    "SubAck", "Subscribe", "UnsubAck", "Unsubscribe", "Will", "encode", "encode_publish",
    "publish_head", "remaining_length",
]

# the reasons an MqttError gives, short enough to count by
REASONS = (
    "malformed",  # a body that breaks the packet's layout or one of its rules
    "reserved_flags",  # a reserved flag bit set (fixed header, CONNECT, CONNACK)
    "remaining_length",  # a remaining length longer than 4 bytes
    "too_large",  # a packet over the decoder's max_packet
    "protocol_name",  # a CONNECT for a protocol other than "MQTT" or "MQIsdp"
    "bad_utf8",  # a string that is not UTF-8, or holds U+0000
    "packet_type",  # type 0 or 15
)


class MqttError(RemoteProtocolError):
    """The peer sent bytes that are not MQTT; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_U16 = struct.Struct(">H")
_CONNECT_HEAD = struct.Struct(">BBH")  # level, flags, keepalive (after the protocol name)
_SHORT_PUBLISH = struct.Struct(">BBH")  # first byte, a one-byte remaining length, topic length
_PROTOCOLS = {b"MQTT": 4, b"MQIsdp": 3}  # name -> the one level of it this codec reads
BRIDGE_LEVEL = 0x80  # the level's bit a bridge sets (mosquitto's try_private)
_SUBACK_CODES = frozenset((0, 1, 2, SUBACK_FAILURE))
_tuple_new = tuple.__new__  # builds a Publish as the tuple it is, without its __new__ call


def _first_byte_verdicts() -> tuple[str | None, ...]:
    """For each possible first byte, the MqttError reason it earns, or None when it is fine."""
    verdicts: list[str | None] = []
    for byte in range(256):
        ptype, flags = byte >> 4, byte & 0x0F
        if ptype in (0, 15):
            verdicts.append("packet_type")
        elif ptype == PacketType.PUBLISH:
            qos3 = flags & 0b0110 == 0b0110
            dup_at_qos0 = flags & 0b1110 == 0b1000  # MQTT-3.3.1-2
            verdicts.append("malformed" if qos3 or dup_at_qos0 else None)
        else:
            wanted = 0b0010 if ptype in (6, 8, 10) else 0
            verdicts.append(None if flags == wanted else "reserved_flags")
    return tuple(verdicts)


_FIRST_BYTE = _first_byte_verdicts()


def _refuse_first_byte(byte: int) -> MqttError:
    reason = _FIRST_BYTE[byte]
    assert reason is not None
    if reason == "packet_type":
        return MqttError(reason, f"packet type {byte >> 4} is reserved")
    name = PacketType(byte >> 4).name
    if reason == "reserved_flags":
        return MqttError(reason, f"{name} with reserved flags {byte & 0x0F:#06b}")
    return MqttError(reason, f"PUBLISH with flags {byte & 0x0F:#06b} (QoS 3, or DUP at QoS 0)")


# -------------------------------------------------------------------------------- encoding

_LENGTH_BYTE = tuple(bytes((n,)) for n in range(128))


def remaining_length(n: int) -> bytes:
    """``n`` as MQTT's variable-length integer: 7 bits a byte, least significant first,
    bit 7 set on every byte but the last; 1 to 4 bytes, so 0 to 268,435,455."""
    if 0 <= n < 128:
        return _LENGTH_BYTE[n]
    if not 0 <= n <= MAX_REMAINING:
        raise LocalProtocolError(f"remaining length {n} is outside 0..{MAX_REMAINING}")
    out = bytearray()
    while n > 127:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_publish(topic: bytes, payload: bytes, qos: int, retain: bool, dup: bool,
                   packet_id: int) -> bytes:
    """A PUBLISH from a topic already in UTF-8 (the hot path: the topic is trusted to be a
    valid topic name; its length, the QoS and the packet id are checked)."""
    tlen = len(topic)
    if not 0 < tlen <= 0xFFFF:
        raise LocalProtocolError(f"a PUBLISH topic is 1 to 65535 bytes, not {tlen}")
    first = (0x38 if dup else 0x30) | (1 if retain else 0)
    if qos:
        if not 0 < qos <= 2:
            raise LocalProtocolError(f"PUBLISH qos must be 0, 1 or 2, not {qos}")
        if not 0 < packet_id <= 0xFFFF:
            raise LocalProtocolError(f"PUBLISH at QoS {qos} needs a packet id 1..65535, "
                                     f"not {packet_id}")
        length = tlen + 4 + len(payload)
        if length < 128:
            return b"".join((_SHORT_PUBLISH.pack(first | qos << 1, length, tlen), topic,
                             _U16.pack(packet_id), payload))
        return b"".join((_LENGTH_BYTE[first | qos << 1], remaining_length(length),
                         _U16.pack(tlen), topic, _U16.pack(packet_id), payload))
    if packet_id or dup:
        raise LocalProtocolError("a QoS 0 PUBLISH carries no packet id and no DUP flag")
    length = tlen + 2 + len(payload)
    if length < 128:
        return b"".join((_SHORT_PUBLISH.pack(first, length, tlen), topic, payload))
    return b"".join((_LENGTH_BYTE[first], remaining_length(length), _U16.pack(tlen), topic,
                     payload))


def publish_head(topic: bytes, payload_size: int, qos: int, retain: bool) -> bytes:
    """What ``encode_publish`` puts before the packet id of a QoS 1 or 2 PUBLISH (no DUP)
    of ``topic`` with a payload of ``payload_size`` bytes, or before the payload of a QoS 0
    one: the same for every such message, so a sender that keeps it makes each packet as
    head + packet id + payload (QoS 0: head + payload)."""
    tlen = len(topic)
    if not 0 < tlen <= 0xFFFF:
        raise LocalProtocolError(f"a PUBLISH topic is 1 to 65535 bytes, not {tlen}")
    if not 0 <= qos <= 2:
        raise LocalProtocolError(f"PUBLISH qos must be 0, 1 or 2, not {qos}")
    first = 0x30 | qos << 1 | (1 if retain else 0)
    return b"".join((_LENGTH_BYTE[first],
                     remaining_length(tlen + (4 if qos else 2) + payload_size),
                     _U16.pack(tlen), topic))


def _utf8(text: str, what: str) -> bytes:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"{what} {text!r} is not encodable as UTF-8") from None
    if "\0" in text:
        raise LocalProtocolError(f"{what} {text!r} holds U+0000, which MQTT strings may not")
    if len(data) > 0xFFFF:
        raise LocalProtocolError(f"{what} of {len(data)} bytes does not fit a u16 length")
    return data


def _str16(text: str, what: str) -> bytes:
    data = _utf8(text, what)
    return _U16.pack(len(data)) + data


def _bin16(data: bytes, what: str) -> bytes:
    if len(data) > 0xFFFF:
        raise LocalProtocolError(f"{what} of {len(data)} bytes does not fit a u16 length")
    return _U16.pack(len(data)) + bytes(data)


def _topic_name(topic: str, what: str = "topic") -> bytes:
    """A topic name to publish to: not empty, no wildcard (MQTT-4.7.3-1, MQTT-3.3.2-2)."""
    if not topic or "+" in topic or "#" in topic:
        raise LocalProtocolError(f"{what} {topic!r} is not a topic name (empty, or a wildcard)")
    return _utf8(topic, what)


def _filter(topic_filter: str) -> bytes:
    if not topic_filter:
        raise LocalProtocolError("a topic filter is at least one character long")
    return _str16(topic_filter, "topic filter")


def _packet_id(packet_id: int, what: str) -> bytes:
    if not 0 < packet_id <= 0xFFFF:
        raise LocalProtocolError(f"{what} needs a packet id 1..65535, not {packet_id}")
    return _U16.pack(packet_id)


def _connect_body(c: Connect) -> bytes:
    name = c.protocol_name.encode("utf-8", "replace")
    if name not in _PROTOCOLS:
        raise LocalProtocolError(f"protocol name {c.protocol_name!r}: MQTT or MQIsdp")
    if not 0 <= c.level <= 255 or not 0 <= c.keepalive <= 0xFFFF:
        raise LocalProtocolError(f"CONNECT level {c.level} or keepalive {c.keepalive} is "
                                 "out of range")
    flags = 0x02 if c.clean_session else 0
    parts = [_U16.pack(len(name)), name, b"", _str16(c.client_id, "client id")]
    if c.will is not None:
        will = c.will
        if not 0 <= will.qos <= 2:
            raise LocalProtocolError(f"will qos must be 0, 1 or 2, not {will.qos}")
        flags |= 0x04 | will.qos << 3 | (0x20 if will.retain else 0)
        topic = _topic_name(will.topic, "will topic")
        parts += (_U16.pack(len(topic)), topic, _bin16(will.payload, "will payload"))
    if c.username is not None:
        flags |= 0x80
        parts.append(_str16(c.username, "username"))
    if c.password is not None:
        if c.username is None:
            raise LocalProtocolError("a password without a username (MQTT-3.1.2-22)")
        flags |= 0x40
        parts.append(_bin16(c.password, "password"))
    parts[2] = _CONNECT_HEAD.pack(c.level, flags, c.keepalive)
    return b"".join(parts)


def _packet(first: int, body: bytes) -> bytes:
    return b"".join((_LENGTH_BYTE[first] if first < 128 else bytes((first,)),
                     remaining_length(len(body)), body))


_PINGREQ = bytes((0xC0, 0))
_PINGRESP = bytes((0xD0, 0))
_DISCONNECT = bytes((0xE0, 0))


def encode(packet: Packet) -> bytes:
    """The bytes of any packet. Raises LocalProtocolError for what MQTT cannot carry: a
    string over 65,535 bytes of UTF-8 (or holding U+0000), a zero packet id where one is
    needed, a QoS outside 0..2, a topic name with a wildcard, an empty list of filters."""
    match packet:
        case Publish():
            return encode_publish(_topic_name(packet.topic), packet.payload, packet.qos,
                                  packet.retain, packet.dup, packet.packet_id)
        case PubAck():
            return b"\x40\x02" + _packet_id(packet.packet_id, "PUBACK")
        case PubRec():
            return b"\x50\x02" + _packet_id(packet.packet_id, "PUBREC")
        case PubRel():
            return b"\x62\x02" + _packet_id(packet.packet_id, "PUBREL")
        case PubComp():
            return b"\x70\x02" + _packet_id(packet.packet_id, "PUBCOMP")
        case UnsubAck():
            return b"\xb0\x02" + _packet_id(packet.packet_id, "UNSUBACK")
        case PingReq():
            return _PINGREQ
        case PingResp():
            return _PINGRESP
        case Disconnect():
            return _DISCONNECT
        case Connect():
            return _packet(0x10, _connect_body(packet))
        case ConnAck():
            if not 0 <= packet.code <= 255:
                raise LocalProtocolError(f"CONNACK code {packet.code} is out of range")
            if packet.session_present and packet.code:
                raise LocalProtocolError("a refusing CONNACK has no session (MQTT-3.2.2-4)")
            return bytes((0x20, 2, 1 if packet.session_present else 0, packet.code))
        case Subscribe():
            if not packet.topics:
                raise LocalProtocolError("a SUBSCRIBE has at least one filter")
            parts = [_packet_id(packet.packet_id, "SUBSCRIBE")]
            for topic_filter, qos in packet.topics:
                if not 0 <= qos <= 2:
                    raise LocalProtocolError(f"requested qos must be 0, 1 or 2, not {qos}")
                parts += (_filter(topic_filter), _LENGTH_BYTE[qos])
            return _packet(0x82, b"".join(parts))
        case SubAck():
            if not packet.codes or not _SUBACK_CODES.issuperset(packet.codes):
                raise LocalProtocolError(f"SUBACK codes {packet.codes!r}: one or more of "
                                         "0, 1, 2, 0x80")
            return _packet(0x90, _packet_id(packet.packet_id, "SUBACK") + bytes(packet.codes))
        case Unsubscribe():
            if not packet.topics:
                raise LocalProtocolError("an UNSUBSCRIBE has at least one filter")
            return _packet(0xA2, b"".join([_packet_id(packet.packet_id, "UNSUBSCRIBE"),
                                           *map(_filter, packet.topics)]))
    raise LocalProtocolError(f"not an MQTT packet: {packet!r}")


# -------------------------------------------------------------------------------- decoding

# topic names by their bytes, checked: a connection publishes to the same few again and again
# (short ones only, and a few thousand at most, then the cache starts over)
_TOPICS: dict[bytes, str] = {}
_TOPICS_KEPT = 2048
_TOPIC_CACHED = 256  # bytes


def _text(raw: bytes, what: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MqttError("bad_utf8", f"{what} is not well-formed UTF-8") from None
    if "\0" in text:
        raise MqttError("bad_utf8", f"{what} holds U+0000")
    return text


def _topic(raw: bytes, what: str = "PUBLISH topic") -> str:
    """A received topic name: UTF-8, not empty, no wildcard (MQTT-4.7.3-1, MQTT-3.3.2-2)."""
    topic = _TOPICS.get(raw)
    if topic is not None:
        return topic
    topic = _text(raw, what)
    if not topic:
        raise MqttError("malformed", f"{what} is empty")
    if "+" in topic or "#" in topic:
        raise MqttError("malformed", f"{what} {topic!r} holds a wildcard")
    if len(raw) <= _TOPIC_CACHED:
        if len(_TOPICS) >= _TOPICS_KEPT:
            _TOPICS.clear()
        _TOPICS[raw] = topic
    return topic


class _Reader:
    """Reads one packet's body, ``data[pos:end]``; running past ``end`` is "malformed"."""

    __slots__ = ("data", "end", "pos", "what")

    def __init__(self, data: bytes, pos: int, end: int, what: str) -> None:
        self.data, self.pos, self.end, self.what = data, pos, end, what

    def take(self, n: int) -> bytes:
        pos = self.pos
        if pos + n > self.end:
            raise MqttError("malformed", f"{self.what} ends early")
        self.pos = pos + n
        return self.data[pos : pos + n]

    def u8(self) -> int:
        if self.pos >= self.end:
            raise MqttError("malformed", f"{self.what} ends early")
        self.pos += 1
        return self.data[self.pos - 1]

    def u16(self) -> int:
        return _U16.unpack(self.take(2))[0]

    def bin16(self) -> bytes:
        return self.take(self.u16())

    def str16(self, what: str) -> str:
        return _text(self.bin16(), f"{self.what} {what}")

    def packet_id(self) -> int:
        packet_id = self.u16()
        if not packet_id:
            raise MqttError("malformed", f"{self.what} with packet id 0")
        return packet_id

    def done(self) -> None:
        if self.pos != self.end:
            raise MqttError("malformed", f"{self.end - self.pos} bytes after the {self.what}")


def _connect(r: _Reader) -> Connect:
    name = r.bin16()
    if name not in _PROTOCOLS:
        raise MqttError("protocol_name", f"CONNECT for protocol {name[:16]!r}, not MQTT")
    protocol, level = name.decode("ascii"), r.u8()
    if _PROTOCOLS[name] != level & ~BRIDGE_LEVEL:  # CONNACK 0x01: nothing more is read
        return Connect(protocol, level)
    flags, keepalive = r.u8(), r.u16()
    if flags & 0x01:
        raise MqttError("reserved_flags", "CONNECT with the reserved connect flag set")
    will_qos = flags >> 3 & 3
    if will_qos == 3:
        raise MqttError("malformed", "CONNECT with will QoS 3")
    if not flags & 0x04 and flags & 0x38:
        raise MqttError("malformed", "CONNECT with a will QoS or retain but no will")
    if flags & 0x40 and not flags & 0x80:
        raise MqttError("malformed", "CONNECT with a password but no username (MQTT-3.1.2-22)")
    client_id = r.str16("client id")
    will = None
    if flags & 0x04:
        topic = _topic(r.bin16(), "CONNECT will topic")
        will = Will(topic, r.bin16(), will_qos, bool(flags & 0x20))
    username = r.str16("username") if flags & 0x80 else None
    password = r.bin16() if flags & 0x40 else None
    r.done()
    return Connect(protocol, level, bool(flags & 0x02), keepalive, client_id, will, username,
                   password)


_ACKS = {4: PubAck, 5: PubRec, 6: PubRel, 7: PubComp, 11: UnsubAck}
_EMPTY = {12: PingReq(), 13: PingResp(), 14: Disconnect()}
_FIXED_LENGTH = {2: 2, 4: 2, 5: 2, 6: 2, 7: 2, 11: 2, 12: 0, 13: 0, 14: 0}


def _check_fixed_length(ptype: int, length: int) -> None:
    if length != _FIXED_LENGTH[ptype]:
        raise MqttError("malformed", f"{PacketType(ptype).name} with a remaining length of "
                        f"{length}, not {_FIXED_LENGTH[ptype]}")


def _too_large(size: str, max_packet: int) -> MqttError:
    return MqttError("too_large", f"a packet of {size} bytes is over the maximum of {max_packet}")


def _decode_body(ptype: int, data: bytes, pos: int, end: int) -> Packet:
    """Every packet but PUBLISH, which ``Decoder.packets`` reads itself (the hot path)."""
    size = end - pos
    name = PacketType(ptype).name
    if ptype in _FIXED_LENGTH:
        _check_fixed_length(ptype, size)
    if ptype in _ACKS:
        packet_id = data[pos] << 8 | data[pos + 1]
        if not packet_id:
            raise MqttError("malformed", f"{name} with packet id 0")
        return _ACKS[ptype](packet_id)
    if ptype in _EMPTY:
        return _EMPTY[ptype]
    if ptype == PacketType.CONNACK:
        flags, code = data[pos], data[pos + 1]
        if flags & 0xFE:
            raise MqttError("reserved_flags", f"CONNACK with ack flags {flags:#04x}")
        if flags and code:
            raise MqttError("malformed", "a refusing CONNACK with a session (MQTT-3.2.2-4)")
        return ConnAck(bool(flags), code)
    r = _Reader(data, pos, end, name)
    if ptype == PacketType.CONNECT:
        return _connect(r)
    packet_id = r.packet_id()
    if ptype == PacketType.SUBSCRIBE:
        topics = []
        while r.pos < end:
            topic_filter = r.str16("filter")
            qos = r.u8()
            if not topic_filter or qos > 2:
                raise MqttError("malformed", f"SUBSCRIBE to {topic_filter!r} at qos byte "
                                f"{qos:#04x}")
            topics.append((topic_filter, qos))
        if not topics:
            raise MqttError("malformed", "SUBSCRIBE without a filter (MQTT-3.8.3-3)")
        return Subscribe(packet_id, tuple(topics))
    if ptype == PacketType.SUBACK:
        codes = tuple(data[r.pos : end])
        if not codes or not _SUBACK_CODES.issuperset(codes):
            raise MqttError("malformed", f"SUBACK with return codes {codes[:16]!r}")
        return SubAck(packet_id, codes)
    # UNSUBSCRIBE: the only type left, the first byte's check saw to that
    filters = []
    while r.pos < end:
        topic_filter = r.str16("filter")
        if not topic_filter:
            raise MqttError("malformed", "UNSUBSCRIBE of an empty filter")
        filters.append(topic_filter)
    if not filters:
        raise MqttError("malformed", "UNSUBSCRIBE without a filter (MQTT-3.10.3-2)")
    return Unsubscribe(packet_id, tuple(filters))


def _long_length(data: bytes, pos: int, end: int, max_packet: int) -> tuple[int, int]:
    """A remaining length of two bytes or more, whose first byte is at ``pos``: its value
    and where the body starts, or (0, -1) when the rest of it has not arrived.

    Each byte that says "more follows" is checked as it comes, the same whichever read
    brought it: a fourth one is "remaining_length", and one that makes the least the packet
    can still come to (this much header, a byte more, the body so far) larger than
    ``max_packet`` is "too_large".
    """
    value, shift = 0, 0
    for at in range(pos, pos + 4):
        if at >= end:
            return 0, -1
        byte = data[at]
        value |= (byte & 0x7F) << shift
        if byte < 128:
            return value, at + 1
        if at == pos + 3:
            raise MqttError("remaining_length", "remaining length longer than 4 bytes")
        if at - pos + 3 + value > max_packet:
            raise _too_large(f"at least {at - pos + 3 + value}", max_packet)
        shift += 7
    raise AssertionError("unreachable")


def _oversize_head(data: bytes, first: int, pos: int, start: int, stop: int,
                   end: int) -> OversizePublish | int:
    """A PUBLISH over ``max_packet`` at ``pos`` (body from ``start`` to ``stop``, buffered
    up to ``end``): what it is once its topic and packet id are in, else how many bytes
    from ``pos`` it takes to read them (at most 5 + 2 + 65,535 + 2)."""
    tstart = start + 2
    if tstart > end:
        return tstart - pos
    p = tstart + (data[start] << 8 | data[start + 1])
    qos = first >> 1 & 3
    head = p + 2 if qos else p
    if head > stop:
        raise MqttError("malformed", "PUBLISH ends within its topic or packet id")
    if head > end:
        return head - pos
    packet_id = data[p] << 8 | data[p + 1] if qos else 0
    if qos and not packet_id:
        raise MqttError("malformed", "PUBLISH with packet id 0")
    return OversizePublish(_topic(data[tstart:p]), qos, packet_id, stop - pos)


_KEEP_JOINED = 1 << 16  # past this, what follows the last whole packet is copied out


class Decoder:
    """Incremental packet decoder: ``feed`` bytes as they arrive, then ``packets()``.

    Raises :class:`MqttError` on the first bad packet; from then on the decoder keeps
    nothing and raises the same error again, as the connection is to be closed.

    A chunk fed while nothing is buffered is decoded where it lies, from an offset, and
    what is left of it is kept as it is (no copy). Chunks fed while a packet is incomplete
    gather in one bytearray and are joined to the rest only once the packet can be whole:
    a large packet costs one copy, however many reads brought it, and a peer writing a byte
    at a time costs a byte per byte. What follows the last whole packet of a buffer over 64
    KiB is copied out of it, so that the buffer is not kept for its tail. Call
    ``packets()`` after each ``feed``: the decoder then holds at most ``max_packet`` plus
    the last read. ``max_packet`` counts the whole
    packet, fixed header included (so the default refuses only the few packets whose
    remaining length is within 5 bytes of the protocol's maximum).

    Any packet over ``max_packet`` is "too_large", unless ``skip_oversize`` is set (a
    bridge's link: an upstream's message too large to store is acknowledged, not fought
    over): then a PUBLISH over it is read up to its packet id, the rest of it is passed
    over as it is fed, never kept, and an :class:`OversizePublish` takes its place among
    the packets once its last byte has passed. Its topic and packet id are held meanwhile,
    so the decoder holds at most the larger of ``max_packet`` and 65,544 bytes, plus the
    last read. Other packet types over the limit are refused as ever.
    """

    __slots__ = ("_data", "_error", "_more", "_need", "_pos", "_size", "_skip", "_skipped",
                 "max_packet", "skip_oversize")

    def __init__(self, max_packet: int = MAX_REMAINING, *, skip_oversize: bool = False) -> None:
        if max_packet < 2:
            raise ValueError(f"max_packet must be at least 2 bytes, not {max_packet}")
        self.max_packet = max_packet
        self.skip_oversize = skip_oversize
        self._skip = 0  # bytes of an oversize PUBLISH still to pass over
        self._skipped: OversizePublish | None = None  # ... and what it was
        self._data = b""  # the chunk being read, from _pos on
        self._pos = 0
        self._more = bytearray()  # what came after _data, while a packet is incomplete
        self._size = 0  # bytes buffered: _data[_pos:] and _more
        self._need = 1  # buffered bytes it takes before packets() can get further
        self._error: MqttError | None = None

    def feed(self, data: bytes) -> None:
        if self._error is not None or not data:
            return  # a refused stream: nothing more is kept
        if self._skip:  # the rest of an oversize PUBLISH: passed over
            if len(data) <= self._skip:
                self._skip -= len(data)
                return
            data = data[self._skip :]
            self._skip = 0
        if self._size:
            self._more += data
        else:
            self._data = data if type(data) is bytes else bytes(data)
            self._pos = 0
        self._size += len(data)

    @property
    def buffered(self) -> int:
        return self._size

    @property
    def wanted(self) -> int:
        """The whole size of the incomplete packet buffered, fixed header included, once
        its length is in (before: what it takes to read the length); 0 with nothing
        buffered. Meaningful after ``packets()``."""
        return self._need if self._size else 0

    @property
    def skipping(self) -> int:
        """Bytes of an oversize PUBLISH still to pass over (``skip_oversize``); 0 else."""
        return self._skip

    def packets(self) -> list[Packet | OversizePublish]:
        """Every complete packet buffered so far, in order (and every oversize PUBLISH
        passed over, with ``skip_oversize``).

        When a bad packet follows good ones, the good ones are returned first and the error
        is raised by the next call, so the peer's valid requests are still served in order.
        """
        if self._error is not None:
            raise self._error
        out: list[Packet | OversizePublish] = []
        if self._skipped is not None:
            if self._skip:
                return out
            out.append(self._skipped)  # its last byte has passed
            self._skipped = None
        if self._size < self._need:
            return out
        data, pos = self._data, self._pos
        if self._more:
            data = b"".join((memoryview(data)[pos:], self._more))
            self._more = bytearray()
            pos = 0
        end = len(data)
        append, new, publish = out.append, _tuple_new, Publish
        first_byte, topics, max_packet = _FIRST_BYTE, _TOPICS, self.max_packet
        skip = self.skip_oversize
        need = 1
        try:
            while pos < end:
                first = data[pos]
                if first_byte[first] is not None:
                    raise _refuse_first_byte(first)
                if pos + 1 == end:
                    need = 2
                    break
                length = data[pos + 1]
                if length < 128:
                    start = pos + 2
                else:
                    length, start = _long_length(data, pos + 1, end, MAX_REMAINING + 5 if (
                        skip and first >> 4 == 3) else max_packet)
                    if start < 0:
                        need = end - pos + 1
                        break
                stop = start + length
                if stop - pos > max_packet:
                    if not skip or first >> 4 != 3:
                        raise _too_large(str(stop - pos), max_packet)
                    head = _oversize_head(data, first, pos, start, stop, end)
                    if head.__class__ is int:
                        need = head  # type: ignore[assignment]
                        break
                    if stop > end:  # the rest is passed over as it is fed
                        self._skip, self._skipped = stop - end, head  # type: ignore[assignment]
                        pos = end
                        break
                    append(head)  # type: ignore[arg-type]
                    pos = stop
                    continue
                if stop > end:
                    if first >> 4 in _FIXED_LENGTH:  # refused now, not once the body is in
                        _check_fixed_length(first >> 4, length)
                    need = stop - pos
                    break
                if first >> 4 != 3:
                    append(_decode_body(first >> 4, data, start, stop))
                    pos = stop
                    continue
                # PUBLISH: topic str16, the packet id at QoS 1 and 2, the payload
                if length < 2:
                    raise MqttError("malformed", "PUBLISH without a topic")
                tstart = start + 2
                p = tstart + (data[start] << 8 | data[start + 1])
                qos = first >> 1 & 3
                if qos:
                    if p + 2 > stop:
                        raise MqttError("malformed", "PUBLISH ends before its packet id")
                    packet_id = data[p] << 8 | data[p + 1]
                    if not packet_id:
                        raise MqttError("malformed", "PUBLISH with packet id 0")
                    pstart = p + 2
                else:
                    if p > stop:
                        raise MqttError("malformed", "PUBLISH ends within its topic")
                    packet_id = 0
                    pstart = p
                raw = data[tstart:p]
                topic = topics.get(raw)
                if topic is None:
                    topic = _topic(raw)
                append(new(publish, (topic, data[pstart:stop], qos, first & 1 == 1,
                                     first & 8 == 8, packet_id)))
                pos = stop
        except MqttError as exc:
            self._data, self._pos, self._size, self._error = b"", 0, 0, exc
            if not out:
                raise
            return out
        self._size = end - pos
        if pos == end:
            data, pos = b"", 0
        elif pos and end > _KEEP_JOINED:  # a joined large packet is not kept for its tail
            data, pos = data[pos:], 0
        self._data = data
        self._pos = pos
        self._need = need
        return out
