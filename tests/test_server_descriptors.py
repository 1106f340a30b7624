"""descriptors.plan: the soft open-file limit raised, max_connections lowered to fit."""

from __future__ import annotations

from blipmq_server.config import Config
from blipmq_server.descriptors import CEILING, plan, reserve


def test_the_soft_limit_goes_up_to_the_hard_one_never_down() -> None:
    assert plan(1024, 524288, 1024, 150) == (524288, 1024, "")
    assert plan(4096, 2048, 1024, 150).soft == 4096  # a soft limit above: left alone
    assert plan(1024, -1, 1024, 150).soft == CEILING  # unlimited: bounded
    assert plan(1024, 1 << 30, 1024, 150).soft == CEILING


def test_a_hard_limit_too_low_lowers_max_connections_and_says_so() -> None:
    budget = plan(1024, 1024, 1024, 150)
    assert (budget.soft, budget.max_connections) == (1024, 874)
    assert budget.warning.startswith("server.max_connections = 1024 lowered to 874: the "
                                     "open-file limit is 1024")
    assert "LimitNOFILE=" in budget.warning
    assert plan(64, 64, 1024, 150).max_connections == 1  # never 0


def test_the_reserve_grows_with_what_is_configured() -> None:
    plain = Config()
    assert 100 < reserve(plain) < 200
    bare = plain._replace(wal=plain.wal._replace(enabled=False),
                          metrics=plain.metrics._replace(enabled=False))
    assert reserve(bare) < reserve(plain) - 50
