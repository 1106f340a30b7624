"""Per-topic usage: messages and payload bytes accepted per topic, and which durable groups
each topic's logged messages count towards (their backlog).

The publish path looks a topic up once per message (``entries``) and bumps the entry's
counts; ``backlog`` of every durable group listed in the entry grows by one for each logged
message, and the group's cursor takes one off for each matching message it passes, so a
group's backlog counts only its own topics' messages and no scrape scans the log. Memory is
bounded: past ``limit`` topics, new topics are counted together in ``other``.
Pure: no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TOPICS_TRACKED = 10_000

Entry = list[Any]  # [messages, payload bytes, durable groups whose filter matches (tuple)]


class Usage:
    def __init__(self, groups_of: Callable[[bytes], tuple[Any, ...]],
                 limit: int = TOPICS_TRACKED) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.other: list[int] = [0, 0]  # messages and bytes of the topics past the limit
        self.limit = limit
        self._groups_of = groups_of

    def entry(self, topic: bytes, payload_len: int) -> Entry:
        """The entry of a topic that has none (the slow path). Past the limit, ``other``
        counts the message and a throwaway entry is returned (the caller's counts on it go
        nowhere; it is asked again for the topic's next message)."""
        groups = self._groups_of(topic)
        if len(self.entries) >= self.limit:
            self.other[0] += 1
            self.other[1] += payload_len
            return [0, 0, groups]
        entry: Entry = [0, 0, groups]
        self.entries[topic] = entry
        return entry

    def regroup(self) -> None:
        """Durable groups changed: look again which count each topic's messages."""
        groups_of = self._groups_of
        for topic, entry in self.entries.items():
            entry[2] = groups_of(topic)

    def rows(self) -> list[tuple[str, int, int]]:
        """(topic, messages, bytes) of every tracked topic, most messages first."""
        rows = [(t.decode("utf-8", "replace"), e[0], e[1]) for t, e in self.entries.items()]
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows
