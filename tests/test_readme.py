"""README's shell examples, run as they are against a real broker, so the docs cannot drift.

Every fenced block whose info string is ``sh example`` runs in bash (``-e -o pipefail``) in
a fresh directory against a fresh broker, and what it prints must equal the ``text`` block
that follows it. Processes an example sends to the background (``sub -b`` says its pid)
must be gone when it ends. Run the examples many times with
``BLIPMQ_README_RUNS=20 pytest tests/test_readme.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```\n", re.M | re.S)
_PID = re.compile(rb"in the background \(pid (\d+)\)")


def examples() -> list[tuple[str, str]]:
    """(script, expected output) of each runnable example, in README order."""
    blocks = [(m.group("info").strip(), m.group("body")) for m in _BLOCK.finditer(
        README.read_text())]
    out = []
    for i, (info, body) in enumerate(blocks):
        if info != "sh example":
            continue
        if i + 1 == len(blocks) or blocks[i + 1][0] != "text":
            raise AssertionError(f"README example {body.splitlines()[0]!r} has no text block "
                                 "after it with its output")
        out.append((body, blocks[i + 1][1]))
    return out


_EXAMPLES = examples()
_RUNS = int(os.environ.get("BLIPMQ_README_RUNS", "1"))


def test_the_readme_has_runnable_examples() -> None:
    assert len(_EXAMPLES) >= 5


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("script,expected", _EXAMPLES,
                         ids=[s.splitlines()[0][2:40] for s, _ in _EXAMPLES])
def test_readme_example(start_broker, tmp_path: Path, script: str, expected: str) -> None:
    for run in range(_RUNS):
        where = tmp_path / f"run{run}"
        where.mkdir()
        b = start_broker(data_dir=where / "data")
        proc = b.spawn_shell(f"cd {where} && set -e\n{script}")
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = []
        for pid in map(int, _PID.findall(err)):
            deadline = time.monotonic() + 10
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)  # ours: started by this example
                left.append(pid)
        b.stop()
        assert (proc.returncode, out.decode()) == (0, expected), (run, err.decode())
        assert not left, f"background processes outlived the example: {left}"
