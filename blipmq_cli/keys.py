"""``blipmq keys new``: a random key and the ``[[auth.keys]]`` stanza that names it.

The key is 32 random bytes (``secrets``), written once; the stanza holds only its
BLAKE2b-512 digest, the form the broker keeps (blipmq_server/broker/access.py), which
``printf %s "$KEY" | b2sum`` computes too.
"""

from __future__ import annotations

import json
import secrets

from blipmq_server.broker.access import digest
from blipmq_server.protocol.names import WIRE_TOPIC_BYTES, filter_problem


def problem(name: str, publish: list[str], subscribe: list[str]) -> str | None:
    """Why these arguments cannot make a key, or None."""
    if not name.strip():
        return "the key needs a name"
    if name == "*":
        return "the name '*' is the identity of auth.api_keys (full access): choose another"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8
        return "the key's name is not UTF-8 text (the config file could not hold it)"
    for f in [*publish, *subscribe]:
        found = filter_problem(f, WIRE_TOPIC_BYTES)
        if found:
            return found
    return None


def mint(name: str, publish: list[str], subscribe: list[str], admin: bool) -> str:
    key = "bmq_" + secrets.token_urlsafe(32)
    lines = [
        key,
        "",
        "# the key above is shown once; the broker keeps only its hash:",
        "[[auth.keys]]",
        f"name = {json.dumps(name)}",
        f"hash = \"blake2b:{digest(key.encode('utf-8')).hex()}\"",
        f"publish = {json.dumps(publish)}",
        f"subscribe = {json.dumps(subscribe)}",
        f"admin = {'true' if admin else 'false'}",
    ]
    return "\n".join(lines) + "\n"
