"""The broker process: listeners, the connection nursery, maintenance and shutdown.

Nursery tree (docs/ARCHITECTURE.md)::

    serve (recovers the write-ahead log before listening)
    +-- root nursery: log flusher, metrics HTTP listener
        +-- maintenance: expiry ticker, watchdog (keepalive, write timeouts), retention,
        |                redelivery, prefetcher (stopped before the log closes)
        +-- connections nursery: one task per connection (reader + writer inside)
            +-- accept loop(s)

Shutdown follows hypercorn's order: stop accepting, tell every session to stop intake and
drain its queued deliveries, wait at most ``shutdown_grace_ms``, cancel what is left, stop
maintenance (nothing appends to the log any more), then let the flusher finish the batch it
is writing and write and sync what is left, within ``wal.shutdown_timeout_ms``.

The core names connections and queues by id; ``Server`` turns its results into wake-ups
(``wake``, ``release``, ``detached``), keeps the events of blocked publishers (``room``) and
disconnects slow consumers.
"""

from __future__ import annotations

import errno
import gc
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import trio

from blipmq_server import notify, startup
from blipmq_server.broker.access import FULL, UNLIMITED, Identity, Quota
from blipmq_server.broker.core import BRIDGE_GROUPS, Blocked, Broker, Detached, Ended, Limits
from blipmq_server.broker.durable import DurableGroup
from blipmq_server.broker.queue import Overflow
from blipmq_server.config import Config, check_anonymous, check_tls, tls_listeners
from blipmq_server.counters import ConnectionCounters
from blipmq_server.errors import ConfigError
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.server import heap
from blipmq_server.server.admission import Unproven, host_of
from blipmq_server.server.flusher import TRIM_BATCH_BYTES, Flusher
from blipmq_server.server.hush import Hush
from blipmq_server.server.intake import Intake
from blipmq_server.server.keys import Keyring
from blipmq_server.server.listeners import open_listeners
from blipmq_server.server.prefetch import Prefetcher
from blipmq_server.server.session import CloseReason, Session, now_ms, peer_of, wall_ms
from blipmq_server.server.sessions import MqttSessions
from blipmq_server.wal import policy
from blipmq_server.wal.log import Log, LogOptions, Recovery, Segment

if TYPE_CHECKING:
    from blipmq_server.server.bridge import Bridge
    from blipmq_server.server.tls import Tls

log = logging.getLogger("blipmq")
_DROPS_EVERY_S = 1.0  # how often the queues that dropped messages are looked at
_REDELIVERY_TICK_S = 0.1  # how often deliveries in flight are looked at
_REDELIVERY_DOZE_S = 1.0  # ... and how often with none in flight
_DROPPED_EVERY_S = 60  # dead letters dropped from a group: one line at most this often


class Bound(NamedTuple):
    """What ``serve`` reports once it listens (tests use the ports). A NamedTuple, as
    ``_Listening``: defining one costs a fifth of what a frozen dataclass does, on every
    start."""

    port: int
    metrics_port: int | None
    mqtt_port: int | None = None
    mqtts_port: int | None = None  # MQTT over TLS (mqtt.tls)
    tls_port: int | None = None  # the native protocol over TLS (server.tls)


