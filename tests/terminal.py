"""Run a command with its stderr on a real pseudo-terminal, for progress bars."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time


def stderr_on_terminal(args: list[str], env: dict[str, str], timeout: float = 60
                       ) -> tuple[int, str]:
    """Run ``args`` with stderr on a pty (stdin and stdout on /dev/null); returns the exit
    status and everything drawn on the terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave, env={**env, "TERM": "xterm", "COLUMNS": "100"})
    os.close(slave)
    drawn = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(master)
    return proc.wait(timeout=30), drawn.decode(errors="replace")
