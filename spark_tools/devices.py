"""Which device each log is, and the inputs of one export as distinct devices.

A device is its dump's ``device_id`` (the manifest's), else the name of the directory
holding the log. Every export writes by device, so an input set where two logs are one
device, or one log comes twice, would merge or double records: it is refused (WalError,
exit 2 from ``blipmq export``), as is a device id that cannot name a partition (empty, not
text, control characters). Standard library and ``wal.reader`` only: ``blipmq export``
checks its inputs with it before Spark starts.
"""

from __future__ import annotations

import json
import os

from blipmq_server.errors import WalError
from blipmq_server.wal import reader


def device_of(log: reader.LogFiles) -> str:
    """The manifest's ``device_id`` of a dump, else the directory holding the log."""
    if log.dump:
        try:
            with open(os.path.join(log.root, reader.MANIFEST), encoding="utf-8") as f:
                found = json.load(f)
        except (OSError, ValueError):
            found = None
        if isinstance(found, dict) and "device_id" in found:
            device = found["device_id"]
            if (why := reader.device_problem(device)) is not None:
                raise WalError(f"{log.root}: the manifest's device_id {why}: give the dump a "
                               "device id (blipmq wal dump --device-id ID)")
            return str(device)
    root = os.path.abspath(log.root)
    if os.path.isfile(root):  # a lone segment: name it after its directory's owner
        root = os.path.dirname(root)
        if os.path.basename(root) == reader.WAL_DIR:
            root = os.path.dirname(root)
    return os.path.basename(root.rstrip("/")) or "unknown"


def logs(paths: list[str]) -> list[tuple[str, reader.LogFiles]]:
    """Every log under ``paths`` with its device, in order. Raises WalError when a path holds
    no log, when one log comes twice (the same files through two paths), or when two logs
    name the same device."""
    out: list[tuple[str, reader.LogFiles]] = []
    seen_files: dict[str, str] = {}  # a segment's real path -> the input it came from
    seen_devices: dict[str, str] = {}  # a device -> the log root naming it
    for path in paths:
        for log in reader.find_logs(path):
            for seg in log.segments:
                real = os.path.realpath(seg)
                if real in seen_files:
                    raise WalError(f"{log.root}: the same log as {seen_files[real]} (given "
                                   "twice); give each log once")
                seen_files[real] = log.root
            if not log.segments:  # no segment yet: known by its directory
                real = os.path.realpath(log.root)
                if real in seen_files:
                    raise WalError(f"{log.root}: given twice; give each log once")
                seen_files[real] = log.root
            device = device_of(log)
            if device in seen_devices:
                raise WalError(f"{log.root} and {seen_devices[device]}: two logs of device "
                               f"{device!r}; export each device once (or name them apart: "
                               "blipmq wal dump --device-id ID)")
            seen_devices[device] = log.root
            out.append((device, log))
    return out
