"""The synchronous Python client: plain sockets plus the shared codec.

    with Client("127.0.0.1:7878", api_key="k") as c:
        c.publish("sensors/temp", b"21.5")
        c.publish_many(("logs", line) for line in lines)
        c.flush()                       # raises BrokerError if the broker refused anything
        for msg in c.subscribe("alerts/#", group="pager"):
            ...

QoS 0 publishes are written without waiting for a reply; a refusal (bad topic, too large)
comes back as an ERROR frame and is raised by the next ``flush()``, ``check()`` or
``close()``. ``flush()`` sends a PING and waits for its PONG: the broker handles a
connection's frames in order, so the PONG proves every earlier publish was processed.

Imports only the standard library and ``blipmq_server.protocol`` (no trio, typer or rich), so
a one-shot ``blipmq pub`` starts fast.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType

from blipmq_server.errors import BrokerError, ConfigError, ConnectError
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import MSG_HEAD, Delivery, ErrorCode, Message
from blipmq_server.protocol.names import topic_problem

DEFAULT_ADDR = "127.0.0.1:7878"
_RECV = 1 << 18
_SEND_CHUNK = 1 << 20
_PROGRESS_CHUNK = 1 << 18


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); raises ValueError with a reason."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r}: port must be 1-65535")
    return host, int(port)


class Subscription:
    """An iterator over the deliveries of one subscription."""

    def __init__(self, client: Client, sub_id: int, topic_filter: str, group: str) -> None:
        self.client = client
        self.sub_id = sub_id
        self.topic_filter = topic_filter
        self.group = group
        self.ended = False

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield from batch

    def next_batch(self, timeout: float | None = None) -> tuple[Delivery, ...] | None:
        """The next DELIVER batch; None once the broker ended the stream (GOODBYE).

        Raises TimeoutError when ``timeout`` seconds pass with nothing delivered.
        """
        return self.client._next_batch(self.sub_id, timeout)

    def ack(self, *deliveries: Delivery) -> None:
        """Acknowledge deliveries of this subscription."""
        self.client.ack(self.sub_id, *deliveries)

    def ack_at_close(self, *deliveries: Delivery) -> None:
        """Acknowledge the last deliveries this connection will take: CREDIT 0 and the ACK
        go out with the GOODBYE of ``close()``, so the broker does not refill the window
        (deliveries it sent then would go back to the group counted once more)."""
        frames = (codec.Credit(self.sub_id, 0),
                  codec.Ack(self.sub_id, tuple(d.offset for d in deliveries)))
        self.client._close_frames.extend(codec.encode(f) for f in frames)

    def set_credit(self, credit: int) -> None:
        """Change this QoS 1 subscription's window of unacked deliveries (0: pause)."""
        self.client._send_now(codec.encode(codec.Credit(self.sub_id, credit)))

    def nack(self, *deliveries: Delivery, delay_ms: int = 0) -> None:
        """Give deliveries back: redelivered at once, or after ``delay_ms``."""
        self.client.nack(self.sub_id, *deliveries, delay_ms=delay_ms)

    def unsubscribe(self) -> None:
        self.client._request(codec.Unsubscribe(self.sub_id))
        self.ended = True


