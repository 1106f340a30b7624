"""BlipMQ side by side with mosquitto, nats-server (core and JetStream) and redis-server, in
one run on one machine; prints figures, never fails on them.

    .venv/bin/python bench/compare.py                 # everything, results in docs/bench/
    .venv/bin/python bench/compare.py --quick         # a smoke run of a few seconds per broker
    .venv/bin/python bench/compare.py --brokers blipmq,redis --workloads throughput,latency

Each broker is started by this script on 127.0.0.1 with its own temporary config and port and
stopped by PID; peers come from Debian (installed with apt-get when missing and running as
root, else skipped with the reason). JetStream, default and sync-always, runs on Debian
trixie's nats-server 2.10, unpacked into a cache by bench/newer_nats.py (Debian 12's 2.9
refuses sync_interval); core NATS on Debian 12's. Each is driven by its usual Python client
in separate processes (bench/drive.py) and, for mosquitto and redis, also by their C tools
in a shell pipe. Loss is counted from sequence numbers in every payload, never assumed.
Broker CPU time (utime + stime from /proc/PID/stat) per delivered message is the figure that
survives a noisy machine; throughput and latency run three times each (``--repeat``) and
the median run is kept. The latency runs go in rounds, each broker once a round, on a new
broker each time, so that a machine whose speed drifts weighs on all of them alike.

The ``mqtt`` workloads put BlipMQ's MQTT listener beside mosquitto, both driven by the same
MQTT clients: `mosquitto_pub -l` -> `mosquitto_sub` at QoS 0 (and `mosquitto_pub -q 1 -l` for
confirmed QoS 1, BlipMQ at wal.fsync = always), paho-mqtt 1 -> 1, 1 -> 4 and latency at
2,000 msg/s (drive.py's paho workers), 1,000 idle connections held by bench/mqttload.py, and,
BlipMQ only, 10,000 persistent sessions restored by a restart. ``--workloads mqtt-latency``
runs the MQTT latency rounds alone (BlipMQ's MQTT listener and mosquitto, paho at 2,000
msg/s). Writes results.csv, results.json, summary.md and PNG charts to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import newer_nats  # bench/newer_nats.py, beside this script
from ports import free_port, wait_port  # bench/ports.py

HERE = Path(__file__).resolve().parent
PY = sys.executable
BLIPMQ = str(Path(PY).with_name("blipmq"))
DRIVE = str(HERE / "drive.py")
PEERS = {  # broker -> (executable, Debian packages)
    "mosquitto": ("mosquitto", "mosquitto mosquitto-clients"),
    "nats": ("nats-server", "nats-server"),
    "redis": ("redis-server", "redis-server redis-tools"),
}
CLIENT = {"blipmq": "blipmq", "mosquitto": "paho", "nats": "nats", "redis": "redis"}
CLIENT_NAME = {"blipmq": "blipmq client", "paho": "paho-mqtt", "nats": "nats-py",
               "redis": "redis-py"}
SIZES = {"full": {100: 100_000, 4096: 25_000, 65536: 3_000},
         "quick": {100: 3_000, 4096: 1_000, 65536: 200}}
WORKLOADS = ("throughput", "latency", "durable", "pipe", "curve", "mqtt", "clients")
# run only when named: the MQTT latency rounds alone (the "mqtt" workloads include them)
EXTRA_WORKLOADS = ("mqtt-latency",)


def find(exe: str) -> str | None:
    return shutil.which(exe) or next(
        (p for p in (f"/usr/sbin/{exe}", f"/usr/bin/{exe}") if Path(p).exists()), None)


class Broker:
    """One broker process: started here, measured from /proc, stopped by PID. ``mqtt_port``:
    BlipMQ's MQTT listener, waited for as well (mosquitto's is its one port)."""

    def __init__(self, name: str, argv: list[str], port: int, cwd: Path,
                 mqtt_port: int | None = None) -> None:
        self.name, self.port, self.dir, self.argv = name, port, cwd, argv
        self.url = f"127.0.0.1:{port}"
        self.mqtt_port = mqtt_port or port
        self.mqtt_url = f"127.0.0.1:{self.mqtt_port}"
        self.lines: list[str] = []  # the last lines of its stderr
        self.ready_at: float | None = None  # when BlipMQ's ready line ("listening on") came
        self.started = started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        reader = threading.Thread(target=self._read_stderr, daemon=True)  # drains it
        reader.start()
        if not all(wait_port(p, self.proc) for p in dict.fromkeys((port, self.mqtt_port))):
            if self.proc.poll() is not None:
                reader.join(5)
                err = self.lines[-1:]
            else:
                err = ["not accepting after 20 s"]
            self.stop()
            raise RuntimeError(f"{name} did not start: {err}")
        self.startup_ms = (time.monotonic() - started) * 1000

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if self.ready_at is None and "listening on" in line:
                self.ready_at = time.monotonic()
            self.lines.append(line)
            del self.lines[:-50]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self, key: str) -> float:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return round(int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024, 1)  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_broker(kind: str, work: Path, *, fsync: str = "always",
                 jetstream: str | None = None, exe: str | None = None,
                 mqtt: bool = False) -> Broker:
    """``mqtt``: BlipMQ with its MQTT listener too, on a port of its own."""
    port = free_port()
    mqtt_port = None
    d = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=work))
    if kind == "blipmq":
        listener = ""
        if mqtt:
            mqtt_port = free_port()
            listener = f"[mqtt]\nenabled = true\nhost = \"127.0.0.1\"\nport = {mqtt_port}\n"
        (d / "b.toml").write_text(
            f"[server]\nport = {port}\nhost = \"127.0.0.1\"\n[metrics]\nenabled = false\n"
            f"[wal]\nfsync = \"{fsync}\"\n{listener}")
        argv = [BLIPMQ, "start", "--config", str(d / "b.toml"), "--data-dir", str(d / "data"),
                "--log-format", "plain", "--log-level", "warning"]
    elif kind == "mosquitto":
        (d / "m.conf").write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
        argv = [find("mosquitto") or "mosquitto", "-c", str(d / "m.conf")]
    elif kind == "nats":
        js = ""
        if jetstream:
            js = f"jetstream {{ store_dir: \"{d / 'js'}\"" + (
                ", sync_interval: always" if jetstream == "always" else "") + " }\n"
        (d / "n.conf").write_text(f"listen: 127.0.0.1:{port}\n{js}")
        argv = [exe or find("nats-server") or "nats-server", "-c", str(d / "n.conf")]
    elif kind == "redis":
        argv = [find("redis-server") or "redis-server", "--port", str(port), "--bind",
                "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
    else:
        raise ValueError(kind)
    return Broker(kind, argv, port, d, mqtt_port)


def version(kind: str) -> str:
    argv = {"blipmq": [BLIPMQ, "--version"], "mosquitto": [find("mosquitto") or "", "-h"],
            "nats": [find("nats-server") or "", "--version"],
            "redis": [find("redis-server") or "", "--version"]}[kind]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    return ((out.stdout or out.stderr).strip().splitlines() or ["?"])[0][:80]


def mqtt_clients() -> str:
    """The versions of the MQTT clients both MQTT brokers are driven by."""
    try:
        out = subprocess.run(["mosquitto_pub", "--help"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
        tool = next((x for x in out if x.startswith("mosquitto_pub version")), "?")
    except OSError:
        tool = "mosquitto_pub not installed"
    paho = subprocess.run([PY, "-c", "import paho.mqtt; print(paho.mqtt.__version__)"],
                          capture_output=True, text=True, timeout=30).stdout.strip() or "?"
    return f"{tool}; paho-mqtt {paho}"


def ensure_peers(wanted: list[str], install: bool) -> tuple[list[str], dict[str, str]]:
    """The peers that can run, and why the others cannot."""
    missing = {k: PEERS[k] for k in wanted if k in PEERS and not find(PEERS[k][0])}
    skipped: dict[str, str] = {}
    if missing and install and os.geteuid() == 0:
        packages = " ".join(p for _, p in missing.values()).split()
        print(f"installing {' '.join(packages)} with apt-get", file=sys.stderr)
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-q", *packages], capture_output=True,
                       timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    for k, (exe, packages) in missing.items():
        if not find(exe):
            how = "not root" if os.geteuid() else "apt-get failed" if install else "--no-install"
            skipped[k] = f"{exe} not installed ({how}; apt-get install {packages})"
    return [k for k in wanted if k not in skipped], skipped


# --- running workers -------------------------------------------------------------------------

def drive(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, DRIVE, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"worker did not get ready: {line!r}")


def outcome(proc: subprocess.Popen[str], timeout: float = 600) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError("worker ran out of time") from None
    lines = out.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"worker failed (exit {proc.returncode})")
    return json.loads(lines[-1])


def fanout(broker: Broker, client: str, subscribers: int, n: int, size: int, rate: int = 0,
           topic: str = "bench/t", sub_topic: str | None = None, extra: int = 0,
           pub_topics: int = 1, url: str | None = None) -> dict:
    """``subscribers`` sub workers, one publisher; deliveries, loss, latency, broker CPU.
    ``url``: where the clients connect (default the broker's own port; BlipMQ's MQTT
    listener for paho)."""
    url = url or broker.url
    subs = [drive(client, "sub", url, sub_topic or topic, n, extra)
            for _ in range(subscribers)]
    for s in subs:
        wait_ready(s)
    cpu = broker.cpu_s()
    pub = outcome(drive(client, "pub", url, topic, n, size, rate, pub_topics))
    got = [outcome(s) for s in subs]
    cpu = broker.cpu_s() - cpu
    last = max([pub["end"], *(g["last"] for g in got if g["last"])])
    seconds = max(last - pub["start"], 1e-9)
    delivered = sum(g["received"] for g in got)
    worst = lambda k: max((g[k] for g in got if g[k] is not None), default=None)  # noqa: E731
    return {
        "messages": n, "size": size, "subscribers": subscribers, "delivered": delivered,
        "lost": subscribers * n - delivered, "duplicates": sum(g["duplicates"] for g in got),
        "seconds": round(seconds, 3), "msg_per_s": round(n / seconds),
        "deliveries_per_s": round(delivered / seconds),
        "mb_per_s": round(delivered * size / seconds / 1e6, 2),
        "p50_us": worst("p50_us"), "p95_us": worst("p95_us"), "p99_us": worst("p99_us"),
        "max_us": worst("max_us"), "broker_cpu_s": round(cpu, 3),
        "cpu_us_per_delivery": round(cpu / delivered * 1e6, 2) if delivered else None,
    }


# --- workloads ---------------------------------------------------------------------------------

Row = dict


def median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (the middle one of an odd count), with how many runs
    there were and the lowest and highest ``key`` among them."""
    ordered = sorted(runs, key=lambda r: r[key] if r[key] is not None else -1)
    pick = dict(ordered[len(ordered) // 2])
    values = [r[key] for r in runs if r[key] is not None]
    pick["runs"] = len(runs)
    pick["spread"] = f"{min(values):,}-{max(values):,}" if values else ""
    return pick


def throughput(kind: str, broker: Broker, sizes: dict[int, int], rows: list[Row],
               repeat: int = 1) -> None:
    client = CLIENT[kind]
    for subscribers in (1, 4):
        for size, n in sizes.items():
            r = median_run([fanout(broker, client, subscribers, n, size)
                            for _ in range(repeat)], "deliveries_per_s")
            rows.append({"workload": f"throughput 1->{subscribers}", "broker": kind,
                         "client": CLIENT_NAME[client], **r})
            print(f"  {kind} 1->{subscribers} {size} B: {r['msg_per_s']:,} msg/s, "
                  f"{r['mb_per_s']} MB/s, lost {r['lost']}", file=sys.stderr)


def latency(kinds: list[str], n: int, work: Path, rows: list[Row], repeat: int,
            peaks: dict[str, float], skipped: dict[str, str],
            workload: str = "latency 2000 msg/s", mqtt: bool = False) -> None:
    """Latency at 2,000 msg/s, in rounds: each round runs every broker once, in turn (the
    order turns by one each round), each run on a new broker. A machine whose speed drifts
    by tens of percent within minutes (this one does) then weighs on every broker alike:
    when each broker's runs came back to back, minutes apart, the drift decided the ratios.
    A new broker per run, after the previous one's files were deleted and everything
    written was flushed to disk (``os.sync``), also keeps a run from sharing the machine
    with the kernel writing back what an earlier broker logged (BlipMQ's latency runs after
    its throughput runs: p99 1.2-4.2 ms instead of 0.4-0.5 ms).

    ``mqtt``: every broker (BlipMQ through its MQTT listener) driven by paho-mqtt."""
    client_of: Callable[[str], str] = (lambda kind: "paho") if mqtt else CLIENT.__getitem__
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for turn in range(repeat):
        for kind in kinds[turn % len(kinds):] + kinds[:turn % len(kinds)]:
            if kind not in runs:
                continue
            os.sync()
            try:
                broker = start_broker(kind, work, mqtt=mqtt)
            except RuntimeError as exc:
                skipped[f"{kind} {workload}"] = str(exc)
                del runs[kind]
                continue
            try:
                time.sleep(0.5)  # as for the idle figure: let start-up settle
                runs[kind].append(fanout(broker, client_of(kind), 1, n, 100, rate=2000,
                                         url=broker.mqtt_url if mqtt else None))
                peaks[kind] = max(peaks.get(kind, 0.0), broker.memory_mb("VmHWM"))
            except RuntimeError as exc:
                skipped[f"{kind} {workload}"] = str(exc)
                del runs[kind]
            finally:
                broker.stop()
                shutil.rmtree(broker.dir, ignore_errors=True)
    for kind, done in runs.items():
        r = median_run(done, "p99_us")
        r["p50_runs"] = [x["p50_us"] for x in done]  # every run's, in the order they ran
        rows.append({"workload": workload, "broker": kind,
                     "client": CLIENT_NAME[client_of(kind)], **r})
        print(f"  {kind} {workload} p50/p99 {r['p50_us']}/{r['p99_us']} us", file=sys.stderr)


def pipe(kind: str, broker: Broker, n: int, work: Path, rows: list[Row]) -> None:
    """The C tools (or `blipmq pub --lines` / `sub`) in a shell pipe: n lines of ~30 bytes."""
    lines = b"".join(b"L%08d of the pipe benchmark\n" % i for i in range(n))
    host, port = "127.0.0.1", str(broker.port)
    if kind == "blipmq":
        env = {**os.environ, "BLIPMQ_ADDR": broker.url}
        sub_argv = [BLIPMQ, "sub", "pipe", "--format", "lines"]
        pub_argv, data, tool = [BLIPMQ, "pub", "pipe", "--lines", "-"], lines, "blipmq CLI"
        probe_argv = [BLIPMQ, "pub", "pipe", "probe"]
    elif kind == "mosquitto":
        env = dict(os.environ)
        sub_argv = ["mosquitto_sub", "-h", host, "-p", port, "-t", "pipe"]
        pub_argv = ["mosquitto_pub", "-h", host, "-p", port, "-t", "pipe", "-l"]
        data, tool = lines, "mosquitto_pub/sub"
        probe_argv = ["mosquitto_pub", "-h", host, "-p", port, "-t", "pipe", "-m", "probe"]
    elif kind == "redis":
        env = dict(os.environ)
        sub_argv = ["redis-cli", "-h", host, "-p", port, "subscribe", "pipe"]
        pub_argv = ["redis-cli", "-h", host, "-p", port, "--pipe"]
        data = b"".join(b"*3\r\n$7\r\nPUBLISH\r\n$4\r\npipe\r\n$%d\r\n%s\r\n" % (len(x), x)
                        for x in lines.splitlines())
        tool = "redis-cli"
        probe_argv = ["redis-cli", "-h", host, "-p", port, "publish", "pipe", "probe"]
    else:
        return
    sub = subprocess.Popen(sub_argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    seen = {"data": 0, "probe": 0, "at": 0.0}
    all_in = threading.Event()

    def count() -> None:
        assert sub.stdout is not None
        for line in sub.stdout:
            if line.startswith(b"L"):
                seen["data"] += 1
                if seen["data"] == n:
                    seen["at"] = time.monotonic()
                    all_in.set()
            elif line.startswith(b"probe"):
                seen["probe"] += 1
        all_in.set()

    threading.Thread(target=count, daemon=True).start()
    try:
        deadline = time.monotonic() + 20
        while not seen["probe"] and time.monotonic() < deadline:  # subscribed yet?
            subprocess.run(probe_argv, env=env, capture_output=True, timeout=10)
            time.sleep(0.05)
        cpu = broker.cpu_s()
        start = time.monotonic()
        subprocess.run(pub_argv, input=data, env=env, capture_output=True, timeout=300)
        all_in.wait(5 + n / 5000)
        end = seen["at"] or time.monotonic()
        cpu = broker.cpu_s() - cpu
    finally:
        sub.kill()
        sub.wait()
    got = min(seen["data"], n)
    seconds = max(end - start, 1e-9)
    rows.append({"workload": "CLI pipe", "broker": kind, "client": tool, "messages": n,
                 "size": 30, "subscribers": 1, "delivered": got, "lost": n - got,
                 "seconds": round(seconds, 3), "msg_per_s": round(got / seconds),
                 "deliveries_per_s": round(got / seconds),
                 "mb_per_s": round(got * 30 / seconds / 1e6, 2), "broker_cpu_s": round(cpu, 3),
                 "cpu_us_per_delivery": round(cpu / got * 1e6, 2) if got else None})
    print(f"  {kind} pipe ({tool}): {round(got / seconds):,} msg/s, lost {n - got}",
          file=sys.stderr)


def jetstream_setups(work: Path, js: tuple[str | None, str],
                     skipped: dict[str, str]) -> list[tuple[str, str, Callable[[], Broker]]]:
    """JetStream default and sync-always on the same nats-server >= 2.10 when there is one;
    else the default on Debian 12's and the sync-always run skipped with the reason."""
    exe, note = js
    if exe is None:
        skipped["durable nats JetStream sync always"] = note
        return [("nats", "JetStream default",
                 lambda: start_broker("nats", work, jetstream="default"))]
    return [("nats", f"JetStream {label}, nats-server {note}",
             lambda setting=setting: start_broker("nats", work, jetstream=setting, exe=exe))
            for setting, label in (("default", "default"), ("always", "sync always"))]


def durable(kinds: list[str], n: int, work: Path, rows: list[Row], skipped: dict[str, str],
            js: tuple[str | None, str]) -> None:
    setups: list[tuple[str, str, Callable[[], Broker]]] = []
    if "blipmq" in kinds:
        setups += [("blipmq", "fsync always", lambda: start_broker("blipmq", work)),
                   ("blipmq", "fsync none", lambda: start_broker("blipmq", work, fsync="none"))]
    if "nats" in kinds:
        setups += jetstream_setups(work, js, skipped)
    for kind, setting, make in setups:
        try:
            broker = make()
        except RuntimeError as exc:
            skipped[f"durable {kind} {setting}"] = str(exc)
            print(f"  skipped {kind} {setting}: {exc}", file=sys.stderr)
            continue
        try:
            cpu = broker.cpu_s()
            r = outcome(drive(CLIENT[kind], "durable", broker.url, "dur/t", n, 100))
            cpu = broker.cpu_s() - cpu
            seconds = r["end"] - r["start"]
            rows.append({"workload": "durable confirmed", "broker": kind,
                         "client": f"{CLIENT_NAME[CLIENT[kind]]}, {setting}", "messages": n,
                         "size": 100, "subscribers": 0, "delivered": r["confirmed"],
                         "lost": n - r["confirmed"], "seconds": round(seconds, 3),
                         "msg_per_s": round(r["confirmed"] / seconds),
                         "broker_cpu_s": round(cpu, 3),
                         "cpu_us_per_delivery": round(cpu / max(r["confirmed"], 1) * 1e6, 2)})
            print(f"  {kind} {setting}: {round(r['confirmed'] / seconds):,} confirmed msg/s",
                  file=sys.stderr)
        finally:
            broker.stop()


CURVE = {  # messages per point, then the scales of each axis
    "full": (100_000, (1, 100, 10_000), (1, 1000, 100_000), (10, 100, 1000)),
    "quick": (2_000, (1000,), (1000,), (100,)),  # a smoke run: one point each
}


def curve(kind: str, work: Path, quick: bool, rows: list[Row]) -> None:
    """A broker's cost as the work grows: subscriptions (exact and wildcard filters), topics,
    idle connections; for BlipMQ also the cost of resolving a new topic. Each axis gets a
    fresh broker: what one axis leaves behind (redis keeps its pattern table's size after
    10,000 PSUBSCRIBE patterns go) must not weigh on the next."""
    n, subs, topics, conns = CURVE["quick" if quick else "full"]
    client = CLIENT[kind]

    def add(axis: str, x: int, r: dict) -> None:
        rows.append({"workload": f"curve {axis}", "broker": kind, "client": CLIENT_NAME[client],
                     "scale": x, **r})
        print(f"  {kind} curve {axis} {x}: {r['deliveries_per_s']:,}/s, "
              f"{r['cpu_us_per_delivery']} us CPU/delivery, lost {r['lost']}", file=sys.stderr)

    def topic_axis(broker: Broker) -> None:
        for t in topics:  # messages spread over tp{t}/0 .. tp{t}/{t-1}, each new to the broker
            add("topics", t, fanout(broker, client, 1, max(n, t), 100,
                                    topic=f"tp{t}" if t > 1 else "tp1/0",
                                    sub_topic=f"tp{t}/#", pub_topics=t))

    def connection_axis(broker: Broker) -> None:
        for c in conns:
            add("connections", c, with_idle(broker, client, c, n))

    axes: list[Callable[[Broker], None]] = [
        lambda b: curve_subscriptions(b, client, n, subs, add), topic_axis, connection_axis]
    if kind == "blipmq":
        axes.append(lambda b: curve_new_topic(b, quick, subs[-1], add))
    for axis in axes:
        broker = start_broker(kind, work)
        try:
            axis(broker)
        finally:
            broker.stop()


def curve_subscriptions(broker: Broker, client: str, n: int, scales: tuple[int, ...],
                        add: Callable[[str, int, dict], None]) -> None:
    """One subscription matches the traffic; s - 1 others on the same connection sit in the
    broker's index: exact filters, then wildcard ones (MQTT +, NATS *, redis PSUBSCRIBE)."""
    for s in scales:
        add("subscriptions exact", s, fanout(broker, client, 1, n, 100, topic=f"se{s}/t",
                                             extra=s - 1))
        add("subscriptions wildcard", s, fanout(broker, client, 1, n, 100, topic=f"sw{s}/a/t",
                                                sub_topic=f"sw{s}/+/t", extra=s - 1))


def with_idle(broker: Broker, client: str, idle: int, n: int) -> dict:
    """1 -> 1 traffic beside ``idle`` connections, each subscribed to a topic of its own."""
    holder = drive(client, "hold", broker.url, f"idle{idle}", idle)
    wait_ready(holder)
    try:
        return fanout(broker, client, 1, n, 100, topic=f"cn{idle}")
    finally:
        outcome(holder, 120)  # closes its stdin: it lets go


def curve_new_topic(broker: Broker, quick: bool, subs: int,
                    add: Callable[[str, int, dict], None]) -> None:
    """Publishes each to a topic never seen before, with no and with ``subs`` subscriptions
    in the index: the broker CPU per publish is the cost of resolving a new topic."""
    for s in (0, subs):
        holder = drive("blipmq", "sub", broker.url, f"rz{s}-held", 1, s) if s else None
        if holder:
            wait_ready(holder)
        m = 500 if quick else 2_000
        r = fanout(broker, "blipmq", 1, m, 100, topic=f"nt{s}", sub_topic=f"nt{s}/#",
                   pub_topics=m)
        if holder:
            holder.kill()
            holder.wait()
        add("new topic resolve", s, r)


# --- MQTT: BlipMQ's MQTT listener and mosquitto, driven by the same MQTT clients ------------

MQTT_KINDS = ("blipmq", "mosquitto")
MQTT = {  # counts of the MQTT workloads
    "full": {"tools": 200_000, "paho": 100_000, "latency": 10_000, "durable": 50_000,
             "idle": 1_000, "idle_s": 60, "sessions": 10_000, "sample": 100},
    "quick": {"tools": 3_000, "paho": 2_000, "latency": 1_000, "durable": 2_000,
              "idle": 200, "idle_s": 2, "sessions": 500, "sample": 50},
}
MQTT_INFLIGHT = 100  # mosquitto_pub -M: QoS 1 messages in flight (its default is 20)
KEEPALIVE = 30  # s, of the idle connections
MQTTLOAD = str(HERE / "mqttload.py")
TOOLS = "mosquitto_pub/sub"


def mqttload(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, MQTTLOAD, *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def tool_lines(n: int, size: int = 100) -> bytes:
    """n lines of ``size`` bytes (then a newline), each starting with its sequence number."""
    return b"".join((b"L%08d " % i).ljust(size, b"x") + b"\n" for i in range(n))


def mqtt_tools(broker: Broker, n: int) -> dict:
    """QoS 0, 1 -> 1: `mosquitto_pub -l` (n lines of 100 bytes) -> broker -> `mosquitto_sub`.
    Readiness is a probe message seen by the subscriber; loss and duplicates are counted
    from the lines' sequence numbers; the end is when the last message arrived (or 3 s of
    silence, the rest lost)."""
    host, port = "127.0.0.1", str(broker.mqtt_port)
    topic = "mq/tools"
    sub = subprocess.Popen(["mosquitto_sub", "-h", host, "-p", port, "-t", topic],
                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    seen = bytearray(n)
    got = {"unique": 0, "dup": 0, "probe": 0, "at": 0.0}
    all_in = threading.Event()

    def count() -> None:
        assert sub.stdout is not None
        for line in sub.stdout:
            if line.startswith(b"L"):
                seq = int(line[1:9])
                got["at"] = time.monotonic()
                if seq < n and not seen[seq]:
                    seen[seq] = 1
                    got["unique"] += 1
                    if got["unique"] == n:
                        all_in.set()
                else:
                    got["dup"] += 1
            elif line.startswith(b"probe"):
                got["probe"] += 1
        all_in.set()

    threading.Thread(target=count, daemon=True).start()
    probe = ["mosquitto_pub", "-h", host, "-p", port, "-t", topic, "-m", "probe"]
    try:
        deadline = time.monotonic() + 20
        while not got["probe"] and time.monotonic() < deadline:  # subscribed yet?
            subprocess.run(probe, capture_output=True, timeout=10)
            time.sleep(0.05)
        if not got["probe"]:
            raise RuntimeError("mosquitto_sub saw no probe message in 20 s")
        data = tool_lines(n)
        cpu = broker.cpu_s()
        start = time.monotonic()
        subprocess.run(["mosquitto_pub", "-h", host, "-p", port, "-t", topic, "-l"],
                       input=data, capture_output=True, timeout=600)
        until = time.monotonic() + 60 + n / 1000
        while not all_in.wait(0.1) and time.monotonic() < until:
            if time.monotonic() - max(got["at"], start) > 3:
                break  # 3 s without a message: the rest is lost
        end = got["at"] or time.monotonic()
        cpu = broker.cpu_s() - cpu
    finally:
        sub.kill()
        sub.wait()
    delivered = got["unique"]
    seconds = max(end - start, 1e-9)
    return {"messages": n, "size": 100, "subscribers": 1, "delivered": delivered,
            "lost": n - delivered, "duplicates": got["dup"], "seconds": round(seconds, 3),
            "msg_per_s": round(delivered / seconds),
            "deliveries_per_s": round(delivered / seconds),
            "mb_per_s": round(delivered * 100 / seconds / 1e6, 2),
            "broker_cpu_s": round(cpu, 3),
            "cpu_us_per_delivery": round(cpu / delivered * 1e6, 2) if delivered else None}


def mqtt_traffic(kind: str, work: Path, counts: dict, rows: list[Row], repeat: int,
                 tools: bool) -> None:
    """On one broker: the C tools at QoS 0, then paho-mqtt 1 -> 1 and 1 -> 4 (drive.py's
    paho workers, pointed at BlipMQ's MQTT port or at mosquitto)."""
    broker = start_broker(kind, work, mqtt=True)
    try:
        time.sleep(0.5)
        if tools:
            r = median_run([mqtt_tools(broker, counts["tools"]) for _ in range(repeat)],
                           "msg_per_s")
            rows.append({"workload": "mqtt C tools qos0", "broker": kind, "client": TOOLS,
                         **r})
            print(f"  {kind} C tools QoS 0: {r['msg_per_s']:,} msg/s, lost {r['lost']}, "
                  f"{r['cpu_us_per_delivery']} us CPU/delivery", file=sys.stderr)
        for subscribers in (1, 4):
            r = median_run([fanout(broker, "paho", subscribers, counts["paho"], 100,
                                   topic="mq/paho", url=broker.mqtt_url)
                            for _ in range(repeat)], "deliveries_per_s")
            rows.append({"workload": f"mqtt paho 1->{subscribers}", "broker": kind,
                         "client": CLIENT_NAME["paho"], **r})
            print(f"  {kind} paho 1->{subscribers}: {r['deliveries_per_s']:,} deliveries/s, "
                  f"lost {r['lost']}", file=sys.stderr)
    finally:
        broker.stop()
        shutil.rmtree(broker.dir, ignore_errors=True)


def mqtt_durable(kind: str, work: Path, n: int, rows: list[Row]) -> None:
    """QoS 1 through `mosquitto_pub -q 1 -l -M 100` (the same flags for both): BlipMQ with
    wal.fsync = always, mosquitto as shipped (in memory, no fsync). Confirmed = the PUBACKs
    its -d output reports; the time is the tool's, connect to DISCONNECT after the last."""
    broker = start_broker(kind, work, mqtt=True)
    try:
        time.sleep(0.5)
        data = tool_lines(n)
        cpu = broker.cpu_s()
        start = time.monotonic()
        done = subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.mqtt_port),
                               "-t", "mq/durable", "-q", "1", "-l", "-M", str(MQTT_INFLIGHT),
                               "-d"], input=data, capture_output=True, timeout=600)
        seconds = time.monotonic() - start
        cpu = broker.cpu_s() - cpu
    finally:
        broker.stop()
        shutil.rmtree(broker.dir, ignore_errors=True)
    confirmed = min(done.stdout.count(b"received PUBACK"), n)
    if done.returncode and not confirmed:
        raise RuntimeError(f"mosquitto_pub -q 1 failed: {done.stderr[-200:]!r}")
    setting = "wal.fsync always" if kind == "blipmq" else "no fsync (as shipped)"
    rows.append({"workload": "mqtt durable qos1", "broker": kind,
                 "client": f"mosquitto_pub -q 1 -M {MQTT_INFLIGHT}, {setting}",
                 "messages": n, "size": 100, "subscribers": 0, "delivered": confirmed,
                 "lost": n - confirmed, "seconds": round(seconds, 3),
                 "msg_per_s": round(confirmed / seconds), "broker_cpu_s": round(cpu, 3),
                 "cpu_us_per_delivery": round(cpu / max(confirmed, 1) * 1e6, 2)})
    print(f"  {kind} durable QoS 1: {round(confirmed / seconds):,} confirmed msg/s",
          file=sys.stderr)


def mqtt_idle(kind: str, work: Path, conns: int, window: float, rows: list[Row]) -> None:
    """``conns`` MQTT connections (keepalive 30 s, a QoS 0 subscription each, a PINGREQ each
    30 s) held by bench/mqttload.py: the broker's RSS, and its CPU per second over
    ``window`` s once they are all up."""
    broker = start_broker(kind, work, mqtt=True)
    try:
        time.sleep(0.5)
        before = broker.memory_mb("VmRSS")
        holder = mqttload("hold", broker.mqtt_url, conns, KEEPALIVE)
        assert holder.stdout is not None
        line = holder.stdout.readline().split()  # mqttload bounds its handshakes: 300 s
        if line[:1] != ["ready"]:
            holder.kill()
            raise RuntimeError(f"mqttload hold did not get ready: {line!r}")
        time.sleep(1)  # the last connections' work settles
        cpu = broker.cpu_s()
        time.sleep(window)
        cpu = broker.cpu_s() - cpu
        rss = broker.memory_mb("VmRSS")
        peak = broker.memory_mb("VmHWM")
        r = outcome(holder, 120)  # closes its stdin: it disconnects
    finally:
        broker.stop()
        shutil.rmtree(broker.dir, ignore_errors=True)
    held = r["held"]
    rows.append({"workload": f"mqtt idle {conns}", "broker": kind, "client": "mqttload.py",
                 "scale": conns, "messages": conns, "subscribers": 0, "delivered": held,
                 "lost": conns - held, "seconds": window, "broker_cpu_s": round(cpu, 3),
                 "cpu_ms_per_s": round(cpu / window * 1000, 2), "rss_mb": rss,
                 "idle_rss_mb": before, "peak_rss_mb": peak,
                 "kb_per_connection": round((rss - before) * 1024 / max(held, 1), 1),
                 "dropped": r["dropped"], "pings": r["pings"], "pongs": r["pongs"]})
    print(f"  {kind} {held} idle connections: RSS {before} -> {rss} MB, "
          f"{round(cpu / window * 1000, 2)} ms CPU/s", file=sys.stderr)


def mqtt_sessions(work: Path, n: int, sample: int, idle_s: float, rows: list[Row]) -> None:
    """BlipMQ: n persistent sessions (clean session 0, one QoS 1 subscription each), the
    broker stopped (SIGTERM) and started again on the same data: the time to accepting
    (both ports open) and to its ready line, its CPU and RSS then, the sessions its log
    says it restored, its CPU per second over ``idle_s`` while every session is offline,
    and ``sample`` of them, spread over all, connected again: how many CONNACKs said
    "session present"."""
    broker = start_broker("blipmq", work, mqtt=True)
    try:
        created = outcome(mqttload("sessions", broker.mqtt_url, n, "bench-s-"), 600)
    finally:
        broker.stop()
    argv = [*broker.argv[:-1], "info"]  # --log-level info: the ready line, the restore line
    again = Broker("blipmq", argv, broker.port, broker.dir, broker.mqtt_port)
    try:
        cpu = again.cpu_s()  # start-up: the log read, the sessions restored
        rss = again.memory_mb("VmRSS")
        time.sleep(0.2)  # the ready line, should it come a little after the ports open
        ready_ms = (again.ready_at - again.started) * 1000 if again.ready_at else None
        found = [re.search(r"(\d+) persistent session\(s\) restored", x) for x in again.lines]
        restored = next((int(m.group(1)) for m in found if m), 0)
        before, quiet = again.cpu_s(), time.monotonic()  # idle, every session offline
        time.sleep(idle_s)
        idle_ms = (again.cpu_s() - before) * 1000 / (time.monotonic() - quiet)
        step = max(n // sample, 1)
        back = outcome(mqttload("resume", again.mqtt_url, min(sample, n), "bench-s-", step), 600)
    finally:
        again.stop()
        shutil.rmtree(broker.dir, ignore_errors=True)
    rows.append({"workload": f"mqtt sessions restore {n}", "broker": "blipmq",
                 "client": "mqttload.py", "scale": n, "messages": n, "subscribers": 0,
                 "delivered": created["created"], "lost": n - created["created"],
                 "seconds": created["seconds"],
                 "msg_per_s": round(created["created"] / max(created["seconds"], 1e-9)),
                 "startup_ms": round(again.startup_ms, 1),
                 "ready_ms": round(ready_ms, 1) if ready_ms is not None else None,
                 "broker_cpu_s": round(cpu, 3), "rss_mb": rss, "restored": restored,
                 "cpu_ms_per_s": round(idle_ms, 1),
                 "resumed": back["present"], "resume_sample": min(sample, n),
                 "resume_seconds": back["seconds"]})
    print(f"  blipmq {n} sessions: created in {created['seconds']} s; restart: accepting "
          f"after {again.startup_ms:.0f} ms, {restored} restored, idle {idle_ms:.1f} ms/s of "
          f"CPU, {back['present']}/"
          f"{min(sample, n)} resumed", file=sys.stderr)


def mqtt(kinds: list[str], work: Path, quick: bool, rows: list[Row], repeat: int,
         skipped: dict[str, str]) -> None:
    """The MQTT workloads, on BlipMQ's MQTT listener and mosquitto (whichever of the two
    are in ``kinds``), each driven by the same clients: mosquitto_pub/sub, paho-mqtt,
    bench/mqttload.py."""
    counts = MQTT["quick" if quick else "full"]
    mine = [k for k in MQTT_KINDS if k in kinds]
    tools = bool(find("mosquitto_pub") and find("mosquitto_sub"))
    if not tools:
        skipped["mqtt C tools"] = ("mosquitto_pub/mosquitto_sub not installed "
                                   "(apt-get install mosquitto-clients)")

    def attempt(what: str, kind: str, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            skipped[f"{kind} mqtt {what}"] = str(exc)
            print(f"  {kind} mqtt {what}: {exc}", file=sys.stderr)

    for kind in mine:
        attempt("traffic", kind, mqtt_traffic, kind, work, counts, rows, repeat, tools)
    print("mqtt latency, in rounds:", file=sys.stderr)
    latency(mine, counts["latency"], work, rows, repeat, {}, skipped,
            workload="mqtt latency 2000 msg/s", mqtt=True)
    for kind in mine:
        if tools:
            attempt("durable", kind, mqtt_durable, kind, work, counts["durable"], rows)
        attempt("idle", kind, mqtt_idle, kind, work, counts["idle"], counts["idle_s"], rows)
    if "blipmq" in mine:
        attempt("sessions", "blipmq", mqtt_sessions, work, counts["sessions"], counts["sample"],
                min(counts["idle_s"], 10), rows)


# --- output ------------------------------------------------------------------------------------

COLUMNS = ["workload", "broker", "client", "scale", "messages", "size", "subscribers",
           "delivered", "lost", "duplicates", "seconds", "msg_per_s", "deliveries_per_s",
           "mb_per_s", "p50_us", "p95_us", "p99_us", "max_us", "broker_cpu_s",
           "cpu_us_per_delivery", "idle_rss_mb", "peak_rss_mb", "startup_ms", "runs", "spread",
           "rss_mb", "cpu_ms_per_s", "kb_per_connection", "ready_ms", "restored", "resumed"]


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def summary(rows: list[Row], meta: dict) -> str:
    """The Markdown tables docs/PERFORMANCE.md quotes: figures and BlipMQ/peer ratios."""
    peers = [k for k in ("mosquitto", "nats", "redis") if any(r["broker"] == k for r in rows)]
    out = [f"Run {meta['date']} on {meta['machine']}; command: `{meta['command']}`; "
           f"load average {meta['loadavg_start']:.2f} before, "
           f"{meta.get('loadavg_end', 0):.2f} after", ""]
    if meta.get("repeat", 1) > 1:
        out += [f"Throughput and latency rows: of {meta['repeat']} runs each, the one with the "
                "median rate (throughput) or median p99 (latency); `runs` and `spread` "
                "(lowest-highest) in results.csv. Latency runs go in rounds, every broker "
                "once a round, each on a new broker.", ""]
    versions = [f"{k} {v}" for k, v in meta["versions"].items()]
    if meta.get("jetstream_server"):
        versions.append(f"JetStream runs: nats-server {meta['jetstream_server']} "
                        "(Debian trixie, cached)")
    out += ["Versions: " + "; ".join(versions), ""]
    by = {(r["workload"], r["broker"], r.get("size"), r.get("client")): r for r in rows}

    def find_row(workload: str, broker: str, size: int | None = None) -> Row | None:
        return next((r for (w, b, s, _), r in by.items()
                     if w == workload and b == broker and (size is None or s == size)), None)

    out += ["| workload | BlipMQ | " + " | ".join(peers) + " | " +
            " | ".join(f"BlipMQ/{p}" for p in peers) + " |",
            "|---|---:|" + "---:|" * (2 * len(peers))]
    lines = []
    for w in ("throughput 1->1", "throughput 1->4"):
        for size in sorted({r["size"] for r in rows if r["workload"] == w}):
            key = "deliveries_per_s"
            cells = [find_row(w, b, size) for b in ["blipmq", *peers]]
            fmt = [f"{c[key]:,}/s, {c['mb_per_s']} MB/s" + (f" ({c['lost']:,} lost)"
                                                            if c["lost"] else "")
                   if c else "-" for c in cells]
            ratios = [ratio(cells[0][key] if cells[0] else None, c[key] if c else None)
                      for c in cells[1:]]
            lines.append(f"| {w}, {size} B, deliveries/s | " + " | ".join(fmt + ratios) + " |")
    for key, label in (("p50_us", "p50"), ("p99_us", "p99")):
        cells = [find_row("latency 2000 msg/s", b) for b in ["blipmq", *peers]]
        fmt = [f"{c[key]} us" if c else "-" for c in cells]
        ratios = [ratio(cells[0][key] if cells[0] else None, c[key] if c else None)
                  for c in cells[1:]]
        lines.append(f"| latency at 2,000 msg/s, {label} (lower is better) | "
                     + " | ".join(fmt + ratios) + " |")
    for w in ("throughput 1->1", "throughput 1->4"):
        cells = [find_row(w, b, 100) for b in ["blipmq", *peers]]
        fmt = [f"{c['cpu_us_per_delivery']} us" if c else "-" for c in cells]
        ratios = [ratio(cells[0]["cpu_us_per_delivery"] if cells[0] else None,
                        c["cpu_us_per_delivery"] if c else None) for c in cells[1:]]
        lines.append(f"| broker CPU per delivery, {w}, 100 B (lower is better) | "
                     + " | ".join(fmt + ratios) + " |")
    for key, label in (("idle_rss_mb", "idle RSS, MB"), ("peak_rss_mb", "peak RSS, MB"),
                       ("startup_ms", "start-up to accepting, ms")):
        cells = [find_row("broker", b) for b in ["blipmq", *peers]]
        fmt = [f"{c[key]}" if c else "-" for c in cells]
        ratios = [ratio(cells[0][key] if cells[0] else None, c[key] if c else None)
                  for c in cells[1:]]
        lines.append(f"| {label} (lower is better) | " + " | ".join(fmt + ratios) + " |")
    cells = [find_row("CLI pipe", b) for b in ["blipmq", *peers]]
    fmt = [f"{c['msg_per_s']:,}/s ({c['client']})" if c else "-" for c in cells]
    ratios = [ratio(cells[0]["msg_per_s"] if cells[0] else None, c["msg_per_s"] if c else None)
              for c in cells[1:]]
    lines.append("| CLI pipe, msg/s | " + " | ".join(fmt + ratios) + " |")
    out += [*lines, ""]
    out += durable_table(rows)
    out += mqtt_table(rows)
    out += clients_table(rows)
    out += curve_table(rows)
    if meta["skipped"]:
        out += ["Skipped: " + "; ".join(f"{k}: {v}" for k, v in meta["skipped"].items()), ""]
    return "\n".join(out)


def clients(work: Path, quick: bool, rows: list[Row], skipped: dict[str, str]) -> None:
    """The Python clients 1 -> 1 (bench/clientbench.py): BlipMQ's AsyncClient and sync
    Client, and nats-py's asyncio client against nats-server."""
    import clientbench

    messages, latency_n = (2_000, 500) if quick else (100_000, 5_000)
    for client in clientbench.CLIENTS:
        kind = "nats" if client.startswith("nats") else "blipmq"
        if kind == "nats" and find("nats-server") is None:
            skipped[client] = "nats-server is not installed"
            continue
        try:
            broker = start_broker(kind, work)
        except RuntimeError as exc:
            skipped[client] = str(exc)
            continue
        try:
            cpu = broker.cpu_s()
            thr = clientbench.one_run(client, broker.url, messages, 100, 0)
            cpu = broker.cpu_s() - cpu
            lat = clientbench.one_run(client, broker.url, latency_n, 100, 2_000.0)
        finally:
            broker.stop()
        seconds = thr["last"] - thr["began"]
        rows.append({"workload": "clients 1->1", "broker": kind, "client": client,
                     "size": 100, "messages": messages, "subscribers": 1,
                     "delivered": thr["got"], "lost": messages - thr["got"],
                     "seconds": round(seconds, 3), "broker_cpu_s": round(cpu, 3),
                     "msg_per_s": round(messages / seconds),
                     "p50_us": round(lat["lat"][0] * 1000, 1),
                     "p99_us": round(lat["lat"][1] * 1000, 1),
                     "max_us": round(lat["lat"][2] * 1000, 1)})
        print(f"  {client}: {rows[-1]['msg_per_s']:,} msg/s, p50 {rows[-1]['p50_us']} us",
              file=sys.stderr)


def clients_table(rows: list[Row]) -> list[str]:
    got = {r["client"]: r for r in rows if r["workload"] == "clients 1->1"}
    if not got:
        return []
    out = ["| Python client, 1 -> 1, 100 B (one-message publish) | msg/s | p50 at 2,000 msg/s "
           "| p99 |", "|---|---:|---:|---:|"]
    for name, label in (("blipmq-async", "BlipMQ AsyncClient (Trio)"),
                        ("blipmq-sync", "BlipMQ Client (sync)"),
                        ("nats-async", "nats-py (asyncio) to nats-server")):
        r = got.get(name)
        if r is not None:
            out.append(f"| {label} | {r['msg_per_s']:,} | {r['p50_us']} us | {r['p99_us']} us |")
    a, b = got.get("blipmq-async"), got.get("nats-async")
    if a and b:
        out.append(f"| AsyncClient / nats-py | {ratio(a['msg_per_s'], b['msg_per_s'])} | "
                   f"{ratio(a['p50_us'], b['p50_us'])} | {ratio(a['p99_us'], b['p99_us'])} |")
    return [*out, ""]


def curve_table(rows: list[Row]) -> list[str]:
    """Each curve point: deliveries/s and broker CPU us per delivery, a column per broker."""
    cur = [r for r in rows if r["workload"].startswith("curve")]
    brokers = [b for b in CLIENT if any(r["broker"] == b for r in cur)]
    if not cur:
        return []
    cell = {(r["workload"][6:], r["scale"], r["broker"]): r for r in cur}
    out = ["| cost curve: deliveries/s, broker CPU us/delivery | scale | "
           + " | ".join(brokers) + " |", "|---|---:|" + "---:|" * len(brokers)]
    for axis, scale in dict.fromkeys((w, s) for w, s, _ in cell):
        fmt = []
        for b in brokers:
            r = cell.get((axis, scale, b))
            fmt.append("-" if r is None else f"{r['deliveries_per_s']:,}/s, "
                       f"{r['cpu_us_per_delivery']} us"
                       + (f" ({r['lost']:,} lost)" if r["lost"] else ""))
        out.append(f"| {axis} | {scale:,} | " + " | ".join(fmt) + " |")
    return [*out, ""]


def mqtt_table(rows: list[Row]) -> list[str]:
    """BlipMQ's MQTT listener beside mosquitto, the same MQTT clients for both."""
    mq = {(r["workload"], r["broker"]): r for r in rows if r["workload"].startswith("mqtt")}
    if not mq:
        return []

    def line(label: str, workload: str, fmt: Callable[[Row], str], key: str) -> str:
        cells = [mq.get((workload, b)) for b in MQTT_KINDS]
        texts = [fmt(c) if c and c.get(key) is not None else "-" for c in cells]
        a, b = (c.get(key) if c else None for c in cells)
        return f"| {label} | " + " | ".join([*texts, ratio(a, b)]) + " |"

    def rate(key: str) -> Callable[[Row], str]:
        return lambda r: f"{r[key]:,}/s" + (f" ({r['lost']:,} lost)" if r["lost"] else "")

    cpu = lambda r: f"{r['cpu_us_per_delivery']} us"  # noqa: E731
    out = ["| MQTT, the same clients for both | BlipMQ (MQTT) | mosquitto | "
           "BlipMQ/mosquitto |", "|---|---:|---:|---:|"]
    tools = "mqtt C tools qos0"
    out.append(line("C tools, QoS 0, 100 B, 1 -> 1: delivered msg/s", tools,
                    rate("msg_per_s"), "msg_per_s"))
    out.append(line("C tools, QoS 0: broker CPU per delivery (lower is better)", tools, cpu,
                    "cpu_us_per_delivery"))
    for s in (1, 4):
        w = f"mqtt paho 1->{s}"
        out.append(line(f"paho-mqtt 1 -> {s}, 100 B: deliveries/s", w, rate("deliveries_per_s"),
                        "deliveries_per_s"))
        out.append(line(f"paho-mqtt 1 -> {s}: broker CPU per delivery (lower is better)", w,
                        cpu, "cpu_us_per_delivery"))
    for key, label in (("p50_us", "p50"), ("p99_us", "p99")):
        out.append(line(f"paho-mqtt latency at 2,000 msg/s, {label} (lower is better)",
                        "mqtt latency 2000 msg/s", lambda r, k=key: f"{r[k]} us", key))
    dur = "mqtt durable qos1"
    out.append(line(f"QoS 1 confirmed msg/s, `mosquitto_pub -q 1 -l -M {MQTT_INFLIGHT}` "
                    "(BlipMQ fsync always; mosquitto no fsync)", dur, rate("msg_per_s"),
                    "msg_per_s"))
    out.append(line("QoS 1: broker CPU per confirmed message (lower is better)", dur, cpu,
                    "cpu_us_per_delivery"))
    idle = next((w for w, _ in mq if w.startswith("mqtt idle")), None)
    if idle:
        n = idle.rsplit(" ", 1)[1]
        out.append(line(f"{int(n):,} idle connections (keepalive {KEEPALIVE} s): broker RSS, "
                        "MB (lower is better)", idle,
                        lambda r: f"{r['rss_mb']} ({r['kb_per_connection']} KB/conn)",
                        "rss_mb"))
        out.append(line(f"{int(n):,} idle connections: broker CPU, ms/s (lower is better)",
                        idle, lambda r: f"{r['cpu_ms_per_s']}", "cpu_ms_per_s"))
    sess = next((w for w, _ in mq if w.startswith("mqtt sessions restore")), None)
    if sess:
        r = mq[(sess, "blipmq")]
        out.append(f"| {int(r['messages']):,} persistent sessions (QoS 1 subscription each), "
                   f"restart: start-up to accepting, ms | {r['startup_ms']} (ready line "
                   f"{r['ready_ms']} ms; {r['restored']:,} restored, {r['resumed']}/"
                   f"{r['resume_sample']} resumed; RSS {r['rss_mb']} MB; CPU while they "
                   f"are offline {r['cpu_ms_per_s']} ms/s) | - | - |")
    return [*out, ""]


def durable_table(rows: list[Row]) -> list[str]:
    dur = [r for r in rows if r["workload"] == "durable confirmed"]
    if not dur:
        return []
    best = next((r["msg_per_s"] for r in dur if r["client"].endswith("fsync always")), None)
    out = ["| durable, confirmed 100 B messages | msg/s | broker CPU us/msg | "
           "BlipMQ fsync always / this |", "|---|---:|---:|---:|"]
    out += [f"| {r['broker']} ({r['client']}) | {r['msg_per_s']:,} | "
            f"{r['cpu_us_per_delivery']} | {ratio(best, r['msg_per_s'])} |" for r in dur]
    return [*out, ""]


def write(rows: list[Row], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "summary.md").write_text(summary(rows, meta) + "\n")
    try:
        import charts  # bench/charts.py: matplotlib, from the dev extra
    except ImportError as exc:
        print(f"no charts: {exc}", file=sys.stderr)
        return
    for path in charts.draw(rows, out):
        print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    ap.add_argument("--brokers", default="blipmq,mosquitto,nats,redis")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--sizes", default="100,4096,65536",
                    help="payload sizes of the throughput workloads, bytes")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench")
    ap.add_argument("--no-install", action="store_true", help="never apt-get missing peers")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs of each throughput and latency workload; the row is the run "
                         "with the median rate (throughput) or p99 (latency) "
                         "(default 3, --quick 1)")
    args = ap.parse_args()
    kinds = [k for k in args.brokers.split(",") if k]
    workloads = set(args.workloads.split(","))
    bad = [k for k in kinds if k not in CLIENT]
    bad += [w for w in workloads if w not in WORKLOADS + EXTRA_WORKLOADS]
    bad += [s for s in args.sizes.split(",") if not s.isdigit() or int(s) not in SIZES["full"]]
    if bad:
        raise SystemExit(f"compare.py: unknown broker or workload: {', '.join(bad)}")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 1,000 connections
    kinds, skipped = ensure_peers(kinds, not args.no_install)
    js: tuple[str | None, str] = (None, "not wanted")
    if "nats" in kinds and "durable" in workloads:
        exe, note = newer_nats.obtain(not args.no_install)
        js = (str(exe) if exe else None, note)
    level = "quick" if args.quick else "full"
    sizes = {s: n for s, n in SIZES[level].items() if str(s) in args.sizes.split(",")}
    command = "python bench/compare.py" + (" --quick" if args.quick else "")
    if args.brokers != ap.get_default("brokers"):
        command += f" --brokers {args.brokers}"
    if args.workloads != ap.get_default("workloads"):
        command += f" --workloads {args.workloads}"
    if args.sizes != ap.get_default("sizes"):
        command += f" --sizes {args.sizes}"
    repeat = args.repeat or (1 if args.quick else 3)
    if args.repeat is not None:
        command += f" --repeat {args.repeat}"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command, "level": level,
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, "
                       f"{platform.platform(terse=True)}, Python {platform.python_version()}",
            "versions": {k: version(k) for k in kinds}, "skipped": skipped,
            "jetstream_server": js[1] if js[0] else None,
            "loadavg_start": os.getloadavg()[0], "repeat": repeat}
    if "mqtt" in workloads and any(k in MQTT_KINDS for k in kinds):
        meta["versions"]["MQTT clients:"] = mqtt_clients()
    rows: list[Row] = []
    info_rows: dict[str, Row] = {}  # the "broker" row of each broker that started
    peaks: dict[str, float] = {}  # peak RSS of each broker, over all its processes
    with tempfile.TemporaryDirectory(prefix="blipmq-compare-") as tmp:
        work = Path(tmp)
        for kind in kinds:
            print(f"{kind}:", file=sys.stderr)
            try:
                broker = start_broker(kind, work)
            except RuntimeError as exc:
                skipped[kind] = str(exc)
                continue
            try:
                time.sleep(0.5)  # settle before the idle figure
                info = {"workload": "broker", "broker": kind, "client": "",
                        "idle_rss_mb": broker.memory_mb("VmRSS"),
                        "startup_ms": round(broker.startup_ms, 1)}
                if "throughput" in workloads:
                    throughput(kind, broker, sizes, rows, repeat)
                if "pipe" in workloads:
                    pipe(kind, broker, 5_000 if args.quick else 200_000, work, rows)
                peaks[kind] = broker.memory_mb("VmHWM")
                info_rows[kind] = info
                rows.append(info)
            except RuntimeError as exc:
                skipped[f"{kind} workloads"] = str(exc)
                print(f"  {kind}: {exc}", file=sys.stderr)
            finally:
                broker.stop()
        if "latency" in workloads:
            print("latency, in rounds:", file=sys.stderr)
            latency(list(info_rows), 1_000 if args.quick else 10_000, work, rows, repeat,
                    peaks, skipped)
        for kind, info in info_rows.items():  # the throughput runs' broker or a latency one
            info["peak_rss_mb"] = peaks[kind]
        if "durable" in workloads:
            print("durable:", file=sys.stderr)
            durable(kinds, 2_000 if args.quick else 50_000, work, rows, skipped, js)
        if "curve" in workloads:
            print("cost curve:", file=sys.stderr)
            for kind in kinds:
                try:
                    curve(kind, work, args.quick, rows)
                except RuntimeError as exc:
                    skipped[f"{kind} cost curve"] = str(exc)
                    print(f"  {kind}: {exc}", file=sys.stderr)
        if "mqtt" in workloads and any(k in MQTT_KINDS for k in kinds):
            print("mqtt (BlipMQ's MQTT listener and mosquitto, the same clients):",
                  file=sys.stderr)
            mqtt(kinds, work, args.quick, rows, repeat, skipped)
        elif "mqtt-latency" in workloads and any(k in MQTT_KINDS for k in kinds):
            print("mqtt latency, in rounds:", file=sys.stderr)
            latency([k for k in MQTT_KINDS if k in kinds],
                    MQTT["quick" if args.quick else "full"]["latency"], work, rows, repeat, {},
                    skipped, workload="mqtt latency 2000 msg/s", mqtt=True)
        if "clients" in workloads:
            print("clients (bench/clientbench.py):", file=sys.stderr)
            clients(work, args.quick, rows, skipped)
    meta["loadavg_end"] = os.getloadavg()[0]
    write(rows, meta, args.out)
    print(summary(rows, meta))
    print(f"\nresults in {args.out}; to reproduce everything docs/PERFORMANCE.md quotes:\n"
          f"  .venv/bin/python bench/compare.py")


if __name__ == "__main__":
    main()
