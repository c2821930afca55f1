"""The plan (`refold.plan`) keeps every name a committed pipeline depends on.

`PINNED` was computed with the code from before the plan existed (the layout settled
piece by piece in recovery/layout.py, runtime/shards.py, runtime/exchange.py,
runtime/tops.py and spark/job.py), for the example pipelines and the shapes the tests
run: the topics the engine makes (name, partitions, compacted), each stage writer's
transactional ids and its checkpoint records' keys. A pipeline that committed under
those names must find them again, so they are literals here, not derived."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from refold.config import load_pipeline, parse_pipeline
from refold.plan import Plan, plan_of
from refold.recovery.layout import settled

ROOT = Path(__file__).resolve().parent.parent

SHAPES: dict[str, dict[str, Any]] = {'grouped_copartitioned': {'pipeline': 'orders',
                           'source': {'topic': 'o', 'format': 'jsonl', 'key': ['region']},
                           'view': {'key': ['region'], 'columns': {'n': {'count': '*'}}},
                           'outputs': {'view': {'topic': 'orders.view'}, 'delta': {'topic': 'orders.delta'}}},
 'regrouping_shards': {'pipeline': 'teams',
                       'writer': 'w2',
                       'shards': 4,
                       'source': {'topic': 's', 'format': 'jsonl', 'key': ['player']},
                       'view': {'key': ['team'], 'columns': {'total': {'sum': 'score'}}},
                       'outputs': {'view': {'topic': 'teams.view', 'form': 'upsert'}}},
 'regrouping_default': {'pipeline': 'teams2',
                        'source': {'topic': 's', 'format': 'jsonl', 'key': ['player']},
                        'view': {'key': ['team'], 'columns': {'total': {'sum': 'score'}}},
                        'outputs': {'view': {'topic': 'teams2.view'}}},
 'merged': {'pipeline': 'm',
            'shards': 'merged',
            'transactional_id_prefix': 'acme',
            'source': {'topic': 's', 'format': 'jsonl', 'key': ['player']},
            'view': {'key': ['team'], 'columns': {'total': {'sum': 'score'}}},
            'outputs': {'view': {'topic': 'm.view', 'partitioning': 'key'}}},
 'global_top_n_shards': {'pipeline': 'board',
                         'shards': 3,
                         'source': {'topic': 's', 'format': 'jsonl', 'key': ['player']},
                         'view': {'top_n': {'n': 3, 'order_by': {'score': 'desc'}, 'columns': ['player', 'score']}},
                         'outputs': {'view': {'topic': 'board.view'}}},
 'regrouping_more_shards': {'pipeline': 'wide',
                            'shards': 8,
                            'source': {'topic': 's', 'format': 'jsonl', 'key': ['player']},
                            'view': {'key': ['team'], 'columns': {'total': {'sum': 'score'}, 'n': {'count': '*'}}},
                            'outputs': {'view': {'topic': 'wide.view'}, 'delta': {'topic': 'wide.delta'}}},
 'partitioned_top_n': {'pipeline': 'ptop',
                       'source': {'topic': 's', 'format': 'jsonl', 'key': ['team']},
                       'view': {'top_n': {'n': 2,
                                          'partition_by': ['team'],
                                          'order_by': {'score': 'desc'},
                                          'columns': ['team', 'player', 'score']}},
                       'outputs': {'view': {'topic': 'ptop.view'}}}}

PINNED: dict[str, dict[str, Any]] = {'examples/totals.yaml': {'shards': None,
                          'topics': [['totals.checkpoints', 4, True],
                                     ['totals.state', 4, True],
                                     ['totals.dlq', 1, False],
                                     ['totals.view', 4, False],
                                     ['totals.delta', 4, False]],
                          'transactional_ids': {'0': ['totals-0-0', 'totals-0-1', 'totals-0-2', 'totals-0-3']},
                          'checkpoint_keys': ['0/0', '0/1', '0/2', '0/3']},
 'examples/leaderboard.yaml': {'shards': 'merged',
                               'topics': [['leaderboard.checkpoints', 4, True],
                                          ['leaderboard.state', 4, True],
                                          ['leaderboard.dlq', 1, False],
                                          ['leaderboard.view', 1, False]],
                               'transactional_ids': {'0': ['leaderboard-0-0']},
                               'checkpoint_keys': ['0/0']},
 'examples/hourly.yaml': {'shards': None,
                          'topics': [['hourly.checkpoints', 4, True],
                                     ['hourly.state', 4, True],
                                     ['hourly.dlq', 1, False],
                                     ['hourly.view', 4, False]],
                          'transactional_ids': {'0': ['hourly-0-0', 'hourly-0-1', 'hourly-0-2', 'hourly-0-3']},
                          'checkpoint_keys': ['0/0', '0/1', '0/2', '0/3']},
 'grouped_copartitioned': {'shards': None,
                           'topics': [['orders.checkpoints', 6, True],
                                      ['orders.state', 6, True],
                                      ['orders.dlq', 1, False],
                                      ['orders.view', 6, False],
                                      ['orders.delta', 6, False]],
                           'transactional_ids': {'0': ['orders-0-0',
                                                       'orders-0-1',
                                                       'orders-0-2',
                                                       'orders-0-3',
                                                       'orders-0-4',
                                                       'orders-0-5']},
                           'checkpoint_keys': ['0/0', '0/1', '0/2', '0/3', '0/4', '0/5']},
 'regrouping_shards': {'shards': 4,
                       'topics': [['teams.checkpoints', 6, True],
                                  ['teams.state', 6, True],
                                  ['teams.dlq', 1, False],
                                  ['teams.repartition', 4, False],
                                  ['teams.rows', 6, True],
                                  ['teams.view', 6, True]],
                       'transactional_ids': {'w2': ['teams-w2-0',
                                                    'teams-w2-1',
                                                    'teams-w2-2',
                                                    'teams-w2-3',
                                                    'teams-w2-4',
                                                    'teams-w2-5'],
                                             'w2.view': ['teams-w2.view-0',
                                                         'teams-w2.view-1',
                                                         'teams-w2.view-2',
                                                         'teams-w2.view-3'],
                                             'close': ['teams-w2-close']},
                       'checkpoint_keys': ['w2/0',
                                           'w2/1',
                                           'w2/2',
                                           'w2/3',
                                           'w2/4',
                                           'w2/5',
                                           'w2.view/0',
                                           'w2.view/1',
                                           'w2.view/2',
                                           'w2.view/3']},
 'regrouping_default': {'shards': 6,
                        'topics': [['teams2.checkpoints', 6, True],
                                   ['teams2.state', 6, True],
                                   ['teams2.dlq', 1, False],
                                   ['teams2.repartition', 6, False],
                                   ['teams2.rows', 6, True],
                                   ['teams2.view', 6, False]],
                        'transactional_ids': {'0': ['teams2-0-0',
                                                    'teams2-0-1',
                                                    'teams2-0-2',
                                                    'teams2-0-3',
                                                    'teams2-0-4',
                                                    'teams2-0-5'],
                                              '0.view': ['teams2-0.view-0',
                                                         'teams2-0.view-1',
                                                         'teams2-0.view-2',
                                                         'teams2-0.view-3',
                                                         'teams2-0.view-4',
                                                         'teams2-0.view-5'],
                                              'close': ['teams2-0-close']},
                        'checkpoint_keys': ['0/0',
                                            '0/1',
                                            '0/2',
                                            '0/3',
                                            '0/4',
                                            '0/5',
                                            '0.view/0',
                                            '0.view/1',
                                            '0.view/2',
                                            '0.view/3',
                                            '0.view/4',
                                            '0.view/5']},
 'merged': {'shards': 'merged',
            'topics': [['m.checkpoints', 6, True], ['m.state', 6, True], ['m.dlq', 1, False], ['m.view', 6, False]],
            'transactional_ids': {'0': ['acme-0-0']},
            'checkpoint_keys': ['0/0']},
 'global_top_n_shards': {'shards': 3,
                         'topics': [['board.checkpoints', 6, True],
                                    ['board.state', 6, True],
                                    ['board.dlq', 1, False],
                                    ['board.repartition', 3, False],
                                    ['board.rows', 6, True],
                                    ['board.tops', 1, False],
                                    ['board.tops.state', 1, True],
                                    ['board.view', 1, False]],
                         'transactional_ids': {'0': ['board-0-0',
                                                     'board-0-1',
                                                     'board-0-2',
                                                     'board-0-3',
                                                     'board-0-4',
                                                     'board-0-5'],
                                               '0.view': ['board-0.view-0', 'board-0.view-1', 'board-0.view-2'],
                                               'close': ['board-0-close'],
                                               '0.top': ['board-0.top-0']},
                         'checkpoint_keys': ['0/0',
                                             '0/1',
                                             '0/2',
                                             '0/3',
                                             '0/4',
                                             '0/5',
                                             '0.view/0',
                                             '0.view/1',
                                             '0.view/2',
                                             '0.top/0']},
 'regrouping_more_shards': {'shards': 8,
                            'topics': [['wide.checkpoints', 4, True],
                                       ['wide.state', 8, True],
                                       ['wide.dlq', 1, False],
                                       ['wide.repartition', 8, False],
                                       ['wide.rows', 4, True],
                                       ['wide.view', 8, False],
                                       ['wide.delta', 4, False]],
                            'transactional_ids': {'0': ['wide-0-0', 'wide-0-1'],
                                                  '0.view': ['wide-0.view-0',
                                                             'wide-0.view-1',
                                                             'wide-0.view-2',
                                                             'wide-0.view-3',
                                                             'wide-0.view-4',
                                                             'wide-0.view-5',
                                                             'wide-0.view-6',
                                                             'wide-0.view-7'],
                                                  'close': ['wide-0-close']},
                            'checkpoint_keys': ['0/0',
                                                '0/1',
                                                '0.view/0',
                                                '0.view/1',
                                                '0.view/2',
                                                '0.view/3',
                                                '0.view/4',
                                                '0.view/5',
                                                '0.view/6',
                                                '0.view/7']},
 'partitioned_top_n': {'shards': None,
                       'topics': [['ptop.checkpoints', 6, True],
                                  ['ptop.state', 6, True],
                                  ['ptop.dlq', 1, False],
                                  ['ptop.view', 6, False]],
                       'transactional_ids': {'0': ['ptop-0-0',
                                                   'ptop-0-1',
                                                   'ptop-0-2',
                                                   'ptop-0-3',
                                                   'ptop-0-4',
                                                   'ptop-0-5']},
                       'checkpoint_keys': ['0/0', '0/1', '0/2', '0/3', '0/4', '0/5']}}


def _plan(name: str) -> Plan:
    """The plan a new pipeline's first run settles (nothing committed yet)."""
    if name.startswith("examples/"):
        pipeline, partitions = load_pipeline(ROOT / name), 4
    else:
        pipeline, partitions = parse_pipeline(SHAPES[name]), 2 if name == "regrouping_more_shards" else 6
    return plan_of(settled(pipeline, {}, partitions), partitions)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_plan_keeps_the_names_and_layouts_committed_pipelines_have(name: str) -> None:
    plan, pinned = _plan(name), PINNED[name]
    assert plan.pipeline.shards == pinned["shards"]
    # (the trace index came after them: a committed pipeline's next start makes it, partitioned as its view)
    assert [[t.name, t.partitions, t.compacted] for t in plan.topics if t.role not in ("source", "trace")] == pinned["topics"]
    trace, view = plan.topic("trace"), plan.topic("view")
    assert trace is None or (view is not None and (trace.name, trace.partitions) == (f"{plan.pipeline.pipeline}.trace", view.partitions))
    ids = {stage.writer: list(stage.transactional_ids) for stage in plan.stages}
    if plan.close_id is not None:
        ids["close"] = [plan.close_id]
    assert ids == pinned["transactional_ids"]
    keys = [stage.checkpoint_key(shard).decode() for stage in plan.stages for shard in stage.shard_indexes]
    assert keys == pinned["checkpoint_keys"]


def test_the_plan_and_recovery_import_nothing_above_them() -> None:
    """The plan depends on the config alone, and recovery (which settles the plan from
    what earlier runs committed) on the plan, never on the runtime that runs it."""
    code = (
        "import importlib, sys\n"
        "importlib.import_module('refold.plan.draw')\n"
        "plan = sorted(m for m in sys.modules if m.startswith(('refold.runtime', 'refold.recovery', 'refold.spark')))\n"
        "for name in ('claims', 'layout', 'records', 'restore'):\n"
        "    importlib.import_module('refold.recovery.' + name)\n"
        "print(plan, sorted(m for m in sys.modules if m.startswith(('refold.runtime', 'refold.spark'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[] []", done.stdout
    imports = [line for path in sorted((ROOT / "engine" / "recovery").glob("*.py"))
               for line in path.read_text().splitlines() if line.startswith(("from refold.runtime", "import refold.runtime"))]
    assert imports == []
