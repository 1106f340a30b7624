"""The synchronous Python client: a thin socket shell over the sans-IO ``ClientConnection``.

    with Client("127.0.0.1:7878", api_key="k") as c:
        c.publish("sensors/temp", b"21.5")
        c.publish_many(("logs", line) for line in lines)
        c.flush()                       # raises BrokerError if the broker refused anything
        for msg in c.subscribe("alerts/#", group="pager"):
            ...

The protocol logic (handshake, request ids, replies, PUBLISH batching and confirms,
deliveries, refusals, answering the broker's PINGs, the keepalive decision) lives in
``blipmq_server.protocol.connection``; this module moves bytes and reads the clock.

QoS 0 publishes are written without waiting for a reply; a refusal (bad topic, too large)
comes back as an ERROR frame and is raised by the next ``flush()``, ``check()``,
``wait_confirms()``, ``next_batch()`` or ``close()``. ``flush()`` sends a PING and waits for
its PONG: the broker handles a connection's frames in order, so the PONG proves every earlier
publish was processed.

Nothing waits forever. ``timeout`` (10 s by default) bounds connecting plus the handshake
(ConnectError), every wait for a reply unless the call passes its own timeout (TimeoutError),
and a send the broker takes nothing of (ConnectError). While waiting for deliveries the client
keeps the link alive itself: after ``timeout`` seconds with nothing from the broker it sends a
PING, and if nothing at all arrives for another ``timeout`` it gives up (ConnectError). TCP
keepalive is on too. A write that stops part-way (that stall, or an exception such as
KeyboardInterrupt) breaks the connection off: nothing more goes out on it. Before writing,
the client reads whatever already arrived without waiting, so a long-idle publisher answers
the broker's PINGs and notices a closed connection.

Reconnects are off unless ``reconnect`` asks for them: then the call that finds the
connection lost dials the addresses again in turn (``Reconnect``'s backoff with jitter),
and the new connection takes over the unconfirmed QoS 1 messages and the subscriptions
(``ClientConnection.resume``, ``restart_point``) before the call goes on (docs/CLIENT.md).

TLS: an address ``tls://host:port`` (or an ``ssl_context``) wraps the socket in TLS after it
connects (``blipmq_cli.tls``, imported only then); the broker's certificate is verified.

Imports only the standard library and ``blipmq_server.protocol`` (no trio, typer or rich, no
ssl without TLS), so a one-shot ``blipmq pub`` starts fast.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from blipmq_cli import arguments
from blipmq_server.errors import (
    BlipError,
    BrokerError,
    ConfigError,
    ConnectError,
    LocalProtocolError,
    NotBrokerError,
    RemoteProtocolError,
    TlsError,
)
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import Delivery, Message
from blipmq_server.protocol.connection import (
    ClientConnection,
    CloseReason,
    Gap,
    Reconnect,
    restart_point,
)

if TYPE_CHECKING:
    import ssl

    from blipmq_cli.tls import TlsSocket

DEFAULT_PORT = 7878
DEFAULT_TLS_PORT = 7879  # a tls:// address without a port (the broker's server.tls_port)
DEFAULT_ADDR = f"127.0.0.1:{DEFAULT_PORT}"
_SCHEMES = ("tcp", "tls")
DEFAULT_TIMEOUT = 10.0
# bytes a receive asks for. Python allocates that much before each recv, and glibc serves
# 128 KiB or more with mmap until a free raises its threshold: a subscriber with 256 KiB
# receives was seen mapping and unmapping memory for every delivery, 20 us more per message
# at 2,000 msg/s (docs/PERFORMANCE.md, "Fifth session")
_RECV = 1 << 16
_SEND_CHUNK = 1 << 20
_PAIRS = 1024  # (topic, payload) pairs handed to the connection at a time
_PROGRESS_CHUNK = 1 << 16
_POLL_READS = 4  # reads of what already arrived before a write; more waits for the next wait
_KEEPCNT = 3
_ENDED, _WOKE = object(), object()  # next_of: every stream ended; a wake fd, no delivery
_MOVED = object()  # a request's connection was replaced by a reconnect: ask again
ASKS = 8  # times a request is asked again across reconnects before giving up (both clients)
DEFAULT_READ_AHEAD = 64 << 20  # payload bytes of deliveries read and not yet taken, at most

_T = TypeVar("_T")
# refusals of a handshake that a broker not yet (or no longer) ready gives: dialled again;
# any other (a bad API key, a version it does not speak) is final
_NOT_READY = (codec.ErrorCode.SHUTTING_DOWN, codec.ErrorCode.TOO_MANY_CONNECTIONS,
              codec.ErrorCode.TIMEOUT)


def split_scheme(addr: str) -> tuple[str | None, str]:
    """``tls://host:port`` -> ("tls", "host:port"); ``tcp://`` likewise; without a scheme
    (None, addr). Raises ValueError for another scheme."""
    scheme, sep, rest = addr.partition("://")
    if not sep:
        return None, addr
    if scheme.lower() not in _SCHEMES:
        raise ValueError(f"address {addr!r}: the scheme must be tcp:// or tls://")
    return scheme.lower(), rest


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too), or a host alone for the default port 7878 (7879
    after ``tls://``), with or without a scheme -> (host, port); raises ValueError with a
    reason."""
    scheme, addr = split_scheme(addr)
    if (addr.startswith("[") and addr.endswith("]")) or addr.count(":") == 0:
        # a host without a port, as mosquitto_pub -h
        addr = f"{addr}:{DEFAULT_TLS_PORT if scheme == 'tls' else DEFAULT_PORT}"
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    host = host.strip("[]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r}: port must be 1-65535")
    if ":" not in host:  # a name (or IPv4): what the resolver will take (IDNA)
        try:
            host.encode("idna")
        except UnicodeError:
            raise ValueError(f"address {addr!r}: {host!r} is not a valid host name (each "
                             "dot-separated label 1-63 characters, valid UTF-8)") from None
    return host, int(port)


