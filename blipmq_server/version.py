"""The package's version (the broker reports it in STATS, the CLI prints it), from one source.

In the frozen executable it is the build's own record, ``blipmq_build.json`` in the bundle
(packaging/buildinfo.py writes it from pyproject.toml at build time): the bundle holds no
package metadata of its own, so a build from a clean checkout would otherwise not know its
version. Anywhere else it is the installed distribution's metadata; a copy that was not
installed (a source tree on PYTHONPATH) says "unknown". ``blipmq --version``
(blipmq_cli/version.py) and a dump's manifest (blipmq_cli/dump.py) read it from here too.
Standard library only, imported when asked (the broker's start path stays without json).
"""

from __future__ import annotations

import os
import sys
from functools import cache

BUILD_INFO = "blipmq_build.json"


def frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def build_info() -> dict[str, object]:
    """The frozen executable's build facts (version, arch, glibc floor); OSError or
    ValueError when its bundle holds none that can be read."""
    import json

    with open(os.path.join(getattr(sys, "_MEIPASS", ""), BUILD_INFO)) as f:
        info = json.load(f)
    if not isinstance(info, dict):
        raise ValueError(f"{BUILD_INFO}: not an object")
    return info


@cache
def version() -> str:
    if frozen():
        try:
            return str(build_info()["version"])
        except (OSError, ValueError, KeyError):
            pass  # a bundle made otherwise: its metadata, if it carries any
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("blipmq")
    except PackageNotFoundError:
        return "unknown"
