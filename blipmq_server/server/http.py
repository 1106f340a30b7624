"""A tiny HTTP/1.1 listener for /metrics, /health and /ready (one request per connection);
HTTPS with ``metrics.tls``, with the TLS listeners' certificate (server/tls.py).

At most ``MAX_CONNECTIONS`` connections are served at once, each for at most ``_WAIT_S``
seconds of handshake, as long again for its request, as long again for the /metrics page and
as long again to send its answer; one more is closed as soon as it is accepted and counted
(``ConnectionCounters.metrics_refused``). A refused token is answered only after
``auth.failure_delay_ms``, its place held meanwhile (server/keys.py). Once answered, a
connection gives its place back and, among at most ``MAX_LINGERING``, reads what its client
still sends for at most ``_LINGER_S`` before it is closed (``_linger``). These are not
client connections: they count neither towards ``server.max_connections`` nor against it.

/metrics is written by one connection at a time, a part at a time, with a checkpoint between
parts, and handed to every scrape that came meanwhile, a large one to those that come soon
after too (``Page``): scrapes cannot hold the event loop for longer than a part takes
(~1 ms), however many groups there are, nor keep it writing pages most of the time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import trio

from blipmq_server import metrics
from blipmq_server.broker.access import digest
from blipmq_server.server.listeners import open_listeners
from blipmq_server.server.session import peer_of

if TYPE_CHECKING:
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.http")
_MAX_HEAD = 8192  # the request line and headers; more is answered 431
_WAIT_S = 5  # for the TLS handshake, the request, the /metrics page, sending the answer
MAX_CONNECTIONS = 16  # a scraper or two and a health check need a few; stalled ones wait
MAX_LINGERING = 16  # answered connections reading what their client still sends (_linger)
# a page that took ``_SLOW_S`` or more to write is handed out again for ``_REUSE`` times as
# long as it took, up to ``FRESH_S``, after it is written: scrapes without pause then keep
# the event loop writing pages a tenth of the time at most (less for pages that take more
# than 0.1 s); a small page is written anew for every scrape
_SLOW_S = 0.01
_REUSE = 10
FRESH_S = 1.0
# after the answer: how long and how much of what the client still sends (a body, the rest
# of a long head) is read and dropped, so that closing does not reset the connection
_LINGER_S = 1.0
_LINGER_BYTES = 65536
_TEXT = "text/plain; charset=utf-8"


class Answer(NamedTuple):
    status: str
    body: bytes
    ctype: str = _TEXT
    headers: str = ""  # more header lines, each ending in CRLF


def reuse_for(took: float) -> float:
    """How long after it is written a page that took ``took`` seconds to write is handed
    out again."""
    return 0.0 if took < _SLOW_S else min(FRESH_S, _REUSE * took)


class _Writing:
    """A page being written: those who wait for it wait for ``done``, then read ``page``
    (None: its writer gave up)."""

    __slots__ = ("done", "page")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.page: bytes | None = None


class Page:
    """The /metrics page as the connections get it: at most one is written at a time, a
    part at a time with a checkpoint between parts (``metrics.pages``); a scrape that comes
    while one is being written waits for it and gets it, and a large page is handed out
    again for a while (``reuse_for``) without writing another."""

    def __init__(self, sources: metrics.Sources) -> None:
        self.sources = sources
        self._kept: tuple[float, bytes] | None = None  # until when it is handed out, a page
        self._writing: _Writing | None = None

    async def get(self) -> bytes:
        while True:
            if self._kept is not None:
                if trio.current_time() < self._kept[0]:
                    return self._kept[1]
                self._kept = None  # not held in memory until the next one is written
            writing = self._writing
            if writing is None:
                return await self._write()
            await writing.done.wait()
            if writing.page is not None:
                return writing.page
            # its writer gave up (its scraper's time ran out): write one here

    async def _write(self) -> bytes:
        self._writing = writing = _Writing()
        began = trio.current_time()
        try:
            parts: list[bytes] = []
            for part in metrics.pages(self.sources):
                parts.append(part)
                await trio.lowlevel.checkpoint()
            writing.page = page = b"".join(parts)
            now = trio.current_time()
            if reuse := reuse_for(now - began):
                self._kept = (now + reuse, page)
            return page
        finally:
            self._writing = None
            writing.done.set()


async def serve_http(server: Server, *, task_status: trio.TaskStatus[int]) -> None:
    cfg = server.config.metrics
    listeners = await open_listeners(cfg.host, cfg.port, "metrics listener")
    page = Page(metrics.Sources(
        server.broker, server.counters, server.wal,
        None if server.flusher is None else server.flusher.counters, server.recovery,
        server.mqtt_sessions.stats if server.config.mqtt.enabled else None,
        (lambda: [b.status() for b in server.bridges.values()]) if server.bridges else None))
    task_status.started(listeners[0].socket.getsockname()[1])
    slots = trio.Semaphore(MAX_CONNECTIONS)
    lingering = trio.Semaphore(MAX_LINGERING)
    await trio.serve_listeners(partial(_admit, server, page, slots, lingering), listeners)


async def _admit(server: Server, page: Page, slots: trio.Semaphore, lingering: trio.Semaphore,
                 socket: trio.SocketStream) -> None:
    """Serve a connection if fewer than ``MAX_CONNECTIONS`` are; else close it at once.
    Once answered, it gives its place back and lingers apart (``_linger``), so that a
    scraper that comes back at once is not turned away by its own last connection."""
    try:
        slots.acquire_nowait()
    except trio.WouldBlock:
        server.counters.metrics_refused += 1
        await trio.aclose_forcefully(socket)
        return
    try:
        try:
            answered = await _serve(server, page, socket)
        finally:
            slots.release()
        if answered:
            await _linger(socket, lingering)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(socket)  # over TLS too: no close_notify, as ever


async def _serve(server: Server, page: Page, socket: trio.SocketStream) -> bool:
    """Read a request and answer it; True once the answer is sent whole."""
    stream: trio.abc.Stream = socket
    if server.config.metrics.tls:
        assert server.tls is not None
        accepted = await server.tls.accept(socket, _WAIT_S)  # a failure is counted
        if accepted is None:
            return False
        stream = accepted[0]
    head: bytes | str | None = None
    with trio.move_on_after(_WAIT_S):
        head = await _receive(stream)
    if head is None:  # nothing whole in time: closed without a word
        return False
    try:
        answer = (Answer(head, f"{head.split(' ', 1)[1].lower()}\n".encode())
                  if isinstance(head, str) else
                  await _respond(server, page, head, peer_of(socket)))
    except Exception:  # a bug here must not take the broker down
        log.exception("error while answering an HTTP request")
        answer = Answer("500 Internal Server Error", b"error\n")
    if answer is None:
        return False
    challenge = "WWW-Authenticate: Bearer\r\n" if answer.status.startswith("401") else ""
    wire = (
        f"HTTP/1.1 {answer.status}\r\n{challenge}{answer.headers}"
        f"Content-Type: {answer.ctype}\r\nContent-Length: {len(answer.body)}\r\n"
        f"Connection: close\r\n\r\n"
    ).encode()
    if not (isinstance(head, bytes) and head[:5] == b"HEAD "):  # HEAD: no body
        wire += answer.body
    with trio.move_on_after(_WAIT_S) as sending:
        await stream.send_all(wire)
    return not sending.cancelled_caught


async def _receive(stream: trio.abc.Stream) -> bytes | str:
    """The request's head, or the status to refuse it with."""
    data = b""
    while True:
        chunk = await stream.receive_some(4096)
        data += chunk
        found = head_of(data, ended=not chunk)
        if found is not None:
            return found


