"""A bridge to an upstream MQTT broker: store and forward from the log (docs/BRIDGE.md).

``out`` rules are one durable group, ``bridge.<name>``, over their local filters: the
upstream broker is its consumer. A delivery leaves the group's bookkeeping only when the
upstream PUBACKs it (QoS 1 rules), PUBCOMPs it (QoS 2) or once it is written to the socket
(QoS 0 rules: best effort). While the link is down the group holds everything in the log;
when the link drops, what was in flight goes back to the group without spending a retry and
is sent again, with DUP, first thing after the reconnect. QoS 2 exchanges outlive the link
instead (the upstream session is persistent): when the next CONNACK says the session is
still there, what had its PUBREC gets its PUBREL again and the rest go out again under
their old packet ids, so the upstream delivers each once; when it says not, they go back to
the group as QoS 1's do. ``in`` rules are a persistent upstream session (clean session 0)
whose messages are written to the local log and PUBACKed (QoS 2: PUBRECed, the packet id
remembered until PUBREL) once durable.

One task per bridge owns its link: connect (with failover across the addresses and
decorrelated-jitter backoff; up once the upstream answers the PINGREQ sent after its
CONNACK; a link the upstream ends within the keepalive of coming up is a failed attempt
on its address too), then a reader and a writer (the only one that writes the socket). A link
silent for 1.5 x the keepalive, or whose oldest PUBLISH waited as long for its PUBACK, is
dropped and made again.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import struct
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import trio

from blipmq_server.bridge.plan import Backoff, brief, imports, inbound_rule
from blipmq_server.bridge.spec import BridgeSpec, Rule
from blipmq_server.broker.core import OWES
from blipmq_server.broker.results import Refusal
from blipmq_server.errors import LocalProtocolError, RemoteProtocolError, WalError
from blipmq_server.mqtt import codec as mqtt
from blipmq_server.mqtt.packets import (
    ConnAck,
    Connect,
    Disconnect,
    OversizePublish,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Will,
    free_packet_id,
)
from blipmq_server.protocol.codec import ErrorCode, Start
from blipmq_server.protocol.message import (
    FLAG_BRIDGED,
    FLAG_QOS2,
    FLAG_RETAIN,
    MSG_HEAD,
    PREFIX_SIZE,
    Message,
    RawMessage,
    message_record,
)
from blipmq_server.server.hush import EVERY_S, Hush, since
from blipmq_server.server.session import now_ms, wall_ms

if TYPE_CHECKING:
    import ssl

    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.bridge")
_HEAD = struct.Struct(">QHQBBIHHI")  # a delivery record's prefix and message head together
_BODY = PREFIX_SIZE + MSG_HEAD.size
_PID = struct.Struct(">H")
_QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)
_RELEASE_CHUNK = 8192  # PUBRELs (32 KiB) sent before their PUBCOMPs are read (``_release``)
_MAX_HEADS = 4096  # PUBLISH heads a link keeps per rule (``_Link._encode``)
_MAX_BATCH = 256
_MAX_BATCH_BYTES = 1 << 20
_UNSTORED_EVERY_S = 60  # while messages coming in cannot be stored: one line at most this often
_STORED_AGAIN_S = 2  # ... until they are stored again for this long without a refusal
_UNSTORED = "a message from the upstream could not be stored"  # why such a link ends
# While linked to another address than the first, the first is tried (a TCP connect) this
# often; each failback that then fails doubles it, up to _PRIMARY_PROBE_MAX_S: an address
# that takes TCP but never completes a link costs a short gap ever more rarely
_PRIMARY_PROBE_S = 5.0
_PRIMARY_PROBE_MAX_S = 3600.0
_PRIMARY_BACK = "the first address answers again: going back to it"  # why such a link ends


def subscriptions_state(spec: BridgeSpec) -> tuple[bytes, bytes]:
    """The STATE key, and the value's part after the upstream's address line, saying which
    in rules' subscriptions the upstream session of a persistent bridge holds: its client
    id and each remote filter with its QoS (empty: nothing to remember, a clean session or
    no in rules)."""
    key = b"bridge/" + spec.name.encode() + b"\0subscribed"
    filters = [f"{r.remote_filter}\t{r.qos}" for r in spec.rules if r.receives]
    if not filters or not spec.persistent:
        return key, b""
    return key, "\n".join([spec.mqtt_client_id, *filters]).encode()


class LinkDown(Exception):
    """The link ended; the text says why (for the log and ``blipmq bridges``)."""


class NotPrivate(LinkDown):
    """The upstream refused a bridge's CONNECT (level 0x84): ask again with plain 3.1.1."""


