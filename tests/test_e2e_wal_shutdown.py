"""SIGTERM under QoS 1 load while redelivery is active: bench/shutdown.py's trials (real
broker, real publishers and a never-acking durable-group subscriber) must all exit 0, with
no traceback and every confirmed message in the log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "shutdown.py"
TRIALS = 10  # bench/shutdown.py runs 50 by default


@pytest.mark.slow
def test_sigterm_under_qos1_load_with_redelivery_exits_cleanly(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--trials", str(TRIALS)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert f"{TRIALS} of {TRIALS} trials exited cleanly" in res.stdout
