"""Backlog counts of many durable groups in one pass over the log.

After a restart every durable group's backlog is to be counted (``results.Count``: the
MESSAGE records of its topics from its position to the end of the log). Counted one group
at a time, that read the log once per group; a ``Tally`` reads it once for all of them,
from the lowest ``first`` on, and attributes each MESSAGE record to the counts whose filter
matches its topic and whose range holds its offset.

Counts with the same filter share one running total of the records of their topics (a
``_Run``): a count takes the total when the pass reaches its ``first`` and again when it
passes its ``last``, so a record costs one lookup per distinct matching filter, however
many groups share it (2,500 persistent sessions on ``fleet/all``), and each count costs
two snapshots. Offsets a count names as acked are taken off when they match.

Pure and synchronous; ``feed`` runs in a worker thread on records read there, and nothing
else touches a tally meanwhile.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from blipmq_server.broker.results import Count
from blipmq_server.broker.storage import StoredRecord
from blipmq_server.broker.topics import FilterIndex
from blipmq_server.kinds import Kind
from blipmq_server.protocol.message import HEAD_SIZE, MSG_HEAD

_MESSAGE = int(Kind.MESSAGE)
_TOPICS_KEPT = 4096  # topics whose matching filters are remembered, at most


class _Run:
    """The MESSAGE records of one filter's topics passed so far."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = 0


class _Member:
    __slots__ = ("base", "count", "minus", "run")

    def __init__(self, count: Count, run: _Run) -> None:
        self.count = count
        self.run = run
        self.base = -1  # ``run.seen`` when the pass reached ``count.first`` (-1: not yet)
        self.minus = 0  # acked offsets of its topics in its range, met so far

    def result(self) -> tuple[Count, int]:
        if self.base < 0:
            return self.count, 0
        return self.count, self.run.seen - self.base - self.minus


class Tally:
    """One pass over the log that counts the backlogs of every ``Count`` added to it.

    Feed it the log's records in offset order from ``position`` on; each count is done
    (``take_done``) once the pass is past its ``last``, the rest at ``finish``.
    """

    def __init__(self, counts: Sequence[Count]) -> None:
        self.position = min((c.first for c in counts), default=0)  # next offset to read
        self.last = -1  # the highest ``last`` of the counts added
        self._runs: dict[tuple[str, ...], _Run] = {}
        self._index: FilterIndex[_Run] = FilterIndex()
        self._topics: dict[bytes, list[_Run]] = {}
        self._waiting: list[tuple[int, int, _Member]] = []  # by ``first``: not reached yet
        self._open: list[tuple[int, int, _Member]] = []  # by ``last``: in range now
        self._acked: dict[int, list[_Member]] = {}  # offset -> counts that name it acked
        self._seq = 0
        self._done: list[tuple[Count, int]] = []
        for count in counts:
            self.add(count)

    def __len__(self) -> int:
        """Counts not done yet."""
        return len(self._waiting) + len(self._open)

    def add(self, count: Count) -> bool:
        """Count this one too, if the pass has not gone past its ``first`` yet."""
        if count.first < self.position:
            return False
        run = self._runs.get(count.levels)
        if run is None:
            run = self._runs[count.levels] = _Run()
            self._index.add(count.levels, run)
            self._topics.clear()
        member = _Member(count, run)
        self._seq += 1
        heapq.heappush(self._waiting, (count.first, self._seq, member))
        for offset in count.acked:
            self._acked.setdefault(offset, []).append(member)
        self.last = max(self.last, count.last)
        return True

    def feed(self, records: Sequence[StoredRecord]) -> None:
        """The log's next records, in offset order, from ``position`` on."""
        waiting, opened, acked = self._waiting, self._open, self._acked
        topics, head = self._topics, MSG_HEAD.unpack_from
        for r in records:
            offset = r.offset
            if offset < self.position:
                continue
            while waiting and waiting[0][0] <= offset:
                _, seq, member = heapq.heappop(waiting)
                member.base = member.run.seen
                heapq.heappush(opened, (member.count.last, seq, member))
            while opened and opened[0][0] < offset:
                self._done.append(heapq.heappop(opened)[2].result())
            if r.kind != _MESSAGE:
                continue
            body = r.body
            topic = body[HEAD_SIZE : HEAD_SIZE + head(body)[2]]
            runs = topics.get(topic)
            if runs is None:
                runs = self._match(topic)
            for run in runs:
                run.seen += 1
            if acked and offset in acked:
                for member in acked.pop(offset):
                    if member.run in runs and member.count.first <= offset <= member.count.last:
                        member.minus += 1
        if records:
            self.position = max(self.position, records[-1].offset + 1)
        # past a count's ``last`` with no record after it read yet: done all the same
        while opened and opened[0][0] < self.position:
            self._done.append(heapq.heappop(opened)[2].result())

    def _match(self, topic: bytes) -> list[_Run]:
        try:
            levels = tuple(topic.decode("utf-8").split("/"))
        except UnicodeDecodeError:
            levels = ("",)  # as ``DurableGroup.wants`` takes such a topic
        if len(self._topics) >= _TOPICS_KEPT:
            self._topics.clear()
        runs = self._topics[topic] = self._index.match(levels)
        return runs

    def take_done(self) -> list[tuple[Count, int]]:
        """Counts the pass has gone past the end of, each with its number (handed out once)."""
        done, self._done = self._done, []
        return done

    def finish(self) -> list[tuple[Count, int]]:
        """The pass ends here (the log's end, or a read that failed): every count not done
        yet, with what was found of it so far."""
        out = self.take_done()
        out.extend(m.result() for _, _, m in self._open)
        out.extend(m.result() for _, _, m in self._waiting)
        self._open.clear()
        self._waiting.clear()
        self._acked.clear()
        return out
