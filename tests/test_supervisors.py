"""The onefile executable stopped the ways supervisors and people stop it.

A onefile executable is two processes: the bootloader, whose PID a supervisor knows, and the
broker, its child. supervisord, runit, start-stop-daemon and ``docker stop`` signal that one
PID; systemd (KillMode=control-group) and a terminal's Ctrl-C signal every process of the
group; an operator may signal the broker's own PID. Each way must end in one graceful
shutdown (drain, final log sync, the "stopped" line) and exit 0; a second Ctrl-C pressed
while the broker drains ends it at once with 130 (128 + SIGINT), as documented in
docs/OPERATIONS.md; Ctrl-C ends a one-shot command with its documented code. Runs the built
executable (tests/frozen.py builds it when needed).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from frozen import SLOW, Broker, Runner, executable, group_alive, runner, start_broker

from blipmq_cli.exits import Exit

pytestmark = pytest.mark.slow
__all__ = ["executable", "runner"]  # fixtures, used by name


def child_of(pid: int) -> int:
    """The one child of ``pid`` (the bootloader's broker), waiting for it to exist."""
    deadline = time.monotonic() + SLOW
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            (child,) = children
            return int(child)
        time.sleep(0.01)
    raise AssertionError(f"process {pid} has no child")


def wait_for_line(broker: Broker, text: str) -> None:
    deadline = time.monotonic() + SLOW
    while not any(text in line for line in broker.log):
        assert not broker.log_ended.is_set(), f"no {text!r} in:\n" + "\n".join(broker.log)
        assert time.monotonic() < deadline, f"no {text!r} after {SLOW} s"
        time.sleep(0.01)


def started(runner: Runner, tmp_path: Path, under: tuple[str, ...] = ()) -> Broker:
    config = tmp_path / "blipmq.toml"
    config.write_text("")  # the defaults
    return start_broker(runner, config, tmp_path / "data", under=under)


def stopped_once(broker: Broker, signame: str = "SIGTERM") -> str:
    """Waits for the exit; asserts it was one graceful shutdown with exit 0."""
    assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)
    assert broker.log_ended.wait(SLOW)
    log = "\n".join(broker.log)
    assert log.count(f"received {signame}") == 1, log  # the copy forwarded was not a second
    assert "second" not in log and "stopped" in log.splitlines()[-1], log
    assert not group_alive(broker.proc.pid)
    return log


def publish_qos1(runner: Runner, broker: Broker, payload: str) -> None:
    done = runner.run("pub", "--qos", "1", "orders", payload, "--addr", broker.addr)
    assert done.returncode == 0, done.stderr


def test_a_signal_to_the_bootloader_alone_drains_the_broker(
    runner: Runner, tmp_path: Path
) -> None:
    """supervisord, runit, start-stop-daemon: SIGTERM to the PID they started."""
    broker = started(runner, tmp_path)
    publish_qos1(runner, broker, "#1")
    os.kill(broker.proc.pid, signal.SIGTERM)
    stopped_once(broker)
    # what the broker confirmed is in the log it closed
    done = runner.run("wal", "cat", str(tmp_path / "data"), "--format", "lines")
    assert (done.returncode, done.stdout) == (0, b"#1\n"), done.stderr


def test_a_signal_to_the_process_group_is_one_shutdown(runner: Runner, tmp_path: Path) -> None:
    """systemd's KillMode=control-group: both processes get it, the broker twice."""
    broker = started(runner, tmp_path)
    publish_qos1(runner, broker, "#2")
    os.killpg(broker.proc.pid, signal.SIGTERM)
    stopped_once(broker)


def test_a_signal_to_the_broker_alone(runner: Runner, tmp_path: Path) -> None:
    broker = started(runner, tmp_path)
    os.kill(child_of(broker.proc.pid), signal.SIGTERM)
    stopped_once(broker)


