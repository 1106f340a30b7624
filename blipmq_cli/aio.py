"""The Trio client: a thin async shell over the sans-IO ``ClientConnection``, with reconnects.

    async with AsyncClient("127.0.0.1:7878") as c:
        await c.publish("sensors/temp", b"21.5", qos=1)    # returns once it is durable
        async for msg in await c.subscribe("alerts/#", group="pager", qos=1):
            ...
            await sub.ack(msg)

The protocol (handshake, request ids, batching, QoS 1 tickets, what a reconnect sends again,
why a connection ended) lives in ``blipmq_server.protocol.connection``, shared with the sync
``Client``; this module moves bytes with Trio streams and decides when to dial again.

Tasks, all under one supervisor task that runs in the nursery ``async with`` opens (or the one
given to ``connect(nursery)``): the supervisor dials, and it runs per live
connection one reader (feeds the connection; stops reading while ``prefetch`` deliveries, or
``prefetch_bytes`` of their payloads, wait to be taken, so a slow application slows the
broker down instead of filling memory), one
writer (the only task that writes the socket: it sends whatever the callers queued since its
last write, so many publishes go out in one ``send_all``) and a keepalive ticker.

Reconnects (on unless ``reconnect=False``): after a lost connection the supervisor dials the
addresses in turn with exponential backoff and jitter (``Reconnect``), sends again the QoS 1
messages not yet confirmed (at least once: a consumer may see one twice) and what was
published meanwhile (at most ``max_pending`` messages and ``max_pending_bytes``; past that
``publish`` waits, or raises with ``block=False``), and subscribes again: a durable group
resumes at its cursor (unacked deliveries come again), a replaying subscription at the offset
after the last one delivered, and a live one at the log's end, reporting a ``Gap``. The first
connection is not retried: a wrong address or key fails ``async with`` at once.

Trio only (it does not run under asyncio). Imports trio; the sync client does not.
"""

from __future__ import annotations

import json
import math
import random
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Self

import trio

from blipmq_cli import arguments
from blipmq_cli.client import ASKS, DEFAULT_ADDR, DEFAULT_TIMEOUT, targets, transient
from blipmq_server.errors import (
    BlipError,
    BrokerError,
    ConfigError,
    ConnectError,
    LocalProtocolError,
    RemoteProtocolError,
)
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import Delivery, Message, Start
from blipmq_server.protocol.connection import (
    ClientConnection,
    CloseReason,
    Gap,
    Reconnect,
    restart_point,
)
from blipmq_server.protocol.message import HEAD_SIZE

