"""The frozen executable under test, and how to run it like a device operator would.

``executable`` (a session fixture) is ``$BLIPMQ_DIST_BINARY`` when set (packaging/arm64.sh
points it at the aarch64 build, run under qemu), else this machine's build from
``packaging/build.py``, which rebuilds only when its inputs changed. Every process is started
in a session of its own and, if it outlives its test, ended with its whole process group:
a onefile executable is two processes, and signalling only the parent would leave the child.
``start_broker`` puts every listener, MQTT included, on a free loopback port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parent.parent
# qemu makes every start of the aarch64 binary take seconds
SLOW = float(os.environ.get("BLIPMQ_DIST_TIMEOUT", "60"))
_LISTENING = re.compile(r"listening on [\d.]+:(\d+), metrics on https?://[\d.]+:(\d+)/metrics")
_MQTT = re.compile(r", mqtt on [\d.]+:(\d+)[;,]")
_MQTTS = re.compile(r", mqtts on [\d.]+:(\d+)[;,]")  # with mqtt.tls
_TLS = re.compile(r", tls on [\d.]+:(\d+)[;,]")  # with server.tls
MOSQUITTO_PUB, MOSQUITTO_SUB = Path("/usr/bin/mosquitto_pub"), Path("/usr/bin/mosquitto_sub")


@dataclass(frozen=True)
class Executable:
    path: Path
    contents: Path | None  # the bill of materials, for a build made here


@pytest.fixture(scope="session")
def executable() -> Executable:
    given = os.environ.get("BLIPMQ_DIST_BINARY")
    if given:
        path = Path(given)
        assert path.is_file(), f"BLIPMQ_DIST_BINARY={given} is not a file"
        contents = path.with_name(path.name + ".contents.txt")
        return Executable(path, contents if contents.exists() else None)
    build = subprocess.run(
        [sys.executable, str(TOP / "packaging" / "build.py")],
        capture_output=True, text=True, timeout=900,
    )
    assert build.returncode == 0, f"packaging/build.py failed:\n{build.stderr[-3000:]}"
    onefile, _tarball, contents = (Path(p) for p in build.stdout.split())
    return Executable(onefile, contents)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Runner:
    """Runs the executable with a clean environment and a private TMPDIR."""

    binary: Path
    tmpdir: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("BLIPMQ_", "PYTHON", "VIRTUAL_ENV"))}
        env["TMPDIR"] = str(self.tmpdir)
        return env

    def run(self, *args: str, input: bytes | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
        proc = self.spawn(*args, env=env, stdin=subprocess.PIPE)
        out, err = proc.communicate(input, timeout=SLOW)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_program(self, *argv: str) -> subprocess.CompletedProcess[bytes]:
        proc = self.spawn_program(*argv)
        out, err = proc.communicate(timeout=SLOW)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def spawn(self, *args: str, env: dict[str, str] | None = None,
              stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        return self.spawn_program(str(self.binary), *args, env=env, stdin=stdin)

    def spawn_program(self, *argv: str, env: dict[str, str] | None = None,
                      stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """Any program (mosquitto_sub, ...), ended with the others if it outlives its test."""
        proc = subprocess.Popen(
            argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**self.env, **(env or {})}, start_new_session=True,
        )
        self.started.append(proc)
        return proc

    def end_all(self) -> None:
        """Kill what is still running, by process group (ours only: each has its own)."""
        for proc in self.started:
            if group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait(SLOW)


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    log: list[str]
    port: int = 0
    metrics_port: int = 0
    mqtt_port: int = 0  # 0: the ready line named no MQTT listener
    mqtts_port: int = 0  # ... no MQTT TLS listener
    tls_port: int = 0  # ... no native TLS listener
    log_ended: threading.Event = field(default_factory=threading.Event)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=SLOW) as resp:
            return resp.read().decode()

    def metric(self, name: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_metric(self, name: str, value: float) -> None:
        deadline = time.monotonic() + SLOW
        while (current := self.metric(name)) != value:
            assert time.monotonic() < deadline, f"{name} is {current}, waited for {value}"
            time.sleep(0.05)


def start_broker(runner: Runner, config: Path, data_dir: Path,
                 env: dict[str, str] | None = None, under: tuple[str, ...] = ()) -> Broker:
    """``blipmq start`` on free loopback ports, returned once its ready line says where.

    MQTT too (``config init`` turns it on at 1883): ``--mqtt-bind`` serves it on a free port
    whatever the file says, and ``Broker.mqtt_port`` is the one the ready line names. ``env``
    adds settings (``BLIPMQ_SERVER_TLS=true``, ...); the TLS ports are read the same way.
    ``under`` runs it under another program (``unshare --pid --fork``: as a PID 1).
    """
    proc = runner.spawn_program(
        *under, str(runner.binary),
        "start", "--config", str(config), "--data-dir", str(data_dir),
        "--bind", "127.0.0.1:0", "--metrics-bind", "127.0.0.1:0",
        "--mqtt-bind", "127.0.0.1:0", "--log-format", "plain", env=env,
    )
    broker = Broker(proc, [])
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            broker.log.append(line)
            m = _LISTENING.search(line)
            if m and not ready.is_set():
                broker.port, broker.metrics_port = int(m.group(1)), int(m.group(2))
                if mq := _MQTT.search(line):
                    broker.mqtt_port = int(mq.group(1))
                if mq := _MQTTS.search(line):
                    broker.mqtts_port = int(mq.group(1))
                if tls := _TLS.search(line):
                    broker.tls_port = int(tls.group(1))
                ready.set()
        broker.log_ended.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(SLOW)
    assert broker.port, "the broker did not say it listens:\n" + "\n".join(broker.log)
    return broker


@pytest.fixture
def runner(executable: Executable, tmp_path: Path) -> Iterator[Runner]:
    unpack = tmp_path / "unpack"
    unpack.mkdir()
    r = Runner(executable.path, unpack)
    yield r
    r.end_all()
