"""A bridge link whose upstream is another BlipMQ broker, over the native protocol.

The link is a ``ClientConnection`` (the same sans-IO client core as ``blipmq_cli``): the
forwarded messages go out as PUBLISH batches, and each batch's PUB_ACK confirms them, in
order, once the upstream's log holds them. A message the upstream refuses (an ERROR frame:
too large, forbidden, a bad topic) goes back to the bridge's group to be tried again after
``backoff_min_ms``, alone in its batch; refused ``max_retries`` times, it goes to the local
dead letters with the upstream's reason, and the rest flow on.

The ``in`` rules subscribe on the upstream to a durable QoS 1 group each, named by the
bridge's client id, so what is published there while the link is down waits in the
upstream's log. A DELIVER batch is written to the local log (marked as bridged in, so no
out rule sends it back) in one core call, and ACKed to the upstream once the local log
holds it under ``wal.fsync``; a link lost before that leaves the batch with the upstream's
group, which sends it again: at least once.
"""

from __future__ import annotations

import trio

from blipmq_server.bridge.spec import Rule
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import FLAG_KEY, FLAG_QOS1, FLAG_RETAIN, MSG_HEAD
from blipmq_server.protocol.connection import ClientConnection
from blipmq_server.protocol.message import (
    FLAG_BRIDGED,
    Delivery,
    Message,
    RawMessage,
    message_record,
)
from blipmq_server.server.bridge import Bridge, LinkDown, _Link, _why, log
from blipmq_server.server.session import now_ms, wall_ms

_KEEP_RETAIN = FLAG_KEY | FLAG_RETAIN


