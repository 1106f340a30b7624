"""What ``blipmq --version`` prints: the version, the architecture and the glibc it needs.

In the frozen executable these are the build's facts, written by packaging/buildinfo.py into
``blipmq_build.json`` inside the bundle and read through blipmq_server/version.py, the one
source of the version (``blipmq version`` and the broker's STATS say the same): the glibc
floor is the newest glibc symbol version any bundled library needs, so a device whose ``ldd
--version`` is at least that runs it. From a pip install it is the installed distribution's
version and the running system's glibc.
Imports only the standard library, and only when asked.
"""

from __future__ import annotations

import os
import platform
import sys


def _machine() -> str:
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


def _frozen_form() -> str:
    """``onefile`` (unpacked into a temporary directory) or ``onedir`` (an unpacked folder).

    Decided by what the bootloader states: a onefile parent tells its child where it
    unpacked the bundle in ``_PYI_APPLICATION_HOME_DIR``, which is then ``sys._MEIPASS``;
    a onedir executable is one process and runs from its ``_internal`` folder. (Whether
    the bundle lies below the executable's directory says nothing: a onefile copied to
    /tmp unpacks into /tmp/_MEI....)"""
    bundle = os.path.realpath(getattr(sys, "_MEIPASS", ""))
    unpacked = os.environ.get("_PYI_APPLICATION_HOME_DIR")
    if unpacked:
        return "onefile" if os.path.realpath(unpacked) == bundle else "onedir"
    home = os.path.dirname(os.path.realpath(sys.executable))
    return "onedir" if bundle in (home, os.path.join(home, "_internal")) else "onefile"


def describe() -> str:
    from blipmq_server.version import build_info, frozen, version

    if frozen():
        info = build_info()
        return (
            f"blipmq {info['version']} linux-{info['arch']} ({_frozen_form()} executable); "
            f"needs glibc >= {info['glibc_floor']} (built on glibc {info['built_on_glibc']})"
        )
    ours = version()
    if ours == "unknown":
        ours = "unknown (not installed)"
    libc, libc_version = platform.libc_ver()
    runtime = f"{libc} {libc_version}" if libc else "libc unknown"
    return (
        f"blipmq {ours} {sys.platform}-{_machine()} (Python {platform.python_version()}, "
        f"{runtime})"
    )
