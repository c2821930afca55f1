"""A join through the exchange (`shards: M`, `refold.runtime.joinx`): stage 1 routes both
sources by join key through `P.repartition`, M stage-2 shards join. Against
`refold.reference_joins` (random changelogs, random batch cuts, restarts), a grouped
view over it against the grouped reference, killed mid-commit, its plan."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_join import Unit, changelogs
from test_join import as_units as numbered
from test_join_engine import (
    GROUPED,
    by_partition,
    changelog,
    crash_units,
    join_pipeline,
    killed_in_a_subprocess,
    make_topics,
    produce_wired,
    run_batches,
    run_drawn,
    wire,
)

from refold.config import ViewSpec, parse_pipeline
from refold.kafka.io import TopicSpec, ensure_topics, read_to_end
from refold.model.changelog import Op
from refold.ops.explain import explain
from refold.ops.status import print_status
from refold.plan import RIGHT_PARTITIONS, plan_of
from refold.plan.draw import tree
from refold.recovery.records import decode_dead_letter
from refold.reduce.values import key_bytes
from refold.reference import reference_changelog
from refold.reference_joins import reference_join
from refold.runtime.exchange import shard_of

SHARDS = 3
BY_CUSTOMER = {"key": ["ck"], "columns": GROUPED["columns"]}  # grouped by the orders' join column


def shard_of_unit(side: int, events: Sequence[Any]) -> int:
    """The stage-2 shard of a unit that stays at its join key."""
    value = events[0].row.get(("cust", "cid")[side])
    return shard_of(key_bytes((value,)), SHARDS)


def moves(units: Sequence[Unit]) -> bool:
    """Whether a correction moves a row to another join key (its halves in two shards)."""
    return any(len(events) == 2 and events[0].row.get(("cust", "cid")[side]) != events[1].row.get(("cust", "cid")[side])
               for side, events in units)


def folded(values: Sequence[bytes]) -> Counter[bytes]:
    """A changelog's live rows, as a multiset of row JSON."""
    rows: Counter[bytes] = Counter()
    for value in values:
        record = orjson.loads(value)
        op = record.pop("op")
        rows[orjson.dumps(record, option=orjson.OPT_SORT_KEYS)] += 1 if op in ("+A", "+C") else -1
    return +rows


@pytest.mark.kafka
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_an_exchanged_join_writes_the_reference_join_shard_by_shard(bootstrap_servers: str, units: list[Unit],
                                                                    kind: str, data: st.DataObject) -> None:
    """Both sources over two partitions, not keyed by their join columns, joined in three
    shards through the exchange: the view's live rows are the reference join's, whatever
    the batch cuts and restarts; when no correction moves a row to another join key, each
    shard's view partition is the reference join's changelog of its join keys, record by
    record, each record naming its unit's first event, and each refused unit a dead letter
    naming its own topic, partition and offset."""
    pipeline = join_pipeline(f"jx{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=["id"], shards=SHARDS)
    plan = plan_of(pipeline, 2)
    assert plan.layout == "exchanged" and [s.name for s in plan.stages] == ["route", "join"]
    firsts = run_drawn(pipeline, units, data)
    spec = pipeline.view.join
    assert spec is not None
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    everything = [m.value() for part in parts.values() for m in part]
    assert folded(everything) == folded(changelog(reference_join(spec, units).changes))
    if moves(units):
        return
    topics = (f"{pipeline.pipeline}.orders", f"{pipeline.pipeline}.customers")
    expected_letters = []
    for m in range(SHARDS):
        mine = [index for index, (side, events) in enumerate(units) if shard_of_unit(side, events) == m]
        expected = reference_join(spec, [units[i] for i in mine])
        assert [r.value() for r in parts.get(m, [])] == changelog(expected.changes)
        causes = []
        for count, index in enumerate(mine):
            before = reference_join(spec, [units[i] for i in mine[:count]])
            made = len(reference_join(spec, [units[i] for i in mine[:count + 1]]).changes) - len(before.changes)
            side, partition, offset = firsts[index]
            causes += [f"{topics[side]}:{partition}:{offset}".encode()] * made
        assert [dict(r.headers() or [])["refold.cause"] for r in parts.get(m, [])] == causes
        expected_letters += [(topics[firsts[mine[i]][0]], firsts[mine[i]][1], firsts[mine[i]][2], reason)
                             for i, reason in expected.rejected]
    letters = [decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                  pipeline.dlq_topic)]
    assert sorted((d.topic, d.partition, d.offset, d.reason) for d in letters) == sorted(expected_letters)