class Bridge:
    def __init__(self, server: Server, spec: BridgeSpec, conn_id: int, where: str = "") -> None:
        """``where`` names the bridge's table in a ConfigError (``bridge[0] (cloud)``): a
        TLS bridge's context is built here, from its files as they are at start."""
        self.server = server
        self.spec = spec
        self.conn_id = conn_id
        self.broker = server.broker
        self.rules_by_sub: dict[int, Rule] = {}
        self.qos2_subs: set[int] = set()  # out rules at QoS 2: done on PUBCOMP, not PUBACK
        # what was in flight when this broker stopped is not known (memory only), but it was
        # at most a window of the messages logged before the start: the first ``inflight``
        # of those sent after it go with DUP ("might be re-delivery", MQTT 3.1.1 3.3.1.1)
        self.restored_end = server.wal.next_offset if server.wal is not None else 0
        self.maybe_sent = spec.inflight
        # nor is what a kept upstream session holds of the QoS 2 messages sent before the
        # start, PUBRECed and not released: taking from the upstream's window of unreleased
        # messages, those could hold it full past this window. The first link that finds
        # the session kept releases them before it sends anything (``_Link._release``).
        # The ids still to release: None until that link works them out, empty once done
        # (or when nothing can be held: no QoS 2 out rule, or a clean session)
        self.stale: set[int] | None = None if spec.sends_qos2 and spec.persistent else set()
        self.connected = False
        self.address = ""  # the upstream in use (host:port)
        self.last_error = ""
        self.counters = {"forwarded": 0, "redelivered": 0, "reconnects": 0, "refused": 0,
                         "dropped": 0, "received": 0, "dead_lettered": 0, "skipped": 0,
                         "connect_failures": 0, "duplicates_in": 0, "unexpected_acks": 0,
                         "superseded": 0}
        self._superseded_said = False  # the first superseded retained value was logged
        self._hush = Hush()  # lines about messages from the upstream not stored
        self.oldest_ms: int | None = None  # timestamp of the oldest record not forwarded
        self._kick = trio.Event()
        self._link: _Link | None = None
        self._strikes: dict[int, int] = {}  # offset -> links that died with it unanswered
        self._ssl: ssl.SSLContext | None = None
        if spec.tls:
            from blipmq_server.server.tls import client_context  # ssl: only with TLS

            self._ssl = client_context(spec, where or f"bridge {spec.name}")
        self.private = spec.try_private  # CONNECT as a bridge (level 0x84)
        # the upstream (address) whose session holds the in rules' subscriptions as they
        # are, "" when none is known to: from the log at a start (``subscriptions_held``),
        # so a restart does not subscribe again to a kept session, which would bring every
        # retained value in again, older than ours; another upstream (failover) or a link
        # lost before the SUBACK gets the SUBSCRIBE again
        self.subs_key, self.subs_value = subscriptions_state(spec)
        stored = self.broker.states.get(self.subs_key, b"")
        where, _, held = stored.partition(b"\n")
        self.held_at = where.decode() if self.subs_value and held == self.subs_value else ""
        self._retry_plain = False
        # (rule's sub id, local topic) -> the upstream's topic, UTF-8 (bounded)
        self.remotes: dict[tuple[int, bytes], bytes] = {}
        # out at QoS 2, between links (each bounded by the window): packet id -> (sub id,
        # offset) of those PUBRECed, PUBCOMP owed (still in flight in the group); (sub id,
        # offset) -> packet id of those not PUBRECed, back in the group, to go out again
        # under that id; and those ids, which no other message may take meanwhile
        self.owed: dict[int, tuple[int, int]] = {}
        self.resend: dict[tuple[int, int], int] = {}
        self.reserved: set[int] = set()
        # in at QoS 2: the upstream's packet id -> 0 once its message is durable here, else
        # the flusher token its PUBREC waits for (bounded by the 65,535 ids); token -> id
        self.qos2_in: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._token = 0
        # messages coming in that the local log could not store (a full disk refuses each
        # of them on every link): when the last line said so (None: they are stored again),
        # how many more were not, and links dropped for them, since that line; when the
        # last was refused and why; whether one was stored since
        self._unstored_said: float | None = None
        self._unstored = 0
        self._unstored_links = 0
        self._unstored_at = 0.0
        self._unstored_why = ""
        self._stored_after = False
        self._quiet = False  # the last link ended so: the next connect is not logged as news
        self._probe_s = _PRIMARY_PROBE_S  # how often the first address is tried (failback)
        self._up_at = 0.0  # when the last link came up (trio's clock)

    # ------------------------------------------------------------------ the core's side

    def subscriptions_held(self) -> None:
        """The upstream in use granted every in rule's subscription: its session holds them,
        and the log remembers where, so the first link after a restart to that upstream
        does not subscribe again while it keeps the session (the rules unchanged)."""
        self.held_at = self.address
        value = self.address.encode() + b"\n" + self.subs_value
        if self.subs_value and self.broker.states.get(self.subs_key) != value:
            self.broker.put_state(self.subs_key, value, wall_ms())
            self.server.log_touched()

    def attach(self) -> None:
        """Open the out rules' durable group (it starts at the log's end when new, and then
        holds every matching message from here on, link or no link). Nothing is taken
        until a link is up: the credit is 0."""
        spec = self.spec
        for rule in spec.rules:
            if not rule.sends:
                continue
            result = self.broker.subscribe(
                self.conn_id, rule.local_filter, group=spec.group, qos=1,
                credit=spec.inflight, start=Start.LATEST, timestamp_ms=wall_ms(),
                retained=False, patient=True, counted=False)
            if result.refusal is not None:
                raise LinkDown(f"cannot bridge {rule.local_filter!r}: {result.refusal.text}")
            self.rules_by_sub[result.sub_id] = rule
            if rule.qos == 2:
                self.qos2_subs.add(result.sub_id)
            self.broker.set_credit(self.conn_id, result.sub_id, 0)
        self._publish_state(b"0")

    def wake(self) -> None:
        """The core has deliveries for the link (or room opened)."""
        self._kick.set()

    @property
    def hold_id(self) -> int:
        """The id the core's hold and the shell's room event use (negative: no queue's)."""
        return -self.conn_id

    def floor(self, groups: list[Any] | None = None) -> int | None:
        """The oldest log offset this bridge has not had acknowledged (of ``groups``, its
        groups, when the caller has them already)."""
        groups = self.groups() if groups is None else groups
        if self.broker.cursors is not None:
            self.broker.cursors.catch_up(groups)  # quiet ones to the end (a consumer dozes)
        return min((g.floor for g in groups), default=None)

    def check_hold(self) -> None:
        """``backlog = "block"``: while the log is over ``wal.retention_bytes`` and this
        bridge's backlog reaches back into a sealed segment (so retention would have to
        delete what it has not forwarded), client publishes to its out topics wait for
        room; they go on once retention brought the log back under the cap."""
        wal = self.server.wal
        if self.spec.backlog != "block" or wal is None:
            return
        cap = self.server.config.wal.retention_bytes
        floor = self.floor()
        over = bool(cap) and wal.total_bytes > cap and floor is not None and (
            len(wal.segments) > 1 and floor < wal.segments[-1].base)
        held = self.hold_id in self.broker.holds
        if over and not held:
            filters = tuple(r.local_filter for r in self.spec.rules if r.sends)
            self.broker.hold(self.hold_id, f"bridge {self.spec.name}'s backlog at "
                             "wal.retention_bytes (backlog = \"block\")", filters)
            log.warning("bridge %s: its backlog holds the log at wal.retention_bytes (%d "
                        "bytes): publishers to its topics wait until it drains",
                        self.spec.name, cap)
        elif held and not over:
            self.broker.unhold(self.hold_id)
            self.server.release((self.hold_id,))
            log.info("bridge %s: the log is under wal.retention_bytes again: publishers go "
                     "on", self.spec.name)

    def groups(self) -> list[Any]:
        return [g for g in map(self._group, self.rules_by_sub) if g is not None]

    def status(self) -> dict[str, Any]:
        """What ``blipmq bridges`` and the metrics show."""
        groups = self.groups()
        backlog = sum(max(0, g.backlog) + len(g.inflight) for g in groups)
        wal = self.server.wal
        floor = self.floor(groups)
        held = 0
        if wal is not None and floor is not None and backlog:
            # a segment counts when anything in it is at or past the floor: the next one
            # starts after the floor (the newest always counts)
            segments = wal.segments
            after = [s.base for s in segments[1:]] + [math.inf]
            held = sum(s.size for s, next_base in zip(segments, after, strict=True)
                       if next_base > floor)
        age = (None if self.oldest_ms is None or not backlog
               else max(0.0, (wall_ms() - self.oldest_ms) / 1000))
        link = self._link
        return {"name": self.spec.name, "protocol": self.spec.protocol,
                "connected": self.connected, "address": self.address,
                "addresses": [f"{h}:{p}" for h, p in self.spec.addresses],
                "rules": [r.text() for r in self.spec.rules],
                "backlog_messages": backlog, "backlog_bytes": held,
                "oldest_age_s": None if age is None else round(age, 3),
                "in_flight": 0 if link is None else len(link.inflight),
                "backlog_policy": self.spec.backlog, "holding": self.hold_id in self.broker.holds,
                "last_error": self.last_error, **self.counters}

    # --------------------------------------------------------------------- the link

    async def run(self) -> None:
        """Keep a link up until cancelled (shutdown)."""
        spec = self.spec
        backoff = Backoff(spec.backoff_min_ms / 1000, spec.backoff_max_ms / 1000,
                          random.uniform)
        turn = 0
        failing_back = False  # the last link was left for the first address
        status = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_oldest, status)
            nursery.start_soon(self._watch_unstored)
            try:
                while True:
                    host, port = spec.addresses[turn % len(spec.addresses)]
                    self.address = f"{host}:{port}"
                    reason = await self._attempt(host, port, backoff)
                    if reason is None and self._retry_plain:
                        self._retry_plain = False
                        reason = await self._attempt(host, port, backoff)
                    # a link the upstream dropped soon after it came up failed as a
                    # refused connect does: the next address next, and no failback to it
                    lasted = trio.current_time() - self._up_at
                    short = (reason is not None and reason not in (_UNSTORED, _PRIMARY_BACK)
                             and brief(lasted, spec.keepalive_s))
                    if turn % len(spec.addresses) == 0 and reason is not None and not short:
                        self._probe_s = _PRIMARY_PROBE_S  # the first address works
                    elif turn % len(spec.addresses) == 0 and failing_back:  # it did not
                        self._probe_s = min(self._probe_s * 2, _PRIMARY_PROBE_MAX_S)
                    failing_back = reason == _PRIMARY_BACK
                    if reason is not None and not short:
                        # it was up and lasted: a link that works. Not after a brief one:
                        # an upstream that drops every link is dialled ever less often,
                        # as one that refuses (at backoff_min_ms for ever before)
                        backoff.reset()
                    if reason is not None:  # it was up: the primary first again (if it
                        # lasted; else the next address, as after a refused connect)
                        turn = turn + 1 if short else 0
                        self.counters["reconnects"] += 1
                        self._quiet = reason == _UNSTORED and self._unstored_said is not None
                        if self._quiet:
                            self._unstored_links += 1  # summed up by _watch_unstored
                            log.debug("bridge %s: link to %s lost: %s", spec.name,
                                      self.address, reason)
                        elif failing_back:
                            log.info("bridge %s: leaving %s: %s", spec.name, self.address,
                                     reason)
                        elif short:
                            log.warning("bridge %s: link to %s lost %.1f s after it came up, "
                                        "within %s: a failed attempt%s: %s",
                                        spec.name, self.address, lasted,
                                        "keepalive_s" if spec.keepalive_s else "60 s",
                                        ", the next address is tried"
                                        if len(spec.addresses) > 1 else "", reason)
                            reason = (f"{self.address}: lost {lasted:.1f} s after it came "
                                      f"up: {reason}")
                        else:
                            log.warning("bridge %s: link to %s lost: %s", spec.name,
                                        self.address, reason)
                    else:
                        turn += 1
                    if not failing_back:  # (leaving a working link is no error; and the
                        # first address answered just now: no wait before trying it)
                        self.last_error = reason or self.last_error
                        await trio.sleep(backoff.next())
            finally:
                status.cancel()
                nursery.cancel_scope.cancel()

    async def _attempt(self, host: str, port: int, backoff: Backoff) -> str | None:
        """``_one_link``; a defect in it ends that link (logged), never the broker."""
        try:
            return await self._one_link(host, port, backoff)
        except Exception as exc:
            log.exception("bridge %s: the link to %s:%d failed", self.spec.name, host, port)
            self.last_error = f"internal error: {exc!r}"
            return None

    async def _one_link(self, host: str, port: int, backoff: Backoff) -> str | None:
        """Connect and serve one link; None when it never came up, else why it ended."""
        spec = self.spec
        opened: list[trio.abc.Stream] = []  # closed again if the link does not come up
        try:
            with trio.fail_after(spec.connect_timeout_ms / 1000) as timer:
                stream = await self._connect(host, port, opened)
                if spec.protocol == "blipmq":
                    from blipmq_server.server.uplink import NativeLink

                    link: _Link = NativeLink(self, stream)
                else:
                    link = _Link(self, stream)
                link.timer = timer
                await link.handshake()
        except NotPrivate as exc:
            await self._close_all(opened)
            self.private = False
            self._retry_plain = True
            log.info("bridge %s: %s", spec.name, exc)
            return None
        except (OSError, UnicodeError, trio.TooSlowError, trio.BrokenResourceError, LinkDown,
                RemoteProtocolError, LocalProtocolError) as exc:
            # UnicodeError: a name IDNA cannot encode; LocalProtocolError: a CONNECT that
            # cannot be encoded (the config checks refuse what they know of)
            await self._close_all(opened)
            self.counters["connect_failures"] += 1
            self.last_error = f"{host}:{port}: {_why(exc)}"
            log.info("bridge %s: cannot connect to %s:%d: %s", spec.name, host, port,
                     _why(exc))
            return None
        self._up_at = trio.current_time()
        self._link = link
        self.connected = True
        self.last_error = ""
        self._publish_state(b"1")
        # quiet while messages coming in cannot be stored: each link is dropped at once
        (log.debug if self._quiet and self._unstored_said is not None else log.info)(
            "bridge %s: connected to %s:%d", spec.name, host, port)
        for sub_id in self.rules_by_sub:
            self.broker.set_credit(self.conn_id, sub_id, spec.inflight)
        self._kick.set()
        try:
            first = spec.addresses[0]
            if (host, port) == first or len(spec.addresses) == 1:
                return await link.serve()
            return await self._serve_until_first(link, first)
        finally:
            self._link = None
            self.connected = False
            self._give_back(link)
            with trio.CancelScope(shield=True):
                await link.close()
            self._publish_state(b"0")

    async def _serve_until_first(self, link: _Link, first: tuple[str, int]) -> str:
        """``link.serve()`` on a link to another address than the first, until the first
        accepts a TCP connection again (tried every ``_probe_s``): then the link ends
        (``_PRIMARY_BACK``), what it had in flight goes back to the group as on any lost
        link, and ``run`` connects to the first address at once (mosquitto's bridges do
        the same with ``round_robin false``, their default)."""
        reason = _PRIMARY_BACK
        async with trio.open_nursery() as nursery:
            async def serve() -> None:
                nonlocal reason
                reason = await link.serve()
                nursery.cancel_scope.cancel()

            nursery.start_soon(serve)
            while True:
                await trio.sleep(self._probe_s)
                try:
                    with trio.fail_after(self.spec.connect_timeout_ms / 1000):
                        probe = await trio.open_tcp_stream(*first)
                except (OSError, trio.TooSlowError):
                    continue
                await trio.aclose_forcefully(probe)
                nursery.cancel_scope.cancel()
                break
        return reason

    async def _connect(self, host: str, port: int, opened: list[trio.abc.Stream]
                       ) -> trio.abc.Stream:
        """TCP, and TLS when asked; what it opened is in ``opened`` (to close on failure)."""
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        opened.append(stream)
        if self._ssl is None:
            return stream
        tls = trio.SSLStream(stream, self._ssl,
                             server_hostname=self.spec.server_name or host, https_compatible=True)
        await tls.do_handshake()
        return tls

    @staticmethod
    async def _close_all(opened: list[trio.abc.Stream]) -> None:
        with trio.CancelScope(shield=True):
            for stream in opened:
                await trio.aclose_forcefully(stream)

    def _give_back(self, link: _Link) -> None:
        """The link is gone: what it had in flight goes back to the group (sent again first
        on the next link, with DUP). A message the upstream cut the link on every time it
        was sent, ``max_retries`` links in a row, goes to the dead letters."""
        link._ack_core()  # acknowledged upstream: not back to the group
        broker, conn = self.broker, self.conn_id
        if link.inflight and not link.acked and link.peer_closed:
            first_pid = next(iter(link.inflight))
            sub_id, offset, _ = link.inflight[first_pid]
            strikes = self._strikes[offset] = self._strikes.get(offset, 0) + 1
            if strikes >= self.spec.max_retries:
                del self._strikes[offset]
                why = (f"bridge {self.spec.name}: the upstream closed the link each of "
                       f"{strikes} times this message was sent")
                self.server.wake(self.give_up(sub_id, offset, why))
                self.server.log_touched()
        if len(self._strikes) > 1024:
            self._strikes.clear()
        rules = self.rules_by_sub
        again: dict[int, list[int]] = {}
        for pid, (sub_id, offset, _) in link.inflight.items():
            if rules[sub_id].qos != 2 or offset not in self._held(sub_id):
                continue
            if pid in link.released:  # the upstream has it: its PUBREL is owed
                self.owed[pid] = (sub_id, offset)
            else:  # sent again under this id, the first thing the group hands out
                self.resend[sub_id, offset] = pid
                self.reserved.add(pid)
                again.setdefault(sub_id, []).append(offset)
        self._back(again)
        for sub_id, rule in rules.items():
            if rule.qos != 2:
                broker.requeue(conn, sub_id)
            broker.set_credit(conn, sub_id, 0)

    def give_up(self, sub_id: int, offset: int, why: str) -> frozenset[int]:
        """A message the upstream will not take goes to the local dead letters, counted in
        ``dead_lettered``; a dead letter (an out rule on ``$dlq/...``) is dropped instead,
        as the core drops one (counted there). Returns the connections to wake."""
        counters = self.broker.counters
        before = counters.dead_lettered
        wake = self.broker.nack(self.conn_id, sub_id, (offset,), 0, now_ms(), wall_ms(), why,
                                give_up=True)
        self.counters["dead_lettered"] += counters.dead_lettered - before
        return wake

    def _back(self, offsets: dict[int, list[int]]) -> None:
        """Deliveries (rule's sub id -> offsets, in sending order) back to the front of
        their group, no retry spent."""
        wake: set[int] = set()
        for sub_id, some in offsets.items():
            wake |= self.broker.nack(self.conn_id, sub_id, tuple(some), 0, now_ms(),
                                     wall_ms(), spend=False)
        self.server.wake(wake)

    def _group(self, sub_id: int) -> Any:
        """An out rule's durable group (None without cursors, or once it is gone)."""
        cursors = self.broker.cursors
        return None if cursors is None else cursors.durable.get(
            (self.rules_by_sub[sub_id].local_filter, self.spec.group))

    def _held(self, sub_id: int) -> Container[int]:
        """The offsets a rule's group holds in flight (a dead-lettered one is gone)."""
        group = self._group(sub_id)
        return frozenset() if group is None else group.inflight

    def stale_ids(self) -> list[int]:
        """The packet ids the upstream may hold a QoS 2 message of this bridge under from
        before this broker started: any message sent and not PUBCOMPed then lies between
        the QoS 2 out rules' floor and the log's end at the start, and its id is its
        offset's (``_Link._pid``'s first choice) or, when that one was busy, one of the
        next ids past the busy ones (at most a window in flight, a window reserved and a
        SUBSCRIBE's): so the ids of the offsets from that floor to two windows and one past
        that end, all 65,535 when they span as many."""
        floors = [g.floor for g in map(self._group, self.qos2_subs) if g is not None]
        if not floors or min(floors) >= self.restored_end:
            return []
        first = min(floors)
        end = self.restored_end + 2 * self.spec.inflight + 1
        if end - first >= 65535:
            return list(range(1, 65536))
        return [offset % 65535 + 1 for offset in range(first, end)]

    def resume(self, link: _Link, present: bool) -> None:
        """A new link's CONNACK: the QoS 2 exchanges of the last link go on when the upstream
        kept the session (MQTT-4.4.0-1: PUBREL again for what had its PUBREC; the others are
        sent again under their ids as the group hands them out), else they go back to the
        group, and the upstream's packet ids of messages coming in are forgotten. (After a
        start here nothing of this is known: the first link to a kept session releases
        what may be held from before, ``_Link._release``, and messages not PUBCOMPed are
        sent again.)"""
        if not present:
            back: dict[int, list[int]] = {}
            for sub_id, offset in self.owed.values():
                back.setdefault(sub_id, []).append(offset)
            self._back(back)
            self.owed.clear()
            self.resend.clear()
            self.reserved.clear()
            self.qos2_in.clear()
            self._tokens.clear()
            return
        now = trio.current_time()
        for pid, (sub_id, offset) in self.owed.items():
            link.inflight[pid] = (sub_id, offset, now)
            link.released.add(pid)
            link.outbox.append(mqtt.encode(PubRel(pid)))
        self.owed.clear()

    def unstored(self, text: str) -> None:
        """A message from the upstream the local log could not store (``text``: why): its
        link ends, so that the upstream sends it again. While that lasts (a full disk
        refuses every message of every link), the first is said at once, the others are
        counted and summed up at most once every ``_UNSTORED_EVERY_S`` seconds, and the
        end is said too (``_watch_unstored``). The caller ends the link."""
        self._kick.set()
        now = trio.current_time()
        self._unstored_at, self._unstored_why, self._stored_after = now, text, False
        if self._unstored_said is None:
            self._unstored_said = now
            log.warning("bridge %s: %s: %s; the link is dropped, so that the upstream sends "
                        "it again (until messages are stored again, this is summed up at most "
                        "once every %d s)", self.spec.name, _UNSTORED, text, _UNSTORED_EVERY_S)
        else:
            self._unstored += 1

    def stored(self) -> None:
        """A message from the upstream is stored while some could not be."""
        self._stored_after = True

    async def _watch_unstored(self) -> None:
        """Once a second while messages from the upstream could not be stored: say that
        they are stored again, once one was and none was refused for ``_STORED_AGAIN_S``
        seconds; else sum up the refusals since the last line, at most every
        ``_UNSTORED_EVERY_S`` seconds."""
        while True:
            await trio.sleep(1)
            said = self._unstored_said
            if said is None:
                continue
            now = trio.current_time()
            name, more, links = self.spec.name, self._unstored, self._unstored_links
            if self._stored_after and now - self._unstored_at >= _STORED_AGAIN_S:
                log.warning("bridge %s: messages from the upstream are stored again (%d more "
                            "could not be, and %d link(s) were dropped for them, since the "
                            "last line said so)", name, more, links)
                self._unstored_said = None
            elif more and now - said >= _UNSTORED_EVERY_S:
                log.warning("bridge %s: %d more message(s) from the upstream could not be "
                            "stored, and %d link(s) were dropped for them, in the last %.0f s: "
                            "%s", name, more, links, now - said, self._unstored_why)
                self._unstored_said = now
            else:
                continue
            self._unstored = self._unstored_links = 0

    def unexpected(self, what: str, packet_id: int) -> None:
        """An acknowledgement for a packet id not waiting for it: counted, logged once."""
        if not self.counters["unexpected_acks"]:
            log.warning("bridge %s: %s for packet id %d, which waits for none (ignored; "
                        "counted as unexpected_acks)", self.spec.name, what, packet_id)
        self.counters["unexpected_acks"] += 1

    def _publish_state(self, value: bytes) -> None:
        """The retained local topic ``$SYS/bridge/<name>/state``: 1 up, 0 down."""
        topic = f"$SYS/bridge/{self.spec.name}/state"
        record = message_record(Message(topic, value, 0, retain=True))
        raw = RawMessage(topic.encode(), 0, 0, len(value), record, FLAG_RETAIN)
        result = self.broker.publish([raw], now_ms(), wall_ms(), internal=True)
        self.server.wake(result.wake)
        self.server.log_touched()

    async def _watch_oldest(self, scope: trio.CancelScope) -> None:
        """Every second: the timestamp of the oldest record the bridge has not forwarded
        (read off the event loop: during an outage it is on disk)."""
        wal = self.server.wal
        if wal is None or not self.rules_by_sub:
            return
        with scope:
            while True:
                self.check_hold()
                groups = self.groups()
                floor = self.floor(groups)
                if not any(g.backlog > 0 or g.inflight for g in groups):
                    self.oldest_ms = None
                elif floor is not None and floor >= wal.first_offset:
                    try:
                        records = await trio.to_thread.run_sync(wal.read_files, floor, 1, 4096)
                    except (OSError, WalError):  # retention removed it: next time
                        records = []
                    if records:
                        self.oldest_ms = records[0].timestamp_ms
                await trio.sleep(1)

    # --------------------------------------------------------------- messages coming in

    def _settle_unstored(self, link: _Link, packet: Publish | OversizePublish) -> None:
        """Acknowledge a message from the upstream that is not stored here, so that it
        does not come again on every link nor fill the upstream's window: PUBACK, or PUBREC
        with its packet id remembered until PUBREL."""
        if packet.qos == 2:
            self.qos2_in[packet.packet_id] = 0
            link.send(mqtt.encode(PubRec(packet.packet_id)))
        elif packet.qos:
            link.ack(packet.packet_id)

    def local_problem(self, topic: str, remote: str = "") -> str | None:
        """Why a message from the upstream (on ``remote``) cannot be stored under this local
        topic (logged here, refused and counted by the core: ``size_refusal``, ``refuse``),
        or None. What the local broker takes from its own clients bounds what comes in (the
        core's other checks follow); "" is no local name (``Rule.to_local``)."""
        if topic:
            refusal = self.broker.limits.size_refusal(len(topic.encode("utf-8")), 0)
            if refusal is None:
                return None
            problem = f"the local {refusal.text}"
        else:
            problem = "its rule gives it no local name (docs/BRIDGE.md, Topic rules)"
        self.counters["received"] += 1
        self.broker.refuse(Refusal(ErrorCode.INVALID_TOPIC, problem))
        self.not_stored(topic or remote, problem, "topic")
        return problem

    def not_stored(self, topic: str, why: str, kind: str) -> None:
        """A message from the upstream the local broker does not store (it could never be):
        counted as refused; logged at most once a minute per bridge and ``kind`` of
        refusal, each line saying how many came since (whoever may publish upstream on the
        bridged topics could otherwise fill the local log, a line a message)."""
        self.counters["refused"] += 1
        said = self._hush.due(self.spec.name, kind)
        if said is not None:
            log.warning("bridge %s: message from the upstream on %r not stored: %s%s; "
                        "further such messages are counted (blipmq_bridge_refused_total), "
                        "not logged, for %d s", self.spec.name, topic[:64], why, since(said),
                        EVERY_S)

    def received(self, link: _Link, packet: Publish | OversizePublish) -> None:
        """A PUBLISH from the upstream (an ``in`` rule): into the local log, PUBACKed once
        durable (the flusher calls ``confirmed``). One over the link's packet limit came
        without its payload (``OversizePublish``): refused and acknowledged."""
        if packet.qos == 2:
            state = self.qos2_in.get(packet.packet_id)
            if state is not None:  # sent again: logged once, PUBRECed once that is durable
                self.counters["duplicates_in"] += 1
                if state == 0:
                    link.send(mqtt.encode(PubRec(packet.packet_id)))
                return
        rule = inbound_rule(self.spec.rules, packet.topic)
        if rule is None:  # a subscription the upstream session kept from older rules
            self.counters["skipped"] += 1
            self._settle_unstored(link, packet)
            return
        topic = rule.to_local(packet.topic)
        if self.local_problem(topic, packet.topic) is not None:
            self._settle_unstored(link, packet)  # it could never be stored
            return
        if packet.__class__ is OversizePublish:  # the decoder passed its payload over
            self.counters["received"] += 1
            refusal = self.broker.refuse(Refusal(
                ErrorCode.MESSAGE_TOO_LARGE, f"a PUBLISH of {packet.size} bytes is over the "
                f"link's limit of {self.server.mqtt_max_packet} (which "
                "server.max_message_bytes sets); its payload was passed over"))
            self.not_stored(packet.topic, refusal.text, "oversize")
            self._settle_unstored(link, packet)  # it could never be stored
            return
        if packet.retain and rule.sends and self._newer_here(rule, topic):
            self.counters["superseded"] += 1
            if not self._superseded_said:
                self._superseded_said = True
                log.info("bridge %s: the upstream's retained value of %r not stored: the "
                         "value published here since is not forwarded yet, and replaces it "
                         "there (counted in blipmq_bridge_superseded_total from now on)",
                         self.spec.name, packet.topic)
            self._settle_unstored(link, packet)
            return
        qos = min(packet.qos, 1)
        record = message_record(Message(topic, packet.payload, qos, retain=packet.retain))
        # QoS 2 stays QoS 2 for the local MQTT subscribers (as the MQTT front logs it)
        mark = FLAG_BRIDGED | (FLAG_QOS2 if packet.qos == 2 else 0)
        record = bytes((record[0] | mark,)) + record[1:]
        raw = RawMessage(topic.encode(), qos, 0, len(packet.payload), record,
                         FLAG_RETAIN if packet.retain else 0)
        server = self.server
        result = self.broker.publish([raw], now_ms(), wall_ms(), internal=True, unkept=True)
        server.wake(result.wake)
        server.log_touched()
        self.counters["received"] += 1
        if result.unkept:
            self.not_kept(result.unkept_topic, result.unkept_text)
        if result.refusal is not None:
            self.not_stored(packet.topic, result.refusal.text, result.refusal.code.name)
        if not packet.qos:
            return
        if result.refusal is not None or not result.last_offset or server.flusher is None:
            self._settle_unstored(link, packet)
            return
        if packet.qos == 2:
            pid = packet.packet_id
            self._token = token = self._token % 0x7FFFFFFF + 1
            self.qos2_in[pid] = token
            self._tokens[token] = pid
            server.flusher.confirm_later(result.last_offset, self, token, 1)  # type: ignore[arg-type]
            return
        server.flusher.confirm_later(result.last_offset, link, packet.packet_id, 1)  # type: ignore[arg-type, union-attr]

    def not_kept(self, topic: bytes, text: str) -> None:
        """Retained messages from the upstream the local retained store had no room for
        (``retained.max_topics``, ``max_bytes``): stored and delivered without retain, the
        topic's local value left as it was (``publish(unkept=True)``), as an MQTT client's
        retained publish past the cap; refused, the message itself would have been lost
        once acknowledged upstream. Counted by the core (``blipmq_retained_refused_total``);
        logged at most once a minute per bridge, as ``not_stored``, each line saying how
        many came since."""
        said = self._hush.due(self.spec.name, "unkept")
        if said is not None:
            log.warning("bridge %s: retained value from the upstream for %r not kept: %s%s; "
                        "the message is stored and delivered without retain (further ones "
                        "are counted in blipmq_retained_refused_total, not logged, for %d s)",
                        self.spec.name, topic.decode("utf-8", "replace")[:64], text,
                        since(said), EVERY_S)

    def _newer_here(self, rule: Rule, topic: str) -> bool:
        """Whether ``topic``'s local retained value was published here (not brought in) and
        is not acknowledged by the upstream yet: a `both` rule's out group still owes it.
        A retained value the upstream sends meanwhile (on a new subscription: what it held
        before the outage) is older, and that one replaces it there once it is forwarded;
        stored here, it would replace ours, and the two brokers would disagree for good."""
        value = self.broker.retained.values.get(topic.encode())
        if value is None or value.record[0] & FLAG_BRIDGED:
            return False
        return any(r is rule and self.broker.copy_of(self.conn_id, sub_id, value.offset) == OWES
                   for sub_id, r in self.rules_by_sub.items())

    # the flusher's confirm interface for QoS 2 messages coming in: their packet ids belong
    # to the upstream session, not to one link, so the PUBREC goes on the link up now
    def confirmed(self, request_id: int, count: int) -> None:
        if self._unstored_said is not None:
            self.stored()
        pid = self._tokens.pop(request_id, None)
        if pid is None or self.qos2_in.get(pid) != request_id:
            return  # the upstream lost the session meanwhile
        self.qos2_in[pid] = 0
        if self._link is not None:  # else: PUBREC when the upstream sends it again
            self._link.send(mqtt.encode(PubRec(pid)))

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        # not stored: no PUBREC, and the link ends, so the upstream sends it again
        pid = self._tokens.pop(request_id, None)
        if pid is not None and self.qos2_in.get(pid) == request_id:
            del self.qos2_in[pid]
        if self._link is not None:
            self._link.open = False
        self.unstored(text)

    def release_in(self, link: _Link, packet_id: int) -> None:
        """PUBREL from the upstream: the packet id may carry a new message; PUBCOMP."""
        if self.qos2_in.pop(packet_id, None):  # a PUBREL before our PUBREC: a bad peer
            self.unexpected("PUBREL", packet_id)
        link.send(mqtt.encode(PubComp(packet_id)))


