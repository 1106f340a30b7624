"""How ``blipmq sub`` writes deliveries to stdout (``--format``).

base64 and json are imported by the formats that use them, not at start-up: every client
command imports this module, and a one-shot ``blipmq pub`` should not pay for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from blipmq_server.protocol.codec import Delivery

FORMATS = ("raw", "lines", "hex", "base64", "json")


def _raw(batch: Sequence[Delivery]) -> bytes:
    return b"".join(d.payload for d in batch)


def _lines(batch: Sequence[Delivery]) -> bytes:
    return b"".join([d.payload + b"\n" for d in batch])


def _hex(batch: Sequence[Delivery]) -> bytes:
    return "".join(d.payload.hex() + "\n" for d in batch).encode()


def _base64(batch: Sequence[Delivery]) -> bytes:
    import base64

    return b"".join(base64.b64encode(d.payload) + b"\n" for d in batch)


def _json_one(d: Delivery) -> str:
    import base64
    import json

    try:
        payload, encoding = d.payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(d.payload).decode(), "base64"
    record: dict[str, object] = {
        "topic": d.topic,
        "offset": d.offset,
        "timestamp_ms": d.timestamp_ms,
        "delivery_count": d.delivery_count,
        "qos": d.qos,
        "ttl_ms": d.ttl_ms,
        "key": base64.b64encode(d.key).decode() if d.key is not None else None,
        "payload": payload,
        "encoding": encoding,
    }
    if d.retained:
        record["retained"] = True
    if d.dead is not None:
        record["dead_letter"] = {"deliveries": d.dead.deliveries, "reason": d.dead.reason}
    return json.dumps(record, ensure_ascii=False)


def _json(batch: Sequence[Delivery]) -> bytes:
    return "".join(_json_one(d) + "\n" for d in batch).encode()


WRITERS: dict[str, Callable[[Sequence[Delivery]], bytes]] = {
    "raw": _raw,
    "lines": _lines,
    "hex": _hex,
    "base64": _base64,
    "json": _json,
}
