"""The pure decisions of a bridge link: when to try again, which rule a topic falls under,
and which bridged-in messages must not go back out. No I/O, no clock, no randomness of
its own (both come in as arguments)."""

from __future__ import annotations

from collections.abc import Callable

from blipmq_server.bridge.spec import Rule
from blipmq_server.broker.access import matches


class Backoff:
    """Decorrelated jitter (each wait drawn between the minimum and three times the last,
    capped): retries of many gateways after one outage spread out instead of arriving
    together. ``uniform(a, b)`` is the random source (``random.uniform``)."""

    def __init__(self, min_s: float, max_s: float, uniform: Callable[[float, float], float]
                 ) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._uniform = uniform
        self._last = min_s

    def next(self) -> float:
        wait = min(self.max_s, self._uniform(self.min_s, self._last * 3))
        self._last = max(wait, self.min_s)
        return wait

    def reset(self) -> None:
        self._last = self.min_s


def brief(lasted_s: float, keepalive_s: int) -> bool:
    """Whether a link the upstream ended ``lasted_s`` after it came up (past its CONNACK and
    the answer after it) ended so soon that it counts as a failed attempt on its address:
    within ``keepalive_s`` (60 s with keepalive 0), the time a link takes to prove itself
    alive. An upstream that takes each link and drops it soon after (a balancer in front of
    a dying backend) then sends the bridge to the next address, as one that refuses does."""
    return lasted_s < (keepalive_s or 60)


def inbound_rule(rules: tuple[Rule, ...], topic: str) -> Rule | None:
    """The first ``in``/``both`` rule whose remote filter matches an upstream topic."""
    for rule in rules:
        if rule.receives and _matches(rule.remote_filter, rule.pattern, topic):
            return rule
    return None


def imports(rules: tuple[Rule, ...], topic: str) -> bool:
    """Whether a local topic is one these rules bring in from the upstream: a message that
    came in through a bridge on it is not sent back out (no loops with ``both``)."""
    return any(rule.receives and _matches(rule.local_filter, rule.pattern, topic)
               for rule in rules)


def _matches(topic_filter: str, pattern: str, topic: str) -> bool:
    if not pattern:  # a rule naming one topic through its prefixes
        return topic == topic_filter
    return matches(topic_filter, topic)