class NativeLink(_Link):
    def __init__(self, bridge: Bridge, stream: trio.abc.Stream) -> None:
        super().__init__(bridge, stream)
        self.conn = ClientConnection()
        self._add = self.conn.publish_record  # ``_encode``'s fast path: a known head
        self._ping_rid = 0
        self.in_subs: dict[int, Rule] = {}  # the upstream's subscription id -> its in rule
        # the flusher's confirm key -> the upstream subscription and offsets to ACK then
        self._in_acks: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._in_key = 0
        self._refusal = ""  # why an in rule's subscription was refused (the status says)

    async def handshake(self) -> None:
        conn = self.conn
        spec = self.bridge.spec
        conn.hello(spec.mqtt_client_id, spec.password)
        await self.stream.send_all(conn.data_to_send())
        while True:
            conn.receive_data(await self._receive(), trio.current_time())
            outcome = conn.handshake()
            if isinstance(outcome, codec.Error):
                raise LinkDown(f"the upstream refused the connection: {outcome.text}")
            if outcome is not None:
                break
            if conn.closed is not None:
                raise LinkDown(str(conn.failure(self.bridge.address, 0)))
        # up once a PING is answered too, as an MQTT link's PINGREQ after its CONNACK: an
        # upstream that closes every link right after WELCOME fails to connect
        rid = conn.ping()
        try:
            await self.stream.send_all(conn.data_to_send())
            while conn.reply(rid) is None:
                conn.receive_data(await self._receive(), trio.current_time())
                if conn.closed is not None:
                    raise LinkDown(str(conn.failure(self.bridge.address, 0)))
        except (LinkDown, OSError, trio.BrokenResourceError) as exc:
            raise LinkDown(f"no answer after the WELCOME: {_why(exc)}") from None
        await self._subscribe_in()

    async def _subscribe_in(self) -> None:
        """Join the in rules' groups on the upstream (made at its log's end the first time,
        resumed from their cursor after that). A refused one is logged and named in the
        status; the rest of the bridge goes on."""
        bridge = self.bridge
        spec = bridge.spec
        conn = self.conn
        asked = {conn.subscribe(rule.remote_filter, group=spec.mqtt_client_id, qos=1,
                                credit=spec.inflight): rule
                 for rule in spec.rules if rule.receives}
        if not asked:
            return
        await self.stream.send_all(conn.data_to_send())
        while asked:
            for rid in list(asked):
                reply = conn.reply(rid)
                if reply is None:
                    continue
                rule = asked.pop(rid)
                if isinstance(reply, codec.Subscribed):
                    self.in_subs[reply.sub_id] = rule
                else:
                    text = getattr(reply, "text", type(reply).__name__)
                    log.warning("bridge %s: the upstream refused the subscription %r: %s",
                                spec.name, rule.remote_filter, text)
                    self._refusal = f"subscription refused: {rule.remote_filter}: {text}"
            if asked:
                conn.receive_data(await self._receive(), trio.current_time())
                if conn.closed is not None:
                    raise LinkDown(str(conn.failure(bridge.address, 0)))

    async def _reader(self) -> None:
        conn = self.conn
        if self._refusal:  # once the link is up (which clears the last error)
            self.bridge.last_error = self._refusal
        if self.in_subs:  # deliveries that came with the SUBSCRIBED replies
            self._take_in()
        while True:
            data = await self._receive()
            conn.receive_data(data, self.heard_at)  # RemoteProtocolError ends the link
            self._settle()
            if self.in_subs:
                self._take_in()
            if conn.closed is not None:
                self.peer_closed = True
                raise LinkDown(str(conn.failure(self.bridge.address, 0)))
            if conn.outgoing:  # a PONG for the upstream's PING
                self.bridge._kick.set()

    def _settle(self) -> None:
        """Confirmed messages leave the group; refused ones go back (or to the dead
        letters), in the order they were sent."""
        bridge = self.bridge
        conn = self.conn
        inflight = self.inflight
        acks: dict[int, list[int]] = {}
        refused: list[tuple[int, int]] = []
        settled: list[int] = []
        # one pass, then the deletions: ``next(iter(inflight))`` once per message rescanned
        # the slots of every ticket deleted before it (4 us a message with 5,000 in flight)
        for ticket, (sub_id, offset, _) in inflight.items():
            outcome = conn.outcome(ticket)
            if outcome is None:
                break
            settled.append(ticket)
            if outcome:
                acks.setdefault(sub_id, []).append(offset)
            else:
                refused.append((sub_id, offset))
        for ticket in settled:
            del inflight[ticket]
        if acks:
            self._acked(acks)
        reason = ""
        while (error := conn.refusal()) is not None:
            reason = reason or f"{error.text} (error {error.code})"
        if refused:
            self._refused(refused, reason or "refused by the upstream")
            bridge._kick.set()

    def _take_in(self) -> None:
        """Store what the upstream delivered to the in rules' groups."""
        conn = self.conn
        for sub_id, rule in self.in_subs.items():
            if not conn.subscribed(sub_id):  # its group was deleted on the upstream
                raise LinkDown(f"the upstream ended the subscription {rule.remote_filter!r} "
                               "(its group was deleted): subscribing again")
            while (batch := conn.next_batch(sub_id)) is not None:
                if batch:
                    self._store(sub_id, rule, batch)

    def _store(self, sub_id: int, rule: Rule, batch: tuple[Delivery, ...]) -> None:
        """One DELIVER batch into the local log in one core call; its ACK goes to the
        upstream once the log holds the last of it (a message the local broker refuses,
        too large or a topic too long, is logged, counted and ACKed too: it could never
        be stored; a retained one the retained store has no room for is stored without
        retain, ``Bridge.not_kept``)."""
        bridge = self.bridge
        server = bridge.server
        raws = []
        for d in batch:
            topic = rule.to_local(d.topic)
            if bridge.local_problem(topic, d.topic) is None:
                raws.append(_inbound(topic, d))
        last = 0
        at = 0
        while at < len(raws):
            result = bridge.broker.publish(raws[at:], now_ms(), wall_ms(), internal=True,
                                           unkept=True)
            server.wake(result.wake)
            if result.unkept:
                bridge.not_kept(result.unkept_topic, result.unkept_text)
            last = result.last_offset or last
            at += result.accepted
            if result.refusal is None:
                break
            bridge.not_stored(raws[at].topic.decode("utf-8", "replace"), result.refusal.text,
                              result.refusal.code.name)
            at += 1
        server.log_touched()
        bridge.counters["received"] += len(raws)  # as over MQTT: those that were offered
        offsets = tuple(d.offset for d in batch)
        if not last or server.flusher is None:
            self.conn.ack(sub_id, offsets)
            bridge._kick.set()
            return
        self._in_key = key = self._in_key % _IN_KEYS + 1
        self._in_acks[key] = (sub_id, offsets)
        server.flusher.confirm_later(last, self, key, len(offsets))  # type: ignore[arg-type]

    def confirmed(self, request_id: int, count: int) -> None:
        """The local log holds a stored batch: ACK it upstream (not on a link that ended:
        the upstream's group already took it back, to send again)."""
        if self.bridge._unstored_said is not None:
            self.bridge.stored()
        found = self._in_acks.pop(request_id, None)
        if found is not None and self.open:
            self.conn.ack(*found)
            self.bridge._kick.set()

    def _refused(self, refused: list[tuple[int, int]], reason: str) -> None:
        """The first refused message of a batch is the one the upstream named; the rest of
        its batch were refused with it and go straight back."""
        bridge = self.bridge
        broker, conn_id = bridge.broker, bridge.conn_id
        (sub_id, offset), rest = refused[0], refused[1:]
        strikes = bridge._strikes[offset] = bridge._strikes.get(offset, 0) + 1
        bridge.counters["refused"] += 1
        wake: set[int] = set()
        if strikes >= bridge.spec.max_retries:
            del bridge._strikes[offset]
            wake |= bridge.give_up(sub_id, offset, f"bridge {bridge.spec.name}: {reason}")
        else:
            wake |= broker.nack(conn_id, sub_id, (offset,), bridge.spec.backoff_min_ms,
                                now_ms(), wall_ms(), reason, spend=False)
        for sub, off in rest:  # the bridge's strikes decide, not the delivery counts
            wake |= broker.nack(conn_id, sub, (off,), 0, now_ms(), wall_ms(), reason,
                                spend=False)
        if bridge.server.redelivery_dozes:  # the delayed one comes due: a tick sends it
            bridge.server.flights_began()
        bridge.server.wake(wake)
        bridge.server.log_touched()

    def _put(self, rule: Rule, topic: bytes, rec: bytes, flags: int, ttl: int, at: int,
             klen: int, plen: int, count: int, offset: int, parts: list[bytes],
             pid: int = 0) -> int:
        conn = self.conn
        alone = offset in self.bridge._strikes  # refused before: alone in its batch
        if alone:
            conn.seal()
        head = self._head(topic, flags, ttl, klen, plen, rule.qos)  # and no trailer
        ticket = conn.publish_record(head + rec[at - klen:at + plen], plen)
        if alone:
            conn.seal()
        return ticket

    def _head(self, topic: bytes, flags: int, ttl: int, klen: int, plen: int,
              qos: int = 1) -> bytes:
        """A record's head and topic as the upstream takes it: the rule's QoS, the key,
        retain unless outgoing_retain is off, the upstream's topic; no broker-made flags."""
        keep = _KEEP_RETAIN if self.bridge.spec.outgoing_retain else FLAG_KEY
        return MSG_HEAD.pack((flags & keep) | (FLAG_QOS1 if qos else 0), ttl, len(topic), klen,
                             plen) + topic

    def _flush(self, parts: list[bytes]) -> None:
        data = self.conn.data_to_send()
        if data:
            parts.append(data)

    def _ping(self) -> bytes:
        if self._ping_rid:
            self.conn.forget(self._ping_rid)
        self._ping_rid = self.conn.ping()
        return b""

    def _goodbye(self) -> bytes:
        self.conn.goodbye()
        return self.conn.data_to_send()


_IN_KEYS = 1 << 30  # confirm keys of stored batches, taking turns


def _inbound(topic: str, d: Delivery) -> RawMessage:
    """A delivery from the upstream as the local log stores it: under ``topic`` (the
    local name), marked as bridged in, retained if it was published so."""
    record = message_record(Message(topic, d.payload, d.qos, d.ttl_ms, d.key, d.retain))
    record = bytes((record[0] | FLAG_BRIDGED,)) + record[1:]
    return RawMessage(topic.encode(), d.qos, d.ttl_ms, len(d.payload), record,
                      FLAG_RETAIN if d.retain else 0)
