"""Shared fixtures: a real broker subprocess on loopback and the real `blipmq` CLI."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomlkit
from hypothesis import settings

BLIPMQ = str(Path(sys.executable).with_name("blipmq"))

# Property tests (hypothesis) draw the same examples on every run, from a seed derived from
# each test, so the suite fails on what a change broke, never on a new draw. The draws can
# still miss a rare case: ``HYPOTHESIS_PROFILE=random`` (or ``pytest
# --hypothesis-profile=random``) draws new examples on each run, to look for one
# (``--hypothesis-seed`` applies there only); a case found that way belongs in an
# ``@example`` of its test. Both keep the rest of the current profile (hypothesis' own "ci"
# profile when it detects CI: no deadline).
settings.register_profile("fixed", settings(), derandomize=True)
settings.register_profile("random", settings(), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def pytest_configure(config: pytest.Config) -> None:
    """Give this process a block of loopback ports of its own for ``free_port()``
    (bench/ports.py, used by tests/upstream.py and the bench scripts the tests start).

    A test that picks a port itself (to start mosquitto or a second broker on it, to restart
    a server on the same port, or as one nobody listens on) needs it to stay free until it
    binds it. A port from the kernel's ephemeral range does not: with the suite on several
    pytest-xdist workers, another worker's bind to port 0 or outgoing connection can take it
    in between. Ports below that range are never handed out by the kernel, so each worker
    gets a slice of 20000 up to the range's start, and a run without workers all of it; the
    bench scripts inherit it through the environment. The xdist controller runs no test and
    takes none."""
    first = 20000
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None and getattr(config.option, "numprocesses", None):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (int(ephemeral[0]) - first) // workers
    if size < 200:  # no room below the ephemeral range: the kernel's choice, as before
        os.environ.pop("BLIPMQ_PORT_BLOCK", None)
        return
    low = first + (int(worker[2:]) if worker else 0) * size
    os.environ["BLIPMQ_PORT_BLOCK"] = f"{low}-{low + size - 1}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that share one worker (``xdist_group``: the Spark tests, the executable's)
    first, keeping their order: each group is one long unit of work for pytest-xdist, and one
    handed out last would run on alone while the other workers have finished."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


def _default_signals() -> None:
    """In a child: SIGINT back to its default. A suite started in the background by a shell
    inherits SIGINT ignored, and Python then never raises KeyboardInterrupt (the Ctrl-C
    tests would hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
_LISTENING = re.compile(r"listening on [\d.]+:(\d+)(?:, metrics on https?://[\d.]+:(\d+)/metrics)?"
                        r"(?:, mqtt on [\d.]+:(\d+))?(?:, mqtts on [\d.]+:(\d+))?"
                        r"(?:, tls on [\d.]+:(\d+))?")


@dataclass
class BrokerProcess:
    proc: subprocess.Popen[bytes]
    config_path: Path
    data_dir: Path
    port: int = 0
    metrics_port: int | None = None
    mqtt_port: int | None = None  # when the config enabled MQTT
    mqtts_port: int | None = None  # MQTT over TLS (mqtt.tls)
    tls_port: int | None = None  # the native protocol over TLS (server.tls)
    # /metrics over HTTPS (metrics.tls): the context that trusts the broker's certificate
    metrics_tls: ssl.SSLContext | None = None
    metrics_token: str | None = None  # sent as a bearer token (metrics.token_hash)
    log: list[str] = field(default_factory=list)
    log_ended: threading.Event = field(default_factory=threading.Event)  # stderr closed

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
        env["BLIPMQ_ADDR"] = self.addr
        return env

    def cli(
        self, *args: str, input: bytes | None = None, timeout: float = 30, **env: str
    ) -> subprocess.CompletedProcess[bytes]:
        """Run `blipmq ARGS` against this broker and wait for it."""
        return subprocess.run(
            [BLIPMQ, *args], input=input, capture_output=True, timeout=timeout,
            env={**self.env, **env}, preexec_fn=_default_signals,
        )

    def spawn(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        """Start `blipmq ARGS` in the background with pipes on all three streams."""
        return subprocess.Popen(
            [BLIPMQ, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={**self.env, **env}, preexec_fn=_default_signals,
        )

    def shell(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        """Run a shell pipeline with `blipmq` on PATH and BLIPMQ_ADDR set, and wait for it."""
        proc = self.spawn_shell(script)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def spawn_shell(self, script: str) -> subprocess.Popen[bytes]:
        """Start a shell pipeline in the background (`blipmq sub t > file`, `... | head -1`)."""
        env = {**self.env, "PATH": f"{Path(BLIPMQ).parent}:{os.environ['PATH']}"}
        return subprocess.Popen(
            ["bash", "-o", "pipefail", "-c", script], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, preexec_fn=_default_signals,
        )

    def metrics(self) -> str:
        scheme = "http" if self.metrics_tls is None else "https"
        url = f"{scheme}://127.0.0.1:{self.metrics_port}/metrics"
        headers = {} if self.metrics_token is None else {
            "Authorization": f"Bearer {self.metrics_token}"}
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5,
                                    context=self.metrics_tls) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """One sample from /metrics, e.g. metric("blipmq_messages_dropped_total", reason="ttl")."""
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        key = f"{name}{{{want}}}" if want else name
        for line in self.metrics().splitlines():
            if line.startswith(key + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(key)

    def wait_metric(self, name: str, value: float, timeout: float = 10, **labels: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            current = self.metric(name, **labels)
            if current == value:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} is {current}, waited for {value}")
            time.sleep(0.02)

    def wait_metric_at_least(self, name: str, value: float, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while (current := self.metric(name)) < value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} is {current}, waited for {value} or more")
            time.sleep(0.02)

    def wait_dead_letters(self, dead_lettered: int, dropped: int, timeout: float = 10) -> None:
        """Wait until ``dropped`` dead letters ended for groups that gave up on them, or
        more than ``dead_lettered`` messages went to the dead letters (a dead letter
        dead-lettered again, to `$dlq/$dlq/...`); then both counters must be those."""
        deadline = time.monotonic() + timeout
        while True:
            found = dict(line.rsplit(" ", 1) for line in self.metrics().splitlines()
                         if line.startswith("blipmq_messages_dead_"))
            now = (float(found.get("blipmq_messages_dead_lettered_total", 0)),
                   float(found.get("blipmq_messages_dead_letters_dropped_total", 0)))
            if now[0] > dead_lettered or now[1] >= dropped or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert now == (dead_lettered, dropped), f"(dead-lettered, dropped) is {now}"

    def wait_subscribers(self, n: int) -> None:
        """Wait until n subscriptions/groups exist (so a publish cannot race a subscribe)."""
        self.wait_metric("blipmq_queues", n)

    def wait_log(self, text: str, timeout: float = 10) -> str:
        """The first log line containing ``text``, once the broker has written it."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.log):
                if text in line:
                    return line
            if self.log_ended.is_set() or time.monotonic() > deadline:
                raise AssertionError(f"no log line with {text!r}:\n" + "\n".join(self.log))
            time.sleep(0.01)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def _drain(proc: subprocess.Popen[bytes], sink: list[str], ready: threading.Event,
           bp: BrokerProcess) -> None:
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode(errors="replace").rstrip("\n")
        sink.append(line)
        m = _LISTENING.search(line)
        if m and not ready.is_set():
            bp.port = int(m.group(1))
            bp.metrics_port = int(m.group(2)) if m.group(2) else None
            bp.mqtt_port = int(m.group(3)) if m.group(3) else None
            bp.mqtts_port = int(m.group(4)) if m.group(4) else None
            bp.tls_port = int(m.group(5)) if m.group(5) else None
            ready.set()
    bp.log_ended.set()
    ready.set()


def launch_broker(where: Path, started: list[BrokerProcess], config: dict | None = None, *,
                  expect_ready: bool = True, data_dir: Path | None = None) -> BrokerProcess:
    """Start a broker subprocess with its config and data under ``where``; ``started``
    collects it so that the caller kills what is left at the end."""
    n = len(started)
    settings: dict = {"server": {"port": 0}, "metrics": {"port": 0}}
    for section, values in (config or {}).items():
        if isinstance(values, list):  # an array of tables: [[bridge]]
            settings[section] = values
            continue
        settings.setdefault(section, {}).update(values)
    path = where / f"blipmq-{n}.toml"
    path.write_text(tomlkit.dumps(settings))
    data_dir = data_dir or where / f"data-{n}"
    proc = subprocess.Popen(
        [BLIPMQ, "start", "--config", str(path), "--data-dir", str(data_dir),
         "--log-format", "plain"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")},
        preexec_fn=_default_signals,
    )
    bp = BrokerProcess(proc, path, data_dir)
    started.append(bp)
    ready = threading.Event()
    threading.Thread(target=_drain, args=(proc, bp.log, ready, bp), daemon=True).start()
    if expect_ready:
        if not ready.wait(20) or not bp.port:
            proc.kill()
            raise AssertionError("broker did not start:\n" + "\n".join(bp.log))
    return bp


def kill_brokers(started: list[BrokerProcess]) -> None:
    for bp in started:
        if bp.proc.poll() is None:
            bp.proc.kill()
            bp.proc.wait()


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator:
    started: list[BrokerProcess] = []

    def start(
        config: dict | None = None, *, expect_ready: bool = True, data_dir: Path | None = None
    ) -> BrokerProcess:
        return launch_broker(tmp_path, started, config, expect_ready=expect_ready,
                             data_dir=data_dir)

    yield start
    kill_brokers(started)
