"""Shards: which views are co-partitioned, how a batch splits, how message keys are checked."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from refold.config import parse_pipeline
from refold.errors import UserError
from refold.model.reasons import Reason
from refold.recovery.records import (
    Checkpoint,
    PendingRecord,
    combined,
    decode_checkpoint,
    encode_checkpoint,
)
from refold.runtime.batch import DeadLetters, InputRecord, Outgoing, UnitReader
from refold.runtime.shards import (
    KeyCheck,
    Shard,
    checkpoint_key,
    co_partitioned,
    message_key,
    plan_shards,
)

GROUPED = {"key": ["player_name", "match_id"], "columns": {"n": {"count": "*"}}}


def pipeline(view: dict[str, Any], source_key: list[str] | None = None, fmt: str = "jsonl") -> Any:
    source: dict[str, Any] = {"topic": "s", "format": fmt}
    if source_key is not None:
        source["key"] = source_key
    return parse_pipeline({"pipeline": "p", "source": source, "view": view, "outputs": {"view": {"topic": "v"}}})


@pytest.mark.parametrize(
    ("view", "source_key", "expected"),
    [
        (GROUPED, None, True),  # keyed by the view key (the default)
        (GROUPED, ["player_name"], True),  # message key ⊆ view key
        (GROUPED, ["match_id", "player_name"], True),
        (GROUPED, ["team"], False),  # re-groups: the view key lacks the message key
        (GROUPED, ["player_name", "team"], False),
        ({"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": []}}, None, False),  # global Top-N
        ({"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": []}}, ["player_name"], False),
        ({"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}}, None, True),
        ({"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}}, ["player_name"], False),
    ],
)
def test_which_views_are_co_partitioned(view: dict[str, Any], source_key: list[str] | None, expected: bool) -> None:
    p = pipeline(view, source_key)
    assert co_partitioned(p) is expected
    plan = plan_shards(p)
    shards = plan.shards([0, 1, 2])
    if expected:
        assert shards == [Shard(0, frozenset({0})), Shard(1, frozenset({1})), Shard(2, frozenset({2}))]
        assert [plan.shard_of(q) for q in (0, 1, 2)] == [0, 1, 2]
    else:
        assert shards == [Shard(0, None)] and shards[0].covers(2)
        assert [plan.shard_of(q) for q in (0, 1, 2)] == [0, 0, 0]


def test_message_key_defaults_to_the_view_key() -> None:
    assert message_key(pipeline(GROUPED)) == ("player_name", "match_id")
    assert message_key(pipeline(GROUPED, ["team"])) == ("team",)
    top = {"top_n": {"n": 2, "order_by": {"score": "desc"}, "partition_by": ["team"]}}
    assert message_key(pipeline(top)) == ("team",)


def test_a_batch_splits_by_shard_in_record_order() -> None:
    records = [InputRecord(p, o, None, None, 0) for p, o in [(1, 5), (0, 3), (1, 6), (2, 0), (0, 4)]]
    split = plan_shards(pipeline(GROUPED)).split(records)
    assert {s: [(r.partition, r.offset) for r in rs] for s, rs in split.items()} == {
        0: [(0, 3), (0, 4)], 1: [(1, 5), (1, 6)], 2: [(2, 0)]}
    assert plan_shards(pipeline(GROUPED, ["team"])).split(records) == {0: records}
    assert plan_shards(pipeline(GROUPED)).split([]) == {}


def test_transactional_ids_and_checkpoint_keys_name_the_shard() -> None:
    p = pipeline(GROUPED)
    assert p.transactional_id(2) == "p-0-2"
    assert parse_pipeline({**p.model_dump(by_alias=True, exclude={"kafka"}), "transactional_id_prefix": "x",
                           "writer": "w"}).transactional_id(0) == "x-w-0"
    assert checkpoint_key("0", 3) == b"0/3"


def key(**columns: Any) -> bytes:
    return orjson.dumps(columns)


def test_key_check_passes_refolds_keys_and_stops_a_run_keyed_otherwise() -> None:
    check = KeyCheck(pipeline(GROUPED, ["player_name"]))
    row = {"player_name": "Alice", "match_id": 1, "score": 3}
    with pytest.raises(UserError, match=r"fields \['match_id'\].*source\.key"):
        check.matches(key(match_id=1), row)  # the first record of the run: stop
    with pytest.raises(UserError, match="not a JSON object"):
        check.matches(b"Alice", row)
    with pytest.raises(UserError, match="null key"):
        check.matches(None, row)
    assert check.matches(key(player_name="Alice"), row) and check.verified
    assert check.matches(b'{"player_name": "Alice"}', row)  # another spacing: the same object
    assert not check.matches(key(player_name="Bob"), row)  # later: a dead letter, not a stop
    assert check.matches(b"anything", {"score": 1})  # a null key column: the reducer's to refuse


def test_key_check_of_two_key_columns_compares_both_in_any_field_order() -> None:
    check = KeyCheck(pipeline(GROUPED, ["player_name", "match_id"]))
    row = {"player_name": "Alice", "match_id": 1, "score": 3}
    assert check.matches(b'{"match_id": 1, "player_name": "Alice"}', row) and check.verified
    assert not check.matches(key(player_name="Alice", match_id=2), row)
    assert not check.matches(key(player_name="Alice"), row)  # a column short
    assert check.matches(b"anything", {"player_name": "Alice", "match_id": None})  # the reducer's to refuse


def test_key_check_is_off_for_regrouping_views_and_checks_debeziums_first_record() -> None:
    assert not KeyCheck(pipeline(GROUPED, ["team"])).enabled
    assert not KeyCheck(pipeline({"top_n": {"n": 1, "order_by": {"s": "desc"}}})).enabled
    assert KeyCheck(pipeline(GROUPED)).enabled
    check = KeyCheck(pipeline({"key": ["id"], "columns": {"n": {"count": "*"}}}, fmt="debezium-json"))
    with pytest.raises(UserError, match=r"fields \['schema', 'payload'\]|fields \['payload', 'schema'\]"):
        check.matches(b'{"schema": {}, "payload": {"other": 1}}', {"id": 1})
    assert check.matches(b'{"schema": {"type": "struct"}, "payload": {"id": 1}}', {"id": 1})
    assert check.matches(b"not checked after the first", {"id": 2})  # Debezium: the first record only


def test_a_later_record_keyed_otherwise_is_a_dead_letter() -> None:
    p = pipeline({"key": ["k"], "columns": {"n": {"count": "*"}}})
    reader = UnitReader(p, DeadLetters("s", "p", strict=False), KeyCheck(p))

    def record(offset: int, message_key: bytes, k: str) -> InputRecord:
        return InputRecord(0, offset, message_key, orjson.dumps({"op": "+A", "k": k}), 0)

    out = Outgoing()
    with pytest.raises(UserError, match=r"source\.key"):
        reader.read([record(0, b"x", "a")], {}, out)
    units = reader.read([record(0, key(k="a"), "a"), record(1, key(k="a"), "b"), record(2, key(k="c"), "c")], {}, out)
    assert [u[0][1].offset for u in units.units] == [0, 2]
    assert [(d.offset, d.reason) for d in out.dlq] == [(1, Reason.KEY_MISMATCH)]


def test_checkpoints_carry_their_shard_and_combine() -> None:
    a = Checkpoint("p", "0", 3, "s", {0: 10}, {0: PendingRecord(9, b"k", b"v", 1)}, 10, 7, 1, 1000, {"d": b"a"}, 0)
    b = Checkpoint("p", "0", 5, "s", {1: 20}, {}, 20, 9, 2, 2000, {"d": b"b"}, shard=1)
    assert decode_checkpoint(encode_checkpoint(b)) == b
    both = combined([b, a])
    assert both is not None
    assert (both.batch, both.offsets, both.records_in, both.records_out, both.dlq, both.committed_at) == (
        5, {0: 10, 1: 20}, 30, 16, 3, 2000)
    assert set(both.pending) == {0} and both.driver_checkpoints == {"d": b"a"}
    assert combined([]) is None