def test_ctrl_c_twice_with_a_pause_exits_at_once(runner: Runner, tmp_path: Path) -> None:
    """The first Ctrl-C (SIGINT to the group) drains; one pressed again later, while the
    broker waits on a consumer that takes nothing, ends it at once with 130."""
    broker = started(runner, tmp_path)
    sub = runner.spawn("sub", "big", "-N", "--addr", broker.addr)
    broker.wait_metric("blipmq_subscriptions", 1)
    os.killpg(sub.pid, signal.SIGSTOP)  # a consumer that stopped reading
    line = b"x" * 3_000_000 + b"\n"  # 12 MB: more than the socket buffers between them
    done = runner.run("pub", "big", "-", "--lines", "--addr", broker.addr, input=line * 4)
    assert done.returncode == 0, done.stderr

    os.killpg(broker.proc.pid, signal.SIGINT)
    wait_for_line(broker, "draining 1 connection(s)")
    time.sleep(1.0)  # the pause: a person waiting for the drain, then pressing again
    os.killpg(broker.proc.pid, signal.SIGINT)
    assert broker.proc.wait(SLOW) == 128 + signal.SIGINT, "\n".join(broker.log)
    assert broker.log_ended.wait(SLOW)
    log = "\n".join(broker.log)
    assert log.count("received SIGINT") == 1 and "second SIGINT: exiting at once" in log, log
    assert "stopped" not in log  # it did not wait for the drain (5 s) to end
    os.killpg(sub.pid, signal.SIGKILL)


def test_ctrl_c_ends_a_one_shot_command_with_its_code(runner: Runner, tmp_path: Path) -> None:
    """``blipmq sub`` in a terminal: Ctrl-C reaches it twice (its own and the forwarded copy)
    and must still end it with 130 (Exit.INTERRUPTED), never by the signal. Three times:
    the forwarded copy may come while the command is already exiting."""
    broker = started(runner, tmp_path)
    for _ in range(3):
        sub = runner.spawn("sub", "t", "--addr", broker.addr)
        broker.wait_metric("blipmq_subscriptions", 1)
        os.killpg(sub.pid, signal.SIGINT)
        _out, err = sub.communicate(timeout=SLOW)
        assert sub.returncode == Exit.INTERRUPTED, err
        assert b"Traceback" not in err
        broker.wait_metric("blipmq_subscriptions", 0)
    os.kill(broker.proc.pid, signal.SIGTERM)
    stopped_once(broker)


def _pid_namespaces() -> str | None:
    """Why ``unshare --pid --fork`` cannot run here, or None when it can."""
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True,
                              timeout=SLOW)
    except FileNotFoundError:
        return "no unshare(1) here (util-linux)"
    if done.returncode:
        return f"unshare --pid --fork: {done.stderr.decode(errors='replace').strip()}"
    return None


