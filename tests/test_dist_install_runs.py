"""packaging/install.sh runs that overlap, are killed, or lose their stderr.

Two runs on one root at once must not interleave (each removed the other's new file, and one
said "installed" while the link pointed at nothing): one holds $LIB/.lock at a time, the
other waits for it, or exits 3 after BLIPMQ_INSTALL_WAIT seconds. A run killed while its
executable unpacks leaves a .unpack.* directory (as large as the bundle): the next run removes
it. A run whose stderr reader went away finishes its work. Into throwaway roots (DESTDIR), as
tests/test_dist_service.py does; every wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from frozen import Executable, executable
from test_dist_service import INSTALL, install, needs_root, throwaway_root
from test_dist_upgrade import other_version, versions

# one worker builds the executable (packaging/build.py) and runs these (make test's xdist)
pytestmark = [pytest.mark.slow, needs_root, pytest.mark.xdist_group("dist")]
__all__ = ["executable"]  # a fixture, used by name

LIB = "usr/local/lib/blipmq"


def start_install(root: Path, *args: str, env: dict[str, str] | None = None,
                  stderr: int = subprocess.PIPE) -> subprocess.Popen[str]:
    """install.sh in a session of its own (killed with its children by process group)."""
    return subprocess.Popen(
        ["sh", str(INSTALL), *args], env={**os.environ, "DESTDIR": str(root), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)


def hidden(lib: Path) -> list[str]:
    return sorted(p.name for p in lib.iterdir() if p.name.startswith("."))


def assert_runs(link: Path, tmp_path: Path) -> None:
    assert link.is_symlink() and link.exists(), f"{link} -> {os.readlink(link)}: dangling"
    done = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.startswith("blipmq "), done.stderr


def test_parallel_installs_take_turns(executable: Executable, tmp_path: Path) -> None:
    # the old installer's interleavings show within a few rounds of four; each round takes
    # about as long as four installs one after another
    others = [other_version(executable, tmp_path, n) for n in (1, 2, 3, 4)]
    for round_ in range(6):
        root = throwaway_root(tmp_path / f"root{round_}")
        assert install(root, str(executable.path)).returncode == 0
        runs = [start_install(root, str(o)) for o in others]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]  # type: ignore[union-attr]
        for rc, err in results:
            assert rc == 0, err
        lib = root / LIB
        link = lib / "blipmq"
        assert_runs(link, tmp_path)
        # the last run's version and the one before it, nothing else, nothing temporary
        assert os.readlink(link) in versions(lib) and len(versions(lib)) == 2, versions(lib)
        assert hidden(lib) == []
        assert any(f"as /{LIB}/{os.readlink(link)}\n" in err for _rc, err in results)


def test_a_run_waits_for_the_lock_or_exits_3(executable: Executable, tmp_path: Path) -> None:
    root = throwaway_root(tmp_path / "root")
    assert install(root, str(executable.path)).returncode == 0
    lib = root / LIB
    before = {p.name: os.readlink(p) if p.is_symlink() else p.stat().st_size
              for p in lib.iterdir()}
    other = other_version(executable, tmp_path, 1)
    with open(lib / ".lock", "a") as held:  # another run holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        done = install(root, str(other), env={"BLIPMQ_INSTALL_WAIT": "1"}, timeout=60)
        assert done.returncode == 3, done.stderr
        assert time.monotonic() - started < 30
        assert done.stderr.count("\n") == 1 and "another install.sh" in done.stderr, done.stderr
        assert {p.name for p in lib.iterdir()} == set(before) | {".lock"}
        assert os.readlink(lib / "blipmq") == before["blipmq"]

        waiting = start_install(root, str(other))  # the default: it waits
        time.sleep(1.5)
        assert waiting.poll() is None
        assert os.readlink(lib / "blipmq") == before["blipmq"]
        fcntl.flock(held, fcntl.LOCK_UN)
        assert waiting.wait(timeout=120) == 0, waiting.stderr.read()  # type: ignore[union-attr]
    assert os.readlink(lib / "blipmq") != before["blipmq"]
    assert_runs(lib / "blipmq", tmp_path)
    assert hidden(lib) == []


def test_what_a_killed_run_left_is_removed_by_the_next(
    executable: Executable, tmp_path: Path
) -> None:
    root = throwaway_root(tmp_path / "root")
    assert install(root, str(executable.path)).returncode == 0
    lib = root / LIB
    run = start_install(root, str(other_version(executable, tmp_path, 1)))
    deadline = time.monotonic() + 60
    # killed while the new executable unpacks for its --version
    while not any(d.is_dir() and any(d.iterdir()) for d in lib.glob(".unpack.*")):
        assert run.poll() is None and time.monotonic() < deadline, "no .unpack.* seen"
        time.sleep(0.005)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    assert [p for p in hidden(lib) if p.startswith(".unpack.")], hidden(lib)  # left behind

    done = install(root, str(other_version(executable, tmp_path, 2)))
    assert done.returncode == 0, done.stderr
    assert hidden(lib) == []
    assert_runs(lib / "blipmq", tmp_path)


def test_a_run_whose_stderr_closes_finishes(executable: Executable, tmp_path: Path) -> None:
    # `sudo sh install.sh X 2>&1 | head -1`, or a terminal gone: the first message no one
    # reads must not end the run between switching the link and its clean-up
    root = throwaway_root(tmp_path / "root")
    run = start_install(root, str(executable.path))
    assert run.stderr is not None
    run.stderr.close()
    assert run.wait(timeout=120) == 0
    lib = root / LIB
    assert hidden(lib) == []
    assert_runs(lib / "blipmq", tmp_path)
    for path in ("usr/local/bin/blipmq", "etc/blipmq/blipmq.toml",
                 "etc/systemd/system/blipmq.service"):
        assert (root / path).is_file(), path
