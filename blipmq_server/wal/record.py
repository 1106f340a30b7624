"""The write-ahead log's record format (docs/WAL.md): one source of truth for every reader.

A segment file is a 16-byte header followed by records::

    header:  | magic "BLPWAL" (6) | version u16 | base_offset u64 |
    record:  | length u32 | crc32c u32 | kind u8 | offset u64 | timestamp_ms u64 | body |

``length`` counts the bytes after itself (21 + body). ``crc32c`` covers kind through body.
A MESSAGE body is the message's wire record from ``protocol.codec`` (flags, ttl, lengths,
topic, key, payload), so the broker stores what it received without re-encoding it.
Integers are big-endian. Standard library and ``crc32c`` only; no trio.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

from blipmq_server.kinds import Kind


def _load_crc32c() -> Callable[..., int]:
    """The ``crc32c`` package's compiled checksum function.

    The package's ``__init__`` also imports ``importlib.metadata`` (for its version) and its
    command line, which bring in email, zipfile, csv, tempfile and more: about 4 MB of a
    broker that idles at 25. So the compiled module is loaded on its own when it sits where
    the package's files are; anything unexpected (a frozen build, another layout) imports
    the package as usual.
    """
    try:
        import importlib.machinery
        import importlib.util
        import os

        name = "crc32c._crc32c"
        if name not in sys.modules:
            spec = importlib.util.find_spec("crc32c")  # finds the package, runs nothing
            for folder in (spec.submodule_search_locations or []) if spec else []:
                for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                    path = os.path.join(folder, "_crc32c" + suffix)
                    if os.path.isfile(path):
                        loader = importlib.machinery.ExtensionFileLoader(name, path)
                        own = importlib.util.spec_from_file_location(name, path, loader=loader)
                        module = importlib.util.module_from_spec(own)  # type: ignore[arg-type]
                        loader.exec_module(module)
                        sys.modules[name] = module  # ``import crc32c`` later reuses it
                        break
                if name in sys.modules:
                    break
        return sys.modules[name].crc32c  # type: ignore[no-any-return]
    except (ImportError, OSError, KeyError, AttributeError):
        from crc32c import crc32c as function

        return function


crc32c = _load_crc32c()

MAGIC = b"BLPWAL"
FORMAT_VERSION = 1
HEADER = struct.Struct(">6sHQ")  # magic, version, base offset
HEADER_SIZE = HEADER.size  # 16
PREFIX = struct.Struct(">II")  # length, crc32c
FIXED = struct.Struct(">BQQ")  # kind, offset, timestamp_ms
RECORD_OVERHEAD = PREFIX.size + FIXED.size  # 25
MIN_LENGTH = 4 + FIXED.size  # crc + fixed fields: 21
MSG_HEAD = struct.Struct(">BIHHI")  # a MESSAGE body's head (protocol.message.MSG_HEAD)
MSG_HEAD_SIZE = MSG_HEAD.size  # 13
MAX_TIMESTAMP_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: no reader goes further


class Record(NamedTuple):
    kind: int
    offset: int
    timestamp_ms: int
    body: bytes


def encode(kind: int, offset: int, timestamp_ms: int, body: bytes) -> bytes:
    covered = _pack_fixed(kind, offset, timestamp_ms) + body  # what the CRC covers
    return _pack_prefix(len(covered) + 4, crc32c(covered)) + covered


def encode_many(kind: int, first_offset: int, timestamp_ms: int, bodies: Iterable[bytes]
                ) -> list[bytes]:
    """``encode`` for records with consecutive offsets (one call per broker batch)."""
    fixed, prefix, join = _pack_fixed, _pack_prefix, b"".join
    size = FIXED.size + 4
    out: list[bytes] = []
    append = out.append
    for offset, body in enumerate(bodies, first_offset):
        head = fixed(kind, offset, timestamp_ms)
        if len(body) < _ONE_CALL:
            # a small record: one CRC call over a copy of what it covers costs less than a
            # second call (about 120 ns less for 100 B)
            covered = head + body
            append(prefix(size + len(body), crc32c(covered)) + covered)
        else:  # a large one: the CRC runs on over the body, which is copied once
            append(join((prefix(size + len(body), crc32c(body, crc32c(head))), head, body)))
    return out


_ONE_CALL = 2048  # bodies below this many bytes: ``encode_many`` checksums a copy


_pack_fixed = FIXED.pack
_pack_prefix = PREFIX.pack


def header(base_offset: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, base_offset)


class Scan(NamedTuple):
    """What a pass over one segment's bytes found.

    ``good_end`` is the byte position just after the last whole, valid record. ``problem``
    is None for a clean segment, else why scanning stopped at ``good_end`` and whether it
    looks like a torn write (``torn``: the bytes end inside a record) or corruption.
    """

    records: list[tuple[int, int]]  # (offset, position) of every valid record
    good_end: int
    problem: str | None
    torn: bool
    others: list[int]  # positions of the records that are not MESSAGE (or flagged, below)


def scan(data: bytes | memoryview, start: int = HEADER_SIZE, last_offset: int = -1,
         message_flags: int = 0, bodies: bool = False) -> Scan:
    """Validate records from ``start``; stops at the first damage. Never raises on bad bytes.

    ``bodies``: also refuse a record ``body_problem`` finds unreadable (a MESSAGE whose
    inner lengths run past it, a timestamp past the year 9999). The broker's recovery and
    every outside reader ask for it; the log's own tests store opaque bodies.

    ``others`` lists the records that are not MESSAGE, and the MESSAGE records whose body's
    first byte (the message flags) has any bit of ``message_flags`` set.
    """
    size = len(data)
    pos = start
    out: list[tuple[int, int]] = []
    others: list[int] = []
    unpack_prefix = PREFIX.unpack_from
    unpack_fixed = FIXED.unpack_from
    unpack_msg = MSG_HEAD.unpack_from
    max_ts, message, min_message = MAX_TIMESTAMP_MS, _MESSAGE, _MIN_MESSAGE
    plain = bytes.isascii if data.__class__ is bytes else _never  # a topic's, without a call
    while pos < size:
        if size - pos < PREFIX.size + FIXED.size:
            problem = f"{size - pos} trailing bytes, less than a record header"
            return Scan(out, pos, problem, True, others)
        length, crc = unpack_prefix(data, pos)
        end = pos + 4 + length
        if length < MIN_LENGTH:
            return Scan(out, pos, f"record length {length} is below the minimum", False, others)
        if end > size:
            problem = f"record of {length} bytes is cut off after {size - pos}"
            return Scan(out, pos, problem, True, others)
        if crc32c(data[pos + 8 : end]) != crc:
            return Scan(out, pos, "CRC mismatch", end == size, others)
        kind, offset, ts = unpack_fixed(data, pos + 8)
        if kind not in _KINDS:
            return Scan(out, pos, f"unknown record kind {kind}", False, others)
        if offset <= last_offset:
            return Scan(out, pos, f"offset {offset} does not follow {last_offset}", False, others)
        if bodies and (ts > max_ts or (kind == message and (
                length < min_message or (h := unpack_msg(data, pos + RECORD_OVERHEAD))[2]
                + h[3] + h[4] > length - min_message
                or not (plain(data[(t := pos + _TOPIC_AT) : t + h[2]])
                        or _text(data, t, h[2]))))):  # inline: recovery's hot loop
            bad = body_problem(data, pos, end)
            return Scan(out, pos, f"{_NAMES.get(kind, kind)} record {offset} cannot be read "
                                  f"({bad})", False, others)
        out.append((offset, pos))
        if kind != _MESSAGE:
            others.append(pos)
        elif message_flags and end > pos + RECORD_OVERHEAD and (
                data[pos + RECORD_OVERHEAD] & message_flags):
            others.append(pos)
        last_offset = offset
        pos = end
    return Scan(out, pos, None, False, others)


def body_problem(data: bytes | memoryview, pos: int, end: int) -> str | None:
    """Why the record at ``pos`` (ending at ``end``, its CRC checked) cannot be read, or None:
    a timestamp no reader can show (past year 9999), a MESSAGE body whose head or inner
    lengths (topic, key, payload) run past the record, or whose topic is not UTF-8. Every
    reader relies on this: the Spark decoder slices the segment buffer with these lengths,
    the broker delivers them (a topic no client can take would come back to a durable
    group's consumer on every reconnect)."""
    kind, _, ts = FIXED.unpack_from(data, pos + 8)
    if ts > MAX_TIMESTAMP_MS:
        return f"timestamp {ts} ms is past the year 9999"
    if kind != _MESSAGE:
        return None
    body = pos + RECORD_OVERHEAD
    if end - body < MSG_HEAD_SIZE:
        return f"its body of {end - body} bytes is shorter than a message head"
    _, _, tlen, klen, plen = MSG_HEAD.unpack_from(data, body)
    need = MSG_HEAD_SIZE + tlen + klen + plen
    if need > end - body:
        return (f"its topic, key and payload lengths ({tlen}, {klen}, {plen}) run past its "
                f"body of {end - body} bytes")
    if not _text(data, body + MSG_HEAD_SIZE, tlen):
        return "its topic is not UTF-8"  # no client could be given it, nor Spark a string
    return None


def _never(_: object) -> bool:
    return False


def _text(data: bytes | memoryview, at: int, n: int) -> bool:
    """Whether the ``n`` bytes at ``at`` are UTF-8 (ASCII without a decode, for bytes)."""
    part = data[at : at + n]
    if part.__class__ is bytes and part.isascii():  # type: ignore[union-attr]
        return True
    try:
        str(part, "utf-8")
    except UnicodeDecodeError:
        return False
    return True


_KINDS = frozenset(int(k) for k in Kind)
_MIN_MESSAGE = MIN_LENGTH + MSG_HEAD_SIZE  # the length of a MESSAGE record with empty fields
_NAMES = {int(k): k.name for k in Kind}
_MESSAGE = int(Kind.MESSAGE)  # a plain int: an enum member costs a lookup per record
_TOPIC_AT = RECORD_OVERHEAD + MSG_HEAD_SIZE  # a MESSAGE record's topic, from its start
_KIND_BYTE = re.compile(b"[" + bytes(sorted(_KINDS)) + b"]")


def resync(data: bytes, at: int, last_offset: int, below: int | None = None,
           end: int | None = None, bodies: bool = False) -> int | None:
    """Where the first whole, valid record after the damaged record at ``at`` begins, or
    None.

    The damaged record's end is found by its own framing, and nothing inside it is
    looked at: a message's payload may hold a whole, valid record (a client published
    one, or a segment file), which must not be taken for the log's. In turn: where its
    length says it ends, when a valid record starts there (the damage was in its payload,
    its CRC or its fixed fields) and that place is not inside a whole record of the log
    that starts after it (``_across``: its length and its CRC were both damaged); where
    its stored CRC holds (its length alone was damaged: ``_crc_end``), the end of the data
    included; a length past the end under a head that reads as a record's own is a record
    cut short (None: all of it is damage); more damage where its CRC, else its length,
    ends it is followed to the next record, the same way (up to ``_CHAIN``). A length
    that lands inside a whole record of the log, or is no record's (a zeroed, erased or
    overwritten block), ends the chain: the bytes after its start (after that whole
    record) are searched for the next valid record (``_next_valid``), which is never one
    inside a whole record of the log either. Never raises on bad bytes.
    """
    size = len(data) if end is None else min(end, len(data))
    if at < HEADER_SIZE:  # the segment header is damaged: the first record may be too
        if valid_at(data, HEADER_SIZE, last_offset, below, bodies, size):
            return HEADER_SIZE
        at = HEADER_SIZE
    pos, start = at, at + 1
    for _ in range(_CHAIN):  # damaged records one after another, each by its own framing
        if size - pos < PREFIX.size:
            return None
        length = PREFIX.unpack_from(data, pos)[0]
        after = pos + 4 + length
        framed = length >= MIN_LENGTH and after <= size
        across = None  # the end of a whole record of the log ``after`` lies inside, if any
        if framed and after < size and valid_at(data, after, last_offset, below, bodies, size):
            across = _across(data, pos, after, last_offset, size)
            if across is None:
                return after
        found = _crc_end(data, pos, size)  # its length alone damaged: its CRC says its end
        if found is not None:
            if found == size:
                return None  # it ends the data: nothing after it to keep
            if valid_at(data, found, last_offset, below, bodies, size):
                return found
            pos = start = found  # the damage runs on into the record there
            continue
        if framed and after == size:
            return None  # it ends the data: nothing after it to keep
        if not framed:
            if after > size and _plausible_head(data, pos, last_offset):
                # cut short (a torn write, a truncated file): a record's own head, so what
                # its bytes hold is its payload, never taken for records (or its length
                # damaged along with something else: nothing tells its end from its
                # payload). A head that is no record's (an erased or overwritten block)
                # is searched past.
                return None
            break
        if across is None:
            across = _across(data, pos, after, last_offset, size)
        if across is not None:
            # its length lands inside a whole record that starts after it (its length and
            # its CRC damaged): that record may be the next one (its length too long) or
            # one inside its own payload (too short); what is inside it is payload either
            # way, so the search starts after it
            start = across
            break
        pos = start = after  # the damage runs on into the next record: not inside this one
    return _next_valid(data, max(start, HEADER_SIZE), last_offset, below, size, bodies)


_CHAIN = 16  # damaged records ``resync`` follows by their own lengths before it searches
_CRC_REACH = 1 << 24  # how far ``_crc_end`` looks for a record's end, bytes
_CRC_TRIES = 1 << 16  # ... and at how many places at most (payload bytes can make each one)
_NEAR = 1 << 20  # a record's offset this far past the last good one is plausible


def _plausible_head(data: bytes, pos: int, last_offset: int) -> bool:
    """Whether the fixed fields at ``pos`` read as a record's own: a known kind and an
    offset after ``last_offset``, not far past it."""
    if len(data) - pos < RECORD_OVERHEAD:
        return False
    kind, offset, _ = FIXED.unpack_from(data, pos + 8)
    return kind in _KINDS and last_offset < offset <= last_offset + _NEAR


def _near_heads(last_offset: int) -> re.Pattern[bytes]:
    """A known kind byte followed by the top five bytes of an offset within ``_NEAR`` of
    ``last_offset``: where the fixed fields of a record of this log near here may be. The
    regular expression skips every other byte in C."""
    low = max(last_offset - _NEAR, 0) >> 24
    high = min(last_offset + _NEAR, (1 << 64) - 1) >> 24  # at most low + 1
    tops = b"|".join(re.escape(top.to_bytes(5, "big")) for top in sorted({low, high}))
    return re.compile(_KIND_BYTE.pattern + b"(?:" + tops + b")")


def _whole_end(data: bytes, pos: int, last_offset: int, size: int) -> int | None:
    """The end of the record at ``pos`` if it reads as one of this log's, in order or
    not: a length that fits before ``size``, a known kind, an offset within ``_NEAR`` of
    ``last_offset``, a matching CRC, and after it the end of the data or a known kind byte
    8 bytes on, where a record could start. (A record inside a payload whose CRC was made
    to run on over the next record's length field, which its sender can tell, ends at
    most 4 bytes into that record: 8 bytes on is a byte of that record's offset, 0 below
    2**32.) None otherwise."""
    if size - pos < RECORD_OVERHEAD:
        return None
    length, crc = PREFIX.unpack_from(data, pos)
    stop = pos + 4 + length
    kind, offset, _ = FIXED.unpack_from(data, pos + 8)
    if (length < MIN_LENGTH or stop > size or kind not in _KINDS
            or abs(offset - last_offset) > _NEAR):
        return None
    if stop + 8 < size and data[stop + 8] not in _KINDS:
        return None
    if crc32c(memoryview(data)[pos + 8 : stop]) != crc:
        return None
    return stop


def _across(data: bytes, lo: int, at: int, last_offset: int, size: int) -> int | None:
    """The end of a whole record of the log (``_whole_end``) that starts at or after
    ``lo``, before ``at``, and runs on past ``at`` (the first such one), or None. ``at`` is
    then inside that record, no record's end: a damaged length that lands there is
    damaged too."""
    for match in _near_heads(last_offset).finditer(data, lo + 8, min(size, at + 8 + 6)):
        pos = match.start() - 8
        if pos >= at:
            break
        stop = _whole_end(data, pos, last_offset, size)
        if stop is not None and stop > at:
            return stop
    return None


def _crc_end(data: bytes, pos: int, size: int) -> int | None:
    """Where the record at ``pos`` ends if only its length field is damaged: a position
    after its fixed fields up to which its stored CRC holds. First the 32 places one
    flipped bit of the length points to, whatever lies there (the record after it may be
    damaged too); then the first such position where a record could start (a known kind
    byte 8 bytes on) or ``size`` is, within ``_CRC_REACH`` bytes and ``_CRC_TRIES``
    places. None when there is none. Each pass takes each byte into the CRC once."""
    if size - pos < RECORD_OVERHEAD:
        return None
    length, crc = PREFIX.unpack_from(data, pos)
    view = memoryview(data)
    done = pos + 8
    running = 0
    for end in sorted({pos + 4 + (length ^ (1 << bit)) for bit in range(32)}):
        if end > size:
            break
        if end >= pos + RECORD_OVERHEAD:
            running = crc32c(view[done:end], running)
            done = end
            if running == crc:
                return end
    reach = min(size, pos + _CRC_REACH)
    done = pos + 8
    running = 0
    tries = 0
    for match in _KIND_BYTE.finditer(data, pos + RECORD_OVERHEAD + 8, reach):
        tries += 1
        if tries > _CRC_TRIES:
            return None
        end = match.start() - 8
        running = crc32c(view[done:end], running)
        done = end
        if running == crc:
            return end
    if reach == size and crc32c(view[done:size], running) == crc:
        return size
    return None


def valid_at(data: bytes, pos: int, last_offset: int, below: int | None = None,
             bodies: bool = False, end: int | None = None) -> bool:
    """Whether a whole, valid record starts at ``pos``: its length fits before ``end``, its
    CRC holds, its kind is known, its offset is above ``last_offset`` (and below
    ``below``), and with ``bodies`` ``body_problem`` finds nothing wrong."""
    size = len(data) if end is None else min(end, len(data))
    if size - pos < RECORD_OVERHEAD:
        return False
    length, crc = PREFIX.unpack_from(data, pos)
    stop = pos + 4 + length
    if length < MIN_LENGTH or stop > size:
        return False
    kind, offset, _ = FIXED.unpack_from(data, pos + 8)
    if kind not in _KINDS or offset <= last_offset or (below is not None and offset >= below):
        return False
    if crc32c(memoryview(data)[pos + 8 : stop]) != crc:
        return False
    return not bodies or body_problem(data, pos, stop) is None


def _next_valid(data: bytes, start: int, last_offset: int, below: int | None, size: int,
                bodies: bool) -> int | None:
    """The first position at or after ``start`` where a whole, valid record begins (as
    ``valid_at`` says), or None. The candidates are the bytes after a known kind byte,
    found by a regular expression, so ordinary payload bytes are skipped in C. A whole
    record of the log met on the way that is not valid here (its offset out of order, its
    body unreadable: ``_whole_end``) is skipped with its payload, never searched."""
    view = memoryview(data)
    unpack_prefix = PREFIX.unpack_from
    unpack_fixed = FIXED.unpack_from
    skip = start  # the end of the last such record met: what is before it is its bytes
    for match in _KIND_BYTE.finditer(data, start + 8, size):
        pos = match.start() - 8
        if pos + RECORD_OVERHEAD > size:
            return None
        if pos < skip:
            continue
        length, crc = unpack_prefix(data, pos)
        if length < MIN_LENGTH or pos + 4 + length > size:
            continue
        _, offset, _ = unpack_fixed(data, pos + 8)
        if offset <= last_offset or (below is not None and offset >= below):
            if abs(offset - last_offset) <= _NEAR:  # a record of the log, out of order?
                skip = _whole_end(data, pos, last_offset, size) or skip
            continue
        if crc32c(view[pos + 8 : pos + 4 + length]) == crc:
            if not bodies or body_problem(data, pos, pos + 4 + length) is None:
                return pos
            skip = _whole_end(data, pos, last_offset, size) or skip
    return None


def ends_in_records(data: bytes, start: int) -> bool:
    """Whether, somewhere at or after ``start``, whole records with matching CRCs and known
    kinds begin that run exactly to the end of ``data``. Damage that runs past the end of
    the newest segment is a torn write only when this is False: else it may be a damaged
    length followed by the log's valid records, which are kept. (A torn record whose
    payload holds records ends inside them, not after one.) Never raises on bad bytes."""
    size = len(data)
    for match in _KIND_BYTE.finditer(data, start + 8):
        pos = match.start() - 8
        if size - pos < RECORD_OVERHEAD:
            return False
        length, _ = PREFIX.unpack_from(data, pos)
        if MIN_LENGTH <= length and pos + 4 + length <= size:
            found = scan(data, pos)
            if found.records and found.problem is None:
                return True
    return False


def offset_bound(data: bytes, start: int, end: int, last_offset: int) -> int:
    """The highest offset the damaged bytes ``data[start:end]`` may hold, as far as can be
    told: as many records as could fit (RECORD_OVERHEAD bytes each at least) numbered on from
    ``last_offset``, or a larger offset read from a plausible record header met by walking
    the damaged bytes' length fields (aborted batches leave gaps in offsets)."""
    count = (end - start) // RECORD_OVERHEAD
    best = last_offset + max(count, 1)
    window = best + (1 << 20)  # a random offset field is far beyond any real one
    pos = start
    while pos + RECORD_OVERHEAD <= end:
        length, _ = PREFIX.unpack_from(data, pos)
        kind, offset, _ = FIXED.unpack_from(data, pos + 8)
        if kind in _KINDS and best < offset <= window:
            best = offset
        if length < MIN_LENGTH:
            break
        pos += 4 + length
    return best


_WHOLE = struct.Struct(PREFIX.format + FIXED.format[1:])  # both at once: the read path's
_new_record = tuple.__new__  # Record(...) without the Python-level __new__ of a NamedTuple


def decode_run(data: bytes, pos: int, out: list[Record], max_records: int, max_bytes: int,
               from_offset: int = 0) -> tuple[int, int]:
    """Records of ``data`` (already validated by ``scan``) from ``pos`` onto ``out``, those
    at ``from_offset`` or later, until ``out`` holds ``max_records`` records or this call
    added ``max_bytes`` bytes of bodies, or the next record does not end within ``data``.
    Returns the position after the last record decoded and the bodies' bytes it added.
    The log's read path (one unpack per record; ``decode_at`` reads one)."""
    unpack = _WHOLE.unpack_from
    limit = len(data) - RECORD_OVERHEAD
    size = 0
    count = len(out)
    append = out.append
    while pos <= limit and count < max_records and size < max_bytes:
        length, _, kind, offset, ts = unpack(data, pos)
        end = pos + 4 + length
        if end > len(data):
            break
        if offset >= from_offset:
            body = data[pos + RECORD_OVERHEAD:end]
            append(_new_record(Record, (kind, offset, ts, body)))
            size += len(body)
            count += 1
        pos = end
    return pos, size


def decode_at(data: bytes | memoryview, pos: int) -> tuple[Record, int]:
    """The record at ``pos`` (already validated by ``scan``) and the position after it."""
    length, _ = PREFIX.unpack_from(data, pos)
    kind, offset, ts = FIXED.unpack_from(data, pos + 8)
    end = pos + 4 + length
    return Record(kind, offset, ts, bytes(data[pos + RECORD_OVERHEAD : end])), end
