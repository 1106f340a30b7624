"""The broker core: routing publishes into subscription queues and taking deliveries out.

``Broker`` is the one thing the shell talks to. It routes messages (the hot path, here),
keeps the books of who consumes what (``registry``), drives log cursors (``cursors``) and
answers every call with a small value in ids (``results``): which connections to wake, which
queue blocks a publisher and who consumes from it, what was appended to the log, which disk
reads cursors wait for. Topics exist once something is published to them. Time comes in as
``now_ms`` (monotonic) and ``timestamp_ms``/``wall_ms`` (wall clock).
Pure and synchronous: never imports trio, never sleeps, never reads a clock.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from heapq import nlargest
from itertools import islice
from typing import Any

from blipmq_server.broker.access import FULL, Access, matches
from blipmq_server.broker.cursors import Cursors
from blipmq_server.broker.durable import BRIDGE_GROUPS, DurableGroup
from blipmq_server.broker.queue import Overflow, Pool, Queue
from blipmq_server.broker.registry import Consumer, Registry, Route
from blipmq_server.broker.results import (
    Blocked,
    Count,
    Counters,
    Deliveries,
    Detached,
    Ended,
    Fetch,
    Limits,
    PublishResult,
    Refusal,
    SubscribeResult,
    UnsubscribeResult,
    refused,
)
from blipmq_server.broker.retained import Retained, Value, carry_body, parse_carry, topic_of
from blipmq_server.broker.shares import RetainedShares
from blipmq_server.broker.storage import MessageLog, StoredRecord, Unwritten
from blipmq_server.broker.usage import Usage
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import ErrorCode, RawMessage, Start
from blipmq_server.protocol.message import (
    DELIVERED_RETAINED,
    DELIVERY_PREFIX,
    FLAG_RETAIN,
    MSG_HEAD,
    PREFIX_SIZE,
    record_size,
)
from blipmq_server.protocol.names import filter_problem, group_problem

_pack_prefix = DELIVERY_PREFIX.pack
_BLOCK, _DROP_OLDEST = Overflow.BLOCK, Overflow.DROP_OLDEST  # an enum member costs a lookup
_MESSAGE = Kind.MESSAGE
_STATE_KEY = struct.Struct(">H")  # STATE body: | key_len u16 | key | value |
_ROUSE_ALL_MS = 1000  # dozing consumers are looked at this often (``redeliver``)


def _dozes(consumer: Consumer) -> bool:
    """Whether ``consumer`` may go on dozing: its cursor is idle (``Broker._nothing_for``)."""
    return consumer.until is None and consumer.queue.idle  # type: ignore[union-attr]


# ``Broker.copy_of``: what a subscription did with a message another one has a copy of
OWES, SETTLED, NEVER = 0, 1, 2
_BRIDGES_ONLY = ("group names starting with 'bridge.' belong to bridges (docs/BRIDGE.md): "
                 "no client may join one, or delete a configured bridge's")


def _check_message(record: bytes) -> None:
    """Raise ValueError (or struct.error) unless ``record`` holds a whole message record."""
    size = record_size(record)
    if size > len(record):
        raise ValueError(f"a message record of {size} bytes in {len(record)}")


def _charge(pools: tuple[tuple[Pool, int], ...], size: int) -> int:
    """Charge ``pools`` what ``size`` bytes to each target cost (each pool times its count);
    returns 0, what is owed them then."""
    for p, k in pools:
        p.size += k * size
    return 0


def _uncharge(pools: tuple[tuple[Pool, int], ...], last: Pool, size: int) -> None:
    """Take back what a message of ``size`` bytes charged ``pools``, up to ``last``."""
    for p, k in pools:
        p.size -= k * size
        if p is last:
            return


def _durable_row(g: DurableGroup) -> dict[str, Any]:
    return {"filter": g.filter, "group": g.group, "durable": True, "backlog": max(0, g.backlog),
            "in_flight": len(g.inflight), "consumers": len(g.consumers), "skipped": g.skipped}


def _memory_row(topic_filter: str, group: str, q: Queue) -> dict[str, Any]:
    return {"filter": topic_filter, "group": group, "durable": False, "backlog": q.backlog,
            "in_flight": 0, "consumers": len(q.consumers),
            "dropped": q.dropped_oldest + q.dropped_new + q.dropped_ttl + q.dropped_no_consumer}


def _owner_key(topic_filter: str, group: str) -> bytes:
    """The STATE key of a group's owner: ``owner/<group>`` NUL ``<filter>``."""
    return b"owner/" + group.encode("utf-8") + b"\x00" + topic_filter.encode("utf-8")