class _Link:
    """One connection to the upstream: its reader, its writer and what it has in flight."""

    def __init__(self, bridge: Bridge, stream: trio.abc.Stream) -> None:
        self.bridge = bridge
        self.stream = stream
        self._sock = _tcp_socket(stream)
        self._window = bridge.spec.inflight
        # a PUBLISH over the limit is passed over and refused, not a protocol error
        self.decoder = mqtt.Decoder(bridge.server.mqtt_max_packet, skip_oversize=True)
        self.inflight: dict[int, tuple[int, int, float]] = {}  # pid -> sub, offset, sent at
        self.released: set[int] = set()  # QoS 2 ids of ``inflight`` PUBRECed: PUBCOMP owed
        self.outbox: list[bytes] = []
        # rule's sub id -> a record's head and topic -> what goes before its payload upstream
        # (QoS 1 rules): an MQTT PUBLISH head (its packet id follows), or a native record's
        # head and topic (its key follows; ``_add``)
        self.heads: dict[int, dict[bytes, bytes]] = {}
        # a native link's way to add a record to the open batch (its ticket back), None for
        # MQTT (``_encode``'s fast path)
        self._add: Callable[[bytes, int], int] | None = None
        self.acked = 0  # PUBACKs this link had
        # rule's sub id -> offsets the upstream acknowledged that the core is not told of
        # yet: the writer tells it before it next takes deliveries (``_ack_core``)
        self.done: dict[int, list[int]] = {}
        self.peer_closed = False
        self.open = True
        self._next_pid = 0
        self.heard_at = trio.current_time()
        self.pinged = False
        self.pending: list[object] = []  # packets that came with the CONNACK
        self.serving = False  # past the handshake: reads wait for room in the log
        self.waiting = False  # the reader waits for room in the log (not the upstream)
        self.reason: str | None = None
        self.timer = trio.CancelScope()  # the handshake's time limit (``Bridge._one_link``)

    def _pid(self, offset: int = 0) -> int:
        """A free packet id for the message at log ``offset``: the one that follows from
        the offset when it is free, so a message sent again after a restart of this broker
        (which forgets what was in flight) goes out under the id it had, and an upstream
        that still holds that id for it (QoS 2, PUBREC sent, PUBREL not had) knows it."""
        # bridge.reserved: QoS 2 ids a message waits to go out under again
        pid = free_packet_id(offset % 65535 + 1, self.inflight, self.bridge.reserved)
        if not pid:  # pragma: no cover - inflight <= 65535
            raise LinkDown("no free packet id")
        return pid

    async def _receive(self) -> bytes:
        """One read from the upstream; its end of the stream ends the link. Once the link
        serves, while more than ``wal.max_unwritten_bytes`` wait for the disk the upstream
        waits too (``waiting``: that silence is ours, not a dead link's)."""
        server = self.bridge.server
        limit = server.config.wal.max_unwritten_bytes
        if self.serving and server.flusher is not None and server.flusher.full(limit):
            self.waiting = True
            try:
                await server.flusher.room(limit)
            finally:
                self.waiting = False
                self.heard_at = trio.current_time()
        data = await self.stream.receive_some(65536)
        if not data:
            self.peer_closed = True
            raise LinkDown("the upstream closed the connection")
        if self._sock is not None and len(self.inflight) >= self._window:
            # the window is full: nothing goes out until the upstream's acknowledgements
            # come, so no data of ours carries the TCP ACK of what came in. ACK it at once,
            # not within the 40 ms of a delayed ACK: an upstream with Nagle's algorithm on
            # (mosquitto's default) holds its next PUBACKs until that ACK (a QoS 2 drain
            # at the window of 20 went from about 240 to about 5,000 msg/s)
            self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        self.heard_at = trio.current_time()
        self.pinged = False
        return data

    async def _read_packets(self) -> list[object]:
        decoder = self.decoder
        while True:
            packets = decoder.packets()
            if packets:
                return packets  # type: ignore[return-value]
            data = await self._receive()
            if not len(data) % 4 and not decoder.buffered and not decoder.skipping:
                acks = _pubacks(data)  # a drain's usual read: nothing but PUBACKs
                if acks is not None:
                    return acks
            decoder.feed(data)

    async def handshake(self) -> None:
        spec = self.bridge.spec
        will = (Will(spec.state_topic, b"0", 1, True) if spec.state_topic else None)
        bridge = self.bridge
        connect = Connect("MQTT", 0x84 if bridge.private else 4,
                          clean_session=not spec.persistent,
                          keepalive=spec.keepalive_s, client_id=spec.mqtt_client_id,
                          will=will, username=spec.username or None,
                          password=spec.password.encode() if spec.password else None)
        await self.stream.send_all(mqtt.encode(connect))
        packets = await self._read_packets()
        first = packets[0]
        if not isinstance(first, ConnAck):
            raise LinkDown(f"expected CONNACK, got {type(first).__name__}")
        if first.code == 1 and bridge.private:
            raise NotPrivate("the upstream does not take a bridge's CONNECT (level 0x84); "
                             "connecting as a plain MQTT 3.1.1 client")
        if first.code:
            raise LinkDown(f"the upstream refused the connection: CONNACK {first.code:#04x} "
                           f"({_CONNACK.get(first.code, 'unknown')})")
        # the link is up once the upstream answers after its CONNACK (the PINGRESP, or any
        # packet): one that closes every link right after it (a crash loop, a balancer)
        # fails to connect, with the growing backoff, and is sent no message to lose
        pending = packets[1:]
        try:
            await self.stream.send_all(_PINGREQ)
            while not pending:
                pending = await self._read_packets()
        except (LinkDown, OSError, trio.BrokenResourceError) as exc:
            raise LinkDown(f"no answer after the CONNACK: {_why(exc)}") from None
        self.pending = pending
        if first.session_present and (bridge.stale is None or bridge.stale):
            await self._release()
        bridge.stale = set()  # released, or the upstream kept nothing
        bridge.resume(self, first.session_present)
        filters = tuple((r.remote_filter, r.qos) for r in spec.rules if r.receives)
        # a session this upstream kept holds them (``Bridge.held_at``): subscribing again
        # would bring every retained value once more
        if filters and not (first.session_present and bridge.held_at == bridge.address):
            bridge.held_at = ""  # until its SUBACK
            self.outbox.append(mqtt.encode(Subscribe(self._pid(), filters)))
        if spec.state_topic:
            self.outbox.append(mqtt.encode(Publish(spec.state_topic, b"1", 0, True)))

    async def _release(self) -> None:
        """PUBREL for each of ``Bridge.stale_ids`` (the upstream session kept from before
        this broker started may hold QoS 2 messages under them, PUBRECed: each is delivered
        then, and sent again later as any not PUBCOMPed), back once each has its PUBCOMP
        (the answer to any PUBREL, MQTT-4.3.3-2), so no PUBLISH takes one of those ids
        meanwhile. What else comes in waits in ``pending``.

        ``_RELEASE_CHUNK`` at a time: neither side's writes can then fill the socket
        buffers while the other is not reading (this one writes, and reads only after).
        Each chunk has ``connect_timeout_ms`` of its own (a slow uplink takes longer than
        one for all 256 KiB each way), and an id once PUBCOMPed is done: a link lost
        midway leaves the next one only the rest to release."""
        bridge = self.bridge
        spec = bridge.spec
        if bridge.stale is None:
            bridge.stale = set(bridge.stale_ids())
        stale = bridge.stale
        ids = sorted(stale)
        if ids:
            log.info("bridge %s: releasing the %d packet ids the upstream may hold QoS 2 "
                     "messages under from before this start", spec.name, len(ids))
        limit = spec.connect_timeout_ms / 1000
        self.timer.deadline = math.inf  # each chunk's own limit instead, below
        for first in range(0, len(ids), _RELEASE_CHUNK):
            chunk = ids[first:first + _RELEASE_CHUNK]
            waiting = set(chunk)
            with trio.move_on_after(limit):
                await self.stream.send_all(b"".join([_ACK.pack(0x62, 2, pid)
                                                     for pid in chunk]))
                while waiting:
                    for packet in await self._read_packets():
                        if isinstance(packet, PubComp) and packet.packet_id in waiting:
                            waiting.discard(packet.packet_id)
                            stale.discard(packet.packet_id)
                        else:
                            self.pending.append(packet)
            if waiting:
                raise LinkDown(f"the upstream answered {len(chunk) - len(waiting)} of "
                               f"{len(chunk)} PUBRELs within connect_timeout_ms "
                               f"({spec.connect_timeout_ms} ms); {len(stale)} of the "
                               "release's packet ids are left for the next link")
        self.timer.deadline = trio.current_time() + limit

    async def serve(self) -> str:
        """Run the reader and the writer until either ends; returns why."""
        self.serving = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._guard, self._writer, nursery)
            nursery.start_soon(self._guard, self._reader, nursery)
        return self.reason or "closed"

    async def _guard(self, work: Any, nursery: trio.Nursery) -> None:
        """Run the reader or the writer; the first to end ends the link and says why."""
        try:
            await work()
            reason = "closed"
        except LinkDown as exc:
            reason = str(exc)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.peer_closed = True
            reason = _why(exc)
        except RemoteProtocolError as exc:
            reason = f"protocol error from the upstream: {exc}"
        except Exception as exc:  # a defect here ends this link, never the broker
            log.exception("bridge %s: the link failed", self.bridge.spec.name)
            reason = f"internal error: {exc!r}"
        if self.reason is None:
            self.reason = reason
        nursery.cancel_scope.cancel()

    def ack(self, packet_id: int) -> None:
        """A PUBACK for a message from the upstream."""
        self.send(mqtt.encode(PubAck(packet_id)))

    def send(self, data: bytes) -> None:
        """A packet for the writer to send (none once the link is closing)."""
        if self.open:
            self.outbox.append(data)
            self.bridge._kick.set()

    # the flusher's confirm interface (``Flusher.confirm_later``)
    def confirmed(self, request_id: int, count: int) -> None:
        if self.bridge._unstored_said is not None:
            self.bridge.stored()
        self.ack(request_id)

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        # not stored: no PUBACK, and the link ends, so the upstream sends it again
        self.open = False
        self.bridge.unstored(text)

    async def _reader(self) -> None:
        self._handle_all(self.pending)
        while True:
            self._handle_all(await self._read_packets())

    def _handle_all(self, packets: list[object]) -> None:
        """The packets of one read; their PUBACKs and PUBCOMPs become one ack per rule (one
        ACK record in the log for the lot, not one per message)."""
        done: dict[int, list[int]] | None = None
        inflight = self.inflight
        released = self.released
        qos2 = self.bridge.qos2_subs
        for packet in packets:
            kind = packet.__class__
            if kind is int or kind is PubAck:  # ``_pubacks`` gives bare packet ids
                pid = packet if kind is int else packet.packet_id  # type: ignore[attr-defined]
                found = inflight.get(pid)  # type: ignore[call-overload]
                if found is None or (qos2 and found[0] in qos2):
                    # nothing waits for it, or a QoS 2 message (which a PUBACK cannot end)
                    self.bridge.unexpected("PUBACK", pid)  # type: ignore[arg-type]
                    continue
                del inflight[pid]  # type: ignore[arg-type]
                released.discard(pid)  # type: ignore[arg-type]
                if done is None:
                    done = {}
                done.setdefault(found[0], []).append(found[1])
                continue
            if kind is PubRec:
                pid = packet.packet_id  # type: ignore[attr-defined]
                found = inflight.get(pid)
                if found is not None and self.bridge.rules_by_sub[found[0]].qos == 2:
                    released.add(pid)  # PUBREL (again, should one have crossed ours)
                    self.send(mqtt.encode(PubRel(pid)))
                else:
                    self.bridge.unexpected("PUBREC", pid)
                continue
            if kind is PubComp:
                pid = packet.packet_id  # type: ignore[attr-defined]
                if pid in released:
                    released.discard(pid)
                    found = inflight.pop(pid)
                    if done is None:
                        done = {}
                    done.setdefault(found[0], []).append(found[1])
                else:
                    self.bridge.unexpected("PUBCOMP", pid)
                continue
            self._handle(packet)
        if done is not None:
            self._acked(done)

    def _room(self, window: int) -> int:
        """Messages the writer may send now: what the window has free, up to a batch, or 0
        while that is less than a quarter of the window (up to a batch) and some are in
        flight (it waits for a bigger batch's room)."""
        room = min(window - len(self.inflight), _MAX_BATCH)
        return 0 if room < min(_MAX_BATCH, window // 4) and self.inflight else room

    def _acked(self, done: dict[int, list[int]]) -> None:
        """The upstream acknowledged these (rule's sub id -> offsets): off the window now,
        out of the group at the writer's next turn (``_ack_core``: one core ack per rule for
        every read since, not one per read), which this wakes once the window has room for
        its next batch."""
        pending = self.done
        n = 0
        for sub_id, offsets in done.items():
            have = pending.get(sub_id)
            if have is None:
                pending[sub_id] = offsets
            else:
                have.extend(offsets)
            n += len(offsets)
        self.acked += n
        bridge = self.bridge
        bridge.counters["forwarded"] += n
        if self._room(bridge.spec.inflight):
            bridge._kick.set()  # room enough in the window for the writer's next batch

    def _ack_core(self) -> None:
        """What the upstream acknowledged leaves the group (the writer, before it takes
        more; ``Bridge._give_back``, before what is still in flight goes back)."""
        done, self.done = self.done, {}
        bridge = self.bridge
        broker, conn, wall = bridge.broker, bridge.conn_id, wall_ms()
        strikes = bridge._strikes
        for sub_id, offsets in done.items():
            broker.ack(conn, sub_id, tuple(offsets), wall)
            if strikes:
                for offset in offsets:
                    strikes.pop(offset, None)

    def _handle(self, packet: object) -> None:
        bridge = self.bridge
        if packet.__class__ is Publish or packet.__class__ is OversizePublish:
            bridge.received(self, packet)  # type: ignore[arg-type]
            return
        if isinstance(packet, SubAck):
            refused = [f for f, c in zip(
                [r.remote_filter for r in bridge.spec.rules if r.receives], packet.codes,
                strict=False) if c == 0x80]
            if refused:
                log.warning("bridge %s: the upstream refused the subscription(s) %s",
                            bridge.spec.name, ", ".join(map(repr, refused)))
                bridge.last_error = f"subscription refused: {', '.join(refused)}"
            else:
                bridge.subscriptions_held()
            return
        if isinstance(packet, PingResp):
            self.pinged = False
            return
        if isinstance(packet, PubRel):
            bridge.release_in(self, packet.packet_id)
            return
        raise LinkDown(f"unexpected {type(packet).__name__} from the upstream")

    async def _writer(self) -> None:
        bridge = self.bridge
        spec = bridge.spec
        broker = bridge.broker
        server = bridge.server
        conn = bridge.conn_id
        keepalive = spec.keepalive_s
        window = spec.inflight
        rate = spec.max_rate
        # a token bucket whose burst is one window (at most a second's worth): a bucket a
        # second deep let an idle link send max_rate messages at once, a drain of 300 at
        # 200/s in 0.5 s
        burst = float(min(rate, window)) if rate else math.inf
        tokens = burst
        refilled = trio.current_time()
        while True:
            if not self.open:
                raise LinkDown(_UNSTORED)
            if self.done:
                self._ack_core()
            now = trio.current_time()
            due = self._watch(now, keepalive)
            if rate:
                tokens = min(burst, tokens + (now - refilled) * rate)
                refilled = now
            room = self._room(window)
            if rate:
                room = min(room, int(tokens))
            parts = self.outbox
            self.outbox = []
            if room > 0 and bridge.rules_by_sub:
                # ``total``: the window covers every out rule, not each (an upstream drops
                # what comes past its own limit, acknowledged or not)
                taken = broker.deliver(conn, room, _MAX_BATCH_BYTES, int(now * 1000),
                                       wall_ms(), total=room)
                if server.redelivery_dozes and taken.batches:
                    server.flights_began()
                if taken.batches:
                    sent = self._encode(taken.batches, parts, now)
                    if rate:
                        tokens -= sent
                if taken.released and server.room:
                    server.release(taken.released)
                if taken.fetches and server.prefetcher is not None:
                    server.prefetcher.request(taken.fetches)
                server.log_touched()
            self._flush(parts)
            if parts:
                await self.stream.send_all(b"".join(parts))
                continue
            bridge._kick = trio.Event()
            # awake when the next check is due (the ping, the silence, the oldest PUBLISH's
            # wait), not up to a quarter keepalive after: a silent link was noticed up to
            # 1.75 x the keepalive after the last byte came
            wait = min(keepalive / 4 if keepalive else math.inf, max(due - now, 0.001))
            if rate and tokens < 1:
                wait = min(wait, (1 - tokens) / rate)
            with trio.move_on_after(wait):
                await bridge._kick.wait()

    def _watch(self, now: float, keepalive: float) -> float:
        """The keepalive's checks: a link silent for 1.5 x the keepalive, or whose oldest
        PUBLISH waited that long for its acknowledgement, is down (LinkDown); a PINGREQ is
        queued once half of it passed in silence. Returns when the next check is due
        (never without a keepalive, or while the reader waits for room in the log: that
        silence is ours)."""
        if not keepalive or self.waiting:
            return math.inf
        due = self.heard_at + 1.5 * keepalive
        if now >= due:
            raise LinkDown(f"nothing from the upstream for 1.5 x the keepalive ({keepalive} s)")
        if self.inflight:
            oldest = next(iter(self.inflight.values()))[2]
            if now >= oldest + 1.5 * keepalive:
                raise LinkDown(f"no acknowledgement for {now - oldest:.0f} s")
            due = min(due, oldest + 1.5 * keepalive)
        if not self.pinged:
            ping_at = self.heard_at + keepalive / 2
            if now >= ping_at:
                self.outbox.append(self._ping())
                self.pinged = True
            else:
                due = min(due, ping_at)
        return due

    def _ping(self) -> bytes:
        return _PINGREQ

    def _flush(self, parts: list[bytes]) -> None:
        """Bytes the protocol's own state has queued (none for MQTT: all in ``parts``)."""

    def _encode(self, batches: list[tuple[int, list[bytes]]], parts: list[bytes],
                now: float) -> int:
        """The core's deliveries as the upstream's PUBLISHes; returns how many were sent.
        Bridged-in messages whose topic this bridge brings in are not sent back.

        A QoS 1 rule's message sent for the first time goes out as the head its record's
        head and topic gave the last time (``heads``, one dict per rule: flags, TTL, sizes
        and topic decide the head) and its payload: over MQTT the PUBLISH head, its packet
        id and payload; to a native upstream the record's head and topic as it takes them,
        the key and payload. Anything else (a record not seen before, DUP, QoS 0 and 2)
        takes the full way, ``_put``."""
        bridge = self.bridge
        rules = bridge.rules_by_sub
        every = bridge.spec.rules
        counters = bridge.counters
        inflight = self.inflight
        remotes = bridge.remotes
        resend = bridge.resend
        reserved = bridge.reserved
        maybe_sent, before = bridge.maybe_sent, bridge.restored_end
        largest = bridge.spec.max_message_bytes or 1 << 62  # payload bytes
        all_heads = self.heads
        add = self._add
        unpack = _HEAD.unpack_from
        pack_pid = _PID.pack
        append = parts.append
        done: dict[int, list[int]] = {}
        sent = 0
        for sub_id, records in batches:
            rule = rules[sub_id]
            heads = None
            if rule.qos == 1:
                heads = all_heads.get(sub_id)
                if heads is None or len(heads) >= _MAX_HEADS:
                    heads = all_heads[sub_id] = {}
            for rec in records:
                offset, count, _, _, flags, ttl, tlen, klen, plen = unpack(rec)
                if heads is not None and count == 1 and not (maybe_sent and offset < before):
                    head = heads.get(rec[PREFIX_SIZE:_BODY + tlen])
                    if head is not None:
                        at = _BODY + tlen + klen
                        if add is not None:  # native: the ticket its batch's PUB_ACK settles
                            pid = add(head + rec[at - klen:at + plen], plen)
                        else:
                            pid = offset % 65535 + 1  # ``_pid``'s first choice, mostly free
                            if pid in inflight or pid in reserved:
                                pid = self._pid(offset)
                            append(head + pack_pid(pid) + rec[at:at + plen])
                        inflight[pid] = (sub_id, offset, now)
                        sent += 1
                        continue
                if maybe_sent and count == 1 and offset < before:
                    count = 2  # it may have gone out before this broker restarted: DUP
                    maybe_sent -= 1
                local = rec[_BODY:_BODY + tlen]
                if flags & FLAG_BRIDGED and imports(every, local.decode("utf-8", "replace")):
                    counters["skipped"] += 1  # it came from the upstream: not back to it
                    done.setdefault(sub_id, []).append(offset)
                    continue
                remote = remotes.get((sub_id, local))
                if remote is None:
                    if len(remotes) >= 4096:
                        remotes.clear()
                    remote = remotes[sub_id, local] = rule.to_remote(
                        local.decode("utf-8", "replace")).encode()
                # a QoS 2 message sent before the last link went down keeps its packet id
                again = resend.pop((sub_id, offset), 0) if resend else 0
                if again:
                    reserved.discard(again)
                try:
                    if not remote:  # ``Rule.to_remote``: no upstream name
                        name = local.decode("utf-8", "replace")
                        raise LocalProtocolError(f"the rule {rule.text()!r} gives {name!r} no "
                                                 "upstream name (docs/BRIDGE.md, Topic rules)")
                    if plen > largest:  # the upstream is known to drop it (docs/BRIDGE.md)
                        raise LocalProtocolError(
                            f"a message of {plen} bytes, larger than bridge "
                            f"{bridge.spec.name}'s max_message_bytes ({largest})")
                    at = _BODY + tlen + klen  # the payload's start
                    key = self._put(rule, remote, rec, flags, ttl, at, klen, plen, count,
                                    offset, parts, again)
                except LocalProtocolError as exc:  # the upstream could never take it
                    counters["refused"] += 1
                    bridge.server.wake(bridge.give_up(sub_id, offset,
                                                      f"bridge {bridge.spec.name}: {exc}"))
                    bridge.server.log_touched()
                    continue
                sent += 1
                if rule.qos:
                    inflight[key] = (sub_id, offset, now)
                    if count > 1:
                        counters["redelivered"] += 1
                    elif heads is not None:  # this record's head and topic, next time
                        heads[rec[PREFIX_SIZE:_BODY + tlen]] = self._head(
                            remote, flags, ttl, klen, plen)
                else:
                    done.setdefault(sub_id, []).append(offset)
                    counters["forwarded"] += 1
        bridge.maybe_sent = maybe_sent
        if done:
            wall = wall_ms()
            for sub_id, offsets in done.items():
                bridge.broker.ack(bridge.conn_id, sub_id, tuple(offsets), wall)
        return sent

    def _put(self, rule: Rule, topic: bytes, rec: bytes, flags: int, ttl: int, at: int,
             klen: int, plen: int, count: int, offset: int, parts: list[bytes],
             pid: int = 0) -> int:
        """One delivery record (its payload at ``at``, after a key of ``klen`` bytes) onto
        ``parts`` as ``topic`` (the upstream's name, UTF-8); returns its packet id (0 at
        QoS 0): ``pid`` when given (a QoS 2 message sent again), else a free one. Raises
        LocalProtocolError for one the protocol cannot carry."""
        qos = rule.qos
        if qos and not pid:
            pid = offset % 65535 + 1  # ``_pid``'s first choice, mostly free: no call for it
            if pid in self.inflight or pid in self.bridge.reserved:
                pid = self._pid(offset)
        parts.append(mqtt.encode_publish(
            topic, rec[at:at + plen], qos,
            self.bridge.spec.outgoing_retain and bool(flags & FLAG_RETAIN),
            count > 1 and qos > 0, pid))
        return pid

    def _head(self, topic: bytes, flags: int, ttl: int, klen: int, plen: int) -> bytes:
        """What goes before a QoS 1 message's packet id and payload (``heads``): the
        PUBLISH head of ``topic`` (the upstream's name)."""
        return mqtt.publish_head(topic, plen, 1,
                                 self.bridge.spec.outgoing_retain and bool(flags & FLAG_RETAIN))

    def _goodbye(self) -> bytes:
        """DISCONNECT (no will), after the state topic's "0" when there is one."""
        state = self.bridge.spec.state_topic
        down = mqtt.encode(Publish(state, b"0", 0, True)) if state else b""
        return down + mqtt.encode(Disconnect())

    async def close(self) -> None:
        self.open = False
        try:
            with trio.move_on_after(1):
                if not self.peer_closed:
                    await self.stream.send_all(self._goodbye())
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await trio.aclose_forcefully(self.stream)


_PINGREQ = mqtt.encode(PingReq())
_CONNACK = {1: "unacceptable protocol version", 2: "client id rejected",
            3: "server unavailable", 4: "bad user name or password", 5: "not authorized"}


_ACK = struct.Struct(">BBH")  # PUBACK, PUBREC, PUBREL, PUBCOMP: type, 2, packet id


def _pubacks(data: bytes) -> list[object] | None:
    """The packet ids of ``data`` when it holds PUBACKs only (4 bytes each), else None (the
    decoder takes it): a drain reads thousands of them at a time."""
    pids: list[object] = []
    append = pids.append
    for kind, length, pid in _ACK.iter_unpack(data):
        if kind != 0x40 or length != 2:
            return None
        append(pid)
    return pids


def _tcp_socket(stream: trio.abc.Stream) -> Any:
    """The TCP socket under ``stream`` (TLS or not) when it can ACK at once, else None."""
    if not _QUICKACK:
        return None
    inner = getattr(stream, "transport_stream", stream)
    return getattr(inner, "socket", None)


def _why(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, RemoteProtocolError):
        return f"protocol error from the upstream: {exc}"
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        exc = exc.__cause__  # TLS: the ssl module's error behind trio's
    verify = getattr(exc, "verify_message", None)
    if verify:
        return f"TLS: certificate verify failed: {verify}"
    if exc.__class__.__module__ == "ssl" and getattr(exc, "reason", None):
        return f"TLS: {exc.reason}"  # type: ignore[attr-defined]
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc) or type(exc).__name__
