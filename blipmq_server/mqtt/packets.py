"""The control packets of MQTT 3.1.1 (and 3.1): their types, fields and codes.

Every packet is a fixed header and a body::

    +----------------------+-----------------+---------------------------------+
    | type << 4 | flags u8 | remaining length| variable header and payload     |
    |                      | 1 to 4 bytes    | (remaining length bytes)        |
    +----------------------+-----------------+---------------------------------+

The remaining length is a base-128 integer, least significant group first, bit 7 of each byte
saying "another byte follows" (at most 4 bytes, so at most 268,435,455). Strings are a u16
big-endian length and that many bytes of UTF-8 without U+0000. The bodies' byte layouts are
drawn in ``codec``, which encodes and decodes them. Packets are values and say nothing about
who may send them: that is the session's business. Standard library only; no I/O.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

MAX_REMAINING = 268_435_455  # the largest remaining length four bytes can carry
SUBACK_FAILURE = 0x80  # a SUBACK return code: the subscription was refused


class PacketType(IntEnum):
    """The high nibble of a packet's first byte (0 and 15 are reserved)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14


class ConnackCode(IntEnum):
    """The return code of CONNACK (6 to 255 are reserved)."""

    ACCEPTED = 0
    BAD_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_CREDENTIALS = 4
    NOT_AUTHORIZED = 5


@dataclass(frozen=True, slots=True)
class Will:
    """The message a CONNECT asks the server to publish if the client goes away unannounced."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT. ``("MQTT", 4)`` is 3.1.1 and ``("MQIsdp", 3)`` is 3.1, and with bit 7 of the
    level set (0x84, 0x83) a bridge's of either; any other level comes with every later
    field at its default, unread, so the server can answer CONNACK 0x01."""

    protocol_name: str
    level: int
    clean_session: bool = True
    keepalive: int = 0  # seconds; 0 turns the keep-alive off
    client_id: str = ""
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None


@dataclass(frozen=True, slots=True)
class ConnAck:
    session_present: bool
    code: int  # a ConnackCode


class Publish(NamedTuple):
    """PUBLISH: a NamedTuple, not a dataclass, as it is made once per message (the hot path).
    ``packet_id`` is 0 at QoS 0, which carries none, and non-zero otherwise."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0


@dataclass(frozen=True, slots=True)
class OversizePublish:
    """Not a packet on the wire: what a decoder made with ``skip_oversize`` yields for a
    PUBLISH over its ``max_packet``, once every byte of it has passed. The payload was never
    kept; ``size`` is the whole packet's, fixed header included."""

    topic: str
    qos: int
    packet_id: int  # 0 at QoS 0
    size: int


@dataclass(frozen=True, slots=True)
class PubAck:
    """The answer to a QoS 1 PUBLISH."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class PubRec:
    """QoS 2, step 1 of 3: the receiver has the PUBLISH."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class PubRel:
    """QoS 2, step 2 of 3: the sender lets go of the PUBLISH."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class PubComp:
    """QoS 2, step 3 of 3: the receiver lets go of the packet id."""

    packet_id: int


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE: one or more ``(filter, requested qos)`` pairs."""

    packet_id: int
    topics: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class SubAck:
    """SUBACK: one code per filter of the SUBSCRIBE, the granted QoS or ``SUBACK_FAILURE``."""

    packet_id: int
    codes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    topics: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UnsubAck:
    packet_id: int


@dataclass(frozen=True, slots=True)
class PingReq:
    pass


@dataclass(frozen=True, slots=True)
class PingResp:
    pass


@dataclass(frozen=True, slots=True)
class Disconnect:
    pass


Packet = (
    Connect | ConnAck | Publish | PubAck | PubRec | PubRel | PubComp | Subscribe | SubAck
    | Unsubscribe | UnsubAck | PingReq | PingResp | Disconnect
)


def free_packet_id(start: int, busy: Container[int], held: Container[int]) -> int:
    """The first packet id from ``start`` on (1-65535, wrapping round) in neither ``busy``
    nor ``held``; 0 when every id is taken."""
    pid = start
    for _ in range(65535):
        if pid not in busy and pid not in held:
            return pid
        pid = pid % 65535 + 1
    return 0
