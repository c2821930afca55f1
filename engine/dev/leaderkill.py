"""How long from a broker's kill -9 to the engine's next committed batch, on a local
three-broker cluster (docs/kafka-cluster.md, "After a broker's loss").

    python -m refold.dev.leaderkill [--kills 3] [--pipeline grouped|top_n] [--idle 600]
        [--kill source|view|state|checkpoints|group|coordinator|controller]
        [--events 6000] [--keys 600] [--seed 1] [--work DIR]

Starts a cluster on free ports in a home of its own, one pipeline (the chaos harness's
grouped view, or its Top-N with `--pipeline top_n`; `refold run --until-idle IDLE` on
`local[2]`) and, `--kills` times: writes half a chunk of input, waits for the engine to
commit it, writes the other half, and after a random pause of up to 1.5 s (a batch in
flight) kills with kill -9 one broker:

- `source`, `view`, `state`, `checkpoints`: the leader of a random partition of the source
  topic, the view topic, `P.state` or `P.checkpoints` (the chaos harness's `leader_kill_*`);
- `group`: the coordinator of the pipeline's consumer group (the leader of its
  `__consumer_offsets` partition, to which each batch sends its consumed offsets);
- `coordinator`: the transaction coordinator of a random shard's transactional id (the
  leader of its `__transaction_state` partition);
- `controller`: the active KRaft controller;

starts it again 2-6 s later on its data and waits until every partition is in sync. An
engine that exited meanwhile (`--idle`: the chaos harness runs its engines with 30 s on a
cluster) is started again before the next kill. Prints the seconds from each kill to the
next committed batch, their median and max, how many times a batch's
`send_offsets_to_transaction` ran into its deadline or was given up early because a broker
left the metadata (from the engine's log), and how the engine's runs ended. The engine inherits the environment:
`REFOLD_SEND_OFFSETS_SECONDS=45` measures the deadline of before.
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from refold.dev import kafkacluster
from refold.dev.chaosengine import ChaosResult, Engine
from refold.dev.chaoskafka import NextCommit, coordinator_of, inject_kafka, leader_of, wait_in_sync
from refold.dev.chaospipelines import chunks, half_of, produce_chunk, write_pipelines
from refold.dev.testing import Workload, generate
from refold.kafka.io import partitions_of
from refold.kafka.transactions import java_string_hash
from refold.model import jsonbytes

PARTITIONS = 3
LEADERS = ("source", "view", "state", "checkpoints")  # --kill of a partition's leader: the chaos harness's kinds


def group_coordinator(settings: dict[str, Any], group: str) -> int:
    """The broker coordinating consumer group `group`: the leader of its
    `__consumer_offsets` partition (`Utils.abs(group.hashCode) % partitions`, as the broker
    maps it); -1 when unknown."""
    try:
        count = len(AdminClient(settings).list_topics("__consumer_offsets", timeout=10)
                    .topics["__consumer_offsets"].partitions)
    except (KafkaException, KeyError):
        return -1
    code = java_string_hash(group)
    return leader_of(settings, "__consumer_offsets", (0 if code == -(1 << 31) else abs(code)) % count) if count else -1


def target_node(kind: str, target: Engine, rng: random.Random, home: Path, settings: dict[str, Any]) -> tuple[int, str]:
    """The broker a `--kill` of `kind` hits (-1 when none is it right now) and what it is."""
    if kind == "group":
        return group_coordinator(settings, f"refold.{target.name}"), "the group's coordinator"
    if kind == "coordinator":
        shard = rng.choice(sorted(partitions_of(settings, target.pipeline.checkpoints_topic)))
        tid = target.pipeline.transactional_id(shard)
        return coordinator_of(settings, tid), f"the transaction coordinator of {tid!r}"
    info = kafkacluster.status(home)
    node = kafkacluster.active_controller(info) if info is not None else None
    return (-1 if node is None else node), "the active controller"


def kill_and_time(kind: str, target: Engine, rng: random.Random, home: Path, settings: dict[str, Any],
                  say: Any, after_kill: Any) -> float | None:
    """kill -9 of the broker a `--kill` of `kind` (not `source`) hits, started again 2-6 s
    later; the seconds from the kill to `target`'s next committed batch (None: none within
    180 s)."""
    time.sleep(rng.uniform(0.0, 1.5))
    node, what = target_node(kind, target, rng, home, settings)
    if node < 0:
        say(f"  no broker is {what} right now; nothing killed")
        after_kill()
        return None
    say(f"  kill -9 of broker {node}, {what}")
    watch = NextCommit(target)
    kafkacluster.kill_node(node, home=home)
    watch.start()
    after_kill()
    time.sleep(rng.uniform(2.0, 6.0))
    kafkacluster.start_node(node, home=home, die_with_parent=True)
    seconds = watch.seconds()
    if watch.slowest > 5:
        say(f"  a read of the engine's checkpoint took {watch.slowest:.0f}s")
    if watch.restarts:
        say(f"  the engine stopped meanwhile; started again {watch.restarts}x")
    if not wait_in_sync(home):
        say("  the cluster is not in sync 180s after the kill")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kill", choices=(*LEADERS, "group", "coordinator", "controller"), default="source",
                        help="whom to kill: the leader of a partition of the source, the view, P.state or "
                             "P.checkpoints, the consumer group's coordinator, a shard's transaction "
                             "coordinator, or the active controller")
    parser.add_argument("--pipeline", choices=("grouped", "top_n"), default="grouped",
                        help="the chaos harness's pipeline to run (top_n: a re-grouping view, two stages of shards)")
    parser.add_argument("--idle", type=float, default=600.0,
                        help="the engine's --until-idle seconds (the chaos harness's on a cluster: 30)")
    parser.add_argument("--events", type=int, default=6000)
    parser.add_argument("--keys", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="refold-leaderkill-"))
    home = work / "kafka-home"
    rng = random.Random(args.seed)
    result = ChaosResult()
    bootstrap = kafkacluster.start(kafkacluster.free_port_range(6), 3, timeout=180.0, home=home, quiet=True,
                                   die_with_parent=True).bootstrap
    print(f"Kafka cluster of 3 at {bootstrap}; work in {work}", flush=True)
    settings = {"bootstrap.servers": bootstrap}
    engine: Engine | None = None
    seconds: list[float | None] = []
    try:
        rows = [jsonbytes.dumps(r) for r in generate(Workload(events=args.events, keys=args.keys, seed=args.seed))]
        source = f"leaderkill-{int(time.time())}"
        (path,) = write_pipelines([args.pipeline], work, source, bootstrap, batch=max(100, args.events // 20))
        engine = Engine(path, work / "logs", result, idle=args.idle)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        parts = list(chunks(rows, args.kills + 1))
        produce_chunk(settings, source, parts[0], PARTITIONS, print)
        engine.ensure_running()
        if not engine.wait_for_progress(0, timeout=300.0):
            raise SystemExit("the engine committed nothing within 300 s; see its log in " + str(work / "logs"))
        for index, part in enumerate(parts[1:], start=1):
            cut = half_of(part)
            engine.ensure_running()  # it may have stopped as idle (--idle) since the last kill
            before = engine.committed_batch()
            produce_chunk(settings, source, part[:cut], PARTITIONS, print)
            engine.wait_for_progress(before)
            write_rest = functools.partial(produce_chunk, settings, source, part[cut:], PARTITIONS, print)
            if args.kill in LEADERS:
                taken = inject_kafka(f"leader_kill_{args.kill}", engine, rng, home, settings, print, write_rest)
            else:
                taken = kill_and_time(args.kill, engine, rng, home, settings, print, write_rest)
            code = engine.proc.poll() if engine.proc is not None else None
            engine.reap()
            seconds.append(taken)
            print(f"  [{index}/{args.kills}] {args.kill} kill → next commit: "
                  + (f"{taken:.1f}s" if taken is not None else "none within 180s")
                  + ("" if code is None else f" (the engine exited meanwhile, status {code})"), flush=True)
    finally:
        if engine is not None:
            engine.kill()
        kafkacluster.stop(home=home)
    texts = [log.read_text(errors="replace") for log in (work / "logs").glob("*.log")]
    deadlines = sum(text.count("send_offsets_to_transaction did not return") for text in texts)
    given_up = sum(text.count("send_offsets_to_transaction gave up") for text in texts)
    seen = sorted(s for s in seconds if s is not None)
    summary = (f"leaderkill: pipeline={args.pipeline} kill={args.kill} kills={len(seconds)} kill_to_commit["
               + (f"median={statistics.median(seen):.1f}s max={seen[-1]:.1f}s" if seen else "-")
               + f" n={len(seen)}] " + " ".join("-" if s is None else f"{s:.1f}" for s in seconds)
               + f" send_offsets_deadlines={deadlines} send_offsets_given_up={given_up} engine_starts={result.engine_starts} exits["
               + " ".join(f"{k}={v}" for k, v in sorted(result.engine_exits.items())) + "]")
    print(summary)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
