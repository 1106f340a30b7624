"""packaging/install.sh, packaging/blipmq.service and packaging/blipmq-wrapper.

The installer runs for real, as root, into a throwaway root (DESTDIR under tmp_path with
its own etc/passwd), never into this machine's /etc. The unit it installs must pass
``systemd-analyze verify`` without a warning. Where a test needs this machine to look
otherwise (a noexec temp dir, a small RAM disk, a user blipmq of its own), it runs in a
private mount namespace (``unshare -m``), so nothing of the real system changes.
Upgrades and uninstalls under running processes: tests/test_dist_upgrade.py.
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
# one worker builds the executable (packaging/build.py) and runs these (make test's xdist)
pytestmark = pytest.mark.xdist_group("dist")


def throwaway_root(path: Path) -> Path:
    etc = path / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    return path


def install(root: Path, *args: str, env: dict[str, str] | None = None,
            under: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """install.sh ARGS with DESTDIR=root; ``under`` runs it under another program."""
    env = {**os.environ, "DESTDIR": str(root), **(env or {})}
    return subprocess.run([*under, "sh", str(INSTALL), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def private_mounts(*commands: str) -> tuple[str, ...]:
    """A prefix that runs a program in a mount namespace of its own after shell commands
    (mounts); skips the test where this machine allows no such namespace."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -m is not allowed here")
    return ("unshare", "-m", "sh", "-c", " && ".join(commands) + ' && exec "$@"', "mounts")


def user_ids(root: Path) -> tuple[int, int]:
    (user,) = blipmq_users(root)
    uid = int(user.split(":")[2])
    (gid,) = (int(g.split(":")[2]) for g in (root / "etc/group").read_text().splitlines()
              if g.startswith("blipmq:"))
    return uid, gid


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
    # the stable path is a link to the version's own file (tests/test_dist_upgrade.py)
    assert installed.is_symlink() and os.readlink(installed).startswith("blipmq-0.")
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


def _wrapper_env(env: dict[str, str], under: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment the wrapper hands to the executable (here /usr/bin/env, which prints it)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("TMPDIR", "XDG_RUNTIME_DIR", "BLIPMQ_TMPDIR_ORIG")}
    out = subprocess.run([*under, "sh", str(WRAPPER)], capture_output=True, text=True,
                         check=True, env={**base, "BLIPMQ_BINARY": "/usr/bin/env", **env}).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _wrapper_tmpdir(env: dict[str, str], under: tuple[str, ...] = ()) -> str | None:
    """The TMPDIR the wrapper hands to the executable."""
    return _wrapper_env(env, under).get("TMPDIR")


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