@pytest.mark.kafka
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_grouped_view_over_an_exchanged_join_is_the_grouped_reference(bootstrap_servers: str, units: list[Unit],
                                                                       kind: str, data: st.DataObject) -> None:
    """Revenue per customer over the join in three shards: each customer's view key lies
    in its join key's shard; the view's rows are the reference grouped view's over the
    reference join (folded: a correction that moves an order between customers is two
    transactions in two shards)."""
    pipeline = join_pipeline(f"jy{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=["id"], shards=SHARDS)
    dumped = pipeline.model_dump(by_alias=True, exclude={"source"}, exclude_none=True)
    pipeline = parse_pipeline({**dumped, "view": {"join": dumped["view"]["join"], **BY_CUSTOMER}})
    assert pipeline.run_refusal() is None
    run_drawn(pipeline, units, data, 4, 3)
    spec = pipeline.view.join
    assert spec is not None
    expected = reference_changelog(ViewSpec.model_validate(BY_CUSTOMER), numbered(reference_join(spec, exchanged(units)).changes))
    written = [m.value() for part in by_partition(pipeline, f"{pipeline.pipeline}.view").values() for m in part]
    assert folded(written) == folded(changelog(expected.changes))


def source_units(spec: Any, units: Sequence[Unit]) -> list[int]:
    """The source unit that made each of the reference join's records, by index."""
    made: list[int] = []
    for index in range(len(units)):
        made += [index] * (len(reference_join(spec, units[:index + 1]).changes) - len(made))
    return made


@pytest.mark.kafka
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                HealthCheck.data_too_large])
@given(units=changelogs(), kind=st.sampled_from(["inner", "left", "full"]), data=st.data())
def test_a_grouped_view_keyed_outside_the_join_key_goes_through_a_second_exchange(
        bootstrap_servers: str, units: list[Unit], kind: str, data: st.DataObject) -> None:
    """Revenue per region over the join in three shards: the join shards route the joined
    rows by region through `P.regroup` to three stage-3 shards. The view's rows are the
    reference grouped view's over the reference join; each refused unit (by the join, or a
    joined row with a null region) is a dead letter of its source record; when no
    correction moves a row to another join key, each stage-3 shard's view partition is the
    reference's changelog of its regions, record by record, each naming its source event."""
    pipeline = join_pipeline(f"jr{uuid.uuid4().hex[:8]}", bootstrap_servers, kind, key=["id"], grouped=True,
                             shards=SHARDS)
    assert pipeline.run_refusal() is None
    assert [s.name for s in plan_of(pipeline, 2).stages] == ["route", "join", "reduce"]
    firsts = run_drawn(pipeline, units, data, 4, 3)
    spec = pipeline.view.join
    assert spec is not None
    joined = reference_join(spec, exchanged(units))
    grouped = numbered(joined.changes)  # the grouped view's units, each tagged with its first record
    view = ViewSpec.model_validate(GROUPED)
    expected = reference_changelog(view, grouped)
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    assert folded([m.value() for part in parts.values() for m in part]) == folded(changelog(expected.changes))
    made_by = source_units(spec, units)
    topics = (f"{pipeline.pipeline}.orders", f"{pipeline.pipeline}.customers")

    def named(unit: int) -> tuple[str, int, int]:
        side, partition, offset = firsts[unit]
        return topics[side], partition, offset

    if moves(units):
        return  # (a moved row's halves are units of their own from stage 1 on, each named by its own record)
    letters = [(*named(i), reason) for i, reason in joined.rejected]
    letters += [(*named(made_by[grouped[i][0].tag[2]]), reason) for i, reason in expected.rejected]
    written_letters = [decode_dead_letter(m.value()) for m in read_to_end({"bootstrap.servers": bootstrap_servers},
                                                                          pipeline.dlq_topic)]
    assert sorted((d.topic, d.partition, d.offset, d.reason) for d in written_letters) == sorted(letters)
    causes: list[bytes] = []  # each view record's source event, in the reference's order
    for count, unit in enumerate(grouped):
        made = len(reference_changelog(view, grouped[:count + 1]).changes) - len(causes)
        causes += [":".join(map(str, named(made_by[unit[0].tag[2]]))).encode()] * made
    for m in range(SHARDS):
        mine = [i for i, change in enumerate(expected.changes)
                if shard_of(key_bytes((change.row.get("region"),)), SHARDS) == m]
        assert [r.value() for r in parts.get(m, [])] == changelog([expected.changes[i] for i in mine])
        assert [dict(r.headers() or [])["refold.cause"] for r in parts.get(m, [])] == [causes[i] for i in mine]