class _Written:
    """What retention waits on (``Flusher.confirm_later``): the log holds its records, or
    the disk refused them."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = trio.Event()

    def confirmed(self, request_id: int, count: int) -> None:
        self.done.set()

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        self.done.set()


def _settle_heap(imports_set_aside: bool) -> None:
    """What start-up made (modules, recovered state) lives as long as the process: one
    collection (of the imports' objects too, when ``Server.serve`` set them aside), then
    keep what survives out of every later full collection, whose pauses stall every
    connection, and give the freed memory back. Run once the listeners accept: its few ms
    come before the accept loop first runs, not before the kernel accepts connections."""
    if imports_set_aside:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)
    heap.trim()  # what imports, compiling and recovery freed: about 0.7 MB


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        q = config.queues
        w = config.wal
        self.wal: Log | None = None
        self.flusher: Flusher | None = None
        self._shed_trimmed = 0  # ``Budget.shed_bytes`` at the last heap trim it asked for
        self.recovery: Recovery | None = None
        # durable groups whose in-flight deliveries went with the restart (``_open_log``)
        self._lost_at_start: list[tuple[DurableGroup, int]] = []
        if w.enabled:
            options = LogOptions(w.segment_bytes, w.retention_bytes, w.retention_ms,
                                 cache_bytes=w.cache_bytes)
            self.wal = Log(os.path.join(config.storage.data_dir, "wal"), options)
            fsync = policy.parse(w.fsync)
            assert not isinstance(fsync, str)  # the config loader validated it
            self.flusher = Flusher(self.wal, fsync, self._wake_durable, w.unconfirmed_sync_ms,
                                   tailing=lambda: self.broker.tailing(),
                                   acks_due=lambda: self.broker.acks_due(),
                                   on_lost=self._lost, on_restored=self._restored)
        self.broker = Broker(
            Limits(
                capacity=q.capacity,
                capacity_bytes=q.capacity_bytes,
                max_bytes_per_connection=q.max_bytes_per_connection,
                max_bytes_total=q.max_bytes_total,
                overflow=Overflow(q.overflow),
                default_ttl_ms=q.default_ttl_ms,
                max_message_bytes=config.server.max_message_bytes,
                max_topic_bytes=config.server.max_topic_bytes,
                log_qos0=w.include_qos0,
                retry_backoff_ms=config.delivery.retry_backoff_ms,
                retry_backoff_max_ms=config.delivery.retry_backoff_max_ms,
                max_retries=config.delivery.max_retries,
                default_credit=config.delivery.default_credit,
                max_inflight_bytes=config.delivery.max_inflight_bytes,
                max_inflight_bytes_total=config.delivery.max_inflight_bytes_total,
                group_expiry_ms=config.delivery.group_expiry_ms,
                max_idle_groups=q.max_idle_groups,
                max_subscriptions=config.server.max_subscriptions,
                max_durable_groups=q.max_durable_groups,
                read_ahead_bytes=w.read_ahead_bytes,
                retained_max_topics=config.retained.max_topics,
                retained_max_per_connection=config.retained.max_per_connection,
                retained_max_all_connections=config.retained.max_all_connections,
                # carried forward at once, retained values must fit in half a segment
                retained_max_bytes=min(config.retained.max_bytes,
                                       w.segment_bytes // 2 if w.enabled else 1 << 62),
            ),
            log=self.wal,
        )
        limits = self.broker.limits
        # the broker-wide caps a key's default quota is a share of (``access.share``); they
        # change only with a restart, a key's own limits with a reload
        self.caps = Quota(limits.max_durable_groups, config.mqtt.max_sessions,
                          limits.retained_max_topics, limits.retained_max_bytes)
        self.prefetcher = (None if self.wal is None
                           else Prefetcher(self.wal, self.broker, self.wake))
        self.counters = ConnectionCounters(closed={r.value: 0 for r in CloseReason})
        # the TLS listeners' context and handshakes; imported only when a listener serves
        # TLS, so that a broker without it never loads ssl (docs/SECURITY.md)
        self.tls: Tls | None = None
        self.handshaking = 0  # TLS handshakes under way: they count towards max_connections
        # who gives way at max_connections (server/admission.py)
        self.unproven = Unproven(trio.current_time)
        self._evictions = Hush()  # ... and the lines saying so: one per source a minute
        if tls_listeners(config):
            from blipmq_server.server.tls import Tls

            self.tls = Tls(config.tls, self.counters.tls_errors)
        # the frame limit of both directions (announced in WELCOME)
        self.max_frame = codec.frame_limit(config.server.max_message_bytes,
                                           config.delivery.max_batch_bytes)
        self.sessions: dict[int, Session] = {}  # by connection id, the core's name for them
        self.room: dict[int, trio.Event] = {}  # queue id -> set when a blocked queue has room
        self.shutdown = trio.Event()
        self.stopped = trio.Event()  # serve has finished: the log is closed
        self.listening = trio.Event()  # serve listens (and told systemd: READY=1)
        self.started_at = 0.0
        self.published_at = -math.inf  # when a client last published (backlog drains yield)
        self._next_conn_id = 1
        self._routed: set[int] = set()  # connections a reader routed to, not yet sent
        # the redelivery ticker dozes while nothing is in flight (``_redelivery_loop``);
        # a delivery taken then sets ``_flights`` (``flights_began``)
        self.redelivery_dozes = False
        self._flights = trio.Event()
        self.mqtt_sessions = MqttSessions(self)
        # an MQTT packet's limit: the largest message with the longest topic, or a CONNECT
        # with every string at its longest
        self.mqtt_max_packet = max(config.server.max_message_bytes + 0xFFFF + 16,
                                   5 * 0xFFFF + 64)
        # large frames in progress, all connections together: at least one of each kind
        self.intake = Intake(max(config.server.max_reading_bytes, self.max_frame + 4,
                                 self.mqtt_max_packet), self.counters)
        # ... of connections not yet authenticated, apart: peers that never authenticate
        # cannot hold back the large frames of those that did (one frame at a time here)
        self.handshakes = Intake(max(self.max_frame + 4, self.mqtt_max_packet), self.counters)
        self.keys = Keyring(config.auth, caps=self.caps)
        # the MQTT front end's lines about what a client can do at will (protocol errors,
        # QoS 0 publishes dropped, filters refused, QoS 2 ids used again): per source
        # address and kind, one a minute
        self.mqtt_hush = Hush()
        self._drops_hush = Hush()  # "a full queue drops": one line per source a minute
        self.bridges: dict[int, Bridge] = {}  # by the connection id each consumes as

    def authenticate(self, session: Session, given: bytes) -> Identity | None:
        """The identity of the key a session offers (None: refused); the session keeps the
        key's digest, so that a reload can tell whether its key is still there."""
        found = self.keys.check(given)
        if found is None and not given and session.tls_identity:
            # no key, a client certificate the CA vouched for: the key its identity names
            # (tls.client_identity; nats' verify_and_map, mosquitto's
            # use_identity_as_username)
            found = self.keys.named(session.tls_identity)
        if found is None:
            return None
        session.key_digest, identity = found
        session.access = self.keys.access_for(identity)
        return identity

    async def auth_failed(self, session: Session) -> None:
        """A session offered a refused key: counted, logged rarely, answered late."""
        self.counters.auth_failures += 1
        reason = session.protocol
        refused = self.counters.auth_refused
        refused[reason] = refused.get(reason, 0) + 1
        await self.keys.refused(session.peer, reason)

    def reload(self, new: Config) -> list[str]:
        """Apply a new configuration's keys, permissions, log level (and TLS certificates,
        when the TLS listeners can reload) while running; returns what changed, one
        phrase each. A connection whose key is gone is closed; the others keep their
        connections, with their key's new permissions, and the subscriptions those still
        allow (``_recheck``)."""
        old = self.config
        turned_off = old.auth.enabled and not new.auth.enabled
        # the MQTT listeners in force ([mqtt] changes only with a restart) with the new keys
        # and TLS settings: dropping the last key, or tls.require_client_cert, must not
        # open a listener beyond loopback to anyone
        check_anonymous(old._replace(auth=new.auth, tls=new.tls), reloading=True)
        # certificates first: a file that cannot be used raises ConfigError here, before
        # anything changed, and the reload is refused whole
        said: list[str] = [self.reload_tls(new)]
        if new.auth != old.auth:
            keys = Keyring(new.auth, self.keys.hush, self.caps)
            before, after = self.keys.names(), keys.names()
            added = sorted(set(after) - set(before))
            removed = sorted(set(before) - set(after))
            # changed: its permissions, or the limits its entry sets (not a default share,
            # which follows the number of keys)
            own_before = {spec.name: spec.limits for spec in old.auth.keys}
            own_after = {spec.name: spec.limits for spec in new.auth.keys}
            changed = sorted(n for n in set(before) & set(after)
                             if _rights(before[n]) != _rights(after[n])
                             or own_before.get(n) != own_after.get(n))
            self.keys = keys
            revoked = narrowed = 0
            for session in list(self.sessions.values()):
                if not session.authenticated:
                    continue
                identity = keys.find(session.key_digest)
                if identity is None:
                    revoked += 1
                    log.info("connection %d from %s closed: its key was revoked",
                             session.conn_id, session.peer)
                    session.revoke()
                else:
                    # compared whole, not by name: the same key renamed, or moved from
                    # api_keys to a named entry, may have lost permissions too
                    before = None if session.access is None else session.access.identity
                    session.access = keys.access_for(identity)
                    if _rights(identity) != _rights(before):
                        narrowed += self._recheck(session, identity)
            names = ", ".join([*(f"+{n}" for n in added), *(f"-{n}" for n in removed),
                               *(f"~{n}" for n in changed)])
            said.append(f"keys: {len(after)}{f' ({names})' if names else ''}; "
                        f"{revoked} connection(s) closed"
                        + (f", {narrowed} subscription(s) ended" if narrowed else ""))
            if turned_off:
                log.warning("authentication is off: the configuration has no keys any more, "
                            "so every new connection is admitted with full access; the %d "
                            "connection(s) made with a key were closed", revoked)
        if new.log.level != old.log.level:
            logging.getLogger().setLevel(new.log.level.upper())
            logging.getLogger("blipmq").setLevel(new.log.level.upper())
            said.append(f"log level: {old.log.level} -> {new.log.level}")
        rest = [f"[{k}]" for k in sorted(_sections(old)) if getattr(old, k) != getattr(new, k)
                and k not in ("auth", "log", "tls")]
        if new.log.format != old.log.format:  # the handlers are made once, at the start
            rest.append("log.format")
        if rest:
            said.append(f"not applied until a restart: {', '.join(rest)}")
        # what is not applied stays as it is in force, so each later reload names it again
        self.config = old._replace(auth=new.auth, tls=new.tls,
                                   log=new.log._replace(format=old.log.format))
        return [s for s in said if s]

    def _recheck(self, session: Session, identity: Identity) -> int:
        """A session's identity changed (its permissions, or its name): its subscriptions
        the key may no longer make end (one to a filter it may no longer read, or in a
        group it may no longer use: another key's, once it is no admin any more). Native:
        each with ERROR FORBIDDEN. MQTT, which has no word for it: the connection is cut
        off at once (``Session.cut_off``), every subscription of it ending now. Returns
        how many ended."""
        if identity is FULL:  # full access: nothing it subscribed to was ever checked
            return 0
        lost = [(consumer, why) for consumer in self.broker.registry.of(session.conn_id)
                if (why := self._may_not_keep(session, identity, consumer.queue.filter,
                                              consumer.queue.group or ""))]
        if lost and session.protocol == "mqtt":
            # not revoke(): the key stays, and so does the will (published if the key's
            # new permissions allow it)
            session.cut_off(CloseReason.REVOKED)
            return len(lost)
        for consumer, why in lost:
            self.detached(self.broker.unsubscribe(session.conn_id, consumer.sub_id).detached)
            session.error(ErrorCode.FORBIDDEN, f"this key may no longer {why} (the "
                          "configuration was reloaded)", consumer.request_id)
        return len(lost)

    def _may_not_keep(self, session: Session, identity: Identity, topic_filter: str,
                      group: str) -> str:
        """Why a subscription of ``session`` is one its key may no longer make ("read
        'a/#'", "use group 'g' on 'a/#'"), as SUBSCRIBE would refuse it; "" if it may."""
        if not identity.may_subscribe(topic_filter):
            return f"read {topic_filter!r}"
        access = session.access
        if group and access is not None and not self.broker.may_use_group(
                access, topic_filter, group):
            return f"use group {group!r} on {topic_filter!r}"
        return ""

    def mqtt_error(self, reason: str) -> None:
        """An MQTT connection broke the protocol, or a publish of it was dropped: counted."""
        errors = self.counters.mqtt_errors
        errors[reason] = errors.get(reason, 0) + 1

    def mqtt_dropped(self, reason: str) -> None:
        """An MQTT QoS 0 publish was dropped (3.1.1 cannot refuse one): counted."""
        dropped = self.counters.mqtt_dropped
        dropped[reason] = dropped.get(reason, 0) + 1

    def reload_tls(self, new: Config | None = None) -> str:
        """Re-read the certificate files (those ``new.tls`` names, when given) and use them
        for new connections; open ones keep theirs. One line saying what changed ("" when
        no listener serves TLS); a file that cannot be used raises ConfigError and the
        certificates in use stay. Which listeners serve TLS changes only with a restart."""
        if self.tls is None:
            return ""
        if new is None or new.tls == self.tls.options:
            return self.tls.reload()
        check_tls(self.config._replace(tls=new.tls))  # named, and they exist
        return self.tls.reload(new.tls)

    async def serve(
        self, *, task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED
    ) -> None:
        cfg = self.config
        starting = notify.Starting()  # systemd waits for READY=1 as long as this takes
        set_aside = not gc.isenabled()  # `blipmq start` imports with it off (blipmq_cli/main.py)
        if set_aside:
            # The imports' objects all sit in the youngest generation: turned on as they are,
            # the collector's first run would traverse every one of them (~10 ms) before the
            # log is open. Set aside untraversed instead; _settle_heap collects them once.
            gc.freeze()
            gc.enable()
        if self.wal is not None:
            self._open_log()
        self._attach_bridges()
        for group, lost in self._lost_at_start:  # once the bridges count what they drop
            self._size_cap_took(group, lost)
            log.warning("wal retention: the size cap (wal.retention_bytes) had removed %d "
                        "delivery(ies) durable group %r on %r had in flight, not acked, "
                        "before the restart: lost", lost, group.group, group.filter)
        self._lost_at_start = []
        if self.wal is not None:
            # room for a full disk before anything is read: a flood that fills the disk
            # before the first maintenance round would otherwise find none (a write and an
            # fsync only when the file is missing or smaller than it should be)
            await trio.to_thread.run_sync(self.wal.make_reserve)
        groups = await self._listen()
        port, mqtt_port, mqtts_port, tls_port = (
            None if g is None else g.listeners[0].socket.getsockname()[1] for g in groups)
        assert port is not None
        serving = [g for g in groups if g is not None]
        listeners = [listener for g in serving for listener in g.listeners]
        self.started_at = trio.current_time()
        async with trio.open_nursery() as root:
            maintained = trio.Event()
            maintenance: trio.CancelScope = await root.start(self._maintain, maintained)
            if self.flusher is not None:
                root.start_soon(self.flusher.run)
            bridging = trio.CancelScope()
            bridged = trio.Event()
            if self.bridges:
                root.start_soon(self._run_bridges, bridging, bridged)
            else:
                bridged.set()
            metrics_port = None
            if cfg.metrics.enabled:
                from blipmq_server.server.http import serve_http

                metrics_port = await root.start(serve_http, self)
            async with trio.open_nursery() as conns:
                accept_scope = trio.CancelScope()
                conns.start_soon(self._accept_all, serving, conns, accept_scope)
                web = "https" if cfg.metrics.tls else "http"
                log.info(
                    "listening on %s:%d%s%s%s%s; queues: capacity %d, overflow %s; auth %s",
                    cfg.server.host, port,
                    f", metrics on {web}://{cfg.metrics.host}:{metrics_port}/metrics"
                    if metrics_port is not None else "",
                    f", mqtt on {cfg.mqtt.host}:{mqtt_port}" if mqtt_port is not None else "",
                    f", mqtts on {cfg.mqtt.tls_host}:{mqtts_port}" if mqtts_port else "",
                    f", tls on {cfg.server.tls_host}:{tls_port}" if tls_port else "",
                    cfg.queues.capacity, cfg.queues.overflow,
                    f"{len(self.keys.identities)} key(s)" if self.keys.enabled
                    else "disabled (no keys configured)",
                )
                notify.ready(f"listening on {cfg.server.host}:{port}")
                starting.end()
                self.listening.set()
                task_status.started(Bound(port, metrics_port, mqtt_port, mqtts_port, tls_port))
                _settle_heap(set_aside)
                await self.shutdown.wait()
                notify.stopping()
                await self._drain(accept_scope, listeners, conns)
            bridging.cancel()  # links close; their last state goes to the log
            await bridged.wait()
            maintenance.cancel()  # no more expiry, retention, redelivery: nothing appends
            await maintained.wait()
            if self.flusher is not None:
                await self._close_log(self.flusher)
            root.cancel_scope.cancel()
        log.info("stopped")
        self.stopped.set()

    def _orphan_bridge_groups(self) -> None:
        """Say so when the log holds the group of a bridge that is no longer configured: it
        keeps what that bridge never forwarded, and with it the log, until it is deleted."""
        cursors = self.broker.cursors
        if cursors is None:
            return
        for (topic_filter, group), target in cursors.durable.items():
            if group.startswith(BRIDGE_GROUPS) and group not in self.broker.bridged:
                log.warning("group %s on %r belongs to no configured bridge: it holds the "
                            "log from %d record(s) back; delete it with: blipmq unsub %r "
                            "--group %s", group, topic_filter, cursors.lag(target),
                            topic_filter, group)

    def _attach_bridges(self) -> None:
        """Open each bridge's durable group (once the log is recovered, before anyone
        publishes): from here on it holds what the bridge has to forward."""
        self.broker.bridged = frozenset(spec.group for spec in self.config.bridges)
        self._orphan_bridge_groups()
        remembered = [k for k in self.broker.states if k.startswith(b"bridge/")]
        if not self.config.bridges and not remembered:
            return
        from blipmq_server.server.bridge import Bridge, LinkDown, subscriptions_state

        # what the log remembers of bridges no longer configured (or with no kept session)
        kept = {key for key, value in map(subscriptions_state, self.config.bridges) if value}
        for key in remembered:
            if key not in kept:
                self.broker.put_state(key, b"", wall_ms())
        if not self.config.bridges:
            return

        if self.wal is None:
            raise ConfigError("bridges forward from the write-ahead log: wal.enabled must be "
                              "true", "bridge")
        # all made first: a TLS bridge's files are checked before any group is opened
        made: list[Bridge] = []
        for i, spec in enumerate(self.config.bridges):
            made.append(Bridge(self, spec, self._next_conn_id, f"bridge[{i}] ({spec.name})"))
            self._next_conn_id += 1
        for bridge in made:
            spec = bridge.spec
            try:
                bridge.attach()
            except LinkDown as exc:
                raise ConfigError(str(exc), f"bridge {spec.name}") from None
            self.bridges[bridge.conn_id] = bridge
        if not self.config.wal.include_qos0 and any(
                r.sends for spec in self.config.bridges for r in spec.rules):
            log.warning("wal.include_qos0 is false: bridges forward only what the log holds, "
                        "so QoS 0 messages are not bridged out")

    async def _run_bridges(self, scope: trio.CancelScope, done: trio.Event) -> None:
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    for bridge in self.bridges.values():
                        nursery.start_soon(bridge.run)
        finally:
            done.set()

    async def _maintain(
        self, stopped: trio.Event, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        """Run the maintenance loops until shutdown cancels the scope handed back; then set
        ``stopped``."""
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as loops:
                    loops.start_soon(self._expiry_loop)
                    loops.start_soon(self._drops_loop)
                    loops.start_soon(self._watchdog_loop)
                    if self.config.mqtt.enabled or self.mqtt_sessions.offline:
                        loops.start_soon(self._session_expiry_loop)
                    if self.flusher is not None:
                        loops.start_soon(self._retention_loop)
                        loops.start_soon(self._redelivery_loop)
                        # log reads for consumers stop with the rest: a read under way in its
                        # thread finishes before the log closes
                        loops.start_soon(self.prefetcher.run)  # type: ignore[union-attr]
                    task_status.started(scope)
        finally:
            stopped.set()

    async def _close_log(self, flusher: Flusher) -> None:
        """Last step of shutdown, once connections and maintenance have stopped (nothing
        appends any more): the flusher finishes its batch, then writes and syncs the rest."""
        timeout = self.config.wal.shutdown_timeout_ms / 1000
        with trio.CancelScope(shield=True):
            if not await flusher.close(timeout):
                log.error("the write-ahead log is not fully written and synced: the disk "
                          "failed, or wal.shutdown_timeout_ms (%.1f s) passed; %d record(s) "
                          "still pending", timeout, flusher.wal.pending_records)

    def _open_log(self) -> None:
        assert self.wal is not None and self.flusher is not None
        started = time.monotonic()
        self.broker.state_checks.update(self.mqtt_sessions.checks())
        found = self.recovery = self.wal.open(on_record=self.broker.recover,
                                              message_flags=codec.FLAG_RETAIN, bodies=True)
        self._lost_at_start = self.broker.recovered(wall_ms())
        self.mqtt_sessions.recover(wall_ms())
        assert self.prefetcher is not None
        self.prefetcher.request(self.broker.take_counts())  # counted once it runs
        for note in found.notes:
            log.warning("wal recovery: %s", note)
        log.info(
            "wal: %d record(s) in %d segment(s) at %s, recovered in %.2f s; fsync %s",
            found.records, found.segments, self.wal.directory, time.monotonic() - started,
            self.flusher.policy,
        )

    async def _retention_loop(self) -> None:
        """Drop expired durable groups, checkpoint groups, then delete segments past the
        retention limits (once every group's checkpoint is on disk; on a full disk, in the
        room the log's reserve makes, or without it, ``_make_room``)."""
        assert self.wal is not None and self.flusher is not None
        wal, broker = self.wal, self.broker
        reserved = wal.has_reserve()  # room set aside for a full disk (``Log.make_reserve``)
        while True:
            await trio.sleep(self.config.wal.maintenance_interval_ms / 1000)
            wall = wall_ms()
            for group in broker.expire_groups(wall):
                log.warning("durable group %r on %r dropped: no consumer for %d ms "
                            "(delivery.group_expiry_ms)", group.group, group.filter,
                            self.config.delivery.group_expiry_ms)
            newest = wal.segments[-1].base if wal.segments else 0
            broker.checkpoint(wall, newest)
            broker.carry_retained(wall, newest)
            broker.carry_states(wall, newest)
            self.log_touched()
            self.flusher.counters.maintenance_runs += 1
            self.flusher.look()  # files deleted under an idle log: noticed within a round
            for bridge in self.bridges.values():  # every round: a hold must not wait for
                bridge.check_hold()  # the checkpoints below to reach the disk
            # retention needs the checkpoints and carried values just appended on disk:
            # wait for their batch (a group that moves, as a draining bridge's does, has a
            # new checkpoint every round, so looking once would skip retention for good)
            interval = self.config.wal.maintenance_interval_ms / 1000
            anchors = self._anchors()
            if anchors > wal.written_offset:
                await self._written(anchors, trio.current_time() + interval)
            held = False
            try:
                if anchors > wal.written_offset and self.flusher.failing and reserved:
                    # a full disk: without room for these records retention can never
                    # run, and nothing could be written until a restart; the reserve
                    # makes that room, and nothing more is read until retention has run
                    # and the reserve is back (what waits to be written is kept small
                    # meanwhile, ``Flusher.full``; a flood read on would take the room)
                    reserved = False
                    if await trio.to_thread.run_sync(wal.release_reserve):
                        log.warning("the disk refuses writes: released the log's reserve "
                                    "so that retention can make room")
                        self.flusher.hold()
                        held = True
                        await self._copies_written(interval)
                if anchors > wal.written_offset and self.flusher.failing and not held:
                    # no reserve (none could be made, or it was too small): what is past
                    # the cap goes first, so that the copies fit in the room it leaves
                    held = await self._make_room(wall, newest, interval)
                    continue
                if anchors > wal.written_offset:
                    continue  # not on disk yet (the disk refuses writes): retain next time
                await self._retain(wall, newest)
                if not self.flusher.failing:  # made, or grown back to its size, when it can
                    reserved = bool(await trio.to_thread.run_sync(wal.make_reserve))
            finally:
                if held:
                    self.flusher.let_go()

    async def _copies_written(self, interval: float) -> None:
        """Wait, at most ``interval`` seconds, until what retention copied forward (and
        restated since, if the disk refused it) is written."""
        assert self.wal is not None
        deadline = trio.current_time() + interval
        while (anchors := self._anchors()) > self.wal.written_offset and (
                trio.current_time() < deadline):  # restated if refused
            await self._written(anchors, deadline)

    async def _make_room(self, wall: int, carried_from: int, interval: float) -> bool:
        """The disk refuses the copies a maintenance round made of what a restart needs, and
        there is no reserve to release: retention deletes the segments past the size cap
        before they are written (the broker's memory holds them, and they are written
        again with the next batch), then readers wait until they are. A broker that dies
        before that batch loses what only the deleted segments held of its groups and
        retained values; without this, writes stayed refused for good, a restart too.
        Returns whether readers are held (the caller lets them go)."""
        assert self.flusher is not None
        if not await self._retain(wall, carried_from):
            return False  # nothing past the cap: the disk is full of something else
        log.warning("the disk refuses writes and the log has no reserve: retention deleted "
                    "segments past the retention limits before the copies of what a restart "
                    "needs were written (they are written next)")
        self.flusher.hold()
        await self._copies_written(interval)
        return True

    async def _retain(self, wall: int, carried_from: int) -> bool:
        """Retention's part of a maintenance round, once its copies are on disk: segments
        past the limits leave the log (none holding offsets from ``carried_from`` on, where
        the round carried what a restart needs), and what the size cap took from durable
        groups is counted and logged. Returns whether segments left the log."""
        assert self.wal is not None
        wal, broker = self.wal, self.broker
        holds = [b.floor() for b in self.bridges.values() if b.spec.backlog == "block"]
        result = wal.retain(wall, broker.durable_floor(), delete=False,
                            hold_from=min((f for f in holds if f is not None), default=None),
                            carried_from=carried_from)
        if result.paths:  # unlinking big files takes milliseconds: not on the event loop
            try:
                await trio.to_thread.run_sync(wal.delete, result.paths)
            except OSError as exc:  # the segments left the log; their files stay behind
                log.warning("wal retention could not delete a segment file: %s", exc)
        if result.removed:
            log.info("wal retention removed %s", ", ".join(result.removed))
            for bridge in self.bridges.values():  # under the cap again: let go now
                bridge.check_hold()
        if result.forced_below is not None:
            for group, skipped in broker.skip_to(wal.first_offset):
                self._size_cap_took(group, skipped)
                log.warning("wal retention: the size cap (wal.retention_bytes) removed %d "
                            "record(s) durable group %r on %r had not consumed",
                            skipped, group.group, group.filter)
            # their backlogs counted what is gone: counted again from the log's start
            self.prefetcher.request(broker.take_counts())  # type: ignore[union-attr]
        return bool(result.removed)

    def _size_cap_took(self, group: DurableGroup, records: int) -> None:
        """The size cap took ``records`` from ``group`` (counted in its ``skipped``): a
        bridge's group counts them in the bridge's dropped too."""
        for bridge in self.bridges.values():
            if group.group == bridge.spec.group:
                bridge.counters["dropped"] += records

    def _anchors(self) -> int:
        """The newest record a restart needs from what retention's round copied forward
        (group checkpoints, carried retained values and states)."""
        broker = self.broker
        return max(max((g.anchor for g in broker.durable_groups), default=0),
                   broker.retained.newest_anchor(), broker.newest_state())

    async def _written(self, offset: int, deadline: float) -> None:
        """Wait until the log holds ``offset`` or the disk refused it, or ``deadline``."""
        assert self.flusher is not None
        written = _Written()
        self.flusher.confirm_later(offset, written, 0, 0)
        with trio.move_on_at(deadline):
            await written.done.wait()

    def about(self) -> dict:
        """What any key may know of the broker (a restricted STATS report)."""
        from blipmq_server.version import version

        return {"broker": "blipmq", "version": version(), "protocol": codec.VERSION,
                "uptime_s": round(trio.current_time() - self.started_at, 3)}

    def stats(self, most: int) -> dict:
        """The STATS report: the core's snapshot plus what the shell knows (docs/PROTOCOL.md,
        "Statistics"); ``most`` entries of each list at most, with how many each leaves
        out."""
        from blipmq_server.version import version

        report = self.broker.stats(max_topics=min(500, most), max_groups=most)
        bridges = list(self.bridges.values())
        listed = bridges[:most]
        wal = self.wal
        report.update(
            broker="blipmq", version=version(), protocol=codec.VERSION,
            uptime_s=round(trio.current_time() - self.started_at, 3),
            connections=self.counters.open,
            mqtt=dict(self.mqtt_sessions.stats(),
                      protocol_errors=dict(self.counters.mqtt_errors),
                      qos0_dropped=dict(self.counters.mqtt_dropped)),
            bridges=[b.status() for b in listed],
            bridges_omitted=len(bridges) - len(listed),
            log=None if wal is None else {
                "bytes": wal.total_bytes, "segments": len(wal.segments),
                "first_offset": wal.first_offset, "next_offset": wal.next_offset},
        )
        return report

    def _wake_durable(self) -> None:
        self.wake(self.broker.cursor_conns())

    def _lost(self, first: int, last: int) -> None:
        """The disk refused the records ``first``..``last``: the core restates what they
        said of its state, and cursor consumers look again (one waiting for the end of the
        log may have it now: those offsets are never stored)."""
        self.broker.relog(first, last, wall_ms())
        self._wake_durable()

    def _restored(self, gone: list[Segment]) -> None:
        """Segment files deleted under the broker, which could not be written back, left
        the log: durable groups that had not read them skip them (counted, as what the size
        cap takes), and what a restart needs that they held (groups' checkpoints, retained
        values, sessions' states) is written again."""
        assert self.wal is not None
        wal, broker = self.wal, self.broker
        for group, skipped in broker.skip_to(wal.first_offset):
            self._size_cap_took(group, skipped)
            log.warning("wal: the deleted segment files held %d record(s) durable group %r "
                        "on %r had not consumed", skipped, group.group, group.filter)
        self.prefetcher.request(broker.take_counts())  # type: ignore[union-attr]
        below = max(seg.last if seg.count else seg.base for seg in gone) + 1
        wall = wall_ms()
        broker.checkpoint(wall, below)
        broker.carry_retained(wall, below)
        broker.carry_states(wall, below)
        self.log_touched()

    # ------------------------------------------------------- wake-ups the core asks for

    def wake(self, conns: set[int] | frozenset[int]) -> None:
        """These connections have deliveries to take."""
        sessions = self.sessions
        for conn in conns:
            session = sessions.get(conn)
            if session is not None:
                session.wake()
            elif conn in self.bridges:
                self.bridges[conn].wake()

    def flights_began(self) -> None:
        """Deliveries were taken (or nacked with a delay) while the redelivery ticker
        dozes: if any can now come due, or a connection waits for room under
        ``delivery.max_inflight_bytes_total`` (woken by a tick), it ticks again (callers
        test ``redelivery_dozes`` first, a field read)."""
        cursors = self.broker.cursors
        if cursors is not None and (cursors.flying or cursors.unacked.starved):
            self.redelivery_dozes = False
            self._flights.set()

    def routed(self, conns: set[int] | frozenset[int]) -> None:
        """A reader routed messages to these connections: ``deliver_routed`` sends them."""
        if conns:
            self._routed |= conns

    def deliver_routed(self, now: float) -> None:
        """Send what readers routed since the last call (see ``Session.deliver_now``);
        ``now``: trio's time, the caller's reading of it.
        Readers call this before they wait or yield: after each chunk read, so a busy
        publisher's frames go out in batches, one write per subscriber and chunk."""
        if not self._routed:
            return
        conns = self._routed
        self._routed = set()
        sessions = self.sessions
        for conn in conns:
            session = sessions.get(conn)
            if session is not None:
                session.deliver_now(now)

    def release(self, queues: tuple[int, ...]) -> None:
        """Publishers blocked on these queues may try again (room, or a consumer fewer)."""
        room = self.room
        for queue in queues:
            event = room.pop(queue, None)
            if event is not None:
                event.set()

    def detached(self, detached: Detached) -> None:
        self.release(detached.released)
        self.wake(detached.wake)
        cursors = self.broker.cursors
        if cursors is not None and self.flusher is not None:
            # glibc keeps what cursors let go of (read-aheads, topics): after 1,000 replays
            # of 1 KB topics left, the broker stayed at 110 MB (29 at start); 36 trimmed
            shed = cursors.budget.shed_bytes
            if shed - self._shed_trimmed >= TRIM_BATCH_BYTES:
                self._shed_trimmed = shed
                self.flusher.trim_soon()

    def notify_ended(self, ended: Ended) -> None:
        session = self.sessions.get(ended.conn)
        if session is not None:
            session.error(ErrorCode.GROUP_DELETED, f"{ended.name} was deleted", ended.request_id)

    def log_touched(self) -> None:
        """Something may have appended to the log: let the flusher look."""
        if self.flusher is not None and self.wal is not None and self.wal.pending_records:
            self.flusher.appended()

    async def wait_for_room(self, blocked: Blocked) -> None:
        """A publisher waits for a full ``block`` queue. Its consumers are slow consumers
        if it stays full for ``queues.block_timeout_ms``: they are disconnected, and the
        queue stops holding publishers back (it goes, or drops its oldest without them)."""
        event = self.room.get(blocked.queue)
        if event is None:
            event = self.room[blocked.queue] = trio.Event()
        self.deliver_routed(trio.current_time())  # now: what it takes sets the event
        timeout_ms = self.config.queues.block_timeout_ms
        with trio.move_on_after(timeout_ms / 1000 if timeout_ms else math.inf) as waited:
            await event.wait()
        if waited.cancelled_caught:
            why = (f"{blocked.name} stayed full for {timeout_ms} ms while publishers waited "
                   "(queues.block_timeout_ms)")
            for conn in blocked.conns:
                session = self.sessions.get(conn)
                if session is not None:
                    self.slow_consumer(session, why)

    def slow_consumer(self, session: Session, why: str) -> None:
        """Disconnect a consumer that does not keep up: its subscriptions end now."""
        if session.aborted:  # once: the watchdog may see it again before it is gone
            return
        log.warning("connection %d from %s closed as a slow consumer: %s",
                    session.conn_id, session.peer, why)
        session.abort(CloseReason.SLOW_CONSUMER)
        self.detached(self.broker.disconnect(session.conn_id, wall_ms()))
        self.log_touched()

    async def _redelivery_loop(self) -> None:
        """Unacked QoS 1 deliveries past their deadline go back to their group. Dead letters
        dropped by a group that gave up on them (here or by a nack) are said: the first at
        once, the next summed up at most once every ``_DROPPED_EVERY_S`` seconds (a
        ``$dlq/#`` reader that never acks drops every dead letter)."""
        assert self.flusher is not None and self.wal is not None
        counters, cursors = self.broker.counters, self.broker.cursors
        said, said_at = 0, -math.inf  # dead letters dropped by the last line, and when
        while True:
            if cursors is None or cursors.flying or cursors.unacked.starved:
                await trio.sleep(_REDELIVERY_TICK_S)
            else:
                # nothing in flight that can come due (deadlines, delayed NACKs; a patient
                # consumer's deliveries never do) and no connection waiting for room past
                # delivery.max_inflight_bytes_total: nothing to do before a delivery is
                # taken or refused, which wakes this (``flights_began``). An idle broker
                # woke ten times a second here, most of its idle CPU; now once, for the
                # core's safety net (``Broker.redeliver`` rouses dozing consumers every
                # second)
                self._flights = trio.Event()
                self.redelivery_dozes = True
                with trio.move_on_after(_REDELIVERY_DOZE_S):
                    await self._flights.wait()
                self.redelivery_dozes = False
            self.wake(self.broker.redeliver(now_ms(), wall_ms()))
            self.log_touched()  # dead letters are new messages
            dropped, now = counters.dead_letters_dropped, trio.current_time()
            if dropped > said and now - said_at >= _DROPPED_EVERY_S and cursors is not None:
                topic, topic_filter, group = cursors.last_dropped or ("", "", "")
                reader = (f"group {group!r} on {topic_filter!r}" if group
                          else f"a subscription on {topic_filter!r}")
                log.warning("%d dead letter(s) dropped by the reader that gave up on them, "
                            "not dead-lettered again (the last: %r, by %s, after "
                            "delivery.max_retries deliveries or given up); they stay in the log "
                            "(blipmq_messages_dead_letters_dropped_total; said at most once "
                            "every %d s)", dropped - said, topic, reader, _DROPPED_EVERY_S)
                said, said_at = dropped, now

    async def _drain(
        self,
        accept_scope: trio.CancelScope,
        listeners: list[trio.SocketListener],
        conns: trio.Nursery,
    ) -> None:
        grace = self.config.server.shutdown_grace_ms / 1000
        log.info("shutting down: draining %d connection(s), up to %.1f s",
                 len(self.sessions), grace)
        accept_scope.cancel()
        for listener in listeners:
            await listener.aclose()
        for session in list(self.sessions.values()):
            session.stop_reading(CloseReason.SHUTDOWN)
        self.release(tuple(self.room))  # blocked publishers: their readers are cancelled anyway
        conns.cancel_scope.deadline = trio.current_time() + grace

    async def _listen(self) -> list[_Listening | None]:
        """Open the listeners: native, MQTT, MQTT over TLS, native over TLS (None: off).
        If one cannot bind, those opened before it are closed again."""
        cfg = self.config
        if cfg.mqtt.enabled:  # the MQTT front end is imported only to serve MQTT
            from blipmq_server.server.mqtt import MqttSession
        wanted = [(cfg.server.host, cfg.server.port, "client listener", Session, False),
                  (cfg.mqtt.host, cfg.mqtt.port, "MQTT listener", MqttSession, False)
                  if cfg.mqtt.enabled else None,
                  (cfg.mqtt.tls_host, cfg.mqtt.tls_port, "MQTT TLS listener", MqttSession, True)
                  if cfg.mqtt.enabled and cfg.mqtt.tls else None,
                  (cfg.server.tls_host, cfg.server.tls_port, "client TLS listener", Session,
                   True) if cfg.server.tls else None]
        opened: list[_Listening | None] = []
        try:
            for want in wanted:
                if want is None:
                    opened.append(None)
                    continue
                host, port, what, kind, secure = want
                opened.append(_Listening(await open_listeners(host, port, what), kind, secure))
        except OSError:
            for group in opened:
                for listener in group.listeners if group is not None else ():
                    await listener.aclose()
            raise
        return opened

    async def _accept_all(
        self, groups: list[_Listening], conns: trio.Nursery, scope: trio.CancelScope,
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for group in groups:
                    for listener in group.listeners:
                        nursery.start_soon(self._accept, listener, conns, group.kind,
                                           group.secure)

    async def _accept(self, listener: trio.SocketListener, conns: trio.Nursery,
                      kind: type[Session], secure: bool = False) -> None:
        failing = False
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                # the shutdown closed the listener after epoll woke this task for a
                # connection: that one is refused with the rest of the backlog
                return
            except OSError as exc:
                if exc.errno not in _OVERLOADED:
                    raise
                if not failing:  # out of descriptors or memory: back off, keep serving
                    log.warning("accept failed: %s; retrying every 0.1 s", exc.strerror or exc)
                failing = True
                await trio.sleep(0.1)
                continue
            if failing:
                log.info("accepting connections again")
                failing = False
            _keepalive(stream, self.config.server.keepalive_ms)
            conns.start_soon(self._connection, stream, kind, secure)

    async def _refuse(self, stream: trio.SocketStream, kind: type[Session], secure: bool
                      ) -> None:
        """At ``max_connections`` with nobody to give way: refused (CONNACK 3 / ERROR
        TOO_MANY_CONNECTIONS over plain TCP; a TLS client is only closed)."""
        self.counters.refused += 1
        limit = self.config.server.max_connections
        refusal = (_CONNACK_UNAVAILABLE if kind.protocol == "mqtt" else codec.encode(
            codec.Error(ErrorCode.TOO_MANY_CONNECTIONS,
                        f"the broker is at max_connections ({limit})")))
        # a TLS client would read the plain refusal as a broken handshake: closed only
        with trio.move_on_after(0 if secure else 1):
            try:
                await stream.send_all(refusal)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(stream)

    def _gave_way(self, source: str) -> None:
        self.counters.evicted += 1
        said = self._evictions.due(f"{source}:", "evicted")
        if said is not None:
            where, unsaid = said
            log.warning("at max_connections (%d): closed a connection from %s that had not "
                        "authenticated yet, to make room%s", self.config.server.max_connections,
                        where, f" ({unsaid} more since the last line)" if unsaid else "")

    async def _connection(self, stream: trio.SocketStream, kind: type[Session],
                          secure: bool = False) -> None:
        self.counters.accepted += 1
        if len(self.sessions) + self.handshaking >= self.config.server.max_connections:
            if (source := self.unproven.evict()) is not None:  # a flood gives way first
                self._gave_way(source)
            else:
                await self._refuse(stream, kind, secure)
                return
        tls = identity = None
        if secure:
            assert self.tls is not None
            self.handshaking += 1
            accepted = None
            with trio.CancelScope() as shaking:
                self.unproven.add(shaking, host_of(peer_of(stream)), shaking.cancel, _never)
                try:
                    accepted = await self.tls.accept(
                        stream, self.config.server.handshake_timeout_ms / 1000)
                finally:
                    self.handshaking -= 1
                    self.unproven.discard(shaking)
            if accepted is None or self.shutdown.is_set():
                await trio.aclose_forcefully(stream)
                return
            tls, identity = accepted
        session = kind(self, stream, self._next_conn_id, tls, identity)
        self._next_conn_id += 1
        self.sessions[session.conn_id] = session
        self.counters.open += 1
        self.unproven.add(session, host_of(session.peer),
                          lambda: session.abort(CloseReason.EVICTED),
                          lambda: session.authenticated or session.closing)
        try:
            await session.run()
        except Exception:  # a bug in one connection must not end the others
            log.exception("connection %d from %s failed", session.conn_id, session.peer)
        finally:
            del self.sessions[session.conn_id]
            self.unproven.discard(session)
            self.intake.give_back(session.conn_id)
            self.handshakes.give_back(session.conn_id)
            self.counters.open -= 1
            reason = session.close_reason.value if session.close_reason else "cancelled"
            closed = self.counters.closed
            closed[reason] = closed.get(reason, 0) + 1

    async def _watchdog_loop(self) -> None:
        """Connections that stopped taking what is sent to them, or went silent.

        One look at every connection each tenth of the shortest timeout (at most every
        second) costs less than a deadline around every send and every receive: a
        connection stuck in a send longer than ``server.write_timeout_ms`` is a slow
        consumer; one that sent nothing for ``server.keepalive_ms`` gets a PING, and if
        nothing comes for as long again, GOODBYE ``TIMEOUT``.
        """
        cfg = self.config.server
        write_timeout = cfg.write_timeout_ms / 1000
        idle = cfg.keepalive_ms / 1000
        # MQTT connections name their own keepalive: looked at every second
        limits = [t for t in (write_timeout, idle, 10.0 if self.config.mqtt.enabled else 0) if t]
        if not limits:
            await trio.sleep_forever()
        tick = min(1.0, max(0.01, min(limits) / 10))
        while True:
            await trio.sleep(tick)
            now = trio.current_time()
            for session in list(self.sessions.values()):
                since = session.sending_since
                if write_timeout and since is not None and now - since > write_timeout:
                    self.slow_consumer(session, f"its socket took nothing for "
                                       f"{write_timeout:g} s (server.write_timeout_ms)")
                elif session.look_at <= now and session.authenticated and not (
                        session.closing or session.paused):
                    # (one look at each of 1,000 idle connections every second cost 0.7 ms)
                    try:
                        session.look_at = session.idle_check(now, idle)
                    except Exception:  # a defect there costs that connection, not the broker
                        log.exception("connection %d: its idle check failed: closing it",
                                      session.conn_id)
                        session.abort(CloseReason.PROTOCOL_ERROR)

    async def _session_expiry_loop(self) -> None:
        """Persistent MQTT sessions offline for ``mqtt.session_expiry_ms`` are deleted."""
        while True:
            await trio.sleep(1)
            self.mqtt_sessions.expire(wall_ms())

    async def _drops_loop(self) -> None:
        """Say when a subscription's full queue starts dropping messages (its policy is
        drop_oldest or drop_new; counted in ``blipmq_messages_dropped_total``): one line
        per episode (it dropped within a second after a second without), at most one a
        minute per source address."""
        before: set[int] = set()
        while True:
            await trio.sleep(_DROPS_EVERY_S)
            now: set[int] = set()
            for queue in self.broker.take_dropping():
                now.add(queue.id)
                if queue.id in before or queue.group is not None or not queue.consumers:
                    continue
                session = self.sessions.get(queue.consumers[0].conn)
                if session is None:
                    continue
                said = self._drops_hush.due(session.peer, "drops")
                if said is None:
                    continue
                client = getattr(session, "client_id", "")
                setting = "mqtt.qos0_overflow" if client else "queues.overflow"
                log.warning(
                    "%s from %s does not keep up: its %s is full and drops messages "
                    "(%s, %s; %d dropped so far, blipmq_messages_dropped_total)%s",
                    f"MQTT client {client!r}" if client else f"connection {session.conn_id}",
                    said[0], queue.name, queue.overflow, setting,
                    queue.dropped_oldest + queue.dropped_new,
                    f"; {said[1]} more such episode(s) not logged" if said[1] else "")
            before = now

    async def _expiry_loop(self) -> None:
        interval = self.config.queues.expiry_interval_ms / 1000
        if not interval:
            await trio.sleep_forever()
        while True:
            await trio.sleep(interval)
            removed = self.broker.tick(now_ms())
            if removed:
                log.debug("expired %d message(s)", removed)


def _sections(config: Config) -> tuple[str, ...]:
    return config._fields


def _rights(identity: Identity | None) -> Identity | None:
    """An identity's permissions and name, without its quota (what a subscription it holds
    depends on)."""
    return None if identity is None else identity._replace(quota=UNLIMITED)


async def _reload(server: Server, reload: Callable[[], Config] | None,
                  one_at_a_time: trio.Lock, threads: trio.CapacityLimiter) -> None:
    """SIGHUP: the configuration again; a bad one is refused and the old one stays. The
    file is read in a worker thread, so a slow or hung filesystem holds the reload (for
    ``_RELOAD_READ_S`` at most), never the broker."""
    if reload is None:
        log.warning("received SIGHUP: nothing to reload (the broker was not started from "
                    "`blipmq start`)")
        return
    await server.listening.wait()  # a SIGHUP during start-up: once the broker listens
    async with one_at_a_time:  # in the order of the signals, each one's notes around it
        if server.shutdown.is_set():  # stopping: no reload, and no READY after STOPPING
            log.info("received SIGHUP while shutting down: not reloaded")
            return
        notify.reloading()
        try:
            await _reload_now(server, reload, threads)
        finally:
            if not server.shutdown.is_set():
                notify.ready()


async def _reload_now(server: Server, reload: Callable[[], Config],
                      threads: trio.CapacityLimiter) -> None:
    try:
        new = None
        with trio.move_on_after(_RELOAD_READ_S):
            # a limiter of its own: a read that hangs for good (a dead NFS mount) keeps its
            # thread, but never one of the tokens the log's writes and reads take (with
            # _HUNG_READS hung, the next reload waits its 10 s and is refused)
            new = await trio.to_thread.run_sync(reload, abandon_on_cancel=True,
                                                limiter=threads)
        if new is None:
            raise ConfigError(f"reading the configuration took over {_RELOAD_READ_S:g} s")
        said = server.reload(new)
    except (ConfigError, OSError) as exc:
        log.error("reload refused, the configuration in force is unchanged: %s", exc)
        return
    except Exception:  # a defect: SIGHUP still never stops the broker (docs/SECURITY.md)
        log.exception("reload failed (a defect of the broker; please report it): what it "
                      "had applied before the failure stays")
        return
    log.info("reloaded: %s", "; ".join(said) or "nothing changed")


_RELOAD_READ_S = 10.0
_HUNG_READS = 4  # reads of the configuration that may hang at once (each keeps a thread)


class _Listening(NamedTuple):
    """The listeners of one address and what they serve."""

    listeners: list[trio.SocketListener]
    kind: type[Session]
    secure: bool  # TLS first


_SWITCH_INTERVAL_S = 0.0001
_CONNACK_UNAVAILABLE = b"\x20\x02\x00\x03"  # MQTT CONNACK 3: server unavailable
# Young collections after 20,000 allocations instead of 700: short-lived objects (records,
# deliveries, frames) die before a collection promotes them, so older generations stay small
_GC_THRESHOLDS = (20_000, 10, 10)

# accept errors that mean "overloaded for now" (trio's serve_listeners retries the same)
_OVERLOADED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def _never() -> bool:
    return False


def _keepalive(stream: trio.SocketStream, keepalive_ms: int) -> None:
    """TCP keepalive, so a peer that vanished without a FIN is noticed by the kernel too."""
    if not keepalive_ms:
        return
    idle = max(1, keepalive_ms // 1000)
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 3))
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass  # the connection is already gone; its session notices


async def run(config: Config, reload: Callable[[], Config] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; a second signal ends the process at once. SIGHUP reads
    the configuration again (``reload``) and applies what can change while running.

    SIGINT or SIGTERM again within ``SAME_SIGNAL_S`` is one signal delivered twice, not a
    second one: a signal to the process group of the onefile executable reaches the broker
    directly and once more forwarded by the bootloader parent (docs/OPERATIONS.md). SIGHUP
    is never dropped: a second reload reads the same files again and changes nothing, where
    a dropped one could miss an edit made between the two."""
    # Worker threads (log writes, log reads for consumers) decode and copy with the GIL
    # held; the event loop gets it back within this long instead of the default 5 ms
    # (0.1 ms: unrelated traffic's p99 during a backlog drain fell about 0.7 ms against
    # 0.5 ms, with no throughput change measurable in bench/run.py or bench/durability.py).
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    server = Server(config)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            # what came before this receiver was open (blipmq_server/startup.py) first
            nursery.start_soon(_watch_signals, signals, server, reload, nursery,
                               startup.take())
            await server.serve()
            nursery.cancel_scope.cancel()


# Long enough for the bootloader's forwarded copy to arrive even on a busy Pi, short enough
# that a person pressing Ctrl-C again because shutdown is slow is heard.
SAME_SIGNAL_S = 0.5


async def _watch_signals(signals: AsyncIterator[int], server: Server,
                         reload: Callable[[], Config] | None, nursery: trio.Nursery,
                         held: Sequence[int] = ()) -> None:
    """Act on each signal: ``held`` ones (they came during start-up) first."""
    last: dict[int, float] = {}  # SIGINT/SIGTERM -> when it was acted on (trio's clock)
    one_at_a_time = trio.Lock()  # reloads in the order of their signals
    threads = trio.CapacityLimiter(_HUNG_READS)  # the reloads' reads of the file

    def act(signum: int, early: bool = False) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:  # in its own task: a signal during it is heard at once
            if early:
                log.info("received SIGHUP during start-up: reloading once listening")
            nursery.start_soon(_reload, server, reload, one_at_a_time, threads)
            return
        now = trio.current_time()
        if now - last.get(signum, -math.inf) < SAME_SIGNAL_S:
            return  # the same delivery again (the group's and the forwarded one)
        last[signum] = now
        if server.shutdown.is_set():
            log.warning("second %s: exiting at once", name)
            logging.shutdown()
            os._exit(128 + signum)
        log.info("received %s%s", name, " during start-up" if early else "")
        server.shutdown.set()

    for signum in held:
        act(signum, early=True)
    async for signum in signals:
        act(signum)
