"""MQTT-style topic filter matching ('+' one level, '#' the rest). Pure, stdlib only."""

from __future__ import annotations


def split(name: str) -> tuple[str, ...]:
    return tuple(name.split("/"))


def matches(filter_levels: tuple[str, ...], topic_levels: tuple[str, ...]) -> bool:
    """True when a topic (already split into levels) falls under a filter.

    As in MQTT, ``a/#`` also matches ``a`` itself, and a filter whose first level is a
    wildcard never matches a topic starting with '$' (broker-reserved topics must be
    subscribed to by name).
    """
    if topic_levels[0].startswith("$") and filter_levels[0] in ("+", "#"):
        return False
    n = len(topic_levels)
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= n:
            return False
        if level != "+" and level != topic_levels[i]:
            return False
    return len(filter_levels) == n
