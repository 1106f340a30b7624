"""The segmented write-ahead log (docs/WAL.md): records, segments, recovery, retention.

Standard library plus ``crc32c``; never imports trio, the broker or the protocol layer's
I/O. The record codec here is the one the broker writes and every reader decodes.
"""
