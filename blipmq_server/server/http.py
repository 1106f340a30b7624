"""A tiny HTTP/1.1 listener for /metrics, /health and /ready (one request per connection);
HTTPS with ``metrics.tls``, with the TLS listeners' certificate (server/tls.py)."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import trio

from blipmq_server import metrics
from blipmq_server.server.listeners import open_listeners

if TYPE_CHECKING:
    from blipmq_server.server.app import Server

log = logging.getLogger("blipmq.http")
_MAX_REQUEST = 8192
_WAIT_S = 5  # for the TLS handshake, then for the request and the answer


async def serve_http(server: Server, *, task_status: trio.TaskStatus[int]) -> None:
    cfg = server.config.metrics
    listeners = await open_listeners(cfg.host, cfg.port, "metrics listener")
    sources = metrics.Sources(
        server.broker, server.counters, server.wal,
        None if server.flusher is None else server.flusher.counters, server.recovery,
        server.mqtt_sessions.stats if server.config.mqtt.enabled else None)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_handle, server, sources), listeners)


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
            while b"\r\n\r\n" not in request and len(request) < _MAX_REQUEST:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                request += chunk
            try:
                status, ctype, body = _respond(server, sources, request)
            except Exception:  # a bug here must not take the broker down
                log.exception("error while answering an HTTP request")
                status, ctype, body = "500 Internal Server Error", "text/plain", b"error\n"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(head.encode() + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


def _respond(server: Server, sources: metrics.Sources, request: bytes) -> tuple[str, str, bytes]:
    text = "text/plain; charset=utf-8"
    try:
        method, target, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    except ValueError:
        return "400 Bad Request", text, b"bad request\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", text, b"only GET\n"
    path = target.split("?", 1)[0]
    if path == "/metrics":
        return "200 OK", metrics.CONTENT_TYPE, metrics.render(sources)
    if path == "/health":
        return "200 OK", text, b"ok\n"
    if path == "/ready":
        if server.shutdown.is_set():
            return "503 Service Unavailable", text, b"shutting down\n"
        return "200 OK", text, b"ready\n"
    return "404 Not Found", text, b"not found: try /metrics, /health or /ready\n"
