"""What the CLI hands the programs it starts (environment.py), and how ``--version`` names
the frozen form (version.py): both decided from what the PyInstaller bootloader and the
wrapper state in the environment. Pure functions, no executable needed."""

from __future__ import annotations

import sys

import pytest

from blipmq_cli import version
from blipmq_cli.environment import for_children

BUNDLE = {
    "_PYI_ARCHIVE_FILE": "/tmp/blipmq", "_PYI_PARENT_PROCESS_LEVEL": "0",
    "_PYI_APPLICATION_HOME_DIR": "/tmp/_MEIabc", "_PYI_LINUX_PROCESS_NAME": "blipmq",
    "_MEIPASS2": "/tmp/_MEIabc", "HOME": "/home/me", "PATH": "/usr/bin",
}


def test_the_bootloaders_library_path_is_dropped_or_the_users_restored() -> None:
    env = for_children({**BUNDLE, "LD_LIBRARY_PATH": "/tmp/_MEIabc"}, frozen=True)
    assert env == {"HOME": "/home/me", "PATH": "/usr/bin"}
    env = for_children({**BUNDLE, "LD_LIBRARY_PATH": "/tmp/_MEIabc:/opt/lib",
                        "LD_LIBRARY_PATH_ORIG": "/opt/lib"}, frozen=True)
    assert env == {"HOME": "/home/me", "PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"}


def test_a_pip_install_keeps_the_users_library_path() -> None:
    env = for_children({"LD_LIBRARY_PATH": "/opt/lib", "LD_LIBRARY_PATH_ORIG": "/x"},
                       frozen=False)
    assert env == {"LD_LIBRARY_PATH": "/opt/lib", "LD_LIBRARY_PATH_ORIG": "/x"}


@pytest.mark.parametrize(("orig", "tmpdir"), [("/home/me/tmp", "/home/me/tmp"), ("", None)])
def test_the_wrappers_tmpdir_is_undone(orig: str, tmpdir: str | None) -> None:
    env = for_children({"TMPDIR": "/run/user/1000", "BLIPMQ_TMPDIR_ORIG": orig},
                       frozen=True)
    assert env.get("TMPDIR") == tmpdir and "BLIPMQ_TMPDIR_ORIG" not in env
    # without the wrapper's note, TMPDIR is the user's own
    assert for_children({"TMPDIR": "/mine"}, frozen=True) == {"TMPDIR": "/mine"}


def _frozen(monkeypatch: pytest.MonkeyPatch, executable: str, meipass: str,
            env: dict[str, str]) -> str:
    monkeypatch.setattr(sys, "executable", executable)
    monkeypatch.setattr(sys, "_MEIPASS", meipass, raising=False)
    monkeypatch.delenv("_PYI_APPLICATION_HOME_DIR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return version._frozen_form()


def test_a_onefile_in_tmp_is_a_onefile(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """h31 #12: a onefile copied to /tmp unpacks below its own directory, and called itself
    "onedir"."""
    unpacked = tmp_path / "_MEIabc"
    unpacked.mkdir()
    exe = str(tmp_path / "blipmq")
    assert _frozen(monkeypatch, exe, str(unpacked),
                   {"_PYI_APPLICATION_HOME_DIR": str(unpacked)}) == "onefile"


def test_onedir_and_onefile_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    home = tmp_path / "blipmq-0.1.0"
    (home / "_internal").mkdir(parents=True)
    exe = str(home / "blipmq")
    assert _frozen(monkeypatch, exe, str(home / "_internal"), {}) == "onedir"
    # a onedir started from a onefile's job that leaked the variable is still a onedir
    assert _frozen(monkeypatch, exe, str(home / "_internal"),
                   {"_PYI_APPLICATION_HOME_DIR": "/tmp/_MEIzzz"}) == "onedir"
    assert _frozen(monkeypatch, "/usr/local/lib/blipmq/blipmq", "/tmp/_MEIabc",
                   {"_PYI_APPLICATION_HOME_DIR": "/tmp/_MEIabc"}) == "onefile"
