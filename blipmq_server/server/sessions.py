"""MQTT sessions by client id: takeover, persistent sessions, wills and session expiry.

A client id is online (one ``MqttSession``), offline (a persistent session: its saved
subscriptions, with its durable groups reading the log meanwhile), or unknown. A persistent
session is saved in the core's STATE records (``mqtt.state`` makes the bodies), so it
survives a restart of the broker, SIGKILL included: the subscriptions, the inbound QoS 2
packet ids between PUBREC and PUBREL, the outbound ones owed a PUBCOMP, and the key that
made it (another key may not take it over). Persistent sessions are bounded: in all by
``mqtt.max_sessions``, and for each key by its quota (``access.Quota.sessions``). Lives in
the shell: it holds sessions and reads the clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from blipmq_server.broker.access import FULL
from blipmq_server.mqtt import state
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.server.hush import Hush
from blipmq_server.server.session import CloseReason, now_ms, wall_ms

if TYPE_CHECKING:
    from blipmq_server.broker.access import Identity
    from blipmq_server.mqtt.packets import ConnackCode
    from blipmq_server.server.app import Server
    from blipmq_server.server.mqtt import MqttSession

log = logging.getLogger("blipmq.mqtt")
_NONE = 1 << 62  # ``_oldest`` with no session offline


class MqttSessions:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.broker = server.broker
        self.online: dict[str, MqttSession] = {}
        # persistent sessions without a connection: client id -> (filter -> qos, since ms)
        self.offline: dict[str, tuple[dict[str, int], int]] = {}
        # no offline session went offline before this (wall ms): ``expire`` looks at none
        # of them until the oldest may have expired (10,000 offline sessions each looked
        # at every second cost an idle broker a millisecond a second)
        self._oldest = _NONE
        self.qos2: dict[str, set[int]] = {}  # persistent sessions' inbound QoS 2 ids
        self.pubrel: dict[str, set[int]] = {}  # ... and outbound ones awaiting PUBCOMP
        # each set is saved in blocks of 64 ids, the keys of which start so
        self._sets = {state.QOS2_BLOCK_PREFIX: self.qos2,
                      state.PUBREL_BLOCK_PREFIX: self.pubrel}
        # the key (by name) a client id's session belongs to, online or persistent; "" or
        # absent: nobody in particular (made while authentication was off)
        self.owners: dict[str, str] = {}
        # the persistent sessions (online or offline): client id -> the key (name) it counts
        # against ("" none), and how many each key has (``room``)
        self.kept: dict[str, str] = {}
        self.kept_by: dict[str, int] = {}
        self.hush = Hush()  # the refusals' log lines (``room``), per source address
        self.wills = 0
        self.expired = 0
        # persistent sessions restored at start, and the log's end then: what they had not
        # acknowledged below it may have reached them before the restart (DUP)
        self.restored: set[str] = set()
        self.restored_end = 0

    def checks(self) -> dict[bytes, Callable[[bytes, bytes], object]]:
        """What the log's recovery checks of the sessions' STATE values (``Broker.
        state_checks``): one that does not parse is set aside as damage, counted in
        ``blipmq_wal_recovery_quarantined``, rather than warned about at every start."""
        return {
            state.SUBS_PREFIX: _check_subs,
            state.QOS2_BLOCK_PREFIX: state.parse_block,
            state.PUBREL_BLOCK_PREFIX: state.parse_block,
            state.QOS2_PREFIX: lambda _key, value: state.parse_ids(value),
            state.PUBREL_PREFIX: lambda _key, value: state.parse_ids(value),
        }

    def recover(self, wall: int) -> None:
        """The log is open: the persistent sessions it holds are offline (since they were
        last seen, or since now when the broker stopped while they were connected)."""
        whole: list[tuple[bytes, set[int]]] = []  # a set of ids in one record (before blocks)
        for key, value in self.broker.states.items():
            try:
                prefix = key[:len(state.SUBS_PREFIX)]
                if prefix == state.SUBS_PREFIX:
                    subs, since = state.parse_subs(value)
                    self.offline[state.client_of(key)] = (subs, since or wall)
                elif prefix in self._sets:
                    cid, ids = state.parse_block(key, value)
                    self._sets[prefix].setdefault(cid, set()).update(ids)
                elif prefix in state.BLOCKS_OF:
                    whole.append((key, state.parse_ids(value)))
                elif key.startswith(state.OWNER_PREFIX):
                    cid = key[len(state.OWNER_PREFIX):].decode("utf-8", "replace")
                    self.owners[cid] = value.decode("utf-8", "replace")
            except ValueError as exc:
                log.warning("MQTT session %r not restored: %s", key, exc)
        for cid in self.offline:
            self._keep(cid, self.owners.get(cid, ""))
        for key, ids in whole:
            self._in_blocks(key, ids, wall)
        if whole:
            log.info("MQTT: %d set(s) of QoS 2 packet ids of persistent sessions (inbound "
                     "awaiting PUBREL, outbound owed a PUBCOMP) rewritten in blocks", len(whole))
        self._oldest = self._oldest_since()
        if self.offline:
            log.info("MQTT: %d persistent session(s) restored", len(self.offline))
        self._drop_orphans(wall)
        self.restored = set(self.offline)
        wal = self.server.wal
        self.restored_end = 0 if wal is None else wal.next_offset

    def _in_blocks(self, key: bytes, ids: set[int], wall: int) -> None:
        """A client's set of QoS 2 ids in one record (``state.qos2_key`` or
        ``state.pubrel_key``, as written before they were kept in blocks) is rewritten as
        blocks, then that record goes. It holds them all: blocks of the set found beside it
        are stale (this was cut short by a crash, or a broker of that version ran on the
        log since)."""
        prefix = state.BLOCKS_OF[key[:len(state.SUBS_PREFIX)]]
        cid = key[len(state.SUBS_PREFIX):].decode("utf-8", "replace")
        sets = self._sets[prefix]
        stale = sets.pop(cid, set())
        if ids:
            sets[cid] = ids
        for block in sorted({state.block_of(pid) for pid in ids | stale}):
            self._put_block(prefix, cid, ids, block, wall)
        self.broker.put_state(key, b"", wall)

    # --------------------------------------------------------------------------- connects

    def may_attach(self, session: MqttSession) -> ConnackCode:
        """Whether the session's key may use its client id (ACCEPTED): a session (online,
        or persistent and offline) that another key made is not its to take over or end
        (NOT_AUTHORIZED), unless the key is an admin's. The exception is the way from
        ``auth.api_keys`` to named keys (docs/SECURITY.md, "Migrating"): a session of the
        ``api_keys`` keys (``*``) is adopted by a named key that may read every filter it
        subscribes to, once no ``api_keys`` connection uses it (until then
        SERVER_UNAVAILABLE: the device tries again, as it does after a restart)."""
        from blipmq_server.mqtt.packets import ConnackCode  # only with MQTT connections

        cid = session.client_id
        owner = self.owners.get(cid, "")
        access = session.access
        if not owner or access is None or access.identity.admin:
            return ConnackCode.ACCEPTED
        if access.identity.name == owner:
            return ConnackCode.ACCEPTED
        if owner != FULL.name or not self._covered(cid, access.identity):
            return ConnackCode.NOT_AUTHORIZED
        if cid in self.online:
            return ConnackCode.SERVER_UNAVAILABLE
        log.info("MQTT session %r of the api_keys keys ('*') is key %r's from now on "
                 "(adopted: the key may read every filter it subscribes to)", cid,
                 access.identity.name)
        return ConnackCode.ACCEPTED

    def room(self, session: MqttSession) -> tuple[str, str] | None:
        """(the limit, why) if the session would be a persistent session past
        ``mqtt.max_sessions`` or past its key's share; None if not (a clean session, or one
        resumed or taken over: it is kept already)."""
        cid = session.client_id
        if session.clean or cid in self.kept:
            return None
        most = self.server.config.mqtt.max_sessions
        if len(self.kept) >= most:
            return "mqtt.max_sessions", (f"the broker keeps {len(self.kept)} persistent "
                                         "sessions, the most mqtt.max_sessions allows")
        access = session.access
        if access is None:
            return None
        name = access.identity.name
        most_own = access.identity.quota.sessions
        held = self.kept_by.get(name, 0)
        if most_own is not None and held >= most_own:
            return "auth.keys.max_sessions", (
                f"key {name!r} keeps {held} persistent sessions, the most its share allows "
                f"({most_own}: max_sessions, docs/SECURITY.md)")
        return None

    def refused(self, session: MqttSession, limit: str, why: str) -> None:
        """A CONNECT refused at a limit (``room``): counted, and logged at most once per
        source address and limit per ``hush.EVERY_S`` (a device retrying, or a flood of
        client ids, does not fill the log)."""
        limited = self.broker.counters.limited
        limited[limit] = limited.get(limit, 0) + 1
        said = self.hush.due(session.peer, limit)
        if said is not None:
            source, unsaid = said
            log.warning("MQTT client %r from %s refused (CONNACK 3, server unavailable): "
                        "%s%s; further refusals at %s from there are counted, not logged, "
                        "for %d s (blipmq_limit_refusals_total)", session.client_id, source,
                        why, f", and {unsaid} more since the last line" if unsaid else "",
                        limit, self.hush.every_s)

    def _keep(self, cid: str, owner: str) -> None:
        """The client id's persistent session is kept, against ``owner``'s share."""
        self._unkeep(cid)
        self.kept[cid] = owner
        self.kept_by[owner] = self.kept_by.get(owner, 0) + 1

    def _unkeep(self, cid: str) -> None:
        owner = self.kept.pop(cid, None)
        if owner is not None:
            left = self.kept_by[owner] - 1
            if left:
                self.kept_by[owner] = left
            else:
                del self.kept_by[owner]

    def _covered(self, cid: str, identity: Identity) -> bool:
        """Whether ``identity`` may read every filter the client id's session subscribes
        to (online, or persistent and offline)."""
        online = self.online.get(cid)
        if online is not None:
            filters = list(online.subs)
        else:
            filters = list(self.offline.get(cid, ({}, 0))[0])
        shares = [state.share_of(f) for f in filters]
        return all(share is not None and identity.may_subscribe(share[1]) for share in shares)

    def attach(self, session: MqttSession) -> bool:
        """A client connected: take over an earlier connection with its id, then start a
        new session or resume its persistent one. Returns CONNACK's session-present flag."""
        cid = session.client_id
        old = self.online.pop(cid, None)
        carried: dict[str, int] | None = None
        if old is not None:
            log.info("MQTT client %r connected again from %s: the connection from %s is "
                     "taken over", cid, session.peer, old.peer)
            old.taken_over = True
            self.publish_will(old)
            if not old.clean:
                carried = {f: q for f, (_, q) in old.subs.items()}
            self.server.detached(self.broker.disconnect(old.conn_id, wall_ms()))
            old.abort(CloseReason.TAKEN_OVER)
        self.online[cid] = session
        name = "" if session.access is None else session.access.identity.name
        if self.owners.get(cid, "") != name and not session.clean:
            self.broker.put_state(state.owner_key(cid), name.encode("utf-8"), wall_ms())
        stored = self.offline.pop(cid, None)
        subs = carried if carried is not None else (None if stored is None else stored[0])
        if session.clean and (subs is not None or cid in self.qos2 or cid in self.pubrel):
            self._forget(cid, subs or {})  # the persistent session ends, its owner's record too
        # after that: the online session is its key's however it began (``_forget`` drops
        # the owner, and an id with none is anybody's to take over, ``may_attach``)
        self.owners[cid] = name
        if session.clean:
            return False
        self._keep(cid, name)  # new, or resumed by its key (or an admin's, or adopted)
        if subs is None:
            self._save(session)
            return False
        session.qos2_in = set(self.qos2.get(cid, ()))
        if cid in self.restored:
            session.sent_before = self.restored_end
        if old is not None and not old.clean:  # outbound QoS 2 owed PUBCOMP moves along
            session.released = dict.fromkeys(old.released, (0, 0))
        else:  # sent PUBREL again once CONNACK is out (MqttSession._connect)
            session.released = dict.fromkeys(self.pubrel.get(cid, ()), (0, 0))
        session.look_at = 0.0  # the watchdog looks at what it owes
        for topic_filter, qos in subs.items():
            session.subscribe_one(topic_filter, qos, retained=False, restored=True)
        # a filter refused now (the key may no longer read it, a damaged record) leaves the
        # session: its durable group goes too, or it would pile up a backlog nobody reads
        self._end_filters(cid, [f for f in subs if f not in session.subs], wall_ms())
        session.say_refusals(len(subs))
        self._save(session)
        counts = self.broker.take_counts()
        if counts and self.server.prefetcher is not None:
            self.server.prefetcher.request(counts)
        return True

    def ended_at(self, session: MqttSession) -> int:
        """The offset a clean session's CONNACK waits for (0: none): the records that ended
        its client id's persistent session, in ``attach`` just now or earlier and not
        durable yet (the disk refused them and the core appended them again,
        ``Broker.relog``). Session present 0 before they are durable would be undone by a
        crash: the old session, its subscriptions and its backlog would come back."""
        flusher = self.server.flusher
        wal = self.server.wal
        if not session.clean or flusher is None or wal is None:
            return 0
        at = self.broker.state_offset(state.subs_key(session.client_id))
        if not at or flusher.durable(at):
            return 0
        # its subscriptions' record goes with its groups' DELETE records (``_forget``),
        # and ``relog`` appends those again after it: everything appended so far
        return wal.next_offset - 1

    def closed(self, session: MqttSession) -> None:
        """A connection ended (not taken over): its will, and its session offline or gone."""
        if session.taken_over or not session.connected:
            return
        if session.close_reason is not CloseReason.GOODBYE:
            self.publish_will(session)
        cid = session.client_id
        if self.online.get(cid) is session:
            del self.online[cid]
            if session.clean:
                self.owners.pop(cid, None)
        if not session.clean:
            subs = {f: q for f, (_, q) in session.subs.items()}
            since = wall_ms()
            self.offline[cid] = (subs, since)
            self._oldest = min(self._oldest, since)  # the wall clock may have gone back
            self.broker.put_state(state.subs_key(cid), state.stored_subs(subs, since), since)
            self.server.log_touched()

    def changed(self, session: MqttSession) -> int:
        """Its subscriptions changed: saved, for a persistent session. Returns the offset
        the SUBACK must wait for (0: nothing was written)."""
        return 0 if session.clean else self._save(session)

    def _save(self, session: MqttSession) -> int:
        return self.broker.put_state(state.subs_key(session.client_id), session.saved_subs(),
                                     wall_ms())

    # ------------------------------------------------------------------- inbound QoS 2

    def qos2_received(self, session: MqttSession, pid: int) -> int:
        """A QoS 2 PUBLISH was logged: its packet id is remembered until PUBREL. Returns
        the offset the PUBREC must wait for (0: nothing was written)."""
        session.qos2_in.add(pid)
        if session.clean:
            return 0
        self.qos2[session.client_id] = session.qos2_in
        return self._put_block(state.QOS2_BLOCK_PREFIX, session.client_id, session.qos2_in,
                               state.block_of(pid))

    def qos2_released(self, session: MqttSession, pid: int) -> int:
        """PUBREL: the packet id may be used again. Returns the offset the PUBCOMP must
        wait for (0: nothing was written). An id not remembered (a PUBREL sent again)
        waits for the newest record of its block of the session's ids: when the disk
        refused the one that freed it, that is the one written again after it
        (``Broker.relog``), and a restart before it is on disk would bring the id back."""
        if pid not in session.qos2_in:
            if session.clean:
                return 0
            return self.broker.state_offset(
                state.qos2_block_key(session.client_id, state.block_of(pid)))
        return self.qos2_forget(session, pid)

    def qos2_forget(self, session: MqttSession, pid: int) -> int:
        """The packet id is not remembered any more (released, or its PUBLISH was never
        stored: the client sends that again). Returns the offset of the record that says
        so (0: none)."""
        session.qos2_in.discard(pid)
        if session.clean:
            return 0
        # what the session's next connection starts from (``attach``), whichever of its
        # connections remembered the id: not an older connection's set that still holds it
        if session.qos2_in:
            self.qos2[session.client_id] = session.qos2_in
        else:
            self.qos2.pop(session.client_id, None)
        return self._put_block(state.QOS2_BLOCK_PREFIX, session.client_id, session.qos2_in,
                               state.block_of(pid))

    def _put_block(self, prefix: bytes, cid: str, ids: set[int], block: int,
                   wall: int = 0) -> int:
        """Save ``block`` of a client's set of QoS 2 ids (``ids``, saved under ``prefix``):
        a record of a few bytes, however many ids the set holds. Returns its offset."""
        return self.broker.put_state(state.block_key(prefix, cid, block),
                                     state.stored_block(ids, block), wall or wall_ms())

    # ------------------------------------------------------------------ outbound QoS 2

    def outbound_released(self, session: MqttSession, pid: int) -> int:
        """A persistent session's outbound QoS 2 packet id ``pid`` is owed a PUBCOMP (its
        PUBREC came: it is in ``session.released``), or not any more (its PUBCOMP came):
        its block is saved, before the cursor moves on, so a restart sends PUBREL again.
        Returns the record's offset (the PUBREL waits for it)."""
        cid = session.client_id
        ids = self.pubrel.setdefault(cid, set())
        if pid in session.released:
            ids.add(pid)
        else:
            ids.discard(pid)
            if not ids:
                del self.pubrel[cid]
        return self._put_block(state.PUBREL_BLOCK_PREFIX, cid, ids, state.block_of(pid))

    # ----------------------------------------------------------------------------- wills

    def publish_will(self, session: MqttSession) -> None:
        """Publish the session's will (once), with its key's permissions as they are now:
        a reload may have narrowed them since CONNECT checked the will's topic, and a will
        they no longer allow is dropped and counted (``forbidden_will``)."""
        will = session.will
        session.will = None
        if will is None:
            return
        # loaded already: a will comes from an MQTT session (the module is imported only
        # to serve MQTT, so a broker without it never loads it: server/app.py, _listen)
        from blipmq_server.server.hush import EVERY_S, since
        from blipmq_server.server.mqtt import connection_state, not_kept, raw_message

        raw = raw_message(will.topic.encode("utf-8"), will.payload, will.qos, will.retain,
                          session.mark)
        # a bridge's will to its link's state topic (``connection_state``) is published;
        # any other will into the broker's trees ($SYS, $dlq, $share) is refused by the
        # core, as such a publish
        internal = session.bridge and connection_state(will.topic, session.client_id,
                                                       self.broker.limits.max_topic_bytes)
        # a retained will the retained store has no room for is published without retain,
        # its value not kept, as a retained PUBLISH is
        result = self.broker.publish((raw,), now_ms(), wall_ms(), internal=internal,
                                     access=session.access, unkept=True)
        self.server.wake(result.wake)
        self.server.log_touched()
        if result.unkept:
            not_kept(self.server, session.peer, session.client_id, result.unkept_topic,
                     result.unkept, result.unkept_text)
        if result.accepted:
            self.wills += 1
            log.debug("MQTT client %r: will published to %r", session.client_id, will.topic)
        else:
            refusal = result.refusal
            if refusal is not None and refusal.code == ErrorCode.FORBIDDEN:
                self.server.mqtt_error("forbidden_will")
            why = "a full queue" if result.blocked else (refusal.text if refusal else "?")
            # a client that loops connecting and dropping makes one line a minute
            said = self.server.mqtt_hush.due(session.peer, "will_not_published")
            if said is not None:
                log.warning("MQTT client %r from %s: will to %r not published: %s%s; "
                            "further such wills from there are not logged for %d s",
                            session.client_id, session.peer, will.topic[:200], why,
                            since(said), EVERY_S)

    # ---------------------------------------------------------------------------- expiry

    def expire(self, wall: int) -> int:
        """Delete persistent sessions offline for ``mqtt.session_expiry_ms``."""
        limit = self.server.config.mqtt.session_expiry_ms
        if not limit or wall - self._oldest < limit:
            return 0
        gone = [cid for cid, (_, since) in self.offline.items() if wall - since >= limit]
        for cid in gone:
            subs, _ = self.offline.pop(cid)
            self._forget(cid, subs)
            log.info("MQTT session %r expired: offline for %d ms (mqtt.session_expiry_ms)",
                     cid, limit)
        self._oldest = self._oldest_since()
        self.expired += len(gone)
        return len(gone)

    def _oldest_since(self) -> int:
        """When the session offline longest went offline (``_NONE``: none is)."""
        return min((since for _, since in self.offline.values()), default=_NONE)

    def _forget(self, cid: str, subs: dict[str, int]) -> None:
        """A persistent session ends: its durable groups, the durable ``$share`` groups
        nobody else belongs to, and its records go."""
        wall = wall_ms()
        self._end_filters(cid, list(subs), wall)
        blocks = [state.block_key(prefix, cid, block) for prefix, sets in self._sets.items()
                  for block in sorted({state.block_of(pid) for pid in sets.pop(cid, ())})]
        self.owners.pop(cid, None)
        self._unkeep(cid)
        self.restored.discard(cid)  # a new session by that id starts afresh
        for key in (state.subs_key(cid), state.qos2_key(cid), state.pubrel_key(cid),
                    state.owner_key(cid), *blocks):
            self.broker.put_state(key, b"", wall)
        self.server.log_touched()

    def _end_filters(self, cid: str, filters: list[str], wall: int) -> None:
        """These filters leave the persistent session for good: its own durable groups on
        them go; for a ``$share`` filter, what its QoS 2 member had kept goes to the other
        members, and the group goes when nobody else belongs to it."""
        self._drop_groups(cid, [f for f in filters if not f.startswith("$share/")])
        for topic_filter in filters:
            if topic_filter.startswith("$share/"):
                share = state.share_of(topic_filter)
                if share is not None:  # what its QoS 2 member had waits for nobody now
                    self.server.wake(self.broker.release(share[1], share[0],
                                                         state.group_name(cid)))
                self._drop_share(cid, topic_filter, wall)

    def _drop_groups(self, cid: str, filters: list[str]) -> None:
        """The persistent session's own durable groups on these filters (where it has one)
        are deleted, with their backlog."""
        group = state.group_name(cid)
        broker = self.broker
        wall = wall_ms()
        for topic_filter in filters:
            if broker.durable_group(topic_filter, group) is not None:
                broker.unsubscribe(0, 0, topic_filter, group, wall)

    def _drop_share(self, cid: str, topic_filter: str, wall: int) -> None:
        """A ``$share`` filter of a session that ends: its durable group goes too when
        nobody else belongs to it (no subscriber attached, no other MQTT session with that
        share). Kept, it held its backlog, and the log, for good."""
        share = state.share_of(topic_filter)
        if share is None:
            return
        group, core_filter = share
        broker = self.broker
        target = broker.durable_group(core_filter, group)
        if target is None or target.consumers:
            return
        for other, (subs, _) in self.offline.items():
            if other != cid and self._shares(subs, share):
                return
        for other, session in self.online.items():
            if other != cid and self._shares(session.subs, share):
                return
        broker.unsubscribe(0, 0, core_filter, group, wall)
        log.info("MQTT session %r ended: durable group %r on %r, which nobody else "
                 "belonged to, deleted", cid, group, core_filter)

    @staticmethod
    def _shares(subs: dict[str, object], share: tuple[str, str]) -> bool:
        return any(f.startswith("$share/") and state.share_of(f) == share for f in subs)

    def _drop_orphans(self, wall: int) -> None:
        """At start: persistent-session groups (``mqtt.<hash of a client id>``) of no
        session restored go (a session record that was damaged, or an earlier version
        that left a refused filter's group behind): nobody could ever read them."""
        known = {state.group_name(cid) for cid in self.offline}
        broker = self.broker
        gone = [(g.filter, g.group) for g in broker.durable_groups
                if state.is_session_group(g.group) and g.group not in known]
        for topic_filter, group in gone:
            broker.unsubscribe(0, 0, topic_filter, group, wall)
            log.warning("MQTT: durable group %r on %r deleted: it belongs to no persistent "
                        "session", group, topic_filter)

    def stats(self) -> dict[str, int]:
        inflight = sum(len(s.inflight) + len(s.released) for s in self.online.values())
        bridges = sum(s.bridge for s in self.online.values())
        return {"online": len(self.online), "offline": len(self.offline), "inflight": inflight,
                "bridges": bridges, "wills_published": self.wills,
                "sessions_expired": self.expired}


def _check_subs(_key: bytes, value: bytes) -> None:
    """Raise ValueError for a session record of this version that does not parse. One of
    another version is left alone: a newer broker wrote it, and a downgrade must not set
    it aside (``recover`` warns that it is not restored, and maintenance keeps it)."""
    if value[:1] == b"\x01":
        state.parse_subs(value)