def _tune(sock: socket.socket, timeout: float) -> None:
    """No Nagle delay; TCP keepalive probing after ``timeout`` idle seconds where offered."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = min(max(1, round(timeout)), 32767)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
    for option, value in ((idle, seconds), (getattr(socket, "TCP_KEEPINTVL", None), seconds),
                          (getattr(socket, "TCP_KEEPCNT", None), _KEEPCNT)):
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:  # refused by this platform: the defaults stay
                pass


def _refused(exc: LocalProtocolError) -> BrokerError:
    """A message checked here and refused as the broker would refuse it."""
    return BrokerError(exc.code, str(exc))


class Subscription:
    """An iterator over the deliveries of one subscription."""

    def __init__(self, client: Client, sub_id: int, topic_filter: str, group: str,
                 end: int | None = None, qos: int = 0, start: int = 0, start_offset: int = 0,
                 flags: int = 0) -> None:
        self.client = client
        self.sub_id = sub_id
        self.topic_filter = topic_filter
        self.group = group
        self.qos = qos
        self.ended = False
        self.end = end  # asked with until_end: the log's next offset when it subscribed
        self.at_end = False  # the broker marked it past ``end`` (an empty batch came)
        self.last_offset: int | None = None  # of the last delivery handed out
        self.gaps: list[Gap] = []  # what reconnects may have cost it (live subscriptions)
        self._start, self._start_offset, self._flags = start, start_offset, flags
        self._carry: deque[tuple[Delivery, ...]] = deque()  # read before a reconnect
        self._on = client._conn  # the connection it is subscribed on

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            batch = self.next_batch()
            if batch is None or self.at_end:
                return
            yield from batch

    def next_batch(self, timeout: float | None = None) -> tuple[Delivery, ...] | None:
        """The next DELIVER batch; None once the stream ended (the broker shut down, or the
        subscription was unsubscribed or its group deleted).

        Raises TimeoutError when ``timeout`` seconds pass with nothing delivered, and
        ConnectError when the broker stays silent through a keepalive PING.
        """
        timeout = arguments.wait("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # again only after a wake fd (``Client.wake_fds``) woke the wait
            left = None if deadline is None else deadline - time.monotonic()
            got = self.client.next_of([self], left)
            if got is None:
                return None
            if got[0] is not None:
                return got[1]

    def ack(self, *deliveries: Delivery) -> None:
        """Acknowledge deliveries of this subscription."""
        self.client.ack(self.sub_id, *deliveries)

    def ack_at_close(self, *deliveries: Delivery) -> None:
        """Acknowledge the last deliveries this connection will take: CREDIT 0 and the ACK
        go out with the GOODBYE of ``close()``, so the broker does not refill the window
        (deliveries it sent then would go back to the group counted once more)."""
        self.client._conn.ack_at_close(self.sub_id, arguments.deliveries(deliveries))

    @property
    def credit(self) -> int:
        """The window of unacked deliveries last asked for (QoS 1; 0: the broker's
        ``delivery.default_credit``)."""
        return self.client._conn.credit_of(self.sub_id)

    def set_credit(self, credit: int) -> None:
        """Change this QoS 1 subscription's window of unacked deliveries (0: pause)."""
        self.client._conn.credit(self.sub_id, arguments.whole("credit", credit))
        self.client._send_control()

    def nack(self, *deliveries: Delivery, delay_ms: int = 0, reason: str = "") -> None:
        """Give deliveries back: redelivered at once, or after ``delay_ms``; ``reason`` is
        what a dead letter made by this NACK says."""
        self.client.nack(self.sub_id, *deliveries, delay_ms=delay_ms, reason=reason)

    def unsubscribe(self) -> None:
        self.client._request(lambda conn: conn.unsubscribe(self.sub_id), "UNSUBSCRIBED")
        self.ended = True
        self.client._forget(self)


