"""The keyring's identities: each key's quota, its share of the broker-wide caps unless its
entry sets its own (docs/SECURITY.md, "Shares")."""

from __future__ import annotations

from blipmq_server.broker.access import FULL, UNLIMITED, Quota
from blipmq_server.config import AuthOptions, KeySpec
from blipmq_server.server.keys import Keyring

CAPS = Quota(100_000, 100_000, 10_000, 16 << 20)


def spec(name: str, n: int, **fields: object) -> KeySpec:
    return KeySpec(name, "blake2b:" + f"{n:02x}" * 64, **fields)  # type: ignore[arg-type]


def test_each_key_gets_its_share_or_its_own_limits() -> None:
    auth = AuthOptions(api_keys=("legacy",), keys=(
        spec("root", 1, admin=True), spec("hall", 2), spec("z2m", 3, max_retained_topics=8000),
        spec("cap", 4, admin=True, max_sessions=10), spec("none", 5, max_durable_groups=0)))
    names = Keyring(auth, caps=CAPS).names()
    quarter = Quota(25_000, 25_000, 2_500, 4 << 20)  # six owners: the api_keys keys count once
    assert names["hall"].quota == quarter
    assert names["z2m"].quota == quarter._replace(retained_topics=8000)
    assert names["none"].quota == quarter._replace(durable_groups=0)
    assert names["root"].quota == UNLIMITED  # an admin: the caps only
    assert names["cap"].quota == UNLIMITED._replace(sessions=10)
    assert names["*"] is FULL and FULL.quota == UNLIMITED


def test_the_only_key_has_the_whole_caps() -> None:
    """A gateway with one key for everything: nothing changes."""
    (only,) = Keyring(AuthOptions(keys=(spec("gw", 1),)), caps=CAPS).names().values()
    assert only.quota == CAPS