class Broker:
    """The core (see the module's docstring); ``log`` None: no durability, nothing logged."""

    def __init__(self, limits: Limits | None = None, log: MessageLog | None = None) -> None:
        self.limits = Limits() if limits is None else limits
        self.log = log
        self.counters = Counters()
        # offset of the last message: the last accepted one without a log, else the last
        # MESSAGE record logged (group and ack records come after it)
        self.offset = 0
        self._bookkeeping = (0, -1)  # the latest run of GROUP/ACK records seen in recovery
        self.registry = Registry(self.limits)
        self.cursors = (None if self.log is None
                        else Cursors(self.limits, self.log, self.counters))
        self.retained = Retained(self.limits.retained_max_topics, self.limits.retained_max_bytes)
        self.retained_shares = RetainedShares()  # whose retained values are which
        # durable groups by the key that owns them (those with an owner), against each
        # key's ``Quota.durable_groups``
        self.groups_held: dict[str, int] = {}
        self.usage = Usage(self._durable_matching, woken=self._rouse)
        self._generation = 0  # of the durable groups ``usage`` knows
        self._roused_at = 0  # when ``redeliver`` last looked at the dozing consumers (ms)
        # front ends' saved state (MQTT persistent sessions), by key, and its record's offset
        self.states: dict[bytes, bytes] = {}
        self._state_at: dict[bytes, int] = {}
        # what a front end checks of its keys' values at recovery: a key prefix -> a
        # function raising ValueError for a value it cannot read (the record is then set
        # aside as damage, as one whose body does not parse)
        self.state_checks: dict[bytes, Callable[[bytes, bytes], object]] = {}
        # each key's newest STATE record, a value or a deletion, while it may be unwritten
        # (``relog`` restates those of a batch the disk refused; pruned once written)
        self._state_recent: Unwritten[bytes] = Unwritten(self.log)
        self._cleared: Unwritten[bytes] = Unwritten(self.log)  # retained values cleared
        self._group_owners: dict[bytes, str] = {}  # by _owner_key, while the broker runs
        # publishers held back (``hold``): by hold id, its name and topic filters
        self.holds: dict[int, tuple[str, tuple[str, ...]]] = {}
        # queues that dropped messages when full since ``take_dropping`` (the shell logs it)
        self.dropping: dict[Queue, None] = {}
        # the groups of the configured bridges (``bridge.<name>``): nobody deletes these;
        # one whose bridge is gone from the configuration may be deleted like any group
        self.bridged: frozenset[str] = frozenset()
        self._turn = 0  # which consumer goes first in a ``deliver`` with a shared ``total``

    # ----------------------------------------------------------------------------- publish

    def publish(
        self,
        messages: Sequence[RawMessage],
        now_ms: int,
        timestamp_ms: int = 0,
        internal: bool = False,
        access: Access | None = None,
        unkept: bool = False,
    ) -> PublishResult:
        """Route a batch. Stops at the first message refused or blocked by a full queue.

        With a log, every accepted message is appended to it first (QoS 0 ones only when
        ``limits.log_qos0``) and carries its log offset; a QoS 0 message kept out of the log
        carries offset 0. ``timestamp_ms`` (wall clock) is stored in the log records.
        ``internal`` messages (dead letters) never wait for room and may use '$' topics.
        ``access``: the publisher's permissions (None: no limits); a message to a topic it
        may not publish to is refused (FORBIDDEN) with the rest of the batch.
        ``unkept``: a retained message the retained store or the key's share of it has no
        room for is routed and logged without retain instead of refused (LIMIT), only its
        value not kept (MQTT: 3.1.1 cannot refuse a publish); the result's ``unkept`` counts
        them, ``unkept_topic`` and ``unkept_text`` say which was the first and why.

        Counted: each message accepted (``published``) and the one refused (``refused``);
        the rest of a batch after a refusal was not looked at, and is the caller's.
        """
        if access is not None and access.unlimited:
            access = None
        if len(messages) == 1 and not internal:
            done = self._publish_one(messages[0], now_ms, timestamp_ms, access)
            if done is not None:
                return done
        routes = self.registry.routes
        resolve = self.registry.resolve
        woken: dict[Queue, None] = {}  # in the order messages reached them
        woken_by: tuple[Queue, ...] | None = None
        room_route: Route | Refusal | None = None
        room_n = room_b = 0
        # bytes each target of ``room_route`` took since its pools were last charged: they
        # are charged (each pool times its count) before anything looks at them again
        owed = 0
        total = self.registry.total
        enqueued = 0
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
        block, drop_oldest = _BLOCK, _DROP_OLDEST
        blocked_hold: Blocked | None = None
        not_kept = 0
        not_kept_topic = b""
        not_kept_text = ""
        usage = self.usage
        entries = usage.entries
        if self.cursors is not None and self.cursors.generation != self._generation:
            self._generation = self.cursors.generation
            usage.regroup()
        # per-topic usage is counted per run of messages with the same route (one topic),
        # in locals, and added to the topic's entry when the run ends
        run_route: Route | Refusal | None = None
        run_entry = None
        run_from = run_first = run_bytes = run_unlogged = 0
        holds = None if internal or not self.holds else self.holds
        for m in messages:
            if holds is not None:
                held = self._held(m.topic, holds)
                if held is not None:
                    blocked_hold = held
                    break
            route = None if internal else routes.get(m.topic)
            if route is None:
                route = resolve(m.topic, internal)
            if route.__class__ is Refusal:
                refusal = route  # type: ignore[assignment]
                break
            if access is not None and not access.may_publish(m.topic):
                refusal = Refusal(ErrorCode.FORBIDDEN, "this key may not publish to "
                                  f"{m.topic.decode('utf-8', 'replace')!r}")
                break
            if m.payload_len > max_bytes:  # the quick test; the refusal is the limits'
                refusal = self.limits.size_refusal(0, m.payload_len)
                break
            if m.qos and logged is None:
                refusal = Refusal(
                    ErrorCode.UNSUPPORTED, "QoS 1 needs the write-ahead log (wal.enabled = false)"
                )
                break
            size = len(m.record) + PREFIX_SIZE
            targets = route.targets  # type: ignore[union-attr]
            # Room left in every target (messages and bytes) since this route was last
            # looked at: while both stay positive no target is full, and the checks below
            # are skipped (the hot path of a batch to one topic). Another route in between
            # may fill shared queues, so a new route is looked at afresh.
            if route is not room_route:
                if owed:
                    owed = _charge(room_route.pools, owed)  # type: ignore[union-attr]
                room_route = route
                room_n = room_b = 1 << 62
                for q in targets:
                    if q.capacity - len(q.items) < room_n:
                        room_n = q.capacity - len(q.items)
                    if q.capacity_bytes - q.size < room_b:
                        room_b = q.capacity_bytes - q.size
                for p, k in route.pools:  # type: ignore[union-attr]
                    if (p.limit - p.size) // k < room_b:
                        room_b = (p.limit - p.size) // k
            room_n -= 1
            room_b -= size
            tight = room_n < 0 or room_b < 0
            if tight:
                if owed:
                    owed = _charge(route.pools, owed)  # type: ignore[union-attr]
                room_route = None  # look again at the next message
                # Only a queue somebody consumes from holds publishers back. A broker-made
                # message (dead letter) never waits: a full ``block`` queue drops its copy
                # (counted as drop_new); the log keeps it either way.
                if not internal:
                    for q in route.blockers:  # type: ignore[union-attr]
                        if q.consumers and self._holds_back(q, route, size):  # type: ignore[arg-type]
                            blocked = q
                            break
                    if blocked is not None:
                        break
            if route is not run_route:  # a run of messages to one topic begins
                if run_route is not None:
                    usage.add(run_entry, accepted - run_from,  # type: ignore[arg-type]
                              run_bytes, run_unlogged, run_first)
                run_route = route
                run_entry = entries.get(m.topic) or usage.entry(m.topic)
                run_from = accepted
                run_first = next_logged  # the offset its first logged message gets
                run_bytes = run_unlogged = 0
            run_bytes += m.payload_len
            if m.retain:  # kept as the topic's value, always logged: the slow path
                problem = self.retained.refusal(m.topic, len(m.record), m.payload_len,
                                                timestamp_ms)
                # whose the value is: its key's (one with full access, or none: nobody's)
                owner = "" if access is None else access.identity.name
                if problem is None and access is not None and m.payload_len:
                    over = self.retained_shares.refusal(
                        self.retained.values, m.topic, len(m.record), owner,
                        access.identity.quota)
                    if over is not None and self.retained.expire(timestamp_ms):
                        # values of the key's that have expired count no more
                        over = self.retained_shares.refusal(
                            self.retained.values, m.topic, len(m.record), owner,
                            access.identity.quota)
                    if over is not None:
                        self.retained.refused += 1
                        self._limited(over[0])
                        problem = over[1]
                if problem is not None:
                    if not unkept:
                        run_bytes -= m.payload_len
                        refusal = Refusal(ErrorCode.LIMIT, problem)
                        break
                    # only keeping it is refused: routed and logged as a live message
                    record = m.record
                    m = m._replace(record=bytes((record[0] & ~FLAG_RETAIN,)) + record[1:],
                                   retain=0)
                    if not not_kept:
                        not_kept_topic, not_kept_text = m.topic, problem
                    not_kept += 1
            if m.retain:  # kept as the topic's value, always logged
                self.retained_shares.put(self.retained.values, m.topic, owner,
                                         len(m.record) if m.payload_len else 0)
                if logged is None:
                    offset += 1
                else:
                    logged.append(m.record)
                    offset = next_logged
                    next_logged += 1
                    if m.qos:
                        confirms += 1
                for q in targets:
                    if q.retained and m.topic in q.retained:  # its old value still to send
                        if owed:
                            owed = _charge(route.pools, owed)  # type: ignore[union-attr]
                        self._hand_over(q, m.topic, timestamp_ms, size)
                        room_route, tight = None, True  # the queue's room is looked at again
                self.retained.put(m.topic, offset, timestamp_ms, m.record, offset)
                if not m.payload_len and logged is not None:  # a clear (``relog``)
                    self._cleared.note(m.topic, offset)
            elif logged is None:
                offset += 1
            elif m.qos or log_qos0:
                logged.append(m.record)
                offset = next_logged
                next_logged += 1
                if m.qos:
                    confirms += 1
            else:
                offset = 0
                run_unlogged += 1
            accepted += 1
            if not targets:
                c.unrouted += 1
                continue
            if targets is not woken_by:  # wake every target (a dropped copy wakes in vain)
                woken.update(dict.fromkeys(targets))
                woken_by = targets
            ttl = m.ttl_ms or default_ttl
            item = (_pack_prefix(offset, 1, timestamp_ms, 0) + m.record, now_ms + ttl if ttl else 0)
            for q in targets:
                items = q.items
                if tight and (len(items) >= q.capacity or (
                        items and q.size + size > q.capacity_bytes) or (
                        (internal or q.overflow is not block or not q.consumers)
                        and q.over(size))):
                    # (a client's message for a ``block`` queue that is read had room above:
                    # its pools may take it past the bound only if they held nothing before)
                    overflow = q.overflow
                    if overflow is drop_oldest and q.frees(size):
                        n = q.make_room(size)
                        q.dropped_oldest += n
                        c.dropped_oldest += n
                        self.dropping[q] = None
                    elif overflow is block and not q.consumers:
                        n = q.make_room(size)
                        q.dropped_no_consumer += n
                        c.dropped_no_consumer += n
                    else:  # DROP_NEW, BLOCK for a dead letter (client messages wait above),
                        # or DROP_OLDEST when the connection's other queues hold the room
                        q.dropped_new += 1
                        c.dropped_new += 1
                        self.dropping[q] = None
                        continue
                items.append(item)
                q.size += size
                if tight:  # each target as it went (the others: below, at once)
                    total.size += size
                    for p in q.pools:
                        p.size += size
                if ttl:
                    q.expiring = True
                enqueued += 1
            if not tight:
                owed += size
        if owed:
            _charge(room_route.pools, owed)  # type: ignore[union-attr]
        if run_route is not None:
            usage.add(run_entry, accepted - run_from, run_bytes,  # type: ignore[arg-type]
                      run_unlogged, run_first)
        last_logged = first_logged = 0
        if logged is None:
            self.offset = offset
        elif logged:
            first_logged = log.append_many(  # type: ignore[union-attr]
                _MESSAGE, logged, timestamp_ms)
            self.offset = last_logged = next_logged - 1
        c.published += accepted
        c.enqueued += enqueued
        if refusal is not None:  # the refused message (the rest was not looked at)
            c.refused += 1
        mark = self.registry.mark
        wake = set()
        for q in woken:
            for consumer in q.consumers:
                mark(consumer)
                wake.add(consumer.conn)
        return PublishResult(
            accepted, wake,
            blocked_hold if blocked is None else Blocked(
                blocked.id, blocked.name, tuple(x.conn for x in blocked.consumers)),
            refusal, confirms, last_logged, first_logged, not_kept,
            not_kept_topic, not_kept_text)

    def _holds_back(self, q: Queue, route: Route, size: int) -> bool:
        """Whether a message of ``size`` bytes to ``route`` must wait for room in ``q`` (a
        queue with the block policy and consumers): it is full, or a connection reading it
        holds ``max_bytes_per_connection`` (each of the route's targets it reads counted),
        or all the queues hold ``max_bytes_total`` and a connection reading it holds its
        share of that (a queue read with no pools: holds any). Marks the pools to release
        it."""
        items = q.items
        full = len(items) >= q.capacity or (items and q.size + size > q.capacity_bytes)
        if not full:
            everyone = self.registry.total
            at_total = everyone.size + len(route.targets) * size > everyone.limit
            share = everyone.share() if at_total else everyone.limit
            full = (any(p.size and p.size + k * size > min(p.limit, share)
                        for p, k in route.pools if p in q.pools) if q.pools
                    else at_total and bool(items))
            if full and at_total:  # a take by anyone makes room
                everyone.blocking.add(q.id)
        if full:
            for p in q.pools:  # a take of any of its readers lets the publisher try again
                p.blocking.add(q.id)
        return bool(full)

    def refuse(self, refusal: Refusal) -> Refusal:
        """A message refused before it could reach ``publish`` (a bridged-in one whose
        local topic or size rules it out before its payload is read): counted as
        ``publish`` counts the one it refuses. Returns ``refusal``."""
        self.counters.refused += 1
        return refusal

    @staticmethod
    def _held(topic: bytes, holds: dict[int, tuple[str, tuple[str, ...]]]) -> Blocked | None:
        name = topic.decode("utf-8", "replace")
        for hold_id, (what, filters) in holds.items():
            if any(matches(f, name) for f in filters):
                return Blocked(hold_id, what, ())
        return None

    def hold(self, hold_id: int, name: str, filters: tuple[str, ...]) -> None:
        """Hold back client publishes to topics under ``filters`` (not broker-made ones):
        ``publish`` stops a batch at the first such message with ``Blocked(hold_id, name)``,
        until ``unhold``. A bridge whose backlog reached the log's size cap uses it (its
        ``block`` policy): the records it has not forwarded are not lost, and no new ones
        are taken that the cap would have to delete."""
        self.holds[hold_id] = (name, filters)

    def unhold(self, hold_id: int) -> bool:
        """End a hold; True if there was one (its publishers may try again)."""
        return self.holds.pop(hold_id, None) is not None

    def _publish_one(self, m: RawMessage, now_ms: int, timestamp_ms: int,
                     access: Access | None) -> PublishResult | None:
        """``publish`` of the usual batch, one message to a topic routed before, with room
        in every queue it goes to and nothing special about it (no retain); None for any
        other, which ``publish`` then takes the general way (nothing was changed)."""
        route = self.registry.routes.get(m.topic)
        log = self.log
        if (route is None or route.__class__ is Refusal or m.retain or log is None
                or self.holds
                or (access is not None and not access.may_publish(m.topic))
                or m.payload_len > self.limits.max_message_bytes
                or (self.cursors is not None and self.cursors.generation != self._generation)):
            return None
        size = len(m.record) + PREFIX_SIZE
        targets = route.targets  # type: ignore[union-attr]
        for q in targets:
            if len(q.items) >= q.capacity or q.size + size > q.capacity_bytes:
                return None  # a full queue: drop, block or make room, the general way
        pools = route.pools  # type: ignore[union-attr]
        for p, k in pools:  # the readers' connections', and the total: charged now
            p.size += k * size
            if p.size > p.limit:  # past a bound: the general way, nothing charged
                _uncharge(pools, p, size)
                return None
        usage = self.usage
        entry = usage.entries.get(m.topic) or usage.entry(m.topic)
        c = self.counters
        c.published += 1
        if m.qos or self.limits.log_qos0:
            offset = log.append_many(_MESSAGE, (m.record,), timestamp_ms)
            self.offset = offset
            usage.add(entry, 1, m.payload_len, 0, offset)
        else:
            offset = 0
            usage.add(entry, 1, m.payload_len, 1)
        wake = set()
        if targets:
            ttl = m.ttl_ms or self.limits.default_ttl_ms
            item = (_pack_prefix(offset, 1, timestamp_ms, 0) + m.record,
                    now_ms + ttl if ttl else 0)
            mark = self.registry.mark
            for q in targets:
                q.items.append(item)
                q.size += size
                if ttl:
                    q.expiring = True
                for consumer in q.consumers:
                    mark(consumer)
                    wake.add(consumer.conn)
            c.enqueued += len(targets)
        else:
            c.unrouted += 1
        return PublishResult(1, wake, None, None, m.qos, offset, offset)

    def _durable_matching(self, topic: bytes) -> tuple[DurableGroup, ...]:
        return () if self.cursors is None else self.cursors.matching(topic)

    def _rouse(self, target: DurableGroup) -> None:
        """A cursor may have work again: its dozing consumers are looked at again."""
        rouse = self.registry.rouse
        for consumer in target.consumers:
            rouse(consumer)

    def _publish_dead(self, dead: list[RawMessage], now_ms: int, timestamp_ms: int) -> set[int]:
        """Dead letters to ``$dlq/<topic>``, then their originals (and the dead letters
        dropped) done; returns the connections to wake."""
        wake: set[int] = set()
        while dead:  # one refused (a cap lowered since) does not take the rest with it
            result = self.publish(dead, now_ms, timestamp_ms, internal=True)
            wake |= result.wake
            if result.refusal is None:
                break
            dead = dead[result.accepted + 1:]
        self.cursors.bury(timestamp_ms)  # type: ignore[union-attr]
        return wake

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
        until_end: bool = False,
        retained: bool | None = None,
        access: Access | None = None,
        patient: bool = False,
        counted: bool = True,
        holder: str = "",
        overflow: Overflow | None = None,
    ) -> SubscribeResult:
        """Attach connection ``conn`` to a new subscription or to a group.

        ``counted``: it counts against ``max_subscriptions`` (False: one granted before,
        restored with an MQTT session, or a bridge's rule).

        ``retained``: whether the subscription starts with the retained values its filter
        matches (when it reads from the latest message); by default only one without a group.

        QoS 0 without ``start``: an in-memory queue (shared by a group's consumers). QoS 1, or
        a ``start`` other than LATEST: a cursor into the log, which is a durable group when
        named (``start`` then only matters when the group is new).

        ``until_end``: the result carries the log's end, and once the subscription has had
        all it held (delivered, and acked with QoS 1) ``deliver`` hands it one empty batch,
        its end mark. A queue (live only) has nothing in the log: its end comes once the
        retained values it started with are taken.

        ``patient``: its log deliveries never come due for redelivery; it acks them, nacks
        them or gives them back (``requeue``) itself.

        ``holder``: a durable group's consumer for a session that outlives it
        (``Consumer.holder``): the QoS 2 messages in flight to it when it leaves (or a retry
        comes due) wait for the next consumer with that holder, which takes what waits for
        it first; ``release`` gives them to the others.

        ``overflow``: a QoS 0 subscription without a group takes this policy for its queue
        instead of ``limits.overflow`` (MQTT's QoS 0 subscriptions: ``mqtt.qos0_overflow``).

        ``access``: the subscriber's permissions (None: no limits, and a new group belongs to
        nobody in particular). A filter that could match a topic it may not read is refused
        (FORBIDDEN), and so is a group another identity made, unless ``access`` is an
        admin's or unlimited; a new group becomes its identity's, and so does a group of
        the ``api_keys`` keys it adopts (``_adoptable``; the result's ``adopted``); whatever
        the subscription then carries (live messages, retained values, a replay, a group's
        backlog) is readable by it.
        """
        cap = self.limits.max_topic_bytes
        problem = (filter_problem(topic_filter, cap)
                   or (group_problem(group) if group else None)
                   or (_BRIDGES_ONLY if group.startswith(BRIDGE_GROUPS) and not patient
                       else None))
        if problem:
            code = ErrorCode.INVALID_TOPIC if "filter" in problem else ErrorCode.INVALID_REQUEST
            return refused(code, problem)
        held = len(self.registry.of(conn)) if counted else 0
        if held >= self.limits.max_subscriptions:
            return refused(ErrorCode.LIMIT, f"this connection holds {held} subscriptions, "
                           "the most server.max_subscriptions allows")
        owner = ""  # who a group made (or adopted) by this call belongs to
        adopted = ""  # the identity of the key that adopted the api_keys keys' group
        if access is not None:  # unlimited: no permission to check, but a group to own
            if not access.unlimited and not access.identity.may_subscribe(topic_filter):
                return refused(ErrorCode.FORBIDDEN, f"this key may not subscribe to "
                               f"{topic_filter!r}: it could match topics the key may not read")
            if group and not self.may_use_group(access, topic_filter, group):
                # as UNSUBSCRIBE says it: not whose the group is
                return refused(ErrorCode.FORBIDDEN, f"this key may not use group {group!r} "
                               f"on {topic_filter!r}")
            if group and not (self.group_owner(topic_filter, group)
                              or self._group_exists(topic_filter, group)):
                owner = access.identity.name
            elif group and self._adoptable(access, topic_filter, group):
                owner = adopted = access.identity.name
        registry = self.registry
        values: list[tuple[bytes, Value]] = []  # the retained values it starts with
        if ((not group) if retained is None else retained) and start == Start.LATEST:
            values = self.retained.matching_topics(topic_filter, timestamp_ms)
            waiting = registry.offered.get(conn, 0)
            most = self.limits.retained_max_per_connection
            if values and most and waiting + len(values) > most:
                self._limited("retained.max_per_connection")
                return refused(ErrorCode.LIMIT, f"{topic_filter!r} matches {len(values)} "
                               f"retained values and this connection's subscriptions started "
                               f"with {waiting}: retained.max_per_connection is {most}")
            waiting = registry.offered_total
            most = self.limits.retained_max_all_connections
            if values and most and waiting + len(values) > most:
                self._limited("retained.max_all_connections")
                return refused(ErrorCode.LIMIT, f"{topic_filter!r} matches {len(values)} "
                               f"retained values and the subscriptions of all connections "
                               f"started with {waiting}: retained.max_all_connections is "
                               f"{most}")
        if not qos and start == Start.LATEST:
            queue = registry.queue_for(topic_filter, group, None if group else overflow)
            consumer = registry.add(conn, queue, qos, credit, request_id)
            if owner:
                self._owned(topic_filter, group, owner, timestamp_ms)
            if values:
                self._retained_to_queue(queue, values)
                registry.offer(consumer, len(values))
            if not until_end:
                return SubscribeResult(consumer.sub_id, bool(queue.backlog), adopted=adopted)
            consumer.until = queue.backlog if not group else 0
            end = 0 if self.cursors is None else self.cursors.log.next_offset
            return SubscribeResult(consumer.sub_id, True, end=end, adopted=adopted)
        cursors = self.cursors
        if cursors is None:
            what = "QoS 1" if qos else "--from (replay)"
            return refused(ErrorCode.UNSUPPORTED,
                           f"{what} needs the write-ahead log (wal.enabled = false)")
        if group and not qos:
            return refused(ErrorCode.UNSUPPORTED, "a QoS 0 group lives in memory and cannot "
                           "replay the log: use QoS 1 for a durable group")
        if (topic_filter, group) in registry.groups:
            return refused(ErrorCode.INVALID_REQUEST,
                           f"group {group!r} on {topic_filter!r} already exists as a QoS 0 group")
        new = bool(group) and (topic_filter, group) not in cursors.durable
        if new and len(cursors.durable) >= self.limits.max_durable_groups:
            self._limited("queues.max_durable_groups")
            return refused(ErrorCode.LIMIT, f"the broker holds {len(cursors.durable)} durable "
                           "groups, the most queues.max_durable_groups allows: delete unused "
                           "ones (blipmq unsub --group) or raise it")
        if new and owner:  # a new group of its own: within its key's share
            most = access.identity.quota.durable_groups  # type: ignore[union-attr]
            held = self.groups_held.get(owner, 0)
            if most is not None and held >= most:
                self._limited("auth.keys.max_durable_groups")
                return refused(ErrorCode.LIMIT, f"key {owner!r} holds {held} durable groups, "
                               f"the most its share allows ({most}: max_durable_groups, "
                               "docs/SECURITY.md): delete unused ones (blipmq unsub --group) "
                               "or raise it")
        target = cursors.open(topic_filter, group, qos, start, start_offset, timestamp_ms)
        if isinstance(target, Refusal):
            return SubscribeResult(0, refusal=target)
        if owner:
            self._owned(topic_filter, group, owner, timestamp_ms, durable=True)
            if adopted:  # the api_keys keys' group: its key's now
                self._hold(FULL.name, -1)
            self._hold(owner, 1)
        credit = (credit or self.limits.default_credit) if qos else 0xFFFFFFFF
        consumer = registry.add(conn, target, qos, credit, request_id)
        consumer.patient = patient
        consumer.holder = holder
        if values:  # QoS 1 here: LATEST at QoS 0 is a queue
            target.offer_retained([value for _, value in values], DELIVERED_RETAINED)
            registry.offer(consumer, len(values))
            self.counters.retained_sent += len(values)
        if until_end:
            consumer.until = cursors.log.next_offset
            return SubscribeResult(consumer.sub_id, True, end=consumer.until, adopted=adopted)
        return SubscribeResult(consumer.sub_id, self.has_work(consumer), adopted=adopted)

    # ------------------------------------------------------------------ group ownership

    def group_owner(self, topic_filter: str, group: str) -> str:
        """The identity that made a group ("" when nobody in particular: made with no
        ``access`` (authentication off), or by the broker)."""
        key = _owner_key(topic_filter, group)
        owner = self.states.get(key)
        return owner.decode("utf-8", "replace") if owner else self._group_owners.get(key, "")

    def may_use_group(self, access: Access, topic_filter: str, group: str) -> bool:
        """Whether ``access`` may consume from, ack in or delete the group: one nobody owns
        (not made yet, or made without permissions in force), its own, or any as an admin;
        or one of the ``api_keys`` keys it may adopt (``_adoptable``). A group a
        subscription makes or adopts becomes its subscriber's (``subscribe``)."""
        identity = access.identity
        owner = self.group_owner(topic_filter, group)
        return (identity.admin or access.unlimited or owner in ("", identity.name)
                or self._adoptable(access, topic_filter, group))

    def _adoptable(self, access: Access, topic_filter: str, group: str) -> bool:
        """Whether a named key takes over (adopts) a group of the ``auth.api_keys`` keys
        (owner ``*``) by using it: the way from ``api_keys`` to named keys (docs/SECURITY.md,
        "Migrating"). Only a key that may read every topic of the group's filter, that is
        no admin (an admin uses any group as it is), and only while nobody consumes from
        the group: an ``api_keys`` client still using it is not pushed aside."""
        identity = access.identity
        if identity.admin or access.unlimited or not identity.may_subscribe(topic_filter):
            return False
        if self.group_owner(topic_filter, group) != FULL.name:
            return False
        key = (topic_filter, group)
        target = self.registry.groups.get(key) or (
            None if self.cursors is None else self.cursors.durable.get(key))
        return target is not None and not target.consumers

    def _hold(self, owner: str, n: int) -> None:
        """``owner`` holds ``n`` durable groups more (or fewer)."""
        if owner:
            held = self.groups_held.get(owner, 0) + n
            if held > 0:
                self.groups_held[owner] = held
            else:
                self.groups_held.pop(owner, None)

    def _limited(self, limit: str) -> None:
        """Something was refused at the cap ``limit`` (counted for metrics)."""
        limited = self.counters.limited
        limited[limit] = limited.get(limit, 0) + 1

    def _group_exists(self, topic_filter: str, group: str) -> bool:
        key = (topic_filter, group)
        return key in self.registry.groups or (
            self.cursors is not None and key in self.cursors.durable)

    def _owned(self, topic_filter: str, group: str, name: str, timestamp_ms: int,
               durable: bool = False) -> int:
        """Record (or with "", forget) a group's owner: kept in the log for a durable group,
        in memory for a QoS 0 one (which a restart ends). Returns the offset of the STATE
        record written (0: none)."""
        key = _owner_key(topic_filter, group)
        if name:
            self._group_owners[key] = name
            if durable and self.log is not None:
                return self.put_state(key, name.encode("utf-8"), timestamp_ms)
            return 0
        self._group_owners.pop(key, None)
        return self.put_state(key, b"", timestamp_ms)

    def retained_again(self, conn: int, sub_id: int, wall_ms: int) -> bool:
        """A subscription made again as it is (MQTT-3.8.4-3: the flow of its messages goes
        on, its deliveries in flight with it): the retained values its filter matches, once
        more. Returns whether it has something to deliver now."""
        consumer = self.registry.owned(conn, sub_id)
        if consumer is None:
            return False
        target = consumer.queue
        values = self.retained.matching_topics(target.filter, wall_ms)
        self.registry.offer(consumer, len(values))  # in place of what it started with
        if isinstance(target, DurableGroup):
            target.offer_retained([value for _, value in values], DELIVERED_RETAINED)
            self.counters.retained_sent += len(values)
            self._rouse(target)
        else:
            self._retained_to_queue(target, values)
            if target.backlog:
                self.registry.mark(consumer)  # what a delivery pass looks at
        return self.has_work(consumer)

    def _retained_to_queue(self, queue: Queue, values: list[tuple[bytes, Value]]) -> None:
        """A new subscription's queue starts with the retained values its filter matches
        (``values``: topic and value): all of them, whatever the queue's bounds. They wait
        in ``queue.retained`` (the store's values, not copies) and ``take`` hands them out
        before the queue's items, as its reader takes them; live messages published
        meanwhile come after them. Made again (``retained_again``), the subscription gets
        the values as they are now instead of those it had yet to take."""
        queue.retained.clear()
        queue.retained.update((topic, value.offset) for topic, value in values)

    def _hand_over(self, queue: Queue, topic: bytes, wall_ms: int, size: int) -> None:
        """A retained publish (``size`` bytes delivered) is about to replace or clear
        ``topic``'s value while ``queue`` has it still to send: the value as it was (what
        the SUBSCRIBE promised) goes to the front of the queue's items, before the live
        publish that replaces it, counted in the queue's bytes and length like any message,
        if the queue has room for both; if not, it is dropped as the queue's policy drops
        (counted), and the newer value comes live. So the list of values still to send never
        holds a value the store has let go of, and no live message waits for its room."""
        offset = queue.retained.pop(topic)
        value = self.retained.values.get(topic)
        if value is None or value.offset != offset or (
                value.expires_ms and value.expires_ms <= wall_ms):
            return  # gone meanwhile (expired): nothing to send
        record = (_pack_prefix(value.offset, 1, value.timestamp_ms, DELIVERED_RETAINED)
                  + value.record)
        items = queue.items
        if len(items) + 2 > queue.capacity or (
                items and queue.size + len(record) + size > queue.capacity_bytes):
            c = self.counters
            if queue.overflow is _DROP_OLDEST:
                queue.dropped_oldest += 1
                c.dropped_oldest += 1
            else:
                queue.dropped_new += 1
                c.dropped_new += 1
            self.dropping[queue] = None
            return
        items.appendleft((record, 0))
        queue.shrink(-len(record))
        self.counters.enqueued += 1
        self.counters.retained_sent += 1

    def unsubscribe(
        self, conn: int, sub_id: int = 0, topic_filter: str = "", group: str = "",
        timestamp_ms: int = 0, access: Access | None = None,
    ) -> UnsubscribeResult:
        """End one subscription (by id), this conn's subscriptions on a filter, or a group
        (only its owner's or an admin's ``access`` may delete a group)."""
        registry = self.registry
        if sub_id:
            consumer = registry.owned(conn, sub_id)
            if consumer is None:
                return UnsubscribeResult(
                    0, refusal=Refusal(ErrorCode.NOT_FOUND, f"no subscription {sub_id}"))
            # ended for good: nothing waits for its holder any more
            holder, consumer.holder = consumer.holder, ""
            detached = self._detach([consumer], timestamp_ms)
            if holder:
                woke = self.release(consumer.queue.filter, consumer.queue.group or "", holder)
                detached = Detached(detached.released, detached.wake | woke)
            return UnsubscribeResult(1, detached)
        if group:
            problem = (filter_problem(topic_filter, self.limits.max_topic_bytes)
                       or group_problem(group)
                       or (_BRIDGES_ONLY if group in self.bridged else None))
            if problem:  # refused as SUBSCRIBE refuses it, not "no such group"
                code = (ErrorCode.INVALID_TOPIC if "filter" in problem
                        else ErrorCode.INVALID_REQUEST)
                return UnsubscribeResult(0, refusal=Refusal(code, problem))
            if access is not None and not access.unlimited and not access.identity.admin and (
                    not self._group_exists(topic_filter, group)
                    or not self.may_use_group(access, topic_filter, group)):
                # the same answer whether it exists or is another key's: a key learns
                # nothing of groups it may not use
                return UnsubscribeResult(0, refusal=Refusal(
                    ErrorCode.FORBIDDEN, f"no group {group!r} on {topic_filter!r} that this "
                    "key may delete"))
            owner = self.group_owner(topic_filter, group)
            logged = self._owned(topic_filter, group, "", timestamp_ms)
            cursors = self.cursors
            target: Queue | DurableGroup | None = (
                None if cursors is None else cursors.durable.get((topic_filter, group)))
            released: tuple[int, ...] = ()
            if target is not None:
                logged = cursors.delete(target, timestamp_ms)  # type: ignore[union-attr,arg-type]
                self._hold(owner, -1)
            else:
                target = registry.groups.pop((topic_filter, group), None)
                if target is None:
                    return UnsubscribeResult(0, refusal=Refusal(
                        ErrorCode.NOT_FOUND,
                        f"no group {group!r} on topic filter {topic_filter!r}"))
                registry.drop(target)
                released = (target.id,)
            name = f"group {group!r} on {topic_filter!r}"
            ended = tuple(Ended(c.conn, c.request_id, name)
                          for c in target.consumers if c.conn != conn)
            freed: list[int] = []  # a member's pool held publishers back: they go on
            for consumer in target.consumers:
                registry.forget(consumer)
                if isinstance(target, Queue):
                    registry.unpool(consumer, target, freed)
            target.consumers.clear()
            return UnsubscribeResult(1, Detached((*released, *freed)), ended, logged=logged)
        mine = [c for c in registry.of(conn)
                if c.queue.filter == topic_filter and not c.queue.group]  # no group, any kind
        return UnsubscribeResult(len(mine), self._detach(mine, timestamp_ms))

    def disconnect(self, conn: int, timestamp_ms: int = 0) -> Detached:
        """A connection is gone: end its subscriptions. Groups keep their queues."""
        return self._detach(list(self.registry.of(conn)), timestamp_ms)

    def _detach(self, consumers: list[Consumer], timestamp_ms: int) -> Detached:
        released: list[int] = []
        wake: set[int] = set()
        registry = self.registry
        for consumer in consumers:
            registry.forget(consumer)
            if isinstance(consumer.queue, DurableGroup):
                self.cursors.detach(consumer, timestamp_ms, wake)  # type: ignore[union-attr]
            else:
                registry.leave(consumer, released)
        if len(registry.idle) > self.limits.max_idle_groups:
            c = self.counters
            for queue in registry.drop_idle():
                # in memory only, as its owner is: nothing to write to the log
                self._group_owners.pop(_owner_key(queue.filter, queue.group or ""), None)
                c.idle_groups_dropped += 1
                c.dropped_no_consumer += len(queue.items)
                released.append(queue.id)
        return Detached(tuple(released), frozenset(wake))

    # ------------------------------------------------------------------- QoS 1 consumers

    def _cursor_of(self, conn: int, sub_id: int) -> tuple[Consumer, DurableGroup] | None:
        consumer = self.registry.owned(conn, sub_id)
        if consumer is None or not isinstance(consumer.queue, DurableGroup):
            return None
        return consumer, consumer.queue

    def in_flight(self, conn: int, sub_id: int, offset: int) -> bool:
        """Whether the delivery at ``offset`` is in flight to this conn's subscription (not
        acked, not given up on, the subscription not ended)."""
        found = self._cursor_of(conn, sub_id)
        if found is None:
            return False
        flight = found[1].inflight.get(offset)
        return flight is not None and flight.sub_id == sub_id

    def copy_of(self, conn: int, sub_id: int, offset: int) -> int:
        """What this conn's subscription did with the message at ``offset``, for another
        subscription of the same client that has a copy of it: ``OWES`` (its log cursor
        has not read that far, or holds it unacked), ``SETTLED`` (read and acked, or not
        one of its topics), ``NEVER`` (it began to read after it, or has no cursor)."""
        found = self._cursor_of(conn, sub_id)
        if found is None:
            return NEVER
        group = found[1]
        if offset >= group.next or offset in group.inflight or offset in group.pending:
            return OWES
        return SETTLED if offset >= group.first else NEVER

    def ack(self, conn: int, sub_id: int, offsets: tuple[int, ...], timestamp_ms: int) -> bool:
        """A QoS 1 consumer acked deliveries; True when that freed room in its window.
        Acks of QoS 0 deliveries, and of ids this conn does not hold, are ignored."""
        found = self._cursor_of(conn, sub_id)
        if found is None:
            return False
        freed = self.cursors.ack(*found, offsets, timestamp_ms)  # type: ignore[union-attr]
        return freed or (found[0].until is not None and self._at_end(found[0]))

    def set_credit(self, conn: int, sub_id: int, credit: int) -> bool:
        """A QoS 1 consumer changes its window; True when it now has room for more.

        Ignored (False) for QoS 0 subscriptions and for ids this conn does not hold."""
        consumer = self.registry.owned(conn, sub_id)
        if consumer is None or not consumer.qos:
            return False
        grew = credit > consumer.credit
        consumer.credit = credit
        return grew

    def nack(
        self, conn: int, sub_id: int, offsets: tuple[int, ...], delay_ms: int, now_ms: int,
        timestamp_ms: int, reason: str = "", give_up: bool = False, spend: bool = True,
    ) -> frozenset[int]:
        """A QoS 1 consumer gives deliveries back, to be redelivered now or after
        ``delay_ms``; one delivered ``max_retries`` times (any, with ``give_up``) goes to
        ``$dlq/<topic>`` instead, with the consumer's ``reason`` if it gave one (a dead
        letter is dropped instead: ``Counters.dead_letters_dropped``). Without
        ``spend`` none does (a consumer that counts its own retries: a bridge). Returns
        the connections to wake."""
        found = self._cursor_of(conn, sub_id)
        if found is None:
            return frozenset()
        dead: list[RawMessage] = []
        wake = self.cursors.nack(*found, offsets, delay_ms, now_ms,  # type: ignore[union-attr]
                                 timestamp_ms, dead, reason, give_up, spend)
        return wake | self._publish_dead(dead, now_ms, timestamp_ms)

    def hold_for(self, conn: int, sub_id: int, holder: str) -> frozenset[int]:
        """A log consumer's holder changes (``subscribe``); what waited for the one it had
        goes to the others. Returns the connections to wake."""
        found = self._cursor_of(conn, sub_id)
        if found is None or found[0].holder == holder:
            return frozenset()
        old, found[0].holder = found[0].holder, holder
        return self.release(found[1].filter, found[1].group, old)

    def release(self, topic_filter: str, group: str, holder: str) -> frozenset[int]:
        """The holder's session is gone (or no longer holds): the group's deliveries kept
        for it go to its other consumers. Returns the connections to wake."""
        target = None if self.cursors is None or not holder else (
            self.cursors.durable.get((topic_filter, group)))
        if target is None or not target.release(holder):
            return frozenset()
        return frozenset(c.conn for c in target.consumers)

    def requeue(self, conn: int, sub_id: int) -> int:
        """A log consumer gives back every delivery it holds, as if it had left: no retry is
        spent (its link dropped; nobody refused them). Returns how many went back."""
        found = self._cursor_of(conn, sub_id)
        return 0 if found is None else found[1].requeue(sub_id)

    # ---------------------------------------------------------------------------- delivery

    def pending(self, conn: int, qos0_only: bool = False) -> bool:
        """Whether ``deliver`` would hand this connection something now."""
        has_work = self.has_work
        found = False
        for c in self.registry.candidates(conn):
            if qos0_only and c.qos:
                continue
            if has_work(c):
                found = True
                break
            self._nothing_for(c)
        return found

    def _nothing_for(self, consumer: Consumer) -> None:
        """``consumer`` has nothing to take: a delivery pass leaves it out until it may
        (a queue consumer until its queue gets items, a log-cursor one while it dozes)."""
        if not isinstance(consumer.queue, DurableGroup):
            self.registry.unmark(consumer)
        elif _dozes(consumer):
            self.registry.doze(consumer)

    def deliver(
        self, conn: int, max_batch: int, max_batch_bytes: int, now_ms: int, wall_ms: int,
        qos0_only: bool = False, total: int = 0,
    ) -> Deliveries:
        """One batch per subscription of this connection that has something (QoS 0 ones only
        when ``qos0_only``: a closing connection takes no QoS 1 delivery it could not ack).
        ``total``: at most this many deliveries over all the batches (0: ``max_batch`` for
        each; a bridge's window covers all its rules)."""
        batches = []
        released = []
        behind = False
        unmark = self.registry.unmark
        left = total
        candidates = self.registry.candidates(conn)
        if total and len(candidates) > 1:  # a shared window: each its turn to go first
            self._turn = turn = (self._turn + 1) % len(candidates)
            candidates = candidates[turn:] + candidates[:turn]
        for consumer in candidates:
            if qos0_only and consumer.qos:
                continue
            if total:
                if left <= 0:
                    break
                max_batch = min(max_batch, left)
            queue = consumer.queue
            if consumer.until is None and not isinstance(queue, DurableGroup):
                # the usual: a live queue's consumer (the general way below, made short)
                if queue.items or queue.retained:
                    records = self.take(consumer, max_batch, max_batch_bytes, now_ms, wall_ms)
                    if records:
                        batches.append((consumer.sub_id, records))
                        left -= len(records)
                    released.append(queue.id)
                    if queue.items or queue.retained:
                        continue
                unmark(consumer)  # nothing left: looked at again once its queue gets items
                continue
            if not self.has_work(consumer):
                self._nothing_for(consumer)
                continue
            if consumer.until is not None and not isinstance(consumer.queue, DurableGroup):
                before = consumer.queue.backlog
                records = self.take(consumer, max_batch, max_batch_bytes, now_ms, wall_ms)
                consumer.until -= before - consumer.queue.backlog
            else:
                records = self.take(consumer, max_batch, max_batch_bytes, now_ms, wall_ms)
            if records:
                batches.append((consumer.sub_id, records))
                left -= len(records)
            if consumer.until is not None and self._at_end(consumer):
                consumer.until = None
                batches.append((consumer.sub_id, []))  # the end mark
            if isinstance(consumer.queue, DurableGroup):
                behind = behind or (
                    records and self.cursors.lag(consumer.queue) > max_batch)  # type: ignore[union-attr]
            else:
                released.append(consumer.queue.id)
                if not self.has_work(consumer):
                    unmark(consumer)
        if released:  # the publishers held back for this room try again
            registry = self.registry
            for pool in (registry.pools.get(conn), registry.total):
                if pool is not None and pool.blocking:
                    released.extend(pool.blocking)
                    pool.blocking.clear()
        cursors = self.cursors  # ``take_fetches``, without the call
        return Deliveries(batches, tuple(released),
                          [] if cursors is None else cursors.take_fetches(), bool(behind))

    def has_work(self, consumer: Consumer) -> bool:
        """Whether ``take`` would hand this consumer something now (or its end mark)."""
        target = consumer.queue
        if consumer.until is not None and self._at_end(consumer):
            return True
        if isinstance(target, DurableGroup):
            return self.cursors.has_work(consumer, target)  # type: ignore[union-attr]
        return bool(target.items or target.retained)

    def _at_end(self, consumer: Consumer) -> bool:
        """An until_end subscription has had all it asked for: a cursor has read past the
        last record the log stores below its end offset, with nothing below that in
        flight; a queue took its retained values."""
        target, until = consumer.queue, consumer.until
        assert until is not None
        if isinstance(target, DurableGroup):
            reach = self._stored_end(until)
            return target.next >= reach and target.floor >= reach
        return until <= 0

    def _stored_end(self, until: int) -> int:
        """One past the last offset below ``until`` the log stores or may still store: a
        log that ends in a gap (a batch the disk refused, damage set aside by recovery)
        stores nothing more below ``until`` once no append below it waits."""
        log = self.log
        assert log is not None
        if log.pending_from < until:
            return until
        return min(until, log.written_offset + 1)

    def take(
        self, consumer: Consumer, limit: int, max_bytes: int, now_ms: int, wall_ms: int = 0
    ) -> list[bytes]:
        """Up to ``limit`` delivery records and ``max_bytes`` of them (a first larger one
        alone) for one consumer.

        A queue's retained values still to send (``Queue.retained``) come first. Expired
        items and values met on the way are dropped and counted, so an expired message is
        never handed out. A group's consumers each take a fair share of what is waiting.
        """
        queue = consumer.queue
        if isinstance(queue, DurableGroup):
            return self.cursors.take(consumer, queue, limit,  # type: ignore[union-attr]
                                     max_bytes, now_ms, wall_ms)
        items = queue.items
        if not items and not queue.retained:
            return []
        sharers = len(queue.consumers)
        if sharers > 1:
            limit = min(limit, -(-queue.backlog // sharers))
        out: list[bytes] = []
        expired = size = expired_size = 0
        if queue.retained:
            expired, size = self._take_retained(queue, out, limit, max_bytes, wall_ms)
            if queue.retained:  # the batch is full: the items wait
                limit = 0
        taken = size  # of the retained values: not in ``queue.size``
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
        queue.shrink(size - taken + expired_size)
        if expired:
            queue.dropped_ttl += expired
            self.counters.dropped_ttl += expired
        self.counters.delivered += len(out)
        return out

    def _take_retained(self, queue: Queue, out: list[bytes], limit: int, max_bytes: int,
                       wall_ms: int) -> tuple[int, int]:
        """Into ``out``: delivery records of the queue's retained values still to send (the
        store's values, looked up now), within ``limit`` records and ``max_bytes`` (the
        first one goes whatever its size). Returns how many expired on the way, and the
        bytes taken."""
        pending = queue.retained
        values = self.retained.values
        size = expired = sent = 0
        while pending and len(out) < limit:
            topic, offset = next(iter(pending.items()))
            value = values.get(topic)
            if value is None or value.offset != offset or (
                    value.expires_ms and value.expires_ms <= wall_ms):
                # expired (dropped from the store, or then set again: that publish is live
                # in the queue after these); a value replaced or cleared left the list then
                pending.popitem(last=False)
                expired += 1
                continue
            n = PREFIX_SIZE + len(value.record)
            if out and size + n > max_bytes:
                break
            pending.popitem(last=False)
            out.append(_pack_prefix(value.offset, 1, value.timestamp_ms, DELIVERED_RETAINED)
                       + value.record)
            size += n
            sent += 1
        self.counters.enqueued += sent
        self.counters.retained_sent += sent
        return expired, size

    def take_counts(self) -> list[Count]:
        """Backlogs of durable groups to count off the event loop (each handed out once)."""
        return [] if self.cursors is None else self.cursors.take_counts()

    def counted(self, key: int, n: int, epoch: int = 0) -> None:
        """``n`` messages of the group's topics were found for ``Count(key, ...)``."""
        if self.cursors is not None:
            self.cursors.counted(key, n, epoch)

    def take_fetches(self) -> list[Fetch]:
        """The disk reads log cursors are waiting for (each handed out once)."""
        return [] if self.cursors is None else self.cursors.take_fetches()

    def fill(self, key: int, records: Sequence[StoredRecord]) -> frozenset[int]:
        """Records read for ``Fetch(key, ...)``; returns the connections to wake. An empty
        read moves the cursor to the oldest record still in the log."""
        return frozenset() if self.cursors is None else self.cursors.fill(key, records)

    # ------------------------------------------------------------------------ maintenance

    def take_dropping(self) -> list[Queue]:
        """The queues that dropped messages (``drop_oldest``, ``drop_new``: a full queue)
        since the last call, for the shell to say so."""
        dropping = list(self.dropping)
        self.dropping.clear()
        return dropping

    def tick(self, now_ms: int) -> int:
        """Drop expired messages from every queue; returns how many."""
        removed = sum(q.purge_expired(now_ms) for q in self.registry.queues)
        self.counters.dropped_ttl += removed
        return removed

    def redeliver(self, now_ms: int, timestamp_ms: int) -> frozenset[int]:
        """Unacked deliveries past their deadline go back to their cursor (or to
        ``$dlq/<topic>`` after ``max_retries`` deliveries; a dead letter is dropped then),
        and delayed nacks come due.
        Returns the connections to wake."""
        if self.cursors is None:
            return frozenset()
        dead: list[RawMessage] = []
        wake = self.cursors.redeliver(now_ms, timestamp_ms, dead)
        if now_ms - self._roused_at >= _ROUSE_ALL_MS:
            # a safety net under the wake-ups ``_rouse`` gives: were one ever missed, a
            # dozing consumer whose cursor is no longer idle would wait this long at most,
            # never for good (the others are not woken: a broker of idle subscribers stays
            # idle)
            self._roused_at = now_ms
            wake = wake | self.registry.rouse_any(_dozes)
        return wake | self._publish_dead(dead, now_ms, timestamp_ms)

    def expire_groups(self, wall_ms: int) -> list[DurableGroup]:
        """Drop durable groups without a consumer for ``group_expiry_ms``."""
        gone = [] if self.cursors is None else self.cursors.expire(wall_ms)
        for g in gone:
            self._hold(self.group_owner(g.filter, g.group), -1)
            self._owned(g.filter, g.group, "", wall_ms)
        return gone

    def checkpoint(self, timestamp_ms: int, below: int) -> int:
        """Restate durable groups anchored below offset ``below`` (see Cursors.checkpoint)."""
        return 0 if self.cursors is None else self.cursors.checkpoint(timestamp_ms, below)

    def carry_retained(self, timestamp_ms: int, below: int) -> int:
        """Carry every retained value whose latest record is below offset ``below`` forward
        into a RETAINED record, so retention never deletes a topic's current value. Returns
        the offset of the last record appended (0: none)."""
        log = self.log
        if log is None:
            return 0
        last = 0
        retained = self.retained
        for topic, value in retained.stale(below):
            last = log.append(Kind.RETAINED, carry_body(value), timestamp_ms)
            retained.moved(topic, last)
        return last

    def put_state(self, key: bytes, value: bytes, timestamp_ms: int) -> int:
        """Save a front end's state under ``key`` (an empty value deletes it) in a STATE
        record; returns the record's offset (0 without a log). The latest value of each key
        is recovered at start and carried past retention (``carry_states``)."""
        if value:
            self.states[key] = value
        elif self.states.pop(key, None) is None and key not in self._state_at:
            return 0  # nothing to delete
        if self.log is None:
            return 0
        at = self.log.append(Kind.STATE, _STATE_KEY.pack(len(key)) + key + value, timestamp_ms)
        if value:
            self._state_at[key] = at
        else:
            self._state_at.pop(key, None)
        self._state_recent.note(key, at)
        return at

    def state_offset(self, key: bytes) -> int:
        """The offset of the newest STATE record of ``key`` (its value or its deletion)
        that may not be written yet; 0 when there is none."""
        return max(self._state_recent.get(key), self._state_at.get(key, 0))

    def relog(self, first: int, last: int, timestamp_ms: int) -> int:
        """The disk refused the batch of records ``first``..``last``: what they said about
        the broker's state (a front end's saved state, retained values, durable groups
        created, deleted, acked) is in memory only. Appends it again, as it is now, so
        that the log says what memory does once a write succeeds. Returns the last offset
        appended (0: none)."""
        out = 0
        if self.log is None:
            return 0
        for key in self._state_recent.between(first, last):
            value = self.states.get(key)
            if value is not None:
                out = self.put_state(key, value, timestamp_ms)
            else:  # a deletion
                out = self.log.append(Kind.STATE, _STATE_KEY.pack(len(key)) + key,
                                      timestamp_ms)
                self._state_recent.note(key, out)
        retained = self.retained
        for topic, value in [(t, v) for t, v in retained.values.items()
                             if first <= v.anchor <= last]:
            # a value published or carried forward there: carried again (``carry_retained``)
            out = self.log.append(Kind.RETAINED, carry_body(value), timestamp_ms)
            retained.moved(topic, out)
        for topic in self._cleared.between(first, last):
            if topic in retained.values:  # set again since
                continue
            clear = MSG_HEAD.pack(FLAG_RETAIN, 0, len(topic), 0, 0) + topic
            out = self.log.append(Kind.RETAINED, carry_body(
                Value(0, timestamp_ms, clear, (), 0, 0)), timestamp_ms)
            self._cleared.note(topic, out)
        if self.cursors is not None:
            out = max(out, self.cursors.relog(first, last, timestamp_ms))
        return out

    def carry_states(self, timestamp_ms: int, below: int) -> int:
        """Rewrite every state whose record is below offset ``below``, so retention never
        deletes it; returns the offset of the last record appended (0: none)."""
        last = 0
        for key, at in list(self._state_at.items()):
            if at < below:
                last = self.put_state(key, self.states[key], timestamp_ms)
        return last

    def newest_state(self) -> int:
        """The offset of the newest STATE record of a live key (0: none)."""
        return max(self._state_at.values(), default=0)

    def skip_to(self, first: int) -> list[tuple[DurableGroup, int]]:
        """Retention removed the log below ``first`` (see Cursors.skip_to)."""
        return [] if self.cursors is None else self.cursors.skip_to(first)

    def durable_floor(self) -> int | None:
        """The lowest offset a durable group still needs (for log retention)."""
        return None if self.cursors is None else self.cursors.floor()

    # --------------------------------------------------------------------------- recovery

    def recover(self, record: StoredRecord) -> str | None:
        """A record met while the log is opened (the log's ``on_record``): a GROUP, ACK,
        RETAINED or STATE record, or a MESSAGE with the retain flag (the log hands over only
        those). Returns None once it is applied, or why its body cannot be read (a record
        whose CRC holds but whose body does not parse: a writer's defect, another tool):
        then nothing of it is applied, and the log sets it aside as damaged."""
        try:
            self._recover(record)
        except (struct.error, IndexError):
            return f"its body of {len(record.body)} bytes ends early"
        except ValueError as exc:
            return str(exc) or type(exc).__name__
        return None

    def _recover(self, record: StoredRecord) -> None:
        """``recover``'s work. Each kind is parsed whole before anything is applied, so a
        body that does not parse raises and leaves the state as it was."""
        kind = record.kind
        if kind == Kind.STATE:
            body = record.body
            (n,) = _STATE_KEY.unpack_from(body)
            if 2 + n > len(body):
                raise ValueError(f"its key of {n} bytes runs past its {len(body)}-byte body")
            key, value = body[2:2 + n], body[2 + n:]
            if value:
                for prefix, check in self.state_checks.items():
                    if key.startswith(prefix):
                        check(key, value)  # ValueError: not applied, set aside
                self.states[key] = value
                self._state_at[key] = record.offset
            else:
                self.states.pop(key, None)
                self._state_at.pop(key, None)
        elif kind == Kind.MESSAGE:
            body = record.body
            _check_message(body)
            if body[0] & FLAG_RETAIN:
                self.retained.put(topic_of(body), record.offset, record.timestamp_ms, body,
                                  record.offset)
            return
        if kind == Kind.RETAINED:
            offset, timestamp_ms, body = parse_carry(record.body)
            _check_message(body)
            self.retained.put(topic_of(body), offset, timestamp_ms, body, record.offset)
        if self.cursors is not None and kind != Kind.RETAINED and kind != Kind.STATE:
            self.cursors.recover(record)
        first, last = self._bookkeeping
        self._bookkeeping = (first if record.offset == last + 1 else record.offset, record.offset)

    def recovered(self, wall_ms: int) -> list[tuple[DurableGroup, int]]:
        """The log is open: where the last message is, and which groups count as idle.
        Returns the durable groups whose unacked deliveries the log no longer holds, and
        how many each lost (see Cursors.recovered)."""
        if self.log is None or self.cursors is None:
            return []
        first, last = self._bookkeeping
        end = self.log.next_offset - 1
        self.offset = first - 1 if last == end else end
        self.groups_held = {}
        for g in self.cursors.durable.values():  # their owners' records are read by now
            self._hold(self.group_owner(g.filter, g.group), 1)
        return self.cursors.recovered(wall_ms)

    # ------------------------------------------------------------------------------ views

    def stats(self, max_topics: int = 500, max_groups: int | None = None) -> dict[str, Any]:
        """A snapshot for STATS (plain values, ready for JSON; docs/PROTOCOL.md,
        "Statistics"): topics (the ``max_topics`` with most messages), groups (the
        ``max_groups`` with the largest backlog, all of them when None), each list with how
        many it leaves out; subscriptions, in-flight deliveries, drops by reason, retained
        values."""
        c = self.counters
        usage = self.usage
        rows = usage.rows()
        retained = self.retained.values
        topics = [{"topic": t, "messages": m, "bytes": n,
                   "retained": t.encode("utf-8") in retained}
                  for t, m, n in rows[:max_topics]]
        # the ``max_groups`` with most backlog (of those with as much as the last one kept,
        # the oldest), then listed by backlog, filter and group; chosen with two lean passes
        # over plain numbers, no row built for the groups left out (there may be 100,000)
        durable = [] if self.cursors is None else list(self.cursors.durable.values())
        memory = list(self.registry.groups.items())
        backlogs = [max(0, g.backlog) for g in durable] + [q.backlog for _, q in memory]
        total = len(backlogs)
        k = total if max_groups is None else min(total, max(0, max_groups))
        if k == total:
            chosen: list[int] = list(range(total))
        elif not k:
            chosen = []
        else:
            cut = nlargest(k, backlogs)[-1]
            chosen = [i for i, b in enumerate(backlogs) if b > cut]
            chosen += islice((i for i, b in enumerate(backlogs) if b == cut), k - len(chosen))
        n = len(durable)
        groups = sorted((_durable_row(durable[i]) if i < n else
                         _memory_row(memory[i - n][0][0], memory[i - n][0][1], memory[i - n][1])
                         for i in chosen),
                        key=lambda row: (-row["backlog"], row["filter"], row["group"]))
        consumers = self.registry.consumers.values()
        return {
            "topics": topics,
            "topics_omitted": max(0, len(rows) - max_topics),
            "topics_untracked": {"messages": usage.other[0], "bytes": usage.other[1]},
            "groups": groups,
            "groups_omitted": total - len(groups),
            "subscriptions": len(self.registry.consumers),
            "subscribers": sum(1 for x in consumers if not x.queue.group),
            "in_flight": sum(len(t.inflight) for t in self.all_cursors),
            "messages": {"published": c.published, "delivered": c.delivered,
                         "unrouted": c.unrouted, "refused": c.refused, "acked": c.acked,
                         "redelivered": c.redelivered, "nacked": c.nacked,
                         "dead_lettered": c.dead_lettered,
                         "dead_letters_dropped": c.dead_letters_dropped},
            "drops": {"drop_oldest": c.dropped_oldest, "drop_new": c.dropped_new,
                      "ttl": c.dropped_ttl, "no_consumer": c.dropped_no_consumer},
            "retained": {"topics": len(self.retained), "bytes": self.retained.size,
                         "sent": c.retained_sent, "refused": self.retained.refused},
        }

    @property
    def queues(self) -> tuple[Queue, ...]:
        return tuple(self.registry.queues)

    def group(self, topic_filter: str, group: str) -> Queue | None:
        return self.registry.groups.get((topic_filter, group))

    def durable_group(self, topic_filter: str, group: str) -> DurableGroup | None:
        return None if self.cursors is None else self.cursors.durable.get((topic_filter, group))

    def consumer(self, sub_id: int) -> Consumer | None:
        return self.registry.consumers.get(sub_id)

    @property
    def subscriptions(self) -> int:
        return len(self.registry.consumers)

    @property
    def durable_groups(self) -> tuple[DurableGroup, ...]:
        return () if self.cursors is None else tuple(self.cursors.durable.values())

    @property
    def all_cursors(self) -> tuple[DurableGroup, ...]:
        """Every log cursor: durable groups and subscriptions without a group."""
        return () if self.cursors is None else self.cursors.all

    def tailing(self) -> bool:
        """Whether a consumer reads from a log cursor (it delivers once new records are
        written, so the log should not hold a batch back)."""
        return self.registry.reads_cursors()

    def acks_due(self) -> bool:
        """Whether the log should write the acks it holds now (``Cursors.acks_due``)."""
        return self.cursors is not None and self.cursors.acks_due()

    def cursor_conns(self) -> set[int]:
        """Connections consuming from a log cursor (they may deliver once the log grows)."""
        return self.registry.cursor_conns()

