"""What an MQTT persistent session keeps between connections, and how MQTT names map onto
the core's.

A persistent session (clean session 0) is saved as STATE records of the log (the core keeps
the latest value per key and carries it past retention); this module makes and reads their
bodies. Per client id: its subscriptions; the inbound QoS 2 packet ids awaiting PUBREL and
the outbound QoS 2 packet ids owed a PUBCOMP (PUBREL sent), each set in blocks of 64 ids,
one key per block holding any (either set may hold up to 65,535 ids: a client may keep
them waiting, and ``mqtt.max_inflight`` does not bound the outbound one, whose cursor moves
on at PUBREC; what a QoS 2 PUBLISH, PUBREL, PUBREC or PUBCOMP rewrites is its id's block,
never the whole set)::

    key:   b"mqtt/s/" + client id (UTF-8)
    value: | version u8 = 1 | offline_since_ms u64 | count u16 |
           | per subscription: | qos u8 | filter_len u16 | filter (UTF-8) |

    key:   b"mqtt/i/" (inbound) or b"mqtt/c/" (outbound) + block (ASCII decimal, 0-1023)
           + b"/" + client id (UTF-8)
    value: | ids u64 |   bit i (of value 1 << i) set: packet id 64 * block + i is in the set

A block with no id left is deleted (an empty value). Before these blocks each set was one
key, ``b"mqtt/q/"`` (inbound) or ``b"mqtt/r/"`` (outbound) + client id, rewritten whole per
QoS 2 message, valued ``| count u16 | packet id u16 ... |``: a log written so is read
(``parse_ids``) and rewritten as blocks at start (``BLOCKS_OF``).

``offline_since_ms`` is 0 while the client is connected (a session is expired by its
offline time, and one whose broker stopped while it was connected counts from the restart).

Shared subscriptions ``$share/<name>/<filter>`` map to consumer groups; a share name that
is not a valid group name, or one starting with ``mqtt.``, maps to ``share.<hash>``. A
persistent session's own QoS 1/2 subscriptions are durable groups named ``mqtt.<hash of the
client id>``, a name no share can take.
Standard library only; never imports trio, the core or the shell.
"""

from __future__ import annotations

import struct

try:  # hashlib's blake2b, without importing hashlib: that loads OpenSSL's libcrypto, which
    # the broker otherwise never maps (blipmq_server/deferred.py, docs/PERFORMANCE.md)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - a Python built without the module
    from hashlib import blake2b

from blipmq_server.protocol.names import group_problem

SUBS_PREFIX = b"mqtt/s/"
QOS2_PREFIX = b"mqtt/q/"  # before the blocks: all of a client's inbound QoS 2 ids
QOS2_BLOCK_PREFIX = b"mqtt/i/"  # a block of them (``block_key``)
PUBREL_PREFIX = b"mqtt/r/"  # before the blocks: all of its outbound ones owed a PUBCOMP
PUBREL_BLOCK_PREFIX = b"mqtt/c/"  # a block of them
# a set's whole record (as written before the blocks) -> its blocks' key prefix
BLOCKS_OF = {QOS2_PREFIX: QOS2_BLOCK_PREFIX, PUBREL_PREFIX: PUBREL_BLOCK_PREFIX}
OWNER_PREFIX = b"mqtt/o/"  # the name of the key that made a persistent session
SESSION_GROUPS = "mqtt."  # persistent sessions' groups; never a share's (``share_of``)
_HEAD = struct.Struct(">BQH")
_SUB = struct.Struct(">BH")
_U16 = struct.Struct(">H")
_BITS = struct.Struct(">Q")
BLOCK_IDS = 64  # QoS 2 packet ids per block record, one bit each
_BLOCKS = 65536 // BLOCK_IDS


def _digest(text: str) -> str:
    return blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def group_name(client_id: str) -> str:
    """The durable group name of a persistent session's QoS 1/2 subscriptions."""
    return SESSION_GROUPS + _digest(client_id)


def is_session_group(group: str) -> bool:
    """Whether ``group`` is named as a persistent session's (``group_name``)."""
    digest = group[len(SESSION_GROUPS):]
    return (group.startswith(SESSION_GROUPS) and len(digest) == 32
            and all(c in "0123456789abcdef" for c in digest))


