"""One client connection: a reader task and the socket's only writer task.

The reader decodes frames and calls the broker core; replies and deliveries go through the
writer, which coalesces everything pending (outbox frames plus a DELIVER batch per
subscription) into one ``send_all``. Trio lives here and in the rest of ``server/`` only.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from enum import Enum
from typing import TYPE_CHECKING

import trio

from blipmq_server.broker.core import Consumer
from blipmq_server.broker.queue import Queue
from blipmq_server.errors import RemoteProtocolError
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import ErrorCode

if TYPE_CHECKING:
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.session")


class CloseReason(Enum):
    EOF = "eof"
    GOODBYE = "goodbye"
    RESET = "reset"
    PROTOCOL_ERROR = "protocol_error"
    AUTH_FAILED = "auth_failed"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    SHUTDOWN = "shutdown"
    WRITE_FAILED = "write_failed"


def now_ms() -> int:
    return int(trio.current_time() * 1000)


def wall_ms() -> int:
    """Wall-clock milliseconds: log record timestamps, idle times of durable groups."""
    return int(time.time() * 1000)


def wake_consumers(queues: set[Queue] | tuple[Queue, ...]) -> None:
    """Tell the writers of every consumer of these queues that there is work."""
    for q in queues:
        for consumer in q.consumers:
            consumer.owner.wake()


def release_waiter(queue: Queue) -> None:
    """A blocked publisher waits on this queue: there is room now (or the queue is gone)."""
    waiter = queue.waiter
    if waiter is not None:
        queue.waiter = None
        waiter.set()


class Session:
    def __init__(self, server: Server, stream: trio.SocketStream, conn_id: int) -> None:
        self.server = server
        self.broker = server.broker
        self.stream = stream
        self.conn_id = conn_id
        self.peer = _peer(stream)
        self.outbox: list[bytes] = []
        self.authenticated = False
        self.closing = False  # no more frames will be read; the writer drains and exits
        self.close_reason: CloseReason | None = None
        self._greeted = False
        self._said_goodbye = False
        self._wakeup = trio.Event()
        self._read_scope: trio.CancelScope | None = None

    # --------------------------------------------------------------------------- plumbing

    def wake(self) -> None:
        self._wakeup.set()

    def send(self, frame: codec.Frame) -> None:
        self.outbox.append(codec.encode(frame))
        self._wakeup.set()

    def error(self, code: ErrorCode, text: str, request_id: int = 0) -> None:
        self.send(codec.Error(code, text, request_id))

    def stop_reading(self, reason: CloseReason) -> None:
        """Stop intake (shutdown, or a group deletion elsewhere does not need this)."""
        if self.close_reason is None:
            self.close_reason = reason
        if self._read_scope is not None:
            self._read_scope.cancel()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, nursery.cancel_scope)
                reason = await self._read_loop()
                if self.close_reason is None:
                    self.close_reason = reason
                self.closing = True
                self._wakeup.set()
        finally:
            durable_before = [c.queue for c in self.broker.consumers_of(self) if c.queue.durable]
            removed = self.broker.disconnect(self, wall_ms())
            for q in removed:
                release_waiter(q)
            wake_consumers(tuple(durable_before))  # our unacked deliveries go to the others
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)
            log.debug("connection %d from %s closed: %s", self.conn_id, self.peer,
                      self.close_reason.value if self.close_reason else "cancelled")

    # ----------------------------------------------------------------------------- writer

    def _has_deliveries(self) -> bool:
        has_work = self.broker.has_work
        return any(has_work(c) for c in self._sending())

    def _sending(self) -> list[Consumer]:
        """Consumers to send to. Once closing, QoS 1 ones are left out: what they took now
        would only go back to the group, one delivery count higher."""
        consumers = self.broker.consumers_of(self)
        if self.closing:
            return [c for c in consumers if not c.qos]
        return consumers

    async def _write_loop(self, session_scope: trio.CancelScope) -> None:
        opts = self.server.config.delivery
        linger = opts.flush_interval_ms / 1000
        stream = self.stream
        try:
            while True:
                if not self.outbox and not self._has_deliveries():
                    if self.closing:
                        if self.close_reason is CloseReason.SHUTDOWN and not self._said_goodbye:
                            # only now: every delivery queued for us went out before it
                            self._said_goodbye = True
                            self.send(codec.Goodbye(ErrorCode.SHUTTING_DOWN,
                                                    "broker is shutting down"))
                            continue
                        return
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    continue
                if linger and not self.outbox:
                    await trio.sleep(linger)  # let a batch fill (delivery.flush_interval_ms)
                data = self._collect(opts.max_batch, opts.max_batch_bytes)
                if data:
                    await stream.send_all(data)
                else:
                    await trio.lowlevel.checkpoint()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.close_reason = self.close_reason or CloseReason.WRITE_FAILED
            session_scope.cancel()

    def _collect(self, max_batch: int, max_batch_bytes: int) -> bytes:
        parts = self.outbox
        self.outbox = []
        now, wall = now_ms(), wall_ms()
        broker = self.broker
        for consumer in self._sending():
            if not broker.has_work(consumer):
                continue
            records = broker.take(consumer, max_batch, max_batch_bytes, now, wall)
            if records:
                parts.append(codec.encode_deliver(consumer.sub_id, records))
            if not consumer.queue.durable:
                release_waiter(consumer.queue)
        return b"".join(parts)

    # ----------------------------------------------------------------------------- reader

    async def _read_loop(self) -> CloseReason:
        cfg = self.server.config
        decoder = codec.Decoder(self.server.max_frame)
        stream = self.stream
        with trio.CancelScope() as scope:
            self._read_scope = scope
            timeout = cfg.server.handshake_timeout_ms / 1000
            scope.deadline = trio.current_time() + timeout if timeout else math.inf
            while True:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return CloseReason.RESET
                if not data:
                    return CloseReason.EOF
                decoder.feed(data)
                while True:  # again after the good frames: a bad one behind them raises now
                    try:
                        frames = decoder.frames()
                    except RemoteProtocolError as exc:
                        self.error(ErrorCode(exc.code), str(exc))
                        return CloseReason.PROTOCOL_ERROR
                    if not frames:
                        break
                    for frame in frames:
                        reason = await self._handle(frame)
                        if reason is not None:
                            return reason
                    if self.authenticated and scope.deadline != math.inf:
                        scope.deadline = math.inf
        if self.close_reason is None and not self.authenticated:
            self.error(ErrorCode.TIMEOUT, "handshake not completed in time")
            return CloseReason.HANDSHAKE_TIMEOUT
        return self.close_reason or CloseReason.SHUTDOWN

    async def _handle(self, frame: codec.Frame) -> CloseReason | None:
        rid = frame.request_id
        if not self._greeted:
            return self._hello(frame)
        if not self.authenticated:
            return self._auth(frame)
        match frame:
            case codec.Publish():
                await self._publish(frame)
            case codec.Ping():
                self.send(codec.Pong(frame.data, rid))
            case codec.Subscribe():
                self._subscribe(frame)
            case codec.Unsubscribe():
                self._unsubscribe(frame)
            case codec.Ack():
                # acks of QoS 0 deliveries are accepted and ignored
                if self.broker.ack(self, frame.sub_id, frame.offsets, wall_ms()):
                    self.wake()  # the consumer's window has room again
                    self._log_touched()
            case codec.Nack():
                back = self.broker.nack(self, frame.sub_id, frame.offsets, frame.delay_ms,
                                        now_ms(), wall_ms())
                if back is not None:
                    wake_consumers((back,))  # type: ignore[arg-type]
                    self._log_touched()  # a dead letter is a new message
            case codec.Credit():
                if self.broker.set_credit(self, frame.sub_id, frame.credit):
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
        keys = self.server.config.auth.api_keys
        given = frame.api_key.encode()
        if keys and not any(hmac.compare_digest(given, k.encode()) for k in keys):
            self.server.counters.auth_failures += 1
            self.error(ErrorCode.AUTH_FAILED, "API key refused", frame.request_id)
            return CloseReason.AUTH_FAILED
        self.authenticated = True
        self.send(codec.AuthOk(frame.request_id))
        return None

    async def _publish(self, frame: codec.Publish) -> None:
        """Route a PUBLISH. A frame with QoS 1 messages gets exactly one PUB_ACK, counting
        those that became durable (possibly after an ERROR about the rest)."""
        broker = self.broker
        flusher = self.server.flusher
        messages = frame.messages
        total = len(messages)
        wants_ack = any(m.qos for m in messages)
        confirms = last_offset = 0
        try:
            while True:
                result = broker.publish(messages, now_ms(), wall_ms())
                wake_consumers(result.woken)
                confirms += result.confirms
                last_offset = result.last_offset or last_offset
                if result.refusal is not None:
                    done = total - len(messages) + result.accepted
                    text = result.refusal.text
                    if total > 1:
                        text += (
                            f" (message {done + 1} of the batch; {done} before it were accepted)"
                        )
                    self.error(result.refusal.code, text, frame.request_id)
                    return
                if result.blocked is None:
                    return
                messages = messages[result.accepted:]
                if not await self._wait_for_room(frame, result.blocked, len(messages), total):
                    return
        finally:
            if last_offset and flusher is not None:
                flusher.appended()
            if wants_ack:
                if confirms and flusher is not None:
                    flusher.confirm_later(last_offset, self, frame.request_id, confirms)
                else:
                    self.send(codec.PubAck(0, frame.request_id))

    async def _wait_for_room(
        self, frame: codec.Publish, queue: Queue, remaining: int, total: int
    ) -> bool:
        """A full queue with the block policy: wait for room, or give up after the timeout."""
        broker = self.broker
        if queue.waiter is None:
            queue.waiter = trio.Event()
        timeout_ms = self.server.config.queues.block_timeout_ms
        with trio.move_on_after(timeout_ms / 1000) as cs:
            await queue.waiter.wait()
        if not cs.cancelled_caught:
            return True
        broker.count_block_timeout(remaining)
        self.error(
            ErrorCode.QUEUE_FULL,
            f"queue of subscription {queue.filter!r} stayed full for {timeout_ms} ms; "
            f"{remaining} of {total} messages of the batch were not accepted",
            frame.request_id,
        )
        return False

    def _subscribe(self, frame: codec.Subscribe) -> None:
        result = self.broker.subscribe(
            self, frame.topic_filter, frame.group, frame.qos, frame.credit, frame.request_id,
            frame.start, frame.start_offset, wall_ms(),
        )
        if result.refusal is not None:
            self.error(result.refusal.code, result.refusal.text, frame.request_id)
            return
        consumer = result.consumer
        assert consumer is not None
        self.send(codec.Subscribed(consumer.sub_id, frame.request_id))
        self._log_touched()  # a new durable group is a log record
        if self.broker.has_work(consumer):
            self.wake()  # a group's backlog waits for its new consumer

    def _unsubscribe(self, frame: codec.Unsubscribe) -> None:
        result = self.broker.unsubscribe(self, frame.sub_id, frame.topic_filter, frame.group,
                                         wall_ms())
        if result.refusal is not None:
            self.error(result.refusal.code, result.refusal.text, frame.request_id)
            return
        for q in result.removed:
            release_waiter(q)
        for consumer in result.ended:
            _notify_ended(consumer)
        self._log_touched()
        self.send(codec.Unsubscribed(result.count, frame.request_id))

    def _log_touched(self) -> None:
        wal, flusher = self.server.wal, self.server.flusher
        if wal is not None and flusher is not None and wal.pending_records:
            flusher.appended()


def _notify_ended(consumer: Consumer) -> None:
    owner: Session = consumer.owner
    owner.error(
        ErrorCode.GROUP_DELETED,
        f"group {consumer.queue.group!r} on {consumer.queue.filter!r} was deleted",
        consumer.request_id,
    )


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"
