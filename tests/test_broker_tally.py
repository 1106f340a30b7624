"""The one-pass backlog count (broker/tally.py) against counting each group on its own."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.broker.results import Count
from blipmq_server.broker.storage import MemoryRecord
from blipmq_server.broker.tally import Tally
from blipmq_server.broker.topics import matches
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import Message, message_record
from blipmq_server.protocol.message import message_from_record

TOPICS = ["a/x", "a/y", "b/x", "$sys/x", "a"]
FILTERS = ["a/x", "a/+", "#", "+/x", "b/#", "$sys/#", "a", "c"]


def log_of(kinds_topics: list[tuple[bool, int]], start: int = 0) -> list[MemoryRecord]:
    """MESSAGE records of the given topics, and other records, at offsets from ``start``."""
    out = []
    for i, (message, t) in enumerate(kinds_topics):
        if message:
            body = message_record(Message(TOPICS[t], b"p", 1))
            out.append(MemoryRecord(Kind.MESSAGE, start + i, 0, body))
        else:
            out.append(MemoryRecord(Kind.GROUP, start + i, 0, b"g"))
    return out


def alone(count: Count, records: list[MemoryRecord]) -> int:
    """The count as each group was counted before: its own read of its range."""
    n = 0
    for r in records:
        if r.kind != Kind.MESSAGE or not count.first <= r.offset <= count.last:
            continue
        topic = message_from_record(r.body).topic
        if matches(count.levels, tuple(topic.split("/"))) and r.offset not in count.acked:
            n += 1
    return n


def run(tally: Tally, records: list[MemoryRecord], step: int) -> dict[int, int]:
    got: dict[int, int] = {}
    for i in range(0, len(records), step):
        tally.feed(records[i : i + step])
        for count, n in tally.take_done():
            assert count.key not in got
            got[count.key] = n
    for count, n in tally.finish():
        assert count.key not in got
        got[count.key] = n
    return got


counts_st = st.lists(st.tuples(st.sampled_from(FILTERS), st.integers(0, 60), st.integers(0, 60),
                               st.sets(st.integers(0, 60), max_size=5)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, len(TOPICS) - 1)), max_size=60),
       counts_st, st.integers(1, 20), st.integers(0, 3))
def test_one_pass_counts_each_group_as_its_own_read_would(
        kinds_topics: list[tuple[bool, int]], specs: list[tuple[str, int, int, set[int]]],
        step: int, start: int) -> None:
    records = log_of(kinds_topics, start)
    counts = [Count(key, min(a, b), max(a, b), tuple(f.split("/")), 0,
                    frozenset(o for o in acked if min(a, b) <= o <= max(a, b)))
              for key, (f, a, b, acked) in enumerate(specs, 1)]
    got = run(Tally(counts), [r for r in records if r.offset >= min(c.first for c in counts)],
              step)
    assert got == {c.key: alone(c, records) for c in counts}


def test_a_count_joins_a_pass_under_way_only_where_it_has_not_read() -> None:
    records = log_of([(True, 0)] * 10)
    tally = Tally([Count(1, 0, 9, ("a", "x"))])
    tally.feed(records[:4])
    assert not tally.add(Count(2, 3, 9, ("a", "+")))  # offset 3 is read: the next pass
    assert tally.add(Count(3, 4, 9, ("a", "+"), 0, frozenset({5})))
    tally.feed(records[4:])
    assert sorted((c.key, n) for c, n in tally.finish()) == [(1, 10), (3, 5)]


def test_a_count_is_done_once_the_pass_is_past_its_last_offset() -> None:
    records = log_of([(True, 0)] * 10)
    tally = Tally([Count(1, 0, 2, ("#",)), Count(2, 0, 9, ("#",))])
    tally.feed(records[:3])
    assert [(c.key, n) for c, n in tally.take_done()] == [(1, 3)]
    assert len(tally) == 1
    tally.feed(records[3:])
    assert [(c.key, n) for c, n in tally.finish()] == [(2, 10)]


def test_many_groups_on_one_filter_share_one_running_total() -> None:
    """2,000 groups on one filter, 2,000 records: a record costs one filter, not 2,000."""
    records = log_of([(True, 0)] * 2000)
    counts = [Count(k, k, 1999, ("a", "x")) for k in range(2000)]
    tally = Tally(counts)
    assert len(tally._runs) == 1
    got = run(tally, records, 1024)
    assert got == {k: 2000 - k for k in range(2000)}
