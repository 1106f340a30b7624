"""Durations on the command line: ``500ms``, ``1.5s``, ``5m``, ``2h``, ``1d``, or a plain
number in the option's own unit (seconds for ``--timeout``, milliseconds for ``--ttl``)."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_FORM = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)


def seconds(text: str, plain_unit: str = "s") -> float | None:
    """The duration in seconds, or None when ``text`` is not a non-negative duration."""
    m = _FORM.fullmatch(text)
    if m is None:
        return None
    unit = (m.group(2) or plain_unit).lower()
    value = float(m.group(1)) * _UNITS[unit]
    return value if value < 10**12 else None


def milliseconds(text: str) -> int | None:
    """A duration in whole milliseconds (a plain number is milliseconds), or None."""
    value = seconds(text, "ms")
    return None if value is None else round(value * 1000)
