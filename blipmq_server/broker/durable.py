"""Log cursors: durable consumer groups, and replaying or QoS 1 subscribers without a group.

A cursor never holds its backlog in memory: it reads matching messages from the log at
``next``, hands each to one of its consumers and, when it takes acks (QoS 1), keeps it in
flight until acked. An unacked delivery comes back when its deadline passes (exponential
backoff from ``retry_backoff_ms``), when its consumer nacks it (now, or after a delay) or
goes away. A *durable group* (QoS 1 with a group name) is persistent: its creation, acks,
last detach and deletion are log records, so a restart rebuilds it, and everything from its
floor (lowest unacked offset) that was not acked is delivered again. A cursor without a
group lives as long as its one subscription and writes nothing to the log.

Record bodies (big-endian, inside the wal record of that kind):

    GROUP:  | op u8 | start u64 | filter str16 | group str16 |
            op 1 create (reading from ``start``), 2 delete, 3 idle (last consumer left),
            4 checkpoint, which goes on with:
            | group_id u64 | count u32 | unacked u64 * count | count u32 | acked u64 * count |
    ACK:    | group_id u64 | floor u64 | count u16 | offsets u64 * count |

A group's id is the log offset of its GROUP create record. A checkpoint restates a group
whole (cursor ``start``, the unacked deliveries below it, the acks above it), so retention
may delete the segment holding its create record: the broker checkpoints every group whose
latest create or checkpoint (its ``anchor``) is not in the newest segment before retention
runs. Pure: no trio, no clock.
"""

from __future__ import annotations

import struct
from collections import deque
from operator import itemgetter
from typing import Any, NamedTuple

from blipmq_server.broker.budget import Budget
from blipmq_server.broker.results import Count
from blipmq_server.broker.topics import matches
from blipmq_server.broker.unacked import Unacked
from blipmq_server.kinds import Kind
from blipmq_server.protocol.message import (
    DELIVERY_PREFIX,
    FLAG_QOS2,
    HEAD_SIZE,
    MSG_HEAD,
    PREFIX_SIZE,
)

_GROUP_HEAD = struct.Struct(">BQ")
_ACK_HEAD = struct.Struct(">QQH")
_U16 = struct.Struct(">H")
CREATE, DELETE, IDLE, CHECKPOINT = 1, 2, 3, 4  # IDLE: its last consumer detached
_CHECKPOINT_HEAD = struct.Struct(">QI")
_U32 = struct.Struct(">I")
DELAYED = -1  # Flight.sub_id of a delivery nacked with a delay
KEPT = -2  # Flight.sub_id of a QoS 2 delivery kept for its holder (``DurableGroup.kept``)
NEVER = 1 << 62  # the delay of a patient consumer's deliveries (``Cursors.take``): never due
_unpack_head = MSG_HEAD.unpack_from
_HEAD = HEAD_SIZE
_MESSAGE = int(Kind.MESSAGE)  # a plain int for the per-record test
# A cursor's topic matches (``DurableGroup.wants``): at most this many bytes, each topic
# charged its length and ``_MATCH_COST`` (its bytes object and dict slot, measured 70-90 B);
# full, they are forgotten and learnt again. 4,096 topics of 1 KB each once cost 3.8 MB.
MATCHES_BYTES = 256 * 1024
_MATCH_COST = 80
# What a record read ahead costs besides its body: the record tuple, its ints, the body's
# bytes header, the deque slot (measured: 175 B)
RECORD_COST = 176
_body = itemgetter(3)
BRIDGE_GROUPS = "bridge."  # the durable groups of bridges: no client joins one


class GroupRecord(NamedTuple):
    op: int
    start: int
    topic_filter: str
    group: str
    group_id: int = 0  # checkpoint only, like the two below
    unacked: tuple[int, ...] = ()
    acked: tuple[int, ...] = ()


def group_body(op: int, start: int, topic_filter: str, group: str) -> bytes:
    f, g = topic_filter.encode(), group.encode()
    return _GROUP_HEAD.pack(op, start) + _U16.pack(len(f)) + f + _U16.pack(len(g)) + g


