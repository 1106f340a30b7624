"""Store and forward: how fast a bridge empties a backlog queued while its uplink was down,
and how long it takes to forward a message with the link up. Prints figures, asserts none.

    .venv/bin/python bench/bridge.py [--count 100000] [--size 100] [--rate 1000]
                                     [--seconds 5] [--reconnect-min 1] [--reconnect-max 2]
                                     [--stall 30] [--idle 5] [--inflight 1000]
                                     [--system mosquitto] [--repeat 1] [--json]

Each system runs on one loopback layout, built the same way for all:

    publisher -> local broker --bridge--> FaultProxy (tests/faultproxy.py) -> upstream
                                                                   -> subscriber (QoS 0)

The upstream is a stock mosquitto 2.0 (``max_queued_messages 0``) for the mosquitto bridge
and BlipMQ's MQTT bridge, and a second BlipMQ for BlipMQ's native bridge. The subscriber is
``FastCollector``: a raw MQTT socket decoded with BlipMQ's codec, stamping each read's
arrival (mosquitto_sub's line output capped every bridge near 50k msg/s here). The subscriber
runs in this process, the proxy in a process of its own (``ProxyProcess``), all on the same
two cores as the brokers: the figures are for comparing the systems side by side, not
absolute. (With the proxy in this process too, it waited for the GIL whenever the subscriber
was decoding, up to Python's 5 ms switch interval each time, and every bridge's acks waited
with it: the native drain measured 63k msg/s so, 80k with a 0.5 ms switch interval.)

Drain: with the bridge connected (a probe went through), the proxy refuses the link (the
bridge's connection is reset, reconnects are refused); ``--count`` numbered QoS 1 messages of
``--size`` bytes are published locally by paho, 100 in flight, every one PUBACKed by the local
broker; then the link comes back and the clock runs until every number arrived upstream (or
nothing new arrived for ``--stall`` s). Figures: seconds from link-up to the first arrival
(the bridge's reconnect), seconds to empty (link-up to the last new number) and msg/s over
those seconds, msg/s of the drain itself (first to last arrival), duplicates and missing
numbers, and the CPU seconds meanwhile of the local broker, of the upstream and of the
bench's own two processes (the subscriber, and the proxy).

Idle cost: the local broker's CPU per second and RSS over ``--idle`` s with the link up and
nothing to send, then as long with the upstream refusing connections (an outage).

Latency: the link up, ``--rate`` msg/s for ``--seconds`` s, QoS 1, from a paho publisher to
the local broker; each payload carries ``time.time_ns()`` at publish, arrival minus that is the
forwarding latency (publisher -> local -> bridge -> proxy -> upstream -> subscriber).

The link-up figures include the bridge's reconnect delay, which is jittered (the
``--reconnect-min``/``--reconnect-max`` given to every system); "drain msg/s" does not.

Systems: ``mosquitto`` (mosquitto 2.0's bridge, mosquitto -> mosquitto), ``blipmq`` (BlipMQ's
bridge to the same mosquitto over MQTT 3.1.1) and ``blipmq-native`` (BlipMQ -> BlipMQ over
the native protocol). Each is a function taking ``Options`` and returning ``measure(...)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from tests.faultproxy import FaultProxy  # noqa: E402
from tests.upstream import (  # noqa: E402
    Mosquitto,
    Received,
    _Recorder,
    mqtt_client,
    numbered,
    sent_ns_of,
    tally,
    wait_until,
)

DRAIN_TOPIC = "bench/drain"
LATENCY_TOPIC = "bench/latency"


@dataclass(frozen=True, slots=True)
class Options:
    count: int = 100_000  # the backlog, messages
    size: int = 100  # payload bytes
    rate: int = 1000  # latency run, msg/s
    seconds: float = 5.0  # latency run, duration
    # the bridges' reconnect delay, s: as short as they allow, so that "to empty" measures
    # the drain more than the backoff (mosquitto 2.0.11 with one restart_timeout value waited
    # 6 s, then 12 s, between refused attempts; with "1 2" it retries every 2-3 s)
    reconnect_min: float = 1.0
    reconnect_max: float = 2.0
    drain_timeout: float = 300.0  # give up waiting for the backlog after this long, s
    stall: float = 30.0  # ... or once nothing new arrived for this long, s
    idle: float = 5.0  # idle cost: seconds with the link up and idle, then as long down
    inflight: int = 1000  # BlipMQ's bridges: messages awaiting the upstream's ack


class ProxyProcess:
    """A ``FaultProxy`` to ``target`` in a child process (``--serve-proxy``), so that it never
    waits for this process's GIL; ``refuse`` and ``restore`` return once the child says
    their effect is in place."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.pid = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ProxyProcess:
        host, port = self.target
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-proxy", f"{host}:{port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self._proc.pid
        self.port = int(self._reply().removeprefix("port "))
        return self

    def _reply(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line or line.startswith("error"):
            raise RuntimeError(f"the proxy process failed: {line or 'it ended'}")
        return line

    def _call(self, command: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        self._reply()

    def refuse(self) -> None:
        self._call("refuse")

    def restore(self) -> None:
        self._call("restore")

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the child's end of input: it closes the proxy and ends
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def serve_proxy(target: str) -> None:
    """The child of ``ProxyProcess``: prints ``port N``, then obeys a command a line."""
    host, port = target.rsplit(":", 1)
    with FaultProxy((host, int(port))) as proxy:
        print(f"port {proxy.port}", flush=True)
        for line in sys.stdin:  # until the parent closes our input
            command = line.strip()
            if command == "refuse":
                proxy.refuse()
            elif command == "restore":
                proxy.restore()
            else:
                print(f"error: unknown command {command!r}", flush=True)
                continue
            print("ok", flush=True)


@dataclass
class Link:
    """The shared half: the upstream, the proxy in front of it, the subscriber on it."""

    upstream: Mosquitto | None
    proxy: ProxyProcess
    collector: FastCollector | NativeCollector
    directory: Path
    upstream_pid: int


class FastCollector(_Recorder):
    """The upstream subscriber of the drain and latency runs: a raw MQTT 3.1.1 socket at QoS 0
    decoded with BlipMQ's own codec, a read at a time, each message stamped with the read's
    arrival time. Faster than mosquitto_sub's line output (about 50k msg/s here), so the
    bridges, not the subscriber, set the pace. Ready once a probe it publishes comes back."""

    def __init__(self, port: int, topic_filter: str) -> None:
        self.probe_topic = f"probe/{uuid.uuid4().hex[:12]}"
        probe = self.probe_topic
        super().__init__(lambda t: t == probe)
        self.port = port
        self.topic_filter = topic_filter
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._probed = threading.Event()

    def start(self, timeout: float = 10) -> FastCollector:
        from blipmq_server.mqtt import codec
        from blipmq_server.mqtt.packets import Connect, Publish, Subscribe

        sock = self._sock = socket.create_connection(("127.0.0.1", self.port), timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.sendall(codec.encode(Connect("MQTT", 4, True, 60, f"fast-{uuid.uuid4().hex[:8]}"))
                     + codec.encode(Subscribe(1, ((self.topic_filter, 0),
                                                  (self.probe_topic, 0)))))
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, args=(sock,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._probed.wait(0.1):  # bounded by the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"no probe came back on port {self.port} in {timeout} s")
            with socket.create_connection(("127.0.0.1", self.port), 5) as pub:
                pub.sendall(codec.encode(Connect("MQTT", 4, True, 0, "fast-probe"))
                            + codec.encode(Publish(self.probe_topic, b"probe")))
                pub.settimeout(5)
                pub.recv(4)  # CONNACK: the PUBLISH was read
        return self

    def _read(self, sock: socket.socket) -> None:
        from blipmq_server.mqtt import codec
        from blipmq_server.mqtt.packets import Publish

        decoder = codec.Decoder()
        probe = self.probe_topic
        while True:  # until the socket closes
            try:
                data = sock.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            at = time.time_ns()
            decoder.feed(data)
            got = []
            for p in decoder.packets():
                if p.__class__ is Publish:
                    if p.topic == probe:  # type: ignore[attr-defined]
                        self._probed.set()
                        continue
                    got.append(Received(p.topic, p.payload, at))  # type: ignore[attr-defined]
            if got:
                self._record_many(got)

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> FastCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NativeCollector(_Recorder):
    """The same record over BlipMQ's native protocol (the sync ``Client`` in a thread), for a
    BlipMQ upstream: its deliveries come in batches, where an MQTT subscriber of it would
    cap the drain at what the upstream's MQTT front end delivers."""

    def __init__(self, port: int, topic_filter: str) -> None:
        super().__init__(lambda t: False)
        self.port = port
        self.topic_filter = topic_filter
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 10) -> NativeCollector:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"no native subscription on port {self.port} in {timeout} s")
        return self

    def _read(self) -> None:
        from blipmq_cli import Client

        with Client(f"127.0.0.1:{self.port}") as client:
            sub = client.subscribe(self.topic_filter)
            self._ready.set()
            while not self._stop.is_set():  # until stop()
                try:
                    batch = sub.next_batch(timeout=0.2)
                except TimeoutError:
                    continue
                if batch is None:
                    return  # the upstream went away
                if batch:
                    at = time.time_ns()
                    self._record_many([Received(d.topic, d.payload, at) for d in batch])

    def stop(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)

    def __enter__(self) -> NativeCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def uplink(opts: Options) -> Iterator[Link]:
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp, \
            Mosquitto(name="upstream", directory=Path(tmp) / "upstream",
                      extra=["max_queued_messages 0"]) as upstream, \
            ProxyProcess(upstream.address) as proxy, \
            FastCollector(upstream.port, "bench/#") as collector:
        assert upstream.pid is not None
        yield Link(upstream, proxy, collector, Path(tmp), upstream.pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def first_arrivals(messages: list[Received]) -> list[Received]:
    """Each number's first arrival, in arrival order."""
    seen: set[bytes] = set()
    out = []
    for m in sorted(messages, key=lambda m: m.at_ns):
        key = m.payload[:10]
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def wait_bridged(link: Link, local_port: int, timeout: float = 30) -> None:
    """Publish probes locally until one arrives upstream: the bridge is connected."""
    topic = f"bench/ready/{uuid.uuid4().hex[:8]}"
    client = mqtt_client(local_port)
    try:
        def arrived() -> bool:
            client.publish(topic, b"probe", qos=0)
            return any(m.topic == topic for m in link.collector.messages())

        if not wait_until(arrived, timeout, interval=0.2):
            raise RuntimeError(f"the bridge forwarded no probe within {timeout} s")
    finally:
        client.disconnect()
        client.loop_stop()


def wait_progress(col: _Recorder, n: int, stall: float, timeout: float) -> bool:
    """Whether ``n`` different numbers arrived, waiting while new ones keep coming: at most
    ``timeout`` s, and no more than ``stall`` s without a new one."""
    deadline = time.monotonic() + timeout
    while True:  # bounded by the deadline; each turn waits at most `stall` s
        before = col.distinct()
        left = deadline - time.monotonic()
        if left <= 0:
            return col.distinct() >= n
        if col.wait_distinct(n, min(stall, left)):
            return True
        if col.distinct() == before:
            return False


def publish_acked(port: int, topic: str, count: int, size: int, timeout: float) -> None:
    """Publish ``count`` numbered QoS 1 messages with paho (100 in flight) and return once
    every one was PUBACKed. Not ``mosquitto_pub -l``: the 2.0.11 one reads a fast stdin to its
    end and disconnects with most messages never sent (34,465 of 100,000 PUBACKed here)."""
    client = mqtt_client(port, keepalive=60)
    deadline = time.monotonic() + timeout

    def acked(info: mqtt.MQTTMessageInfo) -> None:
        info.wait_for_publish(max(0.0, deadline - time.monotonic()))
        if not info.is_published():
            raise RuntimeError(f"the local broker did not PUBACK message {info.mid} "
                               f"within {timeout} s")

    try:
        # at most `queued` unacknowledged in paho's queue: its 16-bit message ids must not
        # wrap onto one still waiting
        queued = 10_000
        pending: deque[mqtt.MQTTMessageInfo] = deque()
        for n in range(count):
            if len(pending) >= queued:
                acked(pending.popleft())
            pending.append(client.publish(topic, numbered(n, size), qos=1))
        while pending:  # bounded: it only shrinks
            acked(pending.popleft())
    finally:
        client.disconnect()
        client.loop_stop()


def drain(link: Link, local_port: int, local_pid: int, opts: Options) -> dict[str, Any]:
    col = link.collector
    link.proxy.refuse()
    col.clear()
    started = time.monotonic()
    publish_acked(local_port, DRAIN_TOPIC, opts.count, opts.size, opts.drain_timeout)
    published_s = time.monotonic() - started
    leaked = sum(1 for m in col.messages() if m.topic == DRAIN_TOPIC)

    pids = (local_pid, link.upstream_pid, os.getpid(), link.proxy.pid)
    cpu_before = [cpu_seconds(pid) for pid in pids]
    up_ns = time.time_ns()
    link.proxy.restore()
    complete = wait_progress(col, opts.count, opts.stall, opts.drain_timeout)
    cpu, upstream_cpu, bench_cpu, proxy_cpu = (
        cpu_seconds(pid) - before for pid, before in zip(pids, cpu_before, strict=True))
    bench_cpu += proxy_cpu
    col.wait_quiet(0.5, 5)  # late redeliveries still count as duplicates
    got = [m for m in col.messages() if m.topic == DRAIN_TOPIC]
    result = tally(got, opts.count)
    firsts = first_arrivals(got)
    out: dict[str, Any] = {
        "backlog": opts.count, "published_msg_per_s": round(opts.count / published_s),
        "arrived_while_down": leaked, "complete": complete, "missing": len(result.missing),
        "duplicates": result.duplicates, "out_of_order": result.out_of_order,
        "local_cpu_s": round(cpu, 2), "upstream_cpu_s": round(upstream_cpu, 2),
        "bench_cpu_s": round(bench_cpu, 2),
    }
    if firsts:
        first_s = (firsts[0].at_ns - up_ns) / 1e9
        empty_s = (firsts[-1].at_ns - up_ns) / 1e9
        span_s = (firsts[-1].at_ns - firsts[0].at_ns) / 1e9
        out |= {
            "reconnect_s": round(first_s, 3),
            "to_empty_s": round(empty_s, 3),
            "msg_per_s": round(len(firsts) / empty_s) if empty_s > 0 else None,
            "drain_msg_per_s": round(len(firsts) / span_s) if span_s > 0 else None,
        }
    return out


def latency(link: Link, local_port: int, opts: Options) -> dict[str, Any]:
    col = link.collector
    col.clear()
    n = max(1, int(opts.rate * opts.seconds))
    client = mqtt_client(local_port, keepalive=60)
    try:
        start = time.monotonic()
        for i in range(n):  # open loop: each message has its slot, late ones go at once
            due = start + i / opts.rate
            ahead = due - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            client.publish(LATENCY_TOPIC, numbered(i, opts.size), qos=1)
        sent_s = time.monotonic() - start
        complete = col.wait_distinct(n, 30 + opts.seconds)
    finally:
        client.disconnect()
        client.loop_stop()
    got = [m for m in col.messages() if m.topic == LATENCY_TOPIC]
    lat = sorted((m.at_ns - (sent_ns_of(m.payload) or m.at_ns)) / 1e6 for m in first_arrivals(got))
    return {
        "latency_messages": n, "latency_sent_msg_per_s": round(n / sent_s),
        "latency_complete": complete,
        "p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3),
        "max_ms": round(lat[-1], 3) if lat else None,
    }


def measure(system: str, link: Link, local_port: int, local_pid: int,
            opts: Options) -> dict[str, Any]:
    """The drain, then the latency run, against a local broker already bridged to
    ``link.proxy.port``."""
    wait_bridged(link, local_port)
    return {"system": system, **drain(link, local_port, local_pid, opts),
            **latency(link, local_port, opts), **idle(link, local_pid, opts)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return math.nan


def idle(link: Link, local_pid: int, opts: Options) -> dict[str, Any]:
    """The local broker's CPU (ms per second) and RSS with the link up and nothing to send,
    then with the upstream unreachable (connections refused) for as long; nothing with
    ``--idle 0``."""
    out: dict[str, Any] = {}
    if opts.idle <= 0:
        return out
    for state in ("up", "down"):
        if state == "down":
            link.proxy.refuse()
        before = cpu_seconds(local_pid)
        time.sleep(opts.idle)  # the measurement itself: a fixed window of doing nothing
        out[f"idle_{state}_cpu_ms_per_s"] = round(
            (cpu_seconds(local_pid) - before) * 1000 / opts.idle, 2)
        out[f"idle_{state}_rss_mb"] = rss_mb(local_pid)
    link.proxy.restore()
    return out


# --- the systems ------------------------------------------------------------------------


def mosquitto_bridge(opts: Options) -> dict[str, Any]:
    """mosquitto 2.0's own bridge, mosquitto -> mosquitto: the bridge's session is kept in the
    local broker's memory (``cleansession false``) with no limit on queued messages."""
    with uplink(opts) as link:
        bridge = [
            "max_queued_messages 0",  # the default (1000) would drop most of the backlog
            "connection bench-uplink",
            f"address 127.0.0.1:{link.proxy.port}",
            "bridge_protocol_version mqttv311",
            "topic bench/# out 1",
            "cleansession false",
            "clientid bench-bridge",
            # decorrelated jitter between the two (whole seconds)
            f"restart_timeout {max(1, round(opts.reconnect_min))} "
            f"{max(1, round(opts.reconnect_max))}",
            "notifications false",
            "try_private false",
        ]
        with Mosquitto(name="local", directory=link.directory / "local",
                       extra=bridge) as local:
            assert local.pid is not None
            return measure("mosquitto bridge", link, local.port, local.pid, opts)


@contextmanager
def blipmq_broker(directory: Path, config: str, name: str) -> Iterator[tuple[int, int, int]]:
    """A BlipMQ broker process (the pip-installed ``blipmq``) with ``config`` added to an MQTT
    listener on a free port; yields (native port, MQTT port, pid) once it listens."""
    import subprocess

    from tests.upstream import free_port

    directory.mkdir(parents=True, exist_ok=True)
    native, mqtt_port = free_port(), free_port()
    path = directory / f"{name}.toml"
    path.write_text(f"[server]\nport = {native}\n[mqtt]\nenabled = true\nport = {mqtt_port}\n"
                    f"[metrics]\nenabled = false\n[storage]\ndata_dir = \"{directory}/data\"\n"
                    + config)
    blipmq = str(Path(sys.executable).parent / "blipmq")
    proc = subprocess.Popen([blipmq, "start", "--config", str(path), "--log-format", "plain"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=(directory / f"{name}.log").open("wb"))
    try:
        import socket

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", mqtt_port), timeout=1).close()
                return True
            except OSError:
                return proc.poll() is not None

        if not wait_until(listening, 20) or proc.poll() is not None:
            raise RuntimeError(f"blipmq {name} did not start: "
                               f"{(directory / f'{name}.log').read_text()}")
        yield native, mqtt_port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _bridge_toml(opts: Options, port: int, protocol: str) -> str:
    return (f"[[bridge]]\nname = \"bench\"\naddresses = [\"127.0.0.1:{port}\"]\n"
            f"protocol = \"{protocol}\"\ntopics = [\"bench/# out 1\"]\n"
            f"inflight = {opts.inflight}\n"
            f"backoff_min_ms = {round(opts.reconnect_min * 1000)}\n"
            f"backoff_max_ms = {round(opts.reconnect_max * 1000)}\n")


def blipmq_bridge(opts: Options) -> dict[str, Any]:
    """BlipMQ's bridge to the same mosquitto upstream over MQTT 3.1.1: the backlog is the
    local log, forwarded with up to 1,000 PUBLISHes awaiting their PUBACK."""
    with uplink(opts) as link, blipmq_broker(
            link.directory / "local", _bridge_toml(opts, link.proxy.port, "mqtt"),
            "local") as (_, mqtt_port, pid):
        return measure("blipmq bridge (mqtt)", link, mqtt_port, pid, opts)


def blipmq_native(opts: Options) -> dict[str, Any]:
    """BlipMQ -> BlipMQ over the native protocol (PUBLISH batches, one PUB_ACK each from the
    upstream's log); the upstream's subscriber reads it natively (``NativeCollector``)."""
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp, \
            blipmq_broker(Path(tmp) / "upstream", "", "upstream") as (up_native, _, up_pid), \
            ProxyProcess(("127.0.0.1", up_native)) as proxy, \
            NativeCollector(up_native, "bench/#") as collector, \
            blipmq_broker(Path(tmp) / "local", _bridge_toml(opts, proxy.port, "blipmq"),
                          "local") as (_, mqtt_port, pid):
        link = Link(None, proxy, collector, Path(tmp), up_pid)
        return measure("blipmq bridge (native)", link, mqtt_port, pid, opts)


SYSTEMS: dict[str, Callable[[Options], dict[str, Any]]] = {
    "mosquitto": mosquitto_bridge,
    "blipmq": blipmq_bridge,
    "blipmq-native": blipmq_native,
}

COLUMNS = [  # (heading, key, format)
    ("system", "system", "{}"),
    ("backlog", "backlog", "{:,}"),
    ("reconnect s", "reconnect_s", "{:.2f}"),
    ("to empty s", "to_empty_s", "{:.2f}"),
    ("msg/s", "msg_per_s", "{:,}"),
    ("drain msg/s", "drain_msg_per_s", "{:,}"),
    ("missing", "missing", "{:,}"),
    ("dups", "duplicates", "{:,}"),
    ("local CPU s", "local_cpu_s", "{:.2f}"),
    ("upstream CPU s", "upstream_cpu_s", "{:.2f}"),
    ("bench CPU s", "bench_cpu_s", "{:.2f}"),
    ("p50 ms", "p50_ms", "{:.2f}"),
    ("p99 ms", "p99_ms", "{:.2f}"),
    ("idle CPU ms/s", "idle_up_cpu_ms_per_s", "{:.1f}"),
    ("down CPU ms/s", "idle_down_cpu_ms_per_s", "{:.1f}"),
    ("RSS MB up/down", "rss", "{}"),
]


def table(results: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    results = [dict(r, rss=f"{r['idle_up_rss_mb']}/{r['idle_down_rss_mb']}"
                    if "idle_up_rss_mb" in r else None) for r in results]
    rows = [[h for h, _, _ in COLUMNS]]
    rows += [[cell(r, k, f) for _, k, f in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def medians(results: list[dict[str, Any]]) -> str:
    """Each system's median drain rate over the rounds, and its ratio to the first system's
    (the machine's speed drifts between rounds; the systems ran in turn within each)."""
    by: dict[str, list[float]] = {}
    for r in results:
        if r.get("drain_msg_per_s") is not None:
            by.setdefault(r["system"], []).append(r["drain_msg_per_s"])
    if not by:
        return "no drain completed"
    base = statistics.median(next(iter(by.values())))
    lines = ["median drain msg/s over the rounds:"]
    for system, rates in by.items():
        m = statistics.median(rates)
        lines.append(f"  {system:<24} {m:>10,.0f}  x{m / base:.2f}  "
                     f"(rounds: {', '.join(f'{r:,.0f}' for r in rates)})")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-proxy":
        serve_proxy(sys.argv[2])
        return
    d = Options()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=d.count, help="backlog messages")
    ap.add_argument("--size", type=int, default=d.size, help="payload bytes (>= 31)")
    ap.add_argument("--rate", type=int, default=d.rate, help="latency run, msg/s")
    ap.add_argument("--seconds", type=float, default=d.seconds,
                    help="latency run, seconds")
    ap.add_argument("--reconnect-min", type=float, default=d.reconnect_min,
                    help="the bridges' shortest reconnect delay, s")
    ap.add_argument("--reconnect-max", type=float, default=d.reconnect_max,
                    help="the bridges' longest reconnect delay, s")
    ap.add_argument("--stall", type=float, default=d.stall,
                    help="give up on a drain once nothing new arrived for this long, s")
    ap.add_argument("--system", action="append", choices=sorted(SYSTEMS),
                    help="run only this one (repeatable); all by default")
    ap.add_argument("--inflight", type=int, default=d.inflight,
                    help="BlipMQ's bridges: their in-flight window (inflight), messages")
    ap.add_argument("--idle", type=float, default=d.idle,
                    help="seconds of the idle cost runs (link up, then down); 0: none")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: every system once per round, in turn; then the medians")
    ap.add_argument("--json", action="store_true", help="print the results as JSON as well")
    args = ap.parse_args()
    if not 1 <= args.inflight <= 65535:
        ap.error("--inflight must be 1 to 65535")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.size < 31:
        ap.error("--size must be at least 31 bytes (number, timestamp, separators)")
    opts = Options(count=args.count, size=args.size, rate=args.rate, seconds=args.seconds,
                   reconnect_min=args.reconnect_min, reconnect_max=args.reconnect_max,
                   stall=args.stall, idle=args.idle, inflight=args.inflight)
    print(f"bridge bench: {asdict(opts)}", flush=True)
    results = []
    names = args.system or list(SYSTEMS)
    for round_ in range(args.repeat):
        for name in names:
            print(f"running {name} (round {round_ + 1} of {args.repeat}) ...", flush=True)
            results.append(SYSTEMS[name](opts))
    print(table(results))
    if args.repeat > 1:
        print(medians(results))
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
