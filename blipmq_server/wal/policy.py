"""fsync policies: when a group commit also syncs the log (fsyncs what it has written).

    always          a batch holding a record a QoS 1 publisher waits on is synced before the
                    publisher is confirmed; so is every batch after a segment rotation; other
                    writes (QoS 0, group and ack records) within ``unconfirmed_sync_ms``
    every_n:N       sync once N records have been written since the last sync
    interval_ms:M   sync at most every M ms, and within M ms of the last unsynced write
    none            never sync (the OS writes back when it likes; shutdown still syncs)

What each can lose on power failure is in docs/OPERATIONS.md. Pure; no clock.
"""

from __future__ import annotations

from typing import NamedTuple


class FsyncPolicy(NamedTuple):
    kind: str  # always | every_n | interval_ms | none
    value: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}" if self.kind in ("every_n", "interval_ms") else self.kind

    @property
    def confirms_after_fsync(self) -> bool:
        """Whether a QoS 1 confirm waits for fsync (else for the write to the OS)."""
        return self.kind == "always"

    def sync_now(
        self,
        unsynced_records: int,
        ms_since_sync: int,
        *,
        awaited: bool = True,
        ms_unsynced: int = 0,
        unconfirmed_sync_ms: int = 0,
    ) -> bool:
        """Should the batch being written now also be synced?

        ``unsynced_records``: written since the last sync, this batch included.
        For ``always``: ``awaited`` says whether a QoS 1 publisher waits on a record written
        and not synced yet, or the log rotated; ``ms_unsynced`` is how long the oldest write
        not synced yet has waited (0 if none did before this batch).
        """
        if self.kind == "always":
            return awaited or ms_unsynced >= unconfirmed_sync_ms
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
