"""A fault-injecting TCP proxy on loopback, for testing and measuring links that fail.

The bridge tests and ``bench/bridge.py`` put it between a bridge and its upstream broker and
then break the link on purpose, the ways real uplinks break:

==================  ===========================================================================
``pass_through()``  bytes are forwarded both ways (the default)
``refuse()``        new connections are refused (nothing listens on the port; the port stays
                    reserved for ``restore()``) and every current connection is reset (RST)
``cut()``           every current connection is reset (RST, SO_LINGER 0); new ones are accepted
``blackhole()``     current and new connections stay open, but every byte in both directions
                    is read and thrown away: no data, no FIN, no RST. A silently dead link: only
                    a keepalive notices it. A connection once blackholed stays dead (the bytes it
                    lost cannot be given back), even after ``restore()``
``delay(ms)``       forwarded with ``ms`` added one way, in order (both directions)
``cut_after(s)``    forwarded, but every connection accepted from now on is reset (RST) ``s``
                    seconds after it was accepted: an upstream, or a balancer in front of a
                    dying backend, that takes each client and drops it soon after, every time
                    (``delay_ms=`` adds a delay: a slow link that drops)
``restore()``       back to pass-through, no delay, no ``cut_after``, listening again
==================  ===========================================================================

It is synchronous to its user: ``with FaultProxy(("127.0.0.1", port)) as proxy:`` runs its own
``trio.run`` in a background thread, ``proxy.port`` is where to connect, and each mode call
returns once the change took effect (the RSTs are sent, the listener closed or open). Counters
are in ``proxy.stats()``.

Everything is bounded: at most ``max_connections`` connections (more are reset at once), one
``chunk``-sized read in flight per direction and ``queue`` chunks waiting per direction (the
delay line), so a fast sender is held back rather than buffered without limit (with a delay,
that caps each direction at about ``queue * chunk`` bytes per delay, as a TCP window would
on a long link). A blackholed
connection whose peers have all closed their side is held open ``dead_linger`` seconds (its
FIN must not come back) and then reset; it counts towards ``max_connections`` meanwhile.

Loopback only: it listens on 127.0.0.1 and refuses a target that is not a loopback address.
"""

from __future__ import annotations

import collections
import enum
import ipaddress
import math
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import trio

_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def _delay_s(ms: float) -> float:
    """A delay in ms as seconds; a ValueError unless finite and >= 0."""
    if not (ms >= 0 and math.isfinite(ms)):
        raise ValueError(f"delay must be a finite number of ms >= 0, not {ms}")
    return ms / 1000


class Mode(enum.Enum):
    PASS = "pass"
    REFUSE = "refuse"
    BLACKHOLE = "blackhole"


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """A snapshot of the proxy's counters. ``bytes_up`` went client -> target, ``bytes_down``
    target -> client (forwarded, that is written to the other side); ``bytes_dropped`` were
    read and thrown away by a blackhole, in either direction."""

    mode: str
    delay_ms: float
    accepted: int
    current: int
    bytes_up: int
    bytes_down: int
    bytes_dropped: int
    resets: int  # connections this proxy ended with an RST (cut, refuse, a failed upstream)
    upstream_failures: int  # accepted connections whose target could not be reached
    over_limit: int  # connections reset at once because max_connections were open
    accepted_at: tuple[float, ...]  # time.monotonic() of the last 256 accepts, oldest first
    down_at: float  # time.time() when bytes last went target -> client (0.0: never)


