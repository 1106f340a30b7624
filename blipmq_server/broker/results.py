"""The small frozen values the broker core answers with, and its options and counters.

The core names connections and queues by id (ints the shell chose or the core handed out)
and never holds a shell object: a result says whom to wake, what was appended to the log,
who is blocked and on what, and the shell turns that into wake-ups and frames.
Pure: no trio.

The frozen ones are NamedTuples, read by attribute and compared only with their own kind:
defining a NamedTuple class costs a fifth of what a frozen dataclass does (on every start
of the broker), and making one about half. ``Counters`` changes: a plain slotted class,
cheaper still to define.
"""

# Annotations are evaluated here (no `from __future__ import annotations`): as strings,
# typing compiles each NamedTuple field's into a ForwardRef, ~5 us a field on every start.

from typing import NamedTuple

from blipmq_server.broker.queue import Overflow
from blipmq_server.protocol.codec import ErrorCode


class Limits(NamedTuple):
    """The broker options the core needs (built from the config by the shell)."""

    capacity: int = 8192
    capacity_bytes: int = 64 * 1024 * 1024
    # bytes the QoS 0 queues one connection reads from may hold together (0: no limit)
    max_bytes_per_connection: int = 64 * 1024 * 1024
    max_bytes_total: int = 256 * 1024 * 1024  # all the queues together (0: no limit)
    overflow: Overflow = Overflow.BLOCK
    default_ttl_ms: int = 0
    max_message_bytes: int = 8 * 1024 * 1024
    log_qos0: bool = True  # with a log: append QoS 0 messages too
    retry_backoff_ms: int = 5000  # first redelivery deadline of an unacked QoS 1 delivery
    retry_backoff_max_ms: int = 60000  # the deadline doubles per delivery up to this
    max_retries: int = 5  # deliveries before a message goes to $dlq/<topic>
    default_credit: int = 256  # in-flight window of a QoS 1 consumer that asks for 0
    # message bytes the QoS 1 consumers of one connection may hold unacked, whatever their
    # credit (0 = no limit): the broker keeps each in memory until its ack
    max_inflight_bytes: int = 16 * 1024 * 1024
    max_inflight_bytes_total: int = 256 * 1024 * 1024  # all connections together (0: none)
    group_expiry_ms: int = 0  # a durable group with no consumer this long is dropped; 0 never
    max_idle_groups: int = 256  # QoS 0 groups without a consumer kept (beyond: the oldest go)
    retained_max_topics: int = 10_000  # topics with a retained value
    retained_max_bytes: int = 16 * 1024 * 1024  # bytes of retained message records
    # retained values one connection's subscriptions start with, all together (0: no limit)
    retained_max_per_connection: int = 100_000
    retained_max_all_connections: int = 1_000_000  # all connections together (0: no limit)
    max_topic_bytes: int = 1024  # longest topic name or filter (at most 65,535)
    max_subscriptions: int = 10_000  # subscriptions one connection may hold at once
    max_durable_groups: int = 100_000  # durable groups in the broker (each a log cursor)
    # records log cursors hold read ahead, with their topic matches, all together
    read_ahead_bytes: int = 64 * 1024 * 1024

    def size_refusal(self, topic_bytes: int, payload_bytes: int) -> "Refusal | None":
        """Why a message with a topic and a payload of these sizes is refused (over
        ``max_topic_bytes`` or ``max_message_bytes``), or None: what ``Broker.publish``
        refuses it with, and what is checked before a message reaches it (an MQTT will, a
        bridged-in message)."""
        if topic_bytes > self.max_topic_bytes:
            return Refusal(ErrorCode.INVALID_TOPIC, f"topic is {topic_bytes} bytes long, "
                           f"server.max_topic_bytes is {self.max_topic_bytes}")
        if payload_bytes > self.max_message_bytes:
            return Refusal(ErrorCode.MESSAGE_TOO_LARGE, f"message of {payload_bytes} bytes "
                           f"exceeds max_message_bytes ({self.max_message_bytes})")
        return None


class Counters:
    """Plain counters, read by metrics at scrape time."""

    __slots__ = ("acked", "dead_lettered", "dead_letters_dropped", "delivered", "dropped_new",
                 "dropped_no_consumer", "dropped_oldest", "dropped_ttl", "enqueued",
                 "groups_expired", "idle_groups_dropped", "limited", "nacked", "published",
                 "redelivered", "refused", "retained_sent", "unrouted")

    def __init__(self) -> None:
        self.published = 0
        self.unrouted = 0  # accepted, but no subscription matched
        self.enqueued = 0
        self.delivered = 0
        self.dropped_oldest = 0
        self.dropped_new = 0
        self.dropped_ttl = 0
        self.dropped_no_consumer = 0  # a ``block`` queue without consumers made room
        # messages of PUBLISH frames answered with an error frame, not stored: the refused
        # one and the rest of its batch (bad topic, too large, LIMIT, ...), and the QoS 1
        # messages the log could not store (STORAGE, counted by the shell's flusher)
        self.refused = 0
        self.retained_sent = 0  # retained values handed to new subscriptions
        self.acked = 0
        self.redelivered = 0
        self.nacked = 0
        self.dead_lettered = 0
        # dead letters that used up their deliveries in their turn: dropped, not moved on
        self.dead_letters_dropped = 0
        self.groups_expired = 0
        self.idle_groups_dropped = 0  # QoS 0 groups dropped beyond ``limits.max_idle_groups``
        # refusals at a cap on what the broker holds, by the cap's name: the broker-wide
        # "queues.max_durable_groups" and a key's "auth.keys.max_..." (the shell counts
        # "mqtt.max_sessions" and "auth.keys.max_sessions" here too)
        self.limited: dict[str, int] = {}

    def __eq__(self, other: object) -> bool:  # by value, as the dataclass it was (tests)
        if type(other) is not Counters:
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in Counters.__slots__)

    __hash__ = None  # type: ignore[assignment]  # it changes: no hash, like a dataclass

    def __repr__(self) -> str:
        return "Counters(" + ", ".join(f"{n}={getattr(self, n)}" for n in Counters.__slots__) + ")"


class Refusal(NamedTuple):
    """Why the core refused something: the error code the native protocol sends, and a
    sentence."""

    code: ErrorCode
    text: str


class Blocked(NamedTuple):
    """A full queue with the ``block`` policy, and the connections consuming from it."""

    queue: int  # Queue.id
    name: str  # for errors and logs: "group 'g' on 't'" or "subscription on 't'"
    conns: tuple[int, ...]


class PublishResult(NamedTuple):  # one per PUBLISH frame: a tuple costs a third of a dataclass
    """``accepted`` messages of the batch were taken; the rest were not looked at.

    ``wake`` are the connections with new deliveries. ``blocked`` is a full queue with the
    ``block`` policy and a consumer that stopped the batch (retry the rest when it has room);
    ``refusal`` says why a message was refused. ``last_offset`` is the last log record
    appended (0: none); ``confirms`` QoS 1 messages were accepted: confirm them once the log
    holds ``last_offset``. ``unkept`` retained messages were routed without retain, their
    values not kept (``publish(unkept=True)``): the first's topic and why, ``unkept_topic`` and
    ``unkept_text``.
    """

    accepted: int
    wake: set[int]
    blocked: Blocked | None = None
    refusal: Refusal | None = None
    confirms: int = 0
    last_offset: int = 0
    first_offset: int = 0  # the first log record appended (0: none)
    unkept: int = 0
    unkept_topic: bytes = b""
    unkept_text: str = ""


class SubscribeResult(NamedTuple):
    """A new subscription's id and whether it has something to take already (a group's
    backlog), or why there is none (``sub_id`` 0)."""

    sub_id: int
    ready: bool = False
    refusal: Refusal | None = None
    end: int | None = None  # asked for (until_end): the log's next offset, 0 without a log
    adopted: str = ""  # a group of the api_keys keys ('*') became this identity's


class Ended(NamedTuple):
    """Another connection's subscription that ended because its group was deleted."""

    conn: int
    request_id: int  # of its SUBSCRIBE
    name: str  # "group 'g' on 't'"


class Detached(NamedTuple):
    """What ending subscriptions changed: ``released`` queues (by id) no longer hold
    publishers back the way they did (gone, or one consumer fewer); ``wake`` connections
    have deliveries again (the unacked ones of a consumer that left)."""

    released: tuple[int, ...] = ()
    wake: frozenset[int] = frozenset()


class UnsubscribeResult(NamedTuple):
    """How many subscriptions ended (0: none matched), what that changed for other
    queues and connections, or why it was refused. ``logged``: the offset of the last log
    record a deleted group's deletion appended (its DELETE, its owner's record); its reply
    waits until the log holds it (0: nothing was written)."""

    count: int
    detached: Detached = Detached()
    ended: tuple[Ended, ...] = ()  # other connections' subscriptions ended (group deleted)
    refusal: Refusal | None = None
    logged: int = 0


class Fetch(NamedTuple):
    """A log cursor needs records the log holds only on disk: read them off the event loop
    (from ``offset``, up to the ``storage.READ_AHEAD`` limits) and hand them to
    ``Broker.fill(key, records)``."""

    key: int
    offset: int


class Count(NamedTuple):
    """A durable group's backlog before it was counted on appends (a group created to
    replay the log, every group after a restart, a group retention skipped): count the
    MESSAGE records of its topics (``levels``, its filter's) from ``first`` to ``last``,
    leaving out ``acked`` (the offsets in that range acked before a restart, as they were
    when the count was asked for), off the event loop (``tally.Tally``, one pass over the
    log for every count waiting), and hand the number to ``Broker.counted(key, n, epoch)``.
    A count of an older ``epoch`` than the group's is void: the group was recounted since."""

    key: int
    first: int
    last: int
    levels: tuple[str, ...]
    epoch: int = 0
    acked: frozenset[int] = frozenset()


class Deliveries(NamedTuple):  # one per write to a subscriber: a tuple, for the same reason
    """What one connection takes in one go: DELIVER batches by subscription id, the queues
    it took from (blocked publishers may go on), the disk reads cursors now wait for, and
    whether a cursor it took from is still more than a batch behind the log's end (a
    backlog drain, which the shell lets live traffic go ahead of)."""

    batches: list[tuple[int, list[bytes]]]
    released: tuple[int, ...]
    fetches: list[Fetch]
    behind: bool = False


def refused(code: ErrorCode, text: str) -> SubscribeResult:
    return SubscribeResult(0, refusal=Refusal(code, text))
