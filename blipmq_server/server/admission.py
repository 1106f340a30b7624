"""Who gives way when the broker is at ``server.max_connections``: connections not yet proven.

A connection holds its slot from the accept on, through its TLS handshake and its
HELLO+AUTH or CONNECT, for up to ``server.handshake_timeout_ms`` each. Refusing every new
connection at the cap let sockets that never finish a handshake keep everyone else out,
the loopback services included, for as long as someone kept opening them. At the cap, a
connection that has been unproven for ``PATIENCE_S`` or more gives way to the newcomer
instead: of those, the oldest of the source address holding the most of them. A handshake
on a working link takes milliseconds, so a younger one is never closed for a newcomer, nor
is a connection that authenticated; sockets left silent, from one address or from many,
are. A flood opening more than ``max_connections`` sockets a second keeps every slot
younger than that and is not stopped here (docs/SECURITY.md: a firewall's rate limit is).
Looked at only at the cap: nothing here runs while the broker has room.
"""

from __future__ import annotations

from collections.abc import Callable

PATIENCE_S = 1.0  # unproven this long, a connection may give way to a newcomer


class Unproven:
    """Connections that have not authenticated yet, oldest first."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # token -> (source host, since when, close it, has it proven itself or ended?)
        self._held: dict[object, tuple[str, float, Callable[[], None], Callable[[], bool]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, token: object, source: str, close: Callable[[], None],
            proven: Callable[[], bool]) -> None:
        self._held[token] = (source, self._clock(), close, proven)

    def discard(self, token: object) -> None:
        self._held.pop(token, None)

    def evict(self) -> str | None:
        """Close the oldest connection unproven for ``PATIENCE_S`` of the source holding the
        most such; return that source, or None when none has waited that long."""
        held = self._held
        ripe = self._clock() - PATIENCE_S
        counts: dict[str, int] = {}
        oldest: dict[str, object] = {}
        for token, (source, since, _, proven) in list(held.items()):
            if proven():  # authenticated (or closing) since it came: no longer ours
                del held[token]
                continue
            if since > ripe:
                break  # oldest first: the rest came later still
            counts[source] = counts.get(source, 0) + 1
            oldest.setdefault(source, token)
        if not counts:
            return None
        source = max(counts, key=counts.__getitem__)
        _, _, close, _ = held.pop(oldest[source])
        close()
        return source


def host_of(peer: str) -> str:
    """The host of a ``host:port`` peer name (``?``: unknown, one source for all such)."""
    host, _, _ = peer.rpartition(":")
    return host or peer