def checkpoint_body(target: DurableGroup) -> bytes:
    unacked = sorted({*target.inflight, *target.pending})
    acked = sorted(target.acked)
    return b"".join((
        group_body(CHECKPOINT, target.next, target.filter, target.group),
        _CHECKPOINT_HEAD.pack(target.id, len(unacked)), struct.pack(f">{len(unacked)}Q", *unacked),
        _U32.pack(len(acked)), struct.pack(f">{len(acked)}Q", *acked),
    ))


def parse_group(body: bytes) -> GroupRecord:
    op, start = _GROUP_HEAD.unpack_from(body)
    pos = _GROUP_HEAD.size
    (n,) = _U16.unpack_from(body, pos)
    topic_filter = body[pos + 2 : pos + 2 + n].decode()
    pos += 2 + n
    (m,) = _U16.unpack_from(body, pos)
    group = body[pos + 2 : pos + 2 + m].decode()
    if op != CHECKPOINT:
        return GroupRecord(op, start, topic_filter, group)
    pos += 2 + m
    group_id, n = _CHECKPOINT_HEAD.unpack_from(body, pos)
    pos += _CHECKPOINT_HEAD.size
    unacked = struct.unpack_from(f">{n}Q", body, pos)
    pos += 8 * n
    (m,) = _U32.unpack_from(body, pos)
    acked = struct.unpack_from(f">{m}Q", body, pos + 4)
    return GroupRecord(op, start, topic_filter, group, group_id, unacked, acked)


def ack_body(group_id: int, floor: int, offsets: list[int]) -> bytes:
    return _ACK_HEAD.pack(group_id, floor, len(offsets)) + struct.pack(
        f">{len(offsets)}Q", *offsets
    )


def parse_ack(body: bytes) -> tuple[int, int, tuple[int, ...]]:
    group_id, floor, n = _ACK_HEAD.unpack_from(body)
    return group_id, floor, struct.unpack_from(f">{n}Q", body, _ACK_HEAD.size)


class Flight:
    """One delivered, not yet acked message. ``sub_id`` is the consumer holding it, 0 when it
    waits in ``ready``, ``DELAYED`` until ``due`` after a delayed nack, ``KEPT`` while it
    waits for its holder in ``DurableGroup.kept``."""

    __slots__ = ("body", "count", "dflags", "due", "sub_id", "timestamp_ms")

    def __init__(self, body: bytes, sub_id: int, due: int, timestamp_ms: int,
                 dflags: int = 0) -> None:
        self.body = body
        self.count = 1
        self.sub_id = sub_id
        self.due = due
        self.timestamp_ms = timestamp_ms  # of its log record: every delivery carries it
        self.dflags = dflags  # DELIVERED_RETAINED: a retained value sent on subscribing