_RECV = 1 << 16
_HIGH_WATER = 1 << 20  # bytes queued for the writer before a publish waits for it
_CHUNK = 1024  # messages publish_many adds between checkpoints (the writer runs then)
_LOST = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class AsyncSubscription:
    """The deliveries of one subscription: ``async for``, or ``next_batch``."""

    def __init__(self, client: AsyncClient, topic_filter: str, group: str, qos: int,
                 credit: int, start: int, start_offset: int, flags: int) -> None:
        self.client = client
        self.topic_filter = topic_filter
        self.group = group
        self.qos = qos
        self._credit = credit
        self._start = start
        self._start_offset = start_offset
        self._flags = flags
        self.end: int | None = None  # asked with until_end: the log's next offset then
        self.at_end = False
        self.ended = False
        self.last_offset: int | None = None  # of the last delivery handed out
        self.gaps: list[Gap] = []  # what reconnects may have cost it (live subscriptions)
        self.sub_id = 0
        # where deliveries are read: the connection of each subscribe, oldest first (an old
        # one is read to its end before the next); acks go to the newest
        self._reads: deque[tuple[ClientConnection, int]] = deque()
        self._error: BlipError | None = None
        self._batch: tuple[Delivery, ...] = ()
        self._index = 0

    def _attach(self, conn: ClientConnection, sub_id: int, end: int | None) -> None:
        self._reads.append((conn, sub_id))
        self.sub_id = sub_id
        if end is not None:
            self.end = end

    @property
    def credit(self) -> int:
        """The window of unacked deliveries last asked for (QoS 1; 0: the broker's
        ``delivery.default_credit``); it is asked again after a reconnect."""
        return self._credit

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delivery:
        if self._index >= len(self._batch):
            batch = await self.next_batch()
            if batch is None or self.at_end:
                raise StopAsyncIteration
            self._batch, self._index = batch, 0
        self._index += 1
        return self._batch[self._index - 1]

    async def next_batch(self, timeout: float | None = None) -> tuple[Delivery, ...] | None:
        """The next DELIVER batch; None once the stream ended (unsubscribed, its group
        deleted, the client closed, or the broker stopped with reconnects off). Raises
        TimeoutError after ``timeout`` seconds without one, and why the client gave up
        when it did."""
        client = self.client
        timeout = arguments.wait("timeout", timeout)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:  # each pass takes a batch, moves on, ends, or waits for a change
                if self._error is not None:
                    raise self._error
                if self.ended or not self._reads:
                    return None
                conn, sub_id = self._reads[0]
                got = conn.next_batch(sub_id)
                if got is not None:
                    client._taken()
                    if got:
                        self.last_offset = got[-1].offset
                    else:
                        self.at_end = True  # the end mark of an until_end subscription
                    return got
                closed = conn.closed
                if closed is None:
                    if not conn.subscribed(sub_id):
                        self.ended = True  # unsubscribed, or its group deleted
                        return None
                elif len(self._reads) > 1:
                    self._reads.popleft()  # read to its end: on to the new connection
                    continue
                elif client._dead is not None or client._closing:
                    if client._closing or closed.ends_streams:
                        return None
                    raise client._dead  # type: ignore[misc]
                await client._changed.wait()
        raise TimeoutError(f"timed out after {timeout:g} s waiting for a delivery from the "
                           f"broker at {client.addr}")

    def _live(self) -> tuple[ClientConnection, int] | None:
        if not self._reads:
            return None
        conn, sub_id = self._reads[-1]
        return (conn, sub_id) if conn.closed is None else None

    async def ack(self, *deliveries: Delivery) -> None:
        """Acknowledge deliveries (QoS 1). While the connection is down an ack is dropped:
        the broker sends those deliveries again."""
        offsets = arguments.deliveries(deliveries)
        live = self._live()
        if live is not None:
            live[0].ack(live[1], offsets)
            self.client._kick()
        await trio.lowlevel.checkpoint()

    async def ack_at_close(self, *deliveries: Delivery) -> None:
        """Acknowledge the last deliveries this connection will take: CREDIT 0 and the ACK
        go out with the GOODBYE of ``close()``, so the broker does not refill the window."""
        live = self._live()
        if live is not None:
            live[0].ack_at_close(live[1], arguments.deliveries(deliveries))
        await trio.lowlevel.checkpoint()

    async def nack(self, *deliveries: Delivery, delay_ms: int = 0, reason: str = "") -> None:
        """Give deliveries back: sent again at once, or after ``delay_ms``; ``reason`` is
        what a dead letter made by this NACK says."""
        arguments.nack(delay_ms, reason)
        offsets = arguments.deliveries(deliveries)
        live = self._live()
        if live is not None:
            live[0].nack(live[1], offsets, delay_ms, reason)
            self.client._kick()
        await trio.lowlevel.checkpoint()

    async def set_credit(self, credit: int) -> None:
        """Change the window of unacked deliveries (QoS 1; 0 pauses the subscription)."""
        self._credit = arguments.whole("credit", credit)
        live = self._live()
        if live is not None:
            live[0].credit(live[1], credit)
            self.client._kick()
        await trio.lowlevel.checkpoint()

    async def unsubscribe(self) -> None:
        """End this subscription (a group's other members go on)."""
        client = self.client
        if self in client._subs:
            client._subs.remove(self)
        live = self._live()
        self.ended = True
        if live is not None:
            conn, sub_id = live
            await client._ask(conn, conn.unsubscribe(sub_id), "UNSUBSCRIBED", None)


async def _read_into(stream: trio.abc.Stream, conn: ClientConnection) -> None:
    """One read from the broker into ``conn``. A lost stream is its end of stream, and bytes
    that break the protocol close it as MALFORMED: either way ``conn.closed`` and
    ``conn.failure()`` say so."""
    try:
        data = await stream.receive_some(_RECV)
    except _LOST:
        data = b""
    try:
        conn.receive_data(data, trio.current_time())
    except RemoteProtocolError:
        pass


def _record_size(topic: str, payload: bytes, key: bytes | None) -> int:
    """The bytes ``pending`` counts for a message (exact for an ASCII topic)."""
    return HEAD_SIZE + len(topic) + len(payload) + (len(key) if key else 0)


