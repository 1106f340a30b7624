"""One client connection: a reader task and the socket's writer task.

The reader decodes frames and calls the broker core by this connection's id; replies and
deliveries go through the writer, which coalesces everything pending (outbox frames plus a
DELIVER batch per subscription, from ``Broker.deliver``) into one write. While the writer is
parked with nothing under way, another connection's reader sends it the deliveries it
routed there itself (``deliver_now``), without an ``await``, so writes stay in order. What the
connection owes its peer is its output budget: past ``server.max_pending_bytes`` the reader
stops reading until the writer has caught up. The server's watchdog reads ``heard_at``,
``pinged_at`` and ``sending_since`` for keepalive and write timeouts. Trio lives here and in
the rest of ``server/`` only.

Both tasks work on the socket's file descriptor with ``os.read`` / ``os.write`` and trio's
``wait_readable`` / ``wait_writable``: a read waits first and then reads once (no failed
read before each wait), a write that the kernel takes whole does not go through the
scheduler, and either yields to the other tasks after ``_TURN_S`` of work without a wait.
The stream itself is closed only after both tasks have ended (``run``).

Over TLS (``tls``: the trio.SSLStream of a connection to a TLS listener, its handshake
done) the two I/O steps are the stream's instead: the reader's step (``_receive``) is
``receive_some``, the writer's (``_send``) is ``send_all``, chosen once per task. Nothing
else differs; ``deliver_now`` only wakes the writer, as the stream must not be written from
another task's turn while the writer may be inside it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Awaitable
from enum import Enum
from typing import TYPE_CHECKING

import trio

try:  # the function trio.testing re-exports, without trio.testing (which imports pytest
    # when it is installed: about 8 MB of the broker's memory)
    from trio._core import wait_all_tasks_blocked
except ImportError:  # pragma: no cover - a trio that moved it
    from trio.testing import wait_all_tasks_blocked

from blipmq_server.errors import RemoteProtocolError
from blipmq_server.mqtt.state import SESSION_GROUPS
from blipmq_server.protocol import codec, report
from blipmq_server.protocol.codec import ErrorCode
from blipmq_server.server.intake import FREE, Partial

if TYPE_CHECKING:
    from blipmq_server.broker.access import Access
    from blipmq_server.broker.results import Blocked, PublishResult
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.session")


def log_adopted(group: str, topic_filter: str, name: str) -> None:
    """A named key took over a group of the ``auth.api_keys`` keys (``Broker._adoptable``):
    said once, since the group is its own from then on."""
    logging.getLogger("blipmq").info(
        "group %r on %r of the api_keys keys ('*') is key %r's from now on (adopted: the key "
        "may read every topic of it)", group, topic_filter, name)


class CloseReason(Enum):
    EOF = "eof"
    GOODBYE = "goodbye"
    RESET = "reset"
    PROTOCOL_ERROR = "protocol_error"
    AUTH_FAILED = "auth_failed"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    KEEPALIVE_TIMEOUT = "keepalive_timeout"
    SLOW_CONSUMER = "slow_consumer"
    SHUTDOWN = "shutdown"
    WRITE_FAILED = "write_failed"
    TAKEN_OVER = "taken_over"  # an MQTT client connected again with the same client id
    REVOKED = "revoked"  # its key left the configuration (a reload)
    EVICTED = "evicted"  # not authenticated yet, closed at max_connections for a newcomer
    LIMIT = "limit"  # an MQTT CONNECT refused at mqtt.max_sessions or its key's share


def now_ms() -> int:
    return int(trio.current_time() * 1000)


def wall_ms() -> int:
    """Wall-clock milliseconds: log record timestamps, idle times of durable groups."""
    return int(time.time() * 1000)


_time = time.time  # ``wall_ms`` without the call, on the hot paths


_RECEIVE = 65536  # bytes a read asks for
# A cursor draining a backlog sends its next batch once nothing else is ready to run, or
# after this long at the latest: live traffic goes first, and a drain never stops
_BACKLOG_WAIT_S = 0.01
# ... and while clients publish (within _LIVE_S), it also pauses this long after each batch:
# on a small machine a drain at full speed keeps every core busy, and the publishers' and
# subscribers' own processes then wait for one (bench/drain.py; docs/PERFORMANCE.md)
_BACKLOG_PACE_S = 0.001
_LIVE_S = 0.1
_TURN_S = 0.001  # a connection with many frames waiting yields to the others after this
_TLS_PIECE = 1 << 16  # a TLS send's piece, after which the watchdog sees progress


class Session:
    protocol = "native"  # the front end's name, in counters ("mqtt": server/mqtt.py)
    # a connection's state without an attribute dict: one holds some sixty names, past
    # what CPython shares between instances, about 1 KB a connection
    __slots__ = (
        "_drained", "_fd", "_full", "_greeted", "_parked", "_read_scope", "_said_goodbye",
        "_scope", "_torn", "_via_writer", "aborted", "access", "authenticated", "broker",
        "clock", "close_reason", "closing", "conn_id", "heard_at", "held", "key_digest",
        "look_at", "outbox", "paused", "peer", "pending_bytes", "pinged_at", "read_at", "refusal",
        "sending_since", "server", "stream", "tls", "tls_identity",
    )

    def __init__(self, server: Server, stream: trio.SocketStream, conn_id: int,
                 tls: trio.SSLStream[trio.SocketStream] | None = None,
                 tls_identity: str | None = None) -> None:
        self.server = server
        self.broker = server.broker
        self.stream = stream
        self.tls = tls
        # the client certificate's name (tls.client_identity), when it sent one
        self.tls_identity = tls_identity
        self.conn_id = conn_id
        self.peer = peer_of(stream)
        self.outbox: list[bytes] = []
        # bytes this connection owes its peer: the outbox plus the send in progress; past
        # server.max_pending_bytes the reader stops until the writer has caught up
        self.pending_bytes = 0
        self.authenticated = False
        # the connection's permissions once authenticated (None: no limits), and the answer
        # to a refused key, sent after the delay that slows guessing (``run``)
        self.access: Access | None = None
        self.key_digest = b""  # of the key it was admitted with (b"": no keys in force)
        self.refusal: bytes | None = None
        self.closing = False  # no more frames will be read; the writer drains and exits
        self.close_reason: CloseReason | None = None
        self._greeted = False
        self._said_goodbye = False
        # the writer task while it waits for something to send (``wake`` resumes it)
        self._parked: trio.lowlevel.Task | None = None
        self._drained = trio.Event()
        self._read_scope: trio.CancelScope | None = None
        # for the server's watchdog: when something last came in, when our keepalive PING
        # went out (None: not waiting for an answer), when the send under way began
        self.clock = trio.lowlevel.current_clock().current_time  # trio's time, one call
        self.heard_at = self.clock()
        self.read_at = self.heard_at  # when the frames being handled were read
        self.pinged_at: float | None = None
        # and when its next look is due (``idle_check``): nothing can be due before then
        self.look_at = 0.0
        self.sending_since: float | None = None
        self.paused = False  # the reader waits for the writer (output budget)
        self.aborted = False  # ended without draining (slow consumer, write failure)
        self._scope: trio.CancelScope | None = None
        self._fd = stream.socket.fileno()
        self._full = False  # the last read filled the buffer: the next need not wait
        # the outbox starts with the rest of a frame a write took only part of
        # (``deliver_now``): nothing may be said before or instead of it (``cut_off``)
        self._torn = False
        # deliveries routed here go through the writer (``deliver_now``): with a linger, or
        # over TLS
        self._via_writer = server.config.delivery.flush_interval_ms > 0 or tls is not None
        # a reply held back until the log holds what it stands for (``hold_reply``): the
        # reader reads nothing more until it went out
        self.held: HeldReply | None = None

    # --------------------------------------------------------------------------- plumbing

    def wake(self) -> None:
        """Resume the writer if it waits: it looks at what is pending before it waits
        again, so a wake while it runs needs no record."""
        task = self._parked
        if task is not None:
            self._parked = None
            trio.lowlevel.reschedule(task)

    def deliver_now(self, now: float) -> None:
        """Another connection's reader routed messages to us. If our writer waits with
        nothing under way, send them from here, in the reader's turn: a delivery then costs
        no trip through trio's run loop to the writer task. Only while the writer is parked
        does anything else write this socket, and never across an ``await``, so writes
        stay in order. What the kernel does not take, and a backlog's next batch, go to the
        writer as before; so does everything while a linger or the close is on, and over
        TLS."""
        if self._parked is None or self.closing or self._via_writer:
            self.wake()
            return
        opts = self.server.config.delivery
        data, behind = self._collect(opts.max_batch, opts.max_batch_bytes, now)
        if not data:
            if self.broker.pending(self.conn_id):  # not to take yet: the writer's loop
                self.wake()  # looks again after the others had their turn
            return
        if not self._write_now(data):
            return
        if self.paused:  # the reader waits until the writer caught up
            self._drained.set()
        if behind or self.broker.pending(self.conn_id):  # more than a batch was waiting
            self.wake()

    def _write_now(self, data: bytes) -> bool:
        """One write of ``data`` (counted in ``pending_bytes``) while the writer is parked
        (``deliver_now``, ``reply_now``); True if the kernel took all of it. What it did
        not take waits first in the outbox, whole, for the writer (``_torn``); a failed
        write aborts the connection."""
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.abort(CloseReason.WRITE_FAILED)
            return False
        self.pending_bytes -= sent
        if sent < len(data):
            self.outbox.insert(0, data[sent:])  # still counted in pending_bytes
            self._torn = True
            self.wake()
            return False
        return True

    def idle_check(self, now: float, idle: float) -> float:
        """The watchdog's look at a quiet connection: silent for ``idle`` (keepalive_ms), it
        gets a PING; silent as long again, GOODBYE TIMEOUT. Returns when the next look is
        due at the earliest (what it hears meanwhile only puts that later)."""
        if not idle:
            return math.inf
        if self.pinged_at is None:
            if now - self.heard_at < idle:
                return self.heard_at + idle
            self.pinged_at = now  # ask for a sign of life
            self.send(codec.Ping(b"keepalive"))
            return now + idle
        if now - self.pinged_at < idle:
            return self.pinged_at + idle
        self.send(codec.Goodbye(ErrorCode.TIMEOUT, f"nothing received for "
                                f"{2 * idle:g} s (server.keepalive_ms)"))
        self.stop_reading(CloseReason.KEEPALIVE_TIMEOUT)
        return math.inf

    def revoke(self) -> None:
        """A reload removed its key: nothing more goes out on its authority, and the
        connection closes at once, saying so when it can (``cut_off``)."""
        self.cut_off(CloseReason.REVOKED, codec.encode(codec.Goodbye(
            ErrorCode.AUTH_FAILED, "the key of this connection was revoked")))

    def cut_off(self, reason: CloseReason, last: bytes = b"") -> None:
        """End the connection at once on the broker's word (a reload took its key's
        authority away). Its subscriptions end now, not after a drain: what they had
        queued for it and not yet written goes with them, and what it had in flight from
        the log goes back to its group unacked (a persistent session's durable groups
        keep it for the session's next connection). Nothing is read any more. What it is
        owed already (replies) goes out, then ``last`` (the native GOODBYE), then the
        connection closes; but with a write under way, or the rest of one waiting, the
        connection closes at once instead: a frame cut short cannot be followed by
        another, and finishing it could take as long as the peer likes."""
        self.server.detached(self.broker.disconnect(self.conn_id, wall_ms()))
        self.server.log_touched()  # a durable group's idle record
        if self.sending_since is not None or self._torn:
            self.abort(reason)
            return
        if last:
            self.send_bytes(last)
        self.stop_reading(reason)

    def closed(self) -> None:
        """The connection has ended, before its subscriptions are detached."""

    def farewell(self) -> bool:
        """The last thing said on shutdown, once every delivery went out; whether
        something was queued."""
        self.send(codec.Goodbye(ErrorCode.SHUTTING_DOWN, "broker is shutting down"))
        return True

    def _unpark(self, _: object) -> trio.lowlevel.Abort:
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    def send_bytes(self, data: bytes) -> None:
        """Queue encoded bytes for the writer (any protocol's)."""
        self.outbox.append(data)
        self.pending_bytes += len(data)
        self.wake()

    def send(self, frame: codec.Frame) -> None:
        self.send_bytes(codec.encode(frame))

    def reply_now(self, data: bytes) -> None:
        """A reply to what the reader just read (a PINGRESP, a PONG), written in the
        reader's own turn when the writer waits with nothing queued, as ``deliver_now``
        writes deliveries: it then costs no trip through trio's run loop to the writer
        task (that took two waits for events a ping instead of one, and about 50 us more
        of CPU here). Otherwise, and over TLS, it goes to the writer (``send_bytes``)."""
        if self._parked is None or self.outbox or self.closing or self._via_writer:
            self.send_bytes(data)
            return
        self.pending_bytes += len(data)
        self._write_now(data)

    def confirmed(self, request_id: int, count: int) -> None:
        """The flusher: ``count`` QoS 1 messages of ``request_id`` are durable."""
        self.send(codec.PubAck(count, request_id))

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        """The flusher: the log could not store the messages of ``request_id``."""
        self.error(ErrorCode.STORAGE, text, request_id)
        self.send(codec.PubAck(0, request_id))
        self.broker.counters.refused += count

    def error(self, code: ErrorCode, text: str, request_id: int = 0) -> None:
        self.send(codec.Error(code, text, request_id))

    def hold_reply(self, offset: int, reply: bytes, request_id: int = 0, what: str = ""
                   ) -> None:
        """Send ``reply`` once the log holds ``offset`` (0: at once), as a QoS 1 confirm
        waits (``Flusher.confirm_later``; durably under ``always``). Until then the reader
        reads nothing more (``_reply_out``), so no later reply overtakes it. Should the
        log fail to store it, ``reply_failed`` answers instead (``what``: what was done,
        for the person reading the error)."""
        flusher = self.server.flusher
        if not offset or flusher is None or flusher.durable(offset):
            self.send_bytes(reply)
            return
        self.held = held = HeldReply(self, reply, what)
        flusher.confirm_later(offset, held, request_id, 0)

    def reply_failed(self, request_id: int, what: str, text: str) -> None:
        """The log could not store the records a held reply stood for; the broker's memory
        has the change and appends them again for its next batch (``Broker.relog``), so
        the reply is ERROR STORAGE saying so, not a success."""
        self.error(ErrorCode.STORAGE, f"{what}, but the log could not store that ({text}); "
                   "the broker stores it with its next successful write, and a restart of "
                   "the broker before then undoes it", request_id)

    async def _held_back(self, budget: int, decoder: Partial, until: float) -> bool:
        """Before each read, both protocols': wait while the connection owes more than
        ``budget`` of output (the peer does not read what it asks for; the write timeout
        ends one that never does), while more than ``wal.max_unwritten_bytes`` waits for
        the disk (publishers outrun it), or while the frame it is reading is larger than
        ``intake.FREE`` and the broker's ``server.max_reading_bytes`` has no room for it
        (``Intake``; before the handshake is done, the room of one frame that handshakes
        share, until its deadline ``until`` at most: TooSlowError, as a read's). Whether
        it waited (then look again)."""
        if self.pending_bytes > budget:
            self._drained = trio.Event()
            await self._waiting(self._drained.wait())
            return True
        server = self.server
        flusher = server.flusher
        limit = server.config.wal.max_unwritten_bytes
        if flusher is not None and flusher.full(limit):
            await self._waiting(flusher.room(limit))
            return True
        # before the handshake is done, from a pool of their own: peers that never
        # authenticate cannot take the room of those that did (``Server.handshakes``)
        intake, other = ((server.intake, server.handshakes) if self.authenticated
                         else (server.handshakes, server.intake))
        if other.held:
            other.give_back(self.conn_id)  # the frame of the handshake is done
        if decoder.buffered > FREE:
            wanted = decoder.wanted
            if intake.held.get(self.conn_id, 0) < wanted and not intake.take(self.conn_id,
                                                                              wanted):
                with trio.fail_at(until):
                    await self._waiting(intake.wait(self.conn_id, wanted))
                return True
        elif intake.held:
            intake.give_back(self.conn_id)
        return False

    async def _waiting(self, wait: Awaitable[object]) -> None:
        """Wait for the broker (room in a queue, for the log, a held reply) reading nothing:
        the peer's silence meanwhile is the broker's doing, so it does not count against
        its keepalive (``paused``), and its clock starts again after."""
        self.paused = True
        try:
            await wait
        finally:
            self.paused = False
            self.heard_at = self.clock()

    async def _reply_out(self) -> None:
        """The reader waits while a reply is held for the log: what its frames routed and
        appended goes first (as at the end of a read), then nothing more is read until
        the reply went out or failed."""
        held = self.held
        if held is None:
            return
        self.held = None
        self.server.deliver_routed(self.read_at)
        self.server.log_touched()
        await self._waiting(held.done.wait())
        self.read_at = self.clock()

    def stop_reading(self, reason: CloseReason) -> None:
        """Stop intake (shutdown, a keepalive timeout); the writer drains what is queued."""
        if self.close_reason is None:
            self.close_reason = reason
        if self._read_scope is not None:
            self._read_scope.cancel()

    def abort(self, reason: CloseReason) -> None:
        """End the connection now, reader and writer, without draining anything."""
        self.aborted = True
        if self.close_reason is None:
            self.close_reason = reason
        if self._scope is not None:
            self._scope.cancel()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._write_loop)
                reason = await self._read_loop()
                if self.close_reason is None:
                    self.close_reason = reason
                if reason is CloseReason.AUTH_FAILED:
                    await self.server.auth_failed(self)
                    if self.refusal is not None:
                        self.send_bytes(self.refusal)
                self.closing = True
                self.wake()
        finally:
            self.closed()
            self.server.detached(self.broker.disconnect(self.conn_id, wall_ms()))
            self.server.log_touched()  # a group's idle record
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
            log.debug("connection %d from %s closed: %s", self.conn_id, self.peer,
                      self.close_reason.value if self.close_reason else "cancelled")

    # ----------------------------------------------------------------------------- writer

    async def _write_loop(self) -> None:
        opts = self.server.config.delivery
        linger = opts.flush_interval_ms / 1000
        fd = self._fd
        send = self._send if self.tls is None else self._send_tls
        clock = self.clock
        turn = clock() + _TURN_S
        woken = True
        try:
            while True:
                if not self.outbox and not self.broker.pending(self.conn_id, self.closing):
                    if self.closing:
                        if self.close_reason is CloseReason.SHUTDOWN and not self._said_goodbye:
                            # only now: every delivery queued for us went out before it
                            self._said_goodbye = True
                            if self.farewell():
                                continue
                        return
                    if self.server.redelivery_dozes:  # ``pending`` may have starved us
                        self.server.flights_began()
                    self._parked = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._unpark)
                    woken = True
                    continue
                now = clock()
                if woken:
                    woken = False
                    turn = now + _TURN_S
                elif now > turn:  # sending without a pause: let the other tasks in
                    await trio.lowlevel.checkpoint()
                    now = clock()
                    turn = now + _TURN_S
                if linger and not self.outbox:
                    await trio.sleep(linger)  # let a batch fill (delivery.flush_interval_ms)
                    now = clock()
                data, behind = self._collect(opts.max_batch, opts.max_batch_bytes, now)
                if data:
                    await send(fd, data, now)
                    self.pending_bytes -= len(data)
                    if self.paused:  # the reader waits until the writer caught up
                        self._drained.set()
                    if behind:  # a backlog drain: live traffic first, the next batch after
                        with trio.move_on_after(_BACKLOG_WAIT_S):
                            await wait_all_tasks_blocked()
                        if clock() - self.server.published_at < _LIVE_S:
                            await trio.sleep(_BACKLOG_PACE_S)
                else:  # something pending, nothing to take yet: the others first
                    await trio.lowlevel.checkpoint()
                    woken = True
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            self.abort(CloseReason.WRITE_FAILED)

    async def _send(self, fd: int, data: bytes, now: float) -> None:
        """Write all of ``data``, waiting only when the socket's buffer is full. The
        server's watchdog closes the connection once a send made no progress for the write
        timeout (``sending_since``: when the last progress was made)."""
        view = memoryview(data)
        total = len(data)
        self.sending_since = now
        at = 0
        while True:
            try:
                sent = os.write(fd, view[at:])
            except BlockingIOError:
                sent = 0
            at += sent
            if at >= total:
                break
            if sent:
                self.sending_since = self.clock()
            await trio.lowlevel.wait_writable(fd)
        self.sending_since = None

    async def _send_tls(self, fd: int, data: bytes, now: float) -> None:
        """``_send`` over TLS: ``send_all`` in pieces, so that the watchdog sees progress
        as it does for a plain socket (``fd`` is not used: the stream owns the socket)."""
        assert self.tls is not None
        send_all = self.tls.send_all
        view = memoryview(data)
        self.sending_since = now
        for at in range(0, len(data), _TLS_PIECE):
            if at:
                self.sending_since = self.clock()
            await send_all(view[at:at + _TLS_PIECE])
        self.sending_since = None

    def _collect(self, max_batch: int, max_batch_bytes: int, now: float) -> tuple[bytes, bool]:
        """The outbox and a DELIVER batch per subscription with something to take. Once
        closing, QoS 1 subscriptions take nothing more: what they took would only go back
        to their cursor, one delivery count higher."""
        parts = self.outbox
        self.outbox = []
        self._torn = False  # what it held is in ``parts``, which go out whole (or abort)
        owed = sum(map(len, parts))  # counted in pending_bytes when they were sent
        taken = self.broker.deliver(self.conn_id, max_batch, max_batch_bytes, int(now * 1000),
                                    int(_time() * 1000), qos0_only=self.closing)
        if self.server.redelivery_dozes:  # (a take refused for room may starve it too)
            self.server.flights_began()
        if taken.batches:
            self.encode_batches(taken.batches, parts)
        if taken.released and self.server.room:  # publishers wait for room
            self.server.release(taken.released)
        if taken.fetches:
            self.server.prefetcher.request(taken.fetches)  # type: ignore[union-attr]
        data = b"".join(parts)
        self.pending_bytes += len(data) - owed
        return data, taken.behind

    def encode_batches(self, batches: list[tuple[int, list[bytes]]], parts: list[bytes]
                       ) -> None:
        """Deliveries as this protocol's bytes, appended to ``parts``: a DELIVER frame per
        subscription (heads and records joined once, by the caller)."""
        for sub_id, records in batches:
            parts.append(codec.deliver_head(sub_id, records))
            parts += records

    # ----------------------------------------------------------------------------- reader

    async def _read_loop(self) -> CloseReason:
        cfg = self.server.config.server
        decoder = codec.Decoder(self.server.max_frame)
        receive = self._receive if self.tls is None else self._receive_tls
        clock = self.clock
        publish = codec.Publish
        budget = cfg.max_pending_bytes
        handshake = cfg.handshake_timeout_ms / 1000 or math.inf
        with trio.CancelScope() as scope:
            self._read_scope = scope
            deadline = trio.current_time() + handshake
            while True:
                until = math.inf if self.authenticated else deadline
                try:  # once authenticated, silence is the watchdog's business
                    if await self._held_back(budget, decoder, until):
                        continue
                    data = await receive(until)
                except trio.TooSlowError:
                    self.error(ErrorCode.TIMEOUT, "handshake not completed in time")
                    return CloseReason.HANDSHAKE_TIMEOUT
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return CloseReason.RESET
                if data is None:
                    continue
                self.heard_at = self.read_at = clock()
                self.pinged_at = None
                if not data:
                    return CloseReason.EOF
                decoder.feed(data)
                try:
                    while True:  # again after the good frames: a bad one behind them raises now
                        try:
                            frames = decoder.frames()
                        except RemoteProtocolError as exc:
                            self.error(ErrorCode(exc.code), str(exc))
                            return CloseReason.PROTOCOL_ERROR
                        if not frames:
                            break
                        turn = self.read_at + _TURN_S
                        last = frames[-1]
                        for frame in frames:
                            if frame.__class__ is publish and self.authenticated:
                                held = self._publish(frame)  # type: ignore[arg-type]
                                if held is not None:  # a full ``block`` queue
                                    await self._publish_held(held)
                            else:
                                reason = self._handle(frame)
                                if reason is not None:
                                    return reason
                                if self.held is not None:  # its reply waits for the log
                                    await self._reply_out()
                                    turn = self.read_at + _TURN_S
                            if frame is not last and clock() > turn:  # let the others in
                                self.server.deliver_routed(self.read_at)
                                self.server.log_touched()
                                await trio.lowlevel.checkpoint()
                                self.read_at = clock()
                                turn = self.read_at + _TURN_S
                finally:
                    # one look per chunk read: what its frames routed to subscribers goes
                    # out (first: that is the latency), and whatever they appended to the
                    # log (messages, acks, group records, dead letters) goes to the flusher
                    # together
                    self.server.deliver_routed(self.read_at)
                    self.server.log_touched()
                    # not kept while the reader waits for its next read: a PUBLISH batch
                    # can be max_message_bytes, and a reader per connection waits
                    frames = frame = last = None  # type: ignore[assignment]
        return self.close_reason or CloseReason.SHUTDOWN

    async def _receive(self, deadline: float) -> bytes | None:
        """The reader's one read, both protocols': what came (b"": the end of the stream),
        or None when there was nothing after all. It waits for the socket, until
        ``deadline`` at most (the handshake's; math.inf after it: TooSlowError then), and
        reads once; after a read that filled the buffer the next one reads without a wait.
        OSError and trio's stream errors: the connection broke."""
        fd = self._fd
        if self._full:  # the rest is likely there already
            await trio.lowlevel.checkpoint()
        elif deadline == math.inf:
            await trio.lowlevel.wait_readable(fd)
        else:
            with trio.fail_at(deadline):
                await trio.lowlevel.wait_readable(fd)
        try:
            data = os.read(fd, _RECEIVE)
        except BlockingIOError:
            self._full = False
            return None
        self._full = len(data) == _RECEIVE
        return data

    async def _receive_tls(self, deadline: float) -> bytes | None:
        """``_receive`` over TLS: what the stream decrypted (it may hold more than the
        socket shows, so it is asked, not the socket)."""
        assert self.tls is not None
        if deadline == math.inf:
            return await self.tls.receive_some(_RECEIVE)
        with trio.fail_at(deadline):
            return await self.tls.receive_some(_RECEIVE)

    def _handle(self, frame: codec.Frame) -> CloseReason | None:
        """Any frame but an authenticated connection's PUBLISH (``_publish``)."""
        rid = frame.request_id
        if not self._greeted:
            return self._hello(frame)
        if not self.authenticated:
            return self._auth(frame)
        match frame:
            case codec.Ping():
                self.reply_now(codec.encode(codec.Pong(frame.data, rid)))
            case codec.Pong():
                pass  # the answer to our keepalive PING: receiving it was the point
            case codec.Stats():
                self._stats(rid)
            case codec.Subscribe():
                self._subscribe(frame)
            case codec.Unsubscribe():
                self._unsubscribe(frame)
            case codec.Ack():
                # acks of QoS 0 deliveries are accepted and ignored
                if self.broker.ack(self.conn_id, frame.sub_id, frame.offsets, wall_ms()):
                    self.wake()  # the consumer's window has room again
            case codec.Nack():
                self.server.wake(self.broker.nack(self.conn_id, frame.sub_id, frame.offsets,
                                                  frame.delay_ms, now_ms(), wall_ms(),
                                                  frame.reason))
            case codec.Credit():
                if self.broker.set_credit(self.conn_id, frame.sub_id, frame.credit):
                    self.wake()
            case codec.Goodbye():
                return CloseReason.GOODBYE
            case _:
                self.error(ErrorCode.PROTOCOL, f"{type(frame).__name__} is not a client frame", rid)
                return CloseReason.PROTOCOL_ERROR
        return None

    def _hello(self, frame: codec.Frame) -> CloseReason | None:
        if not isinstance(frame, codec.Hello):
            self.error(ErrorCode.PROTOCOL, "the first frame must be HELLO", frame.request_id)
            return CloseReason.PROTOCOL_ERROR
        if frame.version != codec.VERSION:
            self.error(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {frame.version} is not supported (this broker speaks "
                f"{codec.VERSION})",
                frame.request_id,
            )
            return CloseReason.PROTOCOL_ERROR
        self._greeted = True
        cfg = self.server.config.server
        self.send(codec.Welcome(codec.VERSION, self.server.max_frame, cfg.max_message_bytes,
                                "blipmq", frame.request_id))
        return None

    def _auth(self, frame: codec.Frame) -> CloseReason | None:
        if not isinstance(frame, codec.Auth):
            self.error(ErrorCode.NOT_AUTHENTICATED, "authenticate (AUTH) before anything else",
                       frame.request_id)
            return CloseReason.PROTOCOL_ERROR
        identity = self.server.authenticate(self, frame.api_key.encode())
        if identity is None:  # answered after a delay (``run``)
            self.refusal = codec.encode(codec.Error(ErrorCode.AUTH_FAILED, "API key refused",
                                                    frame.request_id))
            return CloseReason.AUTH_FAILED
        self.authenticated = True
        self.send(codec.AuthOk(frame.request_id))
        return None

    def _publish(self, frame: codec.Publish) -> _Held | None:
        """Route a PUBLISH, without waiting: None once it is done, or what is left of it
        when a full ``block`` queue held it back (``_publish_held`` goes on with that)."""
        now = self.server.published_at = self.read_at
        result = self.broker.publish(frame.messages, int(now * 1000), int(_time() * 1000),
                                     access=self.access)
        self.server.routed(result.wake)
        if result.blocked is None and result.refusal is None:  # the usual: all were taken
            if result.confirms:  # QoS 1 messages: they were all logged
                self._acknowledge(frame, result.confirms, result.last_offset,
                                  result.first_offset)
            return None
        held = _Held(frame)
        if self._routed(held, result):
            return held
        self._acknowledge(frame, held.confirms, held.last_offset, held.first_offset)
        return None

    async def _publish_held(self, held: _Held) -> None:
        """Wait for room and route the rest, as often as it takes. The PUB_ACK goes out
        however this ends (a refusal, the connection closing while it waits)."""
        server = self.server
        try:
            while held.blocked is not None:
                server.log_touched()  # what was accepted need not wait with us
                await self._waiting(server.wait_for_room(held.blocked))
                now = self.read_at = self.clock()  # the frames after this one, too
                result = self.broker.publish(held.messages, int(now * 1000), wall_ms(),
                                             access=self.access)
                server.routed(result.wake)
                self._routed(held, result)
        finally:
            self._acknowledge(held.frame, held.confirms, held.last_offset, held.first_offset)

    def _routed(self, held: _Held, result: PublishResult) -> bool:
        """Count what the broker took of ``held``; whether a full queue stopped the rest
        (``held.blocked``). A refusal is sent as an ERROR, and ends the frame."""
        messages = held.messages
        held.confirms += result.confirms
        held.last_offset = result.last_offset or held.last_offset
        held.first_offset = held.first_offset or result.first_offset
        held.blocked = None
        if result.refusal is not None:
            # the core counted the refused message; a native batch ends there, so the
            # messages after it are refused with it (docs/PROTOCOL.md): counted here
            self.broker.counters.refused += len(messages) - result.accepted - 1
            total = len(held.frame.messages)
            done = total - len(messages) + result.accepted
            text = result.refusal.text
            if total > 1:
                text += f" (message {done + 1} of the batch; {done} before it were accepted)"
            self.error(result.refusal.code, text, held.frame.request_id)
            return False
        if result.blocked is None:
            return False
        held.blocked = result.blocked
        held.messages = messages[result.accepted:]
        return True

    def _acknowledge(self, frame: codec.Publish, confirms: int, last_offset: int,
                     first_offset: int) -> None:
        """A frame with QoS 1 messages gets exactly one PUB_ACK, counting the ``confirms``
        that became durable (possibly after an ERROR about the rest): once the log holds
        ``last_offset``."""
        if not any(m.qos for m in frame.messages):
            return
        flusher = self.server.flusher
        if confirms and flusher is not None:
            flusher.confirm_later(last_offset, self, frame.request_id, confirms, first_offset)
        else:
            self.send(codec.PubAck(0, frame.request_id))

    def _session_group(self, group: str, request_id: int) -> bool:
        """A group named as an MQTT persistent session's own (``mqtt.``): no native client
        joins or deletes one (it would take, or end, that session's queue); ERROR sent."""
        if not group.startswith(SESSION_GROUPS):
            return False
        self.error(ErrorCode.INVALID_REQUEST, f"group names starting with {SESSION_GROUPS!r} "
                   "belong to MQTT persistent sessions (docs/MQTT.md): no native client may "
                   "join or delete one", request_id)
        return True

    def _subscribe(self, frame: codec.Subscribe) -> None:
        if self._session_group(frame.group, frame.request_id):
            return
        result = self.broker.subscribe(
            self.conn_id, frame.topic_filter, frame.group, frame.qos, frame.credit,
            frame.request_id, frame.start, frame.start_offset, wall_ms(),
            bool(frame.flags & codec.SUBSCRIBE_UNTIL_END), access=self.access,
        )
        if result.refusal is not None:
            self.error(result.refusal.code, result.refusal.text, frame.request_id)
            return
        if result.adopted:
            log_adopted(frame.group, frame.topic_filter, result.adopted)
        self.send(codec.Subscribed(result.sub_id, frame.request_id, result.end))
        counts = self.broker.take_counts()
        if counts:  # a durable group created to replay: its backlog is counted apart
            self.server.prefetcher.request(counts)  # type: ignore[union-attr]
        if result.ready:
            self.wake()  # a group's backlog waits for its new consumer

    def _stats(self, request_id: int) -> None:
        if self.access is not None and not self.access.identity.admin:
            # what the broker is, nothing of what others publish, read or own
            data = json.dumps(self.server.about() | {
                "restricted": True, "key": self.access.identity.name}).encode()
            self.send(codec.StatsReport(data, request_id))
            return
        # within the frame the client decodes with: fewer entries listed if need be
        limit = self.server.max_frame - codec.MIN_LENGTH
        self.send(codec.StatsReport(report.fit(self.server.stats(report.most(limit)), limit),
                                    request_id))

    def _unsubscribe(self, frame: codec.Unsubscribe) -> None:
        if self._session_group(frame.group, frame.request_id):
            return
        result = self.broker.unsubscribe(self.conn_id, frame.sub_id, frame.topic_filter,
                                         frame.group, wall_ms(), self.access)
        if result.refusal is not None:
            self.error(result.refusal.code, result.refusal.text, frame.request_id)
            return
        self.server.detached(result.detached)
        for ended in result.ended:
            self.server.notify_ended(ended)
        # a group deleted: UNSUBSCRIBED once its deletion is durable, or a crash would
        # bring back the group the client was told is gone
        self.hold_reply(result.logged, codec.encode(
            codec.Unsubscribed(result.count, frame.request_id)), frame.request_id,
            f"group {frame.group!r} on {frame.topic_filter!r} is deleted")


class HeldReply:
    """A reply that waits on the flusher as a QoS 1 confirm does (``Session.hold_reply``):
    sent when the log holds its records, or ``Session.reply_failed`` when it could not
    store them; ``done`` either way."""

    __slots__ = ("done", "reply", "session", "what")

    def __init__(self, session: Session, reply: bytes, what: str) -> None:
        self.session = session
        self.reply = reply
        self.what = what
        self.done = trio.Event()

    def confirmed(self, request_id: int, count: int) -> None:
        self.session.send_bytes(self.reply)
        self.done.set()

    def confirm_failed(self, request_id: int, count: int, text: str) -> None:
        self.session.reply_failed(request_id, self.what, text)
        self.done.set()


class _Held:
    """A PUBLISH frame on its way through the broker: what is left of it, what a full
    ``block`` queue holds back, and what its PUB_ACK will count."""

    __slots__ = ("blocked", "confirms", "first_offset", "frame", "last_offset", "messages")

    def __init__(self, frame: codec.Publish) -> None:
        self.frame = frame
        self.messages = frame.messages
        self.blocked: Blocked | None = None
        self.confirms = self.first_offset = self.last_offset = 0


def peer_of(stream: trio.SocketStream) -> str:
    """``host:port`` of a connection's far end ("?" once it is gone)."""
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