def exchanged(units: Sequence[Unit]) -> list[Unit]:
    """The units as the exchange routes them: a correction whose halves' join keys lie in
    two stage-2 shards is two units there, a `-R` of the old row in one shard and an `+A`
    of the new in the other, where the one-shard join pairs their joined rows as `-C`/`+C`
    (the grouped view over the join then refuses a pair with a null half whole, but only
    that half of two units)."""
    out: list[Unit] = []
    for side, events in units:
        if len(events) == 2 and shard_of_unit(side, events[:1]) != shard_of_unit(side, events[1:]):
            out += [(side, [events[0]._replace(op=Op.RETRACT)]), (side, [events[1]._replace(op=Op.APPEND)])]
        else:
            out.append((side, events))
    return out


@pytest.mark.kafka
@pytest.mark.parametrize("stage", ["route", "join"])
def test_an_exchanged_join_killed_mid_commit_writes_each_record_once(bootstrap_servers: str, tmp_path: Any,
                                                                     stage: str) -> None:
    """A join through the exchange killed (SIGKILL) inside batch 2's transaction of a
    stage-1 shard, or of a join shard: the next run writes each shard's reference
    changelog, record by record, nothing twice and nothing lost."""
    pipeline = join_pipeline(f"jk{uuid.uuid4().hex[:8]}", bootstrap_servers, "left", key=["id"], shards=SHARDS)
    units, records = killed_in_a_subprocess(pipeline, bootstrap_servers, tmp_path, stage, (
        "hooks = Hooks(crash_at='in_txn:2')\n"
        "processor = BatchProcessor(pipeline, settings, hooks=hooks if where == 'route' else Hooks())\n"
        "for applier in processor.appliers.values() if where == 'join' else ():\n"
        "    applier.hooks = hooks\n"))
    run_batches(pipeline, records, [7, 14], [False])
    spec = pipeline.view.join
    assert spec is not None
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    for m in range(SHARDS):
        mine = [(side, events) for side, events in units if shard_of_unit(side, events) == m]
        assert [r.value() for r in parts.get(m, [])] == changelog(reference_join(spec, mine).changes)


@pytest.mark.kafka
def test_a_regrouping_join_killed_inside_a_stage_3_commit_writes_each_record_once(bootstrap_servers: str,
                                                                                 tmp_path: Any) -> None:
    """Revenue per region over a join in three shards, killed (SIGKILL) inside batch 2's
    transaction of a stage-3 shard: the next run writes each stage-3 shard's reference
    changelog of its regions, record by record, nothing twice and nothing lost."""
    pipeline = join_pipeline(f"jq{uuid.uuid4().hex[:8]}", bootstrap_servers, "left", key=["id"], grouped=True,
                             shards=SHARDS)
    units, records = killed_in_a_subprocess(pipeline, bootstrap_servers, tmp_path, "group", (
        "hooks = Hooks(crash_at='in_txn:2')\n"
        "processor = BatchProcessor(pipeline, settings)\n"
        "for grouper in processor.groupers.values():\n"
        "    grouper.hooks = hooks\n"))
    run_batches(pipeline, records, [7, 14], [False])
    spec = pipeline.view.join
    assert spec is not None
    expected = reference_changelog(ViewSpec.model_validate(GROUPED), numbered(reference_join(spec, units).changes))
    parts = by_partition(pipeline, f"{pipeline.pipeline}.view")
    assert sum(len(part) for part in parts.values()) == len(expected.changes) > 0
    for m in range(SHARDS):
        mine = [c for c in expected.changes if shard_of(key_bytes((c.row.get("region"),)), SHARDS) == m]
        assert [r.value() for r in parts.get(m, [])] == changelog(mine)


