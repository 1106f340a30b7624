"""Log cursors: durable QoS 1 groups, QoS 1 subscriptions without a group, and replays.

A cursor (``broker.durable.DurableGroup``) reads the log from its position; QoS 1 ones keep
what they delivered in flight until it is acked, redeliver it with backoff, and after
``max_retries`` deliveries hand it back as a dead letter for ``$dlq/<topic>`` (a dead letter
itself is dropped then, never dead-lettered again). Durable groups write their changes to
the log as GROUP and ACK records and are rebuilt from them on start. Records the log holds
only on disk are never read here: the cursor asks for a ``Fetch`` and the shell reads it off
the event loop (``fill``).
Pure and synchronous; no trio, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from blipmq_server.broker import durable
from blipmq_server.broker.budget import Budget
from blipmq_server.broker.durable import BRIDGE_GROUPS, DurableGroup
from blipmq_server.broker.results import Count, Counters, Fetch, Limits, Refusal
from blipmq_server.broker.storage import READ_AHEAD_RECORDS, MessageLog, StoredRecord, Unwritten
from blipmq_server.broker.topics import FilterIndex
from blipmq_server.broker.unacked import Unacked
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import DeadLetter, ErrorCode, RawMessage, Start, dead_letter
from blipmq_server.protocol.message import is_dead_letter, message_from_record

if TYPE_CHECKING:
    from blipmq_server.broker.registry import Consumer

_CACHE_READ_RECORDS = 512  # records a cursor decodes from the log's cache in one go
_ROUNDS = 8  # read-aheads one take may look through (a filter that matches little)
_READ_ON_BELOW = READ_AHEAD_RECORDS // 2  # records left ahead when the next disk read starts
_UNWRITTEN_KEPT = 1024  # ACK records acks_due looks at, at most (plenty to be due)
_PENDING_RUN = 1024  # records one read of unacked deliveries to load back covers, at most


def _never(count: int) -> int:
    """The redelivery delay of a patient consumer's deliveries: none comes due (and
    ``redeliver`` stops looking at a cursor that holds only such)."""
    return durable.NEVER


def _late(count: int) -> str:
    return f"not acked in time ({count} deliveries)"


class Cursors:
    def __init__(self, limits: Limits, log: MessageLog, counters: Counters) -> None:
        self.limits = limits
        self.log = log
        self.counters = counters
        self.durable: dict[tuple[str, str], DurableGroup] = {}
        self._index: FilterIndex[DurableGroup] = FilterIndex()  # every cursor by its filter
        self._ids: dict[int, DurableGroup] = {}  # durable groups by id (their create offset)
        self._plain: list[DurableGroup] = []  # cursors of subscriptions without a group
        # cursors that put deliveries in flight since ``redeliver`` last found them with
        # none (``DurableGroup.flying``), in the order they did: all it has to look at
        self.flying: dict[DurableGroup, None] = {}
        self._by_key: dict[int, DurableGroup] = {}  # every cursor by its key
        # read-aheads and topic matches, all cursors together (``broker.budget``)
        self.budget = Budget(limits.read_ahead_bytes)
        # what consumers hold unacked, per connection and in all (``_bytes_room``)
        self.unacked = Unacked(limits.max_inflight_bytes, limits.max_inflight_bytes_total)
        # unacked messages kept in memory by durable groups without a consumer, all together
        # (``_park``): past ``max_inflight_bytes``, a group left alone keeps their offsets only
        self.parked = 0
        self._next_key = 1
        self._fetches: list[Fetch] = []  # disk reads cursors wait for, not yet handed out
        self._buried: list[tuple[DurableGroup, int]] = []  # dead-lettered, ACK not yet logged
        # the last dead letter dropped for good (``_spend``), for the shell's log line:
        # its topic, and the filter and group of the cursor that gave up on it
        self.last_dropped: tuple[str, str, str] | None = None
        self.generation = 0  # grows whenever a cursor (durable or plain) is added or forgotten
        self._counts: list[Count] = []  # backlogs to count off the event loop
        # ACK records not written yet: (record's offset, offsets it acks, half the acking
        # consumer's window), oldest first (``acks_due``)
        self._unwritten: deque[tuple[int, int, int]] = deque()
        # what may not be written yet, for ``relog``: each durable group's newest GROUP or
        # ACK record (by group id), and the newest DELETE record of a (filter, group)
        self._recent: Unwritten[int] = Unwritten(log)
        self._deleted: Unwritten[tuple[str, str]] = Unwritten(log)

    @property
    def all(self) -> tuple[DurableGroup, ...]:
        return (*self.durable.values(), *self._plain)

    # -------------------------------------------------------------------------- open

    def open(
        self, topic_filter: str, group: str, qos: int, start: int, start_offset: int,
        timestamp_ms: int,
    ) -> DurableGroup | Refusal:
        """The cursor a new subscription reads from: an existing durable group (which goes
        on where it was), a new one, or a cursor of its own."""
        target = self.durable.get((topic_filter, group)) if group else None
        if target is None:
            log = self.log
            if start == Start.EARLIEST:
                first = log.first_offset
            elif start == Start.OFFSET:
                if start_offset > log.next_offset:
                    return Refusal(ErrorCode.INVALID_REQUEST,
                                   f"offset {start_offset} is past the end of the log "
                                   f"(the next message gets offset {log.next_offset})")
                first = max(start_offset, log.first_offset)
            elif start == Start.TIME:  # start_offset is a wall-clock time in ms
                first = max(log.offset_at(start_offset), log.first_offset)
            else:
                first = log.next_offset
            if group:
                end = log.next_offset
                gid = log.append(Kind.GROUP, durable.group_body(
                    durable.CREATE, first, topic_filter, group), timestamp_ms)
                target = self._add_durable(gid, topic_filter, group, first)
                self._recent.note(gid, gid)
                if first < end:  # a replay: what it starts behind is counted apart
                    self._counts.append(target.count(first, end - 1))
                else:  # from the end: nothing of its topics is in the log yet
                    target.quiet_from = first
            else:
                target = DurableGroup(0, topic_filter, "", first, persistent=False,
                                      acks=bool(qos))
                self._plain.append(target)
                self._index.add(target.levels, target)  # ``matching``: quiet until its topics
                self.generation += 1
                self._keep(target)
                if first == log.next_offset:  # from the end: nothing of its topics yet
                    target.quiet_from = first
        target.idle_since = None
        self._unpark(target)  # a consumer comes: what it holds counts as that one's
        return target

    def _add_durable(self, gid: int, topic_filter: str, group: str, start: int) -> DurableGroup:
        target = DurableGroup(gid, topic_filter, group, start)
        self.generation += 1
        old = self.durable.get((topic_filter, group))
        if old is not None:
            self._index.remove(old.levels, old)
            self.flying.pop(old, None)
            old.flying = None
            old.shed()
        self.durable[(topic_filter, group)] = target
        self._index.add(target.levels, target)
        self._ids[gid] = target
        self._keep(target)
        return target

    def _keep(self, target: DurableGroup) -> None:
        target.flying = self.flying
        target.budget = self.budget
        target.unacked = self.unacked
        target.key = self._next_key
        self._next_key += 1
        self._by_key[target.key] = target

    def _forget(self, target: DurableGroup) -> None:
        if target.persistent:
            self.generation += 1
            old = self.durable.pop((target.filter, target.group), None)
            if old is not None:
                self._index.remove(old.levels, old)
            self._ids.pop(target.id, None)
        elif target in self._plain:
            self._plain.remove(target)
            self._index.remove(target.levels, target)
            self.generation += 1
        self._by_key.pop(target.key, None)
        self.flying.pop(target, None)
        target.flying = None
        target.shed()  # its read-ahead and matches go now, whoever still refers to it
        self._unpark(target)
        target.let_go()  # what its consumers held unacked counts against them no more

    def delete(self, target: DurableGroup, timestamp_ms: int) -> int:
        """Delete a durable group (unsubscribe, expiry): a GROUP delete record says so.
        Returns its offset."""
        self._forget(target)
        at = self.log.append(Kind.GROUP, durable.group_body(
            durable.DELETE, 0, target.filter, target.group), timestamp_ms)
        self._recent.forget(target.id)
        self._deleted.note((target.filter, target.group), at)
        return at

    def relog(self, first: int, last: int, timestamp_ms: int) -> int:
        """The disk refused records ``first``..``last`` (see ``Broker.relog``): the DELETE
        records among them again, then a checkpoint of each group that had a record there
        (its CREATE, an ACK, ...), and of each group deleted there and made again since
        (its CREATE may still be waiting to be written, before the DELETE again). Returns
        the last offset appended (0: none)."""
        out = 0
        again = set(self._recent.between(first, last))
        for topic_filter, group in self._deleted.between(first, last):
            out = self.log.append(Kind.GROUP, durable.group_body(
                durable.DELETE, 0, topic_filter, group), timestamp_ms)
            self._deleted.note((topic_filter, group), out)
            now = self.durable.get((topic_filter, group))
            if now is not None:
                again.add(now.id)
        for gid in sorted(again):
            target = self._ids.get(gid)
            if target is None:  # deleted since: its DELETE is logged after
                self._recent.forget(gid)
                continue
            out = target.anchor = self.log.append(
                Kind.GROUP, durable.checkpoint_body(target), timestamp_ms)
            if target.idle_since is not None and not target.consumers:  # as ``checkpoint``
                out = self.log.append(Kind.GROUP, durable.group_body(
                    durable.IDLE, 0, target.filter, target.group), target.idle_since)
            self._recent.note(gid, out)
        return out

    def detach(self, consumer: Consumer, timestamp_ms: int, wake: set[int]) -> None:
        """A consumer leaves its cursor: its unacked deliveries go to the others (``wake``);
        a cursor of its own ends; a durable group left alone logs that it is idle."""
        target = consumer.queue
        assert isinstance(target, DurableGroup)
        if consumer in target.consumers:
            target.consumers.remove(consumer)
        if not target.persistent:
            self._forget(target)
        elif not target.consumers and self.durable.get((target.filter, target.group)) is target:
            target.shed()  # read again when a consumer comes back
            target.idle_since = timestamp_ms
            self._recent.note(target.id, self.log.append(Kind.GROUP, durable.group_body(
                durable.IDLE, 0, target.filter, target.group), timestamp_ms))
        if target.requeue(consumer.sub_id, consumer.holder):
            wake.update(c.conn for c in target.consumers)
            wake.add(consumer.conn)  # its other consumers may take what it held now
        if target.persistent and not target.consumers:
            self._park(target)

    def _park(self, target: DurableGroup) -> None:
        """A durable group is left without a consumer: what its consumers had not acked
        stays in memory for the next one, while all such groups together keep at most
        ``max_inflight_bytes``; beyond, it keeps their offsets only (``unload``), read back
        from the log when a consumer comes (a client leaving group after group with a
        window full would otherwise leave each one's in memory)."""
        self._unpark(target)
        size = sum(len(f.body) for f in target.inflight.values())
        most = self.limits.max_inflight_bytes
        if most and size and self.parked + size > most:
            target.unload()
            size = sum(len(f.body) for f in target.inflight.values())
        target.parked = size
        self.parked += size

    def _unpark(self, target: DurableGroup) -> None:
        self.parked -= target.parked
        target.parked = 0

    # ------------------------------------------------------------------------ delivery

    def has_work(self, consumer: Consumer, target: DurableGroup) -> bool:
        if target.in_flight_for(consumer.sub_id) >= consumer.credit:
            return False
        if self._bytes_room(consumer, target) <= 0:
            return False
        if target.ready or target.pending or target.ahead:
            return True
        if target.kept and consumer.holder in target.kept:
            return True
        if target.fetching or target.next > self.log.written_offset:
            return False
        if target.pass_quiet(self.log.written_offset + 1):
            # nothing of its topics beyond: no reading through other topics' records (with
            # many durable groups, most appends are other groups' messages). A subscription
            # that waits for the end (until_end) may have reached it now: let the delivery
            # pass look (it hands out the end mark, or nothing)
            return consumer.until is not None
        return True

    def matching(self, topic: bytes) -> tuple[DurableGroup, ...]:
        """The cursors (durable groups and plain ones) whose filter matches ``topic``."""
        if not self.durable and not self._plain:
            return ()
        try:
            levels = tuple(topic.decode("utf-8").split("/"))
        except UnicodeDecodeError:  # as ``DurableGroup.wants`` takes such a topic
            levels = ("",)
        return tuple(self._index.match(levels))

    def lag(self, target: DurableGroup) -> int:
        """Log records past the cursor's position (whether they match its filter or not)."""
        self.catch_up((target,))
        return self.log.written_offset + 1 - target.next

    def _bytes_room(self, consumer: Consumer, target: DurableGroup) -> int:
        """Bytes of message records ``consumer`` may still take unacked: what it holds
        stays in memory until its ack, so its connection's consumers together hold at most
        ``max_inflight_bytes``, and all connections ``max_inflight_bytes_total``, besides
        each consumer's credit (``broker.unacked``; no limit without acks). A bridge's link
        is bounded by its own window, not by what the clients hold."""
        if not target.acks:
            return 1 << 62
        return self.unacked.room(consumer.conn, target.group.startswith(BRIDGE_GROUPS))

    def take(
        self, consumer: Consumer, target: DurableGroup, limit: int, max_bytes: int,
        now_ms: int, wall_ms: int,
    ) -> list[bytes]:
        """Up to ``limit`` delivery records and ``max_bytes`` of them (a first larger one
        alone): redeliveries first, then new records from the cursor's position."""
        log = self.log
        room = min(limit, consumer.credit - target.in_flight_for(consumer.sub_id))
        if room <= 0:
            return []
        bytes_room = self._bytes_room(consumer, target)
        if bytes_room <= 0:
            return []
        max_bytes = min(max_bytes, bytes_room)  # the first goes whatever its size
        self.budget.touch(target)  # a consumer with room: what is read for it is taken
        if target.pending:  # unacked before a restart or while it had no consumer
            target.load_pending(self._pending_records(target))
        backoff = _never if consumer.patient else self._backoff
        out, size = target.take_ready(consumer.sub_id, room, max_bytes, now_ms, backoff,
                                      consumer.holder, consumer.conn)
        self.counters.redelivered += len(out)
        for _ in range(_ROUNDS):
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
                consumer.sub_id, room - len(out), max_bytes, size, now_ms, wall_ms, backoff,
                consumer.conn)
            self.counters.dropped_ttl += expired
            out += new
            if full:
                break
        ahead = target.ahead
        if ahead and not target.fetching and len(ahead) <= _READ_ON_BELOW:
            # the read-ahead runs low: read on from disk now, while the consumer still has
            # records, so that it does not wait for the disk when they are gone
            after = ahead[-1][1] + 1
            if after <= log.written_offset and not log.cached(after):
                target.fetching = True
                self._fetches.append(Fetch(target.key, after))
        self.counters.delivered += len(out)
        if (target.quiet_from is None and not target.ahead
                and target.next == log.next_offset == log.written_offset + 1):
            target.quiet_from = target.next  # read to the end; ``usage`` says when that ends
        return out

    def _pending_records(self, target: DurableGroup) -> list[StoredRecord]:
        """The MESSAGE records at ``target.pending``'s offsets, read in runs: one read
        covers the offsets up to _PENDING_RUN records apart (not one read per offset)."""
        want = sorted(target.pending)
        out = []
        i = 0
        while i < len(want):
            first = want[i]
            records = self.log.read(first, min(_PENDING_RUN, want[-1] - first + 1))
            if not records:
                break
            found = {r.offset: r for r in records}
            last = records[-1].offset
            while i < len(want) and want[i] <= last:
                record = found.get(want[i])
                if record is not None and record.kind == Kind.MESSAGE:
                    out.append(record)
                i += 1
        return out

    def take_counts(self) -> list[Count]:
        counts, self._counts = self._counts, []
        return counts

    def counted(self, key: int, n: int, epoch: int = 0) -> None:
        target = self._by_key.get(key)
        if target is not None and target.epoch == epoch:
            target.backlog += n
            self._quiet_if_read(target)

    @staticmethod
    def _quiet_if_read(target: DurableGroup) -> None:
        """A group none of whose topics' messages lies unread past its position (a count
        of none, with every append since counted in too: ``usage``) is quiet from there,
        as one that read to the end is (``take``); a restart forgets that, and such a group
        would hold retention's floor and have other topics' records counted as its loss."""
        if (target.quiet_from is None and target.backlog == 0 and not target.pending
                and not target.ready and not target.ahead and not target.fetching):
            target.quiet_from = target.next

    def take_fetches(self) -> list[Fetch]:
        fetches, self._fetches = self._fetches, []
        return fetches

    def fill(self, key: int, records: Sequence[StoredRecord]) -> frozenset[int]:
        target = self._by_key.get(key)
        if target is None:  # the cursor is gone meanwhile
            return frozenset()
        target.fetching = False
        target.fill(records)
        if not target.ahead:  # nothing there: the segment went (retention), read on after it
            target.move_to(self.log.first_offset)
        if not target.consumers:  # the last one left during the read: not kept for nobody
            target.shed()
        return frozenset(c.conn for c in target.consumers)

    def _backoff(self, count: int) -> int:
        base = self.limits.retry_backoff_ms
        return min(base << min(count - 1, 20), self.limits.retry_backoff_max_ms)

    # ---------------------------------------------------------------- acks and retries

    def ack(self, consumer: Consumer, target: DurableGroup, offsets: tuple[int, ...],
            timestamp_ms: int) -> bool:
        done = target.ack(consumer.sub_id, offsets)
        if done:
            self.counters.acked += len(done)
            if target.persistent:
                at = self.log.append(Kind.ACK, durable.ack_body(target.id, target.floor, done),
                                     timestamp_ms)
                if len(self._unwritten) >= _UNWRITTEN_KEPT:  # the disk fails for long
                    self._unwritten.popleft()
                self._unwritten.append((at, len(done), max(1, consumer.credit // 2)))
                self._recent.note(target.id, at)
        return bool(done)

    def acks_due(self) -> bool:
        """Whether acks not yet written should be written without waiting for more: once
        they ack half the window of a consumer among theirs. A crash loses what is not
        written, and each of those deliveries comes again: this keeps the duplicates of a
        crash within about one window (a bridge's ``inflight``), as the delivery window
        bounds them anyway, while a consumer acking fast does not cost a write per ack."""
        unwritten = self._unwritten
        written = self.log.written_offset
        while unwritten and unwritten[0][0] <= written:
            unwritten.popleft()
        if not unwritten:
            return False
        return sum(n for _, n, _ in unwritten) >= min(half for _, _, half in unwritten)

    def nack(
        self, consumer: Consumer, target: DurableGroup, offsets: tuple[int, ...], delay_ms: int,
        now_ms: int, timestamp_ms: int, dead: list[RawMessage], why: str = "",
        give_up: bool = False, spend: bool = True,
    ) -> frozenset[int]:
        mine = target.held_by(consumer.sub_id, offsets)
        self.counters.nacked += len(mine)
        reason = why or (f"nacked with a delay of {delay_ms} ms" if delay_ms else "nacked")
        back = (self._spend(target, mine, lambda _: reason, timestamp_ms, dead, give_up)
                if spend or give_up else mine)
        target.back(back, now_ms, delay_ms)
        return frozenset(c.conn for c in target.consumers) if mine else frozenset()

    def redeliver(self, now_ms: int, timestamp_ms: int, dead: list[RawMessage]
                  ) -> frozenset[int]:
        woken: set[int] = set()
        flying = self.flying
        # only cursors with deliveries held by a consumer, or delayed, can have any due
        for target in tuple(flying):
            if not target.inflight:
                del flying[target]  # until it hands one out again (``take_new``)
                continue
            late, due, waiting = target.expire(now_ms)
            if late:
                target.back(self._spend(target, late, _late, timestamp_ms, dead))
            elif not waiting:
                # what is in flight waits in ``ready`` (its consumer left) or for a holder:
                # nothing comes due until it is handed out or delayed again (``_flies``)
                del flying[target]
            if late or due:
                woken.update(c.conn for c in target.consumers)
        woken.update(self.unacked.woken())  # acks elsewhere made room for them
        return frozenset(woken)

    def _spend(
        self, target: DurableGroup, offsets: list[int], reason: Callable[[int], str],
        timestamp_ms: int, dead: list[RawMessage], give_up: bool = False,
    ) -> list[int]:
        """Those of ``offsets`` delivered ``max_retries`` times (all of them: ``give_up``)
        become dead letters (added to ``dead``; a durable group logs them as done, so a
        restart does not deliver them again); returns the others, in order, to be given
        back. A dead letter that runs out in its turn is dropped the same way, but not
        dead-lettered again: ``$dlq/$dlq/...`` would go round for as long as its readers
        fail (it stays in the log, for other groups and replays)."""
        back = []
        for offset in offsets:
            count = target.inflight[offset].count
            if count < self.limits.max_retries and not give_up:
                back.append(offset)
                continue
            flight = target.drop(offset)
            if is_dead_letter(flight.body):
                self.counters.dead_letters_dropped += 1
                self.last_dropped = (message_from_record(flight.body).topic, target.filter,
                                     target.group)
            else:
                dead.append(dead_letter(flight.body, DeadLetter(flight.count, reason(count))))
                self.counters.dead_lettered += 1
            if target.persistent:
                self._buried.append((target, offset))
        return back

    def bury(self, timestamp_ms: int) -> None:
        """The dead letters made by ``nack`` or ``redeliver`` are in the log now: log their
        originals (and the dead letters dropped) as done for their durable groups (in this
        order, so a crash in between leaves a message delivered twice, never one lost)."""
        for target, offset in self._buried:
            self._recent.note(target.id, self.log.append(
                Kind.ACK, durable.ack_body(target.id, target.floor, [offset]), timestamp_ms))
        self._buried.clear()

    # ---------------------------------------------------------------------- maintenance

    def expire(self, wall_ms: int) -> list[DurableGroup]:
        """Durable groups without a consumer for ``group_expiry_ms``: deleted."""
        expiry = self.limits.group_expiry_ms
        if not expiry:
            return []
        gone = [t for t in self.durable.values()
                if not t.consumers and t.idle_since is not None
                and wall_ms - t.idle_since >= expiry]
        for target in gone:
            self.delete(target, wall_ms)
        self.counters.groups_expired += len(gone)
        return gone

    def checkpoint(self, timestamp_ms: int, below: int) -> int:
        """Restate every durable group whose anchor (create or checkpoint record) is below
        offset ``below`` in a new checkpoint record, so that retention may delete the old
        segments. Returns the offset of the last record appended (0: none)."""
        log = self.log
        last = 0
        self.catch_up(self.durable.values())
        for target in self.durable.values():
            if target.anchor >= below:
                continue
            last = target.anchor = log.append(Kind.GROUP, durable.checkpoint_body(target),
                                              timestamp_ms)
            if target.idle_since is not None and not target.consumers:
                last = log.append(Kind.GROUP, durable.group_body(
                    durable.IDLE, 0, target.filter, target.group), target.idle_since)
            self._recent.note(target.id, last)
        return last

    def skip_to(self, first: int) -> list[tuple[DurableGroup, int]]:
        """Retention removed the log below ``first``: durable groups whose cursor was lower
        skip what they had not read (counted in ``group.skipped``). Deliveries already in
        flight are kept (they are in memory); unacked ones not yet reloaded are lost."""
        out = []
        self.catch_up(self.durable.values())
        for target in self.durable.values():
            skipped = max(0, first - target.next) + sum(1 for o in target.pending if o < first)
            if not skipped:
                continue
            target.move_to(first)
            target.pending = {o for o in target.pending if o >= first}
            target.skipped += skipped
            # its backlog counted the skipped records, which are gone: count it again from
            # where it reads on (``first``, or its cursor when only unacked deliveries below
            # ``first`` were lost: what lies before the cursor it has read), and appends
            # after this add to it as usual, reads from there take off
            target.epoch += 1
            target.backlog = 0
            end = self.log.next_offset - 1
            start = target.next  # at least ``first`` (move_to)
            if start <= end:
                self._counts.append(target.count(start, end))
            out.append((target, skipped))
        return out

    def floor(self) -> int | None:
        """The lowest offset a durable group still needs (for log retention)."""
        self.catch_up(self.durable.values())
        return min((g.floor for g in self.durable.values()), default=None)

    def catch_up(self, targets: Iterable[DurableGroup]) -> None:
        """Quiet cursors (nothing of their topics logged since they read to the end) move to
        the end of what is written, as ``has_work`` moves one it is asked about: a consumer
        that dozes is not asked, and an idle group has none (for ``floor``, ``lag``,
        ``skip_to`` and checkpoints, which would take the old position for unread records)."""
        end = self.log.written_offset + 1
        for target in targets:
            target.pass_quiet(end)

    # ------------------------------------------------------------------------- recovery

    def recover(self, record: StoredRecord) -> None:
        """Rebuild durable groups from a GROUP or ACK record met while the log is opened.

        A group whose last record is IDLE has been without a consumer since then; any other
        group is taken as idle from the restart (``idle_since`` None until ``recovered``).
        """
        if record.kind == Kind.GROUP:
            g = durable.parse_group(record.body)
            target = self.durable.get((g.topic_filter, g.group))
            if g.op == durable.CREATE:
                self._add_durable(record.offset, g.topic_filter, g.group, g.start)
            elif g.op == durable.CHECKPOINT:
                if target is None:  # its CREATE record is gone: it began by its unacked
                    target = self._add_durable(g.group_id, g.topic_filter, g.group,
                                               min((g.start, *g.unacked)))
                target.restore(g)
                target.anchor = record.offset
                target.idle_since = None
            elif g.op == durable.IDLE:
                if target is not None:
                    target.idle_since = record.timestamp_ms
            elif target is not None:
                self._forget(target)
        elif record.kind == Kind.ACK:
            gid, floor, offsets = durable.parse_ack(record.body)
            target = self._ids.get(gid)
            if target is not None:
                target.recover_ack(floor, offsets)
                target.idle_since = None

    def recovered(self, wall_ms: int) -> list[tuple[DurableGroup, int]]:
        """The log is open: groups not known to be idle count as idle from now; every
        group's backlog is to be counted (from its position to the end of the log).

        Returns the durable groups that lost unacked deliveries, and how many: those a
        checkpoint names below the log's first offset. They were in flight (in memory)
        when the size cap removed their segment, and went with the restart; counted in
        ``group.skipped`` like the size cap's other losses, and restated in a checkpoint
        so that the next restart does not count them again."""
        first = self.log.first_offset
        lost = []
        for target in self.durable.values():
            gone = sum(1 for o in target.pending if o < first)
            if not gone:
                continue
            target.pending = {o for o in target.pending if o >= first}
            target.skipped += gone
            last = target.anchor = self.log.append(
                Kind.GROUP, durable.checkpoint_body(target), wall_ms)
            if target.idle_since is not None:  # the log said so: still so after this record
                last = self.log.append(Kind.GROUP, durable.group_body(
                    durable.IDLE, 0, target.filter, target.group), target.idle_since)
            self._recent.note(target.id, last)
            lost.append((target, gone))
        end = self.log.written_offset
        for target in self.durable.values():
            if target.next <= end:
                self._counts.append(target.count(target.next, end))
            else:  # nothing past it: quiet
                self._quiet_if_read(target)
            if target.idle_since is None and not target.consumers:
                target.idle_since = wall_ms
        return lost
