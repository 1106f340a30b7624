"""MQTT-style topic filter matching ('+' one level, '#' the rest), one filter at a time
(``matches``) or against every filter at once (``FilterIndex``). Pure, stdlib only."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


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


class _Node:
    """One level of a filter prefix: what goes on from here, and whose filters end here."""

    __slots__ = ("children", "here", "plus", "rest")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}  # exact next levels
        self.plus: _Node | None = None  # a '+' next level
        self.here: dict[object, None] = {}  # filters that end at this level
        self.rest: dict[object, None] = {}  # filters with '#' as their next level

    def empty(self) -> bool:
        return not (self.children or self.plus or self.here or self.rest)


class FilterIndex(Generic[T]):
    """Values (queues, cursors) filed under their filter's levels in a trie, so that the
    values whose filter matches a topic are found in time that grows with the topic's
    levels and the number of matches, not with the number of filters.

    ``match`` returns exactly the values whose filter ``matches`` the topic (the property
    test holds it to that), in no particular order. A value is filed under one filter.
    """

    __slots__ = ("_root", "_size")

    def __init__(self) -> None:
        self._root = _Node()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, levels: tuple[str, ...], value: T) -> None:
        node, last = self._walk(levels, create=True)
        bucket = node.rest if last == "#" else node.here
        if value not in bucket:
            bucket[value] = None
            self._size += 1

    def remove(self, levels: tuple[str, ...], value: T) -> bool:
        """Take ``value`` out from under ``levels``; False when it was not there."""
        path: list[tuple[_Node, str]] = []  # (parent, key of the child taken)
        node: _Node | None = self._root
        last = ""
        for level in levels:
            if level == "#":
                last = "#"
                break
            assert node is not None
            child = node.plus if level == "+" else node.children.get(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        assert node is not None
        bucket = node.rest if last == "#" else node.here
        if value not in bucket:
            return False
        del bucket[value]
        self._size -= 1
        while path and node.empty():  # prune the branch nothing is filed under any more
            parent, level = path.pop()
            if level == "+":
                parent.plus = None
            else:
                del parent.children[level]
            node = parent
        return True

    def _walk(self, levels: tuple[str, ...], create: bool) -> tuple[_Node, str]:
        """The node a filter's levels lead to (up to a '#', which ends a filter, as it
        ends ``matches``) and '#' when the filter ends in it."""
        node = self._root
        for level in levels:
            if level == "#":
                return node, "#"
            if level == "+":
                if node.plus is None:
                    node.plus = _Node()
                node = node.plus
            else:
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
        return node, ""

    def match(self, topic_levels: tuple[str, ...]) -> list[T]:
        """The values whose filter matches the topic."""
        out: list[T] = []
        root = self._root
        # '$' topics: a wildcard first level does not match them (see ``matches``)
        if topic_levels[0].startswith("$"):
            child = root.children.get(topic_levels[0])
            if child is None:
                return out
            nodes = [child]
            rest_levels = topic_levels[1:]
        else:
            nodes = [root]
            rest_levels = topic_levels
        for level in rest_levels:
            following: list[_Node] = []
            for node in nodes:
                if node.rest:
                    out += node.rest  # type: ignore[arg-type]
                child = node.children.get(level)
                if child is not None:
                    following.append(child)
                if node.plus is not None:
                    following.append(node.plus)
            if not following:
                return out
            nodes = following
        for node in nodes:
            if node.here:
                out += node.here  # type: ignore[arg-type]
            if node.rest:  # 'a/#' matches 'a'
                out += node.rest  # type: ignore[arg-type]
        return out
