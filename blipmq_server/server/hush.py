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
        self._said: dict[tuple[str, str], float] = {}  # (source, what) -> when last said

    def due(self, peer: str, what: str = "") -> str | None:
        """The source address of ``peer`` ("host:port") if a line about ``what`` from there
        is due now (and noted as said), else None. Another ``what`` (a failure of another
        kind) gets its own line."""
        source = peer.rpartition(":")[0] or peer
        now = time.monotonic()
        last = self._said.get((source, what))
        if last is not None and now - last < self.every_s:
            return None
        if len(self._said) >= _SOURCES_KEPT:
            self._said.clear()
        self._said[source, what] = now
        return source