def head_of(data: bytes, *, ended: bool) -> bytes | str | None:
    """What the first bytes of a connection hold: the request's head (its request line and
    header lines, without the empty line that ends them), the status to refuse it with, or
    None while more is needed. ``ended``: the client sent all it will. One empty line
    before the request line is skipped (RFC 9112 2.2); lines may end in bare newlines, as
    some hand-written clients send them; a head that ends with the connection is taken as
    it is."""
    if data.startswith(b"\r\n"):
        data = data[2:]
    elif data.startswith(b"\n"):
        data = data[1:]
    if data.startswith((b"\r\n", b"\n")):  # a second empty line: no request line
        return "400 Bad Request"
    ends = [i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0]
    end = min(ends) if ends else len(data)
    if end > _MAX_HEAD:
        return "431 Request Header Fields Too Large"
    if ends or ended:
        return data[:end]
    return None


def _target(target: str) -> str:
    """The path of a request target: origin form (``/metrics?x``), or absolute form
    (``http://host:9090/metrics``, which a server must accept: RFC 9112 3.2.2)."""
    scheme, sep, rest = target.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        target = "/" + rest.partition("/")[2]
    return target.split("?", 1)[0]


def _token(head: bytes) -> bytes | None:
    """The token an ``Authorization`` header carries: a bearer token, or basic auth's
    password (Prometheus' ``authorization`` and ``basic_auth`` scrape settings)."""
    for line in head.splitlines()[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"authorization":
            continue
        scheme, _, credentials = value.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            return credentials.strip()
        if scheme.lower() == b"basic":
            try:
                return base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except (ValueError, binascii.Error):
                return None
    return None


def _allowed(server: Server, head: bytes, path: str) -> bool:
    cfg = server.config.metrics
    if not cfg.token_hash or (cfg.open_health and path in ("/health", "/ready")):
        return True
    token = _token(head)
    return token is not None and hmac.compare_digest(
        digest(token), bytes.fromhex(cfg.token_hash.split(":", 1)[1]))


async def _respond(server: Server, page: Page, head: bytes, peer: str) -> Answer | None:
    """The answer to a request; None: none in time (the page took too long)."""
    try:
        method, target, _ = head.splitlines()[0].decode("latin-1").split(" ", 2)
    except (ValueError, IndexError):
        return Answer("400 Bad Request", b"bad request\n")
    if method not in ("GET", "HEAD"):
        return Answer("405 Method Not Allowed", b"only GET and HEAD\n",
                      headers="Allow: GET, HEAD\r\n")
    path = _target(target)
    if not _allowed(server, head, path):
        server.counters.auth_failures += 1
        refused = server.counters.auth_refused
        refused["metrics"] = refused.get("metrics", 0) + 1
        # as a refused key: logged rarely, answered after auth.failure_delay_ms, the
        # connection's slot held meanwhile
        await server.keys.refused(peer, "metrics", "a metrics token")
        return Answer("401 Unauthorized", b"a token is required (metrics.token_hash)\n")
    if path == "/metrics":
        with trio.move_on_after(_WAIT_S):
            return Answer("200 OK", await page.get(), metrics.CONTENT_TYPE)
        return None
    if path == "/health":
        return Answer("200 OK", b"ok\n")
    if path == "/ready":
        if server.shutdown.is_set():
            return Answer("503 Service Unavailable", b"shutting down\n")
        return Answer("200 OK", b"ready\n")
    return Answer("404 Not Found", b"not found: try /metrics, /health or /ready\n")


async def _linger(socket: trio.SocketStream, lingering: trio.Semaphore) -> None:
    """After the answer: end the sending side (FIN) and read and drop what the client still
    sends (a body, the rest of a head too long) until it closes, for at most ``_LINGER_S``
    and ``_LINGER_BYTES``. Closed with unread input, the connection would be reset (RST),
    and a client that had not read the answer yet would lose it. Over TLS too: the answer
    is on the socket by now, what follows is dropped unread. At most ``MAX_LINGERING``
    linger at once; one more is closed at once."""
    try:
        lingering.acquire_nowait()
    except trio.WouldBlock:
        return
    try:
        with trio.move_on_after(_LINGER_S):
            await socket.send_eof()
            left = _LINGER_BYTES
            while left > 0:
                chunk = await socket.receive_some(min(left, 16384))
                if not chunk:
                    return
                left -= len(chunk)
    finally:
        lingering.release()
