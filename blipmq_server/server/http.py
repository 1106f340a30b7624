"""A tiny HTTP/1.1 listener for /metrics, /health and /ready (one request per connection);
HTTPS with ``metrics.tls``, with the TLS listeners' certificate (server/tls.py).

At most ``MAX_CONNECTIONS`` connections are served at once, each for at most ``_WAIT_S``
seconds of handshake and as long again for its request and answer; one more is closed as
soon as it is accepted and counted (``ConnectionCounters.metrics_refused``). These are not
client connections: they count neither towards ``server.max_connections`` nor against it.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from blipmq_server import metrics
from blipmq_server.broker.access import digest
from blipmq_server.server.listeners import open_listeners

if TYPE_CHECKING:
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.http")
_MAX_REQUEST = 8192
_WAIT_S = 5  # for the TLS handshake, then for the request and the answer
MAX_CONNECTIONS = 16  # a scraper or two and a health check need a few; stalled ones wait


async def serve_http(server: Server, *, task_status: trio.TaskStatus[int]) -> None:
    cfg = server.config.metrics
    listeners = await open_listeners(cfg.host, cfg.port, "metrics listener")
    sources = metrics.Sources(
        server.broker, server.counters, server.wal,
        None if server.flusher is None else server.flusher.counters, server.recovery,
        server.mqtt_sessions.stats if server.config.mqtt.enabled else None,
        (lambda: [b.status() for b in server.bridges.values()]) if server.bridges else None)
    task_status.started(listeners[0].socket.getsockname()[1])
    slots = trio.Semaphore(MAX_CONNECTIONS)
    await trio.serve_listeners(partial(_admit, server, sources, slots), listeners)


async def _admit(server: Server, sources: metrics.Sources, slots: trio.Semaphore,
                 socket: trio.SocketStream) -> None:
    """Serve a connection if fewer than ``MAX_CONNECTIONS`` are; else close it at once."""
    try:
        slots.acquire_nowait()
    except trio.WouldBlock:
        server.counters.metrics_refused += 1
        await trio.aclose_forcefully(socket)
        return
    try:
        await _handle(server, sources, socket)
    finally:
        slots.release()


async def _handle(server: Server, sources: metrics.Sources, socket: trio.SocketStream) -> None:
    stream: trio.abc.Stream = socket
    try:
        if server.config.metrics.tls:
            assert server.tls is not None
            accepted = await server.tls.accept(socket, _WAIT_S)  # a failure is counted
            if accepted is None:
                return
            stream = accepted[0]
        with trio.move_on_after(_WAIT_S):
            request = b""
            # the end of the headers (bare newlines too, as some hand-written clients send)
            while (b"\r\n\r\n" not in request and b"\n\n" not in request
                   and len(request) < _MAX_REQUEST):
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                request += chunk
            try:
                status, ctype, body = _respond(server, sources, request)
            except Exception:  # a bug here must not take the broker down
                log.exception("error while answering an HTTP request")
                status, ctype, body = "500 Internal Server Error", "text/plain", b"error\n"
            challenge = ("WWW-Authenticate: Bearer\r\n" if status.startswith("401") else "")
            head = (
                f"HTTP/1.1 {status}\r\n{challenge}Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            head_only = request[:5] == b"HEAD "  # the headers GET would have, no body
            await stream.send_all(head.encode() + (b"" if head_only else body))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


def _token(request: bytes) -> bytes | None:
    """The token an ``Authorization`` header carries: a bearer token, or basic auth's
    password (Prometheus' ``authorization`` and ``basic_auth`` scrape settings)."""
    for line in request.splitlines()[1:]:
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


def _allowed(server: Server, request: bytes, path: str) -> bool:
    cfg = server.config.metrics
    if not cfg.token_hash or (cfg.open_health and path in ("/health", "/ready")):
        return True
    token = _token(request)
    return token is not None and hmac.compare_digest(
        digest(token), bytes.fromhex(cfg.token_hash.split(":", 1)[1]))


def _respond(server: Server, sources: metrics.Sources, request: bytes) -> tuple[str, str, bytes]:
    text = "text/plain; charset=utf-8"
    try:
        method, target, _ = request.splitlines()[0].decode("latin-1").split(" ", 2)
    except (ValueError, IndexError):
        return "400 Bad Request", text, b"bad request\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", text, b"only GET\n"
    path = target.split("?", 1)[0]
    if not _allowed(server, request, path):
        server.counters.auth_failures += 1
        refused = server.counters.auth_refused
        refused["metrics"] = refused.get("metrics", 0) + 1
        return "401 Unauthorized", text, b"a token is required (metrics.token_hash)\n"
    if path == "/metrics":
        return "200 OK", metrics.CONTENT_TYPE, metrics.render(sources)
    if path == "/health":
        return "200 OK", text, b"ok\n"
    if path == "/ready":
        if server.shutdown.is_set():
            return "503 Service Unavailable", text, b"shutting down\n"
        return "200 OK", text, b"ready\n"
    return "404 Not Found", text, b"not found: try /metrics, /health or /ready\n"
