"""The MQTT front end: one MQTT 3.1.1 / 3.1 client connection on the shared session machinery.

``MqttSession`` is a ``Session`` whose reader decodes MQTT packets (``mqtt.codec``) instead of
native frames and whose deliveries leave as PUBLISH packets; the writer, the output budget,
slow-consumer cuts, ``deliver_now`` and the flusher's confirms are the base class's. It turns
packets into the same core calls a native session makes (publish, subscribe, ack, ...):

    MQTT                        core
    PUBLISH QoS 0 / 1 / 2       publish; QoS 1 and 2 logged, PUBACK / PUBREC once durable
    SUBSCRIBE QoS 0             a live queue (retained values first)
    SUBSCRIBE QoS 1 / 2         a log cursor with ``mqtt.max_inflight`` credit, patient (no
                                retry while connected); in a persistent session (clean
                                session 0) a durable group of the session's own
    PUBACK, PUBCOMP             ack of the delivery's log offset
    $share/<name>/<filter>      a consumer group (QoS 1/2: durable)

A bridge's CONNECT (level 0x84 or 0x83, as mosquitto's bridges send it) makes a bridge
session: what it publishes is marked as bridged in (``FLAG_BRIDGED``, as the broker's own
bridges mark what they bring in), and it is sent no message so marked, which may have come
from that very peer (mosquitto's no-local for bridges; docs/BRIDGE.md, "Loops").

Persistent sessions (their subscriptions, QoS 2 packet ids and owner) are kept by
``MqttSessions`` (``server/sessions.py``) in the log's STATE records (``mqtt.state``). The
connection's key decides what it may publish and subscribe to (``broker/access.py``).
Trio is imported here as in the rest of ``server/``; the MQTT codec and state know nothing
of it.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import zlib
from typing import TYPE_CHECKING

import trio

from blipmq_server.broker.core import BRIDGE_GROUPS, OWES, SETTLED
from blipmq_server.broker.queue import Overflow
from blipmq_server.broker.topics import FilterIndex, split
from blipmq_server.mqtt import codec as mqtt
from blipmq_server.mqtt.packets import (
    SUBACK_FAILURE,
    ConnAck,
    ConnackCode,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    Will,
    free_packet_id,
)
from blipmq_server.mqtt.state import group_name, share_of, stored_subs
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.protocol.message import (
    DELIVERED_RETAINED,
    DELIVERY_PREFIX,
    FLAG_BRIDGED,
    FLAG_QOS1,
    FLAG_QOS2,
    FLAG_RETAIN,
    HEAD_SIZE,
    MSG_HEAD,
    PREFIX_SIZE,
    RawMessage,
)
from blipmq_server.protocol.names import broker_topic, filter_problem
from blipmq_server.server.hush import EVERY_S, since
from blipmq_server.server.session import (
    _TURN_S,
    CloseReason,
    Session,
    _time,
    log_adopted,
    now_ms,
    wall_ms,
)

if TYPE_CHECKING:
    from blipmq_server.broker.results import PublishResult, Refusal
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.mqtt")

# a delivery record's prefix and its message record's head, in one unpack
_unpack_delivery = struct.Struct(DELIVERY_PREFIX.format + MSG_HEAD.format[1:]).unpack_from
_pack_head = MSG_HEAD.pack
_BODY = PREFIX_SIZE + HEAD_SIZE  # where a delivery record's topic starts
_encode_publish = mqtt.encode_publish
_publish_head = mqtt.publish_head
# PUBLISH heads by QoS, for the record head and topic they start (``encode_batches``): shared
# by every connection, as they depend on nothing else; at most _HEADS_KEPT of topics up to
# _HEAD_TOPIC_MAX bytes each, so about 2 MiB at most
_HEADS: tuple[dict[bytes, bytes], ...] = ({}, {}, {})
_HEADS_KEPT = 1024
_HEAD_TOPIC_MAX = 256
_PINGRESP = mqtt.encode(PingResp())


def connection_state(topic: str, client_id: str, limit: int) -> bool:
    """Whether ``topic`` is ``$SYS/broker/connection/<client_id>/state``, where a mosquitto
    bridge connected with ``client_id`` publishes the state of its link
    (``notifications``, on by default) and sets its will: a bridge session may publish
    there, and nowhere else in the broker's trees (not another bridge's state topic)."""
    levels = topic.split("/")
    return (len(levels) == 5 and levels[:3] == ["$SYS", "broker", "connection"]
            and levels[4] == "state" and levels[3] == client_id
            and client_id not in ("", "+", "#")
            and "\x00" not in topic and len(topic.encode("utf-8")) <= limit)


class MqttSession(Session):
    protocol = "mqtt"
    __slots__ = (
        "_batch_key", "_copies", "_cursors", "_filters", "_names", "_next_pid", "_no_ids",
        "_owners", "_qos2_at", "_said_no_ids", "_salts", "_shared", "_turn", "_unsent",
        "bridge", "clean", "client_id", "confirming", "connected", "granted", "inflight",
        "keepalive", "level", "mark", "qos2_in", "refusals", "released", "sent_before",
        "subs", "taken_over", "username", "will",
    )

    def __init__(self, server: Server, stream: trio.SocketStream, conn_id: int,
                 tls: trio.SSLStream[trio.SocketStream] | None = None,
                 tls_identity: str | None = None) -> None:
        super().__init__(server, stream, conn_id, tls, tls_identity)
        self.client_id = ""
        self.username: str | None = None
        self.clean = True
        self.keepalive = 0.0  # seconds of silence before 1.5 x of it closes us (0: none)
        self.will: Will | None = None
        self.level = 4
        # a bridge's session (CONNECT level 0x84 / 0x83): its messages are marked as bridged
        # in (``mark``), and it is never sent one so marked (``encode_batches``)
        self.bridge = False
        self.mark = 0
        self.subs: dict[str, tuple[int, int]] = {}  # filter -> (core sub id, granted QoS)
        self.granted: dict[int, int] = {}  # core sub id -> granted QoS
        self._next_pid = 0
        # outbound QoS 1/2 deliveries awaiting PUBACK / PUBREC, then PUBCOMP
        self.inflight: dict[int, tuple[int, int, int]] = {}  # pid -> (sub id, offset, qos)
        self.released: dict[int, tuple[int, int]] = {}  # pid -> (sub id, offset), PUBREL sent
        # every packet id was taken: the log cursors' credit is cut to the free ids (``_no_id``)
        self._no_ids = False
        self._said_no_ids = False
        self._unsent: dict[int, list[int]] = {}  # sub id -> offsets taken, no id to send them
        # log offsets below this one may have been sent to the client before the broker
        # restarted: their first delivery in this run carries DUP (``MqttSessions.attach``)
        self.sent_before = 0
        # packets that go out once the log holds what they confirm (PUBACK, PUBREC, PUBCOMP,
        # SUBACK, UNSUBACK by the client's packet id; PUBREL by ours + _OUTBOUND)
        self.confirming: dict[int, bytes] = {}
        # inbound QoS 2 packet ids awaiting PUBREL
        self.qos2_in: set[int] = set()
        self._qos2_at: dict[int, int] = {}  # of those, PUBREC not sent yet: message's offset
        self.taken_over = False
        self.connected = False
        # topic -> the subscription that delivers it (see ``_owner``); cleared on changes
        self._owners: dict[bytes, int] = {}
        # its plain (not $share) filters -> (sub id, QoS), for ``_owner``; None: build anew
        self._filters: FilterIndex[tuple[int, int]] | None = None
        # while subscriptions overlap: log offset -> the other subscriptions' copies of that
        # message, acked once the client has it from the one that sends it
        self._copies: dict[int, list[int]] = {}
        self.refusals: list[tuple[str, str]] = []  # filters refused since the last log line
        self._shared: set[int] = set()  # sub ids of $share/ subscriptions
        self._cursors: set[int] = set()  # sub ids that read the log (not a live queue)
        self._names: dict[str, bytes] = {}  # topics published to and found fine, as UTF-8
        self._salts: dict[int, int] = {}  # sub id -> where its packet ids start (``_pid_for``)
        self._batch_key = 0  # the last ``confirming`` key of a batch's PUBACKs
        self._turn = 0.0  # when the reader lets the other tasks in (``_let_others_in``)

    # ------------------------------------------------------------- the base class's hooks

    def confirmed(self, request_id: int, count: int) -> None:
        data = self.confirming.pop(request_id, None)
        if self._qos2_at:
            self._qos2_at.pop(request_id, None)
        if data is not None:
            self.send_bytes(data)

    def _once_durable(self, offset: int, key: int, packet: object, count: int = 0) -> None:
        """Send ``packet`` (or bytes) once the log holds ``offset`` (durably, under
        ``always``); at once when nothing was written (0) or there is no log."""
        data = packet if packet.__class__ is bytes else mqtt.encode(packet)  # type: ignore[arg-type]
        flusher = self.server.flusher
        if not offset or flusher is None:
            self.send_bytes(data)
            return
        self.confirming[key] = data
        flusher.confirm_later(offset, self, key, count)

    def _appended(self) -> int:
        """The newest offset in the log (0: no log): an acknowledgement sent once it is
        durable goes after every one this connection waits for."""
        wal = self.server.wal
        return 0 if wal is None else wal.next_offset - 1

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        # MQTT 3.1.1 has no negative acknowledgement: the client resends after reconnecting
        self.confirming.pop(request_id, None)
        at = self._qos2_at.pop(request_id, None)
        wal = self.server.wal
        if at is not None and wal is not None and wal.lost_between(at, at):
            # its PUBLISH is not in the log: the copy the client sends again must be logged,
            # not taken for a duplicate of this one
            self.server.mqtt_sessions.qos2_forget(self, request_id)
        self.broker.counters.refused += count
        log.warning("MQTT client %r: closing, %s", self.client_id, text)
        self.server.mqtt_error("storage")
        self.stop_reading(CloseReason.PROTOCOL_ERROR)

    def reply_failed(self, request_id: int, what: str, text: str) -> None:
        # the CONNACK of a clean session whose end the log could not store: 3.1.1 has no
        # code for it, so the connection closes without CONNACK (and without its will:
        # it never was connected). The client connects again, and that CONNACK waits for
        # the records written again (``MqttSessions.ended_at``)
        self.will = None
        log.warning("MQTT client %r: closing without CONNACK, the log could not store the "
                    "end of its persistent session: %s", self.client_id, text)
        self.server.mqtt_error("storage")
        self.stop_reading(CloseReason.PROTOCOL_ERROR)

    def revoke(self) -> None:
        # its key is gone: nothing more goes out on that key's authority, the will neither
        self.will = None
        self.cut_off(CloseReason.REVOKED)  # 3.1.1 has no word for it: the close says it

    def closed(self) -> None:
        self.server.mqtt_sessions.closed(self)

    def farewell(self) -> bool:
        return False  # MQTT 3.1.1 has nothing to say on the way out

    def idle_check(self, now: float, idle: float) -> float:
        """Packet ids of deliveries the core gave up on come free (looked at every tick
        while any is in flight: ``encode_batches`` calls for the next tick's look); a
        client silent for 1.5 x its keepalive is closed. Returns when the next look is due
        at the earliest."""
        soon = math.inf
        if self.inflight or self.released:
            self._forget_given_up()
            self._id_freed()
            soon = now
        if not self.keepalive:
            return soon
        if now - self.heard_at >= 1.5 * self.keepalive:
            log.info("MQTT client %r silent for 1.5 x its keepalive (%g s): closing",
                     self.client_id, self.keepalive)
            self.stop_reading(CloseReason.KEEPALIVE_TIMEOUT)
            return math.inf
        return min(soon, self.heard_at + 1.5 * self.keepalive)

    def encode_batches(self, batches: list[tuple[int, list[bytes]]], parts: list[bytes]
                       ) -> None:
        granted = self.granted
        inflight = self.inflight
        acks: dict[int, list[int]] = {}
        owners = self._owners if len(self.subs) > 1 else None
        skip = self.mark  # a bridge session: FLAG_BRIDGED
        for sub_id, records in batches:
            sub_qos = granted.get(sub_id, 0)
            cursor = sub_id in self._cursors  # its deliveries are acked, or stay in flight
            for rec in records:
                offset, count, _, dflags, flags, _, tlen, klen, plen = _unpack_delivery(rec)
                if flags & skip and sub_id not in self._shared:
                    # it came in over a bridge, maybe from this peer: not to a bridge (live,
                    # from the log or retained), settled as sent so that its cursor moves on.
                    # A $share member's message is not: settled, it would be the whole
                    # group's, which would never get it (its other members neither)
                    if cursor and offset:
                        acks.setdefault(sub_id, []).append(offset)
                    continue
                if (owners is not None and not dflags & DELIVERED_RETAINED
                        and sub_id not in self._shared):
                    # overlapping subscriptions: one copy, from the one with the highest QoS
                    # (a message kept out of the log, offset 0, only reaches live queues)
                    topic = rec[_BODY:_BODY + tlen]
                    key = topic if offset else b"\0" + topic
                    owner = owners.get(key) or self._owner(topic, key)
                    if owner != sub_id and self._copy_waits(sub_id, owner, offset, cursor,
                                                            acks):
                        continue
                at = _BODY + tlen + klen
                qos = 2 if flags & FLAG_QOS2 else flags & FLAG_QOS1
                if sub_qos < qos:
                    qos = sub_qos
                pid = 0
                if qos:
                    pid = self._pid_for(sub_id, offset, count)
                    if not pid:  # every id taken: it waits in its cursor (``_no_id``)
                        continue
                    if self.released.get(pid) == (sub_id, offset):
                        # its PUBREC came: from here on only PUBREL is sent (MQTT-4.3.3)
                        parts.append(_PUBREL + pid.to_bytes(2, "big"))
                        continue
                    inflight[pid] = (sub_id, offset, qos)
                else:
                    if cursor and offset:  # a cursor's delivery sent at QoS 0: done at once
                        acks.setdefault(sub_id, []).append(offset)
                    if owners is not None and offset:
                        self._client_has(offset, acks)  # at QoS 0: it has it now
                # DUP: sent before on this connection or an earlier one, or maybe before the
                # broker restarted (a message the restored session's cursor held then; not a
                # retained value sent for a new subscription)
                retained = bool(dflags & DELIVERED_RETAINED)
                dup = qos > 0 and (count > 1 or (offset < self.sent_before and not retained))
                if retained or dup or tlen > _HEAD_TOPIC_MAX:
                    parts.append(_encode_publish(rec[_BODY:_BODY + tlen], rec[at:at + plen],
                                                 qos, retained, dup, pid))
                    continue
                # the usual: no DUP, no retain. Its head is that of every such delivery at
                # this QoS of a record with this head and topic (``_HEADS``)
                key = rec[PREFIX_SIZE:_BODY + tlen]
                heads = _HEADS[qos]
                head = heads.get(key)
                if head is None:
                    if len(heads) >= _HEADS_KEPT:
                        heads.clear()
                    head = heads[key] = _publish_head(rec[_BODY:_BODY + tlen], plen, qos,
                                                      False)
                parts.append(head + pid.to_bytes(2, "big") + rec[at:at + plen] if qos
                             else head + rec[at:at + plen])
        if inflight:
            self.look_at = 0.0  # the watchdog looks at what is in flight
        if acks:
            wall = int(_time() * 1000)
            for sub_id, offsets in acks.items():
                self.broker.ack(self.conn_id, sub_id, tuple(offsets), wall)
        if self._unsent:
            self._give_back()

    def _copy_waits(self, sub_id: int, owner: int, offset: int, cursor: bool,
                    acks: dict[int, list[int]]) -> bool:
        """A copy of a message another of this client's subscriptions (``owner``) sends:
        whether this one keeps it back (False: it sends it itself). A log cursor's copy is
        acked once the client has the message (``_client_has``), not before: were the
        owner to change first (a subscription replaced, ended, restored in another order
        after a restart), this cursor would have passed what the new owner never sent. The
        owner's cursor says where the copy stands (``Broker.copy_of``): kept back while the
        owner owes the message, acked once it settled it, and sent by this subscription
        when the owner never had it (it subscribed after the message)."""
        if not (cursor and offset):
            return True
        if owner not in self._cursors:
            # a live queue sends it (it would own a logged message only at a higher QoS
            # than this cursor's, and live queues are QoS 0: ``_owner``): done as it goes
            acks.setdefault(sub_id, []).append(offset)
            return True
        state = self.broker.copy_of(self.conn_id, owner, offset)
        if state == OWES:
            waiting = self._copies.setdefault(offset, [])
            if sub_id not in waiting:
                waiting.append(sub_id)
            return True
        if state == SETTLED:
            acks.setdefault(sub_id, []).append(offset)
            return True
        return False

    def _client_has(self, offset: int, acks: dict[int, list[int]]) -> None:
        """The client has the message at ``offset`` for good: the copies other
        subscriptions kept back are acked (into ``acks``)."""
        for sub_id in self._copies.pop(offset, ()):
            acks.setdefault(sub_id, []).append(offset)

    def _acked(self, sub_id: int, offset: int) -> None:
        """The client acked a delivery (PUBACK; PUBREC or PUBCOMP at QoS 2)."""
        if self.broker.ack(self.conn_id, sub_id, (offset,), wall_ms()):
            self.wake()
        self._copies_done(offset)

    def _copies_done(self, offset: int) -> None:
        """The client has the message at ``offset``: the copies of it that other
        subscriptions kept back are acked."""
        if offset and self._copies:
            acks: dict[int, list[int]] = {}
            self._client_has(offset, acks)
            wall = wall_ms()
            for other, offsets in acks.items():
                if self.broker.ack(self.conn_id, other, tuple(offsets), wall):
                    self.wake()

    def _owners_changed(self) -> None:
        """Subscriptions changed: who delivers what is worked out again, and the copies kept
        back for an owner that may be gone are delivered again now (each is looked at
        anew: acked, kept back for the new owner, or sent)."""
        self._owners.clear()
        self._filters = None
        copies, self._copies = self._copies, {}
        by_sub: dict[int, list[int]] = {}
        for offset, subs in copies.items():
            for sub_id in subs:
                by_sub.setdefault(sub_id, []).append(offset)
        for sub_id, offsets in by_sub.items():
            self.server.wake(self.broker.nack(self.conn_id, sub_id, tuple(offsets), 0,
                                              now_ms(), wall_ms(), spend=False))

    def _owner(self, topic: bytes, key: bytes) -> int:
        """Which of this client's subscriptions whose filters match ``topic`` sends it: the
        one with the highest granted QoS, a log cursor before a live queue at the same QoS
        (a cursor has what came while the client was away, a live queue does not), the
        oldest of those. Shared subscriptions are left out (each delivers its own copy);
        for a message not in the log (``key`` starts with NUL) so are the log cursors,
        which never see it."""
        filters = self._filters
        if filters is None:  # one walk of the topic's levels, however many filters
            filters = self._filters = FilterIndex()
            for topic_filter, value in self.subs.items():
                if not topic_filter.startswith("$share/"):
                    filters.add(split(topic_filter), value)
        best = (-1, False, 0)
        owner = -1
        live_only = key[:1] == b"\0"
        cursors = self._cursors
        for sub_id, qos in filters.match(split(topic.decode("utf-8", "replace"))):
            if live_only and sub_id in cursors:
                continue
            if (rank := (qos, sub_id in cursors, -sub_id)) > best:
                best = rank
                owner = sub_id
        if len(self._owners) >= _OWNERS_KEPT:
            self._owners.clear()
        self._owners[key] = owner
        return owner

    def _pid_for(self, sub_id: int, offset: int, count: int) -> int:
        """The packet id of a QoS 1 or 2 delivery. Each time the same message goes to this
        client (a retry, a reconnect, a restart of the broker, which forgets what was in
        flight) it gets the same id, so the client knows it again (MQTT-4.4.0-1): the id
        follows from the log offset and the subscription's filter, or, when another message
        in flight holds that one, the next free id after it (``count``: the delivery count,
        more than 1 when it was sent before in this run). 0: no id is free (``_no_id``)."""
        if not offset:  # not from the log: nothing to send again
            return self._pid() or self._no_id(sub_id, 0)
        inflight = self.inflight
        released = self.released
        pid = (offset + self._salts.get(sub_id, 0)) % 65535 + 1
        entry = inflight.get(pid)
        if entry is not None and entry[0] == sub_id and entry[1] == offset:
            return pid
        if released.get(pid) == (sub_id, offset):
            return pid
        if count > 1:  # sent before in this run: perhaps moved on by a collision then
            for other, held in inflight.items():
                if held[1] == offset and held[0] == sub_id:
                    return other
            for other, done in released.items():  # PUBREC had: its PUBREL goes again
                if done == (sub_id, offset):
                    return other
        return self._free(pid) or self._no_id(sub_id, offset)

    def _free(self, start: int) -> int:
        return free_packet_id(start, self.inflight, self.released)

    def _no_id(self, sub_id: int, offset: int) -> int:
        """Every packet id is taken: 65,535 deliveries await PUBACK, PUBREC or PUBCOMP
        (most of them, likely, owed a PUBCOMP the client does not send: the cursor moved on
        at PUBREC, so ``mqtt.max_inflight`` does not bound those). The delivery goes back
        to its cursor, no retry spent, and the session's log cursors take nothing more
        until an id is free (``_id_freed``): its QoS 1/2 deliveries wait, nothing is lost
        (but a delivery not from the log, ``offset`` 0: never one at QoS 1/2, which is
        always logged). Counted (``no_packet_id``) when it runs out with its cursors'
        full credit, said once per connection. Returns 0."""
        if not self._no_ids:
            self.server.mqtt_error("no_packet_id")
        self._no_ids = True
        conn = self.conn_id
        for sub in self._cursors:  # every time: a subscription made since has its credit
            self.broker.set_credit(conn, sub, 0)
        if offset:  # given back once the batch is done (``_give_back``)
            self._unsent.setdefault(sub_id, []).append(offset)
        if not self._said_no_ids:
            self._said_no_ids = True
            log.warning("MQTT client %r: all 65,535 packet ids are taken (%d of them owed a "
                        "PUBCOMP): its QoS 1/2 deliveries wait until it frees one (PUBCOMP, "
                        "PUBACK)", self.client_id, len(self.released))
        return 0

    def _give_back(self) -> None:
        """The deliveries ``_no_id`` kept from the client go back to their cursors, to be
        taken again in their order, no retry spent."""
        unsent, self._unsent = self._unsent, {}
        now, wall = now_ms(), wall_ms()
        for sub_id, offsets in unsent.items():
            self.server.wake(self.broker.nack(self.conn_id, sub_id, tuple(offsets), 0, now,
                                              wall, spend=False))

    def _id_freed(self) -> None:
        """Packet ids may have come free: the log cursors take again (``_no_id``), as many
        as there are free ids, up to ``mqtt.max_inflight`` (what they took beyond would
        only go back)."""
        if not self._no_ids:
            return
        most = self.server.config.mqtt.max_inflight
        credit = min(most, 65535 - len(self.inflight) - len(self.released))
        if credit > 0:
            self._no_ids = credit < most
            for sub in self._cursors:
                self.broker.set_credit(self.conn_id, sub, credit)
            self.wake()

    def _forget_given_up(self) -> None:
        """Deliveries the core no longer holds for this client (dead-lettered after
        ``delivery.max_retries``, or their subscription ended) free their packet ids; the
        watchdog has this looked at every second. (A persistent session's ids owed a
        PUBCOMP, whose cursor moved on at PUBREC, stay: their PUBREL is still owed.)"""
        held = self.broker.in_flight
        conn = self.conn_id
        for table in (self.inflight, self.released):
            gone = [pid for pid, entry in table.items()
                    if entry[1] and not held(conn, entry[0], entry[1])]
            for pid in gone:
                del table[pid]

    def _pid(self) -> int:
        """The next free packet id after the last one handed out this way."""
        self._next_pid = pid = self._free(self._next_pid % 65535 + 1)
        return pid

    # ----------------------------------------------------------------------------- reader

    async def _read_loop(self) -> CloseReason:
        server = self.server
        cfg = server.config.server
        decoder = mqtt.Decoder(server.mqtt_max_packet)
        receive = self._receive if self.tls is None else self._receive_tls  # the base's
        clock = self.clock
        budget = cfg.max_pending_bytes
        handshake = cfg.handshake_timeout_ms / 1000 or math.inf
        with trio.CancelScope() as scope:
            self._read_scope = scope
            deadline = trio.current_time() + handshake
            while True:
                until = math.inf if self.connected else deadline
                try:
                    if await self._held_back(budget, decoder, until):
                        continue
                    data = await receive(until)
                except trio.TooSlowError:
                    server.mqtt_error("handshake_timeout")
                    return CloseReason.HANDSHAKE_TIMEOUT
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return CloseReason.RESET
                if data is None:
                    continue
                self.heard_at = self.read_at = clock()
                self._turn = self.read_at + _TURN_S
                if not data:
                    return CloseReason.EOF
                decoder.feed(data)
                try:
                    while True:
                        try:
                            packets = decoder.packets()
                        except mqtt.MqttError as exc:
                            self._protocol_error(exc.reason, str(exc))
                            return CloseReason.PROTOCOL_ERROR
                        if not packets:
                            break
                        # QoS 0 and 1 PUBLISHes in a row go to the core as one batch (one
                        # log append); any other packet sends what came before it first
                        batch: list[RawMessage] = []
                        pids: list[int] = []
                        names, mark, bridge = self._names, self.mark, self.bridge
                        for packet in packets:
                            if packet.__class__ is Publish and self.connected:
                                topic, payload, qos, retain, _, pid = packet  # type: ignore[misc]
                                name = names.get(topic)
                                if name is not None and qos < 2 and not (
                                        bridge and topic[:1] == "$"):
                                    # the usual: a topic this client published to before
                                    # (``_message``'s first step and ``raw_message``
                                    # inlined: two calls a message fewer)
                                    n = len(payload)
                                    batch.append(_new(RawMessage, (
                                        name, 1 if qos else 0, 0, n, _join((_pack_head(
                                            _FLAGS[qos][retain] | mark, 0, len(name), 0, n),
                                            name, payload)), FLAG_RETAIN if retain else 0)))
                                    pids.append(pid)
                                    continue
                                if qos < 2 and not (bridge and topic[:1] == "$"):
                                    raw = self._message(packet)  # type: ignore[arg-type]
                                    if raw.__class__ is RawMessage:
                                        batch.append(raw)  # type: ignore[arg-type]
                                        pids.append(packet.packet_id)  # type: ignore[attr-defined]
                                        continue
                                    if raw is None:  # dropped
                                        continue
                                    reason = await self._publish_batch(batch, pids)
                                    return reason or raw  # type: ignore[return-value]
                                reason = await self._publish_batch(batch, pids)
                                if reason is None:
                                    reason = self._publish(packet)  # type: ignore[arg-type]
                                    if reason is _HELD:
                                        reason = await self._publish_blocked(packet)  # type: ignore[arg-type]
                                if reason is not None:
                                    return reason  # type: ignore[return-value]
                                continue
                            reason = await self._publish_batch(batch, pids)
                            if reason is None:
                                if packet.__class__ is Subscribe and self.connected:
                                    await self._subscribe_packet(packet)  # type: ignore[arg-type]
                                else:
                                    reason = self._handle(packet)
                                    # a CONNECT sets what a bridge's PUBLISHes get
                                    mark, bridge = self.mark, self.bridge
                            if reason is not None:
                                return reason
                            if self.held is not None:  # CONNACK waits for the log
                                await self._reply_out()
                            if clock() > self._turn:  # many packets in a row
                                await self._let_others_in()
                        reason = await self._publish_batch(batch, pids)
                        if reason is not None:
                            return reason
                finally:
                    server.deliver_routed(self.read_at)
                    server.log_touched()
                    # not kept while the reader waits for its next read (as the native
                    # reader's): a message can be max_message_bytes
                    packets = batch = packet = raw = payload = None  # type: ignore[assignment]
        return self.close_reason or CloseReason.SHUTDOWN

    async def _let_others_in(self) -> None:
        """The reader has worked for ``_TURN_S`` without a wait (many packets, or a
        SUBSCRIBE of many filters): what it routed goes out, what it appended goes to the
        flusher, and the other tasks run before it goes on, as the native reader does
        between frames. Nothing of this client's is reordered: its next packet, or the
        rest of the SUBSCRIBE, waits for it."""
        server = self.server
        server.deliver_routed(self.read_at)
        server.log_touched()
        await trio.lowlevel.checkpoint()
        self.read_at = self.clock()
        self._turn = self.read_at + _TURN_S

    def _protocol_error(self, reason: str, text: str) -> None:
        """The connection closes for breaking the protocol (or for a refusal 3.1.1 has no
        answer for): counted by ``reason``, and logged at most once per source address
        and reason a minute (``hush``), before and after CONNECT alike: a peer that loops
        connecting and sending garbage, or an authenticated client that connects again
        after each close, writes one line a minute, not one per connection."""
        self.server.mqtt_error(reason)
        said = self.server.mqtt_hush.due(self.peer, reason)
        if said is not None:
            log.info("MQTT connection %d from %s (client %r) closed: %s%s; further such "
                     "closes from there are counted, not logged, for %d s "
                     "(blipmq_mqtt_protocol_errors_total{reason=\"%s\"})", self.conn_id,
                     self.peer, self.client_id, text, since(said), EVERY_S, reason)

    def _dropped(self, code: ErrorCode, text: str) -> None:
        """A QoS 0 publish the broker refused is dropped (3.1.1 cannot refuse one): counted
        by the refusal's code, and logged at most once per source address and code a
        minute, so that a client publishing in a loop what the broker refuses (a retained
        value past retained.max_topics, a message too large) does not fill the log."""
        reason = code.name.lower()
        server = self.server
        server.mqtt_error("refused")
        server.mqtt_dropped(reason)
        said = server.mqtt_hush.due(self.peer, "qos0_dropped:" + reason)
        if said is not None:
            log.info("MQTT client %r from %s: QoS 0 publish dropped: %s%s; further such drops "
                     "from there are counted, not logged, for %d s "
                     "(blipmq_mqtt_qos0_dropped_total{reason=\"%s\"})", self.client_id,
                     self.peer, text, since(said), EVERY_S, reason)

    def _handle(self, packet: object) -> CloseReason | None:
        if not self.connected:
            if packet.__class__ is not Connect:
                self._protocol_error("not_connect_first", "the first packet must be CONNECT")
                return CloseReason.PROTOCOL_ERROR
            return self._connect(packet)  # type: ignore[arg-type]
        match packet:
            case PubAck():
                # only a QoS 1 delivery's: a QoS 2 one is not done before PUBREC (a client
                # that answers with the other packet gets the delivery again, as one that
                # does not answer, and mosquitto ignores it too)
                found = self.inflight.get(packet.packet_id)
                if found is not None and found[2] == 1:
                    del self.inflight[packet.packet_id]
                    self._acked(found[0], found[1])
                    self._id_freed()
            case PubRec():
                pid = packet.packet_id
                entry = self.inflight.get(pid)
                if entry is not None and entry[2] == 1:
                    return None  # a QoS 1 delivery's id: not a QoS 2 exchange (see PUBACK)
                if entry is not None:
                    del self.inflight[pid]
                    if self.clean and entry[0] not in self._shared:
                        self.released[pid] = (entry[0], entry[1])  # the cursor moves on PUBCOMP
                        # the client has it: no other subscription sends it (after an
                        # UNSUBSCRIBE of this one before PUBCOMP, say)
                        self._copies_done(entry[1])
                    else:
                        # the client has the message: from here on only its packet id is
                        # owed (PUBREL, again after a reconnect), saved before the cursor
                        # moves on, so a restart sends PUBREL, never the PUBLISH again. A
                        # $share delivery's cursor moves on now in a clean session too: the
                        # message must never go to another member (MQTT-4.8.2-5)
                        self.released[pid] = (0, 0)
                        at = (0 if self.clean
                              else self.server.mqtt_sessions.outbound_released(self, pid))
                        self._acked(entry[0], entry[1])
                        self._once_durable(at, pid | _OUTBOUND, PubRel(pid))
                        return None
                self.send_bytes(mqtt.encode(PubRel(pid)))
            case PubComp():
                found = self.released.pop(packet.packet_id, None)
                if found is not None:
                    self._id_freed()
                    if not self.clean:
                        self.server.mqtt_sessions.outbound_released(self, packet.packet_id)
                    elif found[0]:  # not a $share delivery, acked at PUBREC
                        self._acked(found[0], found[1])
            case PubRel():
                pid = packet.packet_id
                # PUBCOMP once the id is free on disk too (a persistent session's)
                at = self.server.mqtt_sessions.qos2_released(self, pid)
                self._once_durable(at, pid, PubComp(pid))
            case Unsubscribe():
                self._unsubscribe(packet)
            case PingReq():
                self.reply_now(_PINGRESP)
            case Disconnect():
                self.will = None  # never after DISCONNECT
                return CloseReason.GOODBYE
            case Connect():
                self._protocol_error("second_connect", "a second CONNECT")
                return CloseReason.PROTOCOL_ERROR
            case _:
                name = type(packet).__name__.upper()
                self._protocol_error("server_packet", f"{name} is not a client packet")
                return CloseReason.PROTOCOL_ERROR
        return None

    def _connect(self, packet: Connect) -> CloseReason | None:
        server = self.server
        level = packet.level & ~mqtt.BRIDGE_LEVEL
        if _LEVELS.get(packet.protocol_name) != level:  # MQTT/4, MQIsdp/3 (bridges': 0x8_)
            self.send_bytes(mqtt.encode(ConnAck(False, ConnackCode.BAD_PROTOCOL_VERSION)))
            self._protocol_error("protocol_version",
                                 f"protocol {packet.protocol_name} level {packet.level} is not "
                                 "supported (MQTT 4 and MQIsdp 3 are)")
            return CloseReason.PROTOCOL_ERROR
        self.level = level
        if packet.level & mqtt.BRIDGE_LEVEL:
            self.bridge = True
            self.mark = FLAG_BRIDGED
        identity = server.authenticate(self, packet.password or b"")
        if identity is None:  # CONNACK 5 after the delay that slows guessing (``run``)
            self.refusal = mqtt.encode(ConnAck(False, ConnackCode.NOT_AUTHORIZED))
            return CloseReason.AUTH_FAILED
        access = self.access
        will = packet.will
        if (will is not None and access is not None and not access.unlimited
                and not access.may_publish(will.topic.encode("utf-8"))):
            self.send_bytes(mqtt.encode(ConnAck(False, ConnackCode.NOT_AUTHORIZED)))
            self._protocol_error("forbidden_will", f"key {identity.name!r} may not publish "
                                 f"its will to {will.topic!r}")
            return CloseReason.PROTOCOL_ERROR
        if will is not None:
            problem = self._will_problem(will.topic, len(will.payload))
            if problem is not None:
                # it could never be published: refused now, when the client can be told
                # (the connection closes, as mosquitto closes it), not dropped when it fires
                self._protocol_error("will_refused", problem)
                return CloseReason.PROTOCOL_ERROR
        client_id = packet.client_id
        if not client_id:
            if not packet.clean_session or level == 3:
                self.send_bytes(mqtt.encode(ConnAck(False, ConnackCode.IDENTIFIER_REJECTED)))
                self._protocol_error("identifier_rejected",
                                     "an empty client id needs clean session 1")
                return CloseReason.PROTOCOL_ERROR
            client_id = "blipmq-" + os.urandom(8).hex()
        self.client_id = client_id
        self.username = packet.username
        self.clean = packet.clean_session
        limit = server.config.mqtt.max_keepalive
        if packet.keepalive > limit:
            # 3.1.1 cannot tell the client a shorter keepalive (MQTT 5's Server Keep Alive):
            # cut silently, it would be closed at 1.5 x the cap every cycle, its will fired
            # each time. Refused instead, as mosquitto documents for its max_keepalive
            self.send_bytes(mqtt.encode(ConnAck(False, ConnackCode.IDENTIFIER_REJECTED)))
            self._protocol_error("keepalive_too_long", f"keepalive of {packet.keepalive} s "
                                 f"asked (the most is {limit} s, mqtt.max_keepalive): "
                                 "CONNACK 2 (identifier rejected)")
            return CloseReason.PROTOCOL_ERROR
        self.keepalive = float(packet.keepalive)
        verdict = server.mqtt_sessions.may_attach(self)  # before it counts as connected
        if verdict != ConnackCode.ACCEPTED:
            self.send_bytes(mqtt.encode(ConnAck(False, verdict)))
            if verdict == ConnackCode.SERVER_UNAVAILABLE:
                self._protocol_error("session_in_use", f"client id {client_id!r} is a "
                                     "session of the api_keys keys that one of them still "
                                     "uses: adopted once that connection is gone")
            else:
                self._protocol_error("session_of_another_key", f"client id {client_id!r} "
                                     "is another key's session")
            return CloseReason.PROTOCOL_ERROR
        over = server.mqtt_sessions.room(self)
        if over is not None:  # the device tries again later, as after a restart
            self.send_bytes(mqtt.encode(ConnAck(False, ConnackCode.SERVER_UNAVAILABLE)))
            server.mqtt_sessions.refused(self, *over)
            return CloseReason.LIMIT
        self.will = packet.will
        self.connected = self.authenticated = True
        if self.bridge:
            log.info("MQTT client %r from %s connected as a bridge (level %#x): what it "
                     "publishes is marked as bridged in, and it is sent nothing so marked",
                     client_id, self.peer, packet.level)
        present = server.mqtt_sessions.attach(self)
        # a clean session that ended a persistent one: CONNACK (session present 0) once
        # that is durable; nothing is read, so nothing is answered, before it
        self.hold_reply(server.mqtt_sessions.ended_at(self),
                        mqtt.encode(ConnAck(present, ConnackCode.ACCEPTED)))
        for pid in self.released:  # MQTT-4.4.0-1: PUBREL again (never the PUBLISH)
            self.send_bytes(mqtt.encode(PubRel(pid)))
        if present:
            self.wake()
        return None

    def _will_problem(self, topic: str, size: int) -> str | None:
        """Why a will could never be published (the core's ``size_refusal``: its topic over
        ``server.max_topic_bytes``, its payload over ``server.max_message_bytes``), or None."""
        refusal = self.broker.limits.size_refusal(len(topic.encode("utf-8")), size)
        return None if refusal is None else f"will {refusal.text}"

    # ---------------------------------------------------------------------------- publish

    def _message(self, packet: Publish) -> RawMessage | CloseReason | None:
        """The core's message for an MQTT PUBLISH; None: dropped (counted) ; a reason: close."""
        topic, payload, qos, retain = packet[:4]
        name = self._names.get(topic)
        if name is not None:  # the usual: a topic this client published to before
            return raw_message(name, payload, qos, retain, self.mark)
        if broker_topic(topic):
            if self.bridge and connection_state(topic, self.client_id,
                                                self.broker.limits.max_topic_bytes):
                # a mosquitto bridge's notification (and will): its link's state, kept here
                # as mosquitto keeps it (never cached in ``_names``: checked every time)
                return raw_message(topic.encode("utf-8"), payload, qos, retain, self.mark)
            if packet.qos:
                self._protocol_error("reserved_topic",
                                     f"publish to the broker's topic {topic!r}")
                return CloseReason.PROTOCOL_ERROR
            self.server.mqtt_error("reserved_topic")
            self.server.mqtt_dropped("reserved_topic")
            return None
        name = topic.encode("utf-8")
        if len(name) > self.broker.limits.max_topic_bytes:
            # not remembered: the core refuses it (INVALID_TOPIC), and ``_refused`` says
            # what becomes of it
            return raw_message(name, payload, qos, retain, self.mark)
        if len(self._names) >= _NAMES_KEPT:
            self._names.clear()
        self._names[topic] = name
        return self._message(packet)

    async def _publish_batch(self, batch: list[RawMessage], pids: list[int]
                             ) -> CloseReason | None:
        """Route QoS 0 and 1 messages in one core call (``pids``: their packet ids, 0 for
        QoS 0), waiting for room when a full ``block`` queue holds the rest back; the
        batch and ``pids`` are emptied. Each QoS 1 message's PUBACK once the batch is
        durable."""
        if not batch:
            return None
        server = self.server
        messages: list[RawMessage] | tuple[RawMessage, ...] = batch
        at = 0
        try:
            while messages:
                now = server.published_at = self.read_at
                result = self.broker.publish(messages, int(now * 1000), int(_time() * 1000),
                                             access=self.access, unkept=True)
                server.routed(result.wake)
                if result.unkept:
                    self._not_kept(result)
                done = result.accepted
                acked = [pid for pid in pids[at:at + done] if pid]
                if acked:  # one flusher entry for the PUBACKs of the batch
                    self._batch_key = key = self._batch_key % _BATCH_KEYS + 1 + _BATCHES
                    self._once_durable(result.last_offset, key, b"".join(
                        _PUBACK + pid.to_bytes(2, "big") for pid in acked), len(acked))
                at += done
                if result.refusal is not None:
                    # the refused message only: the rest of the batch goes on
                    pid = pids[at]
                    if self._refused(1 if pid else 0, pid, result.refusal):
                        return CloseReason.PROTOCOL_ERROR
                    at += 1
                    messages = batch[at:]
                    continue
                if result.blocked is not None:
                    server.log_touched()  # what was accepted need not wait with us
                    await self._waiting(server.wait_for_room(result.blocked))
                    self.read_at = self.clock()
                    messages = batch[at:]
                    continue
                break
        finally:
            batch.clear()
            pids.clear()
        return None

    def _publish(self, packet: Publish) -> object:
        """None once done; ``_HELD`` when a full ``block`` queue holds it; a reason to close."""
        qos = packet.qos
        pid = packet.packet_id
        if qos == 2 and (pid in self.confirming or (pid in self.qos2_in and packet.dup)):
            # a resent PUBLISH whose first copy is logged: not twice. Its PUBREC goes out
            # once that copy is durable (again, if that was before; a sync that failed
            # since is tried again first)
            if pid not in self.confirming:
                self._once_durable(self._appended(), pid, PubRec(pid))
            return None
        if qos == 2 and pid in self.qos2_in:
            # DUP 0: not a resend (MQTT-3.3.1-1) but a new message with an id still owed a
            # PUBREL (a client that lost its state, a device rebooted): logged and
            # delivered like any other. The id now stands for this one: its PUBREC waits
            # for this message and the id's record after it (``_published``), and its
            # PUBREL releases it
            said = self.server.mqtt_hush.due(self.peer, "qos2_id_reused")
            if said is not None:  # a client doing it in a loop: a line a minute
                log.info("MQTT client %r: QoS 2 packet id %d used again before its PUBREL, "
                         "with DUP 0: a new message%s; further such messages from there "
                         "are not logged for %d s", self.client_id, pid, since(said), EVERY_S)
        raw = self._message(packet)
        if raw is None or raw.__class__ is CloseReason:
            return raw
        now = self.server.published_at = self.read_at
        result = self._route(raw, int(now * 1000), int(_time() * 1000))  # type: ignore[arg-type]
        if result.blocked is not None:
            return _HELD
        return self._published(packet, result.refusal, result.last_offset)

    def _route(self, raw: RawMessage, now: int, wall: int) -> PublishResult:
        """Publish one message; a retained one the retained store (or its key's share) has
        no room for is routed without retain, its value not kept (``_not_kept``)."""
        # internal: only a bridge's link state (``_message``) is in a broker's tree here
        result = self.broker.publish((raw,), now, wall, internal=raw.topic[:5] == b"$SYS/",
                                     access=self.access, unkept=True)
        self.server.routed(result.wake)
        if result.unkept:
            self._not_kept(result)
        return result

    def _not_kept(self, result: PublishResult) -> None:
        """Retained PUBLISHes the retained store refused to keep (``retained.max_topics``,
        ``max_bytes``, or the key's retained share): the core routed, logged and
        acknowledged them as live messages (``publish(unkept=True)``); only the topics'
        retained values stay what they were. Closing instead would make a 3.1.1 client
        resend it at every reconnect (an endless loop); a native client gets ERROR LIMIT.
        Counted by the core's retained refusal counters, logged (``not_kept``)."""
        not_kept(self.server, self.peer, self.client_id, result.unkept_topic, result.unkept,
                 result.unkept_text)

    def _refused(self, qos: int, pid: int, refusal: Refusal) -> bool:
        """A publish the core refused, nothing of it routed or kept. 3.1.1 cannot refuse a
        PUBLISH (MQTT-3.3.5-2: acknowledge it or close): a QoS 0 one is dropped; a QoS 1/2
        one the key may not make (FORBIDDEN), or that can never be taken (a topic over
        ``server.max_topic_bytes``, a payload over ``server.max_message_bytes``), is
        acknowledged (after the earlier publishes', MQTT-4.6.0-2, -3) and dropped, as
        mosquitto does: closing instead, the client would resend it at every reconnect
        and loop, everything it publishes behind it stuck. Any other refusal (QoS 1 without
        a log) closes the connection: True. Counted, and logged at most once per source
        address and reason a minute (``hush``)."""
        server = self.server
        code = refusal.code
        if code == ErrorCode.FORBIDDEN:  # acknowledged, not routed (docs/SECURITY.md)
            server.mqtt_error("forbidden")
            if not qos:
                server.mqtt_dropped("forbidden")
        elif not qos:
            self._dropped(code, refusal.text)
            return False
        elif code not in _ACKED_DROPPED:
            self._protocol_error("refused", f"publish refused: {refusal.text}")
            return True
        else:
            reason = code.name.lower()
            server.mqtt_error("refused")
            said = server.mqtt_hush.due(self.peer, "acked_dropped:" + reason)
            if said is not None:
                log.info("MQTT client %r from %s: QoS %d publish acknowledged and dropped: "
                         "%s%s; further such drops from there are counted, not logged, for "
                         "%d s (blipmq_mqtt_protocol_errors_total{reason=\"refused\"})",
                         self.client_id, self.peer, qos, refusal.text, since(said), EVERY_S)
        if qos:
            self._once_durable(self._appended(), pid, (PubAck if qos == 1 else PubRec)(pid))
        return False

    def _published(self, packet: Publish, refusal: Refusal | None, offset: int
                   ) -> CloseReason | None:
        qos = packet.qos
        if refusal is not None:
            if self._refused(qos, packet.packet_id, refusal):
                return CloseReason.PROTOCOL_ERROR
            return None
        if qos == 1:
            self._once_durable(offset, packet.packet_id, PubAck(packet.packet_id), 1)
        elif qos == 2:  # remembered (in a persistent session: logged) before PUBREC
            pid = packet.packet_id
            if offset:
                self._qos2_at[pid] = offset
            offset = max(offset, self.server.mqtt_sessions.qos2_received(self, pid))
            self._once_durable(offset, pid, PubRec(pid), 1)
        return None

    async def _publish_blocked(self, packet: Publish) -> CloseReason | None:
        """A full ``block`` queue held the message back: wait for room, as often as it takes."""
        server = self.server
        raw = self._message(packet)
        while True:
            server.log_touched()
            result = self._route(raw, now_ms(), wall_ms())  # type: ignore[arg-type]
            if result.blocked is None:
                return self._published(packet, result.refusal, result.last_offset)
            await self._waiting(server.wait_for_room(result.blocked))

    # ----------------------------------------------------------------------- subscriptions

    async def _subscribe_packet(self, packet: Subscribe) -> None:
        """A SUBSCRIBE: each filter in turn (MQTT-3.8.4-4: as if each came in a SUBSCRIBE of
        its own), then one SUBACK with a code for each. A filter listed again in the same
        packet replaces the subscription the earlier one made (MQTT-3.8.4-3), so only its
        last occurrence is sent the retained values (not once per occurrence). After
        ``_TURN_S`` of work the other tasks run between two filters (``_let_others_in``):
        a packet of thousands of filters does not hold the broker. Each subscription's
        retained values still come before what is published to it later, and SUBACK after
        them all; a message published meanwhile to a filter already done may come before
        the SUBACK, as 3.1.1 allows (3.8.4)."""
        topics = packet.topics
        last = {topic_filter: i for i, (topic_filter, _) in enumerate(topics)}
        made: set[str] = set()  # filters one of this packet's occurrences subscribed
        codes = []
        ready = False
        clock = self.clock
        for i, (topic_filter, qos) in enumerate(topics):
            if i and clock() > self._turn:
                self._owners_changed()  # what the writer may do meanwhile goes by them
                await self._let_others_in()
            final = last[topic_filter] == i
            code, woke = self.subscribe_one(topic_filter, qos, retained=final)
            codes.append(code)
            ready = ready or woke
            if code != SUBACK_FAILURE:
                made.add(topic_filter)
            elif final and topic_filter in made and topic_filter in self.subs:
                # the last occurrence was refused, an earlier one's subscription stays:
                # its retained values, which it was made without
                ready = self.broker.retained_again(self.conn_id, self.subs[topic_filter][0],
                                                   wall_ms()) or ready
        self.say_refusals(len(codes))
        self._owners_changed()
        # a persistent session's SUBACK once the subscription is on disk
        at = self.server.mqtt_sessions.changed(self)
        self._once_durable(at, packet.packet_id, SubAck(packet.packet_id, tuple(codes)))
        counts = self.broker.take_counts()
        if counts and self.server.prefetcher is not None:
            self.server.prefetcher.request(counts)
        if ready:
            self.wake()

    def say_refusals(self, asked: int) -> None:
        """One log line for the filters of a SUBSCRIBE (or a session restored) that were
        refused (0x80), however many: the first three with their reasons, and how many. At
        most one such line per source address a minute (``hush``; the next says how many
        were not logged), so that SUBSCRIBEs of a refused filter in a loop do not fill the
        log."""
        refusals = self.refusals
        if refusals:
            said = self.server.mqtt_hush.due(self.peer, "filters_refused")
            if said is not None:
                named = "; ".join(f"{f!r}: {why}" for f, why in refusals[:3])
                more = f" (and {len(refusals) - 3} more)" if len(refusals) > 3 else ""
                log.info("MQTT client %r: %d of %d filter(s) refused (0x80): %s%s%s; further "
                         "such refusals from there are not logged for %d s", self.client_id,
                         len(refusals), asked, named, more, since(said), EVERY_S)
            refusals.clear()

    def subscribe_one(self, topic_filter: str, qos: int, retained: bool,
                      restored: bool = False) -> tuple[int, bool]:
        """One filter of a SUBSCRIBE (or, ``restored``, of a session restored, which keeps
        what it was granted whatever ``server.max_subscriptions`` says now): (SUBACK code,
        ready)."""
        share = share_of(topic_filter)
        if share is None:
            self.server.mqtt_error("bad_share")
            self.refusals.append((topic_filter, "expected $share/<name>/<filter>"))
            return SUBACK_FAILURE, False
        group, core_filter = share
        problem = filter_problem(core_filter, self.broker.limits.max_topic_bytes)
        if problem:
            self.refusals.append((topic_filter, problem))
            return SUBACK_FAILURE, False
        self._owners.clear()
        self._filters = None
        if self.server.wal is None:
            qos = 0  # QoS 1 and 2 need the log: granted QoS 0
        # a log cursor for QoS 1/2; in a persistent session also for QoS 0 with
        # mqtt.queue_qos0 (what arrives while the client is away waits in the log)
        cursor = self.server.wal is not None and (
            qos > 0 or (not self.clean and self.server.config.mqtt.queue_qos0))
        if group and self.server.wal is not None:
            cursor = self._share_reads_log(core_filter, group, cursor)
            if not cursor:
                qos = 0
        if (not cursor and not group and not self.clean and self.server.wal is not None
                and self.broker.durable_group(core_filter, group_name(self.client_id))
                is not None):
            # a QoS 1/2 subscription of this persistent session made QoS 0 (now, or before
            # a reconnect or a restart): its durable group goes on, delivering at QoS 0, so
            # the backlog queued in the log is not lost (MQTT-3.8.4-3: the flow of
            # publications must not be interrupted); UNSUBSCRIBE ends it
            cursor = True
        # a persistent session's QoS 2 $share member: what it has in flight and not
        # PUBRECed waits for the session when it leaves (MQTT-4.8.2-4, -5), not another member
        holder = (group_name(self.client_id)
                  if share[0] and cursor and qos == 2 and not self.clean else "")
        old = self.subs.pop(topic_filter, None)
        access = self.access
        if (old is not None and (old[0] in self._cursors) == cursor
                and (access is None or access.unlimited
                     or access.identity.may_subscribe(core_filter))):
            # MQTT-3.8.4-3: replaced by one to the same filter, "but the flow of
            # publications MUST NOT be interrupted": the same subscription goes on at the
            # QoS granted now, what it has in flight with it (a session resumed and
            # subscribed again, as clients do, keeps its PUBACKs and packet ids), and its
            # retained values come again
            sub_id = old[0]
            self.subs[topic_filter] = (sub_id, qos)
            self.granted[sub_id] = qos
            if share[0] and cursor:
                self.server.wake(self.broker.hold_for(self.conn_id, sub_id, holder))
            return qos, (self.broker.retained_again(self.conn_id, sub_id, wall_ms())
                         if retained else False)
        if not group and cursor and not self.clean:
            group = group_name(self.client_id)
        credit = self.server.config.mqtt.max_inflight
        # another kind of subscription (a log cursor or not) replaces ``old``: the new one
        # first (it takes the old one's place, so it is not counted), so that a refusal
        # leaves the old one as it was
        # patient: a delivery is not sent again, nor dead-lettered, while the connection is
        # up (MQTT 3.1.1 resends at reconnect only, MQTT 5 forbids more: a copy on a live
        # connection only piles up behind the first); when the client goes, what it had not
        # acknowledged goes back to its cursor (and to the other $share members), and a
        # persistent session gets it again with DUP 1 at its next CONNECT. (A bridge's
        # group name stays refused: patient consumers may join those.)
        result = self.broker.subscribe(
            self.conn_id, core_filter, group, 1 if cursor else 0, credit if cursor else 0,
            0, timestamp_ms=wall_ms(), retained=retained, access=self.access,
            patient=not group.startswith(BRIDGE_GROUPS),
            counted=not restored and old is None, holder=holder,
            # at most once: a full QoS 0 queue drops rather than hold its publishers
            overflow=None if cursor else Overflow(self.server.config.mqtt.qos0_overflow))
        if result.adopted and share[0]:  # the session's own groups: said of the session
            log_adopted(group, core_filter, result.adopted)
        if result.refusal is not None:
            self.refusals.append((topic_filter, result.refusal.text))
            if result.refusal.code != ErrorCode.FORBIDDEN:
                if old is not None:
                    self.subs[topic_filter] = old
                return SUBACK_FAILURE, False
            # the key may not read it (any more): the old one goes too
            self.server.mqtt_error("forbidden")
        if old is not None:
            self.granted.pop(old[0], None)
            self._shared.discard(old[0])
            was_cursor = old[0] in self._cursors
            self._cursors.discard(old[0])
            self.server.detached(self.broker.unsubscribe(self.conn_id, old[0]).detached)
            if was_cursor and not self.clean and not share[0]:
                # the session's durable group on it goes, as on UNSUBSCRIBE: kept, it would
                # pile up what the QoS 0 one delivers, and send it all again at QoS 1
                self.broker.unsubscribe(self.conn_id, 0, topic_filter,
                                        group_name(self.client_id), wall_ms())
        if result.refusal is not None:
            return SUBACK_FAILURE, False
        self.subs[topic_filter] = (result.sub_id, qos)
        self.granted[result.sub_id] = qos
        if group and group == share[0]:
            self._shared.add(result.sub_id)
            if cursor and not self.clean and not holder:  # kept for a QoS 2 member before
                self.server.wake(self.broker.release(core_filter, group,
                                                     group_name(self.client_id)))
        if cursor:
            self._cursors.add(result.sub_id)
        # its deliveries' packet ids start from the offset moved on by this, the same for
        # the filter after a reconnect or a restart: overlapping subscriptions' copies of
        # one message then take ids of their own
        self._salts[result.sub_id] = zlib.crc32(topic_filter.encode("utf-8"))
        return qos, result.ready

    def _share_reads_log(self, core_filter: str, group: str, cursor: bool) -> bool:
        """Whether a ``$share`` member reads the log: as its group does when the group is
        there already (the members of one share split its messages whatever QoS each asked
        for; a QoS 0 member of a durable group gets its deliveries at QoS 0, a QoS 1/2 one
        of a live QoS 0 group is granted QoS 0), else as its QoS says (``cursor``)."""
        broker = self.broker
        if broker.durable_group(core_filter, group) is not None:
            return True
        return cursor and broker.group(core_filter, group) is None

    def _unsubscribe(self, packet: Unsubscribe) -> None:
        for topic_filter in packet.topics:
            found = self.subs.pop(topic_filter, None)
            if found is None:
                continue
            self.granted.pop(found[0], None)
            self._shared.discard(found[0])
            self._cursors.discard(found[0])
            self.server.detached(self.broker.unsubscribe(self.conn_id, found[0]).detached)
            if not self.clean and not topic_filter.startswith("$share/"):
                # the session's durable group goes with it (when it has one)
                self.broker.unsubscribe(self.conn_id, 0, topic_filter,
                                        group_name(self.client_id), wall_ms())
        self._owners_changed()
        at = self.server.mqtt_sessions.changed(self)
        self._once_durable(at, packet.packet_id, UnsubAck(packet.packet_id))
        self.server.log_touched()

    def saved_subs(self) -> bytes:
        return stored_subs({f: q for f, (_, q) in self.subs.items()})


def not_kept(server: Server, peer: str, client_id: str, topic: bytes, count: int,
             text: str) -> None:
    """``count`` retained publishes (or a will) of a client routed without retain, their
    values not kept (``Broker.publish(unkept=True)``): logged at WARNING at most once per
    source address a minute (``hush``; the next line says how many came since)."""
    hush = server.mqtt_hush
    said = None
    for _ in range(count):
        said = hush.due(peer, "retained_refused") or said
    if said is not None:
        log.warning("MQTT client %r from %s: retained value for %r not kept: %s; the "
                    "message is delivered without retain%s; further such refusals from "
                    "there are counted, not logged, for %d s", client_id, peer,
                    topic.decode("utf-8", "replace"), text, since(said), EVERY_S)


def raw_message(topic: bytes, payload: bytes, qos: int, retain: bool, mark: int = 0
                ) -> RawMessage:
    """The core's message (the native message record) for an MQTT publish or will;
    ``mark``: FLAG_BRIDGED for a bridge session's."""
    n = len(payload)
    return _new(RawMessage, (topic, 1 if qos else 0, 0, n, _join((
        _pack_head(_FLAGS[qos][retain] | mark, 0, len(topic), 0, n), topic, payload)),
        FLAG_RETAIN if retain else 0))


_HELD = object()  # a publish a full ``block`` queue holds back
# refusals of a QoS 1/2 publish that a resend can never get past: acknowledged and dropped
_ACKED_DROPPED = frozenset((ErrorCode.INVALID_TOPIC, ErrorCode.MESSAGE_TOO_LARGE))
_OWNERS_KEPT = 4096  # topics whose delivering subscription is remembered
_NAMES_KEPT = 1024  # topics a connection remembers having checked
# a message record's flags by MQTT QoS and retain
_FLAGS = tuple((q, q | FLAG_RETAIN) for q in (0, FLAG_QOS1, FLAG_QOS1 | FLAG_QOS2))
_join = b"".join
_new = tuple.__new__  # a RawMessage without the Python frame of its ``__new__``
_OUTBOUND = 0x10000  # ``confirming`` keys of our packet ids (the client's are below)
_BATCHES = 0x20000  # ... and of a batch's PUBACKs, taking turns through _BATCH_KEYS
_BATCH_KEYS = 1 << 20
_PUBACK = b"\x40\x02"  # a PUBACK's fixed header
_PUBREL = b"\x62\x02"  # a PUBREL's
_LEVELS = {"MQTT": 4, "MQIsdp": 3}  # the protocol level each name comes with

