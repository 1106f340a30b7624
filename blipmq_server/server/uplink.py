"""A bridge link whose upstream is another BlipMQ broker, over the native protocol.

The link is a ``ClientConnection`` (the same sans-IO client core as ``blipmq_cli``): the
forwarded messages go out as PUBLISH batches, and each batch's PUB_ACK confirms them, in
order, once the upstream's log holds them. A message the upstream refuses (an ERROR frame:
too large, forbidden, a bad topic) goes back to the bridge's group to be tried again after
``backoff_min_ms``, alone in its batch; refused ``max_retries`` times, it goes to the local
dead letters with the upstream's reason, and the rest flow on.
"""

from __future__ import annotations

import trio

from blipmq_server.bridge.spec import Rule
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import FLAG_KEY, FLAG_QOS1, FLAG_RETAIN, MSG_HEAD
from blipmq_server.protocol.connection import ClientConnection
from blipmq_server.server.bridge import Bridge, LinkDown, _Link
from blipmq_server.server.session import now_ms, wall_ms

_KEEP_RETAIN = FLAG_KEY | FLAG_RETAIN


class NativeLink(_Link):
    def __init__(self, bridge: Bridge, stream: trio.abc.Stream) -> None:
        super().__init__(bridge, stream)
        self.conn = ClientConnection()
        self._ping_rid = 0

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
                return
            if conn.closed is not None:
                raise LinkDown(str(conn.failure(self.bridge.address, 0)))

    async def _reader(self) -> None:
        conn = self.conn
        while True:
            data = await self._receive()
            conn.receive_data(data, self.heard_at)  # RemoteProtocolError ends the link
            self._settle()
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
        while inflight:
            ticket = next(iter(inflight))
            outcome = conn.outcome(ticket)
            if outcome is None:
                break
            sub_id, offset, _ = inflight.pop(ticket)
            if outcome:
                acks.setdefault(sub_id, []).append(offset)
            else:
                refused.append((sub_id, offset))
        if acks:
            self._acked(acks)
        reason = ""
        while (error := conn.refusal()) is not None:
            reason = reason or f"{error.text} (error {error.code})"
        if refused:
            self._refused(refused, reason or "refused by the upstream")
            bridge._kick.set()

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
            wake |= broker.nack(conn_id, sub_id, (offset,), 0, now_ms(), wall_ms(),
                                f"bridge {bridge.spec.name}: {reason}", give_up=True)
            bridge.counters["dead_lettered"] += 1
        else:
            wake |= broker.nack(conn_id, sub_id, (offset,), bridge.spec.backoff_min_ms,
                                now_ms(), wall_ms(), reason, spend=False)
        for sub, off in rest:  # the bridge's strikes decide, not the delivery counts
            wake |= broker.nack(conn_id, sub, (off,), 0, now_ms(), wall_ms(), reason,
                                spend=False)
        bridge.server.wake(wake)
        bridge.server.log_touched()

    def _put(self, rule: Rule, topic: bytes, rec: bytes, flags: int, ttl: int, at: int,
             klen: int, plen: int, count: int, offset: int, parts: list[bytes],
             pid: int = 0) -> int:
        conn = self.conn
        alone = offset in self.bridge._strikes  # refused before: alone in its batch
        if alone:
            conn.seal()
        # the record as the upstream takes it: the rule's QoS, the key, retain unless
        # outgoing_retain is off, the upstream's topic; no broker-made flags or trailer
        keep = _KEEP_RETAIN if self.bridge.spec.outgoing_retain else FLAG_KEY
        head = MSG_HEAD.pack((flags & keep) | (FLAG_QOS1 if rule.qos else 0), ttl, len(topic),
                             klen, plen)
        ticket = conn.publish_record(head + topic + rec[at - klen:at + plen], plen)
        if alone:
            conn.seal()
        return ticket

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
