"""blipmq_server/version.py: one version for ``--version``, ``blipmq version``, STATS and dumps.

A frozen executable built from a clean checkout carries no package metadata for blipmq, only
the build's record ``blipmq_build.json`` in its bundle; what it reports must come from there.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from blipmq_cli import dump
from blipmq_cli import version as cli_version
from blipmq_server import version as server_version

INFO = {"version": "7.8.9", "arch": "x86_64", "glibc_floor": "2.28", "built_on_glibc": "2.36"}


@pytest.fixture
def frozen_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As in the executable: sys.frozen, sys._MEIPASS with the build's record, and no
    distribution metadata for blipmq."""
    (tmp_path / "blipmq_build.json").write_text(json.dumps(INFO))
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    monkeypatch.delenv("_PYI_APPLICATION_HOME_DIR", raising=False)

    def no_metadata(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", no_metadata)
    server_version.version.cache_clear()
    yield tmp_path
    server_version.version.cache_clear()


def test_frozen_version_is_the_builds_not_unknown(frozen_bundle: Path) -> None:
    assert server_version.version() == "7.8.9"


def test_every_report_of_the_version_says_the_same_when_frozen(frozen_bundle: Path) -> None:
    assert dump.blipmq_version() == "7.8.9"
    assert cli_version.describe().startswith("blipmq 7.8.9 linux-x86_64 (")


def test_frozen_without_a_build_record_falls_back_to_unknown(frozen_bundle: Path) -> None:
    (frozen_bundle / "blipmq_build.json").unlink()
    assert server_version.version() == "unknown"


def test_a_source_tree_uses_the_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "version", lambda name: "1.2.3")
    server_version.version.cache_clear()
    try:
        assert server_version.version() == "1.2.3"
    finally:
        server_version.version.cache_clear()
