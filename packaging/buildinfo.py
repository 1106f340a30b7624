"""Facts about one build of the executable, written at build time for ``blipmq --version``.

Imported by ``packaging/blipmq.spec`` inside the build venv (never by blipmq itself): it
reads the glibc symbol versions that the bundled ELF files require, with ``objdump -p``
(binutils, which PyInstaller needs on Linux anyway), and writes ``blipmq_build.json``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections.abc import Iterable

_NEED = re.compile(r"\bGLIBC_(\d+)\.(\d+)(?:\.(\d+))?\b")


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def glibc_needs(path: str) -> tuple[int, ...]:
    """The highest GLIBC_x.y version that one ELF file asks its loader for, or ()."""
    out = subprocess.run(
        ["objdump", "-p", path], check=True, capture_output=True, text=True
    ).stdout
    refs = out.partition("Version References:")[2]
    found = [tuple(int(p) for p in m.groups() if p is not None) for m in _NEED.finditer(refs)]
    return max(found, default=())


def glibc_floor(paths: Iterable[str]) -> str:
    """The oldest glibc every one of these files can load with, as "2.34"."""
    best: tuple[int, ...] = ()
    for path in paths:
        if is_elf(path):
            best = max(best, glibc_needs(path))
    if not best:
        raise RuntimeError("no bundled ELF file names a glibc version; is objdump working?")
    return ".".join(str(p) for p in best)


def machine() -> str:
    """The architecture as the artefacts name it (x86_64, aarch64)."""
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


def write(path: str, *, version: str, floor: str) -> dict[str, str]:
    info = {
        "version": version,
        "arch": machine(),
        "glibc_floor": floor,
        "built_on_glibc": platform.libc_ver()[1] or "unknown",
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    return info
