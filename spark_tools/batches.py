"""A checked segment -> Arrow record batches, the rows of the ``blipmq-wal`` source.

The log's own code finds and validates the records (``wal.reader.check``: lengths, CRC-32C,
kinds, increasing offsets, damage skipped). The fixed-width fields are then read for all
records of a batch at once, with numpy, at the places the log's ``struct`` formats declare
(``record.PREFIX`` + ``record.FIXED`` + ``message.MSG_HEAD``, turned into one numpy
dtype here, so the layout is still stated once). Topics, keys and payloads are copied out
of the segment buffer by Arrow's ``take`` over a binary array that views the whole buffer.
GROUP, ACK and dead-letter bodies are rare and go through their Python readers
(``broker.durable``, ``message.dead_of``). Damage becomes rows of kind ``damage`` (where,
how many bytes, why), so that it reaches the report through the data itself.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from blipmq_server.broker import durable
from blipmq_server.errors import ProtocolError, WalError
from blipmq_server.kinds import Kind
from blipmq_server.protocol import message as msg
from blipmq_server.wal import reader
from blipmq_server.wal import record as rec

BATCH_ROWS = 65_536

SCHEMA = pa.schema([
    ("device", pa.string()),
    ("segment", pa.string()),
    ("position", pa.int64()),  # byte position of the record (or of the damage) in the segment
    ("offset", pa.int64()),
    ("timestamp", pa.timestamp("us", tz="UTC")),
    ("kind", pa.string()),  # message | group | ack | retained | state | damage
    ("topic", pa.string()),  # a group's topic filter for GROUP records
    ("qos", pa.int8()),
    ("ttl_ms", pa.int64()),
    ("key", pa.binary()),
    ("payload", pa.binary()),
    ("payload_size", pa.int64()),  # damage: bytes skipped
    ("dead_deliveries", pa.int32()),
    ("dead_reason", pa.string()),
    ("group_name", pa.string()),
    ("group_op", pa.string()),  # create | delete | idle | checkpoint
    ("group_id", pa.int64()),  # CREATE, CHECKPOINT, ACK: the group's id (its create offset)
    ("group_start", pa.int64()),  # CREATE and CHECKPOINT: the next offset the group reads
    ("ack_floor", pa.int64()),
    ("acked", pa.list_(pa.int64())),  # ACK: offsets acked; CHECKPOINT: acked above start
    ("problem", pa.string()),  # damage: why
])

# one numpy dtype for a record's head and a message's head, from the log's struct formats
_CODES = {"B": "u1", "H": ">u2", "I": ">u4", "Q": ">u8"}


def _dtype(fields: list[tuple[str, struct.Struct]]) -> np.dtype:
    names, formats = [], []
    for prefix, st in fields:
        for i, code in enumerate(st.format.lstrip("<>!=")):
            names.append(f"{prefix}{i}")
            formats.append(_CODES[code])
    return np.dtype({"names": names, "formats": formats})


_HEAD = _dtype([("p", rec.PREFIX), ("f", rec.FIXED), ("m", msg.MSG_HEAD)])
_HEAD_SIZE = _HEAD.itemsize  # 38: the record head and the message head
assert _HEAD_SIZE == rec.RECORD_OVERHEAD + msg.HEAD_SIZE
_BODY = rec.RECORD_OVERHEAD
_MESSAGE, _GROUP, _ACK = int(Kind.MESSAGE), int(Kind.GROUP), int(Kind.ACK)
_OPS = {durable.CREATE: "create", durable.DELETE: "delete", durable.IDLE: "idle",
        durable.CHECKPOINT: "checkpoint"}
_KIND_NAMES = pa.array(["", "message", "group", "ack", "retained", "state"])


def segment_batches(data: bytes, checked: reader.Checked, device: str, segment: str,
                    rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The records of one checked segment (and its damage), ``rows`` at most per batch."""
    buf = np.frombuffer(data, dtype=np.uint8)
    whole = pa.py_buffer(data)
    positions = np.fromiter((p for _, p in checked.records), dtype=np.int64,
                            count=len(checked.records))
    for at in range(0, len(positions), rows):
        yield _batch(data, buf, whole, positions[at:at + rows], device, segment)
    if checked.damage:
        yield damage_batch(checked.damage, device, segment)


