"""Upgrades and uninstalls by packaging/install.sh while the installed executable runs.

A onefile executable reopens its own file, by its real path, for every module it imports
late (json for ``stats`` and ``sub --format json``, ssl, ...): a file replaced under it breaks
those imports, a file removed kills it. The installer must therefore never change the file
of a running process: each version has its own file and the stable path is a link.

"Another version" is ``$BLIPMQ_DIST_SECOND`` when set (a second build, e.g. with the version
bumped), else a copy of the executable with bytes appended: a different file with a different
digest, which PyInstaller runs as it runs the original (the archive is found from the end of
its ELF part). What this checks either way is that the running process's file keeps its
bytes; with a real second build a replaced file also breaks ``stats`` (zlib.error).
Into a throwaway root (DESTDIR), as tests/test_dist_service.py does.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from frozen import SLOW, Executable, Runner, executable, group_alive, start_broker
from test_dist_service import install, needs_root, throwaway_root

# one worker builds the executable (packaging/build.py) and runs these (make test's xdist)
pytestmark = [pytest.mark.slow, needs_root, pytest.mark.xdist_group("dist")]
__all__ = ["executable"]  # a fixture, used by name


def other_version(executable: Executable, tmp_path: Path, n: int) -> Path:
    given = os.environ.get("BLIPMQ_DIST_SECOND")
    if given and n == 1:
        return Path(given)
    path = tmp_path / f"blipmq-other-{n}"
    path.write_bytes(executable.path.read_bytes() + f"\0another version {n}\n".encode())
    path.chmod(0o755)
    return path


def archive_of(pid: int) -> Path:
    """The file the broker (the bootloader's child) reads its modules from."""
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    (path,) = (e.split(b"=", 1)[1] for e in env if e.startswith(b"_PYI_ARCHIVE_FILE="))
    return Path(path.decode())


def versions(lib: Path) -> set[str]:
    return {p.name for p in lib.iterdir() if p.name.startswith("blipmq-")}


def test_upgrades_and_uninstalls_leave_running_processes_their_file(
    executable: Executable, tmp_path: Path
) -> None:
    root = throwaway_root(tmp_path / "root")
    done = install(root, str(executable.path))
    assert done.returncode == 0, done.stderr
    lib = root / "usr/local/lib/blipmq"
    stable = lib / "blipmq"
    first = stable.resolve()
    unpack = tmp_path / "unpack"
    unpack.mkdir()
    runner = Runner(stable, unpack)  # run as the unit and the wrapper do: by the stable path
    try:
        config = tmp_path / "blipmq.toml"
        assert runner.run("config", "init", str(config)).returncode == 0
        broker = start_broker(runner, config, tmp_path / "data")
        env = {"BLIPMQ_ADDR": broker.addr}
        # a client of the old version that imports json only when its first message comes
        sub = runner.spawn("sub", "t", "--count", "1", "--format", "json", env=env)
        broker.wait_metric("blipmq_subscriptions", 1)
        original = archive_of(broker.proc.pid)

        done = install(root, str(other_version(executable, tmp_path, 1)))
        assert done.returncode == 0, done.stderr
        # the old broker's file is untouched, and it still serves what it imports late
        assert original.read_bytes() == executable.path.read_bytes()
        second = stable.resolve()
        assert second != first and versions(lib) == {first.name, second.name}
        done = runner.run("stats", "--json", env=env)  # the new version asks the old broker
        assert done.returncode == 0, done.stderr + "\n".join(broker.log).encode()
        assert runner.run("pub", "t", "after the upgrade", env=env).returncode == 0
        out, err = sub.communicate(timeout=SLOW)
        assert sub.returncode == 0 and b'"after the upgrade"' in out, err

        # a third version: the first is older than the previous one, but the broker runs it
        done = install(root, str(other_version(executable, tmp_path, 2)))
        assert done.returncode == 0, done.stderr
        third = stable.resolve()
        assert versions(lib) == {first.name, second.name, third.name}
        assert f"kept /usr/local/lib/blipmq/{first.name}: still run by process(es)" in done.stderr
        assert str(broker.proc.pid) in done.stderr

        os.killpg(broker.proc.pid, signal.SIGTERM)
        assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)
        assert not group_alive(broker.proc.pid)
        done = install(root, str(other_version(executable, tmp_path, 3)))
        assert done.returncode == 0, done.stderr
        fourth = stable.resolve()
        assert versions(lib) == {third.name, fourth.name}  # this one and the previous one

        # an uninstall keeps the file of a process still running it, and says so
        config2 = tmp_path / "other.toml"
        assert runner.run("config", "init", str(config2)).returncode == 0
        broker = start_broker(runner, config2, tmp_path / "data2")
        done = install(root, "--uninstall")
        assert done.returncode == 0, done.stderr
        assert f"kept /usr/local/lib/blipmq/{fourth.name}: still run by" in done.stderr
        assert versions(lib) == {fourth.name} and not stable.is_symlink()
        assert runner.run_program(str(lib / fourth.name), "stats", "--addr", broker.addr
                                  ).returncode == 0
        os.killpg(broker.proc.pid, signal.SIGTERM)
        assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)
        done = install(root, "--uninstall")
        assert done.returncode == 0, done.stderr
        assert not lib.exists()
    finally:
        runner.end_all()


def test_an_upgrade_from_the_single_file_layout_keeps_the_old_file(
    executable: Executable, tmp_path: Path
) -> None:
    # installed by an install.sh from before versioned files: /usr/local/lib/blipmq/blipmq
    root = throwaway_root(tmp_path / "root")
    lib = root / "usr/local/lib/blipmq"
    lib.mkdir(parents=True)
    old = lib / "blipmq"
    old.write_bytes(executable.path.read_bytes())
    old.chmod(0o755)
    done = install(root, str(other_version(executable, tmp_path, 1)))
    assert done.returncode == 0, done.stderr
    assert old.is_symlink()
    kept = [p for p in lib.iterdir() if p.name.startswith("blipmq-old-")]
    assert len(kept) == 1 and kept[0].read_bytes() == executable.path.read_bytes()
    assert subprocess.run([str(old), "--version"], capture_output=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)}).returncode == 0
