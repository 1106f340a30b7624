"""Points in time for ``blipmq sub``: ``--since 10m`` and ``--from 2026-11-23T10:00:00Z``.

``since`` turns a duration back from now into ms since the epoch; ``instant`` reads an ISO
8601 date and time with ``Z`` or a UTC offset (a time without a zone is refused: which clock
it meant cannot be known). Both return ``None`` for text they do not accept, so the caller
says what is wrong in one line. Standard library only.
"""

from __future__ import annotations

import re
from datetime import datetime

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
             "w": 604_800_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})",
                  re.IGNORECASE)


def duration_ms(text: str) -> int | None:
    """``90s``, ``10m``, ``1h30m``, ``2d``, ``500ms`` (units ms, s, m, h, d, w) in ms; a bare
    number counts as seconds. None for anything else, or a negative or zero duration."""
    word = text.strip().lower()
    if not word:
        return None
    try:
        seconds = float(word)
    except ValueError:
        pass
    else:
        return round(seconds * 1000) if 0 < seconds < 1e12 else None
    pos, total = 0, 0.0
    for match in _PART.finditer(word):
        if match.start() != pos:
            return None
        total += float(match.group(1)) * _UNITS_MS[match.group(2)]
        pos = match.end()
    if pos != len(word) or total <= 0 or total >= 1e15:
        return None
    return round(total)


def since(text: str, now_ms: int) -> int | None:
    """``now_ms`` minus the duration ``text`` (ms since the epoch), or None."""
    ms = duration_ms(text)
    return None if ms is None else max(0, now_ms - ms)


def instant(text: str) -> int | None:
    """An ISO 8601 date and time with ``Z`` or an offset, in ms since the epoch, or None."""
    word = text.strip()
    if not _ISO.fullmatch(word):
        return None
    if word[-1] in "zZ":
        word = word[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(word)
    except ValueError:
        return None
    ms = round(moment.timestamp() * 1000)
    return ms if ms >= 0 else None
