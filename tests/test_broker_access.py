"""broker/access.py: the permission rules, held to brute force over a small topic universe."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.broker.access import FULL, Access, Identity, covers, matches, overlaps
from blipmq_server.broker.topics import matches as core_matches
from blipmq_server.broker.topics import split

_WORDS = ["a", "b", "", "$x"]
# every topic of up to 4 levels over the words ('$x' only first, as the broker's topics)
UNIVERSE = ["/".join(p) for n in range(1, 5) for p in itertools.product(_WORDS, repeat=n)
            if all(not w.startswith("$") for w in p[1:])]


def filters() -> st.SearchStrategy[str]:
    level = st.sampled_from(["a", "b", "", "+", "$x"])
    return st.lists(level, min_size=1, max_size=3).flatmap(
        lambda ls: st.sampled_from(["/".join(ls), "/".join([*ls, "#"]), "#"])).filter(
        lambda f: all(not w.startswith("$") for w in f.split("/")[1:]))


@given(filters(), st.sampled_from(UNIVERSE))
def test_matches_is_the_core_rule(f: str, topic: str) -> None:
    assert matches(f, topic) == core_matches(split(f), split(topic))


@given(filters(), filters())
@settings(max_examples=500)
def test_covers_means_every_topic_of_the_inner_filter_matches_the_outer(a: str, f: str) -> None:
    counter = [t for t in UNIVERSE if matches(f, t) and not matches(a, t)]
    assert covers(a, f) == (not counter), (a, f, counter[:3])


@given(filters(), filters())
@settings(max_examples=500)
def test_overlaps_means_some_topic_matches_both(a: str, b: str) -> None:
    both = [t for t in UNIVERSE if matches(a, t) and matches(b, t)]
    assert overlaps(a, b) == bool(both), (a, b)
    assert overlaps(a, b) == overlaps(b, a)


def test_the_documented_wildcard_rule() -> None:
    kitchen = Identity("kitchen", subscribe=("sensors/kitchen/#",))
    assert kitchen.may_subscribe("sensors/kitchen/#")
    assert kitchen.may_subscribe("sensors/kitchen/+/t")
    assert not kitchen.may_subscribe("sensors/#")  # could match sensors/hall/t
    assert not kitchen.may_subscribe("#")
    assert not kitchen.may_subscribe("+/kitchen/t")
    no_hall = Identity("no-hall", subscribe=("sensors/#",), subscribe_deny=("sensors/hall/#",))
    assert no_hall.may_subscribe("sensors/kitchen/t")
    assert not no_hall.may_subscribe("sensors/+/t")  # would match sensors/hall/t
    assert not no_hall.may_subscribe("sensors/#")
    assert no_hall.may_read("sensors/kitchen/t") and not no_hall.may_read("sensors/hall/t")
    # '$' topics need their own allow filter
    assert not Identity("x", subscribe=("#",)).may_subscribe("$dlq/#")
    assert Identity("x", subscribe=("#", "$dlq/jobs/#")).may_subscribe("$dlq/jobs/#")


def test_a_deny_wins_for_publishing() -> None:
    pub = Identity("p", publish=("sensors/#",), publish_deny=("sensors/secret",))
    access = Access(pub)
    assert access.may_publish(b"sensors/hall") and not access.may_publish(b"sensors/secret")
    assert not access.may_publish(b"other") and not access.may_publish(b"\xff")
    assert access.may_publish(b"sensors/hall")  # remembered, the same verdict
    assert Access(FULL).unlimited and not access.unlimited


def test_a_default_share_divides_each_cap_among_the_keys_by_four_at_most() -> None:
    from blipmq_server.broker.access import Quota, share

    caps = Quota(100_000, 100_000, 10_000, 16 << 20)
    assert share(caps, 1) == caps  # the only key: everything, as before shares
    assert share(caps, 2) == Quota(50_000, 50_000, 5_000, 8 << 20)
    assert share(caps, 3) == Quota(33_334, 33_334, 3_334, -(-(16 << 20) // 3))  # rounded up
    assert share(caps, 4) == share(caps, 40) == Quota(25_000, 25_000, 2_500, 4 << 20)
    assert share(Quota(1, None, 0, 3), 4) == Quota(1, None, 0, 1)
