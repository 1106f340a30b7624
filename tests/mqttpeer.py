"""MQTT clients for the end-to-end tests: paho-mqtt, the mosquitto C clients, and a raw socket.

``Paho`` wraps a paho-mqtt 2.x client (3.1.1 by default) whose network thread feeds queues and
events: every wait here is for an event, with a deadline, never a fixed sleep. ``Raw`` speaks
MQTT byte by byte through ``blipmq_server.mqtt.codec``, for what a well-behaved client never
sends (no PUBACK, a resent PUBLISH with DUP, random bytes, a second CONNECT). ``mosquitto``
and ``mosquitto_spawn`` run /usr/bin/mosquitto_pub and mosquitto_sub against 127.0.0.1.
"""

from __future__ import annotations

import itertools
import queue
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from blipmq_server.mqtt import codec
from blipmq_server.mqtt.codec import ConnAck, Connect, Disconnect, Packet, Will

HOST = "127.0.0.1"
WAIT = 10.0  # the longest any single wait here lasts before the test fails
_sync_ids = itertools.count(1)


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool


class Paho:
    """One paho-mqtt client on its own network thread; no automatic reconnection."""

    def __init__(self, port: int, client_id: str = "", *, clean: bool = True,
                 will: Will | None = None, username: str | None = None,
                 password: str | None = None, keepalive: int = 60,
                 protocol: int = paho.MQTTv311, connect: bool = True) -> None:
        self.port = port
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  clean_session=clean, protocol=protocol,
                                  reconnect_on_failure=False)
        self.client.max_inflight_messages_set(100)
        self.client.max_queued_messages_set(0)
        if will is not None:
            self.client.will_set(will.topic, will.payload, will.qos, will.retain)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.keepalive = keepalive
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connacks: queue.Queue[tuple[bool, int]] = queue.Queue()
        self.acks: dict[int, list[int]] = {}  # SUBACK codes (or [] for UNSUBACK) by mid
        self._acked = threading.Condition()
        self.disconnected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe
        self.client.on_disconnect = self._on_disconnect
        self.session_present: bool | None = None
        if connect:
            self.connect()

    # -- callbacks (the network thread)
    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        self.connacks.put((bool(flags.session_present), reason.value))

    def _on_message(self, client, userdata, msg) -> None:
        self.messages.put(Message(msg.topic, bytes(msg.payload), msg.qos, bool(msg.retain),
                                  bool(msg.dup)))

    def _on_subscribe(self, client, userdata, mid, codes, properties) -> None:
        with self._acked:
            self.acks[mid] = [c.value for c in codes]
            self._acked.notify_all()

    def _on_unsubscribe(self, client, userdata, mid, codes, properties) -> None:
        with self._acked:
            self.acks[mid] = []
            self._acked.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason, properties) -> None:
        self.disconnected.set()

    # -- the test's side
    def connect(self, timeout: float = WAIT) -> bool:
        """Connect and wait for CONNACK 0; returns its session-present flag."""
        self.disconnected.clear()
        self.client.connect(HOST, self.port, self.keepalive)
        self.client.loop_start()
        try:
            present, code = self.connacks.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no CONNACK") from None
        assert code == 0, f"CONNACK refused: {code}"
        self.session_present = present
        return present

    def _wait_ack(self, mid: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        with self._acked:
            while mid not in self.acks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no SUBACK/UNSUBACK for mid {mid}")
                self._acked.wait(left)
            return self.acks.pop(mid)

    def subscribe(self, *topics: tuple[str, int], timeout: float = WAIT) -> list[int]:
        """One SUBSCRIBE of ``(filter, qos)`` pairs; returns SUBACK's return codes."""
        rc, mid = self.client.subscribe(list(topics))
        assert rc == paho.MQTT_ERR_SUCCESS, rc
        return self._wait_ack(mid, timeout)

    def unsubscribe(self, *filters: str, timeout: float = WAIT) -> None:
        rc, mid = self.client.unsubscribe(list(filters))
        assert rc == paho.MQTT_ERR_SUCCESS, rc
        self._wait_ack(mid, timeout)

    def sync(self, timeout: float = WAIT) -> None:
        """A round trip (UNSUBSCRIBE of a filter never subscribed): every packet the broker
        wrote before its UNSUBACK has been handed to ``messages`` when this returns."""
        self.unsubscribe(f"mqttpeer/sync/{next(_sync_ids)}", timeout=timeout)

    def publish(self, topic: str, payload: bytes | str, qos: int = 0, retain: bool = False,
                *, wait: bool = True, timeout: float = WAIT) -> paho.MQTTMessageInfo:
        """Publish; at QoS 1 and 2 wait for PUBACK / PUBCOMP unless ``wait`` is False."""
        info = self.client.publish(topic, payload, qos, retain)
        if qos and wait:
            info.wait_for_publish(timeout)
            assert info.is_published(), f"no PUBACK/PUBCOMP for {topic!r}"
        return info

    def get(self, timeout: float = WAIT) -> Message:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no message arrived") from None

    def take(self, n: int, timeout: float = WAIT) -> list[Message]:
        """The next ``n`` messages, all of them within ``timeout``."""
        deadline = time.monotonic() + timeout
        got: list[Message] = []
        while len(got) < n:
            try:
                got.append(self.messages.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"{len(got)} of {n} messages arrived") from None
        return got

    def drained(self) -> list[Message]:
        """What has arrived and not been taken yet (call ``sync`` first)."""
        out = []
        while True:
            try:
                out.append(self.messages.get_nowait())
            except queue.Empty:
                return out

    def wait_closed(self, timeout: float = WAIT) -> None:
        """The broker closed the connection."""
        assert self.disconnected.wait(timeout), "the broker kept the connection open"

    def disconnect(self) -> None:
        """DISCONNECT (no will), then stop the network thread."""
        self.client.disconnect()
        self.disconnected.wait(WAIT)
        self.client.loop_stop()

    def stop(self) -> None:
        """Stop without DISCONNECT (the socket is closed: an abnormal close)."""
        sock = self.client.socket()
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)  # the broker sees the end of the stream now
        self.disconnected.wait(WAIT)
        self.client.loop_stop()


