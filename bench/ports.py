"""Loopback ports for the benchmark scripts: a free one, and waiting until one listens.

Imported by the scripts beside it (``python bench/x.py`` puts this folder on sys.path).
"""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 20) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` within ``timeout`` s;
    False at once should ``proc`` (the server being waited for) exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.01)
    return False
