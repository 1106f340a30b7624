"""fsync policies: when a group commit also forces the data to stable storage.

    always          every batch is fsynced before its QoS 1 publishes are confirmed
    every_n:N       fsync once N records have been written since the last fsync
    interval_ms:M   fsync at most every M ms, and within M ms of the last unsynced write
    none            never fsync (the OS writes back when it likes; shutdown still syncs)

What each can lose on power failure is in docs/OPERATIONS.md. Pure; no clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    kind: str  # always | every_n | interval_ms | none
    value: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}" if self.kind in ("every_n", "interval_ms") else self.kind

    @property
    def confirms_after_fsync(self) -> bool:
        """Whether a QoS 1 confirm waits for fsync (else for the write to the OS)."""
        return self.kind == "always"

    def sync_now(self, unsynced_records: int, ms_since_sync: int) -> bool:
        """Should the batch being written now also be fsynced?"""
        if self.kind == "always":
            return True
        if self.kind == "every_n":
            return unsynced_records >= self.value
        if self.kind == "interval_ms":
            return ms_since_sync >= self.value
        return False


def parse(text: str) -> FsyncPolicy | str:
    """The policy, or a one-line problem."""
    name, sep, arg = text.strip().partition(":")
    if name in ("always", "none") and not sep:
        return FsyncPolicy(name)
    if name in ("every_n", "interval_ms") and sep:
        if arg.isdigit() and int(arg) >= 1:
            return FsyncPolicy(name, int(arg))
        return f"{name} needs a positive whole number after ':', got {arg!r}"
    return f"{text!r} is not one of always, every_n:N, interval_ms:M, none"
