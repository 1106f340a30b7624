"""`blipmq start` in its first moments, as a service manager or a careless script starts it:
standard descriptors closed, signals that come before the broker listens, the open-file
limit, and the readiness notification systemd waits for (Type=notify). Real broker
processes from the pip install; tests/test_supervisors.py does the same with the
executable where the bootloader matters."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BLIPMQ, _default_signals

from blipmq_server.errors import ConfigError
from tests.test_e2e_exec_lifecycle import _wait_for


def _config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "blipmq.toml"
    path.write_text('[server]\nhost = "127.0.0.1"\nport = 0\n[metrics]\nenabled = false\n'
                    f"[mqtt]\nenabled = false\n{extra}")
    return path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}


def test_a_config_error_with_stderr_closed_still_exits_2(tmp_path: Path) -> None:
    """h31 #13: `start --config bad.toml 2>&-` exited 1 (writing the error line to a
    closed stderr raised) where a configuration error is 2."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "x"\n')
    done = subprocess.run(
        ["/bin/sh", "-c", f'exec "{BLIPMQ}" start --config "{bad}" --data-dir '
         f'"{tmp_path / "data"}" 2>&-'], capture_output=True, timeout=30, env=_env())
    assert done.returncode == 2, done
    # the client commands too: bad usage is 2, whatever stderr is
    done = subprocess.run(["/bin/sh", "-c", f'exec "{BLIPMQ}" pub --no-such-flag 2>&-'],
                          capture_output=True, timeout=30, env=_env())
    assert done.returncode == 2, done


def test_closed_standard_descriptors_get_dev_null_not_the_lock_file(tmp_path: Path) -> None:
    """h31 #13: started with fds 1 and 2 closed, the broker's fd 2 became blipmq.lock and
    fd 1 the data directory (every log line written into the lock file)."""
    data = tmp_path / "data"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f'exec "{BLIPMQ}" start --config "{_config(tmp_path)}" '
         f'--data-dir "{data}" --log-format plain <&- >&- 2>&-'],
        env=_env(), preexec_fn=_default_signals)
    try:
        lock = data / "blipmq.lock"
        _wait_for(lambda: lock.exists() and lock.read_text().strip() == str(proc.pid),
                  what="the broker's lock")
        time.sleep(0.3)  # listening by now: the log has been written to fd 2 if anywhere
        for fd in (0, 1, 2):
            assert os.readlink(f"/proc/{proc.pid}/fd/{fd}") == "/dev/null"
        assert lock.read_text().strip() == str(proc.pid)  # no log line in it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _limited(nofile: tuple[int, int] | None) -> None:
    """In the child: SIGINT to its default, and the open-file limit (soft, hard)."""
    _default_signals()
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)


class _Broker:
    """``blipmq start`` with its log collected, on a free port."""

    def __init__(self, tmp_path: Path, extra: str = "", nofile: tuple[int, int] | None = None,
                 **env: str) -> None:
        self.data = tmp_path / "data"
        self.lock = self.data / "blipmq.lock"
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [BLIPMQ, "start", "--config", str(_config(tmp_path, extra)), "--data-dir",
             str(self.data), "--log-format", "plain"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**_env(), **env}, preexec_fn=lambda: _limited(nofile))
        import threading

        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.log.append(raw.decode(errors="replace").rstrip("\n"))

    def said(self, text: str) -> str | None:
        return next((line for line in self.log if text in line), None)

    def locked(self) -> bool:
        """The configuration was read and the data directory taken (the next steps import
        the server and start it)."""
        try:
            return self.lock.read_text().strip() == str(self.proc.pid)
        except OSError:
            return False

    def catches(self, signum: int) -> bool:
        with open(f"/proc/{self.proc.pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)

    def end(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_sighup_is_caught_before_the_configuration_is_read(tmp_path: Path) -> None:
    """h31 #3: until trio ran, SIGHUP killed the broker (exit 129, no line) and SIGTERM too;
    `systemctl reload` right after a start hit that. Now SIGHUP is held from the first
    thing main() does, before the heavy imports and the configuration."""
    b = _Broker(tmp_path)
    try:
        _wait_for(lambda: b.proc.poll() is not None or b.catches(signal.SIGHUP),
                  what="SIGHUP caught")
        assert not b.locked(), "SIGHUP was first caught after the configuration was read"
        b.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: b.proc.poll() is not None or b.said("listening on"),
                  what="listening")
        assert b.proc.poll() is None, "\n".join(b.log)
    finally:
        assert b.end() == 0, "\n".join(b.log)


def test_a_sighup_after_the_configuration_was_read_is_a_reload_once_listening(
    tmp_path: Path,
) -> None:
    """The file may have changed after the start read it: the SIGHUP is not dropped (it was
    ignored, or killed the broker during its imports), it reloads once the broker listens."""
    b = _Broker(tmp_path)
    try:
        _wait_for(lambda: b.proc.poll() is not None or b.locked(), timeout=20,
                  what="the data directory taken")
        b.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: b.proc.poll() is not None or b.said("reloaded"), what="a reload")
        assert b.proc.poll() is None, "\n".join(b.log)
        assert b.said("received SIGHUP during start-up"), "\n".join(b.log)
        listening, reloaded = b.said("listening on"), b.said("reloaded")
        assert listening and reloaded
        assert b.log.index(listening) < b.log.index(reloaded)
    finally:
        assert b.end() == 0, "\n".join(b.log)


