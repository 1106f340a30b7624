"""How ``blipmq sub`` writes deliveries to stdout.

A named format (``--format lines|raw|hex|base64|json``), ``-v`` (topic, a space, the
payload, as ``mosquitto_sub -v``) or a template: ``--format '{topic} {offset} {payload}'``
or mosquitto's ``-F '%t %p'``. Every form but ``raw`` ends each message with a newline;
``raw`` writes the exact bytes and nothing else, for binary payloads.

base64 and json are imported by the formats that use them, not at start-up: every client
command imports this module, and a one-shot ``blipmq pub`` should not pay for them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

from blipmq_server.protocol.codec import Delivery

FORMATS = ("lines", "raw", "hex", "base64", "json")
Writer = Callable[[Sequence[Delivery]], bytes]


def _raw(batch: Sequence[Delivery]) -> bytes:
    return b"".join(d.payload for d in batch)


def _lines(batch: Sequence[Delivery]) -> bytes:
    return b"".join([d.payload + b"\n" for d in batch])


def _verbose(batch: Sequence[Delivery]) -> bytes:
    return b"".join([d.topic.encode() + b" " + d.payload + b"\n" for d in batch])


def _hex(batch: Sequence[Delivery]) -> bytes:
    return "".join(d.payload.hex() + "\n" for d in batch).encode()


def _base64(batch: Sequence[Delivery]) -> bytes:
    import base64

    return b"".join(base64.b64encode(d.payload) + b"\n" for d in batch)


def text_or_base64(data: bytes) -> tuple[str, str]:
    """(text, "utf-8") when ``data`` is UTF-8, else (its base64, "base64")."""
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        import base64

        return base64.b64encode(data).decode(), "base64"


def json_record(d: Delivery) -> dict[str, object]:
    """One delivery as the JSON object ``--format json`` prints (fields in README.md)."""
    payload, encoding = text_or_base64(d.payload)
    record: dict[str, object] = {
        "topic": d.topic,
        "offset": d.offset,
        "timestamp_ms": d.timestamp_ms,
        "delivery_count": d.delivery_count,
        "qos": d.qos,
        "ttl_ms": d.ttl_ms,
        "key": None,
        "payload": payload,
        "encoding": encoding,
    }
    if d.key is not None:
        record["key"], key_encoding = text_or_base64(d.key)
        if key_encoding != "utf-8":
            record["key_encoding"] = key_encoding
    if d.retained:
        record["retained"] = True
    if d.dead is not None:
        record["dead_letter"] = {"deliveries": d.dead.deliveries, "reason": d.dead.reason}
    return record


def _json(batch: Sequence[Delivery]) -> bytes:
    import json

    from blipmq_cli.literal import json_visible

    # C1 controls and bidi overrides in a topic or payload as \u escapes (the same values):
    # raw, a terminal the output reaches would act on them (JSON escapes C0 itself)
    return json_visible("".join(
        json.dumps(json_record(d), ensure_ascii=False) + "\n" for d in batch)).encode()


# ------------------------------------------------------------------------------- templates

def _iso(ms: int) -> bytes:
    """ISO 8601 in UTC with milliseconds: 2026-11-23T10:00:00.123Z."""
    import time

    seconds, rest = divmod(ms, 1000)
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rest:03d}Z").encode()


# the fields of a template, by both spellings: {name} and mosquitto's %letter
_FIELDS: dict[str, Callable[[Delivery], bytes]] = {
    "topic": lambda d: d.topic.encode(),
    "payload": lambda d: d.payload,
    "offset": lambda d: b"%d" % d.offset,
    "qos": lambda d: b"%d" % d.qos,
    "size": lambda d: b"%d" % len(d.payload),
    "key": lambda d: d.key or b"",
    "delivery_count": lambda d: b"%d" % d.delivery_count,
    "ttl_ms": lambda d: b"%d" % d.ttl_ms,
    "hex": lambda d: d.payload.hex().encode(),
    "timestamp": lambda d: _iso(d.timestamp_ms),
    "timestamp_ms": lambda d: b"%d" % d.timestamp_ms,
}
_PERCENT = {"t": "topic", "p": "payload", "o": "offset", "q": "qos", "l": "size", "k": "key",
            "c": "delivery_count", "x": "hex", "I": "timestamp"}
_PART = re.compile(r"\{(\w+)\}|%(.)|\{\{|\}\}|\\(.)")
_ESCAPES = {"n": b"\n", "t": b"\t", "\\": b"\\", "0": b"\0"}


class TemplateError(ValueError):
    pass


def _literal(text: str) -> bytes:
    """A template's own text as bytes: what the argument held, bytes that are not UTF-8
    included (as the shell passed them)."""
    try:
        return os.fsencode(text)
    except UnicodeEncodeError:
        raise TemplateError(f"the format {text!r} is not valid text") from None


def template(text: str) -> Writer:
    """A writer for ``{field}`` / ``%x`` templates; each message ends with a newline.
    Raises TemplateError naming an unknown field."""
    parts: list[bytes | Callable[[Delivery], bytes]] = []
    at = 0
    for m in _PART.finditer(text):
        parts.append(_literal(text[at : m.start()]))
        at = m.end()
        name, letter, escape = m.group(1), m.group(2), m.group(3)
        if name is not None:
            if name not in _FIELDS:
                raise TemplateError(f"unknown field {{{name}}} in the format (fields: "
                                    f"{', '.join(_FIELDS)})")
            parts.append(_FIELDS[name])
        elif letter is not None:
            if letter == "%":
                parts.append(b"%")
            elif letter in _PERCENT:
                parts.append(_FIELDS[_PERCENT[letter]])
            else:
                raise TemplateError(f"unknown field %{letter} in the format (fields: "
                                    + ", ".join(f"%{k}" for k in _PERCENT) + ", %%)")
        elif escape is not None:
            parts.append(_ESCAPES.get(escape, b"\\" + escape.encode()))
        else:
            parts.append(m.group(0)[0].encode())  # {{ or }}
    parts.append(_literal(text[at:]))
    pieces = [p for p in parts if p != b""]

    def write(batch: Sequence[Delivery]) -> bytes:
        return b"".join([b"".join([p if isinstance(p, bytes) else p(d) for p in pieces]) + b"\n"
                         for d in batch])

    return write


WRITERS: dict[str, Writer] = {
    "raw": _raw,
    "lines": _lines,
    "hex": _hex,
    "base64": _base64,
    "json": _json,
}


def writer(fmt: str | None, verbose: bool = False, raw: bool = False) -> Writer:
    """The writer for ``--format``/``-F`` (a name or a template), ``-v`` and ``-N``.
    Raises TemplateError for a bad template or a clash of options."""
    if sum((fmt is not None, verbose, raw)) > 1:
        raise TemplateError("give one of --format/-F, -v and -N/--raw")
    if raw:
        return _raw
    if verbose:
        return _verbose
    if fmt is None:
        return _lines
    if fmt in WRITERS:
        return WRITERS[fmt]
    if "{" in fmt or "%" in fmt:
        return template(fmt)
    raise TemplateError(f"--format {fmt!r}: give {', '.join(FORMATS)} or a template such as "
                        "'{topic} {payload}'")
