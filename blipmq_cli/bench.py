"""``blipmq bench``: load a broker with publisher and subscriber processes and report what came
through: msg/s, MB/s, end-to-end latency percentiles and loss, counted message by message.

Every publisher and subscriber is its own process (forked, so it works the same from the pip
install and the frozen executable, and it loads more than one core). Each payload starts with
a 16-byte header:

    | offset | size | field                                        |
    |--------|------|----------------------------------------------|
    | 0      | 8    | send time, CLOCK_MONOTONIC ns (one clock for |
    |        |      | every process on the machine)                |
    | 8      | 4    | publisher index                              |
    | 12     | 4    | sequence number within that publisher        |

so a subscriber measures latency itself and marks each (publisher, sequence) it got: lost and
duplicated messages are counted, never assumed. Latencies go into a fixed-size log-linear
histogram (1.6% resolution), so memory does not grow with the run; the seen-marks take one
byte per message per subscriber, which ``MAX_MESSAGES`` bounds.

``--start`` runs a temporary broker (this executable's ``start``) on a free 127.0.0.1 port
with a temporary data directory, measures its CPU time and peak RSS from /proc, and stops it
by PID. Imports the standard library, rich (for the table and the progress bar) and the
client; nothing dev-only.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from blipmq_cli.client import DEFAULT_ADDR, connect_from_env
from blipmq_cli.commands import UsageError, guarded, say, stderr_is_terminal
from blipmq_cli.environment import for_children
from blipmq_cli.exits import Exit, for_error
from blipmq_server.errors import BlipError
from blipmq_server.protocol.codec import Message

HEADER = struct.Struct(">QII")
MAX_MESSAGES = 10_000_000  # seen-marks: one byte per message per subscriber
MAX_PROCESSES = 256
FSYNC_POLICIES = ("always", "none")  # plus every_n:N and interval_ms:M, checked by the broker
_SUB_BITS = 6  # histogram: 2**6 sub-buckets per power of two (about 1.6% resolution)
_BUCKETS = (64 - _SUB_BITS + 1) << _SUB_BITS
_IDLE_AFTER_DONE = 1.0  # s without a delivery, once every publisher is done: the rest is lost
_PROGRESS_EVERY = 0.1


class Histogram:
    """Counts of non-negative integers in log-linear buckets (exact below 128)."""

    __slots__ = ("counts", "max", "total")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0
        self.max = 0

    def add_all(self, values: Sequence[int]) -> None:
        """Count every value (a batch's latencies: one call, no call per value, so that the
        measuring costs a subscriber less than the receiving it measures)."""
        counts, top = self.counts, self.max
        sub, over = _SUB_BITS, _SUB_BITS + 1
        for value in values:
            if value < 0:
                value = 0
            shift = value.bit_length() - over
            if shift < 0:
                shift = 0
            counts[(shift << sub) + (value >> shift)] += 1
            if value > top:
                top = value
        self.max = top
        self.total += len(values)

    def merge(self, counts: list[int], top: int) -> None:
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.total += sum(counts)
        self.max = max(self.max, top)

    def quantile(self, q: float) -> int | None:
        """The value at quantile ``q`` (the middle of its bucket, never above the max)."""
        if not self.total:
            return None
        rank = max(1, round(q * self.total))
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                if index < 2 << _SUB_BITS:
                    return index
                shift = (index >> _SUB_BITS) - 1
                low = (index - (shift << _SUB_BITS)) << shift
                return min(low + (1 << shift) // 2, self.max)
        return self.max


@dataclass(frozen=True, slots=True)
class Plan:
    addr: str
    api_key: str
    publishers: int
    subscribers: int
    topics: int
    messages: int
    size: int
    qos: int
    batch: int
    rate: int  # messages/s over all publishers, 0: as fast as they can
    timeout: float
    prefix: str

    def share(self, publisher: int) -> int:
        """Messages publisher ``publisher`` sends (the total split as evenly as possible)."""
        base, extra = divmod(self.messages, self.publishers)
        return base + (publisher < extra)


def _send(conn: multiprocessing.connection.Connection, *item: object) -> None:
    try:
        conn.send(item)
    except OSError:
        pass  # the parent went away; nothing to report to


def _fail(conn: multiprocessing.connection.Connection, exc: BaseException) -> None:
    _send(conn, "error", str(exc) or type(exc).__name__, int(for_error(exc)))


def _publisher(plan: Plan, index: int, conn: multiprocessing.connection.Connection,
               go: threading.Event) -> None:
    try:
        client = connect_from_env(plan.addr, plan.api_key, timeout=min(plan.timeout, 30))
        _send(conn, "ready")
        if not go.wait(plan.timeout):
            return
        n = plan.share(index)
        filler = b"x" * (plan.size - HEADER.size)
        topics = [f"{plan.prefix}/{t}" for t in range(plan.topics)]
        pack, clock, qos = HEADER.pack, time.monotonic_ns, plan.qos
        deadline = time.monotonic() + plan.timeout
        start = time.monotonic()
        sent = 0
        if plan.rate:
            interval = plan.publishers * 1e9 / plan.rate
            origin = clock()
            for seq in range(n):
                due = origin + seq * interval
                while (now := clock()) < due:
                    if due - now > 200_000:
                        time.sleep((due - now - 100_000) / 1e9)
                client.publish_many(
                    [Message(topics[seq % plan.topics], pack(clock(), index, seq) + filler, qos)]
                )
                sent += 1
                if time.monotonic() > deadline:
                    break
        else:
            for base in range(0, n, plan.batch):
                stop = min(base + plan.batch, n)
                client.publish_many(
                    [Message(topics[s % plan.topics], pack(clock(), index, s) + filler, qos)
                     for s in range(base, stop)]
                )
                sent = stop
                if qos:
                    client.check()
                if time.monotonic() > deadline:
                    break
        client.flush(timeout=max(1.0, deadline - time.monotonic()))
        end = time.monotonic()
        _send(conn, "done", {"sent": sent, "confirmed": client.confirmed, "start": start,
                             "end": end})
        client.close()
    except (BlipError, OSError, TimeoutError) as exc:
        _fail(conn, exc)
    except KeyboardInterrupt:
        pass


def _subscriber(plan: Plan, index: int, conn: multiprocessing.connection.Connection,
                done: threading.Event) -> None:
    try:
        client = connect_from_env(plan.addr, plan.api_key, timeout=min(plan.timeout, 30))
        subscription = client.subscribe(f"{plan.prefix}/#")
        _send(conn, "ready")
        seen = [bytearray(plan.share(p)) for p in range(plan.publishers)]
        histogram = Histogram()
        unpack, clock = HEADER.unpack_from, time.monotonic_ns
        received = unique = duplicates = 0
        expected = plan.messages
        deadline = time.monotonic() + plan.timeout
        idle_since = None
        last_delivery = 0.0
        next_progress = 0.0
        while unique < expected:
            try:
                batch = subscription.next_batch(0.1)
            except TimeoutError:
                batch = ()
            now_s = time.monotonic()
            if batch:
                now = clock()
                heads = [unpack(d.payload) for d in batch]
                histogram.add_all([now - head[0] for head in heads])
                for _, publisher, seq in heads:
                    marks = seen[publisher]
                    if marks[seq]:
                        duplicates += 1
                    else:
                        marks[seq] = 1
                        unique += 1
                received += len(batch)
                last_delivery = now_s
                idle_since = None
            elif done.is_set():
                idle_since = idle_since or now_s
                if now_s - idle_since > _IDLE_AFTER_DONE:
                    break
            if now_s > deadline:
                break
            if now_s >= next_progress:
                _send(conn, "progress", index, unique)
                next_progress = now_s + _PROGRESS_EVERY
        _send(conn, "done", {"received": received, "unique": unique, "duplicates": duplicates,
                             "last": last_delivery, "hist": histogram.counts,
                             "max": histogram.max})
        client.abort()
    except (BlipError, OSError, TimeoutError) as exc:
        _fail(conn, exc)
    except KeyboardInterrupt:
        pass


@dataclass(frozen=True, slots=True)
class Report:
    publishers: int
    subscribers: int
    topics: int
    messages: int
    size: int
    qos: int
    rate: int
    broker: str  # "started" or the address
    log: bool | None
    fsync: str | None
    published: int
    confirmed: int
    expected_deliveries: int
    delivered: int
    duplicates: int
    lost: int
    seconds: float
    publish_seconds: float
    msg_per_s: float
    deliveries_per_s: float
    mb_per_s: float
    latency_us: dict[str, float | None]
    broker_cpu_s: float | None
    broker_cpu_us_per_delivery: float | None
    broker_peak_rss_mb: float | None


class Broker:
    """A temporary broker: this executable's ``start`` on 127.0.0.1, port 0, in a temp dir."""

    def __init__(self, log: bool, fsync: str, timeout: float) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="blipmq-bench-"))
        config = self.dir / "bench.toml"
        config.write_text(
            "[server]\nport = 0\nhost = \"127.0.0.1\"\n[metrics]\nenabled = false\n"
            f"[wal]\nenabled = {'true' if log else 'false'}\nfsync = \"{fsync}\"\n"
        )
        command = ([sys.executable] if getattr(sys, "frozen", False)
                   else [sys.executable, "-m", "blipmq_cli.main"])
        self.proc = subprocess.Popen(
            [*command, "start", "--config", str(config), "--data-dir", str(self.dir / "data"),
             "--log-format", "plain", "--log-level", "info"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            # `python -m` puts its working directory first on the import path: from a source
            # tree of another version the broker would be that tree's, not this CLI's
            cwd=self.dir,
            # the frozen executable's own variables would make the new broker take itself
            # for this process's child (environment.py)
            env=for_children(os.environ),
        )
        self.tail: deque[str] = deque(maxlen=20)
        self.addr = self._ready(timeout)
        threading.Thread(target=self._drain, daemon=True).start()

    def _ready(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        pending = b""
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                self.tail.append(line)
                marker = "listening on "
                if marker in line:
                    return line.split(marker, 1)[1].split(";", 1)[0].split(",", 1)[0].strip()
        self.stop()
        why = self.tail[-1] if self.tail else "no output"
        raise UsageError(f"the temporary broker did not start: {why}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.tail.append(raw.decode(errors="replace").rstrip())

    def cpu_s(self) -> float | None:
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        except OSError:
            pass
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _check(plan: Plan, start: bool, log: bool | None, fsync: str | None) -> None:
    if plan.publishers < 1 or plan.subscribers < 0:
        raise UsageError("--publishers must be at least 1 and --subscribers at least 0")
    if plan.publishers + plan.subscribers > MAX_PROCESSES:
        raise UsageError(f"--publishers plus --subscribers: at most {MAX_PROCESSES} processes")
    if not 1 <= plan.topics <= 1_000_000:
        raise UsageError("--topics must be between 1 and 1000000")
    if not 1 <= plan.messages <= MAX_MESSAGES:
        raise UsageError(f"--messages must be between 1 and {MAX_MESSAGES}")
    if plan.size < HEADER.size:
        raise UsageError(f"--size must be at least {HEADER.size} bytes (the timestamp header)")
    if plan.qos not in (0, 1):
        raise UsageError("--qos must be 0 or 1")
    if plan.batch < 1 or plan.rate < 0 or plan.timeout <= 0:
        raise UsageError("--batch must be at least 1, --rate and --timeout not negative")
    if not start and (log is not None or fsync is not None):
        raise UsageError("--log and --fsync configure a broker bench starts: add --start")
    if start and plan.addr:
        raise UsageError("give --start (a temporary broker) or --addr (a running one), not both")
    if fsync is not None and fsync not in FSYNC_POLICIES and not fsync.startswith(
        ("every_n:", "interval_ms:")
    ):
        raise UsageError(f"--fsync {fsync!r}: always, none, every_n:N or interval_ms:M")


def _summarize(plan: Plan, pubs: list[dict], subs: list[dict], broker: Broker | None,
               cpu_before: float | None, log: bool | None, fsync: str | None) -> Report:
    histogram = Histogram()
    for s in subs:
        histogram.merge(s["hist"], s["max"])
    published = sum(p["sent"] for p in pubs)
    first = min(p["start"] for p in pubs)
    last_publish = max(p["end"] for p in pubs)
    last = max([last_publish, *(s["last"] for s in subs)])
    seconds = max(last - first, 1e-9)
    delivered = sum(s["unique"] for s in subs)
    expected = plan.messages * plan.subscribers
    cpu_after = broker.cpu_s() if broker else None
    cpu = (cpu_after - cpu_before) if cpu_after is not None and cpu_before is not None else None
    work = delivered or published
    us = lambda q: (  # noqa: E731
        None if (v := histogram.quantile(q)) is None else round(v / 1000, 1))
    return Report(
        publishers=plan.publishers, subscribers=plan.subscribers, topics=plan.topics,
        messages=plan.messages, size=plan.size, qos=plan.qos, rate=plan.rate,
        broker="started" if broker else plan.addr, log=log, fsync=fsync,
        published=published, confirmed=sum(p["confirmed"] for p in pubs),
        expected_deliveries=expected, delivered=delivered,
        duplicates=sum(s["duplicates"] for s in subs), lost=expected - delivered,
        seconds=round(seconds, 4), publish_seconds=round(last_publish - first, 4),
        msg_per_s=round(published / seconds, 1),
        deliveries_per_s=round(delivered / seconds, 1),
        mb_per_s=round((delivered or published) * plan.size / seconds / 1e6, 3),
        latency_us={"p50": us(0.50), "p95": us(0.95), "p99": us(0.99),
                    "max": round(histogram.max / 1000, 1) if histogram.total else None},
        broker_cpu_s=None if cpu is None else round(cpu, 3),
        broker_cpu_us_per_delivery=None if cpu is None or not work else round(cpu / work * 1e6, 3),
        broker_peak_rss_mb=broker.peak_rss_mb() if broker else None,
    )


def _table(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(
        f"{report.publishers} pub -> {report.subscribers} sub, {report.messages:,} x "
        f"{report.size} B, QoS {report.qos}, {report.topics} topic(s)"), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    lat = report.latency_us
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    rows = [
        ("published", f"{report.published:,}"),
        ("confirmed (QoS 1)", f"{report.confirmed:,}" if report.qos else "-"),
        ("delivered / expected", f"{report.delivered:,} / {report.expected_deliveries:,}"),
        ("lost", f"{report.lost:,}"),
        ("duplicates", f"{report.duplicates:,}"),
        ("seconds", f"{report.seconds:.3f}"),
        ("msg/s (published)", f"{report.msg_per_s:,.0f}"),
        ("deliveries/s", f"{report.deliveries_per_s:,.0f}"),
        ("MB/s (delivered payload)", f"{report.mb_per_s:,.2f}"),
        ("latency p50 / p95 / p99 / max, us",
         " / ".join(fmt(lat[k]) for k in ("p50", "p95", "p99", "max"))),
    ]
    if report.broker_cpu_s is not None:
        rows.append(("broker CPU, s (us per delivery)",
                     f"{report.broker_cpu_s:.2f} ({fmt(report.broker_cpu_us_per_delivery)})"))
        rows.append(("broker peak RSS, MB", fmt(report.broker_peak_rss_mb)))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _run(plan: Plan, start: bool, log: bool | None, fsync: str | None, as_json: bool) -> int:
    _check(plan, start, log, fsync)
    broker = None
    if start:
        log, fsync = (True if log is None else log), (fsync or "always")
        broker = Broker(log, fsync, min(plan.timeout, 30))
        # plain TCP, whatever BLIPMQ_CAFILE and the like say (it is not a TLS broker)
        plan = Plan(**{**asdict(plan), "addr": f"tcp://{broker.addr}"})
    elif not plan.addr:
        plan = Plan(**{**asdict(plan), "addr": os.environ.get("BLIPMQ_ADDR") or DEFAULT_ADDR})
    procs: list[multiprocessing.Process] = []
    try:
        # reachable?
        connect_from_env(plan.addr, plan.api_key, timeout=min(plan.timeout, 10)).close()
        ctx = multiprocessing.get_context("fork")
        go, done = ctx.Event(), ctx.Event()
        conns: dict[multiprocessing.connection.Connection, str] = {}
        for kind, count, target, event in (("sub", plan.subscribers, _subscriber, done),
                                           ("pub", plan.publishers, _publisher, go)):
            for i in range(count):
                ours, theirs = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=target, args=(plan, i, theirs, event), daemon=True)
                proc.start()
                theirs.close()
                procs.append(proc)
                conns[ours] = kind
        return _collect(plan, broker, procs, conns, go, done, log, fsync, as_json)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if broker:
            broker.stop()


def _collect(plan: Plan, broker: Broker | None, procs: list, conns: dict, go: threading.Event,
             done: threading.Event, log: bool | None, fsync: str | None, as_json: bool) -> int:
    deadline = time.monotonic() + plan.timeout + 30
    results: dict[str, list[dict]] = {"pub": [], "sub": []}
    readies = 0
    progress: dict[int, int] = {}
    cpu_before = None
    finished: set = set()
    bar = None
    if not as_json and stderr_is_terminal():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        bar = Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), transient=True)
        task = bar.add_task("deliveries" if plan.subscribers else "waiting",
                            total=plan.messages * max(plan.subscribers, 1))
        bar.start()
    try:
        open_conns = list(conns)
        while open_conns:
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"bench: gave up after {plan.timeout + 30:g} s with processes still running")
                return Exit.TIMEOUT
            for conn in multiprocessing.connection.wait(open_conns, timeout=min(left, 0.5)):
                try:
                    item = conn.recv()
                except EOFError:
                    open_conns.remove(conn)
                    if conn not in finished:
                        say("bench: a worker process ended without a result")
                        return Exit.INTERNAL
                    continue
                kind = item[0]
                if kind == "error":
                    say(item[1])
                    return item[2]
                if kind == "ready":
                    readies += 1
                    if readies == len(procs):
                        cpu_before = broker.cpu_s() if broker else None
                        go.set()
                elif kind == "progress":
                    progress[item[1]] = item[2]
                    if bar is not None:
                        bar.update(task, completed=sum(progress.values()))
                elif kind == "done":
                    results[conns[conn]].append(item[1])
                    finished.add(conn)
                    if len(results["pub"]) == plan.publishers:
                        done.set()
    finally:
        if bar is not None:
            bar.stop()
    report = _summarize(plan, results["pub"], results["sub"], broker, cpu_before, log, fsync)
    if as_json:
        print(json.dumps(asdict(report)))
    else:
        _table(report)
    return Exit.OK


def command(
    addr: str | None, api_key: str | None, *, start: bool, publishers: int, subscribers: int,
    topics: int, messages: int, size: int, qos: int, batch: int, rate: int, timeout: float,
    log: bool | None, fsync: str | None, as_json: bool,
) -> int:
    plan = Plan(
        addr=addr or "", api_key=api_key or "", publishers=publishers, subscribers=subscribers,
        topics=topics, messages=messages, size=size, qos=qos, batch=batch, rate=rate,
        timeout=timeout, prefix=f"bench/{os.getpid()}-{time.monotonic_ns() % 1_000_000}",
    )
    return guarded(lambda: _run(plan, start, log, fsync, as_json))
