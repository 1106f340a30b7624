"""Who may publish and subscribe where: identities and their topic permissions.

An ``Identity`` is a named key's permissions: allow and deny lists of topic filters for
publishing and for subscribing, and ``admin`` (statistics, the groups view, other
identities' durable groups). A deny always wins over an allow. Its ``Quota`` bounds what
it may make the broker hold beyond a connection (durable groups, persistent MQTT sessions,
retained values), so that one key cannot take a broker-wide budget from the others.

Publishing to a topic needs an allow filter that matches it and no deny filter that does.
Subscribing to a filter needs an allow filter that *covers* it (every topic the filter can
match, the allow filter matches too) and no deny filter that *overlaps* it (no topic matches
both). So ``sensors/#`` is refused to an identity that may read only ``sensors/kitchen/#``
(it could match ``sensors/hall/t``), and ``sensors/+/t`` is refused when ``sensors/hall/t``
is denied; what a subscription admits is decided once, at SUBSCRIBE, and every path that
reads through it (live messages, retained values, replay, a durable group's backlog) can
only carry topics the identity may read. As in MQTT, a filter starting with a wildcard never
matches a topic starting with '$': ``#`` does not cover ``$dlq/...``, which needs an allow
filter of its own.

Pure, standard library only: no clock, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

try:  # hashlib's blake2b without importing hashlib, which loads OpenSSL's libcrypto
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - a Python built without the module
    from hashlib import blake2b


def digest(key: bytes) -> bytes:
    """The stored form of a key: its BLAKE2b-512 digest (what ``b2sum`` prints, in hex).
    A fast hash is enough for keys minted with 256 random bits (``blipmq keys new``)."""
    return blake2b(key).digest()


def _levels(name: str) -> tuple[str, ...]:
    return tuple(name.split("/"))


def _dollar_guard(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """True when a wildcard first level of one meets a '$' first level of the other: no
    topic can match both."""
    return ((a[0] in ("+", "#") and b[0].startswith("$"))
            or (b[0] in ("+", "#") and a[0].startswith("$")))


def matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` falls under ``topic_filter`` (MQTT rules, '$' topics apart)."""
    f, t = _levels(topic_filter), _levels(topic)
    if _dollar_guard(f, t):
        return False
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t) or (level != "+" and level != t[i]):
            return False
    return len(f) == len(t)


def covers(outer: str, inner: str) -> bool:
    """Whether every topic ``inner`` can match is matched by ``outer``."""
    a, f = _levels(outer), _levels(inner)
    if a[0] in ("+", "#") and f[0].startswith("$"):
        return False
    for i, level in enumerate(f):
        if i >= len(a):
            return False
        wanted = a[i]
        if wanted == "#":
            return True
        if level == "#":
            # ``inner`` goes on to any depth (from its parent on, or from one level when it
            # is all '#'): only '#', or '+/#' in the first place, goes along
            return i == 0 and a == ("+", "#")
        if level == "+":
            if wanted != "+":
                return False
        elif wanted != "+" and wanted != level:
            return False
    # ``outer`` may go on by exactly a '#' ("a/#" matches "a")
    return len(a) == len(f) or (len(a) == len(f) + 1 and a[-1] == "#")


def overlaps(one: str, other: str) -> bool:
    """Whether some topic matches both filters."""
    a, b = _levels(one), _levels(other)
    if _dollar_guard(a, b):
        return False
    for i in range(min(len(a), len(b))):
        x, y = a[i], b[i]
        if x == "#" or y == "#":
            return True
        if x != "+" and y != "+" and x != y:
            return False
    if len(a) == len(b):
        return True
    longer = a if len(a) > len(b) else b
    return len(longer) == min(len(a), len(b)) + 1 and longer[-1] == "#"


class Quota(NamedTuple):
    """What one key may make the broker hold (docs/SECURITY.md, "Shares"): durable groups,
    persistent MQTT sessions, topics with a retained value and bytes of retained values.
    None: no limit of its own (the broker-wide one still applies). The same order serves
    for the broker-wide caps (``share``)."""

    durable_groups: int | None = None
    sessions: int | None = None
    retained_topics: int | None = None
    retained_bytes: int | None = None


UNLIMITED = Quota()
_PARTS = 4  # a default share is at least a quarter of the broker-wide cap


def share(caps: Quota, owners: int) -> Quota:
    """A non-admin key's default quota: each broker-wide cap of ``caps`` divided among the
    ``owners`` (named keys, and the ``api_keys`` keys as one), by four at most (rounded
    up). The only key has it all; two keys half each; one key of many, a quarter, so it
    always leaves three quarters to the others."""
    parts = max(1, min(owners, _PARTS))
    return Quota(*(None if cap is None else -(-cap // parts) for cap in caps))


class Identity(NamedTuple):
    name: str
    publish: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    admin: bool = False
    quota: Quota = UNLIMITED

    def may_publish(self, topic: str) -> bool:
        return (any(matches(f, topic) for f in self.publish)
                and not any(matches(f, topic) for f in self.publish_deny))

    def may_subscribe(self, topic_filter: str) -> bool:
        return (any(covers(f, topic_filter) for f in self.subscribe)
                and not any(overlaps(f, topic_filter) for f in self.subscribe_deny))

    def may_read(self, topic: str) -> bool:
        """Whether a message of ``topic`` may reach this identity (any path)."""
        return (any(matches(f, topic) for f in self.subscribe)
                and not any(matches(f, topic) for f in self.subscribe_deny))


# Everything, administration included: the identity of a connection when authentication is
# off, and of every key of the ``auth.api_keys`` list. '$' topics stay apart as for any
# filter (``$dlq/#`` is allowed by name).
FULL = Identity("*", ("#", "$dlq/#", "$SYS/#"), (), ("#", "$dlq/#", "$SYS/#"), (), True)


class Access:
    """One connection's identity with its publish verdicts remembered by topic (the hot
    path asks once per topic, not once per message). Replaced whole when a reload changes
    the identity's permissions."""

    __slots__ = ("_published", "identity", "unlimited")

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.unlimited = identity is FULL
        self._published: dict[bytes, bool] = {}

    def may_publish(self, topic: bytes) -> bool:
        verdict = self._published.get(topic)
        if verdict is None:
            try:
                verdict = self.identity.may_publish(topic.decode("utf-8"))
            except UnicodeDecodeError:
                verdict = False
            if len(self._published) >= _KEPT:
                self._published.clear()
            self._published[topic] = verdict
        return verdict


_KEPT = 4096  # publish verdicts a connection remembers
