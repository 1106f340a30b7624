"""Log lines about failures that a stranger can cause at will (a refused key, a failed TLS
handshake), at most one per source address, kind of failure and interval: a flood is counted
in full by the caller's metrics, while the log, on an SD card's journal, gets one line a
minute."""

from __future__ import annotations

import time

EVERY_S = 60.0  # one log line per source address and interval
_SOURCES_KEPT = 4096  # source addresses whose last line is remembered


class Hush:
    """When each source address was last logged about."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        # (source, what) -> when last said, and how many were not said since
        self._said: dict[tuple[str, str], tuple[float, int]] = {}

    def due(self, peer: str, what: str = "") -> tuple[str, int] | None:
        """If a line about ``what`` from the source address of ``peer`` ("host:port") is due
        now: that address and how many times it was not due since the last line (the line
        is noted as said); else None. Another ``what`` (a failure of another kind) gets its
        own lines."""
        source = peer.rpartition(":")[0] or peer
        now = time.monotonic()
        key = (source, what)
        last = self._said.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._said[key] = (last[0], last[1] + 1)
            return None
        if len(self._said) >= _SOURCES_KEPT:
            self._said.clear()
        self._said[key] = (now, 0)
        return source, 0 if last is None else last[1]
