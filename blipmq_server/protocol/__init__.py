"""Sans-IO wire protocol shared by the broker and the clients (see docs/PROTOCOL.md).

Bytes in, frames out; frames in, bytes out. Standard library only: never imports trio,
sockets, the broker or the log.
"""
