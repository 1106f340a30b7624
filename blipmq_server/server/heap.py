"""Giving the C heap's free memory back to the system (glibc's ``malloc_trim``)."""

from __future__ import annotations


def trim() -> None:
    """Return the C heap's free pages to the system: glibc keeps what a burst freed (start-up's
    imports, a flood's batches) for later mallocs, so an idle broker would keep the peak's
    memory. Not glibc (musl): nothing to do. Safe in a worker thread (ctypes lets go of the
    GIL for the call)."""
    try:
        import ctypes  # loaded by trio already

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
