"""The broker's keys: which identity a key offered by a client is, and what a refused key
costs its sender.

Keys are kept as BLAKE2b-512 digests (``[[auth.keys]]`` holds only the digest; the keys of
the older ``auth.api_keys`` list are hashed on load and their clear text is not kept), and a
key offered by a client is hashed and compared with every digest in constant time
(``hmac.compare_digest``), so neither the comparison nor the order of the keys tells a
guesser anything. A refused key is answered only after ``auth.failure_delay_ms`` (1 s by
default), and refusals are counted by reason and logged at most once per source address per
``hush.EVERY_S`` (that line says how many came since the last one), so a flood of bad keys
neither guesses fast nor floods the log. A refused metrics token (server/http.py) costs the
same.
"""

from __future__ import annotations

import hmac
import logging

import trio

from blipmq_server.broker.access import FULL, UNLIMITED, Access, Identity, Quota, digest, share
from blipmq_server.config import AuthOptions
from blipmq_server.server.hush import EVERY_S, Hush

log = logging.getLogger("blipmq.auth")


class Keyring:
    def __init__(self, auth: AuthOptions, hush: Hush | None = None,
                 caps: Quota = UNLIMITED) -> None:
        """``caps``: the broker-wide caps a key's default quota is a share of (``share``):
        a non-admin key's, unless its entry sets its own; an admin's (and the ``api_keys``
        keys') is none beyond the broker-wide caps."""
        # digest -> identity, the one rule both check and find follow (the configuration
        # refuses a key listed twice); the config hashed api_keys when it loaded them
        # ("blake2b:<hex>")
        identities: dict[bytes, Identity] = {}
        for k in auth.api_keys:
            identities.setdefault(bytes.fromhex(k.split(":", 1)[1]) if k.startswith("blake2b:")
                                  else digest(k.encode("utf-8")), FULL)
        shared = share(caps, len(auth.keys) + bool(auth.api_keys))
        for spec in auth.keys:
            base = UNLIMITED if spec.admin else shared
            quota = Quota(*(b if o is None else o
                            for b, o in zip(base, spec.limits, strict=True)))
            identities.setdefault(bytes.fromhex(spec.hash.split(":", 1)[1]), Identity(
                spec.name, spec.publish, spec.publish_deny, spec.subscribe,
                spec.subscribe_deny, spec.admin, quota))
        self.identities = identities
        self.enabled = bool(identities)
        self.delay_s = auth.failure_delay_ms / 1000  # before a refused key is answered
        self.failures: dict[str, int] = {}  # by reason
        # the refusals' log lines, per source and kind (a reload hands the last one on: the
        # lines of a flood do not start again with each reload)
        self.hush = hush or Hush()

    def check(self, given: bytes) -> tuple[bytes, Identity] | None:
        """(the key's digest, the identity it is); None for a refused key. Without keys,
        everyone is ``FULL`` (digest b"")."""
        if not self.enabled:
            return b"", FULL
        offered = digest(given)
        found = False
        for known in self.identities:  # every digest compared: no early exit
            found |= hmac.compare_digest(offered, known)
        # looked up only once it is known to be there: the lookup tells nothing new
        return (offered, self.identities[offered]) if found else None

    def named(self, name: str) -> tuple[bytes, Identity] | None:
        """The key called ``name`` (a client certificate's identity names it)."""
        for known, identity in self.identities.items():
            if identity is not FULL and identity.name == name:
                return known, identity
        return None

    def find(self, key_digest: bytes) -> Identity | None:
        """The identity of a key already accepted (after a reload: None if revoked). Without
        keys, a connection admitted without one (digest b"") is ``FULL``; one admitted with
        a key is revoked: the reload that removed the last key does not hand its
        connections full access."""
        if not self.enabled:
            return None if key_digest else FULL
        return self.identities.get(key_digest)

    def names(self) -> dict[str, Identity]:
        return {identity.name: identity for identity in self.identities.values()}

    def access_for(self, identity: Identity) -> Access | None:
        """What a session passes to the core: None while authentication is off (no limits,
        and what it makes belongs to nobody in particular). With authentication on, a full
        access key (``api_keys``) has an unlimited ``Access`` (the core's fast path too), so
        that the sessions and groups it makes belong to its identity (``*``)."""
        return Access(identity) if self.enabled else None

    async def refused(self, peer: str, reason: str, what: str = "a key") -> None:
        """Count and (rarely) log a refused key (``what``: a metrics token too), then make
        its sender wait. The first refusal from a source address is logged at once; the
        next line about it, ``hush.EVERY_S`` later at the soonest, says how many were
        counted in between."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        said = self.hush.due(peer, reason)  # a kind's flood does not hide another's
        if said is not None:
            source, unsaid = said
            log.warning("refused %s from %s (%s)%s; further refusals from there are "
                        "counted, not logged, for %d s (blipmq_auth_failures_total)",
                        what, source, reason,
                        f", and {unsaid} more since the last line" if unsaid else "",
                        EVERY_S)
        await trio.sleep(self.delay_s)
