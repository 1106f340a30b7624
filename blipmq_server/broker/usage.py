"""Per-topic usage: messages and payload bytes accepted per topic, and which log cursors
(durable groups and plain ones) each topic's logged messages count towards (their backlog,
and the end of their ``quiet_from``).

The publish path counts a run of messages to one topic in local variables and adds them to
the topic's entry once (``add``); ``backlog`` of every durable group listed in the entry
grows by the run's logged messages, and the group's cursor takes one off for each matching
message it passes, so a group's backlog counts only its own topics' messages and no scrape
scans the log. Memory is
bounded: past ``limit`` topics, new topics are counted together in ``other``.
Pure: no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TOPICS_TRACKED = 10_000

# [messages, payload bytes, log cursors whose filter matches (tuple), tracked (bool),
#  the ``Usage.generation`` those cursors were looked up in, topic]
Entry = list[Any]


class Usage:
    def __init__(self, groups_of: Callable[[bytes], tuple[Any, ...]],
                 limit: int = TOPICS_TRACKED,
                 woken: Callable[[Any], None] | None = None) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.other: list[int] = [0, 0]  # messages and bytes of the topics past the limit
        self.limit = limit
        self.generation = 0  # of the cursors: an entry looked up in an older one is stale
        self._groups_of = groups_of
        self._woken = woken  # told of a cursor whose ``quiet_from`` a message ends

    def entry(self, topic: bytes) -> Entry:
        """The entry of a topic that has none (the slow path). Past the limit, an untracked
        entry, not kept: ``add`` counts its messages in ``other``."""
        groups = self._groups_of(topic)
        if len(self.entries) >= self.limit:
            return [0, 0, groups, False, self.generation, topic]
        entry: Entry = [0, 0, groups, True, self.generation, topic]
        self.entries[topic] = entry
        return entry

    def add(self, entry: Entry, messages: int, nbytes: int, unlogged: int,
            first: int = 0) -> None:
        """A run of ``messages`` to the entry's topic, ``unlogged`` of them kept out of the
        log (with a log; without one, no durable group exists to count them); ``first``:
        the offset of the run's first logged message. A quiet cursor it ends moves on to
        ``first`` at once: what lies between is other topics' (it would read through it)."""
        if entry[3]:
            entry[0] += messages
            entry[1] += nbytes
        else:
            self.other[0] += messages
            self.other[1] += nbytes
        logged = messages - unlogged
        if logged:
            if entry[4] != self.generation:  # cursors came or went since: look again
                entry[2] = self._groups_of(entry[5])
                entry[4] = self.generation
            for g in entry[2]:
                g.backlog += logged
                if g.quiet_from is not None:
                    g.pass_quiet(first)  # what lies before is other topics'
                    g.quiet_from = None
                    if self._woken is not None:
                        self._woken(g)

    def regroup(self) -> None:
        """Cursors came or went: each topic looks again which count its messages, when it
        next has one (not every topic now: plain cursors come and go with subscribers)."""
        self.generation += 1

    def rows(self) -> list[tuple[str, int, int]]:
        """(topic, messages, bytes) of every tracked topic, most messages first."""
        rows = [(t.decode("utf-8", "replace"), e[0], e[1]) for t, e in self.entries.items()]
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows
