"""The broker core: routing publishes into subscription queues and taking deliveries out.

``Broker`` owns topics (implicitly: a topic exists once something is published to it),
subscriptions, consumer groups and their queues. Every call is synchronous and returns a
small result value; the Trio shell decides whom to wake and what to send. Time comes in as
``now_ms`` (monotonic milliseconds). Never imports trio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from blipmq_server.broker import durable
from blipmq_server.broker.durable import DurableGroup
from blipmq_server.broker.queue import Overflow, Queue
from blipmq_server.broker.topics import matches
from blipmq_server.protocol.codec import (
    DELIVERY_PREFIX,
    FLAG_DEAD,
    MSG_HEAD,
    DeadLetter,
    ErrorCode,
    RawMessage,
    Start,
    dead_trailer,
)
from blipmq_server.protocol.names import filter_problem, group_problem, topic_problem

_ROUTE_CACHE_LIMIT = 8192
_pack_prefix = DELIVERY_PREFIX.pack
_PREFIX_SIZE = DELIVERY_PREFIX.size
# wal.record.Kind values (the core does not import the log package)
MESSAGE_RECORD, GROUP_RECORD, ACK_RECORD = 1, 2, 3


class MessageLog(Protocol):
    """What the core needs of the write-ahead log (tests can pass an in-memory one)."""

    written_offset: int
    next_offset: int

    @property
    def first_offset(self) -> int: ...

    def append(self, kind: int, body: bytes, timestamp_ms: int) -> int: ...

    def append_many(self, kind: int, bodies: Sequence[bytes], timestamp_ms: int) -> int: ...

    def cached(self, offset: int) -> bool:
        """Whether ``read`` at ``offset`` is served from memory (no disk read)."""
        ...

    def read(self, from_offset: int, max_records: int = ..., max_bytes: int = ...) -> list[Any]:
        ...


READ_AHEAD_RECORDS = 4096  # one read for a log cursor: at most this many records
READ_AHEAD_BYTES = 512 * 1024  # ... and about this many bytes (at least one record)
_CACHE_READ_RECORDS = 512  # records a cursor decodes from the log's cache in one go


@dataclass(frozen=True, slots=True)
class Fetch:
    """A log cursor needs records the log holds only on disk: read them off the event loop
    (``MessageLog.read`` from ``offset``, up to the READ_AHEAD limits) and hand them to
    ``Broker.fill(key, records)``."""

    key: int
    offset: int


@dataclass(frozen=True, slots=True)
class Limits:
    """The broker options the core needs (built from the config by the shell)."""

    capacity: int = 8192
    capacity_bytes: int = 64 * 1024 * 1024
    overflow: Overflow = Overflow.BLOCK
    default_ttl_ms: int = 0
    max_message_bytes: int = 8 * 1024 * 1024
    log_qos0: bool = True  # with a log: append QoS 0 messages too
    retry_backoff_ms: int = 5000  # first redelivery deadline of an unacked QoS 1 delivery
    retry_backoff_max_ms: int = 60000  # the deadline doubles per delivery up to this
    max_retries: int = 5  # deliveries before a message goes to $dlq/<topic>
    default_credit: int = 256  # in-flight window of a QoS 1 consumer that asks for 0
    group_expiry_ms: int = 0  # a durable group with no consumer this long is dropped; 0 never


@dataclass(slots=True)
class Counters:
    """Plain counters, read by metrics at scrape time."""

    published: int = 0
    unrouted: int = 0  # accepted, but no subscription matched
    enqueued: int = 0
    delivered: int = 0
    dropped_oldest: int = 0
    dropped_new: int = 0
    dropped_ttl: int = 0
    dropped_no_consumer: int = 0  # a ``block`` queue without consumers made room
    refused: int = 0  # messages answered with an error frame (bad topic, too large, ...)
    acked: int = 0
    redelivered: int = 0
    nacked: int = 0
    dead_lettered: int = 0
    groups_expired: int = 0


class Consumer:
    """One subscriber attachment: a connection's subscription id on a queue."""

    __slots__ = ("conn", "credit", "qos", "queue", "request_id", "sub_id")

    def __init__(
        self, sub_id: int, queue: Queue, conn: int, qos: int, credit: int, request_id: int
    ) -> None:
        self.sub_id = sub_id
        self.queue = queue
        self.conn = conn
        self.qos = qos
        self.credit = credit
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"Consumer({self.sub_id}, {self.queue!r})"


@dataclass(frozen=True, slots=True)
class Refusal:
    code: ErrorCode
    text: str


@dataclass(frozen=True, slots=True)
class Blocked:
    """A full queue with the ``block`` policy, and the connections consuming from it."""

    queue: int  # Queue.id
    name: str  # for errors and logs: "group 'g' on 't'" or "subscription on 't'"
    conns: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PublishResult:
    """``accepted`` messages of the batch were taken; the rest were not looked at.

    ``wake`` are the connections with new deliveries. ``blocked`` is a full queue with the
    ``block`` policy and a consumer that stopped the batch (retry the rest when it has room);
    ``refusal`` says why a message was refused. ``last_offset`` is the last log record
    appended (0: none); ``confirms`` QoS 1 messages were accepted: confirm them once the log
    holds ``last_offset``.
    """

    accepted: int
    wake: set[int]
    blocked: Blocked | None = None
    refusal: Refusal | None = None
    confirms: int = 0
    last_offset: int = 0


@dataclass(frozen=True, slots=True)
class SubscribeResult:
    consumer: Consumer | None
    refusal: Refusal | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """Another connection's subscription that ended because its group was deleted."""

    conn: int
    request_id: int  # of its SUBSCRIBE
    name: str  # "group 'g' on 't'"


@dataclass(frozen=True, slots=True)
class Detached:
    """What ending subscriptions changed: ``released`` queues (by id) no longer hold
    publishers back the way they did (gone, or one consumer fewer); ``wake`` connections
    have deliveries again (the unacked ones of a consumer that left)."""

    released: tuple[int, ...] = ()
    wake: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class UnsubscribeResult:
    count: int
    detached: Detached = Detached()
    ended: tuple[Ended, ...] = ()  # other connections' subscriptions ended (group deleted)
    refusal: Refusal | None = None


def _late_reason(count: int) -> str:
    return f"not acked in time ({count} deliveries)"


def _refused(code: ErrorCode, text: str) -> SubscribeResult:
    return SubscribeResult(None, Refusal(code, text))


@dataclass(slots=True)
class _Route:
    targets: tuple[Queue, ...]
    blockers: tuple[Queue, ...]  # the targets with the block policy


@dataclass
class Broker:
    limits: Limits = field(default_factory=Limits)
    log: MessageLog | None = None

    def __post_init__(self) -> None:
        self.counters = Counters()
        # offset of the last message: the last accepted one without a log, else the last
        # MESSAGE record logged (group and ack records come after it)
        self.offset = 0
        self._bookkeeping = (0, -1)  # the latest run of GROUP/ACK records seen in recovery
        self._queues: list[Queue] = []
        self._groups: dict[tuple[str, str], Queue] = {}
        self._consumers: dict[int, Consumer] = {}
        self._by_conn: dict[int, list[Consumer]] = {}
        self._routes: dict[bytes, _Route | Refusal] = {}
        self._next_sub_id = 1
        self._next_queue_id = 1
        self._durable: dict[tuple[str, str], DurableGroup] = {}
        self._durable_ids: dict[int, DurableGroup] = {}
        self._cursors: list[DurableGroup] = []  # log cursors of subscriptions without a group
        self._by_key: dict[int, DurableGroup] = {}  # every log cursor by its key
        self._next_key = 1
        self._fetches: list[Fetch] = []  # disk reads cursors wait for, not yet handed out

    # ----------------------------------------------------------------------------- publish

    def publish(
        self,
        messages: Sequence[RawMessage],
        now_ms: int,
        timestamp_ms: int = 0,
        internal: bool = False,
    ) -> PublishResult:
        """Route a batch. Stops at the first message refused or blocked by a full queue.

        With a log, every accepted message is appended to it first (QoS 0 ones only when
        ``limits.log_qos0``) and carries its log offset; a QoS 0 message kept out of the log
        carries offset 0. ``timestamp_ms`` (wall clock) is stored in the log records.
        """
        routes = self._routes
        woken: set[Queue] = set()
        add = woken.add
        c = self.counters
        max_bytes = self.limits.max_message_bytes
        default_ttl = self.limits.default_ttl_ms
        log = self.log
        log_qos0 = self.limits.log_qos0
        offset = self.offset
        # records to log, appended in one call after the loop: offsets are assigned in order
        logged: list[bytes] | None = None if log is None else []
        next_logged = 0 if log is None else log.next_offset
        confirms = 0
        accepted = 0
        refusal: Refusal | None = None
        blocked: Queue | None = None
        block, drop_oldest = Overflow.BLOCK, Overflow.DROP_OLDEST
        for m in messages:
            route = None if internal else routes.get(m.topic)
            if route is None:
                route = self._resolve(m.topic, internal)
            if route.__class__ is Refusal:
                refusal = route  # type: ignore[assignment]
                break
            if m.payload_len > max_bytes:
                refusal = Refusal(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message of {m.payload_len} bytes exceeds max_message_bytes ({max_bytes})",
                )
                break
            if m.qos and logged is None:
                refusal = Refusal(
                    ErrorCode.UNSUPPORTED, "QoS 1 needs the write-ahead log (wal.enabled = false)"
                )
                break
            size = len(m.record) + _PREFIX_SIZE
            # Only a queue somebody consumes from holds publishers back. A broker-made
            # message (dead letter) never waits: a full ``block`` queue drops its copy
            # (counted as drop_new); the log keeps it either way.
            if not internal:
                for q in route.blockers:  # type: ignore[union-attr]
                    items = q.items
                    if q.consumers and (len(items) >= q.capacity or (
                            items and q.size + size > q.capacity_bytes)):
                        blocked = q
                        break
                if blocked is not None:
                    break
            if logged is None:
                offset += 1
            elif m.qos or log_qos0:
                logged.append(m.record)
                offset = next_logged
                next_logged += 1
                if m.qos:
                    confirms += 1
            else:
                offset = 0
            accepted += 1
            targets = route.targets  # type: ignore[union-attr]
            if not targets:
                c.unrouted += 1
                continue
            ttl = m.ttl_ms or default_ttl
            item = (_pack_prefix(offset, 1) + m.record, now_ms + ttl if ttl else 0)
            for q in targets:
                items = q.items
                if len(items) >= q.capacity or (items and q.size + size > q.capacity_bytes):
                    overflow = q.overflow
                    if overflow is drop_oldest:
                        n = q.make_room(size)
                        q.dropped_oldest += n
                        c.dropped_oldest += n
                    elif overflow is block and not q.consumers:
                        n = q.make_room(size)
                        q.dropped_no_consumer += n
                        c.dropped_no_consumer += n
                    else:  # DROP_NEW, or BLOCK for a dead letter (client messages wait above)
                        q.dropped_new += 1
                        c.dropped_new += 1
                        continue
                items.append(item)
                q.size += size
                if ttl:
                    q.expiring = True
                c.enqueued += 1
                add(q)
        last_logged = 0
        if logged is None:
            self.offset = offset
        elif logged:
            log.append_many(MESSAGE_RECORD, logged, timestamp_ms)  # type: ignore[union-attr]
            self.offset = last_logged = next_logged - 1
        c.published += accepted
        if refusal is not None:
            c.refused += 1
        wake = {consumer.conn for q in woken for consumer in q.consumers}
        return PublishResult(
            accepted, wake,
            None if blocked is None else Blocked(
                blocked.id, blocked.name, tuple(x.conn for x in blocked.consumers)),
            refusal, confirms, last_logged)

    def _resolve(self, topic: bytes, internal: bool = False) -> _Route | Refusal:
        """Which queues a topic goes to (cached until the subscriptions change)."""
        if len(self._routes) >= _ROUTE_CACHE_LIMIT:
            self._routes.clear()
        try:
            name = topic.decode("utf-8")
        except UnicodeDecodeError:
            route: _Route | Refusal = Refusal(ErrorCode.INVALID_TOPIC, "topic is not valid UTF-8")
        else:
            problem = None if internal else topic_problem(name)
            if problem:
                route = Refusal(ErrorCode.INVALID_TOPIC, problem)
            else:
                levels = tuple(name.split("/"))
                targets = tuple(q for q in self._queues if matches(q.levels, levels))
                blockers = tuple(q for q in targets if q.overflow is Overflow.BLOCK)
                route = _Route(targets, blockers)
        if not internal:  # broker-made topics ($dlq/...) must not open the cache to clients
            self._routes[topic] = route
        return route

    # ------------------------------------------------------------------------ subscriptions

    def subscribe(
        self,
        conn: int,
        topic_filter: str,
        group: str = "",
        qos: int = 0,
        credit: int = 0,
        request_id: int = 0,
        start: int = Start.LATEST,
        start_offset: int = 0,
        timestamp_ms: int = 0,
    ) -> SubscribeResult:
        """Attach ``conn`` (a connection) to a new subscription or to a group.

        QoS 0 without ``start``: an in-memory queue (shared by a group's consumers). QoS 1, or
        a ``start`` other than LATEST: a cursor into the log, which is a durable group when
        named (``start`` then only matters when the group is new).
        """
        problem = filter_problem(topic_filter) or (group_problem(group) if group else None)
        if problem:
            code = ErrorCode.INVALID_TOPIC if "filter" in problem else ErrorCode.INVALID_REQUEST
            return SubscribeResult(None, Refusal(code, problem))
        if qos or start != Start.LATEST:
            return self._subscribe_cursor(conn, topic_filter, group, qos, credit, request_id,
                                          start, start_offset, timestamp_ms)
        queue = self._groups.get((topic_filter, group)) if group else None
        if queue is None:
            limits = self.limits
            queue = Queue(self._next_queue_id, topic_filter, group or None, limits.capacity,
                          limits.overflow, limits.capacity_bytes)
            self._next_queue_id += 1
            self._queues.append(queue)
            if group:
                self._groups[(topic_filter, group)] = queue
            self._routes.clear()
        consumer = Consumer(self._next_sub_id, queue, conn, qos, credit, request_id)
        self._next_sub_id += 1
        queue.consumers.append(consumer)
        self._consumers[consumer.sub_id] = consumer
        self._by_conn.setdefault(conn, []).append(consumer)
        return SubscribeResult(consumer)

    def _subscribe_cursor(
        self, conn: int, topic_filter: str, group: str, qos: int, credit: int,
        request_id: int, start: int, start_offset: int, timestamp_ms: int,
    ) -> SubscribeResult:
        log = self.log
        if log is None:
            what = "QoS 1" if qos else "--from (replay)"
            return _refused(ErrorCode.UNSUPPORTED, f"{what} needs the write-ahead log "
                            "(wal.enabled = false)")
        if group and not qos:
            return _refused(ErrorCode.UNSUPPORTED, "a QoS 0 group lives in memory and cannot "
                            "replay the log: use QoS 1 for a durable group")
        if (topic_filter, group) in self._groups:
            return _refused(ErrorCode.INVALID_REQUEST,
                            f"group {group!r} on {topic_filter!r} already exists as a QoS 0 group")
        target = self._durable.get((topic_filter, group)) if group else None
        if target is None:
            if start == Start.EARLIEST:
                first = log.first_offset
            elif start == Start.OFFSET:
                if start_offset > log.next_offset:
                    return _refused(ErrorCode.INVALID_REQUEST,
                                    f"offset {start_offset} is past the end of the log "
                                    f"(the next message gets offset {log.next_offset})")
                first = max(start_offset, log.first_offset)
            else:
                first = log.next_offset
            if group:
                gid = log.append(GROUP_RECORD, durable.group_body(
                    durable.CREATE, first, topic_filter, group), timestamp_ms)
                target = self._add_durable(gid, topic_filter, group, first)
            else:
                target = DurableGroup(0, topic_filter, "", first, persistent=False, acks=bool(qos))
                self._cursors.append(target)
                self._keep(target)
        target.idle_since = None
        credit = (credit or self.limits.default_credit) if qos else 0xFFFFFFFF
        consumer = Consumer(self._next_sub_id, target, conn, qos, credit,  # type: ignore[arg-type]
                            request_id)
        self._next_sub_id += 1
        target.consumers.append(consumer)
        self._consumers[consumer.sub_id] = consumer
        self._by_conn.setdefault(conn, []).append(consumer)
        return SubscribeResult(consumer)

    def _add_durable(
        self, gid: int, topic_filter: str, group: str, start: int, idle_since: int | None = None
    ) -> DurableGroup:
        target = DurableGroup(gid, topic_filter, group, start, idle_since=idle_since)
        self._durable[(topic_filter, group)] = target
        self._durable_ids[gid] = target
        self._keep(target)
        return target

    def _keep(self, target: DurableGroup) -> None:
        target.key = self._next_key
        self._next_key += 1
        self._by_key[target.key] = target

    def recover(self, record: Any) -> None:
        """Rebuild durable groups from a GROUP or ACK record met while the log is opened.

        A group whose last record is IDLE has been without a consumer since then; any other
        group is taken as idle from the restart (``idle_since`` None until ``recovered``).
        """
        first, last = self._bookkeeping
        self._bookkeeping = (first if record.offset == last + 1 else record.offset, record.offset)
        if record.kind == GROUP_RECORD:
            g = durable.parse_group(record.body)
            target = self._durable.get((g.topic_filter, g.group))
            if g.op == durable.CREATE:
                self._add_durable(record.offset, g.topic_filter, g.group, g.start)
            elif g.op == durable.CHECKPOINT:
                if target is None:
                    target = self._add_durable(g.group_id, g.topic_filter, g.group, g.start)
                target.restore(g)
                target.anchor = record.offset
                target.idle_since = None
            elif g.op == durable.IDLE:
                if target is not None:
                    target.idle_since = record.timestamp_ms
            elif target is not None:
                del self._durable[(g.topic_filter, g.group)]
                self._durable_ids.pop(target.id, None)
                self._by_key.pop(target.key, None)
        elif record.kind == ACK_RECORD:
            gid, floor, offsets = durable.parse_ack(record.body)
            target = self._durable_ids.get(gid)
            if target is not None:
                target.recover_ack(floor, offsets)
                target.idle_since = None

    def checkpoint(self, timestamp_ms: int, below: int) -> int:
        """Restate every durable group whose anchor (create or checkpoint record) is below
        offset ``below`` in a new checkpoint record, so that retention may delete the old
        segments. Returns the offset of the last record appended (0: none)."""
        log = self.log
        last = 0
        if log is None:
            return 0
        for target in self._durable.values():
            if target.anchor >= below:
                continue
            last = target.anchor = log.append(GROUP_RECORD, durable.checkpoint_body(target),
                                              timestamp_ms)
            if target.idle_since is not None and not target.consumers:
                last = log.append(GROUP_RECORD, durable.group_body(
                    durable.IDLE, 0, target.filter, target.group), target.idle_since)
        return last

    def skip_to(self, first: int) -> list[tuple[DurableGroup, int]]:
        """Retention removed the log below ``first``: durable groups whose cursor was lower
        skip what they had not read (counted in ``group.skipped``). Deliveries already in
        flight are kept (they are in memory); unacked ones not yet reloaded are lost."""
        out = []
        for target in self._durable.values():
            skipped = max(0, first - target.next) + sum(1 for o in target.pending if o < first)
            if not skipped:
                continue
            target.move_to(first)
            target.pending = {o for o in target.pending if o >= first}
            target.skipped += skipped
            out.append((target, skipped))
        return out

    def recovered(self, wall_ms: int) -> None:
        """The log is open: groups not known to be idle count as idle from now."""
        if self.log is not None:
            first, last = self._bookkeeping
            end = self.log.next_offset - 1  # offsets run on without gaps within the log
            self.offset = first - 1 if last == end else end
        for target in self._durable.values():
            if target.idle_since is None and not target.consumers:
                target.idle_since = wall_ms

    @property
    def durable_groups(self) -> tuple[DurableGroup, ...]:
        return tuple(self._durable.values())

    def cursor_conns(self) -> set[int]:
        """Connections consuming from a log cursor (they may deliver once the log grows)."""
        return {c.conn for target in self.cursors for c in target.consumers}

    @property
    def cursors(self) -> tuple[DurableGroup, ...]:
        """Every log cursor: durable groups and subscriptions without a group."""
        return (*self._durable.values(), *self._cursors)

    def durable_floor(self) -> int | None:
        """The lowest offset a durable group still needs (for log retention)."""
        return min((g.floor for g in self._durable.values()), default=None)

    def ack(self, conn: int, sub_id: int, offsets: tuple[int, ...], timestamp_ms: int) -> bool:
        """A QoS 1 consumer acked deliveries; True when that freed room in its window."""
        consumer = self._owned(conn, sub_id)
        if consumer is None:
            return False
        target = consumer.queue
        if not isinstance(target, DurableGroup) or self.log is None:
            return False  # QoS 0 deliveries need no ack
        done = target.ack(sub_id, offsets)
        if done:
            self.counters.acked += len(done)
            if target.persistent:
                self.log.append(ACK_RECORD, durable.ack_body(target.id, target.floor, done),
                                timestamp_ms)
        return bool(done)

    def set_credit(self, conn: int, sub_id: int, credit: int) -> bool:
        """A QoS 1 consumer changes its window; True when it now has room for more.

        Ignored (False) for QoS 0 subscriptions and for ids this conn does not hold."""
        consumer = self._owned(conn, sub_id)
        if consumer is None or not consumer.qos:
            return False
        grew = credit > consumer.credit
        consumer.credit = credit
        return grew

    def nack(
        self, conn: int, sub_id: int, offsets: tuple[int, ...], delay_ms: int, now_ms: int,
        timestamp_ms: int,
    ) -> frozenset[int]:
        """A QoS 1 consumer gives deliveries back, to be redelivered now or after
        ``delay_ms``; one delivered ``max_retries`` times goes to ``$dlq/<topic>`` instead.
        Returns the connections to wake (the cursor's consumers, when anything came back)."""
        consumer = self._owned(conn, sub_id)
        if consumer is None:
            return frozenset()
        target = consumer.queue
        if not isinstance(target, DurableGroup):
            return frozenset()
        mine = target.held_by(sub_id, offsets)
        self.counters.nacked += len(mine)
        reason = f"nacked with a delay of {delay_ms} ms" if delay_ms else "nacked"
        target.back(self._spend(target, mine, lambda _: reason, now_ms, timestamp_ms),
                    now_ms, delay_ms)
        return frozenset(c.conn for c in target.consumers) if mine else frozenset()

    def _spend(
        self, target: DurableGroup, offsets: list[int], reason: Callable[[int], str],
        now_ms: int, timestamp_ms: int,
    ) -> list[int]:
        """Dead-letter those of ``offsets`` delivered ``max_retries`` times (``reason`` of
        their delivery count); returns the others, in order, to be given back."""
        back = []
        for offset in offsets:
            count = target.inflight[offset].count
            if count >= self.limits.max_retries:
                self._give_up(target, offset, reason(count), now_ms, timestamp_ms)
            else:
                back.append(offset)
        return back

    def _backoff(self, count: int) -> int:
        base = self.limits.retry_backoff_ms
        return min(base << min(count - 1, 20), self.limits.retry_backoff_max_ms)

    def has_work(self, consumer: Consumer) -> bool:
        """Whether ``take`` would hand this consumer something now."""
        target = consumer.queue
        if not isinstance(target, DurableGroup):
            return bool(target.items)
        if target.in_flight_for(consumer.sub_id) >= consumer.credit:
            return False
        log = self.log
        return bool(target.ready or target.pending or target.ahead) or (
            not target.fetching and log is not None and target.next <= log.written_offset
        )

    def _take_durable(
        self, consumer: Consumer, target: DurableGroup, limit: int, max_bytes: int,
        now_ms: int, wall_ms: int,
    ) -> list[bytes]:
        log = self.log
        assert log is not None
        room = min(limit, consumer.credit - target.in_flight_for(consumer.sub_id))
        if room <= 0:
            return []
        if target.pending:  # unacked before a restart, named by a checkpoint
            target.load_pending([r for o in sorted(target.pending)
                                 for r in log.read(o, max_records=1)
                                 if r.kind == MESSAGE_RECORD])
        out, size = target.take_ready(consumer.sub_id, room, max_bytes, now_ms, self._backoff)
        self.counters.redelivered += len(out)
        for _ in range(8):  # each round looks at one read-ahead's worth of records
            if len(out) >= room or size >= max_bytes or target.next > log.written_offset:
                break
            if not target.ahead:
                if target.fetching:
                    break
                if not log.cached(target.next):  # on disk: read off the event loop
                    target.fetching = True
                    self._fetches.append(Fetch(target.key, target.next))
                    break
                # from memory, on the caller's thread: a batch's worth at a time
                target.fill(log.read(target.next, _CACHE_READ_RECORDS, max_bytes))
                if not target.ahead:
                    target.move_to(log.written_offset + 1)
                    break
            new, size, expired, full = target.take_new(
                consumer.sub_id, room - len(out), max_bytes, size, now_ms, wall_ms,
                self._backoff)
            self.counters.dropped_ttl += expired
            out += new
            if full:
                break
        self.counters.delivered += len(out)
        return out

    def take_fetches(self) -> list[Fetch]:
        """The disk reads log cursors are waiting for (each handed out once)."""
        fetches, self._fetches = self._fetches, []
        return fetches

    def fill(self, key: int, records: list[Any]) -> frozenset[int]:
        """Records read for ``Fetch(key, ...)``; returns the connections to wake. An empty
        read below the oldest record still in the log moves the cursor there."""
        target = self._by_key.get(key)
        if target is None:  # the cursor is gone meanwhile
            return frozenset()
        target.fetching = False
        target.fill(records)
        if not target.ahead and self.log is not None:
            target.move_to(self.log.first_offset)
        return frozenset(c.conn for c in target.consumers)

    def redeliver(self, now_ms: int, timestamp_ms: int) -> frozenset[int]:
        """Maintenance: unacked deliveries past their deadline go back to their cursor (or to
        ``$dlq/<topic>`` after ``max_retries`` deliveries), and delayed nacks come due.
        Returns the connections to wake."""
        woken: set[int] = set()
        for target in self.cursors:
            late, due = target.expire(now_ms)
            target.back(self._spend(target, late, _late_reason, now_ms, timestamp_ms))
            if late or due:
                woken.update(c.conn for c in target.consumers)
        return frozenset(woken)

    def _give_up(
        self, target: DurableGroup, offset: int, reason: str, now_ms: int, timestamp_ms: int
    ) -> None:
        """Move a delivery that exhausted its retries to ``$dlq/<its topic>``. A durable group
        records it as done after the dead letter, so a restart does not deliver it again."""
        flight = target.drop(offset)
        self._dead_letter(flight.body, DeadLetter(flight.count, reason), now_ms, timestamp_ms)
        if target.persistent and self.log is not None:
            self.log.append(ACK_RECORD, durable.ack_body(target.id, target.floor, [offset]),
                            timestamp_ms)

    def _dead_letter(self, body: bytes, dead: DeadLetter, now_ms: int, timestamp_ms: int) -> None:
        """Publish a message that exhausted its retries to ``$dlq/<its topic>``, with its
        delivery count and the reason in the dead-letter trailer."""
        flags, ttl, tlen, klen, plen = MSG_HEAD.unpack_from(body)
        topic = b"$dlq/" + body[13 : 13 + tlen]
        rest = body[13 + tlen : 13 + tlen + klen + plen]  # an older trailer is replaced
        record = b"".join((
            MSG_HEAD.pack(flags | FLAG_DEAD, ttl, len(topic), klen, plen), topic, rest,
            dead_trailer(dead),
        ))
        self.counters.dead_lettered += 1
        self.publish([RawMessage(topic, flags & 1, ttl, plen, record)], now_ms, timestamp_ms,
                     internal=True)

    def expire_groups(self, wall_ms: int) -> list[DurableGroup]:
        """Maintenance: drop durable groups without a consumer for ``group_expiry_ms``."""
        expiry = self.limits.group_expiry_ms
        if not expiry:
            return []
        gone = [t for t in self._durable.values()
                if not t.consumers and t.idle_since is not None
                and wall_ms - t.idle_since >= expiry]
        for target in gone:
            self._delete_durable(target, wall_ms)
        self.counters.groups_expired += len(gone)
        return gone

    def _delete_durable(self, target: DurableGroup, timestamp_ms: int) -> None:
        del self._durable[(target.filter, target.group)]
        self._durable_ids.pop(target.id, None)
        self._by_key.pop(target.key, None)
        if self.log is not None:
            self.log.append(GROUP_RECORD, durable.group_body(
                durable.DELETE, 0, target.filter, target.group), timestamp_ms)

    def unsubscribe(
        self, conn: int, sub_id: int = 0, topic_filter: str = "", group: str = "",
        timestamp_ms: int = 0,
    ) -> UnsubscribeResult:
        """End one subscription (by id), this conn's subscriptions on a filter, or a group."""
        if sub_id:
            consumer = self._owned(conn, sub_id)
            if consumer is None:
                return UnsubscribeResult(
                    0, refusal=Refusal(ErrorCode.NOT_FOUND, f"no subscription {sub_id}")
                )
            return UnsubscribeResult(1, self._detach_all([consumer], timestamp_ms))
        if group:
            target: Queue | DurableGroup | None = self._durable.get((topic_filter, group))
            if target is not None:
                self._delete_durable(target, timestamp_ms)  # type: ignore[arg-type]
                released: tuple[int, ...] = ()
            else:
                target = self._groups.pop((topic_filter, group), None)
                if target is None:
                    return UnsubscribeResult(0, refusal=Refusal(
                        ErrorCode.NOT_FOUND,
                        f"no group {group!r} on topic filter {topic_filter!r}"))
                self._drop_queue(target)
                released = (target.id,)
            name = f"group {group!r} on {topic_filter!r}"
            ended = tuple(Ended(c.conn, c.request_id, name)
                          for c in target.consumers if c.conn != conn)
            for consumer in target.consumers:
                self._forget(consumer)
            target.consumers.clear()
            return UnsubscribeResult(1, Detached(released), ended)
        mine = [
            c for c in self._by_conn.get(conn, ())
            if c.queue.filter == topic_filter and not c.queue.group  # no group, any kind
        ]
        return UnsubscribeResult(len(mine), self._detach_all(mine, timestamp_ms))

    def disconnect(self, conn: int, timestamp_ms: int = 0) -> Detached:
        """A connection is gone: end its subscriptions. Groups keep their queues."""
        detached = self._detach_all(list(self._by_conn.get(conn, ())), timestamp_ms)
        self._by_conn.pop(conn, None)
        return detached

    def _owned(self, conn: int, sub_id: int) -> Consumer | None:
        """The subscription ``sub_id`` if ``conn`` holds it (else None: ignored or refused)."""
        consumer = self._consumers.get(sub_id)
        return consumer if consumer is not None and consumer.conn == conn else None

    def consumers_of(self, conn: int) -> list[Consumer]:
        return self._by_conn.get(conn, [])

    def _detach_all(self, consumers: list[Consumer], timestamp_ms: int) -> Detached:
        released: list[int] = []
        wake: set[int] = set()
        for consumer in consumers:
            self._detach(consumer, timestamp_ms, released, wake)
        return Detached(tuple(released), frozenset(wake))

    def _detach(
        self, consumer: Consumer, timestamp_ms: int, released: list[int], wake: set[int]
    ) -> None:
        self._forget(consumer)
        queue = consumer.queue
        if consumer in queue.consumers:
            queue.consumers.remove(consumer)
        if isinstance(queue, DurableGroup):
            if not queue.persistent:
                if queue in self._cursors:
                    self._cursors.remove(queue)
                    self._by_key.pop(queue.key, None)
            elif not queue.consumers and self._durable.get((queue.filter, queue.group)) is queue:
                queue.idle_since = timestamp_ms
                if self.log is not None:
                    self.log.append(GROUP_RECORD, durable.group_body(
                        durable.IDLE, 0, queue.filter, queue.group), timestamp_ms)
            if queue.requeue(consumer.sub_id):
                wake.update(c.conn for c in queue.consumers)
            return
        released.append(queue.id)
        if queue.group is None:
            self._drop_queue(queue)

    def _forget(self, consumer: Consumer) -> None:
        self._consumers.pop(consumer.sub_id, None)
        mine = self._by_conn.get(consumer.conn)
        if mine and consumer in mine:
            mine.remove(consumer)

    def _drop_queue(self, queue: Queue) -> None:
        if queue in self._queues:
            self._queues.remove(queue)
            self._routes.clear()

    # ---------------------------------------------------------------------------- delivery

    def take(
        self, consumer: Consumer, limit: int, max_bytes: int, now_ms: int, wall_ms: int = 0
    ) -> list[bytes]:
        """Up to ``limit`` delivery records (and about ``max_bytes``) for one consumer.

        Expired items met on the way are dropped and counted, so an expired message is never
        handed out. A group's consumers each take a fair share of what is waiting.
        """
        queue = consumer.queue
        if isinstance(queue, DurableGroup):
            return self._take_durable(consumer, queue, limit, max_bytes, now_ms, wall_ms)
        items = queue.items
        if not items:
            return []
        sharers = len(queue.consumers)
        if sharers > 1:
            limit = min(limit, -(-len(items) // sharers))
        out: list[bytes] = []
        size = expired_size = 0
        expired = 0
        popleft = items.popleft
        while items and len(out) < limit:
            record, expires = items[0]
            if expires and expires <= now_ms:
                popleft()
                expired += 1
                expired_size += len(record)
                continue
            if out and size + len(record) > max_bytes:
                break
            popleft()
            out.append(record)
            size += len(record)
        queue.size -= size + expired_size
        if expired:
            queue.dropped_ttl += expired
            self.counters.dropped_ttl += expired
        self.counters.delivered += len(out)
        return out

    def tick(self, now_ms: int) -> int:
        """Maintenance: drop expired messages from every queue; returns how many."""
        removed = sum(q.purge_expired(now_ms) for q in self._queues)
        self.counters.dropped_ttl += removed
        return removed

    # ------------------------------------------------------------------------------- views

    @property
    def queues(self) -> tuple[Queue, ...]:
        return tuple(self._queues)

    def group(self, topic_filter: str, group: str) -> Queue | None:
        return self._groups.get((topic_filter, group))
