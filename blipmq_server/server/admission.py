"""Who gives way when the broker is at ``server.max_connections``: connections not yet proven.

A connection holds its slot from the accept on, through its TLS handshake and its
HELLO+AUTH or CONNECT, for up to ``server.handshake_timeout_ms`` each. Refusing every new
connection at the cap let one source that opened sockets and never finished a handshake
keep everyone else out, the loopback services included, for as long as it kept opening
them. At the cap, the oldest unproven connection of the source holding the most unproven
ones is closed to make room instead, provided that source holds at least ``SHARE`` of them:
a flood from one address then only ever displaces itself, and a connection that is
authenticated is never closed for a newcomer. Looked at only at the cap: nothing here runs
while the broker has room.
"""

from __future__ import annotations

from collections.abc import Callable

SHARE = 2  # unproven connections a source must hold before one of them gives way


class Unproven:
    """Connections that have not authenticated yet, oldest first, by source address."""

    def __init__(self) -> None:
        # token -> (source host, close it, has it proven itself or ended meanwhile?)
        self._held: dict[object, tuple[str, Callable[[], None], Callable[[], bool]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, token: object, source: str, close: Callable[[], None],
            proven: Callable[[], bool]) -> None:
        self._held[token] = (source, close, proven)

    def discard(self, token: object) -> None:
        self._held.pop(token, None)

    def evict(self) -> str | None:
        """Close the oldest unproven connection of the source holding the most (at least
        ``SHARE``); return that source, or None when no source holds that many."""
        held = self._held
        counts: dict[str, int] = {}
        oldest: dict[str, object] = {}
        for token, (source, _, proven) in list(held.items()):
            if proven():  # authenticated (or closing) since it came: no longer ours
                del held[token]
                continue
            counts[source] = counts.get(source, 0) + 1
            oldest.setdefault(source, token)
        if not counts:
            return None
        source = max(counts, key=counts.__getitem__)
        if counts[source] < SHARE:
            return None
        _, close, _ = held.pop(oldest[source])
        close()
        return source


def host_of(peer: str) -> str:
    """The host of a ``host:port`` peer name (``?``: unknown, one source for all such)."""
    host, _, _ = peer.rpartition(":")
    return host or peer