def _under_trio() -> None:
    """Refuse to run outside Trio with one clear line (under asyncio Trio's own calls fail
    with "must be called from async context")."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise ConfigError("AsyncClient runs under Trio (trio.run), not asyncio or another "
                          "event loop: from asyncio, run the sync Client in a thread "
                          "(asyncio.to_thread)") from None


class AsyncClient:
    """A BlipMQ client for Trio. See the module docstring and docs/CLIENT.md."""

    def __init__(
        self,
        addr: str | Sequence[str] = DEFAULT_ADDR,
        api_key: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        name: str = "blipmq-py-async",
        ssl_context: ssl.SSLContext | None = None,
        reconnect: Reconnect | bool = True,
        max_pending: int = 10_000,
        max_pending_bytes: int = 64 << 20,
        block: bool = True,
        prefetch: int = 10_000,
        prefetch_bytes: int = 64 << 20,
        on_disconnect: Callable[[BlipError], object] | None = None,
        on_reconnect: Callable[[str], object] | None = None,
        on_gap: Callable[[Gap], object] | None = None,
    ) -> None:
        """``addr``: one address or several (``[tls://|tcp://]host[:port]``), dialled in
        turn when reconnecting. ``ssl_context`` as for ``Client``."""
        arguments.connection(api_key, name, ssl_context)
        self._targets = targets(addr, ssl_context)
        self.addr = self._targets[0][3]  # the address of the current (or last) connection
        self.api_key = api_key
        self.timeout = arguments.seconds("timeout", timeout)
        self.name = name
        self._ssl_context = ssl_context
        self.reconnect = arguments.reconnect(reconnect)
        self.max_pending = arguments.count("max_pending", max_pending)
        self.max_pending_bytes = arguments.count("max_pending_bytes", max_pending_bytes)
        self.block = block
        # deliveries (and their payload bytes) read ahead of the application that stop
        # the reader until the application takes some
        self.prefetch = arguments.count("prefetch", prefetch)
        self.prefetch_bytes = arguments.count("prefetch_bytes", prefetch_bytes)
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.on_gap = on_gap
        self.reconnects = 0  # connections made again after a loss
        self.resent = 0  # messages a reconnect sent again (QoS 1 unconfirmed, or held)
        self._conn = ClientConnection()
        self._next_target = 1
        self._subs: list[AsyncSubscription] = []
        self._up = False  # a connection is ready and its tasks run
        self._dead: BlipError | None = None  # why the client gave up
        self._closing = False
        self._ending = False  # close() began: publishes are refused from here on
        self._changed = trio.Event()  # set (and replaced) on every change waiters look at
        self._dirty = trio.Event()  # the writer has something to send
        self._gated = False  # the reader waits for the application to take deliveries
        self._started = False  # connect() started the client's task (once per client)
        self._scope = trio.CancelScope()  # around the client's task: close() cancels it
        self._stopped = trio.Event()  # the client's task has ended
        self._own: Any = None  # the nursery ``async with`` opened for the client's task

    # ------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        stream = await self._dial_first()
        self._own = trio.open_nursery()
        self._begin(await self._own.__aenter__(), stream)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if et is None:
                await self.close()
            else:
                await self._shutdown()
        finally:
            await self._shutdown()  # at once if done already; else (close() cancelled) now
            await self._leave_own()

    async def connect(self, nursery: trio.Nursery) -> None:
        """Connect to the first address that answers (each is tried once), then run the
        client's task in ``nursery`` until ``close()``. The connect alone is what a
        surrounding ``trio.fail_after`` bounds; ``nursery`` must outlive the client's use
        (``async with AsyncClient(...)`` opens one of its own). A client connects once:
        after ``close()``, make a new one."""
        stream = await self._dial_first()
        self._begin(nursery, stream)

    async def _dial_first(self) -> trio.abc.Stream:
        """The first connection's stream, from the first address that answers."""
        _under_trio()
        if self._closing:
            raise ConnectError(f"the client for {self.addr} was closed: make a new "
                               "AsyncClient to connect again")
        if self._started:
            raise ConnectError(f"the client for {self.addr} is already connected")
        error: BlipError | None = None
        for target in self._targets:
            try:
                stream, conn = await self._open(target)
            except BlipError as exc:
                error = error or exc
                continue
            self._conn, self.addr = conn, target[3]
            return stream
        assert error is not None
        raise error

    def _begin(self, nursery: trio.Nursery, stream: trio.abc.Stream) -> None:
        self._started = self._up = True
        nursery.start_soon(self._supervise, stream)

    async def close(self) -> None:
        """Flush (within ``timeout``: while disconnected with messages pending, that
        includes waiting for the reconnect), say GOODBYE and end the client's task. Raises
        the first refusal not yet reported, and ConnectError when messages are left that
        the broker has not taken (held while disconnected, or QoS 1 unconfirmed): they are
        dropped. Publishes are refused from the moment it begins (ConnectError: publish
        before close()). A second ``close()`` does nothing."""
        if not self._started or self._closing:
            self._closing = True
            return
        self._ending = True
        error: BlipError | None = None
        if self._dead is None and (self._up or self._conn.backlog[0]):
            try:
                await self.flush()
            except (BlipError, TimeoutError) as exc:
                error = exc if isinstance(exc, BlipError) else ConnectError(str(exc))
        else:
            error = self._dead
        self._closing = True
        conn = self._conn
        if self._up and conn.closed is None:
            conn.goodbye()
            self._kick()
            with trio.move_on_after(self.timeout):
                while self._up:  # until the broker closed after our GOODBYE
                    await self._changed.wait()
        held, held_size = self._conn.backlog
        await self._shutdown()
        if error is not None and not isinstance(error, ConnectError):
            raise error
        if held:
            why = error or "the connection closed before the broker confirmed them"
            raise ConnectError(f"closed with {held} messages ({held_size} bytes) that the "
                               f"broker at {self.addr} has not taken, now dropped: {why}")

    async def _shutdown(self) -> None:
        """End the client's task and wait for it. Safe from any task or cancel scope: the
        nursery ``async with`` opened is left by ``__aexit__`` alone (``_leave_own``)."""
        self._closing = True
        self._notify()
        self._scope.cancel()
        if self._started:
            with trio.CancelScope(shield=True):  # cancelled itself: ends at once
                await self._stopped.wait()

    async def _leave_own(self) -> None:
        """Exit the nursery ``__aenter__`` opened, from ``__aexit__``: Trio wants a nursery
        left by the task, and in the cancel scope, that entered it."""
        own, self._own = self._own, None
        if own is not None:
            await own.__aexit__(None, None, None)

    @property
    def connected(self) -> bool:
        """Whether a connection is up now."""
        return self._up

    @property
    def max_message(self) -> int:
        """The largest payload the broker accepts (from WELCOME)."""
        return self._conn.max_message

    @property
    def buffered(self) -> tuple[int, int]:
        """Deliveries (and their payload bytes) read from the broker and not yet taken:
        what ``prefetch`` and ``prefetch_bytes`` bound."""
        return self._conn.queued, self._conn.queued_bytes

    @property
    def pending(self) -> tuple[int, int]:
        """Messages (and bytes) not yet taken for good by the broker: unsent, and QoS 1
        unconfirmed. While disconnected, what ``max_pending`` bounds."""
        return self._conn.backlog

    # ------------------------------------------------------------------------ publishing

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        ttl_ms: int = 0,
        key: bytes | None = None,
        retain: bool = False,
    ) -> None:
        """Send one message; with ``qos=1``, return once the broker confirmed it durable
        (across reconnects: it is sent again if the connection broke first). A QoS 0
        publish returns once the message is queued for the writer."""
        arguments.message(topic, payload, qos, ttl_ms, key)
        conn = await self._room(1, _record_size(topic, payload, key))
        try:
            if qos or ttl_ms or key is not None or retain:
                ticket = conn.publish(Message(topic, payload, qos, ttl_ms, key, retain))
            else:
                conn.publish_pairs(((topic, payload),))
                ticket = 0
        except LocalProtocolError as exc:
            raise BrokerError(exc.code, str(exc)) from None
        self._kick()
        if conn.outgoing >= _HIGH_WATER:
            await self._drain(conn)
        if ticket:
            await self._confirmed(ticket)

    async def publish_many(self, messages: Iterable[Message | tuple[str, bytes]]) -> int:
        """Send many messages in PUBLISH batches, in order; returns how many. Each counts
        against ``max_pending`` and ``max_pending_bytes`` as a ``publish`` does: past the
        bound this waits for room (``block=True``) or raises ConnectError (``block=False``)
        at the first message that does not fit. The messages before it are queued and go
        out, and the error says how many; that one and the rest are not taken. A bad
        message raises likewise (ConfigError or BrokerError). QoS 1 ones are not waited
        for: ``flush`` does that."""
        n = 0
        for m in messages:
            try:
                size = _record_size(m[0], m[1], m.key if isinstance(m, Message) else None)
            except (TypeError, IndexError, KeyError):
                arguments.given(m)
                raise
            conn = await self._room(1, size, n)
            try:
                if isinstance(m, Message):
                    conn.publish(m)
                else:
                    conn.publish_pairs((m,))
            except LocalProtocolError as exc:
                arguments.given(m)
                raise BrokerError(exc.code, str(exc)) from None
            except (TypeError, ValueError):
                arguments.given(m)
                raise
            n += 1
            if conn.outgoing >= _HIGH_WATER:
                await self._drain(conn)
            elif not n % _CHUNK:
                self._kick()
                await trio.lowlevel.checkpoint()
        self._kick()
        await trio.lowlevel.checkpoint()
        return n

    async def flush(self, timeout: float | None = None) -> None:
        """Send everything, wait until the broker processed it (PING/PONG) and confirmed
        every QoS 1 message so far; raise the first refusal. A connection lost meanwhile
        is waited through: what it had not confirmed went to the next one, which is asked
        again. ``timeout`` (the client's by default) bounds it all."""
        timeout = arguments.wait("timeout", timeout)
        limit = self.timeout if timeout is None else timeout
        with trio.move_on_after(limit):
            while True:  # one pass per connection the flush is asked on
                conn, _ = await self._request(lambda conn: conn.ping(), "PONG", math.inf)
                while conn.unconfirmed and conn.closed is None:
                    await self._changed.wait()
                if conn.closed is not None:
                    continue  # lost before it confirmed all: asked again on the next one
                refusal = conn.refusal()
                if refusal is not None:
                    raise BrokerError(refusal.code, refusal.text)
                return
        raise TimeoutError(f"timed out after {limit:g} s waiting for the broker at "
                           f"{self.addr} to confirm")

    # ----------------------------------------------------------------------- subscribing

    async def subscribe(
        self,
        topic_filter: str,
        *,
        group: str = "",
        qos: int = 0,
        credit: int = 0,
        start: Start = Start.LATEST,
        start_offset: int = 0,
        start_time_ms: int = 0,
        until_end: bool = False,
    ) -> AsyncSubscription:
        """Subscribe; the options are those of ``Client.subscribe``. ``credit`` is the QoS 1
        window of unacked deliveries (0: the broker's default)."""
        if start == Start.TIME and start_time_ms:
            start_offset = start_time_ms
        arguments.subscription(topic_filter, group, qos, credit, start_offset, start)
        flags = codec.SUBSCRIBE_UNTIL_END if until_end else 0
        sub = AsyncSubscription(self, topic_filter, group, qos, credit, start, start_offset,
                                flags)
        with trio.move_on_after(self.timeout):
            conn = await self._until_up()
            reply = await self._ask(conn, conn.subscribe(topic_filter, group, qos, credit,
                                                         start, start_offset, flags),
                                    "SUBSCRIBED", None)
            assert isinstance(reply, codec.Subscribed)
            if until_end and reply.end is None:
                raise BrokerError(codec.ErrorCode.UNSUPPORTED,
                                  f"the broker at {self.addr} does not mark the end of the log")
            sub._attach(conn, reply.sub_id, reply.end)
            self._subs.append(sub)
            return sub
        raise TimeoutError(f"timed out after {self.timeout:g} s waiting for the broker at "
                           f"{self.addr}")

    async def unsubscribe(self, topic_filter: str, *, group: str = "") -> int:
        """End this client's subscriptions on a filter, or delete a consumer group."""
        arguments.names(topic_filter, group)
        conn = await self._until_up_within()
        reply = await self._ask(conn, conn.unsubscribe(0, topic_filter, group),
                                "UNSUBSCRIBED", None)
        for sub in list(self._subs):
            if sub.topic_filter == topic_filter and sub.group == group:
                self._subs.remove(sub)
        assert isinstance(reply, codec.Unsubscribed)
        return reply.count

    # --------------------------------------------------------------------- request/reply

    async def stats(self, timeout: float | None = None) -> dict:
        """The broker's statistics (docs/PROTOCOL.md, "Statistics"), as a dict."""
        _, reply = await self._request(lambda conn: conn.stats(), "STATS_REPORT",
                                       arguments.wait("timeout", timeout))
        assert isinstance(reply, codec.StatsReport)
        try:
            data = json.loads(reply.data)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ConnectError(f"the broker at {self.addr} sent statistics that are not "
                               "a JSON object")
        return data

    async def ping(self, timeout: float | None = None) -> float:
        """Round-trip time to the broker in seconds (a PING and its PONG)."""
        timeout = arguments.wait("timeout", timeout)
        began = trio.current_time()
        await self._request(lambda conn: conn.ping(), "PONG", timeout)
        return trio.current_time() - began

    # --------------------------------------------------------------------------- waiting

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _kick(self) -> None:
        self._dirty.set()

    def _taken(self) -> None:
        if self._gated and not self._full(self._conn):
            self._notify()

    def _full(self, conn: ClientConnection) -> bool:
        """Whether ``prefetch`` or ``prefetch_bytes`` is reached on ``conn``: its reader
        waits for the application to take deliveries."""
        return conn.queued >= self.prefetch or conn.queued_bytes >= self.prefetch_bytes

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closing:
            raise ConnectError(f"the client for {self.addr} is closed")
        if not self._started:
            raise ConnectError(f"the client for {self.addr} is not connected: use async "
                               "with, or await connect(nursery)")

    async def _until_up(self) -> ClientConnection:
        """The ready connection, once there is one (waiting through a reconnect)."""
        while True:  # each pass returns, raises, or waits for a change
            self._check_alive()
            if self._up and self._conn.closed is None:
                return self._conn
            await self._changed.wait()

    async def _until_up_within(self, timeout: float | None = None) -> ClientConnection:
        limit = self.timeout if timeout is None else timeout
        with trio.move_on_after(limit):
            return await self._until_up()
        raise TimeoutError(f"timed out after {limit:g} s waiting for a connection to "
                           f"{self.addr}")

    async def _ask(self, conn: ClientConnection, rid: int, what: str,
                   timeout: float | None) -> codec.Frame:
        """Send the request ``rid`` queued on ``conn`` and wait for its reply; ConnectError
        if ``conn`` breaks first."""
        limit = self.timeout if timeout is None else timeout
        with trio.move_on_after(limit):
            reply = await self._reply(conn, rid)
            if reply is None:
                raise ConnectError(f"the connection to {self.addr} broke while waiting for "
                                   f"{what}")
            if isinstance(reply, codec.Error):
                raise BrokerError(reply.code, reply.text)
            return reply
        raise TimeoutError(f"timed out after {limit:g} s waiting for {what} from the broker "
                           f"at {self.addr}")

    async def _request(self, make: Callable[[ClientConnection], int], what: str,
                       timeout: float | None) -> tuple[ClientConnection, codec.Frame]:
        """Queue a request with ``make`` on the ready connection and wait for its reply,
        asked again on the next connection when a reconnect comes in between (as the sync
        client's ``_request``); returns the connection that answered, and the reply.
        ``timeout`` (the client's by default) bounds it all, reconnects included."""
        limit = self.timeout if timeout is None else timeout
        with trio.move_on_after(limit):
            for _ in range(ASKS):
                conn = await self._until_up()  # raises why, once the client gave up
                reply = await self._reply(conn, make(conn))
                if reply is None:
                    continue  # the connection broke: asked again on the next one
                if isinstance(reply, codec.Error):
                    raise BrokerError(reply.code, reply.text)
                return conn, reply
            raise ConnectError(f"the connection to {self.addr} kept breaking while waiting "
                               f"for {what}")
        raise TimeoutError(f"timed out after {limit:g} s waiting for {what} from the broker "
                           f"at {self.addr}")

    async def _reply(self, conn: ClientConnection, rid: int) -> codec.Frame | None:
        """Send the request ``rid`` queued on ``conn`` and wait for its reply (an ERROR
        too); None when ``conn`` closed first. Cancelled, it forgets the request."""
        self._kick()
        try:
            while (reply := conn.reply(rid)) is None:
                if conn.closed is not None:
                    return None
                await self._changed.wait()
        except BaseException:  # cancelled: its reply, when it comes, is not for anyone
            conn.forget(rid)
            raise
        return reply

    async def _room(self, count: int, size: int, queued: int | None = None) -> ClientConnection:
        """The connection to publish on, once ``max_pending`` leaves room for ``count``
        messages of ``size`` bytes (or at once with nothing pending). ``queued``: how many
        messages of a ``publish_many`` went in before, for the error."""
        while True:  # each pass returns, raises, or waits for a change
            if self._ending and not self._closing:
                raise ConnectError(f"the client for {self.addr} is closing: publish before "
                                   "close()")
            self._check_alive()
            conn = self._conn
            held, held_size = conn.backlog
            if not held or (held + count <= self.max_pending
                            and held_size + size <= self.max_pending_bytes):
                return conn
            if not self.block:
                state = "connected to" if self._up else "disconnected from"
                before = ("" if queued is None else
                          f" (publish_many queued {queued} of its messages before this one)")
                raise ConnectError(f"{held} messages ({held_size} bytes) wait, {state} the "
                                   f"broker at {self.addr}: max_pending reached{before}")
            self._kick()
            await self._changed.wait()

    async def _drain(self, conn: ClientConnection) -> None:
        """Wait until the writer took what is queued on ``conn`` (or it closed)."""
        while conn.outgoing >= _HIGH_WATER and conn.closed is None:
            self._kick()
            await self._changed.wait()

    async def _confirmed(self, ticket: int) -> None:
        while True:  # each pass returns, raises, or waits for a change
            outcome = self._conn.outcome(ticket)
            if outcome:
                return
            if outcome is False:
                refusal = self._conn.refusal()
                if refusal is not None:
                    raise BrokerError(refusal.code, refusal.text)
                raise BrokerError(codec.ErrorCode.INVALID_REQUEST,
                                  "the broker refused the message")
            self._check_alive()
            await self._changed.wait()

    # ------------------------------------------------------------------- the connection

    async def _open(self, target: tuple[str, int, bool, str]) -> tuple[trio.abc.Stream,
                                                                         ClientConnection]:
        """Dial one address and complete the handshake, within ``timeout``."""
        host, port, secure, label = target
        with trio.move_on_after(self.timeout):
            try:
                tcp = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise ConnectError(f"cannot connect to {label}: {exc.strerror or exc}") from None
            stream: trio.abc.Stream = tcp
            try:
                if secure:
                    stream = await self._tls(tcp, host, label)
                conn = ClientConnection()
                conn.hello(self.name, self.api_key)
                await stream.send_all(conn.data_to_send())
                while (outcome := conn.handshake()) is None:
                    await _read_into(stream, conn)
                    if conn.closed is not None and conn.handshake() is None:
                        raise self._refused(conn, label, secure)
                if isinstance(outcome, codec.Error):
                    raise BrokerError(outcome.code, outcome.text)
                return stream, conn
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        raise ConnectError(f"cannot connect to {label}: no handshake within {self.timeout:g} s")

    def _refused(self, conn: ClientConnection, label: str, secure: bool) -> BlipError:
        """Why ``conn`` closed during the handshake: an end of stream is a TLS port spoken
        to in plain TCP, or over TLS a client certificate missing or refused (TLS 1.3
        tells only after the handshake, as the sync client's ``_dial`` finds too)."""
        if conn.closed is not None and conn.closed.reason is CloseReason.EOF:
            if secure:
                from blipmq_cli import tls

                return tls.closed_after_handshake(label)
            return ConnectError(f"the broker at {label} closed the connection during the "
                                f"handshake (if it is a TLS port, connect to tls://{label})")
        return conn.failure(label, self.timeout)

    async def _tls(self, tcp: trio.SocketStream, host: str, label: str) -> trio.SSLStream:
        from blipmq_cli import tls

        context = self._ssl_context or tls.context()
        stream = trio.SSLStream(tcp, context, server_hostname=host)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                raise tls.problem(cause, label) from None
            raise ConnectError(f"{label} closed the connection during the TLS handshake: "
                               "is it the broker's TLS port?") from None
        return stream

    async def _supervise(self, stream: trio.abc.Stream) -> None:
        """Run connections one after another until the client closes or gives up."""
        restore = False
        try:
            with self._scope:
                while True:  # one pass per connection; bounded by Reconnect's waits
                    await self._run(stream, self._conn, restore)
                    if self._closing:
                        return
                    error = self._conn.failure(self.addr, 2 * self.timeout)
                    if self.reconnect is None:
                        self._dead = error
                        return
                    if self.on_disconnect is not None:
                        self.on_disconnect(error)
                    dialled = await self._redial(error)
                    if dialled is None:
                        return
                    stream, restore = dialled, True
        finally:
            self._up = False
            if not self._closing and self._dead is None:
                self._dead = ConnectError(f"the client for {self.addr} stopped: the nursery "
                                          "it ran in was cancelled")
            self._stopped.set()
            self._notify()

    async def _redial(self, error: BlipError) -> trio.abc.Stream | None:
        """A new connection that took the old one's messages over, or None: given up, or
        a final answer (``client.transient``: a refused API key, a failed TLS handshake,
        not BlipMQ's protocol), which ends the client at once, as in the sync client."""
        assert self.reconnect is not None
        old = self._conn
        last: BlipError = error
        tried = 0
        for wait in self.reconnect.waits(random.random):
            await trio.sleep(wait)
            tried += 1
            target = self._targets[self._next_target % len(self._targets)]
            self._next_target += 1
            try:
                stream, conn = await self._open(target)
            except BlipError as exc:
                if not transient(exc):
                    self._dead = exc
                    return None
                last = exc
                continue
            self.resent += conn.resume(old)
            self._conn, self.addr = conn, target[3]
            self.reconnects += 1
            return stream
        self._dead = ConnectError(f"gave up reconnecting after {tried} attempts: {last}")
        return None

    async def _run(self, stream: trio.abc.Stream, conn: ClientConnection,
                   restore: bool) -> None:
        """One connection's reader, writer and keepalive, until it is over."""
        self._up = True
        self._notify()
        try:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                nursery.start_soon(self._writer, stream, conn, scope)
                nursery.start_soon(self._keepalive, conn, scope)
                nursery.start_soon(self._reader, stream, conn, scope)
                if restore:
                    nursery.start_soon(self._restore, conn)
                self._kick()
        finally:
            self._up = False
            if conn.closed is None:
                conn.receive_data(b"", trio.current_time())
            await trio.aclose_forcefully(stream)
            self._notify()

    async def _reader(self, stream: trio.abc.Stream, conn: ClientConnection,
                      scope: trio.CancelScope) -> None:
        try:
            while conn.closed is None:  # each pass takes one read
                while self._full(conn) and conn.closed is None:
                    self._gated = True  # let the application catch up: TCP pushes back
                    # (a broker that cut us off meanwhile is noticed once the application
                    # takes deliveries again: its FIN waits behind what we have not read)
                    await self._changed.wait()
                self._gated = False
                await _read_into(stream, conn)
                if conn.outgoing:
                    self._kick()  # the PONG for the broker's PING
                self._notify()
        finally:
            self._gated = False
            scope.cancel()

    async def _writer(self, stream: trio.abc.Stream, conn: ClientConnection,
                      scope: trio.CancelScope) -> None:
        try:
            while True:  # each pass sends what was queued since the last one
                await self._dirty.wait()
                self._dirty = trio.Event()
                data = conn.data_to_send()
                if data:
                    # a send cut off part-way is only ever cancelled with this connection's
                    # nursery: ``_run`` then closes the stream, so no later frame follows
                    # the cut one on it (the sync client's ``_break``)
                    await stream.send_all(data)
                    self._notify()
                closed = conn.closed
                if closed is not None and closed.reason is CloseReason.LOCAL:
                    return  # our GOODBYE went out; the reader waits for the broker's end
        except _LOST:
            if conn.closed is None:
                conn.receive_data(b"", trio.current_time())
            scope.cancel()

    async def _keepalive(self, conn: ClientConnection, scope: trio.CancelScope) -> None:
        while True:  # one pass per keepalive decision
            if self._gated:
                wait = self.timeout  # we are not reading: silence proves nothing
            else:
                wait = conn.tick(trio.current_time(), self.timeout)
            if conn.closed is not None:
                if conn.closed.reason is not CloseReason.LOCAL:
                    scope.cancel()
                return
            if conn.outgoing:
                self._kick()
            await trio.sleep(max(wait, 0.01))

    async def _restore(self, conn: ClientConnection) -> None:
        """Subscribe again on a new connection, then tell ``on_reconnect``."""
        for sub in list(self._subs):
            if conn.closed is not None:
                return  # this connection went too; the next one restores them
            last, last_id = sub._reads[-1]
            if sub.ended or not last.subscribed(last_id):
                self._subs.remove(sub)  # unsubscribed, or its group deleted: not restored
                continue
            start, offset, missed = restart_point(sub.group, sub.qos, sub._start,
                                                  sub._start_offset, sub.last_offset)
            gap = Gap(sub.topic_filter, sub.group, sub.last_offset) if missed else None
            try:
                reply = await self._ask(conn, conn.subscribe(sub.topic_filter, sub.group,
                                                             sub.qos, sub.credit, start,
                                                             offset, sub._flags),
                                        "SUBSCRIBED", None)
            except BrokerError as exc:
                sub._error = exc  # refused now (its key lost the right, say): it ends so
                self._subs.remove(sub)
                self._notify()
                continue
            except (ConnectError, TimeoutError):
                return  # this connection is going too; the next one restores them
            assert isinstance(reply, codec.Subscribed)
            sub._attach(conn, reply.sub_id, reply.end)
            if gap is not None:
                sub.gaps.append(gap)
                if self.on_gap is not None:
                    self.on_gap(gap)
            self._notify()
        if self.on_reconnect is not None:
            self.on_reconnect(self.addr)