def _batch(data: bytes, buf: np.ndarray, whole: pa.Buffer, pos: np.ndarray, device: str,
           segment: str) -> pa.RecordBatch:
    n = len(pos)
    last = len(buf) - 1
    idx = np.minimum(pos[:, None] + np.arange(_HEAD_SIZE), last)  # a short record's tail
    head = buf[idx].view(_HEAD).ravel()  # is garbage and never read: only MESSAGEs are
    kind = head["f0"].astype(np.int64)
    is_msg = kind == _MESSAGE
    flags = head["m0"]
    tlen = head["m2"].astype(np.int64)
    klen = head["m3"].astype(np.int64)
    plen = head["m4"].astype(np.int64)
    tlen[~is_msg] = 0
    klen[~is_msg] = 0
    plen[~is_msg] = 0
    topic_at = pos + _HEAD_SIZE
    key_at = topic_at + tlen
    payload_at = key_at + klen
    # ``check`` refuses a MESSAGE whose lengths run past it (record.body_problem); slicing
    # the whole buffer past a record would read memory beyond it, so say so, never do it
    record_end = pos + 4 + head["p0"].astype(np.int64)
    if np.any(is_msg & ((payload_at + plen > record_end) | (record_end > len(buf)))):
        raise WalError(f"{segment}: a MESSAGE record's lengths run past it (not checked)")
    has_key = is_msg & ((flags & msg.FLAG_KEY) != 0)
    not_msg = pa.array(~is_msg)
    topic = _cut(whole, topic_at, tlen, not_msg)
    payload = _cut(whole, payload_at, plen, not_msg)
    key = _cut(whole, key_at, klen, pa.array(~has_key))
    kinds = _KIND_NAMES.take(pa.array(np.where((kind >= 1) & (kind <= 5), kind, 0)))
    dead_n: list[int | None] = [None] * n
    dead_why: list[str | None] = [None] * n
    for i in np.flatnonzero(is_msg & ((flags & msg.FLAG_DEAD) != 0)):
        body = rec.decode_at(data, int(pos[i]))[0].body
        try:
            dead = msg.dead_of(body)
        except (struct.error, ProtocolError):  # a trailer cut short: still a message
            dead = None
        if dead is not None:
            dead_n[i], dead_why[i] = dead.deliveries, dead.reason
    groups = _groups(data, pos, kind, head["f1"])
    topic = topic.cast(pa.string()) if _utf8(topic) else _decode(topic)
    if groups["filter"].null_count != n:  # GROUP records name their filter in the topic
        topic = pc.coalesce(groups["filter"], topic)
    values = {
        "device": pa.repeat(pa.scalar(device, pa.string()), n),
        "segment": pa.repeat(pa.scalar(segment, pa.string()), n),
        "position": pa.array(pos),
        "offset": pa.array(head["f1"].astype(np.int64)),
        "timestamp": pa.array(head["f2"].astype(np.int64) * 1000, pa.timestamp("us", tz="UTC")),
        "kind": kinds,
        "topic": topic,
        "qos": pa.array((flags & msg.FLAG_QOS1).astype(np.int8), mask=~is_msg),
        "ttl_ms": pa.array(head["m1"].astype(np.int64), mask=~is_msg),
        "key": key,
        "payload": payload,
        "payload_size": pa.array(plen, mask=~is_msg),
        "dead_deliveries": pa.array(dead_n, pa.int32()),
        "dead_reason": pa.array(dead_why, pa.string()),
        "problem": pa.nulls(n, pa.string()),
    } | groups
    return pa.RecordBatch.from_arrays([values[f.name] for f in SCHEMA], schema=SCHEMA)