@pytest.mark.kafka
def test_refold_status_of_a_regrouping_join_shows_each_stage(bootstrap_servers: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`refold status` of revenue per region over a join in three shards, its right source
    in three partitions and its left in two: stage 1's three shards (shard 2 reads the
    right source's partition 2 alone), then each later stage's shards and its lag; the
    view is the reference grouped view over the reference join."""
    pipeline = join_pipeline(f"js{uuid.uuid4().hex[:8]}", bootstrap_servers, "left", key=["id"], grouped=True,
                             shards=SHARDS)
    settings_ = {"bootstrap.servers": bootstrap_servers}
    ensure_topics(settings_, [TopicSpec(f"{pipeline.pipeline}.customers", 3)])
    make_topics(pipeline, 2)
    units = crash_units()
    records, _ = wire(units, 2, 3)
    assert {r.partition for r in records} == {0, 1, RIGHT_PARTITIONS, RIGHT_PARTITIONS + 1, RIGHT_PARTITIONS + 2}
    produce_wired(pipeline, records)  # (for the lag)
    run_batches(pipeline, records, [9], [False])
    spec = pipeline.view.join
    assert spec is not None
    expected = reference_changelog(ViewSpec.model_validate(GROUPED), numbered(reference_join(spec, units).changes))
    written = [m.value() for part in by_partition(pipeline, f"{pipeline.pipeline}.view").values() for m in part]
    assert folded(written) == folded(changelog(expected.changes))
    assert print_status(pipeline)
    shown = capsys.readouterr().out
    assert f"source {pipeline.pipeline}.orders (L) joined with {pipeline.pipeline}.customers (R)" in shown
    first = shown[:shown.index("stage 2")]
    assert "R2:" in first and "    2  R2 " in first  # shard 2: the right source's partition 2 alone
    assert f"stage 2 (writer 0.view) from {pipeline.pipeline}.repartition" in shown
    assert f"stage 3 (writer 0.group) from {pipeline.pipeline}.regroup" in shown
    assert shown.count("total lag 0") == 4  # both sources, P.repartition, P.regroup
    for stage in ("stage 2", "stage 3"):
        part = shown[shown.index(stage):]
        assert all(f"\n  {m:>5}  {m:<12}" in part for m in range(SHARDS)), part


def test_an_exchanged_joins_plan_routes_by_join_key() -> None:
    """`refold explain`'s plan of a join in shards: 3: stage 1 per partition pair of both
    sources, `P.repartition` of 3 partitions, 3 join shards under `<writer>.view`, the
    driver's close; a grouped view keyed outside the join key adds a stage 3 of 3 shards
    under `<writer>.group` reading `P.regroup`, which the driver closes after stage 2."""
    pipeline = join_pipeline("jz", "127.0.0.1:1", "left", key=["id"], shards=3)
    plan = plan_of(pipeline, 2)
    assert plan.layout == "exchanged" and plan.stage2_shards == 3 and plan.close_id == "jz-0-close"
    route, join = plan.stages
    assert route.inputs == ("jz.orders", "jz.customers") and route.outputs == ("jz.repartition", "jz.dlq")
    assert join.inputs == ("jz.repartition",) and join.writer == "0.view" and join.shards == 3
    drawn = tree(plan)
    assert "1. route: decode → validate → route" in drawn and "2. join: join (3 shards" in drawn
    assert "the driver closes each batch in jz.repartition (transactional id jz-0-close)" in drawn
    text = explain(pipeline)  # `refold explain`
    assert "# shards: stage 1 one per partition pair of jz.orders and jz.customers, routed by join key to 3 join " \
           "shards through jz.repartition" in text
    assert "2. join: join (3 shards" in text
    grouped = join_pipeline("jw", "127.0.0.1:1", "left", key=["id"], grouped=True, shards=3)
    assert grouped.run_refusal() is None
    plan = plan_of(grouped, 2)
    route, join, reduce = plan.stages
    assert plan.regrouped and join.outputs == ("jw.regroup", "jw.dlq") and join.state_topic == "jw.state"
    assert reduce.inputs == ("jw.regroup",) and reduce.writer == "0.group" and reduce.shards == 3
    assert reduce.outputs == ("jw.view", "jw.dlq") and reduce.state_topic == "jw.regroup.state"
    assert reduce.transactional_ids == ("jw-0.group-0", "jw-0.group-1", "jw-0.group-2")
    drawn = explain(grouped)  # `refold explain`
    for line in ("# shards: stage 1 one per partition pair of jw.orders and jw.customers, routed by join key to 3 join "
                 "shards through jw.repartition, their joined rows routed by region to 3 shards of the grouped view "
                 "through jw.regroup",
                 "2. join: join → route (3 shards, shard p reads partition p of its input)",
                 "writes jw.regroup, jw.dlq; state in jw.state",
                 "3. reduce: reduce (3 shards, shard p reads partition p of its input)",
                 "writer 0.group: transactional ids jw-0.group-<shard>, checkpoints 0.group/<shard> in jw.checkpoints",
                 "writes jw.view, jw.dlq; state in jw.regroup.state",
                 "the driver closes each batch in jw.repartition, then, once every stage-2 shard committed, in "
                 "jw.regroup (transactional id jw-0-close)",
                 "jw.regroup ", "joined rows by view key, a partition per stage-3 shard: 3 partitions"):
        assert line in drawn, line
