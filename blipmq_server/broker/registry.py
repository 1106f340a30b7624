"""Who consumes what: consumers by id and by connection, the in-memory queues (one per
subscription without a group, one per QoS 0 group) and the routing cache from a topic to
the queues it goes to. A topic's queues are found through an index of the queues' filters
(``topics.FilterIndex``), so resolving a new topic does not grow with the subscriptions.

A ``Consumer`` attaches a connection (an int the shell chose) to a queue or to a log cursor
(``broker.durable.DurableGroup``); the registry keeps the books and never decides delivery.
A QoS 0 group whose consumers all left keeps its queue for the next one, but only the
``limits.max_idle_groups`` most recently left are kept: memory stays bounded however many
group names clients use and leave.
Pure and synchronous; no trio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from blipmq_server.broker.queue import Overflow, Pool, Queue
from blipmq_server.broker.results import Limits, Refusal
from blipmq_server.broker.topics import FilterIndex
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.protocol.names import topic_problem

if TYPE_CHECKING:
    from blipmq_server.broker.durable import DurableGroup

_ROUTE_CACHE_LIMIT = 8192


def _queue_id(queue: Queue) -> int:
    return queue.id


class Consumer:
    """One subscriber attachment: a connection's subscription id on a queue or a cursor."""

    __slots__ = ("conn", "credit", "holder", "offered", "patient", "qos", "queue", "request_id",
                 "sub_id", "until")

    def __init__(
        self, sub_id: int, queue: Queue | DurableGroup, conn: int, qos: int, credit: int,
        request_id: int,
    ) -> None:
        self.sub_id = sub_id
        self.queue = queue
        self.conn = conn
        self.qos = qos
        self.credit = credit
        self.request_id = request_id
        # asked to be told when it is at the end (SUBSCRIBE_UNTIL_END), None otherwise or
        # once told: a log cursor's end offset, or for a queue the retained values left
        self.until: int | None = None
        # its log deliveries never time out: it acks them or gives them back itself (a
        # bridge, whose upstream may take longer than a retry's backoff to answer)
        self.patient = False
        # a durable group's consumer on behalf of a session that outlives it (an MQTT
        # persistent session's ``$share`` member at QoS 2): the QoS 2 messages in flight to
        # it when it leaves or a retry comes due wait for that session's next consumer
        # (``DurableGroup.kept``) rather than go to another member ("": none)
        self.holder = ""
        # the retained values it started with (or was offered again): a connection's
        # subscriptions together start with at most ``retained_max_per_connection``
        self.offered = 0

    def __repr__(self) -> str:
        return f"Consumer({self.sub_id}, {self.queue!r})"


class Route(NamedTuple):
    targets: tuple[Queue, ...]
    blockers: tuple[Queue, ...]  # the targets with the block policy
    # the pools of the targets' readers, each with how many of the targets read into it (a
    # message costs it that many copies), and last the total with all of them; routes are
    # made again when these change
    pools: tuple[tuple[Pool, int], ...] = ()


