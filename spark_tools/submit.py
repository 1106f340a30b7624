"""``blipmq export --print-submit``: a ``spark-submit`` line for the same export on YARN or
Kubernetes.

BlipMQ's pure-Python packages are shipped with ``--py-files`` in one zip, written next to
the current directory (``blipmq-spark.zip``); the driver runs ``spark_tools/entry.py``,
which is ``blipmq export`` without ``--master`` (so the submitter's master applies). The
executors' Python still needs the compiled dependencies (``crc32c``, ``pyarrow``): install
``blipmq[spark]`` there, or ship a packed environment with ``--archives`` and point
``spark.pyspark.python`` at it (docs/ANALYTICS.md).
"""

from __future__ import annotations

import os
import shlex
import zipfile

PACKAGES = ("blipmq_server", "blipmq_cli", "spark_tools", "pyspark_blipmq_wal")


def build_zip(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for package in PACKAGES:
            for folder, _, files in os.walk(os.path.join(root, package)):
                for name in files:
                    if name.endswith(".py"):
                        full = os.path.join(folder, name)
                        z.write(full, os.path.relpath(full, root))
    return os.path.abspath(path)


def line(dumps: list[str], output: str, settings: list[tuple[str, str]],
         report: str | None) -> str:
    archive = build_zip("blipmq-spark.zip")
    entry = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry.py")
    args = ["spark-submit", "--master", "yarn", "--deploy-mode", "client",
            "--py-files", archive]
    for key, value in settings:
        args += ["--conf", f"{key}={value}"]
    args += [entry, *[os.path.abspath(d) if "://" not in d else d for d in dumps],
             "--output", output]
    if report:
        args += ["--report", report]
    return shlex.join(args)