# --- the unit ---------------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    """packaging/blipmq.service: every setting's values, in order."""
    found: dict[str, list[str]] = {}
    for line in (TOP / "packaging" / "blipmq.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def _seconds(value: str) -> float:
    for suffix, factor in (("min", 60.0), ("ms", 0.001), ("s", 1.0)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def test_unit_does_not_restart_a_config_error_and_its_start_limit_can_trigger() -> None:
    unit = unit_settings()
    assert "2" in " ".join(unit["RestartPreventExitStatus"]).split()
    # any other failure within seconds of each start: burst+1 starts, RestartSec apart (plus
    # the ~0.2 s a start takes to fail), must fit in the interval or the limit never triggers
    restart = _seconds(unit["RestartSec"][-1])
    burst = int(unit["StartLimitBurst"][-1])
    interval = _seconds(unit["StartLimitIntervalSec"][-1])
    assert burst * (restart + 0.2) < interval


def test_unit_allows_more_open_files_than_connections() -> None:
    # systemd's default soft limit is 1024; server.max_connections is 1024 by default
    assert int(unit_settings()["LimitNOFILE"][-1]) >= 65536


def test_unit_unpacks_into_its_runtime_directory() -> None:
    # the service's /tmp (PrivateTmp: a directory of the host's /tmp) may be noexec
    unit = unit_settings()
    assert unit["ExecStart"][-1].startswith("/usr/local/lib/blipmq/blipmq start ")
    assert unit["RuntimeDirectory"] == ["blipmq"]
    assert "TMPDIR=/run/blipmq" in unit["Environment"]


@pytest.mark.slow
def test_a_config_error_exits_with_the_status_the_unit_does_not_restart(
    executable: Executable, tmp_path: Path
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nport = \"many\"\n")
    done = subprocess.run(
        [str(executable.path), "start", "--config", str(config), "--data-dir",
         str(tmp_path / "data")], capture_output=True, text=True, timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    prevented = " ".join(unit_settings()["RestartPreventExitStatus"]).split()
    assert str(done.returncode) in prevented, done.stderr


# --- the wrapper's choices ---------------------------------------------------------------------

@pytest.mark.skipif(not _exec_tmpfs("/dev/shm"), reason="/dev/shm is not an exec tmpfs here")
def test_wrapper_saves_the_callers_tmpdir_when_it_sets_one(tmp_path: Path) -> None:
    # `sub --exec` gives its commands the caller's TMPDIR back from BLIPMQ_TMPDIR_ORIG
    runtime = Path("/dev/shm") / f"blipmq-test-{os.getpid()}"
    runtime.mkdir()
    try:
        got = _wrapper_env({"XDG_RUNTIME_DIR": str(runtime), "BLIPMQ_TMPDIR_ORIG": "stale"})
        assert (got["TMPDIR"], got["BLIPMQ_TMPDIR_ORIG"]) == (str(runtime), "")
        got = _wrapper_env({"TMPDIR": str(tmp_path), "BLIPMQ_TMPDIR_ORIG": "stale"})
        assert got["TMPDIR"] == str(tmp_path) and "BLIPMQ_TMPDIR_ORIG" not in got
    finally:
        runtime.rmdir()


@needs_root
def test_wrapper_passes_over_a_ram_dir_without_room_for_the_bundle(tmp_path: Path) -> None:
    # /run/user/UID is 10% of RAM (about 51 MB on a Pi Zero 2 W): a few commands fill it.
    # The bundle needs twice the executable's size, at least 8 MiB (here /usr/bin/env's).
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    under = private_mounts(f"mount -t tmpfs -o size=4m tmpfs '{small}'",
                           f"mount -t tmpfs -o size=64m tmpfs '{large}'")
    assert _wrapper_tmpdir({"XDG_RUNTIME_DIR": str(large)}, under) == str(large)
    got = _wrapper_tmpdir({"XDG_RUNTIME_DIR": str(small)}, under)
    assert got != str(small)
    assert got == ("/dev/shm" if _exec_tmpfs("/dev/shm") else None)


# --- the installer's checks, ids, modes and paths -------------------------------------------


@pytest.mark.slow
@needs_root
def test_config_is_root_blipmq_0640_and_a_reinstall_fixes_one_readable_by_all(
    executable: Executable, tmp_path: Path
) -> None:
    # it may come to hold API keys in clear or a bridge's password (the template shows one)
    root = throwaway_root(tmp_path / "root")
    assert install(root, str(executable.path)).returncode == 0
    config = root / "etc/blipmq/blipmq.toml"
    _uid, gid = user_ids(root)
    st = config.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, 0o640)

    config.chmod(0o644)  # as installed before, or by hand
    os.chown(config, 0, 0)
    done = install(root, str(executable.path))
    assert done.returncode == 0, done.stderr
    assert "other users could read: made it root:blipmq 0640" in done.stderr
    st = config.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, 0o640)

    config.chmod(0o600)  # the operator's own choice, readable by nobody else: left alone
    assert install(root, str(executable.path)).returncode == 0
    assert config.stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
@needs_root
def test_install_refuses_what_is_not_a_blipmq_executable(
    executable: Executable, tmp_path: Path
) -> None:
    root = throwaway_root(tmp_path / "root")
    assert install(root, str(executable.path)).returncode == 0
    lib = root / "usr/local/lib/blipmq"
    before = sorted(p.name for p in lib.iterdir())
    wrapper_copy = tmp_path / "blipmq"  # `sudo sh install.sh $(command -v blipmq)`, copied
    shutil.copy(root / "usr/local/bin/blipmq", wrapper_copy)
    fake = tmp_path / "fake"  # a script that answers --version as the executable does
    fake.write_text("#!/bin/sh\necho 'blipmq 9.9.9 linux-x86_64 (onefile executable)'\n")
    fake.chmod(0o755)
    env = {"BLIPMQ_BINARY": str(lib / "blipmq")}  # the wrapper runs the installed executable
    for source in (wrapper_copy, root / "usr/local/bin/blipmq", lib / "blipmq",
                   lib / before[0], fake, Path("/bin/true")):
        done = install(root, str(source), env=env, timeout=30)
        assert done.returncode == 1, (source, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr
    assert sorted(p.name for p in lib.iterdir()) == before
    assert (lib / "blipmq").read_bytes() == executable.path.read_bytes()


@pytest.mark.slow
@needs_root
def test_install_works_with_a_noexec_temp_dir(executable: Executable, tmp_path: Path) -> None:
    # CIS-hardened hosts mount /tmp noexec; the executable unpacks there by default
    root = throwaway_root(tmp_path / "root")
    noexec = tmp_path / "noexec"
    noexec.mkdir()
    under = private_mounts(f"mount -t tmpfs -o noexec,size=64m tmpfs '{noexec}'")
    done = install(root, str(executable.path), env={"TMPDIR": str(noexec)}, under=under)
    assert done.returncode == 0, done.stderr
    assert (root / "etc/blipmq/blipmq.toml").exists()
    assert [p.name for p in (root / "usr/local/lib/blipmq").iterdir() if p.name[0] == "."] == []


@pytest.mark.slow
@needs_root
def test_a_destdir_with_spaces(executable: Executable, tmp_path: Path) -> None:
    # an SD card image mounted at "/media/me/SD card/rootfs"
    root = throwaway_root(tmp_path / "SD card" / "root fs")
    done = install(root, str(executable.path))
    assert done.returncode == 0, done.stderr
    assert len(blipmq_users(root)) == 1
    assert (root / "usr/local/lib/blipmq/blipmq").read_bytes() == executable.path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SD card"]  # nothing at "SD"
    done = install(root, "--uninstall", "--purge")
    assert done.returncode == 0, done.stderr
    assert not blipmq_users(root) and not (root / "var/lib/blipmq").exists()


@pytest.mark.slow
@needs_root
def test_a_destdir_install_gives_the_data_to_the_images_user(
    executable: Executable, tmp_path: Path
) -> None:
    # this machine has a user blipmq of its own (uid 4242): the image's files are not its
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text(Path("/etc/passwd").read_text()
                                 + "blipmq:x:4242:4242::/nonexistent:/usr/sbin/nologin\n")
    (host / "group").write_text(Path("/etc/group").read_text() + "blipmq:x:4242:\n")
    under = private_mounts(f"mount --bind '{host}/passwd' /etc/passwd",
                           f"mount --bind '{host}/group' /etc/group")
    root = throwaway_root(tmp_path / "root")
    done = install(root, str(executable.path), under=under)
    assert done.returncode == 0, done.stderr
    uid, gid = user_ids(root)
    assert uid != 4242
    data = (root / "var/lib/blipmq").stat()
    assert (data.st_uid, data.st_gid) == (uid, gid)
    assert (root / "etc/blipmq/blipmq.toml").stat().st_gid == gid


@pytest.mark.slow
@needs_root
def test_a_failed_step_exits_1(executable: Executable, tmp_path: Path) -> None:
    # the documented codes are 0, 1 and 2: a step's own code (useradd's 3, ...) becomes 1
    root = throwaway_root(tmp_path / "root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    useradd = bin_dir / "useradd"
    useradd.write_text("#!/bin/sh\necho 'useradd: cannot do that' >&2\nexit 3\n")
    useradd.chmod(0o755)
    done = install(root, str(executable.path), env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        "useradd: cannot do that", "install.sh: failed (a step exited with 3)"]