class Registry:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.queues: list[Queue] = []
        self.index: FilterIndex[Queue] = FilterIndex()  # the same queues, by filter
        self.groups: dict[tuple[str, str], Queue] = {}  # QoS 0 groups
        # the QoS 0 groups without a consumer, the one left longest ago first
        self.idle: dict[Queue, None] = {}
        self.consumers: dict[int, Consumer] = {}
        self.by_conn: dict[int, list[Consumer]] = {}
        self.offered: dict[int, int] = {}  # per connection, its consumers' ``offered``
        self.offered_total = 0  # all of them
        # per connection, what its queues hold together (``limits.max_bytes_per_connection``;
        # none kept when that is 0)
        self.pools: dict[int, Pool] = {}
        # what all the queues hold (``limits.max_bytes_total``)
        self.total = Pool(limits.max_bytes_total or 1 << 62)
        # per connection, what a delivery pass looks at (``candidates``): its log-cursor
        # consumers but those dozing (``doze``: their cursor is idle with nothing of its
        # topics logged since, until ``rouse``), and those of its queue consumers that may
        # have something (a superset: marked when their queue gets items, dropped once found
        # with nothing), so a connection holding thousands of quiet subscriptions costs
        # nothing per delivery
        self._cursor_consumers: dict[int, dict[Consumer, None]] = {}
        self._dozing: dict[int, dict[Consumer, None]] = {}
        self._marked: dict[int, dict[Consumer, None]] = {}
        self.routes: dict[bytes, Route | Refusal] = {}
        self._next_sub_id = 1
        self._next_queue_id = 1

    # ------------------------------------------------------------------------- routing

    def resolve(self, topic: bytes, internal: bool = False) -> Route | Refusal:
        """Which queues a topic goes to (cached until the subscriptions change)."""
        if len(self.routes) >= _ROUTE_CACHE_LIMIT:
            self.routes.clear()
        try:
            name = topic.decode("utf-8")
        except UnicodeDecodeError:
            route: Route | Refusal = Refusal(ErrorCode.INVALID_TOPIC, "topic is not valid UTF-8")
        else:
            problem = None if internal else topic_problem(name, self.limits.max_topic_bytes)
            if problem:
                route = Refusal(ErrorCode.INVALID_TOPIC, problem)
            else:
                levels = tuple(name.split("/"))
                found = self.index.match(levels)
                if len(found) > 1:  # in subscription order, as the queues list has them
                    found.sort(key=_queue_id)
                targets = tuple(found)
                blockers = tuple(q for q in targets if q.overflow is Overflow.BLOCK)
                pools: dict[Pool, int] = {}
                for q in targets:
                    for pool in q.pools:
                        pools[pool] = pools.get(pool, 0) + 1
                if targets:
                    pools[self.total] = len(targets)
                route = Route(targets, blockers, tuple(pools.items()))
        # broker-made topics ($dlq/...) must not open the cache to clients; a refused topic
        # is not kept either (it may be up to 64 KiB long, over server.max_topic_bytes)
        if not internal and route.__class__ is Route:
            self.routes[topic] = route
        return route

    # ---------------------------------------------------------------------------- books

    def queue_for(self, topic_filter: str, group: str, overflow: Overflow | None = None
                  ) -> Queue:
        """The QoS 0 group's queue (made on first use), or a new subscription's queue.
        ``overflow``: a new queue's policy (None: ``limits.overflow``)."""
        queue = self.groups.get((topic_filter, group)) if group else None
        if queue is None:
            limits = self.limits
            queue = Queue(self._next_queue_id, topic_filter, group or None, limits.capacity,
                          overflow or limits.overflow, limits.capacity_bytes, self.total)
            self._next_queue_id += 1
            self.queues.append(queue)
            self.index.add(queue.levels, queue)
            if group:
                self.groups[(topic_filter, group)] = queue
            self.routes.clear()
        return queue

    def add(
        self, conn: int, target: Queue | DurableGroup, qos: int, credit: int, request_id: int
    ) -> Consumer:
        consumer = Consumer(self._next_sub_id, target, conn, qos, credit, request_id)
        self._next_sub_id += 1
        target.consumers.append(consumer)
        if isinstance(target, Queue):
            self.idle.pop(target, None)
            if self.limits.max_bytes_per_connection:
                pool = self.pools.get(conn)
                if pool is None:
                    pool = self.pools[conn] = Pool(self.limits.max_bytes_per_connection)
                    self.total.queues += 1
                pool.queues += 1
                pool.size += target.size
                target.pools.append(pool)
                self.routes.clear()
        self.consumers[consumer.sub_id] = consumer
        self.by_conn.setdefault(conn, []).append(consumer)
        if isinstance(target, Queue):
            self.mark(consumer)  # a group's queue may hold items already
        else:
            self._cursor_consumers.setdefault(conn, {})[consumer] = None
        return consumer

    def offer(self, consumer: Consumer, n: int) -> None:
        """``consumer`` starts with ``n`` retained values (instead of what it had)."""
        left = self.offered.get(consumer.conn, 0) + n - consumer.offered
        self.offered_total += n - consumer.offered
        consumer.offered = n
        if left > 0:
            self.offered[consumer.conn] = left
        else:
            self.offered.pop(consumer.conn, None)

    def mark(self, consumer: Consumer) -> None:
        """This queue consumer may have something to take."""
        self._marked.setdefault(consumer.conn, {})[consumer] = None

    def unmark(self, consumer: Consumer) -> None:
        marked = self._marked.get(consumer.conn)
        if marked is not None:
            marked.pop(consumer, None)

    def doze(self, consumer: Consumer) -> None:
        """This log-cursor consumer has nothing to take until ``rouse``: its cursor is idle
        and nothing of its topics was logged since (``DurableGroup.idle``)."""
        awake = self._cursor_consumers.get(consumer.conn)
        if awake is not None and awake.pop(consumer, 0) is None:
            if not awake:
                del self._cursor_consumers[consumer.conn]
            self._dozing.setdefault(consumer.conn, {})[consumer] = None

    def rouse(self, consumer: Consumer) -> None:
        dozing = self._dozing.get(consumer.conn)
        if dozing is not None and dozing.pop(consumer, 0) is None:
            if not dozing:
                del self._dozing[consumer.conn]
            self._cursor_consumers.setdefault(consumer.conn, {})[consumer] = None

    def rouse_any(self, dozes: Callable[[Consumer], bool]) -> set[int]:
        """Dozing consumers that should not (``dozes`` says no) look again: a safety net
        under ``rouse``. Returns their connections."""
        woken = [c for dozing in self._dozing.values() for c in dozing if not dozes(c)]
        for consumer in woken:
            self.rouse(consumer)
        return {c.conn for c in woken}

    def cursor_conns(self) -> set[int]:
        """The connections with a consumer on a log cursor (dozing or not)."""
        return set(self._cursor_consumers) | set(self._dozing)

    def reads_cursors(self) -> bool:
        """Whether any connection consumes from a log cursor."""
        return bool(self._cursor_consumers or self._dozing)

    def candidates(self, conn: int) -> list[Consumer]:
        """The consumers of ``conn`` that may have something: its cursor consumers and its
        marked queue consumers (in the order they were marked)."""
        marked = self._marked.get(conn)
        cursors = self._cursor_consumers.get(conn)
        if not marked:
            return list(cursors) if cursors else []
        return [*cursors, *marked] if cursors else list(marked)

    def owned(self, conn: int, sub_id: int) -> Consumer | None:
        """The subscription ``sub_id`` if ``conn`` holds it (else None: ignored or refused)."""
        consumer = self.consumers.get(sub_id)
        return consumer if consumer is not None and consumer.conn == conn else None

    def of(self, conn: int) -> list[Consumer]:
        return self.by_conn.get(conn, [])

    def forget(self, consumer: Consumer) -> None:
        """Take a consumer out of the books (not out of its queue or cursor)."""
        self.consumers.pop(consumer.sub_id, None)
        conn = consumer.conn
        self.offer(consumer, 0)
        mine = self.by_conn.get(conn)
        if mine and consumer in mine:
            mine.remove(consumer)
            if not mine:
                del self.by_conn[conn]
        self.unmark(consumer)
        for by_conn in (self._cursor_consumers, self._dozing):
            cursors = by_conn.get(conn)
            if cursors and cursors.pop(consumer, 0) is None and not cursors:
                del by_conn[conn]
        if conn in self._marked and not self._marked[conn]:
            del self._marked[conn]

    def leave(self, consumer: Consumer, released: list[int]) -> None:
        """A consumer leaves its in-memory queue; a subscription's own queue goes with it,
        a group's stays (idle once its last consumer left)."""
        queue = consumer.queue
        assert isinstance(queue, Queue)
        if consumer in queue.consumers:
            queue.consumers.remove(consumer)
            self.unpool(consumer, queue, released)
        released.append(queue.id)
        if queue.group is None:
            self.drop(queue)
        elif not queue.consumers:
            self.idle[queue] = None

    def unpool(self, consumer: Consumer, queue: Queue, released: list[int]) -> None:
        """``consumer`` no longer reads ``queue``: its bytes leave the connection's pool, and
        the queues that held publishers back for the pool's room are ``released``."""
        pool = self.pools.get(consumer.conn)
        if pool is not None and pool in queue.pools:
            queue.pools.remove(pool)
            self.routes.clear()
            pool.size -= queue.size
            pool.queues -= 1
            released.extend(pool.blocking)
            pool.blocking.clear()
            released.extend(self.total.blocking)
            self.total.blocking.clear()
            if not pool.queues:
                del self.pools[consumer.conn]
                self.total.queues -= 1

    def drop_idle(self) -> list[Queue]:
        """Drop the idle QoS 0 groups beyond ``limits.max_idle_groups``, those left longest
        ago first; returns them (their messages are gone with them)."""
        idle = self.idle
        dropped: list[Queue] = []
        while len(idle) > self.limits.max_idle_groups:
            queue = next(iter(idle))
            assert queue.group is not None
            self.groups.pop((queue.filter, queue.group), None)
            self.drop(queue)
            dropped.append(queue)
        return dropped

    def drop(self, queue: Queue) -> None:
        self.idle.pop(queue, None)
        if queue.total is self.total:  # its items go with it, out of the total
            self.total.size -= queue.size
            queue.total = Pool()
        if queue in self.queues:
            self.queues.remove(queue)
            self.index.remove(queue.levels, queue)
            self.routes.clear()
