"""The environment a program started by the CLI gets: the user's, not the bundle's.

The onefile executable runs with an environment its bootloader and the RAM-unpacking wrapper
(packaging/blipmq-wrapper) changed for the bundle's own sake:

- ``LD_LIBRARY_PATH`` names the unpacked bundle first: every dynamically linked program a
  ``sub --exec`` job runs would load the bundle's libpython, libssl, ... (a python3 of
  another build fails on an undefined symbol). PyInstaller keeps the user's value in
  ``LD_LIBRARY_PATH_ORIG`` when there was one;
- ``_PYI_*`` (and the older ``_MEIPASS2``) tell a PyInstaller executable it is the child of
  a bootloader that already unpacked it: a onefile started with them (``blipmq`` from an
  ``--exec`` job, a benchmark's broker) would use the unpacked directory of another
  process, which goes away with it;
- the wrapper points ``TMPDIR`` at RAM for the unpacking, and keeps the user's value in
  ``BLIPMQ_TMPDIR_ORIG`` (empty: ``TMPDIR`` was not set).

``for_children`` undoes that. Imports only the standard library.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

_BUNDLE_PREFIXES = ("_PYI_", "_MEIPASS")
TMPDIR_ORIG = "BLIPMQ_TMPDIR_ORIG"  # set by packaging/blipmq-wrapper when it sets TMPDIR


def for_children(environ: Mapping[str, str], frozen: bool | None = None) -> dict[str, str]:
    """``environ`` as the user had it before the bundle ran: what a child process gets.
    ``frozen`` (default: whether this process is the frozen executable) says whether
    ``LD_LIBRARY_PATH`` is the bootloader's; a pip install leaves it alone."""
    if frozen is None:
        frozen = bool(getattr(sys, "frozen", False))
    env = {k: v for k, v in environ.items() if not k.startswith(_BUNDLE_PREFIXES)}
    if frozen:
        original = env.pop("LD_LIBRARY_PATH_ORIG", None)
        if original is None:
            env.pop("LD_LIBRARY_PATH", None)
        else:
            env["LD_LIBRARY_PATH"] = original
    if TMPDIR_ORIG in env:
        tmpdir = env.pop(TMPDIR_ORIG)
        if tmpdir:
            env["TMPDIR"] = tmpdir
        else:
            env.pop("TMPDIR", None)
    return env
