"""Store and forward to an upstream broker: what a ``[[bridge]]`` table says (``spec``) and
the pure decisions of a link (``plan``: topic mapping, backoff, the in-flight window).
Standard library only; the shell that moves bytes is ``blipmq_server.server.bridge``."""
