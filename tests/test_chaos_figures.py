"""The chaos run's line of figures (`refold.dev.chaosengine.ChaosResult`)."""

from __future__ import annotations

from refold.dev.chaosengine import ChaosResult


def test_the_line_gives_the_median_and_worst_leader_kill_to_commit() -> None:
    result = ChaosResult(leader_recoveries=[4.0, 1.5, None, 2.5])
    assert result.line().endswith(" leader_kill_to_commit[median=2.5s max=4.0s n=3 none_within_180s=1]")


def test_no_leader_kill_no_recovery_figures() -> None:
    assert "leader_kill_to_commit" not in ChaosResult().line()
    assert ChaosResult(leader_recoveries=[None]).recovery_text() == (
        " leader_kill_to_commit[median=- max=- n=0 none_within_180s=1]"
    )


def test_the_line_ends_with_kafkas_find_hanging_check() -> None:
    assert ChaosResult(hanging=(3, 0)).line().endswith(" find_hanging[brokers=3 found=0]")
    assert "find_hanging" not in ChaosResult().line()