def test_a_sigterm_during_start_up_is_a_clean_stop(tmp_path: Path) -> None:
    """SIGTERM during the imports killed the broker by the signal (no line); now it is
    held and the broker stops cleanly, exit 0, saying so."""
    b = _Broker(tmp_path)
    _wait_for(lambda: b.proc.poll() is not None or b.locked(), what="the data directory taken")
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(20) == 0, "\n".join(b.log)
    time.sleep(0.1)  # the last lines
    assert b.said("received SIGTERM during start-up"), "\n".join(b.log)
    # and before the data directory was taken: not started at all
    (tmp_path / "c").mkdir()
    c = _Broker(tmp_path / "c")
    _wait_for(lambda: c.proc.poll() is not None or c.catches(signal.SIGTERM),
              what="SIGTERM caught")
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(20) == 0, "\n".join(c.log)
    time.sleep(0.1)
    assert c.said("SIGTERM during start-up"), "\n".join(c.log)


def _notes(sock, until: str, timeout: float = 20) -> list[str]:  # type: ignore[no-untyped-def]
    """The notes received until one holding ``until``."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(until in note for note in got):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        got.append(sock.recv(4096).decode())
    return got


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_hears_ready_once_the_broker_listens(tmp_path: Path, abstract: bool) -> None:
    """Type=notify: READY=1 on $NOTIFY_SOCKET once the broker listens (not before: a
    `systemctl reload` waits for it), RELOADING=1/READY=1 around a reload, STOPPING=1."""
    import socket
    import tempfile

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    short = tempfile.mkdtemp(prefix="bq-", dir="/tmp")  # sun_path holds 107 bytes
    name = f"@blipmq-test-{os.getpid()}" if abstract else os.path.join(short, "notify")
    sock.bind("\0" + name[1:] if abstract else name)
    b = _Broker(tmp_path, NOTIFY_SOCKET=name)
    try:
        ready = _notes(sock, "READY=1")
        assert ready[-1].splitlines()[0] == "READY=1"
        listening = _wait_for(lambda: b.said("listening on"), what="the listening line")
        port = int(listening.split("listening on 127.0.0.1:")[1].split(";")[0])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # was listening
        assert f"STATUS=listening on 127.0.0.1:{port}" in ready[-1]
        b.proc.send_signal(signal.SIGHUP)
        reload = _notes(sock, "READY=1")
        assert reload[0].startswith("RELOADING=1\nMONOTONIC_USEC="), reload
        b.proc.send_signal(signal.SIGTERM)
        assert _notes(sock, "STOPPING=1")[-1] == "STOPPING=1"
        assert b.proc.wait(20) == 0
    finally:
        b.end()
        sock.close()
        if not abstract:
            os.unlink(name)
        os.rmdir(short)


def test_no_reload_note_after_stopping_and_a_fifo_is_refused_without_waiting(
        tmp_path: Path) -> None:
    """h32: a SIGHUP right after a SIGTERM sent RELOADING=1 and READY=1 after STOPPING=1
    (systemd would take the stopping broker for ready again); now a SIGHUP while shutting
    down is not a reload. And a reload's read of a FIFO renamed into the file's place after
    a check of the path could hang its thread for good: the opened descriptor is checked."""
    import socket
    import tempfile

    from blipmq_server import config

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        config.load(fifo, env={}, regular=True)  # no writer: must not wait for one
    assert time.monotonic() - started < 5
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    short = tempfile.mkdtemp(prefix="bq-", dir="/tmp")
    name = os.path.join(short, "notify")
    sock.bind(name)
    b = _Broker(tmp_path, NOTIFY_SOCKET=name)
    try:
        _notes(sock, "READY=1")
        b.proc.send_signal(signal.SIGTERM)
        b.proc.send_signal(signal.SIGHUP)
        assert b.proc.wait(20) == 0
        after: list[str] = []
        sock.settimeout(0.5)
        try:
            while True:  # bounded: the broker is gone, the queue runs dry
                after.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        stopping = [i for i, note in enumerate(after) if note.startswith("STOPPING=1")]
        assert stopping, after
        assert not [n for n in after[stopping[0]:] if "READY=1" in n or "RELOADING" in n], after
    finally:
        b.end()
        sock.close()
        os.unlink(name)
        os.rmdir(short)


def test_a_long_start_asks_systemd_for_more_time() -> None:
    """Type=notify: a start longer than TimeoutStartSec (a large log recovering on an SD
    card) would be killed and restarted forever; until READY=1 the broker asks for more."""
    import socket
    import tempfile

    from blipmq_server import notify

    short = tempfile.mkdtemp(prefix="bq-", dir="/tmp")
    name = os.path.join(short, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(name)
    old = os.environ.get("NOTIFY_SOCKET")
    os.environ["NOTIFY_SOCKET"] = name
    try:
        starting = notify.Starting(every_s=0.05, by_s=30)
        sock.settimeout(5)
        assert sock.recv(4096).decode().startswith("EXTEND_TIMEOUT_USEC=30000000\n")
        starting.end()
        time.sleep(0.2)
        sock.settimeout(0)
        while True:  # what was in flight
            try:
                sock.recv(4096)
            except BlockingIOError:
                break
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
        assert notify.address({"NOTIFY_SOCKET": "@x"}) == "\0x"
        assert notify.address({"NOTIFY_SOCKET": "vsock:2:9"}) is None
        assert not notify.send("READY=1", environ={})
    finally:
        if old is None:
            os.environ.pop("NOTIFY_SOCKET", None)
        else:
            os.environ["NOTIFY_SOCKET"] = old
        sock.close()
        os.unlink(name)
        os.rmdir(short)


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def _listening_port(b: _Broker) -> int:
    line = _wait_for(lambda: b.proc.poll() is not None or b.said("listening on"),
                     what="listening")
    assert b.proc.poll() is None, "\n".join(b.log)
    return int(line.split("listening on 127.0.0.1:")[1].split(";")[0].split(",")[0])


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    """h31 #2: the broker kept systemd's default soft limit (1024) below the default
    server.max_connections plus its log's descriptors."""
    b = _Broker(tmp_path, nofile=(256, 4096))
    try:
        _listening_port(b)
        assert _limits(b.proc.pid) == (4096, 4096)
        assert not b.said("WARNING"), "\n".join(b.log)
    finally:
        assert b.end() == 0, "\n".join(b.log)