class Client:
    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        api_key: str = "",
        *,
        timeout: float = 10.0,
        name: str = "blipmq-py",
    ) -> None:
        host, port = parse_addr(addr)
        self.addr = addr
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectError(f"cannot connect to {addr}: {exc.strerror or exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self._decoder = codec.Decoder(1 << 20)
        self._rid = 0
        self._errors: deque[BrokerError] = deque()
        self._replies: dict[int, codec.Frame] = {}
        self._batches: dict[int, deque[tuple[Delivery, ...]]] = {}
        self._ended: set[int] = set()
        self._closed_by_broker: BrokerError | None = None
        self._eof = False
        self._topics: dict[str, bytes] = {}
        self._out: list[bytes] = []  # message records not yet sealed into a frame
        self._out_size = 0
        self._frames: list[bytes] = []  # sealed PUBLISH frames not yet written
        self._frames_size = 0
        self._out_qos1 = 0  # QoS 1 records among self._out
        self._awaiting: dict[int, int] = {}  # PUBLISH request id -> QoS 1 messages in it
        self._close_frames: list[bytes] = []  # sent just before GOODBYE (ack_at_close)
        self.qos1_sent = 0
        self.confirmed = 0  # QoS 1 messages the broker confirmed as durable
        hello, auth = self._next_rid(), self._next_rid()
        self._send_now(
            codec.encode(codec.Hello(codec.VERSION, name, hello))
            + codec.encode(codec.Auth(api_key, auth))
        )
        welcome = self._await_reply(hello)
        assert isinstance(welcome, codec.Welcome)
        self.max_message = welcome.max_message
        self.max_frame = welcome.max_frame
        self._decoder.max_frame = welcome.max_frame + 65536
        self._await_reply(auth)

    # ------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if et is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:
        """Flush, say GOODBYE and close; raises the first refusal not yet reported."""
        try:
            if self._eof or self._closed_by_broker is not None:
                self._raise_errors()  # the broker ended the connection: nothing to flush
            else:
                self.flush()
                self._send_now(b"".join(self._close_frames) + codec.encode(codec.Goodbye()))
        finally:
            self.abort()

    def abort(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------------ publishing

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        ttl_ms: int = 0,
        key: bytes | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Send one message; with ``qos=1``, return once the broker confirmed it durable.

        ``progress(bytes_sent)`` is called as a large message goes out.
        """
        self._add(Message(topic, payload, qos, ttl_ms, key))
        self._seal()
        if progress is None:
            self._send_frames()
            if qos:
                self.wait_confirms()
            return
        data = b"".join(self._frames)
        self._frames, self._frames_size = [], 0
        view = memoryview(data)
        for start in range(0, len(data), _PROGRESS_CHUNK):
            self._send_now(view[start : start + _PROGRESS_CHUNK])
            progress(min(start + _PROGRESS_CHUNK, len(payload)))

    def publish_many(self, messages: Iterable[Message | tuple[str, bytes]]) -> int:
        """Send many messages in PUBLISH batches; returns how many were sent."""
        n = 0
        for m in messages:
            self._add(m if isinstance(m, Message) else Message(m[0], m[1]))
            n += 1
        self._send_pending()
        return n

    def _topic_bytes(self, topic: str) -> bytes:
        tb = self._topics.get(topic)
        if tb is None:
            problem = topic_problem(topic)
            if problem:
                raise BrokerError(ErrorCode.INVALID_TOPIC, problem)
            if len(self._topics) > 4096:
                self._topics.clear()
            tb = self._topics[topic] = topic.encode("utf-8")
        return tb

    def _add(self, m: Message) -> None:
        payload = m.payload
        if len(payload) > self.max_message:
            raise BrokerError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"message of {len(payload)} bytes exceeds the broker's limit of "
                f"{self.max_message} bytes",
            )
        tb = self._topic_bytes(m.topic)
        if m.key is None and m.qos == 0 and m.ttl_ms == 0:
            record = MSG_HEAD.pack(0, 0, len(tb), 0, len(payload)) + tb + payload
        else:
            record = codec.message_record(m, tb)
        if self._out and (
            self._out_size + len(record) > self.max_frame - 64 or len(self._out) >= codec.MAX_BATCH
        ):
            self._seal()
        self._out.append(record)
        self._out_size += len(record)
        if m.qos:
            self._out_qos1 += 1

    def _seal(self) -> None:
        """Turn the records gathered so far into one PUBLISH frame, queued for sending."""
        if self._out:
            rid = self._next_rid()
            self._frames.append(codec.encode_publish(self._out, rid))
            if self._out_qos1:
                self._awaiting[rid] = self._out_qos1
                self.qos1_sent += self._out_qos1
                self._out_qos1 = 0
            self._frames_size += self._out_size
            self._out, self._out_size = [], 0
            if self._frames_size >= _SEND_CHUNK:
                self._send_frames()

    def _send_pending(self) -> None:
        self._seal()
        self._send_frames()

    def _send_frames(self) -> None:
        if self._frames:
            data = b"".join(self._frames)
            self._frames, self._frames_size = [], 0
            self._send_now(data)

    def check(self) -> None:
        """Read whatever the broker sent without waiting; raise the first refusal."""
        self._pump(block=False)
        self._raise_errors()

    def flush(self, timeout: float | None = None) -> None:
        """Send everything, wait until the broker processed it (PING/PONG) and confirmed every
        QoS 1 message sent so far; raise the first refusal."""
        self._send_pending()
        rid = self._next_rid()
        self._send_now(codec.encode(codec.Ping(b"", rid)))
        self._await_reply(rid, timeout)
        self.wait_confirms(timeout)

    def wait_confirms(self, timeout: float | None = None) -> None:
        """Wait for the PUB_ACK of every QoS 1 publish sent; raise the first refusal."""
        self._send_pending()
        self._wait_until(lambda: not self._awaiting, timeout)

    # ----------------------------------------------------------------------- subscribing

    def subscribe(
        self,
        topic_filter: str,
        *,
        group: str = "",
        qos: int = 0,
        credit: int = 0,
        start: codec.Start = codec.Start.LATEST,
        start_offset: int = 0,
    ) -> Subscription:
        """Subscribe; ``start`` (EARLIEST, or OFFSET with ``start_offset``) replays the log.

        ``start`` applies to an ephemeral subscription and to a group's first subscriber;
        a group that already exists resumes where it was.
        """
        frame = codec.Subscribe(topic_filter, group, qos, credit, start, start_offset)
        reply = self._request(frame)
        assert isinstance(reply, codec.Subscribed)
        self._batches.setdefault(reply.sub_id, deque())  # deliveries may already be here
        return Subscription(self, reply.sub_id, topic_filter, group)

    def unsubscribe(self, topic_filter: str, *, group: str = "") -> int:
        """End this connection's subscriptions on a filter, or delete a consumer group."""
        reply = self._request(codec.Unsubscribe(0, topic_filter, group))
        assert isinstance(reply, codec.Unsubscribed)
        return reply.count

    def ack(self, sub_id: int, *deliveries: Delivery) -> None:
        """Acknowledge deliveries (QoS 1; accepted and ignored for QoS 0)."""
        frame = codec.Ack(sub_id, tuple(d.offset for d in deliveries))
        self._send_now(codec.encode(frame))

    def nack(self, sub_id: int, *deliveries: Delivery, delay_ms: int = 0) -> None:
        """Negative ack: redeliver now (``delay_ms=0``) or once ``delay_ms`` has passed."""
        frame = codec.Nack(sub_id, tuple(d.offset for d in deliveries), delay_ms)
        self._send_now(codec.encode(frame))

    def ping(self) -> float:
        """Round-trip time to the broker, in seconds."""
        start = time.perf_counter()
        self.flush()
        return time.perf_counter() - start

    # --------------------------------------------------------------------------- plumbing

    def _next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF or 1
        return self._rid

    def _request(self, frame: codec.Frame) -> codec.Frame:
        rid = self._next_rid()
        frame = frame._replace(request_id=rid)
        self._send_pending()
        self._send_now(codec.encode(frame))
        return self._await_reply(rid)

    def _send_now(self, data: bytes | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self._raise_closed()
            raise ConnectError(f"connection to {self.addr} lost: {exc.strerror or exc}") from None

    def _await_reply(self, rid: int, timeout: float | None = None) -> codec.Frame:
        self._wait_until(lambda: rid in self._replies, timeout)
        return self._replies.pop(rid)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Receive and dispatch frames until ``done()``; raise refusals and a closed link."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            self._raise_errors()
            if self._eof:
                raise self._closed_by_broker or ConnectError(
                    f"the broker at {self.addr} closed the connection"
                )
            self._pump(block=True, deadline=deadline)
        self._raise_errors()

    def _next_batch(self, sub_id: int, timeout: float | None) -> tuple[Delivery, ...] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        queue = self._batches.setdefault(sub_id, deque())
        while not queue:
            self._raise_errors()
            if sub_id in self._ended:
                return None
            if self._closed_by_broker is not None:
                if self._closed_by_broker.code == ErrorCode.SHUTTING_DOWN:
                    return None
                raise self._closed_by_broker
            self._pump(block=True, deadline=deadline)
        return queue.popleft()

    def _raise_errors(self) -> None:
        if self._errors:
            raise self._errors.popleft()

    def _raise_closed(self) -> None:
        self._pump(block=False)
        self._raise_errors()
        if self._closed_by_broker is not None:
            raise self._closed_by_broker

    def _pump(self, block: bool, deadline: float | None = None) -> None:
        """Receive once (waiting if ``block``) and dispatch every whole frame."""
        sock = self.sock
        try:
            if block:
                if deadline is None:
                    sock.settimeout(None)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("timed out waiting for the broker")
                    sock.settimeout(remaining)
                data = sock.recv(_RECV)
            else:
                sock.setblocking(False)
                try:
                    data = sock.recv(_RECV)
                except BlockingIOError:
                    return
                finally:
                    sock.setblocking(True)
        except TimeoutError:
            raise TimeoutError("timed out waiting for the broker") from None
        except OSError as exc:
            raise ConnectError(f"connection to {self.addr} lost: {exc.strerror or exc}") from None
        if not data:
            self._eof = True
            if self._closed_by_broker is not None:
                if self._closed_by_broker.code == ErrorCode.SHUTTING_DOWN:
                    self._ended.update(self._batches)
                    return
                raise self._closed_by_broker
            self._raise_errors()  # e.g. the ERROR that explains why the broker closed
            raise ConnectError(f"the broker at {self.addr} closed the connection")
        self._decoder.feed(data)
        try:
            frames = self._decoder.frames()
        except codec.RemoteProtocolError as exc:
            raise ConnectError(f"the broker sent a malformed frame: {exc}") from None
        for frame in frames:
            self._dispatch(frame)

    def _dispatch(self, frame: codec.Frame) -> None:
        if isinstance(frame, codec.Deliver):
            self._batches.setdefault(frame.sub_id, deque()).append(frame.messages)
        elif isinstance(frame, codec.Error):
            self._errors.append(BrokerError(frame.code, frame.text))
        elif isinstance(frame, codec.PubAck):
            self._awaiting.pop(frame.request_id, None)
            self.confirmed += frame.count
        elif isinstance(frame, codec.Goodbye):
            self._closed_by_broker = BrokerError(frame.code, frame.text or "broker said goodbye")
        else:
            self._replies[frame.request_id] = frame


def connect_from_env(addr: str | None = None, api_key: str | None = None) -> Client:
    """A client configured by arguments, else BLIPMQ_ADDR / BLIPMQ_API_KEY, else defaults."""
    where = addr or os.environ.get("BLIPMQ_ADDR") or DEFAULT_ADDR
    try:
        parse_addr(where)
    except ValueError as exc:
        raise ConfigError(str(exc), "--addr") from None
    return Client(
        where, api_key if api_key is not None else os.environ.get("BLIPMQ_API_KEY", "")
    )

