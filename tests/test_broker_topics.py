import pytest

from blipmq_server.broker.topics import matches, split


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
