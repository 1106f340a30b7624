"""Loopback ports for the benchmark scripts: a free one, and waiting until one listens.

Imported by the scripts beside it (``python bench/x.py`` puts this folder on sys.path), and by
the tests (tests/upstream.py), which set ``$BLIPMQ_PORT_BLOCK`` for each pytest-xdist worker.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time

BLOCK = "BLIPMQ_PORT_BLOCK"  # LOW-HIGH: free_port() takes its ports from there
_turn: list[int] = []  # the next port of the block to try, once the first was drawn


def free_port() -> int:
    """A loopback port that nothing is bound to now, for a server started next.

    By default the kernel's choice (a bind to port 0): an ephemeral port, which the kernel may
    give to anyone's bind to port 0 or outgoing connection once this returns. That is a rare
    race for one process, a real one for several test processes on one machine, so with
    ``$BLIPMQ_PORT_BLOCK=LOW-HIGH`` (conftest.py gives each worker its own block, below the
    ephemeral range, which the kernel never hands out) the ports come from that block in
    turn, from a random first one, each checked by a bind.
    """
    block = os.environ.get(BLOCK)
    if not block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    low, high = (int(end) for end in block.split("-"))
    size = high - low + 1
    if not _turn:
        _turn.append(random.randrange(size))
    for _ in range(size):
        port = low + _turn[0] % size
        _turn[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a closing socket counts too
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {BLOCK}={block}")


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