class _Conn:
    """One proxied connection: the accepted client socket, its upstream socket, and the cancel
    scope of the two pumps between them."""

    def __init__(self, client: trio.socket.SocketType, dead: bool) -> None:
        self.client = client
        self.upstream: trio.socket.SocketType | None = None
        self.dead = dead  # blackholed: read both sides, forward nothing, ever
        self.scope = trio.CancelScope()
        self.closed = False
        self.failed = False  # a socket error or reset: end the other side with RST as well
        self.ends_at: float | None = None  # cut_after: when it is reset (trio's clock)

    def sockets(self) -> list[trio.socket.SocketType]:
        return [s for s in (self.client, self.upstream) if s is not None]

    def reset(self) -> None:
        """RST both sides now. Tasks blocked on these sockets wake with ClosedResourceError."""
        if self.closed:
            return
        self.closed = True
        for sock in self.sockets():
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
            except OSError:
                pass
            sock.close()
        self.scope.cancel()

    def close(self) -> None:
        """An ordinary close (FIN where one was not sent yet)."""
        if self.closed:
            return
        self.closed = True
        for sock in self.sockets():
            sock.close()
        self.scope.cancel()



class FaultProxy:
    """A TCP proxy from 127.0.0.1:``port`` to ``target`` whose link can be broken on demand.

    Use as a context manager (or ``start()`` / ``close()``). The mode methods may be called
    from any thread other than the proxy's own; each returns when its effect is in place.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        max_connections: int = 64,
        chunk: int = 16384,
        queue: int = 16,
        connect_timeout: float = 5.0,
        dead_linger: float = 30.0,
    ) -> None:
        host, port = target
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"FaultProxy only proxies to loopback, not {host}")
        self.target = (host, int(port))
        self.max_connections = max_connections
        self.chunk = chunk
        self.queue = queue
        self.connect_timeout = connect_timeout
        self.dead_linger = dead_linger
        self.port = 0
        self._mode = Mode.PASS
        self._delay = 0.0  # seconds
        self._lifetime: float | None = None  # cut_after: seconds each new connection lives
        self._conns: set[_Conn] = set()
        self._accepted = 0
        self._accepted_at: collections.deque[float] = collections.deque(maxlen=256)
        self._bytes_up = 0
        self._bytes_down = 0
        self._down_at = 0.0
        self._dropped = 0
        self._resets = 0
        self._upstream_failures = 0
        self._over_limit = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._root: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._reserve: socket.socket | None = None  # holds the port while nothing listens
        self._listener: trio.socket.SocketType | None = None
        self._accept_scope: trio.CancelScope | None = None

    # --- the test thread's side ---------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        self._thread = threading.Thread(target=self._run, name=f"faultproxy->{self.target[1]}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("FaultProxy did not start within 10 s")
        if self._error is not None:
            raise RuntimeError("FaultProxy failed to start") from self._error
        return self

    def close(self) -> None:
        """Reset every connection, stop listening, end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._token is not None and self._error is None:
            try:
                trio.from_thread.run_sync(self._shutdown, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        thread.join(10)
        if thread.is_alive():
            raise RuntimeError("FaultProxy's thread did not end within 10 s")
        if self._error is not None:
            raise RuntimeError("FaultProxy failed") from self._error

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def pass_through(self) -> None:
        """Forward everything, no delay; listen again if refusing."""
        self._call(self._set, Mode.PASS, 0.0)

    def restore(self) -> None:
        """The link is back: pass-through for new connections, no delay, no ``cut_after``,
        listening again. Connections that were blackholed stay dead (their peers must notice
        and reconnect)."""
        self._call(self._set, Mode.PASS, 0.0)

    def cut_after(self, seconds: float, delay_ms: float = 0.0) -> None:
        """Forward (with ``delay_ms`` as ``delay``, listening again), but reset (RST) every
        connection accepted from now on ``seconds`` after it was accepted; connections
        already open are left alone. Any other mode call ends it."""
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"cut_after needs a finite number of seconds > 0, not {seconds}")
        self._call(self._set, Mode.PASS, _delay_s(delay_ms), seconds)

    def refuse(self) -> None:
        """Refuse new connections (connect() fails with ECONNREFUSED) and RST current ones."""
        self._call(self._set, Mode.REFUSE, None)

    def cut(self) -> None:
        """RST every current connection; new connections are still accepted."""
        self._call(self._cut_all)

    def blackhole(self) -> None:
        """Drop every byte, both ways, of current and new connections, silently."""
        self._call(self._set, Mode.BLACKHOLE, None)

    def delay(self, ms: float) -> None:
        """Forward with ``ms`` milliseconds added one way (applies to bytes read from now on);
        listening again if refusing, forwarding again for new connections if blackholed."""
        self._call(self._set, Mode.PASS, _delay_s(ms))

    def stats(self) -> ProxyStats:
        return self._call(self._snapshot)

    @property
    def mode(self) -> str:
        return self._mode.value

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._token is None or self._thread is None:
            raise RuntimeError("FaultProxy is not running")
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to the test thread by start()/close()
            self._error = e
        finally:
            self._ready.set()

    # --- the proxy's thread (trio) ------------------------------------------------------

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        reserve = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Two sockets share the port through SO_REUSEPORT: this one is bound but never
            # listens, so the port stays ours while refuse() has closed the listener, and a
            # SYN then meets no listener: the kernel answers RST (ECONNREFUSED).
            reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reserve.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            reserve.bind(("127.0.0.1", 0))
            self._reserve = reserve
            self.port = reserve.getsockname()[1]
            with trio.CancelScope() as root:
                self._root = root
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._listen()
                    self._ready.set()
                    await trio.sleep_forever()
        finally:
            for conn in list(self._conns):
                conn.reset()
            self._stop_listening()
            reserve.close()

    def _shutdown(self) -> None:
        for conn in list(self._conns):
            conn.reset()
        self._stop_listening()
        if self._root is not None:
            self._root.cancel()

    def _snapshot(self) -> ProxyStats:
        return ProxyStats(
            mode=self._mode.value, delay_ms=self._delay * 1000, accepted=self._accepted,
            current=len(self._conns), bytes_up=self._bytes_up, bytes_down=self._bytes_down,
            bytes_dropped=self._dropped, resets=self._resets,
            upstream_failures=self._upstream_failures, over_limit=self._over_limit,
            accepted_at=tuple(self._accepted_at), down_at=self._down_at,
        )

    def _set(self, mode: Mode, delay: float | None, lifetime: float | None = None) -> None:
        self._mode = mode
        self._lifetime = lifetime
        if delay is not None:
            self._delay = delay
        if mode is Mode.REFUSE:
            self._stop_listening()
            self._cut_all()
        else:
            self._listen()
        if mode is Mode.BLACKHOLE:
            for conn in self._conns:
                conn.dead = True

    def _cut_all(self) -> None:
        for conn in list(self._conns):
            if not conn.closed:
                self._resets += 1
            conn.reset()
            self._conns.discard(conn)

    def _listen(self) -> None:
        if self._listener is not None:
            return
        assert self._nursery is not None
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            raw.bind(("127.0.0.1", self.port))
            raw.listen(min(128, self.max_connections * 2))
        except BaseException:
            raw.close()
            raise
        sock = trio.socket.from_stdlib_socket(raw)
        self._listener = sock
        self._accept_scope = trio.CancelScope()
        self._nursery.start_soon(self._accept_loop, sock, self._accept_scope)

    def _stop_listening(self) -> None:
        sock, self._listener = self._listener, None
        if self._accept_scope is not None:
            self._accept_scope.cancel()
            self._accept_scope = None
        if sock is not None:
            sock.close()  # connections waiting in its backlog are reset by the kernel

    async def _accept_loop(self, listener: trio.socket.SocketType,
                           scope: trio.CancelScope) -> None:
        assert self._nursery is not None
        with scope:
            while True:  # ends when refuse()/close() cancels the scope or closes the socket
                try:
                    client, _ = await listener.accept()
                except (trio.ClosedResourceError, OSError):
                    return
                self._accepted += 1
                self._accepted_at.append(time.monotonic())
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if len(self._conns) >= self.max_connections:
                    self._over_limit += 1
                    self._resets += 1
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                    client.close()
                    continue
                conn = _Conn(client, dead=self._mode is Mode.BLACKHOLE)
                if self._lifetime is not None:
                    conn.ends_at = trio.current_time() + self._lifetime
                self._conns.add(conn)
                self._nursery.start_soon(self._serve, conn)

    async def _serve(self, conn: _Conn) -> None:
        try:
            with conn.scope:
                if not conn.dead and not await self._connect(conn):
                    self._upstream_failures += 1
                    conn.failed = True
                    return
                async with trio.open_nursery() as pumps:
                    if conn.ends_at is not None:
                        pumps.start_soon(self._expire, conn, conn.ends_at)
                    if conn.upstream is None:  # blackholed from the start: no upstream at all
                        pumps.start_soon(self._guard, conn, self._sink, conn.client)
                    else:
                        for src, dst, up in ((conn.client, conn.upstream, True),
                                             (conn.upstream, conn.client, False)):
                            send, recv = trio.open_memory_channel[tuple[float, bytes]](self.queue)
                            pumps.start_soon(self._guard, conn, self._read, conn, src, send)
                            pumps.start_soon(self._guard, conn, self._write, conn, dst, recv, up)
                if conn.dead and not conn.failed:
                    # Every peer sent its FIN into the void. Closing now would send ours back,
                    # which a dead link never does: hold the sockets (in the connection limit)
                    # until cut(), refuse(), close() or dead_linger has passed.
                    await trio.sleep(self.dead_linger)
                    conn.failed = True  # an end the peers never hear of, if they are still there
        finally:
            self._conns.discard(conn)
            if conn.failed and not conn.closed:
                self._resets += 1
                conn.reset()  # one side reset or failed: the other side learns it the same way
            else:
                conn.close()

    async def _guard(self, conn: _Conn, pump: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one pump; a socket error ends the whole connection (with RST, in _serve)."""
        try:
            await pump(*args)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            conn.failed = True
            conn.scope.cancel()

    @staticmethod
    async def _expire(conn: _Conn, ends_at: float) -> None:
        """cut_after: the connection's time is up; _serve resets both sides (RST)."""
        await trio.sleep_until(ends_at)
        conn.failed = True
        conn.scope.cancel()

    async def _connect(self, conn: _Conn) -> bool:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        conn.upstream = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with trio.move_on_after(self.connect_timeout):
            try:
                await sock.connect(self.target)
                return True
            except (OSError, trio.ClosedResourceError):
                return False
        return False

    async def _sink(self, src: trio.socket.SocketType) -> None:
        """Read and drop until the peer goes away (it sees an open, silent link)."""
        while True:  # ends at the peer's EOF or error, or when the connection is reset
            data = await src.recv(self.chunk)
            if not data:
                return
            self._dropped += len(data)

    async def _read(self, conn: _Conn, src: trio.socket.SocketType,
                    out: trio.MemorySendChannel[tuple[float, bytes]]) -> None:
        async with out:
            while True:  # ends at EOF, an error, or the connection's cancel scope
                if conn.dead:
                    await self._sink(src)
                    return
                data = await src.recv(self.chunk)
                if conn.dead:
                    self._dropped += len(data)
                    if not data:
                        return  # the peer's FIN is swallowed too
                    continue
                # the delay line: each chunk is due `delay` after it was read, and the
                # bounded channel holds the reader back when the writer is behind
                await out.send((trio.current_time() + self._delay, data))
                if not data:
                    return

    async def _write(self, conn: _Conn, dst: trio.socket.SocketType,
                     inp: trio.MemoryReceiveChannel[tuple[float, bytes]], up: bool) -> None:
        async with inp:
            async for due, data in inp:  # ends when the reader closes its end
                if conn.dead:
                    self._dropped += len(data)
                    continue
                await trio.sleep_until(due)
                if conn.dead:
                    self._dropped += len(data)
                    continue
                if not data:
                    dst.shutdown(socket.SHUT_WR)  # the peer's FIN, passed on
                    return
                view = memoryview(data)
                while view:  # each send takes at least one byte
                    sent = await dst.send(view)
                    view = view[sent:]
                    if up:
                        self._bytes_up += sent
                    else:
                        self._bytes_down += sent
                        self._down_at = time.time()
