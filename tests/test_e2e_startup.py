"""`blipmq start` in its first moments, as a service manager or a careless script starts it:
standard descriptors closed, signals that come before the broker listens, the open-file
limit, and the readiness notification systemd waits for (Type=notify). Real broker
processes from the pip install; tests/test_supervisors.py does the same with the
executable where the bootloader matters."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import BLIPMQ, _default_signals


def _wait_for(check, timeout: float = 20, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.02)
    return got


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
