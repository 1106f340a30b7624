"""Log lines about failures that a peer can cause at will (a refused key, a failed TLS
handshake; over MQTT a protocol error, a QoS 0 publish dropped, a refused filter), at most
one per source address, kind of failure and interval: a flood is counted in full by the
caller's metrics, while the log, on an SD card's journal, gets one line a minute.

At most ``_SOURCES_KEPT`` sources are remembered. When that many were heard from within
the interval (a flood from a whole IPv6 /64), a new one joins ``OTHERS``: all of them
together get one line per interval, so the log stays bounded whatever the number of
addresses. Each line says how many failures came since the last line about the same
source; the count of a source forgotten for room goes to ``OTHERS``'s next line, so no
count is lost."""

from __future__ import annotations

import time

EVERY_S = 60.0  # one log line per source address and interval
OTHERS = "other addresses"  # the source of the lines about sources not remembered
_SOURCES_KEPT = 4096  # source addresses whose last line is remembered


class Hush:
    """When each source address was last logged about, oldest line first."""

    def __init__(self, every_s: float = EVERY_S, kept: int = _SOURCES_KEPT) -> None:
        self.every_s = every_s
        self.kept = kept
        # (source, what) -> when last said, and how many were not said since; in the order
        # of their last lines (a line moves its entry to the end)
        self._said: dict[tuple[str, str], tuple[float, int]] = {}
        self._others: dict[str, tuple[float, int]] = {}  # what -> the same, for OTHERS

    def due(self, peer: str, what: str = "") -> tuple[str, int] | None:
        """If a line about ``what`` from the source address of ``peer`` ("host:port") is due
        now: that address (or ``OTHERS``) and how many failures were not said since the
        last line about it (the line is noted as said); else None. Another ``what`` (a
        failure of another kind) gets its own lines."""
        source = peer.rpartition(":")[0] or peer
        now = time.monotonic()
        key = (source, what)
        last = self._said.get(key)
        if last is not None:
            if now - last[0] < self.every_s:
                self._said[key] = (last[0], last[1] + 1)
                return None
            del self._said[key]  # said again now: to the end
        elif len(self._said) >= self.kept and not self._room(now):
            return self._other(what, now)
        self._said[key] = (now, 0)
        return source, 0 if last is None else last[1]

    def _room(self, now: float) -> bool:
        """Forget the sources whose last line is older than the interval (the oldest first),
        their counts not said yet going to OTHERS; whether there is room now."""
        said = self._said
        while len(said) >= self.kept:
            (source, what), (at, unsaid) = next(iter(said.items()))
            if now - at < self.every_s:
                return False  # the oldest line is recent: so are all the others
            del said[source, what]
            if unsaid:
                then, count = self._others.get(what, (-self.every_s, 0))
                self._others[what] = (then, count + unsaid)
        return True

    def _other(self, what: str, now: float) -> tuple[str, int] | None:
        then, count = self._others.get(what, (-self.every_s, 0))
        if now - then < self.every_s:
            self._others[what] = (then, count + 1)
            return None
        self._others[what] = (now, 0)
        return OTHERS, count


def since(said: tuple[str, int]) -> str:
    """What a line of ``Hush.due`` adds: how many it did not say since the last one."""
    source, unsaid = said
    if not unsaid:
        return ""
    return f", and {unsaid} more{' from ' + source if source == OTHERS else ''} since the last line"
