"""How long from a broker's kill -9 to the engine's next committed batch, on a local
three-broker cluster (docs/kafka-cluster.md, "After a broker's loss").

    python -m refold.dev.leaderkill [--kills 3] [--kill source|group] [--events 6000]
                                    [--keys 600] [--seed 1] [--work DIR]

Starts a cluster on free ports in a home of its own, one grouped pipeline (the chaos
harness's, `refold run` on `local[2]`) and, `--kills` times: writes half a chunk of
input, waits for the engine to commit it, writes the other half, and after a random
pause of up to 1.5 s (a batch in flight) kills with kill -9 either the leader of a random
source partition (`--kill source`, the chaos harness's `leader_kill_source`) or the
coordinator of the pipeline's consumer group (`--kill group`: the leader of its
`__consumer_offsets` partition, to which each batch sends its consumed offsets), starts
it again 2-6 s later on its data and waits until every partition is in sync. Prints the
seconds from each kill to the next committed batch, their median and max, and how many
times a batch's `send_offsets_to_transaction` ran into its deadline (from the engine's
log). The engine inherits the environment: `REFOLD_SEND_OFFSETS_SECONDS=45` measures
the deadline of before.
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
from refold.dev.chaoskafka import NextCommit, inject_kafka, leader_of, wait_in_sync
from refold.dev.chaospipelines import chunks, half_of, produce_chunk, write_pipelines
from refold.dev.testing import Workload, generate
from refold.kafka.transactions import java_string_hash
from refold.model import jsonbytes

PARTITIONS = 3


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


def kill_group_coordinator(target: Engine, rng: random.Random, home: Path, settings: dict[str, Any],
                           say: Any, after_kill: Any) -> float | None:
    """kill -9 of the consumer group's coordinator, started again 2-6 s later; the seconds
    from the kill to `target`'s next committed batch (None: none within 180 s)."""
    time.sleep(rng.uniform(0.0, 1.5))
    node = group_coordinator(settings, f"refold.{target.name}")
    if node < 0:
        say("  the group's coordinator is unknown right now; nothing killed")
        after_kill()
        return None
    watch = NextCommit(target)
    kafkacluster.kill_node(node, home=home)
    watch.start()
    after_kill()
    time.sleep(rng.uniform(2.0, 6.0))
    kafkacluster.start_node(node, home=home, die_with_parent=True)
    seconds = watch.seconds()
    if not wait_in_sync(home):
        say("  the cluster is not in sync 180s after the kill")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kill", choices=("source", "group"), default="source",
                        help="whom to kill: a source partition's leader, or the consumer group's coordinator")
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
        (path,) = write_pipelines(["grouped"], work, source, bootstrap, batch=max(100, args.events // 20))
        engine = Engine(path, work / "logs", result, idle=600.0)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        parts = list(chunks(rows, args.kills + 1))
        produce_chunk(settings, source, parts[0], PARTITIONS, print)
        engine.ensure_running()
        if not engine.wait_for_progress(0, timeout=300.0):
            raise SystemExit("the engine committed nothing within 300 s; see its log in " + str(work / "logs"))
        for index, part in enumerate(parts[1:], start=1):
            cut = half_of(part)
            before = engine.committed_batch()
            produce_chunk(settings, source, part[:cut], PARTITIONS, print)
            engine.wait_for_progress(before)
            write_rest = functools.partial(produce_chunk, settings, source, part[cut:], PARTITIONS, print)
            if args.kill == "group":
                taken = kill_group_coordinator(engine, rng, home, settings, print, write_rest)
            else:
                taken = inject_kafka("leader_kill_source", engine, rng, home, settings, print, write_rest)
            seconds.append(taken)
            print(f"  [{index}/{args.kills}] {args.kill} kill → next commit: "
                  + (f"{taken:.1f}s" if taken is not None else "none within 180s"), flush=True)
    finally:
        if engine is not None:
            engine.kill()
        kafkacluster.stop(home=home)
    deadlines = sum(log.read_text(errors="replace").count("send_offsets_to_transaction did not return")
                    for log in (work / "logs").glob("*.log"))
    seen = sorted(s for s in seconds if s is not None)
    summary = (f"leaderkill: kill={args.kill} kills={len(seconds)} kill_to_commit["
               + (f"median={statistics.median(seen):.1f}s max={seen[-1]:.1f}s" if seen else "-")
               + f" n={len(seen)}] " + " ".join("-" if s is None else f"{s:.1f}" for s in seconds)
               + f" send_offsets_deadlines={deadlines}")
    print(summary)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
