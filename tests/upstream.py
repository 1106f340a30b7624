"""A real upstream broker for the bridge tests and benchmarks, and what arrives at it.

- ``Mosquitto``: the Debian mosquitto 2.0 (``/usr/sbin/mosquitto``) on 127.0.0.1, with a
  config written to a temporary directory, started and waited for (its port accepts and its
  "running" line is logged), stopped by its PID (SIGTERM, then SIGKILL), killed, and
  restarted on the same port; with ``persistence=True`` a restart keeps its sessions and their
  queued messages (mosquitto saves them on SIGTERM, not on SIGKILL).
- ``Collector``: a paho-mqtt subscriber (persistent session, QoS 1 by default) that records
  every message with its arrival time, thread-safely, reconnecting on its own through an
  upstream restart. ``SubCollector`` does the same with ``mosquitto_sub`` (C, so it keeps up
  with a fast drain); both answer ``tally()``: which sequence numbers 0..N-1 arrived, how many
  twice, whether each topic's numbers came in order.
- ``numbered()`` makes the payloads they count: a sequence number, a send time, padding.

Loopback only. Every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from ports import free_port  # bench/ports.py: from the worker's own block of ports

MOSQUITTO = "/usr/sbin/mosquitto"
HOST = "127.0.0.1"


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout`` s have passed (False)."""
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --- the upstream broker ------------------------------------------------------------------