def _cut(whole: pa.Buffer, start: np.ndarray, length: np.ndarray, null: pa.Array) -> pa.Array:
    """Binary values ``whole[start:start+length]``: a view of the whole buffer whose even
    values are the wanted slices and odd ones the bytes between, then ``take`` of the even
    ones (one copy, in C)."""
    n = len(start)
    if n == 0:
        return pa.array([], pa.binary())
    bounds = np.empty(2 * n, dtype=np.int64)
    bounds[0::2] = start
    bounds[1::2] = start + length
    view = pa.Array.from_buffers(pa.large_binary(), 2 * n - 1,
                                 [None, pa.py_buffer(bounds), whole])
    picked = view.take(pa.array(np.arange(0, 2 * n, 2))).cast(pa.binary())
    if null.true_count:
        picked = pc.if_else(null, pa.scalar(None, pa.binary()), picked)
    return picked


def _utf8(values: pa.Array) -> bool:
    try:
        values.cast(pa.string())
        return True
    except pa.ArrowInvalid:
        return False


def _decode(values: pa.Array) -> pa.Array:
    return pa.array([None if v is None else v.decode("utf-8", "replace")
                     for v in values.to_pylist()], pa.string())


def _groups(data: bytes, pos: np.ndarray, kind: np.ndarray, offsets: np.ndarray
            ) -> dict[str, pa.Array]:
    """The group columns, and the filter of GROUP records (for the topic column), decoded
    by the broker's own readers. A group's id is its create record's offset: a create row
    carries it; delete and idle rows name the group by filter and name only (they apply to
    the instance of that name live then, ``analytics.instances``)."""
    n = len(pos)
    others = np.flatnonzero((kind == _GROUP) | (kind == _ACK))
    name: list[str | None] = [None] * n
    op: list[str | None] = [None] * n
    gid: list[int | None] = [None] * n
    start: list[int | None] = [None] * n
    floor: list[int | None] = [None] * n
    acked: list[list[int] | None] = [None] * n
    filt: list[str | None] = [None] * n
    for i in others:
        body = rec.decode_at(data, int(pos[i]))[0].body
        try:
            if kind[i] == _GROUP:
                g = durable.parse_group(body)
                name[i], op[i], filt[i] = g.group, _OPS.get(g.op, str(g.op)), g.topic_filter
                start[i] = g.start if g.op in (durable.CREATE, durable.CHECKPOINT) else None
                if g.op == durable.CHECKPOINT:
                    gid[i], acked[i] = g.group_id, list(g.acked)
                elif g.op == durable.CREATE:
                    gid[i] = int(offsets[i])
            else:
                gid[i], floor[i], ack_offsets = durable.parse_ack(body)
                acked[i] = list(ack_offsets)
        except (struct.error, UnicodeDecodeError):
            continue  # valid CRC, unreadable body: the row keeps its kind and offset
    return {"group_name": pa.array(name, pa.string()), "group_op": pa.array(op, pa.string()),
            "group_id": pa.array(gid, pa.int64()), "group_start": pa.array(start, pa.int64()),
            "ack_floor": pa.array(floor, pa.int64()),
            "acked": pa.array(acked, pa.list_(pa.int64())), "filter": pa.array(filt, pa.string())}


def damage_batch(damage: tuple[reader.Damage, ...], device: str, segment: str
                 ) -> pa.RecordBatch:
    n = len(damage)
    values = {f.name: pa.nulls(n, f.type) for f in SCHEMA}
    values |= {"device": pa.array([device] * n, pa.string()),
               "segment": pa.array([segment] * n, pa.string()),
               "position": pa.array([d.start for d in damage], pa.int64()),
               "kind": pa.array(["damage"] * n, pa.string()),
               "payload_size": pa.array([d.end - d.start for d in damage], pa.int64()),
               "problem": pa.array([d.problem for d in damage], pa.string())}
    return pa.RecordBatch.from_arrays([values[f.name] for f in SCHEMA], schema=SCHEMA)
