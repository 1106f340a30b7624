"""Where ``blipmq export`` writes, checked before Spark starts: ``--output`` must be a
directory it can write (or one it can create), ``--report`` a file it can write. Spark
would find out only after decoding everything, with a Java message. Standard library only;
local paths only (a URL is the cluster's business).
"""

from __future__ import annotations

import os


def _creatable(path: str) -> str | None:
    """Why ``path`` (which does not exist) cannot be created (None: it can)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def output_problem(output: str) -> str | None:
    """Why ``--output`` cannot take the export (None: it can)."""
    if "://" in output and not output.startswith("file://"):
        return None
    output = output.removeprefix("file://")
    if os.path.exists(output):
        if not os.path.isdir(output):
            return f"--output {output}: exists and is not a directory"
        if not os.access(output, os.W_OK | os.X_OK):
            return f"--output {output}: not writable (permissions or a read-only filesystem)"
        return None
    why = _creatable(output)
    return None if why is None else f"--output {output}: cannot be created ({why})"


def report_problem(report: str) -> str | None:
    """Why ``--report`` cannot be written (None: it can)."""
    if os.path.isdir(report):
        return f"--report {report}: is a directory; give a file name"
    if os.path.exists(report):
        if not os.access(report, os.W_OK):
            return f"--report {report}: not writable"
        return None
    parent = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(parent):
        return f"--report {report}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--report {report}: {parent} is not writable"
    return None