class Mosquitto:
    """mosquitto 2.0 on 127.0.0.1:``port`` (a free one when 0), anonymous, its config and log
    (and persistence file) in ``directory`` (a temporary one, removed by ``close()``, when
    None). ``extra`` lines are appended to the config as they are (bridges, limits)."""

    def __init__(
        self,
        *,
        port: int = 0,
        persistence: bool = False,
        autosave_interval: int | None = None,
        extra: Iterable[str] = (),
        directory: Path | None = None,
        name: str = "mosquitto",
    ) -> None:
        if not os.access(MOSQUITTO, os.X_OK):
            raise RuntimeError(f"{MOSQUITTO} is missing: apt-get install mosquitto")
        self._own_dir = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix=f"{name}-")) if directory is None \
            else directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.persistence = persistence
        self.autosave_interval = autosave_interval
        self.extra = list(extra)
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path = self.directory / f"{name}.conf"
        self.log_path = self.directory / f"{name}.log"
        self.starts = 0

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def config(self) -> str:
        lines = [
            f"listener {self.port} {HOST}",
            "allow_anonymous true",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        ]
        if os.geteuid() == 0:
            lines.append("user root")  # as root it would switch to "mosquitto", who cannot
            # write to this directory
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.directory}/",
                      f"persistence_file {self.name}.db"]
            if self.autosave_interval is not None:
                lines.append(f"autosave_interval {self.autosave_interval}")
        else:
            lines.append("persistence false")
        return "\n".join([*lines, *self.extra, ""])

    def start(self, timeout: float = 10) -> Mosquitto:
        """Start and wait until it accepts connections and logged that it runs. A port of 0
        becomes a free one, tried up to three times should another process take it first."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        pick = self.port == 0
        for _attempt in range(3 if pick else 1):
            if pick:
                self.port = free_port()
            if self._launch(timeout):
                return self
            if pick and "Address already in use" in self.log():
                self.port = 0
                continue
            break
        raise RuntimeError(f"{self.name} did not start on port {self.port}:\n{self.log()[-2000:]}")

    def _launch(self, timeout: float) -> bool:
        self.config_path.write_text(self.config())
        mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.config_path)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.starts += 1

        def ready() -> bool:
            if not self.running:
                return True  # ends the wait; judged below
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                if b" running" not in f.read():
                    return False
            try:
                socket.create_connection(self.address, timeout=1).close()
                return True
            except OSError:
                return False

        wait_until(ready, timeout)
        if self.running and ready():
            return True
        self.stop()
        return False

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM (it saves its persistence file and ends), SIGKILL after ``timeout`` s.
        Returns the exit status, None when it was not running."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        return proc.returncode

    def kill(self) -> int | None:
        """SIGKILL: a crash; what it had not saved (see ``autosave_interval``) is lost."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        return proc.returncode

    def restart(self, *, kill: bool = False, timeout: float = 10) -> Mosquitto:
        """Stop (or kill) and start again on the same port, with the same persistence file."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# --- the payloads and what is made of them -----------------------------------------------

_NUMBER = re.compile(rb"(\d+)(?: (\d+))?")


def numbered(n: int, size: int = 100, sent_ns: int | None = None) -> bytes:
    """Payload ``n``: ``NNNNNNNNNN TTTTTTTTTTTTTTTTTTT `` then ``.`` up to ``size`` bytes (at
    least the number). T is ``time.time_ns()`` at the call unless given: the wall clock, so
    another process on this machine can tell how long the message took."""
    t = time.time_ns() if sent_ns is None else sent_ns
    head = b"%010d %019d " % (n, t)
    return head + b"." * (size - len(head)) if size > len(head) else head[:max(size, 10)]


def number_of(payload: bytes) -> int | None:
    m = _NUMBER.match(payload)
    return int(m.group(1)) if m else None


def sent_ns_of(payload: bytes) -> int | None:
    m = _NUMBER.match(payload)
    return int(m.group(2)) if m and m.group(2) else None


@dataclass(frozen=True, slots=True)
class Received:
    topic: str
    payload: bytes
    at_ns: int  # time.time_ns() at arrival (mosquitto_sub's own clock for SubCollector)
    dup: bool = False  # the DUP flag, where the client library shows it


@dataclass(frozen=True, slots=True)
class Tally:
    """What arrived of the numbers 0..expected-1 (see ``numbered``)."""

    expected: int
    received: int  # numbered messages counted, duplicates included
    distinct: int  # different numbers within 0..expected-1
    missing: tuple[int, ...]
    duplicates: int  # arrivals of a number already seen
    unexpected: int  # numbers outside 0..expected-1, or payloads with no number
    out_of_order: int  # per topic, first arrivals of a number below an earlier one's
    regressions: int  # per topic, arrivals below the previous one (redeliveries included)

    @property
    def complete(self) -> bool:
        return not self.missing


def tally(messages: Iterable[Received], expected: int) -> Tally:
    seen: dict[int, int] = {}
    high: dict[str, int] = {}  # per topic: the highest first arrival so far
    last: dict[str, int] = {}  # per topic: the previous arrival
    received = unexpected = out_of_order = regressions = 0
    for m in messages:
        n = number_of(m.payload)
        if n is None or not 0 <= n < expected:
            unexpected += 1
            continue
        received += 1
        if n < last.get(m.topic, -1):
            regressions += 1
        last[m.topic] = n
        if n in seen:
            seen[n] += 1
            continue
        seen[n] = 1
        if n < high.get(m.topic, -1):
            out_of_order += 1
        else:
            high[m.topic] = n
    missing = tuple(n for n in range(expected) if n not in seen)
    return Tally(expected=expected, received=received, distinct=len(seen), missing=missing,
                 duplicates=received - len(seen), unexpected=unexpected,
                 out_of_order=out_of_order, regressions=regressions)


# --- subscribers upstream ---------------------------------------------------------------


class _Recorder:
    """The thread-safe record both collectors share."""

    def __init__(self, ignore: Callable[[str], bool]) -> None:
        self._ignore = ignore
        self._lock = threading.Condition()
        self._messages: list[Received] = []
        self._numbers: set[int] = set()

    def _record(self, m: Received) -> None:
        if self._ignore(m.topic):
            return
        n = number_of(m.payload)
        with self._lock:
            self._messages.append(m)
            if n is not None:
                self._numbers.add(n)
            self._lock.notify_all()

    def _record_many(self, messages: list[Received]) -> None:
        """``_record`` of one read's worth, under the lock once."""
        kept = [m for m in messages if not self._ignore(m.topic)]
        numbers = [n for m in kept if (n := number_of(m.payload)) is not None]
        with self._lock:
            self._messages += kept
            self._numbers.update(numbers)
            self._lock.notify_all()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._messages)

    def distinct(self) -> int:
        """How many different sequence numbers arrived."""
        with self._lock:
            return len(self._numbers)

    def messages(self) -> list[Received]:
        with self._lock:
            return list(self._messages)

    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages()]

    def wait_count(self, n: int, timeout: float) -> bool:
        """Whether ``n`` messages (duplicates included) arrived within ``timeout`` s."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._messages) >= n, timeout)

    def wait_distinct(self, n: int, timeout: float) -> bool:
        """Whether ``n`` different sequence numbers arrived within ``timeout`` s."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._numbers) >= n, timeout)

    def wait_quiet(self, quiet: float, timeout: float) -> bool:
        """Whether a gap of ``quiet`` s with no arrival came within ``timeout`` s (the end of
        a burst of redeliveries)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:  # bounded by the deadline
                seen = len(self._messages)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(quiet, left))
                if len(self._messages) == seen and time.monotonic() <= deadline:
                    return True

    def tally(self, expected: int) -> Tally:
        return tally(self.messages(), expected)

    def clear(self) -> None:
        with self._lock:
            self._messages.clear()
            self._numbers.clear()


def mqtt_client(port: int, client_id: str = "", *, clean_session: bool = True,
                keepalive: int = 30, host: str = HOST, timeout: float = 10) -> mqtt.Client:
    """A connected paho MQTT 3.1.1 client running its network thread (``loop_start``), that
    reconnects on its own (1-2 s apart). Stop it with ``disconnect()`` then ``loop_stop()``."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                         clean_session=clean_session, protocol=mqtt.MQTTv311)
    client.reconnect_delay_set(1, 2)
    client.max_queued_messages_set(0)
    client.max_inflight_messages_set(100)
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set() if not rc.is_failure else None
    client.connect(host, port, keepalive)
    client.loop_start()
    if not connected.wait(timeout):
        client.loop_stop()
        raise RuntimeError(f"no CONNACK from {host}:{port} within {timeout} s")
    client.on_connect = None
    return client


