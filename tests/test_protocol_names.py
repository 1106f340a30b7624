"""Validation of topic names, subscription filters and consumer group names."""

from __future__ import annotations

import pytest

from blipmq_server.protocol.names import (
    MAX_GROUP_CHARS,
    MAX_TOPIC_BYTES,
    filter_problem,
    group_problem,
    topic_problem,
)

# "é" is 2 bytes in UTF-8 and "€" is 3: limits count bytes, not characters.
GOOD_NAMES = [
    "a",
    "a/b/c",
    "sensors/kitchen/temp-1",
    "with space/and.dots_and-dashes",
    "ünïcode/тема/🚀",
    "a" * MAX_TOPIC_BYTES,
    "é" * (MAX_TOPIC_BYTES // 2),
    "€" * (MAX_TOPIC_BYTES // 3),
    "x$/y",  # '$' is only reserved at the start
    # empty levels are levels, as in MQTT 3.1.1 (4.7.1.1): '/TopicA' has two
    "/",
    "/a",
    "a/",
    "a//b",
    "a/b/",
]

# (name, a word the problem must mention): for both topics and filters
BAD_NAMES_COMMON = [
    ("", "empty"),
    ("a" * (MAX_TOPIC_BYTES + 1), "bytes long"),
    ("é" * (MAX_TOPIC_BYTES // 2 + 1), "bytes long"),  # 513 characters, 1026 bytes
    ("€" * (MAX_TOPIC_BYTES // 3 + 1), "bytes long"),  # 342 characters, 1026 bytes
    ("a\x00b", "NUL"),
    ("\x00", "NUL"),
    ("a/\ud800", "UTF-8"),  # a lone surrogate cannot be encoded
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_topics(name: str) -> None:
    assert topic_problem(name) is None


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_topics_are_good_filters(name: str) -> None:
    assert filter_problem(name) is None


@pytest.mark.parametrize(("name", "why"), BAD_NAMES_COMMON)
def test_bad_topics(name: str, why: str) -> None:
    problem = topic_problem(name)
    assert problem is not None
    assert why in problem
    assert problem.startswith("topic ")


@pytest.mark.parametrize(("name", "why"), BAD_NAMES_COMMON)
def test_bad_filters(name: str, why: str) -> None:
    problem = filter_problem(name)
    assert problem is not None
    assert why in problem
    assert problem.startswith("topic filter ")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("+", "wildcard"),
        ("#", "wildcard"),
        ("a/+", "wildcard"),
        ("a/#", "wildcard"),
        ("a/+/c", "wildcard"),
        ("a+", "wildcard"),
        ("a#b", "wildcard"),
        ("$SYS/x", "'$SYS' tree"),
        ("$SYS", "'$SYS' tree"),
        ("$dlq/orders", "'$dlq' tree"),
        ("$share/g/a", "'$share' tree"),
    ],
)
def test_topics_refuse_wildcards_and_the_brokers_trees(name: str, why: str) -> None:
    problem = topic_problem(name)
    assert problem is not None
    assert why in problem


@pytest.mark.parametrize("name", ["$aws/things/t1/shadow/update", "$iothub/twin/PATCH/x",
                                  "$", "$/a", "$sys/x", "$SYSTEM/x", "a/$SYS"])
def test_other_dollar_topics_are_the_clients(name: str) -> None:
    """Only the broker's own trees are reserved (mosquitto keeps only $SYS): devices made
    for AWS IoT or Azure publish to $aws/... and $iothub/..."""
    assert topic_problem(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "+",
        "#",
        "a/+",
        "a/#",
        "+/b",
        "a/+/c",
        "+/+/+",
        "+/#",
        "a/b/c/#",
        "$dlq/#",  # '$' is reserved for topics, a filter may still name them
    ],
)
def test_good_filters(name: str) -> None:
    assert filter_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a+", "whole level"),
        ("+a", "whole level"),
        ("a/b+", "whole level"),
        ("a/+b/c", "whole level"),
        ("++", "whole level"),
        ("a#", "whole level"),
        ("a/#b", "whole level"),
        ("##", "whole level"),
        ("+#", "whole level"),
        ("#/a", "last level"),
        ("a/#/b", "last level"),
        ("#/#", "last level"),
        ("a/#/", "last level"),
    ],
)
def test_bad_filters_wildcards(name: str, why: str) -> None:
    problem = filter_problem(name)
    assert problem is not None
    assert why in problem


def test_limit_is_exact() -> None:
    assert topic_problem("a" * MAX_TOPIC_BYTES) is None
    assert topic_problem("a" * (MAX_TOPIC_BYTES + 1)) is not None
    assert topic_problem("a" * (MAX_TOPIC_BYTES - 2) + "é") is None
    assert topic_problem("a" * (MAX_TOPIC_BYTES - 1) + "é") is not None


@pytest.mark.parametrize(
    "name",
    ["g", "0", "workers", "Billing-EU.v2_blue", "a.b-c_d", "A" * MAX_GROUP_CHARS, "...", "-"],
)
def test_good_groups(name: str) -> None:
    assert group_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "empty"),
        ("A" * (MAX_GROUP_CHARS + 1), "characters long"),
        ("has space", "may only contain"),
        ("a/b", "may only contain"),
        ("a+b", "may only contain"),
        ("a#", "may only contain"),
        ("ü", "may only contain"),
        ("é" * 10, "may only contain"),
        ("a\x00", "may only contain"),
        ("trailing\n", "may only contain"),  # fullmatch: no '$'-before-newline loophole
        ("$g", "may only contain"),
        ("a:b", "may only contain"),
    ],
)
def test_bad_groups(name: str, why: str) -> None:
    problem = group_problem(name)
    assert problem is not None
    assert why in problem
