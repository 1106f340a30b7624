"""Validation of topic names, subscription filters and group names.

Returns a problem as a string (or None when the name is fine), so callers decide whether a
bad name is an error frame, a CLI exit code or a test assertion. Standard library only.
"""

from __future__ import annotations

import re

MAX_TOPIC_BYTES = 1024  # the default cap (server.max_topic_bytes)
WIRE_TOPIC_BYTES = 0xFFFF  # what the wire can carry, the highest cap there is
MAX_GROUP_CHARS = 64
_GROUP_RE = re.compile(r"[A-Za-z0-9_.\-]+")
# the first levels of the broker's own topics: its state ($SYS), the dead letters ($dlq) and
# the shared subscriptions' filters ($share); other '$' topics ($aws/..., $iothub/...) are
# the clients', as in mosquitto, which keeps only $SYS
BROKER_TREES = frozenset({"$SYS", "$dlq", "$share"})


def broker_topic(name: str) -> bool:
    """Whether ``name`` lies in one of the broker's own trees (``BROKER_TREES``)."""
    return name[:1] == "$" and name.split("/", 1)[0] in BROKER_TREES


def _common(name: str, what: str, limit: int) -> str | None:
    if not name:
        return f"{what} is empty"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{what} {name!r} is not valid UTF-8"
    if size > limit:
        return f"{what} is {size} bytes long, the limit is {limit}"
    if "\x00" in name:
        return f"{what} {name!r} contains a NUL character"
    return None  # empty levels ('/a', 'a//b', 'a/') are valid levels, as in MQTT


def topic_problem(name: str, limit: int = MAX_TOPIC_BYTES) -> str | None:
    """Why ``name`` cannot be published to, or None. Wildcards and the broker's own trees
    (``$SYS``, ``$dlq``, ``$share``) are refused; ``limit``: the longest name in bytes."""
    problem = _common(name, "topic", limit)
    if problem:
        return problem
    if "+" in name or "#" in name:
        return f"topic {name!r} contains a wildcard ('+' or '#'); wildcards are for sub"
    if broker_topic(name):
        return (f"topic {name!r} is in the broker's own {name.split('/', 1)[0]!r} tree "
                "($SYS, $dlq and $share are reserved; other '$' topics are not)")
    return None


def filter_problem(name: str, limit: int = MAX_TOPIC_BYTES) -> str | None:
    """Why ``name`` is not a valid subscription filter, or None (MQTT-style '+' and '#')."""
    problem = _common(name, "topic filter", limit)
    if problem:
        return problem
    levels = name.split("/")
    for i, level in enumerate(levels):
        if ("+" in level and level != "+") or ("#" in level and level != "#"):
            return f"topic filter {name!r}: a wildcard must be a whole level"
        if level == "#" and i != len(levels) - 1:
            return f"topic filter {name!r}: '#' must be the last level"
    return None


def group_problem(name: str) -> str | None:
    """Why ``name`` is not a valid consumer group name, or None."""
    if not name:
        return "group name is empty"
    if len(name) > MAX_GROUP_CHARS:
        return f"group name is {len(name)} characters long, the limit is {MAX_GROUP_CHARS}"
    if not _GROUP_RE.fullmatch(name):
        return f"group name {name!r} may only contain letters, digits, '_', '.' and '-'"
    return None