class Collector(_Recorder):
    """Subscribes to ``topic_filter`` on the broker at 127.0.0.1:``port`` with paho-mqtt and
    records every message. A persistent session (``clean_session=False``) under a fixed
    client id, so messages queued for it while it was away (an upstream restart) arrive when
    it is back; it reconnects and subscribes again on its own. ``ignore`` leaves out topics
    (probes, status topics)."""

    def __init__(self, port: int, topic_filter: str = "#", *, qos: int = 1,
                 client_id: str | None = None, clean_session: bool = False,
                 keepalive: int = 10, ignore: Callable[[str], bool] = lambda t: False) -> None:
        super().__init__(ignore)
        self.port = port
        self.topic_filter = topic_filter
        self.qos = qos
        self.client_id = client_id or f"collector-{uuid.uuid4().hex[:12]}"
        self.clean_session = clean_session
        self.keepalive = keepalive
        self.connects = 0
        self._subscribed = threading.Event()
        self._client: mqtt.Client | None = None

    def start(self, timeout: float = 10) -> Collector:
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             clean_session=self.clean_session, protocol=mqtt.MQTTv311)
        client.reconnect_delay_set(1, 2)
        client.on_connect = self._on_connect
        client.on_subscribe = lambda c, u, mid, codes, p: self._subscribed.set()
        client.on_message = self._on_message
        self._client = client
        client.connect(HOST, self.port, self.keepalive)
        client.loop_start()
        if not self._subscribed.wait(timeout):
            self.stop()
            raise RuntimeError(f"collector: no SUBACK from port {self.port} in {timeout} s")
        return self

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: Any,
                    props: Any) -> None:
        if rc.is_failure:
            return
        self.connects += 1
        client.subscribe(self.topic_filter, self.qos)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        self._record(Received(msg.topic, bytes(msg.payload), time.time_ns(), bool(msg.dup)))

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class SubCollector(_Recorder):
    """The same record, made by ``mosquitto_sub`` (persistent session, QoS 1, arrival times
    from its own clock): fast enough for a drain of tens of thousands of messages a second.
    Ready once a probe published to ``probe_topic`` came back (mosquitto_sub does not say
    when its SUBACK came); probes are not recorded. Payloads must not contain a newline."""

    def __init__(self, port: int, topic_filter: str = "#", *, qos: int = 1,
                 client_id: str | None = None, probe_topic: str | None = None,
                 ignore: Callable[[str], bool] = lambda t: False) -> None:
        self.probe_topic = probe_topic or f"probe/{uuid.uuid4().hex[:12]}"
        probe = self.probe_topic
        super().__init__(lambda t: t == probe or ignore(t))
        self.port = port
        self.topic_filter = topic_filter
        self.qos = qos
        self.client_id = client_id or f"subcollector-{uuid.uuid4().hex[:12]}"
        self._probed = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 10) -> SubCollector:
        if shutil.which("mosquitto_sub") is None:
            raise RuntimeError("mosquitto_sub is missing: apt-get install mosquitto-clients")
        argv = ["mosquitto_sub", "-h", HOST, "-p", str(self.port), "-V", "mqttv311",
                "-q", str(self.qos), "-c", "-i", self.client_id, "-k", "10",
                "-t", self.topic_filter, "-t", self.probe_topic, "-F", "%U %t %p"]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
        self._reader = threading.Thread(target=self._read, args=(self._proc,),
                                        name="subcollector", daemon=True)
        self._reader.start()
        probe = mqtt_client(self.port)
        try:
            def probed() -> bool:
                if self._proc is None or self._proc.poll() is not None:
                    return True  # it ended: judged below
                probe.publish(self.probe_topic, b"probe", qos=0)
                return self._probed.wait(0.1)

            if not wait_until(probed, timeout, interval=0) or not self._probed.is_set():
                self.stop()
                raise RuntimeError(f"mosquitto_sub saw no probe on port {self.port} in {timeout} s")
        finally:
            probe.disconnect()
            probe.loop_stop()
        return self

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when mosquitto_sub does
            stamp, _, rest = line.rstrip(b"\n").partition(b" ")
            topic, _, payload = rest.partition(b" ")
            secs, _, frac = stamp.partition(b".")
            at_ns = int(secs) * 1_000_000_000 + int(frac.ljust(9, b"0")[:9] or b"0")
            name = topic.decode(errors="replace")
            if name == self.probe_topic:
                self._probed.set()
            self._record(Received(name, payload, at_ns))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
            self._reader = None

    def __enter__(self) -> SubCollector:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class StandIn:
    """A stand-in MQTT upstream for a bridge, one link at a time, on its own port: each
    link gets CONNACK with the session present flag ``present(n)`` (n: the link's number
    from 0), PINGRESP for each PINGREQ; a SUBSCRIBE is answered with SUBACK, or, while
    ``drop_subscribe`` is set, by closing the link; each PUBLISH is recorded
    (``published[n]``: payload and DUP) and handed to ``on_publish`` (which may answer it;
    nothing is acknowledged otherwise).
    ``subscribes[n]`` counts a link's SUBSCRIBEs. ``close`` refuses new links and cuts the
    one open."""

    def __init__(self, present: Callable[[int], bool] = lambda n: False, *,
                 drop_subscribe: bool = False,
                 on_publish: Callable[[socket.socket, Any], None] | None = None) -> None:
        self.port = free_port()
        self.present = present
        self.drop_subscribe = drop_subscribe
        self.on_publish = on_publish
        self.subscribes: list[int] = []
        self.published: list[list[tuple[bytes, bool]]] = []
        self._conn: socket.socket | None = None
        self._listener = socket.create_server((HOST, self.port))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:  # a link at a time, until closed
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.subscribes.append(0)
            self.published.append([])
            self._conn = conn
            with conn:
                self._link(conn, len(self.subscribes) - 1)

    def _link(self, conn: socket.socket, n: int) -> None:
        from blipmq_server.mqtt import codec
        from blipmq_server.mqtt.packets import (
            ConnAck,
            Connect,
            PingReq,
            PingResp,
            Publish,
            SubAck,
            Subscribe,
        )

        decoder = codec.Decoder()
        while True:  # until either side closes
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            decoder.feed(data)
            for packet in decoder.packets():
                if isinstance(packet, Connect):
                    conn.sendall(codec.encode(ConnAck(self.present(n), 0)))
                elif isinstance(packet, Subscribe):
                    self.subscribes[n] += 1
                    if self.drop_subscribe:
                        return  # the SUBSCRIBE is lost with the link
                    conn.sendall(codec.encode(SubAck(
                        packet.packet_id, tuple(q for _, q in packet.topics))))
                elif isinstance(packet, PingReq):  # a bridge's link is up on the answer
                    conn.sendall(codec.encode(PingResp()))
                elif isinstance(packet, Publish):
                    self.published[n].append((packet.payload, packet.dup))
                    if self.on_publish is not None:
                        self.on_publish(conn, packet)

    def close(self) -> None:
        import struct

        self._listener.close()
        conn = self._conn
        if conn is not None:
            try:  # a reset, not a goodbye
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
