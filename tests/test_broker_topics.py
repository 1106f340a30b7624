import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.broker.topics import FilterIndex, matches, split


@pytest.mark.parametrize(
    ("flt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/b", "a/b/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/d", False),
        ("+/+", "a/b", True),
        ("+", "a/b", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c/d", True),
        ("a/#", "b/c", False),
        ("#", "anything/at/all", True),
        ("sensors/+/temp", "sensors/kitchen/temp", True),
        ("sensors/+/temp", "sensors/kitchen/humidity", False),
        ("#", "$dlq/x", False),
        ("+/x", "$sys/x", False),
        ("$dlq/#", "$dlq/x", True),
    ],
)
def test_matches(flt: str, topic: str, expected: bool) -> None:
    assert matches(split(flt), split(topic)) is expected


# ------------------------------------------------------------------------- the filter index

# Few distinct level names, so that filters and topics overlap often; '$' first levels and
# a '+' or '#' inside a topic (broker-made topics are not validated) are included.
_level = st.sampled_from(["a", "b", "c", "$sys", "$dlq", "x+y", "", "+", "#"])
_filter_level = st.sampled_from(["a", "b", "c", "$sys", "$dlq", "x+y", "", "+", "#"])
_levels = st.lists(_level, min_size=1, max_size=5).map(tuple)
_filters = st.lists(_filter_level, min_size=1, max_size=5).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    filters=st.lists(_filters, max_size=30),
    removed=st.sets(st.integers(0, 29)),
    topics=st.lists(_levels, min_size=1, max_size=20),
)
def test_index_matches_exactly_what_the_linear_scan_matches(
    filters: list[tuple[str, ...]], removed: set[int], topics: list[tuple[str, ...]]
) -> None:
    index: FilterIndex[int] = FilterIndex()
    for i, f in enumerate(filters):
        index.add(f, i)
    for i in removed:
        if i < len(filters):
            assert index.remove(filters[i], i)
    live = {i: f for i, f in enumerate(filters) if i not in removed}
    assert len(index) == len(live)
    for topic in topics:
        found = index.match(topic)
        assert len(found) == len(set(found))  # nothing twice
        assert set(found) == {i for i, f in live.items() if matches(f, topic)}


def test_index_add_and_remove() -> None:
    index: FilterIndex[str] = FilterIndex()
    index.add(split("a/+/c"), "q1")
    index.add(split("a/#"), "q2")
    index.add(split("a/b/c"), "q3")
    index.add(split("#"), "q4")
    index.add(split("$dlq/#"), "q5")
    assert sorted(index.match(split("a/b/c"))) == ["q1", "q2", "q3", "q4"]
    assert sorted(index.match(split("a"))) == ["q2", "q4"]
    assert sorted(index.match(split("$dlq/a/b"))) == ["q5"]  # '#' at the root skips '$'
    assert index.match(split("$sys")) == []
    assert len(index) == 5
    index.add(split("a/#"), "q2")  # filed twice under one filter: once
    assert len(index) == 5

    assert index.remove(split("a/#"), "q2")
    assert not index.remove(split("a/#"), "q2")  # no longer there
    assert not index.remove(split("a/+/c"), "q3")  # not under that filter
    assert not index.remove(split("z/y"), "q1")  # no such branch
    assert sorted(index.match(split("a/b/c"))) == ["q1", "q3", "q4"]
    assert sorted(index.match(split("a"))) == ["q4"]


def test_index_prunes_what_nothing_is_filed_under() -> None:
    index: FilterIndex[int] = FilterIndex()
    filters = [split(f"dev/{i}/+/x/#") for i in range(100)] + [split("a/+/+/#")]
    for i, f in enumerate(filters):
        index.add(f, i)
    for i, f in enumerate(filters):
        assert index.remove(f, i)
    root = index._root
    assert not root.children and root.plus is None and not root.here and not root.rest
    assert len(index) == 0