def share_of(topic_filter: str) -> tuple[str, str] | None:
    """(group, filter) of an MQTT filter: group "" for a plain one; None for a malformed
    ``$share/`` filter (no name, or no filter after it)."""
    if not topic_filter.startswith("$share/"):
        return "", topic_filter
    name, sep, rest = topic_filter[7:].partition("/")
    if not sep or not name or not rest or "+" in name or "#" in name:
        return None
    if group_problem(name) or name.startswith(SESSION_GROUPS):
        # also a name in the sessions' own groups' space: a share must not join (and
        # drain) a persistent session's group, ``group_name``
        name = "share." + _digest(name)
    return name, rest


def subs_key(client_id: str) -> bytes:
    return SUBS_PREFIX + client_id.encode("utf-8")


def qos2_key(client_id: str) -> bytes:
    return QOS2_PREFIX + client_id.encode("utf-8")


def block_key(prefix: bytes, client_id: str, block: int) -> bytes:
    """The key of the record of a client's packet ids ``64 * block`` .. ``64 * block + 63``
    (``block_of``) of one set: ``QOS2_BLOCK_PREFIX`` or ``PUBREL_BLOCK_PREFIX``."""
    return b"%s%d/%s" % (prefix, block, client_id.encode("utf-8"))


def qos2_block_key(client_id: str, block: int) -> bytes:
    return block_key(QOS2_BLOCK_PREFIX, client_id, block)


def block_of(packet_id: int) -> int:
    return packet_id // BLOCK_IDS


def pubrel_key(client_id: str) -> bytes:
    return PUBREL_PREFIX + client_id.encode("utf-8")


def owner_key(client_id: str) -> bytes:
    return OWNER_PREFIX + client_id.encode("utf-8")


def client_of(key: bytes) -> str:
    return key[len(SUBS_PREFIX):].decode("utf-8", "replace")


def stored_subs(subs: dict[str, int], offline_since_ms: int = 0) -> bytes:
    parts = [_HEAD.pack(1, offline_since_ms, len(subs))]
    for topic_filter, qos in subs.items():
        name = topic_filter.encode("utf-8")
        parts.append(_SUB.pack(qos, len(name)))
        parts.append(name)
    return b"".join(parts)


def parse_subs(body: bytes) -> tuple[dict[str, int], int]:
    """(filter -> qos, offline_since_ms) of ``stored_subs``; ValueError when damaged."""
    try:
        version, offline, count = _HEAD.unpack_from(body)
        if version != 1:
            raise ValueError(f"unknown session record version {version}")
        subs: dict[str, int] = {}
        pos = _HEAD.size
        for _ in range(count):
            qos, n = _SUB.unpack_from(body, pos)
            pos += _SUB.size
            name = body[pos:pos + n]
            if len(name) != n or qos > 2:
                raise ValueError("session record ends early")
            subs[name.decode("utf-8")] = qos
            pos += n
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"damaged session record: {exc}") from None
    return subs, offline


def stored_ids(ids: set[int]) -> bytes:
    return _U16.pack(len(ids)) + b"".join(_U16.pack(i) for i in sorted(ids))


def parse_ids(body: bytes) -> set[int]:
    try:
        (count,) = _U16.unpack_from(body)
        return {_U16.unpack_from(body, 2 + 2 * i)[0] for i in range(count)}
    except struct.error as exc:
        raise ValueError(f"damaged session record: {exc}") from None


def stored_block(ids: set[int], block: int) -> bytes:
    """The value of ``block``'s record: which of its 64 packet ids ``ids`` holds (b"": none,
    the record is deleted)."""
    first = block * BLOCK_IDS
    bits = 0
    for i in range(BLOCK_IDS):
        if first + i in ids:
            bits |= 1 << i
    return _BITS.pack(bits) if bits else b""


def parse_block(key: bytes, value: bytes) -> tuple[str, set[int]]:
    """(client id, packet ids) of a ``block_key`` record; ValueError when damaged."""
    number, sep, client = key[len(QOS2_BLOCK_PREFIX):].partition(b"/")  # either prefix
    if not sep or not number.isdigit() or int(number) >= _BLOCKS or len(value) != _BITS.size:
        raise ValueError("damaged session record: not a block of packet ids")
    first = int(number) * BLOCK_IDS
    (bits,) = _BITS.unpack(value)
    return client.decode("utf-8", "replace"), {first + i for i in range(BLOCK_IDS)
                                               if bits >> i & 1}
