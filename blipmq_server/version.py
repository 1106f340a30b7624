"""The package's version, as installed (the broker reports it in STATS, the CLI prints it).

Read from the installed distribution's metadata once; a copy that was not installed (a
source tree on PYTHONPATH) says "unknown". Standard library only.
"""

from __future__ import annotations

from functools import cache


@cache
def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("blipmq")
    except PackageNotFoundError:
        return "unknown"
