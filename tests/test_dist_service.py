"""packaging/install.sh, packaging/blipmq.service and packaging/blipmq-wrapper.

The installer runs for real, as root, into a throwaway root (DESTDIR under tmp_path with
its own etc/passwd), never into this machine's /etc. The unit it installs must pass
``systemd-analyze verify`` without a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from frozen import TOP, Executable, executable

__all__ = ["executable"]  # a fixture, used by name

INSTALL = TOP / "packaging" / "install.sh"
WRAPPER = TOP / "packaging" / "blipmq-wrapper"
UNIT = "etc/systemd/system/blipmq.service"
WANTS = "etc/systemd/system/multi-user.target.wants/blipmq.service"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="install.sh creates a user: root only")


def throwaway_root(path: Path) -> Path:
    etc = path / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    return path


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DESTDIR": str(root)}
    return subprocess.run(["sh", str(INSTALL), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def blipmq_users(root: Path) -> list[str]:
    return [u for u in (root / "etc/passwd").read_text().splitlines() if u.startswith("blipmq:")]


@pytest.mark.slow
@needs_root
def test_install_twice_then_uninstall_then_purge(executable: Executable, tmp_path: Path) -> None:
    root = throwaway_root(tmp_path / "root")
    done = install(root, str(executable.path))
    assert done.returncode == 0, done.stderr
    config = root / "etc/blipmq/blipmq.toml"
    assert "[server]" in config.read_text()
    config.write_text(config.read_text() + "# edited by the operator\n")

    done = install(root, str(executable.path))  # an upgrade: same steps, nothing duplicated
    assert done.returncode == 0, done.stderr
    assert config.read_text().endswith("# edited by the operator\n")
    assert len(blipmq_users(root)) == 1
    installed = root / "usr/local/lib/blipmq/blipmq"
    assert installed.read_bytes() == executable.path.read_bytes()
    assert os.readlink(root / WANTS) == "/" + UNIT
    data = root / "var/lib/blipmq"
    uid, gid = (int(f) for f in blipmq_users(root)[0].split(":")[2:4])
    assert (data.stat().st_uid, data.stat().st_gid, data.stat().st_mode & 0o777) == (
        uid, gid, 0o750)
    run = subprocess.run([str(root / "usr/local/bin/blipmq"), "--version"], capture_output=True,
                         text=True, env={**os.environ, "BLIPMQ_BINARY": str(installed)})
    assert run.returncode == 0 and run.stdout.startswith("blipmq "), run.stderr

    for _ in range(2):  # uninstalling twice is fine too
        done = install(root, "--uninstall")
        assert done.returncode == 0, done.stderr
        for gone in (UNIT, WANTS, "usr/local/bin/blipmq", "usr/local/lib/blipmq"):
            assert not (root / gone).exists() and not (root / gone).is_symlink(), gone
        assert config.exists() and data.is_dir() and blipmq_users(root)

    done = install(root, "--uninstall", "--purge")
    assert done.returncode == 0, done.stderr
    assert not config.exists() and not data.exists() and not blipmq_users(root)


@needs_root
def test_install_refuses_bad_usage_in_one_line(tmp_path: Path) -> None:
    root = throwaway_root(tmp_path / "root")
    for args, code in ((("--bogus",), 2), ((), 2), ((str(tmp_path / "missing"),), 1),
                       (("--uninstall", "--everything"), 2)):
        done = install(root, *args)
        assert done.returncode == code, (args, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr
    assert not (root / "usr").exists()


@pytest.mark.slow
@needs_root
@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze missing (Debian package systemd; scripts/test-deps)")
def test_installed_unit_passes_systemd_analyze_verify(
    executable: Executable, tmp_path: Path
) -> None:
    root = throwaway_root(tmp_path / "root")
    assert install(root, str(executable.path)).returncode == 0
    # verify checks that ExecStart exists on this machine: point it at the throwaway root
    text = (root / UNIT).read_text()
    assert "ExecStart=/usr/local/lib/blipmq/blipmq start " in text
    unit = tmp_path / "blipmq.service"
    unit.write_text(text.replace("/usr/local/lib/blipmq/", f"{root}/usr/local/lib/blipmq/"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def _wrapper_tmpdir(env: dict[str, str]) -> str | None:
    """The TMPDIR the wrapper hands to the executable (here /usr/bin/env, which prints it)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "XDG_RUNTIME_DIR")}
    out = subprocess.run(["sh", str(WRAPPER)], capture_output=True, text=True, check=True,
                         env={**base, "BLIPMQ_BINARY": "/usr/bin/env", **env}).stdout
    found = [line.split("=", 1)[1] for line in out.splitlines() if line.startswith("TMPDIR=")]
    return found[0] if found else None


def _exec_tmpfs(path: str) -> bool:
    best, fs, opts = "", "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, mnt, kind, options = line.split()[:4]
        if (path + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
            best, fs, opts = mnt, kind, options
    return fs == "tmpfs" and "noexec" not in opts.split(",")


def test_wrapper_keeps_a_tmpdir_already_set(tmp_path: Path) -> None:
    assert _wrapper_tmpdir({"TMPDIR": str(tmp_path)}) == str(tmp_path)


@pytest.mark.skipif(not _exec_tmpfs("/dev/shm"), reason="/dev/shm is not an exec tmpfs here")
def test_wrapper_prefers_ram(tmp_path: Path) -> None:
    runtime = Path("/dev/shm") / f"blipmq-test-{os.getpid()}"
    runtime.mkdir()
    try:
        assert _wrapper_tmpdir({"XDG_RUNTIME_DIR": str(runtime)}) == str(runtime)
        # a runtime dir on disk is passed over for /dev/shm
        on_disk = _exec_tmpfs(str(tmp_path))
        assert _wrapper_tmpdir({"XDG_RUNTIME_DIR": str(tmp_path)}) == (
            str(tmp_path) if on_disk else "/dev/shm")
    finally:
        runtime.rmdir()


def test_wrapper_leaves_tmpdir_alone_without_ram(tmp_path: Path) -> None:
    if _exec_tmpfs(str(tmp_path)):
        pytest.skip("tmp_path is itself on an exec tmpfs")
    missing = tmp_path / "missing"
    # nothing usable named: the executable falls back to its own default (/tmp)
    env = {"XDG_RUNTIME_DIR": str(missing)}
    got = _wrapper_tmpdir(env)
    assert got in (None, "/dev/shm")
    assert got == ("/dev/shm" if _exec_tmpfs("/dev/shm") else None)
