"""The body of a STATS_REPORT: the broker's report as JSON, within one frame.

docs/PROTOCOL.md, "Statistics": the report always fits the frame the client decodes with.
Its fixed fields are small and bounded; its lists (``topics``, ``groups``, ``bridges``)
are not, so ``fit`` lists fewer entries when the whole would not fit, each list a prefix
of itself in the order the broker gave it, and says in ``<list>_omitted`` how many of each
it left out. Each entry is encoded once: no JSON of the whole is built to be thrown away.

Standard library only; never imports the core or the shell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from blipmq_server.errors import LocalProtocolError

LISTS = ("topics", "groups", "bridges")  # the lists a report may shorten, in this order
# No entry of any list encodes to fewer bytes: the smallest is a topic's,
# {"topic":"a","messages":0,"bytes":0,"retained":false}
ENTRY_MIN = 53
_WIDEST_COUNT = len(str(2**64))  # an omitted count is written in at most this many digits
_END = object()


# Entries a list gives at most, whatever the frame would hold: ranking and encoding every
# one of 100,000 groups held the event loop 0.7-1.3 s per STATS (/metrics lists them all)
LISTED = 1000


def most(limit: int) -> int:
    """How many entries of one list a report of ``limit`` bytes gives at most: what could
    fit at best, and never more than ``LISTED``; the broker need not rank, nor build, more
    than that of any list."""
    return max(0, min(LISTED, limit // (ENTRY_MIN + 1)))


_ENCODE: list[Callable[[Any], str]] = []  # one encoder, made at the first report


def _json(value: Any) -> bytes:
    # ASCII only (a str's length is its byte length), no spaces
    if not _ENCODE:
        import json  # deferred (blipmq_server/deferred.py): the broker loads it only here

        _ENCODE.append(json.JSONEncoder(separators=(",", ":")).encode)
    return _ENCODE[0](value).encode()


def _member(name: str, value: bytes) -> bytes:
    return _json(name) + b":" + value


def fit(report: Mapping[str, Any], limit: int) -> bytes:
    """``report`` as a JSON object of at most ``limit`` bytes.

    Every field but the lists is kept as it is. The lists take the room left in turn, one
    entry each, so that a long list does not crowd out the others; a list ends at its first
    entry that no longer fits (what is listed is always the first entries, in the report's
    order). ``<list>_omitted`` is the report's own count (entries it did not list at all)
    plus those left out here. Raises LocalProtocolError when the fields without the lists
    do not fit: a bug, as they are small and every frame limit is far larger.
    """
    lists = {name: report[name] for name in LISTS if isinstance(report.get(name), list)}
    fixed = {k: _member(k, _json(v)) for k, v in report.items()
             if k not in lists and k.removesuffix("_omitted") not in lists}
    # braces and commas, and each list's two members with the longest count they may take
    room = limit - 2 - sum(len(m) + 1 for m in fixed.values()) - sum(
        len(_member(name, b"[]")) + 1 + len(_member(f"{name}_omitted", b"0" * _WIDEST_COUNT))
        + 1 for name in lists)
    if room < 0:
        raise LocalProtocolError(
            f"a report of {limit - room} bytes without its lists does not fit {limit} bytes")
    kept: dict[str, list[bytes]] = {name: [] for name in lists}
    turns: list[tuple[str, Iterator[Any]]] = [(name, iter(v)) for name, v in lists.items()]
    while turns and room > ENTRY_MIN:  # bounded: each turn takes an entry or ends a list
        going = []
        for name, entries in turns:
            entry = next(entries, _END)
            if entry is _END:
                continue
            data = _json(entry)
            if len(data) + 1 > room:
                continue  # this list ends here: the ones after it are not looked at
            room -= len(data) + 1
            kept[name].append(data)
            going.append((name, entries))
        turns = going
    members = []
    for k in report:
        if k in lists:
            omitted = int(report.get(f"{k}_omitted", 0)) + len(lists[k]) - len(kept[k])
            members += [_member(k, b"[" + b",".join(kept[k]) + b"]"),
                        _member(f"{k}_omitted", str(omitted).encode())]
        elif k in fixed:
            members.append(fixed[k])
    return b"{" + b",".join(members) + b"}"