def test_as_pid_1_of_a_container(runner: Runner, tmp_path: Path) -> None:
    """A Dockerfile's ``exec blipmq start``: the bootloader is PID 1 of a PID namespace,
    and ``docker stop`` signals it from outside. PID 1 gets only the signals it handles."""
    why = _pid_namespaces()
    if why:
        pytest.skip(why)
    broker = started(runner, tmp_path, under=("unshare", "--pid", "--fork"))
    init = child_of(broker.proc.pid)  # the bootloader: PID 1 inside
    status = Path(f"/proc/{init}/status").read_text()
    assert [ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")] == ["1"]
    os.kill(init, signal.SIGTERM)
    stopped_once(broker)


def _catches(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def _spawn_start(runner: Runner, tmp_path: Path, *under: str) -> Broker:
    config = tmp_path / "blipmq.toml"
    config.write_text("")
    proc = runner.spawn_program(
        *under, str(runner.binary), "start", "--config", str(config), "--data-dir",
        str(tmp_path / "data"), "--bind", "127.0.0.1:0", "--metrics-bind", "127.0.0.1:0",
        "--mqtt-bind", "off", "--log-format", "plain")
    broker = Broker(proc, [])

    def drain() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            broker.log.append(raw.decode(errors="replace").rstrip("\n"))
        broker.log_ended.set()

    threading.Thread(target=drain, daemon=True).start()
    return broker


def test_a_sighup_during_start_up_neither_kills_the_broker_nor_is_lost(
    runner: Runner, tmp_path: Path
) -> None:
    """h31 #3: `systemctl reload` right after a start (kill -HUP $MAINPID: the bootloader,
    which forwards it) killed the broker during its imports, exit 129 and no line. The
    broker catches SIGHUP before it reads its configuration; one after that reading is a
    reload once it listens."""
    broker = _spawn_start(runner, tmp_path)
    child = child_of(broker.proc.pid)
    deadline = time.monotonic() + SLOW
    while not _catches(child, signal.SIGHUP):
        assert time.monotonic() < deadline and broker.proc.poll() is None, broker.log
        time.sleep(0.001)
    assert not (tmp_path / "data" / "blipmq.lock").exists(), "caught only after the start"
    os.kill(broker.proc.pid, signal.SIGHUP)
    while not (tmp_path / "data" / "blipmq.lock").exists():
        assert time.monotonic() < deadline and broker.proc.poll() is None, broker.log
        time.sleep(0.001)
    os.kill(broker.proc.pid, signal.SIGHUP)  # after the configuration was read
    wait_for_line(broker, "listening on")
    wait_for_line(broker, "reloaded")
    assert broker.proc.poll() is None
    os.kill(broker.proc.pid, signal.SIGTERM)
    stopped_once(broker)


def test_started_with_sighup_ignored_even_the_unpacking_survives_one(
    runner: Runner, tmp_path: Path
) -> None:
    """What PyInstaller's bootloader leaves open (it installs its handlers only once it has
    started the broker, after unpacking), a SIGHUP ignored at exec closes: the bootloader
    and, inherited, the broker's interpreter ignore it until the broker takes it over."""
    broker = _spawn_start(runner, tmp_path, "env", "--ignore-signal=HUP")
    exe = str(runner.binary.resolve())
    deadline = time.monotonic() + SLOW  # env ignores SIGHUP, then becomes the executable:
    while os.path.realpath(f"/proc/{broker.proc.pid}/exe") != exe:  # a SIGHUP before that
        assert time.monotonic() < deadline, "env never ran the executable"  # ends env
        time.sleep(0.001)
    os.kill(broker.proc.pid, signal.SIGHUP)  # unpacking
    child_of(broker.proc.pid)
    os.kill(broker.proc.pid, signal.SIGHUP)  # forwarded to an interpreter starting up
    wait_for_line(broker, "listening on")
    assert broker.proc.poll() is None
    os.kill(broker.proc.pid, signal.SIGHUP)  # and a reload as usual once running
    wait_for_line(broker, "reloaded")
    os.kill(broker.proc.pid, signal.SIGTERM)
    stopped_once(broker)


def test_ready_comes_from_the_broker_not_the_bootloader(runner: Runner, tmp_path: Path) -> None:
    """Type=notify: READY=1 once listening. Its sender is the bootloader's child, not the
    main PID systemd knows, which is why the unit says NotifyAccess=all."""
    short = tempfile.mkdtemp(prefix="bq-", dir="/tmp")
    name = os.path.join(short, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(name)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(SLOW)
    try:
        config = tmp_path / "blipmq.toml"
        config.write_text("")
        broker = start_broker(runner, config, tmp_path / "data", env={"NOTIFY_SOCKET": name})
        creds = struct.calcsize("3i")
        data, ancillary, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(creds))
        assert data.startswith(b"READY=1\n"), data
        (level, kind, cred), = ancillary
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
        pid = struct.unpack("3i", cred[:creds])[0]
        assert pid == child_of(broker.proc.pid) != broker.proc.pid
        os.killpg(broker.proc.pid, signal.SIGTERM)
        stopped_once(broker)
    finally:
        sock.close()
        os.unlink(name)
        os.rmdir(short)
