"""The small chaos run (`make test-slow`): faults of several kinds, then EosTestDriver-style checks.

It repeats, through the harness, what faster tests of `make test` prove one by one: a
kill -9 inside the commit (`test_crash`'s kill at each point) and a broker's loss
(`test_kafka_cluster`'s leader and coordinator kills). `make chaos` runs the same harness (`refold.dev.chaos` (engine/dev/chaos.py)) with a million events and
over a hundred faults; this one keeps to two — kill -9 inside the Kafka commit and
a hard broker restart (which once left the engine stuck in librdkafka) — so that
CI stays quick; and to one leader kill on a three-broker cluster. It owns its brokers.
A lost local state directory, the harness's
third fault kind of the quick run, is proved faster elsewhere in `make test`: a
restart with the shards' local stores deleted in
`test_upsert.test_upsert_streams_through_the_engine_equal_the_reference`, a store
that disagrees with Kafka discarded in `test_recovery`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refold.dev.chaos import ChaosConfig, run_chaos

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.slow]


@pytest.mark.parametrize("pipeline", ["upsert", "join"])
def test_small_chaos_run_finds_no_anomaly(tmp_path: Path, pipeline: str) -> None:
    cfg = ChaosConfig(events=1_200, keys=120, kills=1, others=1,
                      other_kinds=("broker_restart",), batch=200,
                      seed=3, pipelines=(pipeline,), idle=3.0, cluster=False)
    said: list[str] = []
    result = run_chaos(cfg, tmp_path, say=said.append)
    assert result.anomalies == [], "\n".join(result.anomalies + said)
    assert result.faults == {"kill9_in_commit": 1, "broker_restart": 1}
    assert result.engine_exits["killed"] >= 1
    assert result.stalls == 0, "an engine stopped making progress"
    assert result.view_records > 0 and result.delta_records > 0
    assert result.events == 1_200


def test_a_leader_kill_leaves_the_windowed_pipeline_input_to_read(tmp_path: Path) -> None:
    """On the three-broker cluster a leader's kill has the second half of its chunk of every
    topic written after the kill, the windowed pipeline's own topic too: that engine has
    input waiting through the election, commits again (the kill's recovery is measured),
    and every record arrives once."""
    cfg = ChaosConfig(events=1_200, keys=120, kills=0, others=1, other_kinds=("leader_kill_source",), batch=200,
                      seed=3, pipelines=("window",), idle=3.0, cluster=False, kafka_brokers=3)
    said: list[str] = []
    result = run_chaos(cfg, tmp_path, say=said.append)
    assert result.anomalies == [], "\n".join(result.anomalies + said)
    assert result.faults == {"leader_kill_source": 1}
    assert len(result.leader_recoveries) == 1 and result.leader_recoveries[0] is not None, "\n".join(said)
    assert result.view_records > 0 and result.delta_records > 0