def test_a_hard_limit_too_low_serves_fewer_connections_and_the_log_keeps_writing(
    tmp_path: Path,
) -> None:
    """h31 #2 (r_nofile_wal2.sh): with the open-file limit below max_connections, idle
    clients took every descriptor and the next log segment could not be opened: "Too many
    open files; 200 record(s) not stored", the QoS 1 publisher exit 9. Now the broker serves
    fewer connections, says so once at start, and refuses the rest."""
    b = _Broker(tmp_path, extra="[wal]\nsegment_bytes = 8192\n", nofile=(256, 256))
    held: list[socket.socket] = []
    try:
        port = _listening_port(b)
        warning = b.said("server.max_connections = 1024 lowered to")
        assert warning and "open-file limit is 256" in warning, "\n".join(b.log)
        served = int(warning.split("lowered to ")[1].split(":")[0])
        assert 50 < served < 256 - 64
        pub = subprocess.Popen(
            [BLIPMQ, "pub", "--addr", f"127.0.0.1:{port}", "-q", "1", "-l", "t"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_env(), preexec_fn=_default_signals)
        assert pub.stdin is not None
        pub.stdin.write(b"first\n")
        pub.stdin.flush()
        time.sleep(0.5)  # connected
        for _ in range(256):  # every descriptor the broker has, and more
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        time.sleep(1)
        line = b"x" * 90
        pub.stdin.write(b"".join(b"%d-%s\n" % (i, line) for i in range(200)))
        pub.stdin.close()
        assert pub.wait(60) is not None and pub.stderr is not None
        err = pub.stderr.read()
        assert pub.returncode == 0, (err, "\n".join(b.log[-10:]))
        assert not b.said("write-ahead log write failed"), "\n".join(b.log)
        ended = 0
        for s in held:  # those past the limit were not left to a handshake timeout: told
            s.settimeout(0.01)  # (ERROR), or closed to make room for a newer one (EOF)
            try:
                s.recv(64)
                ended += 1
            except OSError:
                pass
        assert ended >= len(held) - served
    finally:
        for s in held:
            s.close()
        assert b.end() == 0, "\n".join(b.log)


def test_a_signal_after_the_start_ended_does_not_change_its_exit_code(tmp_path: Path) -> None:
    """The onefile's bootloader forwards its copy of a signal to the group, and it can come
    after the start has ended (a configuration error, a stop during start-up, a clean
    shutdown): Python's exit puts the default action back in place of the handlers `start`
    installs, so the copy turned exit 2 (or 0) into death by SIGTERM (-15 from the
    executable in test_dist_smoke.py's TLS test)."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "x"\n')
    script = (
        "import os, signal, sys\n"
        "from blipmq_cli.main import main\n"
        f"code = main(['start', '--config', {str(bad)!r}])\n"
        "for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
        "    os.kill(os.getpid(), signum)\n"
        "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30,
                          env=_env(), preexec_fn=_default_signals)
    assert done.returncode == 2, done