class DurableGroup:
    __slots__ = (
        "_chunks",
        "_matches",
        "_matches_size",
        "_void",
        "acked",
        "acks",
        "ahead",
        "anchor",
        "backlog",
        "budget",
        "conn_of",
        "consumers",
        "epoch",
        "fetching",
        "filter",
        "first",
        "flying",
        "group",
        "held",
        "held_bytes",
        "id",
        "idle_since",
        "inflight",
        "kept",
        "key",
        "levels",
        "memory",
        "next",
        "parked",
        "pending",
        "persistent",
        "quiet_from",
        "ready",
        "skipped",
        "soonest",
        "unacked",
    )

    durable = True  # reads from the log (a Queue holds its messages instead)

    def __init__(
        self, group_id: int, topic_filter: str, group: str, start: int,
        persistent: bool = True, acks: bool = True, idle_since: int | None = None,
    ) -> None:
        self.id = group_id
        self.filter = topic_filter
        self.levels = tuple(topic_filter.split("/"))
        self.group = group
        self.persistent = persistent  # a durable group: its state is in the log
        self.acks = acks  # QoS 1: deliveries stay in flight until acked
        self.next = start  # next log offset to read
        self.first = start  # where it began to read (what came before was never its)
        self.inflight: dict[int, Flight] = {}
        self.held: dict[int, int] = {}  # sub_id -> deliveries that consumer holds in flight
        self.held_bytes: dict[int, int] = {}  # sub_id -> their message records' bytes
        self.conn_of: dict[int, int] = {}  # sub_id -> its connection, while it holds any
        # the broker's count of those bytes per connection (``Cursors.take`` bounds them)
        self.unacked: Unacked | None = None
        self.ready: deque[int] = deque()  # in-flight offsets to deliver again now
        # no delivery in flight comes due before this (``expire`` looks at none until then):
        # lowered whenever one is given a deadline, raised to the true soonest by a look
        self.soonest = NEVER
        # holder -> in-flight offsets of QoS 2 messages to deliver again to that holder's
        # consumer only (``Consumer.holder``: an MQTT persistent session's share member,
        # MQTT-4.8.2-4, -5): never handed to another consumer while they wait
        self.kept: dict[str, deque[int]] = {}
        self.acked: set[int] = set()  # acked at or above the cursor (known from a restart)
        # unacked below the cursor, known by offset only (from a checkpoint, or ``unload``):
        # read back from the log by the next take
        self.pending: set[int] = set()
        self.parked = 0  # bytes of unacked messages kept in memory while it has no consumer
        self.anchor = group_id  # offset of the latest create or checkpoint record
        # log records removed by the retention size cap before it read them, and unacked
        # deliveries a restart lost because the size cap had removed them (Cursors.recovered)
        self.skipped = 0
        # logged messages of its own topics not read yet (durable groups only): the core
        # adds one per matching append, the cursor takes one off per matching record passed
        self.backlog = 0
        self.epoch = 0  # bumped when the backlog is recounted from scratch (results.Count)
        # Durable groups only: no message of its topics is in the log at or after this
        # offset, as far as the core knows (None: not known). Set when the cursor has read
        # the whole log; the core forgets it on every append of a message of its topics.
        # A cursor at or past it skips to the log's end without reading what is between.
        self.quiet_from: int | None = None
        self.consumers: list[Any] = []
        self.idle_since = idle_since  # wall ms since when no consumer is attached
        # Read-ahead: log records from ``next`` on, read but not yet looked at. Filled from the
        # log's in-memory cache by the core, or by the shell reading the segment files off
        # the event loop (``fetching`` while such a read is under way).
        self.ahead: deque[Any] = deque()
        self.fetching = False
        # each fill's last offset and bytes, oldest first: let go of once the cursor passed it
        self._chunks: deque[tuple[int, int]] = deque()
        # what was read ahead went while a read was under way (``shed``): that read would
        # leave a gap, and is dropped when it comes (``fill``)
        self._void = False
        self.key = 0  # the broker's handle for this cursor (durable or not)
        self._matches: dict[bytes, bool] = {}  # topic -> whether it matches the filter
        self._matches_size = 0  # bytes charged for them (``MATCHES_BYTES``)
        self.memory = 0  # bytes held for speed: read-ahead and matches (``budget``)
        self.budget: Budget | None = None  # the broker's, shared by every cursor
        # the cursors that may have deliveries in flight (``Cursors.flying``, shared): this
        # one joins when it puts one in flight that can come due (not a patient consumer's),
        # or a delayed nack waits, so that ``Cursors.redeliver`` looks only
        # at those, not at every cursor of the broker every 100 ms
        self.flying: dict[DurableGroup, None] | None = None

    def __repr__(self) -> str:
        return f"DurableGroup({self.filter!r}, {self.group!r}, next={self.next})"

    @property
    def idle(self) -> bool:
        """Nothing in flight, to send again, read ahead or being read, and nothing of its
        topics logged since it read to the end (``quiet_from``): only an append of one of
        its topics' messages (``usage``), or retained values offered to it, give it work."""
        quiet = self.quiet_from
        return (quiet is not None and self.next >= quiet and not self.inflight
                and not self.ready and not self.pending and not self.ahead and not self.kept
                and not self.fetching)

    def pass_quiet(self, end: int) -> bool:
        """Whether nothing of its topics lies between its position and ``end`` (the end of
        what is written): it read to the end since the last append of one of its topics
        (``quiet_from``), with nothing read ahead or being read. If so it moves to ``end``
        without reading other topics' records."""
        quiet = self.quiet_from
        if quiet is None or self.next < quiet or self.ahead or self.fetching:
            return False
        if self.next < end:
            self.next = end
        return True

    @property
    def floor(self) -> int:
        """Every offset below this is acked or not for this group."""
        if not self.inflight and not self.pending:
            return self.next
        return min(min(self.inflight, default=self.next), min(self.pending, default=self.next))

    def recover_ack(self, floor: int, offsets: tuple[int, ...]) -> None:
        self.next = max(self.next, floor)
        done = set(offsets)
        self.pending = {o for o in self.pending if o >= floor and o not in done}
        self.acked = {o for o in self.acked if o >= self.next}
        self.acked.update(o for o in offsets if o >= self.next)

    def count(self, first: int, last: int) -> Count:
        """Its backlog from ``first`` to ``last``, to count off the event loop, leaving out
        the offsets there known acked now (the cursor forgets those as it passes them, and
        never takes them off the backlog)."""
        acked = frozenset(o for o in self.acked if first <= o <= last)
        return Count(self.key, first, last, self.levels, self.epoch, acked)

    def move_to(self, offset: int) -> None:
        """Read on from ``offset`` (records below it were removed): forget the read-ahead."""
        if offset > self.next:
            self.next = offset
            self._drop_ahead()

    def fill(self, records: list[Any]) -> None:
        """Records read from the log at ``next``, or after the read-ahead's last one: onto
        the read-ahead (what ``next`` or the read-ahead passed meanwhile is dropped)."""
        if self._void:
            self._void = False
            return
        if not records:
            return
        ahead = self.ahead
        nxt = max(self.next, ahead[-1][1] + 1) if ahead else self.next
        if records[0][1] < nxt:
            records = [r for r in records if r[1] >= nxt]
            if not records:
                return
        ahead.extend(records)
        size = sum(map(len, map(_body, records))) + RECORD_COST * len(records)
        self._chunks.append((records[-1][1], size))
        self._charge(size)

    def _charge(self, n: int) -> None:
        self.memory += n
        if self.budget is not None:
            self.budget.charge(self, n)

    def _release(self, n: int) -> None:
        self.memory -= n
        if self.budget is not None:
            self.budget.release(self, n)

    def _drop_ahead(self) -> None:
        """Forget the read-ahead (a read under way then leaves a gap: dropped too)."""
        if self.ahead:
            self.ahead.clear()
            if self.fetching:
                self._void = True
        if self._chunks:
            self._release(sum(n for _, n in self._chunks))
            self._chunks.clear()

    def _drop_matches(self) -> None:
        self._matches.clear()  # not a new dict: ``take_new`` holds its ``get``
        if self._matches_size:
            self._release(self._matches_size)
            self._matches_size = 0

    def shed(self) -> None:
        """Let go of what is held for speed only (``budget``; a consumer that left): the
        read-ahead, read again when a consumer takes, and the topic matches."""
        if self.budget is not None:
            self.budget.shed_bytes += self.memory
        self._drop_ahead()
        self._drop_matches()

    def restore(self, g: GroupRecord) -> None:
        """State from a checkpoint record."""
        self._drop_ahead()
        self.next = g.start
        self.pending = set(g.unacked)
        self.acked = set(g.acked)
        self.inflight.clear()
        self.let_go()
        self.ready.clear()
        self.kept.clear()

    def load_pending(self, records: list[Any]) -> None:
        """Unacked deliveries known by offset only (``pending``), read back from the log
        (MESSAGE records): ready again, but for those in flight meanwhile (a retained
        value offered again at the same offset)."""
        inflight = self.inflight
        for record in records:
            if record.offset in self.pending and record.offset not in inflight:
                inflight[record.offset] = Flight(record.body, 0, 0, record.timestamp_ms)
                self.ready.append(record.offset)
        self.pending.clear()
        self._flies()

    def unload(self) -> None:
        """Nobody consumes: the unacked messages waiting to go again keep only their offsets
        (``pending``, read back from the log by the next consumer's first take); retained
        values offered on subscribing and QoS 2 ones kept for their holder stay."""
        inflight = self.inflight
        gone = [o for o, f in inflight.items() if f.sub_id in (0, DELAYED) and not f.dflags]
        for offset in gone:
            del inflight[offset]
        self.pending.update(gone)
        self.ready = deque(o for o in self.ready if o in inflight)

    def offer_retained(self, values: list[Any], dflags: int) -> None:
        """Retained values (``retained.Value``) for a new QoS 1 subscription, or one made
        again: in flight and ready, ahead of the log, each counted as delivered once it is
        taken. A value whose record is in flight already (delivered live, or offered
        before) takes its place: its consumer no longer holds the old delivery (an ack of
        it is ignored; the value comes again), and one waiting to go is not queued twice."""
        inflight = self.inflight
        for value in values:
            offset = value.offset
            old = inflight.get(offset)
            flight = Flight(value.record, 0, 0, value.timestamp_ms, dflags)
            flight.count = 0
            inflight[offset] = flight
            if old is not None and old.sub_id > 0:
                self._unhold(old.sub_id, 1, len(old.body))
            if old is None or old.sub_id != 0:
                self.ready.append(offset)
        self._flies()

    def _flies(self) -> None:
        """Deliveries may come due now (held by a consumer, or nacked with a delay): among
        the cursors ``redeliver`` looks at."""
        if self.inflight and self.flying is not None:
            self.flying[self] = None

    def wants(self, topic: bytes) -> bool:
        hit = self._matches.get(topic)
        if hit is None:
            try:
                levels = tuple(topic.decode("utf-8").split("/"))
            except UnicodeDecodeError:
                levels = ("",)
            hit = matches(self.levels, levels)
            cost = len(topic) + _MATCH_COST
            if self._matches_size + cost > MATCHES_BYTES:
                self._drop_matches()
            self._matches[topic] = hit
            self._matches_size += cost
            self._charge(cost)
        return hit

    def take_ready(
        self, sub_id: int, room: int, max_bytes: int, now_ms: int, backoff: Any,
        holder: str = "", conn: int = 0,
    ) -> tuple[list[bytes], int]:
        """Deliveries to send again, within ``room`` records and ``max_bytes`` (the first one
        goes whatever its size): those kept for ``holder`` first; returns them and their size
        in bytes."""
        out: list[bytes] = []
        size = 0
        bodies = 0
        kept = self.kept.get(holder) if holder and self.kept else None
        sources = ((self.ready, 0),) if kept is None else ((kept, KEPT), (self.ready, 0))
        for ready, waiting in sources:
            while ready and len(out) < room:
                offset = ready[0]
                flight = self.inflight.get(offset)
                if flight is None or flight.sub_id != waiting:
                    ready.popleft()
                    continue  # acked, or taken again, meanwhile
                record_size = PREFIX_SIZE + len(flight.body)
                if out and size + record_size > max_bytes:
                    break
                ready.popleft()
                flight.count += 1
                flight.sub_id = sub_id
                bodies += len(flight.body)
                flight.due = due = now_ms + backoff(flight.count)
                if due < self.soonest:
                    self.soonest = due
                out.append(DELIVERY_PREFIX.pack(offset, min(flight.count, 0xFFFF),
                                                flight.timestamp_ms, flight.dflags) + flight.body)
                size += record_size
            if ready:
                break
        if kept is not None and not kept:
            del self.kept[holder]
        if out:
            self._hold(sub_id, conn, len(out), bodies)
            if now_ms + backoff(1) < NEVER:
                self._flies()  # held by a consumer again: they may come due
        return out, size

    def take_new(
        self, sub_id: int, room: int, max_bytes: int, used: int, now_ms: int, wall_ms: int,
        backoff: Any, conn: int = 0,
    ) -> tuple[list[bytes], int, int, bool]:
        """Deliver matching MESSAGE records from the read-ahead, within ``room`` records and
        ``max_bytes`` for the whole batch, ``used`` of which are taken already (a batch's
        first record goes whatever its size). Returns (records, the batch's size now,
        expired, full); the cursor stops before the first record left out."""
        out: list[bytes] = []
        size = used
        expired = 0
        full = False
        due = now_ms + backoff(1)
        acks = self.acks
        ahead = self.ahead
        inflight = self.inflight
        acked = self.acked
        wants = self.wants
        known = self._matches.get
        pack = DELIVERY_PREFIX.pack
        nxt = self.next
        taken = 0  # matching records passed (the backlog counts them)
        popleft = ahead.popleft
        append = out.append
        while ahead:
            kind, offset, ts, body = ahead[0]
            if offset < nxt:
                popleft()
                continue
            if len(out) >= room:
                full = True
                break
            if size and size + PREFIX_SIZE + len(body) > max_bytes and kind == _MESSAGE:
                full = True
                break
            popleft()
            nxt = offset + 1
            if kind != _MESSAGE:
                continue
            _, ttl, tlen, _, _ = _unpack_head(body)
            topic = body[_HEAD : _HEAD + tlen]
            hit = known(topic)  # ``wants`` without its call for a topic seen before
            if not (wants(topic) if hit is None else hit):
                continue
            if acked and offset in acked:  # acked before a restart: never counted
                acked.discard(offset)
                continue
            taken += 1
            if ttl and ts + ttl <= wall_ms:
                expired += 1
                continue
            if acks:
                inflight[offset] = Flight(body, sub_id, due, ts)
            append(pack(offset, 1, ts, 0) + body)
            size += PREFIX_SIZE + len(body)
        self.next = nxt
        self.backlog -= taken
        chunks = self._chunks
        if chunks and chunks[0][0] < nxt:  # whole reads passed: no longer held
            passed = 0
            while chunks and chunks[0][0] < nxt:
                passed += chunks.popleft()[1]
            self._release(passed)
        if acks and out:
            self._hold(sub_id, conn, len(out), size - used - PREFIX_SIZE * len(out))
            # a patient consumer's deliveries never come due: ``redeliver`` would look at
            # every one of them ten times a second for nothing (a bridge's window of 4,000
            # cost its drain 5% of the broker's CPU so)
            if due < NEVER:
                if due < self.soonest:
                    self.soonest = due
                self._flies()
        return out, size, expired, full

    def ack(self, sub_id: int, offsets: tuple[int, ...]) -> list[int]:
        """Offsets that were in flight for this consumer and are now done."""
        done = []
        size = 0
        for offset in offsets:
            flight = self.inflight.get(offset)
            if flight is not None and flight.sub_id == sub_id:
                del self.inflight[offset]
                done.append(offset)
                size += len(flight.body)
        if done:
            self._unhold(sub_id, len(done), size)
        return done

    def _hold(self, sub_id: int, conn: int, n: int, size: int) -> None:
        """The consumer took ``n`` deliveries more, of ``size`` record bytes."""
        self.held[sub_id] = self.held.get(sub_id, 0) + n
        self.held_bytes[sub_id] = self.held_bytes.get(sub_id, 0) + size
        if self.unacked is not None:
            self.conn_of[sub_id] = conn
            self.unacked.add(conn, size)

    def _unhold(self, sub_id: int, n: int, size: int) -> None:
        """The consumer no longer holds ``n`` deliveries of ``size`` record bytes; once it
        holds none, its byte count starts again from 0 whatever it says."""
        left = self.held.get(sub_id, 0) - n
        if left <= 0:
            self._unhold_all(sub_id)
            return
        self.held[sub_id] = left
        had = self.held_bytes.get(sub_id, 0)
        now = self.held_bytes[sub_id] = max(0, had - size)
        if self.unacked is not None and sub_id in self.conn_of:
            self.unacked.add(self.conn_of[sub_id], now - had)

    def _unhold_all(self, sub_id: int) -> None:
        """The consumer holds no delivery of this cursor any more."""
        self.held.pop(sub_id, None)
        had = self.held_bytes.pop(sub_id, 0)
        conn = self.conn_of.pop(sub_id, None)
        if self.unacked is not None and conn is not None:
            self.unacked.add(conn, -had)

    def let_go(self) -> None:
        """No consumer holds anything of this cursor any more (it ends, or is restored)."""
        for sub_id in list(self.held_bytes):
            self._unhold_all(sub_id)
        self.held.clear()

    def held_by(self, sub_id: int, offsets: tuple[int, ...]) -> list[int]:
        """Those of ``offsets`` that this consumer holds in flight."""
        inflight = self.inflight
        return [o for o in offsets if o in inflight and inflight[o].sub_id == sub_id]

    def back(self, offsets: list[int], now_ms: int = 0, delay_ms: int = 0) -> None:
        """Deliveries come back: to the front of ``ready`` in their order, or after
        ``delay_ms``."""
        holders = None if delay_ms else self._holders()
        for offset in offsets:
            flight = self.inflight[offset]
            if flight.sub_id > 0:
                self._unhold(flight.sub_id, 1, len(flight.body))
                if holders and self._keep(offset, flight, holders.get(flight.sub_id)):
                    continue
            flight.sub_id = DELAYED if delay_ms else 0
            flight.due = now_ms + delay_ms
        if delay_ms and now_ms + delay_ms < self.soonest:
            self.soonest = now_ms + delay_ms
        if not delay_ms:
            self.ready.extendleft(reversed([o for o in offsets if self.inflight[o].sub_id == 0]))
        elif offsets:
            self._flies()  # the delayed ones come due

    def _holders(self) -> dict[int, str] | None:
        """sub_id -> holder of this group's consumers that have one (None: none has)."""
        return {c.sub_id: c.holder for c in self.consumers
                if getattr(c, "holder", "")} or None

    def _keep(self, offset: int, flight: Flight, holder: str | None) -> bool:
        """A QoS 2 message's delivery comes back from a consumer with a ``holder``: kept for
        it (True), never handed to another consumer (MQTT-4.8.2-4, -5)."""
        if not holder or not _unpack_head(flight.body)[0] & FLAG_QOS2:
            return False
        flight.sub_id = KEPT
        self.kept.setdefault(holder, deque()).append(offset)
        return True

    def release(self, holder: str) -> int:
        """The holder is gone for good (its session ended): what was kept for it goes to
        the others. Returns how many."""
        n = 0
        for offset in self.kept.pop(holder, ()):
            flight = self.inflight.get(offset)
            if flight is not None and flight.sub_id == KEPT:
                flight.sub_id = 0
                self.ready.append(offset)
                n += 1
        return n

    def drop(self, offset: int) -> Flight:
        """Take a delivery out of flight for good (it goes to the dead-letter topic)."""
        flight = self.inflight.pop(offset)
        if flight.sub_id > 0:
            self._unhold(flight.sub_id, 1, len(flight.body))
        return flight

    def requeue(self, sub_id: int, holder: str = "") -> int:
        """A consumer left: its deliveries go to the others (or wait for the next one), but
        for a ``holder``'s QoS 2 messages, kept for the holder's next consumer."""
        n = 0
        for offset, flight in self.inflight.items():
            if flight.sub_id == sub_id:
                n += 1
                if holder and self._keep(offset, flight, holder):
                    continue
                flight.sub_id = 0
                self.ready.append(offset)
        self._unhold_all(sub_id)
        return n

    def expire(self, now_ms: int) -> tuple[list[int], int, int]:
        """Deliveries whose consumer did not ack them in time (still in flight, for the
        caller to give back or drop, each of them), how many delayed nacks became ready,
        and how many deliveries may still come due later (held by a consumer, or nacked
        with a delay, and not due now; a patient consumer's never does): none, and nothing
        of this group can come due before it hands a delivery out again (``take_new``,
        ``take_ready``) or a NACK delays one (``back``). Before ``soonest`` it looks at
        none of them."""
        soonest = self.soonest
        if now_ms < soonest and (self.held or soonest >= NEVER):
            # none due yet: no look at each of a window of thousands (held by a consumer,
            # they stay in flight; with none held, a look finds whether any was delayed)
            return [], 0, int(soonest < NEVER)
        late = []
        woke = waiting = 0
        soonest = NEVER
        for offset, f in self.inflight.items():
            if f.sub_id and f.sub_id != KEPT:
                due = f.due
                if due > now_ms:
                    # a patient consumer's delivery never comes due: not waited for
                    if due < NEVER:
                        waiting += 1
                        if due < soonest:
                            soonest = due
                elif f.sub_id == DELAYED:
                    f.sub_id = 0
                    self.ready.append(offset)
                    woke += 1
                else:
                    late.append(offset)
        self.soonest = soonest  # the late ones: given back or dropped by the caller
        return late, woke, waiting

    def in_flight_for(self, sub_id: int) -> int:
        return self.held.get(sub_id, 0)

    def bytes_for(self, sub_id: int) -> int:
        """Record bytes of the deliveries the consumer holds in flight."""
        return self.held_bytes.get(sub_id, 0)
