"""`sub --exec` and the ways a run ends: its stdout reader goes away (`| head`), `-W` runs
out while a command runs, SIGINT or SIGTERM. The run ends as documented, the commands end
with it (none is left behind), and no message is nacked or dead-lettered for it. Real
broker, real CLI, real pipes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from blipmq_cli.exits import Exit


def _wait_for(check, timeout: float = 20, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.02)
    return got


def _alive(pids: list[int]) -> bool:
    """Whether any of ``pids`` still runs (a zombie that init has not reaped yet counts;
    callers wait a little)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return True
    return False


def _pids(path: Path) -> list[int]:
    """The shell's pid and its child's, as the command wrote them."""
    return [int(p) for p in path.read_text().split()]


def test_exec_into_head_ends_with_its_reader_and_dead_letters_nothing(start_broker) -> None:
    """D06: `sub --exec CMD | head -n 2` never ended; each later command died of SIGPIPE
    and was nacked until 18 of 20 were dead-lettered."""
    b = start_broker({"delivery": {"max_retries": 2}})
    assert b.shell("seq 1 20 | blipmq pub jobs -l -q 1").returncode == 0
    began = time.monotonic()
    res = b.shell("blipmq sub jobs --group g -q 1 --from earliest --exec 'cat; echo' "
                  "| head -n 2", timeout=30)
    assert (res.returncode, res.stderr) == (0, b""), res.stderr
    assert res.stdout.split() == [b"1", b"2"]
    assert time.monotonic() - began < 10
    dead = b.cli("sub", "$dlq/jobs", "--from", "earliest", "-e", "--format", "json")
    assert (dead.returncode, dead.stdout) == (0, b""), dead.stderr
    # what was not handled is still the group's to take: every job, none lost (once the
    # broker has seen the --exec consumer go: until then what it held is its own)
    b.wait_metric("blipmq_subscriptions", 0)
    rest = b.cli("sub", "jobs", "--group", "g", "-q", "1", "-e")
    assert rest.returncode == 0, rest.stderr
    assert set(rest.stdout.split()) | {b"1", b"2"} == {str(i).encode() for i in range(1, 21)}


def test_timeout_bounds_an_exec_run_and_ends_its_command(start_broker, tmp_path: Path) -> None:
    """D07: `-W 2s --exec 'sleep 12'` took 12 s; now -W bounds the run: the command is
    ended with its process group and its message comes again, unacked and not nacked."""
    b = start_broker()
    assert b.cli("pub", "ex", "payload", "-q", "1").returncode == 0
    pidfile = tmp_path / "pid"
    began = time.monotonic()
    res = b.cli("sub", "ex", "--group", "g", "-q", "1", "--from", "earliest", "-C", "1",
                "-W", "2s", "--exec", f"sleep 12 & echo $$ $! > {pidfile}; wait")
    took = time.monotonic() - began
    assert res.returncode == Exit.TIMEOUT, res.stderr
    assert res.stderr.count(b"\n") == 1 and b"ended 1 command" in res.stderr, res.stderr
    assert took < 6, took
    pids = _pids(pidfile)  # the shell and its sleep are gone
    _wait_for(lambda: not _alive(pids), timeout=5, what="the command to end")
    again = b.cli("sub", "ex", "--group", "g", "-q", "1", "-C", "1", "-W", "10s")
    assert (again.returncode, again.stdout) == (0, b"payload\n"), again.stderr
    dead = b.cli("sub", "$dlq/ex", "--from", "earliest", "-e")
    assert dead.stdout == b""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, Exit.INTERRUPTED),
                                           (signal.SIGTERM, -signal.SIGTERM)])
def test_a_signal_to_sub_ends_its_running_command(start_broker, tmp_path: Path,
                                                  sig: int, code: int) -> None:
    """D07: SIGINT or SIGTERM sent to the sub's pid (kill, timeout, a supervisor) left
    `/bin/sh -c CMD` and its children running."""
    b = start_broker()
    assert b.cli("pub", "ex", "payload", "-q", "1").returncode == 0
    pidfile = tmp_path / "pid"
    sub = b.spawn("sub", "ex", "--from", "earliest", "-q", "1", "-C", "1", "--exec",
                  f"sleep 1000 & echo $$ $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait")
    _wait_for(pidfile.exists, what="the command to start")
    pids = _pids(pidfile)
    try:
        sub.send_signal(sig)
        sub.communicate(timeout=10)
        assert sub.returncode == code
        _wait_for(lambda: not _alive(pids), timeout=5, what="the command to end")
    finally:  # nothing left behind when it fails
        sub.kill()
        sub.wait()
        for pid in pids:
            if _alive([pid]):
                os.kill(pid, signal.SIGKILL)


def test_exec_commands_get_the_users_environment_not_the_bundles(start_broker) -> None:
    """h31 #5: a job inherited the onefile bootloader's variables (_PYI_*, which make a
    onefile `blipmq` in the job take itself for the bundle's child) and the wrapper's TMPDIR
    in RAM. (LD_LIBRARY_PATH is the bootloader's only in the frozen executable: the pip
    install leaves it alone; tests/test_cli_environment.py and test_dist_smoke.py.)"""
    b = start_broker()
    assert b.cli("pub", "jobs", "one", "-q", "1").returncode == 0
    res = b.cli("sub", "jobs", "--from", "earliest", "--count", "1", "--exec", "env",
                _PYI_ARCHIVE_FILE="/tmp/_MEIabc/blipmq", _PYI_PARENT_PROCESS_LEVEL="0",
                _PYI_APPLICATION_HOME_DIR="/tmp/_MEIabc", _MEIPASS2="/tmp/_MEIabc",
                TMPDIR="/dev/shm", BLIPMQ_TMPDIR_ORIG="/home/me/tmp",
                LD_LIBRARY_PATH="/opt/mine")
    assert res.returncode == 0, res.stderr
    env = dict(line.split("=", 1) for line in res.stdout.decode().splitlines() if "=" in line)
    assert not [k for k in env if k.startswith(("_PYI_", "_MEIPASS"))], env
    assert env["TMPDIR"] == "/home/me/tmp"
    assert "BLIPMQ_TMPDIR_ORIG" not in env
    assert env["LD_LIBRARY_PATH"] == "/opt/mine"
    assert env["BLIPMQ_TOPIC"] == "jobs"
    # the wrapper had found no TMPDIR: the job has none either
    res = b.cli("sub", "jobs", "--from", "earliest", "--count", "1", "--exec", "env",
                TMPDIR="/dev/shm", BLIPMQ_TMPDIR_ORIG="")
    assert res.returncode == 0, res.stderr
    names = {line.split("=", 1)[0] for line in res.stdout.decode().splitlines()}
    assert "TMPDIR" not in names and "BLIPMQ_TMPDIR_ORIG" not in names
