"""Which key's retained values are which: each key's count of topics and bytes, against its
``access.Quota`` (docs/SECURITY.md, "Shares").

A retained value counts against the key that published it last (a value published over
another key's takes the topic from that key); an empty publish clears it and its count.
A value published with no key in force or with full access (``auth.api_keys``, which has
no share), or recovered from the log at start (a record does not say who published it), is
nobody's: a restart leaves every key's count at zero, and the broker-wide caps
(``retained.Retained.refusal``) still bound them all.

The store (``Retained``) also drops values on its own (an expired one, found on the way);
that is seen here by its size: everything else that changes it passes ``put`` first, so a
store of another size than this ledger last left it lost values meanwhile, and the ledger
forgets those (``_reconcile``). Pure: no clock, no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping

from blipmq_server.broker.access import Quota

# the names of the limits, as refusals and metrics give them
TOPICS = "auth.keys.max_retained_topics"
BYTES = "auth.keys.max_retained_bytes"


class RetainedShares:
    def __init__(self) -> None:
        self.owner: dict[bytes, tuple[str, int]] = {}  # topic -> (key name, record bytes)
        self.held: dict[str, list[int]] = {}  # key name -> [topics, bytes]
        self._seen = 0  # the store's size after the last ``put``

    def refusal(self, values: Mapping[bytes, object], topic: bytes, record_size: int,
                owner: str, quota: Quota) -> tuple[str, str] | None:
        """(the limit, why) if a retained publish of ``record_size`` bytes to ``topic`` by
        key ``owner`` would take it past its quota; None if not (a clear never does)."""
        most_topics, most_bytes = quota.retained_topics, quota.retained_bytes
        if not owner or (most_topics is None and most_bytes is None):
            return None
        self._reconcile(values)
        mine = self.owner.get(topic)
        own = mine[1] if mine is not None and mine[0] == owner else 0
        topics, size = self.held.get(owner, (0, 0))
        if not own and most_topics is not None and topics >= most_topics:
            return TOPICS, (f"key {owner!r} keeps retained values for {topics} topics, the "
                            f"most its share allows ({most_topics}: max_retained_topics, "
                            "docs/SECURITY.md)")
        after = size - own + record_size
        if most_bytes is not None and after > most_bytes:
            return BYTES, (f"key {owner!r}'s retained values would take {after} bytes, more "
                           f"than its share allows ({most_bytes}: max_retained_bytes, "
                           "docs/SECURITY.md)")
        return None

    def put(self, values: Mapping[bytes, object], topic: bytes, owner: str, size: int) -> None:
        """Before the store keeps a value of ``size`` bytes for ``topic`` (0: clears it):
        it is ``owner``'s now ("": nobody's)."""
        self._reconcile(values)
        old = self.owner.pop(topic, None)
        if old is not None:
            self._add(old[0], -1, -old[1])
        if owner and size:
            self.owner[topic] = (owner, size)
            self._add(owner, 1, size)
        self._seen = len(values) - (topic in values) + bool(size)

    def _add(self, owner: str, topics: int, size: int) -> None:
        held = self.held.setdefault(owner, [0, 0])
        held[0] += topics
        held[1] += size
        if not held[0]:
            del self.held[owner]

    def _reconcile(self, values: Mapping[bytes, object]) -> None:
        """Forget the values the store dropped on its own since the last ``put``."""
        if len(values) == self._seen:
            return
        for topic in [t for t in self.owner if t not in values]:
            name, size = self.owner.pop(topic)
            self._add(name, -1, -size)
        self._seen = len(values)