class Closed(Exception):
    """The broker closed (or reset) the connection."""


class Raw:
    """MQTT over a plain socket, one packet at a time, through the broker's own codec."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=WAIT)
        self.decoder = codec.Decoder()
        self.ready: list[Packet] = []
        self.eof = False

    def send(self, *packets: Packet) -> None:
        self.sock.sendall(b"".join(codec.encode(p) for p in packets))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str = "", *, clean: bool = True, keepalive: int = 0,
                will: Will | None = None, username: str | None = None,
                password: bytes | None = None, level: int = 4) -> ConnAck:
        name = "MQTT" if level & 0x7F == 4 else "MQIsdp"  # 0x84, 0x83: a bridge's
        self.send(Connect(name, level, clean, keepalive, client_id, will, username, password))
        ack = self.recv()
        assert isinstance(ack, ConnAck), ack
        return ack

    def recv(self, timeout: float = WAIT) -> Packet:
        """The next packet; Closed when the broker ends the connection first."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.eof:
                raise Closed()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("no packet arrived")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError("no packet arrived") from None
            except ConnectionError:
                data = b""
            if not data:
                self.eof = True
                continue
            self.decoder.feed(data)
            self.ready.extend(self.decoder.packets())
        return self.ready.pop(0)

    def expect(self, kind: type, timeout: float = WAIT) -> Packet:
        packet = self.recv(timeout)
        assert isinstance(packet, kind), f"wanted {kind.__name__}, got {packet!r}"
        return packet

    def wait_closed(self, timeout: float = WAIT) -> list[Packet]:
        """Read until the broker closes the connection; returns the packets it sent first."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                got.append(self.recv(max(0.0, deadline - time.monotonic())))
            except Closed:
                return got
            except AssertionError:
                raise AssertionError(f"the broker kept the connection open (sent {got})"
                                     ) from None

    def disconnect(self) -> None:
        self.send(Disconnect())
        self.sock.close()

    def close(self) -> None:
        """Close without DISCONNECT: to the broker, the network connection was lost."""
        self.sock.close()


def raw_small_window(port: int, rcvbuf: int = 4096) -> Raw:
    """A ``Raw`` client whose socket receive buffer is ``rcvbuf`` bytes, set before it
    connects (so the TCP window stays small): one that stops reading is full at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT)
    sock.connect((HOST, port))
    raw = Raw.__new__(Raw)
    raw.sock = sock
    raw.decoder = codec.Decoder()
    raw.ready = []
    raw.eof = False
    return raw


def mosquitto(tool: str, port: int, *args: str, input: bytes | None = None,
              timeout: float = 30, version: str = "mqttv311"
              ) -> subprocess.CompletedProcess[bytes]:
    """Run mosquitto_pub or mosquitto_sub (MQTT 3.1.1 unless ``version``) to the end."""
    return subprocess.run([f"/usr/bin/{tool}", "-h", HOST, "-p", str(port), "-V", version,
                           *args], input=input, capture_output=True, timeout=timeout)


_children: list[subprocess.Popen[bytes]] = []


def track(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Have ``reap`` kill ``proc`` if it is still running at the end of the test."""
    _children.append(proc)
    return proc


def reap() -> None:
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
        if proc.stdin is not None and proc.stdin.closed:  # the test closed it: nothing to flush
            proc.stdin = None
        proc.communicate(timeout=WAIT)


def mosquitto_spawn(tool: str, port: int, *args: str, version: str = "mqttv311"
                    ) -> subprocess.Popen[bytes]:
    """Start mosquitto_pub or mosquitto_sub in the background, pipes on all three streams
    (killed by ``reap`` if still running at the end of the test)."""
    return track(subprocess.Popen([f"/usr/bin/{tool}", "-h", HOST, "-p", str(port), "-V", version,
                             *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE))