def targets(addr: str | Sequence[str], ssl_context: ssl.SSLContext | None
            ) -> list[tuple[str, int, bool, str]]:
    """The addresses to dial, each as (host, port, TLS or not, the address as shown):
    ``tls://`` means TLS, and so does an ``ssl_context`` with no scheme; ``tcp://`` is plain
    TCP. Raises ConfigError for an address that is not one."""
    if isinstance(addr, str):
        addrs = [addr]
    else:  # any iterable of them (a list, a tuple, a generator)
        try:
            addrs = list(addr)
        except TypeError:
            addrs = [addr]  # type: ignore[list-item]
        if not all(isinstance(a, str) for a in addrs):
            raise ConfigError(f"must be a str or a list of them, not {addr!r:.60}", "addr")
    if not addrs:
        raise ConfigError("no broker address given", "addr")
    out = []
    for one in addrs:
        if not isinstance(one, str):
            raise ConfigError(f"must be a str or a list of them, not {one!r}", "addr")
        if "," in one:
            raise ConfigError(f"{one!r} holds a comma: give several addresses as a list, "
                              f"{[a.strip() for a in one.split(',')]!r}", "addr")
        try:
            scheme = split_scheme(one)[0]
            host, port = parse_addr(one)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        secure = scheme == "tls" or (scheme is None and ssl_context is not None)
        out.append((host, port, secure, ("tls://" if secure else "") + (
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}")))
    return out


class Client:
    def __init__(
        self,
        addr: str | Sequence[str] = DEFAULT_ADDR,
        api_key: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        name: str = "blipmq-py",
        ssl_context: ssl.SSLContext | None = None,
        reconnect: Reconnect | bool = False,
        on_disconnect: Callable[[BlipError], object] | None = None,
        on_reconnect: Callable[[str], object] | None = None,
        on_gap: Callable[[Gap], object] | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        pause: Callable[[float], object] = time.sleep,
    ) -> None:
        """``addr``: ``[tls://|tcp://]host[:port]``, or several, dialled in turn when
        reconnecting (the first that answers is used at first). TLS with ``tls://``
        (verifying the broker's certificate with the system's CAs unless ``ssl_context``
        says otherwise), or with an ``ssl_context`` and no scheme; ``tcp://`` is plain TCP.

        ``reconnect`` (off by default; True for ``Reconnect()``'s policy): the call that
        finds the connection lost dials again, sends the unconfirmed QoS 1 messages again,
        subscribes again (``on_gap`` and ``Subscription.gaps`` for a live subscription),
        then goes on; ``on_disconnect(error)`` and ``on_reconnect(address)`` are told.
        ``pause(seconds)`` waits between attempts (``time.sleep``; ``pub -l`` reads stdin
        meanwhile).

        ``read_ahead``: the payload bytes of deliveries read from the socket and not yet
        taken that stop further reads (``buffered``; docs/CLIENT.md, "Flow control")."""
        arguments.connection(api_key, name, ssl_context)
        self._targets = targets(addr, ssl_context)
        self.addr = self._targets[0][3]
        self.timeout = arguments.seconds("timeout", timeout)
        self.read_ahead = arguments.count("read_ahead", read_ahead)
        self.name = name
        self.api_key = api_key
        self._ssl_context = ssl_context
        self.reconnect = arguments.reconnect(reconnect)
        self.on_disconnect = on_disconnect
        self.on_reconnect = on_reconnect
        self.on_gap = on_gap
        self.pause = pause
        self.reconnects = 0  # connections made again after a loss
        self.resent = 0  # messages a reconnect sent again
        self._subs: list[Subscription] = []  # live subscriptions, restored by a reconnect
        self._next_target = 1
        self._recovering = True  # no reconnects before the first connection is up
        self._closing = False
        self._dropping = False  # close(): deliveries not taken are dropped, not waited behind
        self._tls: TlsSocket | None = None  # the TLS layer (None: plain TCP)
        # while waiting for deliveries: wake when one of these fds is readable, and raise
        # BrokenPipeError when ``hangup_fd`` (stdout) reports that its reader went away
        self.wake_fds: tuple[int, ...] = ()
        self.hangup_fd: int | None = None
        self._woken = False
        self._conn = ClientConnection()
        error: BlipError | None = None
        for target in self._targets:
            try:
                self._dial(target)
                break
            except BlipError as exc:
                error = error or exc
        else:
            assert error is not None
            raise error
        self._recovering = False

    def _dial(self, target: tuple[str, int, bool, str]) -> None:
        """Connect to one address and finish the handshake: the client's socket and
        connection are the new ones from here (a failure closes the socket and raises)."""
        host, port, secure, self.addr = target
        timeout = self.timeout
        self._tls = None
        self._conn = ClientConnection()
        deadline = time.monotonic() + timeout
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise ConnectError(
                f"cannot connect to {self.addr}: the TCP connect timed out after {timeout:g} s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.addr}: {exc.strerror or exc}") from None
        try:
            _tune(self.sock, timeout)
            if secure:
                from blipmq_cli import tls

                context = self._ssl_context or tls.context()
                self.sock = self._tls = tls.connect(  # type: ignore[assignment]
                    self.sock, context, host, self.addr, deadline)
            # non-blocking from here on: waits are this client's own poll() calls (a socket
            # timeout would cost a mode switch and a poll before every send and receive)
            self.sock.setblocking(False)
            self._poller: tuple[tuple[int, ...], int | None, select.poll] | None = None
            self._arrived = select.poll()  # whether anything came, without waiting
            self._arrived.register(self.sock, select.POLLIN)
            self._conn.hello(self.name, self.api_key)
            try:
                # in the try: a broker that refuses the client certificate after the TLS
                # handshake may close (EPIPE, ECONNRESET) while HELLO is being written
                self._send_out()
                outcome = self._wait(self._conn.handshake, deadline - time.monotonic(),
                                     "the handshake")
            except TimeoutError:
                raise ConnectError(
                    f"cannot connect to {self.addr}: the broker did not finish the handshake "
                    f"within {timeout:g} s"
                ) from None
            except ConnectError as exc:
                if isinstance(exc, TlsError):
                    raise
                # bytes came back that are not the protocol: not a BlipMQ broker
                closed = self._conn.closed
                kind = NotBrokerError if closed is not None and (
                    closed.reason is CloseReason.MALFORMED) else ConnectError
                if self._tls is None:  # a TLS port takes HELLO for a broken TLS handshake
                    raise kind(f"{exc} during the handshake (if it is a TLS port, "
                               f"connect to tls://{self.addr})") from None
                from blipmq_cli import tls

                raise tls.closed_after_handshake(self.addr) from None
            if isinstance(outcome, codec.Error):
                raise BrokerError(outcome.code, outcome.text)
        except BaseException:
            self.abort()
            raise

    @property
    def max_message(self) -> int:
        """The largest payload the broker accepts (from WELCOME)."""
        return self._conn.max_message

    @property
    def max_frame(self) -> int:
        """The largest frame the broker sends or accepts (from WELCOME)."""
        return self._conn.max_frame

    @property
    def buffered(self) -> tuple[int, int]:
        """Deliveries (and their payload bytes) read from the broker and not yet taken."""
        conn = self._conn
        return conn.queued, conn.queued_bytes

    def _full(self) -> bool:
        """Whether ``read_ahead`` is reached: the socket is not read until some are taken."""
        return self._conn.queued_bytes >= self.read_ahead

    @property
    def confirmed(self) -> int:
        """QoS 1 messages the broker confirmed as durable."""
        return self._conn.confirmed

    @property
    def qos1_sent(self) -> int:
        """QoS 1 messages sent (or sealed for sending)."""
        return self._conn.qos1_sent

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
        """Flush, say GOODBYE and close; raises the first refusal not yet reported.
        Deliveries read and not taken are dropped, so that a full ``read_ahead`` does not
        hold the flush back (a group's go back to it unacked)."""
        conn = self._conn
        self._closing = self.reconnect is None  # with reconnects, the flush may need one
        self._dropping = True
        try:
            if conn.closed is not None:
                # the broker ended the connection: nothing to flush, but say why it refused
                refusal = conn.refusal()
                if refusal is not None:
                    raise BrokerError(refusal.code, refusal.text)
            else:
                self.flush()
                self._closing = True
                conn = self._conn
                conn.goodbye()
                self._write(conn.data_to_send())
        finally:
            self._closing = True
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
        retain: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Send one message; with ``qos=1``, return once the broker confirmed it durable.

        ``retain=True`` keeps it as the topic's last value, handed to every new subscriber
        (an empty payload clears it). ``progress(bytes_sent)`` is called as a large message
        goes out.
        """
        arguments.message(topic, payload, qos, ttl_ms, key)
        try:
            if qos or ttl_ms or key is not None or retain:
                self._conn.publish(Message(topic, payload, qos, ttl_ms, key, retain))
            else:  # the usual message: no Message made
                self._conn.publish_pairs(((topic, payload),))
        except LocalProtocolError as exc:
            raise _refused(exc) from None
        if progress is None:
            self._send_out()
        else:
            size = len(payload)
            self._send_out(lambda sent: progress(min(sent, size)), _PROGRESS_CHUNK)
        if qos:
            self.wait_confirms()

    def publish_many(self, messages: Iterable[Message | tuple[str, bytes]]) -> int:
        """Send many messages in PUBLISH batches; returns how many were sent. A bad one
        raises (ConfigError for a bad argument, BrokerError for what the broker would
        refuse); the ones before it are sent."""
        conn = self._conn
        n = 0
        pairs: list[tuple[str, bytes]] = []
        m: object = None
        try:
            for m in messages:
                if isinstance(m, Message):
                    if pairs:
                        n += self._pairs(conn, pairs)
                        pairs = []
                    conn.publish(m)  # type: ignore[arg-type]
                    n += 1
                else:
                    pairs.append(m)  # type: ignore[arg-type]
                    if len(pairs) < _PAIRS:
                        continue
                    n += self._pairs(conn, pairs)
                    pairs = []
                if conn.outgoing >= _SEND_CHUNK:
                    self._send_out()
                    conn = self._conn  # a new one after a reconnect
            n += self._pairs(conn, pairs)
        except LocalProtocolError as exc:
            arguments.given(m)
            raise _refused(exc) from None
        except (TypeError, ValueError):
            arguments.given(m)
            raise
        self._send_out()
        return n

    @staticmethod
    def _pairs(conn: ClientConnection, pairs: list[tuple[str, bytes]]) -> int:
        """``conn.publish_pairs``; a refused pair is checked for a bad argument first."""
        try:
            return conn.publish_pairs(pairs)
        except (LocalProtocolError, TypeError, ValueError):
            for pair in pairs:
                arguments.given(pair)
            raise

    def check(self) -> None:
        """Read whatever the broker sent without waiting and answer its PINGs; raise why the
        connection closed, or the first refusal. Keeps the keepalive going too: a broker
        silent for 2 x ``timeout`` is a lost connection (reconnected when that is on)."""
        self._send_out()
        conn = self._conn
        if not self._full():  # not reading: the broker's silence would prove nothing
            conn.tick(time.monotonic(), self.timeout)
        if conn.closed is not None:
            self._raise_closed()
        elif conn.outgoing:
            self._write(conn.data_to_send())  # the keepalive PING
        refusal = self._conn.refusal()
        if refusal is not None:
            raise BrokerError(refusal.code, refusal.text)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything, wait until the broker processed it (PING/PONG) and confirmed every
        QoS 1 message sent so far; raise the first refusal. ``timeout`` (default: the
        client's) bounds the whole wait."""
        timeout = arguments.wait("timeout", timeout)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._request(lambda conn: conn.ping(), "PONG", limit)
        self.wait_confirms(max(0.0, deadline - time.monotonic()))

    def wait_confirms(self, timeout: float | None = None) -> None:
        """Wait for the PUB_ACK of every QoS 1 publish sent; raise the first refusal."""
        timeout = arguments.wait("timeout", timeout)
        self._send_out()

        def confirmed() -> bool | None:
            conn = self._conn  # a new one after a reconnect: the unconfirmed went with it
            refusal = conn.refusal()
            if refusal is not None:
                raise BrokerError(refusal.code, refusal.text)
            return True if not conn.unconfirmed else None

        self._wait(confirmed, self.timeout if timeout is None else timeout, "PUB_ACK")

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
        start_time_ms: int = 0,
        until_end: bool = False,
    ) -> Subscription:
        """Subscribe; ``start`` (EARLIEST, OFFSET with ``start_offset``, or TIME with
        ``start_time_ms``, ms since the epoch) replays the log.

        ``until_end``: ``Subscription.end`` is the log's end at this moment, and once all
        that it held for this subscription was delivered (and acked, QoS 1) an empty batch
        comes and ``Subscription.at_end`` turns true; iterating stops there.

        ``start`` applies to an ephemeral subscription and to a group's first subscriber;
        a group that already exists resumes where it was. A subscription without a group
        starting at LATEST first gets the retained value of every topic it matches.
        """
        if start == codec.Start.TIME and start_time_ms:
            start_offset = start_time_ms  # the wire carries the time in start_offset
        arguments.subscription(topic_filter, group, qos, credit, start_offset, start)
        flags = codec.SUBSCRIBE_UNTIL_END if until_end else 0
        reply = self._request(
            lambda conn: conn.subscribe(topic_filter, group, qos, credit, start, start_offset,
                                        flags),
            "SUBSCRIBED",
        )
        assert isinstance(reply, codec.Subscribed)
        if until_end and reply.end is None:
            raise BrokerError(codec.ErrorCode.UNSUPPORTED,
                              f"the broker at {self.addr} does not mark the end of the log")
        sub = Subscription(self, reply.sub_id, topic_filter, group, reply.end, qos, start,
                           start_offset, flags)
        if self.reconnect is not None:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, topic_filter: str, *, group: str = "") -> int:
        """End this connection's subscriptions on a filter, or delete a consumer group."""
        arguments.names(topic_filter, group)
        reply = self._request(lambda conn: conn.unsubscribe(0, topic_filter, group),
                              "UNSUBSCRIBED")
        assert isinstance(reply, codec.Unsubscribed)
        for sub in list(self._subs):
            if sub.topic_filter == topic_filter and sub.group == group:
                self._forget(sub)
        return reply.count

    def ack(self, sub_id: int, *deliveries: Delivery) -> None:
        """Acknowledge deliveries (QoS 1; accepted and ignored for QoS 0)."""
        self._conn.ack(sub_id, arguments.deliveries(deliveries))
        self._send_control()

    def nack(
        self, sub_id: int, *deliveries: Delivery, delay_ms: int = 0, reason: str = ""
    ) -> None:
        """Negative ack: redeliver now (``delay_ms=0``) or once ``delay_ms`` has passed."""
        arguments.nack(delay_ms, reason)
        self._conn.nack(sub_id, arguments.deliveries(deliveries), delay_ms, reason)
        self._send_control()

    def stats(self, timeout: float | None = None) -> dict:
        """The broker's statistics (docs/PROTOCOL.md, "Statistics"), as a dict."""
        import json

        reply = self._request(lambda conn: conn.stats(), "STATS_REPORT",
                              arguments.wait("timeout", timeout))
        assert isinstance(reply, codec.StatsReport)
        try:
            data = json.loads(reply.data)
        except ValueError:
            raise ConnectError(f"the broker at {self.addr} sent statistics that are not "
                               "JSON") from None
        if not isinstance(data, dict):
            raise ConnectError(f"the broker at {self.addr} sent statistics that are not "
                               "a JSON object")
        return data

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time to the broker, in seconds."""
        start = time.perf_counter()
        self.flush(timeout)
        return time.perf_counter() - start

    # --------------------------------------------------------------------------- plumbing

    def _request(
        self, make: Callable[[ClientConnection], int], what: str, timeout: float | None = None
    ) -> codec.Frame:
        """Queue a request with ``make``, send it and wait for its reply (asked again on the
        new connection when a reconnect came in between)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for _ in range(ASKS):
            if self._conn.closed is not None:
                self._raise_closed()
            conn = self._conn
            rid = make(conn)
            self._send_out()

            def reply(conn: ClientConnection = conn, rid: int = rid) -> object | None:
                return conn.reply(rid) if self._conn is conn else _MOVED

            try:
                got = self._wait(reply, max(0.0, deadline - time.monotonic()), what)
            except TimeoutError:
                conn.forget(rid)
                raise
            if got is _MOVED:
                continue
            if isinstance(got, codec.Error):
                raise BrokerError(got.code, got.text)
            return got  # type: ignore[return-value]
        raise ConnectError(f"the connection to {self.addr} kept breaking while waiting for "
                           f"{what}")

    def next_of(
        self, subs: list[Subscription], timeout: float | None = None
    ) -> tuple[Subscription | None, tuple[Delivery, ...]] | None:
        """The next DELIVER batch of any of ``subs`` (taken in turn), with its subscription;
        None once all their streams ended; ``(None, ())`` when a wake fd became readable
        first. Raises like ``Subscription.next_batch``."""
        timeout = arguments.wait("timeout", timeout)
        def batch() -> object | None:
            conn = self._conn  # a new one after a reconnect
            live = 0
            for sub in subs:
                got = sub._carry.popleft() if sub._carry else conn.next_batch(sub.sub_id)
                if got is not None:
                    if got:
                        sub.last_offset = got[-1].offset
                    else:
                        sub.at_end = True  # the end mark of an until_end subscription
                    subs.append(subs.pop(subs.index(sub)))  # the others go first next time
                    return sub, got
                live += conn.subscribed(sub.sub_id)
            refusal = conn.refusal()
            if refusal is not None:
                raise BrokerError(refusal.code, refusal.text)
            closed = conn.closed
            if not live or (closed is not None and closed.ends_streams
                            and self.reconnect is None):
                return _ENDED
            if self._woken:
                self._woken = False
                return _WOKE
            return None

        got = self._wait(batch, timeout, "a delivery", keepalive=True)
        if got is _ENDED:
            return None
        return (None, ()) if got is _WOKE else got  # type: ignore[return-value]

    def _wait(
        self,
        ready: Callable[[], _T | None],
        timeout: float | None,
        what: str,
        keepalive: bool = False,
    ) -> _T:
        """Receive until ``ready()`` returns a value; raise why the connection closed.

        ``timeout`` None means no deadline, only with ``keepalive``: the connection's
        keepalive then decides when the broker has been silent for too long. With
        reconnects on, a wait with a deadline keeps the keepalive going too: past the
        deadline with the broker silent since the wait began, a PING asks, and if that goes
        unanswered the keepalive decides (a dead link: a lost connection, dialled again),
        not the deadline; a broker that answers it but not the request is slow
        (TimeoutError). The deadline starts again after a reconnect (the request was
        handed to the new connection).
        """
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout
        current = self._conn
        while True:  # each pass receives, or moves towards the deadline or the keepalive
            result = ready()
            if result is not None:
                return result
            conn = self._conn
            if conn is not current:  # reconnected (a read or write found the link lost)
                current = conn
                began = time.monotonic()
                if deadline is not None:
                    deadline = began + timeout  # type: ignore[operator]
            if conn.closed is not None:
                self._raise_closed()  # or reconnects, and the next pass asks again
                continue
            if self._full():
                if not self._dropping:
                    raise self._stuck(what)
                conn.drop_deliveries()  # close(): what is buffered will never be taken
            now = time.monotonic()
            wait = self.timeout
            # with reconnects on, a reply's wait keeps the keepalive going too: a dead link
            # is then a lost connection, dialled again, not a TimeoutError for ever after
            alive = keepalive or self.reconnect is not None
            if alive:
                wait = conn.tick(now, self.timeout)
                if conn.closed is not None:
                    continue  # silent for too long: lost (the next pass raises or reconnects)
                if conn.outgoing:
                    self._write(conn.data_to_send())  # the keepalive PING
            if deadline is not None:
                left = deadline - now
                if left <= 0 and alive and not conn.probing and not conn.heard_since(began):
                    conn.probe(now)  # silent since we asked: a dead link, or a slow broker?
                    if conn.outgoing:
                        self._write(conn.data_to_send())
                if left <= 0 and not (alive and conn.probing):
                    raise TimeoutError(
                        f"timed out after {timeout:g} s waiting for {what} from the broker "
                        f"at {self.addr}"
                    )
                if left > 0:
                    wait = min(wait, left)
            self._receive(wait)

    def _stuck(self, what: str) -> TimeoutError:
        """What a wait raises at once when ``read_ahead`` stops reads: what it waits for
        is behind deliveries nobody takes, and only the caller can take them."""
        count, size = self.buffered
        return TimeoutError(
            f"{what} from the broker at {self.addr} waits behind {count} deliveries "
            f"({size} bytes) not taken: read_ahead ({self.read_ahead} bytes) is reached; "
            "take them (next_batch) or unsubscribe")

    def _receive(self, wait: float) -> None:
        """Receive once, waiting at most ``wait`` seconds, and hand the bytes over."""
        if not self._watch(wait):
            return
        try:
            data = self.sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(exc)
            return  # reconnected
        self._feed(data)
        conn = self._conn
        if conn.outgoing and conn.closed is None:
            self._write(conn.data_to_send())  # the PONG that answers the broker's PING

    def _watch(self, wait: float) -> bool:
        """Wait for the socket, the wake fds and a hang-up of ``hangup_fd``; whether the
        socket is readable."""
        if self._tls is not None and self._tls.pending():
            return True  # TLS holds decrypted bytes the socket does not show
        sock_fd = self.sock.fileno()
        kept = self._poller
        if kept is None or kept[0] != self.wake_fds or kept[1] != self.hangup_fd:
            poller = select.poll()
            poller.register(sock_fd, select.POLLIN)
            for fd in self.wake_fds:
                poller.register(fd, select.POLLIN)
            if self.hangup_fd is not None:
                poller.register(self.hangup_fd, 0)  # POLLERR / POLLHUP are always reported
            kept = self._poller = (self.wake_fds, self.hangup_fd, poller)
        readable = False
        for fd, events in kept[2].poll(max(wait, 0.001) * 1000):
            if fd == sock_fd:
                readable = True
            elif fd == self.hangup_fd:
                if events & (select.POLLERR | select.POLLHUP):
                    raise BrokenPipeError("stdout was closed")
            else:
                self._woken = True
        return readable

    def _feed(self, data: bytes) -> None:
        try:
            self._conn.receive_data(data, time.monotonic())
        except RemoteProtocolError:
            self._raise_closed()

    def _poll(self) -> None:
        """Take in what already arrived, without waiting (a read error counts as the end
        of the stream: the caller reports the closed connection)."""
        conn = self._conn
        sock = self.sock
        arrived = self._arrived.poll
        tls = self._tls
        for _ in range(_POLL_READS):
            # a look first: a read that finds nothing raises, which costs 4x as much
            if conn.closed is not None or self._full() or not (
                    arrived(0) or (tls is not None and tls.pending())):
                return
            try:
                data = sock.recv(_RECV)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            self._feed(data)
            if 0 < len(data) < _RECV:
                return

    def _send_out(
        self, progress: Callable[[int], None] | None = None, chunk: int = _SEND_CHUNK
    ) -> None:
        """Write everything queued, after a read that does not wait: PINGs that came are
        answered, and a closed connection is reported before anything is written into it."""
        self._poll()
        if self._conn.closed is not None:
            self._raise_closed()
        data = self._conn.data_to_send()
        if data:
            self._write(data, progress, chunk)

    def _send_control(self) -> None:
        """Like ``_send_out``, for ACK, NACK and CREDIT: after a shutdown they are dropped
        quietly, as the subscription's stream has ended (``next_batch`` returns None)."""
        self._poll()
        closed = self._conn.closed
        if closed is not None:
            if not closed.ends_streams or self.reconnect is not None:
                self._raise_closed()  # or reconnects: what was queued went with the old one
                return
            self._conn.data_to_send()
            return
        data = self._conn.data_to_send()
        if data:
            self._write(data)

    def _write(
        self, data: bytes, progress: Callable[[int], None] | None = None,
        chunk: int = _SEND_CHUNK,
    ) -> None:
        """Write all of ``data``. A write that stops part-way (the broker takes nothing for
        ``timeout`` seconds, or an exception such as KeyboardInterrupt, from ``progress``
        too) breaks the connection off (``_break``): nothing more is written on it, as the
        broker would read it as the rest of the cut frame. The stall then reconnects, when
        that is on, or raises ConnectError; an exception goes on up."""
        conn = self._conn
        sent = [0]
        try:
            self._send_all(data, progress, chunk, sent)
        except BaseException as exc:
            if sent[0] < len(data) and self._conn is conn and conn.closed is None:
                self._break(conn, exc)
            raise
        if sent[0] < len(data) and self._conn is conn:  # stalled: no more room for ``timeout``
            stalled = ConnectError(f"the broker at {self.addr} took no data for "
                                   f"{self.timeout:g} s")
            self._break(conn, stalled)
            if not self._recover():
                raise stalled

    def _send_all(
        self, data: bytes, progress: Callable[[int], None] | None, chunk: int,
        sent: list[int],
    ) -> None:
        """Send ``data``, counting the bytes that went out in ``sent[0]`` (all of them once
        a reconnect replaced the connection: the old one's bytes are moot); returns early
        when the broker takes nothing for ``timeout`` seconds."""
        sock = self.sock
        view = memoryview(data)
        total = len(view)
        writable: select.poll | None = None
        while sent[0] < total:  # each pass sends, waits up to the timeout for room, or stops
            try:
                sent[0] += sock.send(view[sent[0] : sent[0] + chunk])
            except BlockingIOError:
                if writable is None:
                    writable = select.poll()
                    writable.register(sock, select.POLLOUT)
                if not writable.poll(self.timeout * 1000):
                    return
                continue
            except OSError as exc:
                self._lost(exc)
                sent[0] = total  # reconnected
                return
            if progress is not None:
                progress(sent[0])

    def _break(self, conn: ClientConnection, cause: BaseException) -> None:
        """A write to ``conn`` stopped part-way: close it and its socket for good (with
        reconnects on, the next call that needs the broker dials again)."""
        why = str(cause) if isinstance(cause, BlipError) else (
            f"a write was interrupted part-way ({type(cause).__name__})")
        conn.break_off(why)
        self.abort()

    def _lost(self, exc: OSError) -> None:
        """A read or write failed: report the refusal or GOODBYE that explains it, if one
        came, else the failure itself; returns only after a reconnect."""
        self._poll()
        conn = self._conn
        conn.receive_data(b"", time.monotonic())
        if self._recover():
            return
        closed = conn.closed
        if conn.unreported or (closed is not None and closed.reason is not CloseReason.EOF):
            self._raise_closed()
        raise ConnectError(f"connection to {self.addr} lost: {exc.strerror or exc}") from None

    def _raise_closed(self) -> None:
        """Raise why the connection is over (``ClientConnection.failure``); with reconnects
        on, return once a new connection took over instead."""
        if self._recover():
            return
        raise self._conn.failure(self.addr, 2 * self.timeout)

    def _forget(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    def _recover(self) -> bool:
        """After the connection was lost: False when reconnects are off (the caller raises
        why); else dial again (``redial``), hand the unconfirmed and unsent messages and
        the subscriptions over to the new connection, and return True; raise the final
        error (``transient``) or ConnectError on giving up."""
        old = self._conn
        closed = old.closed
        policy = self.reconnect
        if (policy is None or self._recovering or self._closing or closed is None
                or closed.reason is CloseReason.LOCAL):
            return False
        error = old.failure(self.addr, 2 * self.timeout)
        if self.on_disconnect is not None:
            self.on_disconnect(error)

        def dial() -> None:
            nonlocal old
            self.abort()
            target = self._targets[self._next_target % len(self._targets)]
            self._next_target += 1
            taken: ClientConnection | None = None
            try:
                self._dial(target)
                taken = self._conn
                self._take_over(old)
            except (BlipError, TimeoutError):
                if taken is not None:  # it took the messages over, then failed too
                    if taken.closed is None:
                        taken.receive_data(b"", time.monotonic())
                    old = taken
                raise

        self._recovering = True
        try:
            redial(policy, dial, error, "reconnecting", self.pause)
        except BlipError:
            self.abort()
            self._conn = old
            raise
        finally:
            self._recovering = False
        self.reconnects += 1
        if self.on_reconnect is not None:
            self.on_reconnect(self.addr)
        return True

    def _take_over(self, old: ClientConnection) -> None:
        """On the new connection: send ``old``'s messages again, subscribe again."""
        conn = self._conn
        self.resent += conn.resume(old)
        self._send_out()
        for sub in list(self._subs):
            if sub.ended or not sub._on.subscribed(sub.sub_id):
                self._forget(sub)  # unsubscribed, or its group deleted: not restored
                continue
            while (batch := sub._on.next_batch(sub.sub_id)) is not None:
                sub._carry.append(batch)  # read before the loss: still handed out
            start, offset, missed = restart_point(sub.group, sub.qos, sub._start,
                                                  sub._start_offset, sub.last_offset)
            rid = conn.subscribe(sub.topic_filter, sub.group, sub.qos,
                                 sub._on.credit_of(sub.sub_id), start, offset, sub._flags)
            self._send_out()
            reply = self._wait(lambda rid=rid: conn.reply(rid), self.timeout, "SUBSCRIBED")
            if isinstance(reply, codec.Error):
                raise ConnectError(f"the broker at {self.addr} refused to restore the "
                                   f"subscription to {sub.topic_filter!r}: {reply.text}")
            assert isinstance(reply, codec.Subscribed)
            sub.sub_id, sub._on = reply.sub_id, conn
            if missed:
                gap = Gap(sub.topic_filter, sub.group, sub.last_offset)
                sub.gaps.append(gap)
                if self.on_gap is not None:
                    self.on_gap(gap)


def _env_timeout() -> float:
    raw = os.environ.get("BLIPMQ_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 1e9:
        raise ConfigError(f"{raw!r} is not a positive number of seconds", "BLIPMQ_TIMEOUT")
    return seconds


def transient(exc: BaseException) -> bool:
    """Whether a failed dial may succeed when dialled again: the broker not reachable (yet),
    closing or resetting the connection before answering, silent, or not ready
    (``_NOT_READY``). A TLS failure, a refused API key, a bad address and an answer that is
    not BlipMQ's protocol (``NotBrokerError``: an HTTP server, a TLS server's alert) are
    final. A port closing without a byte (BlipMQ's TLS port dialled without TLS, an MQTT
    port) cannot be told from a proxy whose broker is not up yet: dialled again."""
    if isinstance(exc, (TlsError, NotBrokerError)):
        return False
    if isinstance(exc, BrokerError):
        return exc.code in _NOT_READY
    return isinstance(exc, (ConnectError, TimeoutError))


def redial(
    policy: Reconnect, dial: Callable[[], _T], error: BaseException, what: str,
    pause: Callable[[float], object], idle: Callable[[], bool] | None = None,
    began: float | None = None, tried: int = 0,
) -> _T | None:
    """The one reconnect loop (a first connection in ``pub -l``, a lost one in ``Client``):
    ``dial()`` after each of ``policy``'s waits (``pause``) until it returns. A final error
    (not ``transient``) is raised at once; once the policy gives up, ConnectError ("gave up
    ``what`` after S s (N attempts)", counting ``tried`` before and the time since
    ``began``) with the last error (``error`` at first). None when ``idle()`` says, after a
    wait, that there is nothing left to send."""
    import random

    began = time.monotonic() if began is None else began
    for wait in policy.waits(random.random):
        pause(wait)
        if idle is not None and idle():
            return None
        tried += 1
        try:
            return dial()
        except (BlipError, TimeoutError) as exc:
            if not transient(exc):
                raise
            error = exc
    raise ConnectError(f"gave up {what} after {time.monotonic() - began:.1f} s "
                       f"({tried} attempts): {error}")


def connect_from_env(
    addr: str | None = None, api_key: str | None = None, timeout: float | None = None, *,
    reconnect: Reconnect | bool = False,
    on_disconnect: Callable[[BlipError], object] | None = None,
    on_reconnect: Callable[[str], object] | None = None,
    pause: Callable[[float], object] = time.sleep,
) -> Client:
    """A client configured by arguments, else BLIPMQ_ADDR / BLIPMQ_API_KEY / BLIPMQ_TIMEOUT,
    else defaults; TLS by the address's scheme and BLIPMQ_CAFILE / BLIPMQ_CERT /
    BLIPMQ_CERT_KEY / BLIPMQ_INSECURE (``tls_address``). ``reconnect``, the callbacks and
    ``pause`` are ``Client``'s."""
    env = os.environ
    cafile, cert = env.get("BLIPMQ_CAFILE") or None, env.get("BLIPMQ_CERT") or None
    key = env.get("BLIPMQ_CERT_KEY") or None
    insecure = _env_flag("BLIPMQ_INSECURE")
    where = tls_address(addr or env.get("BLIPMQ_ADDR"), bool(cafile or cert or key or insecure))
    try:
        parse_addr(where)
        secure = split_scheme(where)[0] == "tls"
    except ValueError as exc:
        raise ConfigError(str(exc), "--addr") from None
    if api_key is None:
        api_key, source = env.get("BLIPMQ_API_KEY", ""), "BLIPMQ_API_KEY"
    else:
        source = "--api-key"
    try:
        api_key.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the API key is not valid UTF-8", source) from None
    context = None
    if secure:
        from blipmq_cli import tls

        context = tls.context(cafile, cert, key, insecure)
    return Client(
        where,
        api_key,
        timeout=_env_timeout() if timeout is None else timeout,
        ssl_context=context,
        reconnect=reconnect,
        on_disconnect=on_disconnect,
        on_reconnect=on_reconnect,
        pause=pause,
    )


def tls_address(addr: str | None, tls: bool) -> str:
    """The address to connect to: ``addr`` (or the default), with ``tls://`` in front when
    ``tls`` asks for TLS and the address names no scheme (``tcp://`` keeps plain TCP). The
    default address with TLS is the default TLS port, 127.0.0.1:7879."""
    if not addr:
        return "tls://127.0.0.1" if tls else DEFAULT_ADDR
    if tls and "://" not in addr:
        return "tls://" + addr
    return addr


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{raw!r} is not a boolean (1 or 0)", name)
