"""A scripted stand-in for the broker, for the failures the real one will not stage.

The real broker cannot be told to fall silent, to send an oversized frame or to PING at a
chosen moment, so the client's timeouts and failure paths are tested against this: a plain
TCP listener on 127.0.0.1 that either never accepts (connect succeeds in the kernel, nothing
is ever answered) or hands every frame it receives to a script. Every loop here ends by
itself after ``lifetime`` seconds, whatever the client does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

from blipmq_server.protocol import codec

_POLL = 0.05  # how often the loops look at the stop flag while they wait for bytes


class Link:
    """The peer's side of one accepted connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames: list[codec.Frame] = []  # everything the client sent, in order

    def send(self, *frames: codec.Frame) -> None:
        self.sock.sendall(b"".join(codec.encode(f) for f in frames))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hang_up(self) -> None:
        """Close our side (the client sees the end of the stream)."""
        self.sock.shutdown(socket.SHUT_RDWR)


Script = Callable[[codec.Frame, Link], None]


def greet(frame: codec.Frame, link: Link, max_frame: int = codec.DEFAULT_MAX_FRAME) -> bool:
    """Answer HELLO and AUTH the way a broker with no API keys does; True if it was one."""
    if isinstance(frame, codec.Hello):
        link.send(codec.Welcome(codec.VERSION, max_frame, max_frame - 1024, "peer",
                                frame.request_id))
        return True
    if isinstance(frame, codec.Auth):
        link.send(codec.AuthOk(frame.request_id))
        return True
    return False


def silent_after_subscribe(frame: codec.Frame, link: Link) -> None:
    """A broker that takes the handshake and SUBSCRIBE (sub_id 7), then never says anything
    again, not even PONG."""
    if not greet(frame, link) and isinstance(frame, codec.Subscribe):
        link.send(codec.Subscribed(7, frame.request_id))


class Peer:
    """``Peer(None)``: a listener that never accepts. ``Peer(script)``: accepts connections
    one after another and calls ``script(frame, link)`` for every frame a client sends."""

    def __init__(self, script: Script | None, lifetime: float = 8.0) -> None:
        self.script = script
        self.lifetime = lifetime
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.links: list[Link] = []
        self.hung_up = threading.Event()  # a link reached the end of its client's stream
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Peer:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(self.lifetime + 5)

    def wait_for(self, done: Callable[[list[codec.Frame]], bool], timeout: float = 10) -> None:
        """Wait until ``done(frames the clients sent)`` holds."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self.frames()), timeout):
                raise AssertionError(f"the peer never saw that; it got {self.frames()}")

    def frames(self) -> list[codec.Frame]:
        return [f for link in self.links for f in link.frames]

    def _serve(self) -> None:
        deadline = time.monotonic() + self.lifetime
        try:
            if self.script is None:
                self._stop.wait(self.lifetime)  # never accept: clients wait on the backlog
                return
            self.listener.settimeout(_POLL)
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    sock, _ = self.listener.accept()
                except TimeoutError:
                    continue
                with sock:
                    self._talk(sock, deadline)
        finally:
            self.listener.close()  # resets connections still waiting on the backlog

    def _talk(self, sock: socket.socket, deadline: float) -> None:
        link = Link(sock)
        self.links.append(link)
        decoder = codec.Decoder(1 << 26)
        sock.settimeout(_POLL)
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            decoder.feed(data)
            for frame in decoder.frames():
                with self._changed:
                    link.frames.append(frame)
                    self._changed.notify_all()
                assert self.script is not None
                try:
                    self.script(frame, link)
                except OSError:  # the client went away while we answered
                    return
        self.hung_up.set()
