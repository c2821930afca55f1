"""`make chaos`: exactly once under abuse, checked record by record.

The harness owns a local Kafka broker (its own home, a free port), produces a
seeded changelog into a source topic in chunks, and runs five pipelines as
separate `refold run` processes: a grouped view (sum, count, avg, min, max,
first, last, set; on the native core) and a Top-N view of the changelog, a
grouped view of an upsert topic (`source.form: upsert`) the harness writes beside
it, chunk by chunk: the changelog as the table of each player's latest row
(`+A`/`+C` put the row, `-R` a tombstone); and a windowed view with a lateness (a 1 min
tumble per player, 1 min of lateness, with its deltas) over a topic of its own, written
chunk by chunk too: an out-of-order changelog (`refold.dev.windowload`) whose late
events and late corrections fall within the horizon (they correct written windows) or
beyond it (`late` dead letters), its windows closing all through the faults; and revenue
per region over a join of orders with customers (`refold.dev.joinload`), two topics of its
own written chunk by chunk too, customers moving between regions and leaving all through
the faults (checked by its final view and its folded deltas: a merged join's changelog
depends on the batches, as a re-grouping view's does). The upsert pipeline also materializes
its view and its deltas into a Delta Lake table each (`--lakehouse delta,iceberg`
adds Iceberg tables; without the upsert pipeline the grouped one does). Between
chunks it injects one fault at a random moment, chosen from a seeded plan:

- `kill9`            kill -9 of an engine after it committed new work;
- `kill9_in_commit`  kill -9 inside the Kafka transaction (records sent, not
                     committed) through the engine's REFOLD_TEST_CRASH hook;
- `broker_restart`   kill -9 of the Kafka broker and a restart on the same data;
- `spark_dir_lost`   kill -9 of an engine, then its Spark checkpoint directory
                     deleted (state comes back from `P.state`);
- `zombie`           a second engine with the same pipeline: one is fenced;
- `txn_timeout`      a batch kept open three times past transaction.timeout.ms;
- `python_worker_kill` kill -9 of the engine's Python workers (tasks mid-batch):
                     Spark runs their tasks again;
- `executor_kill`    kill -9 of one of the engine's executor JVMs (on the cluster);
- `spark_worker_kill` kill -9 of a whole Spark worker with its executors, started
                     again a few seconds later (on the cluster);
- `state_dir_lost`   kill -9 of an engine, then its shards' local state stores
                     deleted (restored from `P.state`).

With `--kafka-brokers 3` the broker is a three-node KRaft cluster
(`refold.dev.kafkacluster`) and the other kinds are its faults (`refold.dev.chaoskafka`):
kill -9 of the leader of a source, view, state or checkpoints partition, of a shard's
transaction coordinator, of the active controller; a broker that lost its data; a
rolling restart. `make chaos` runs that part after the single-broker one.

The engines run on a Spark standalone cluster the harness starts (2 workers x 2
cores on 127.0.0.1, each engine 2 executors of 1 core), or with `--local` on
`local[2]` (then the executor and worker faults are left out).

At the end every engine runs until idle, and the harness checks like Kafka's
EosTestDriver: every output read with read_committed; the view changelog record
by record against the reference reducer (a windowed view's: one watermark per source
partition, and its dead letters exactly the reference's, each once); deltas reduced to the view; the lakehouse
tables read back (delta-rs, pyiceberg) equal to the view, the delta tables folded; no
duplicates, no losses (`refold.ops.verify`); every output partition free of open
transactions (last stable offset = high watermark) and accepting a final
transactional marker that a read_committed consumer sees. One line of figures
ends the run; the exit status is non-zero when an anomaly was found.

    python -m refold.dev.chaos [--events 1000000] [--keys 100000] [--kills 100] [--seed 1] [--kafka-brokers 3]
                               [--pipelines grouped,top_n,upsert,window,join]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from refold.dev import kafkacluster, localkafka, localspark, netpartition, sparkprocs
from refold.dev.chaosengine import FAULTS, ChaosResult, Engine, exit_kind
from refold.dev.chaoskafka import KAFKA_FAULTS, final_markers, inject_kafka, wait_in_sync
from refold.dev.chaospipelines import (
    JoinFeed,
    chunks,
    halved,
    produce_chunk,
    produce_upserts,
    upsert_records,
    verify_pipeline,
    window_workload,
    write_pipelines,
)
from refold.dev.hanging import find_hanging
from refold.dev.testing import Workload, generate
from refold.dev.windowload import generate_windowed
from refold.errors import UserError
from refold.kafka.io import (
    admin_client,
    open_transactions,
)
from refold.model import jsonbytes
from refold.recovery.restore import load_checkpoints
from refold.spark.job import spark_checkpoint_dir

CLUSTER_FAULTS = ("executor_kill", "spark_worker_kill")


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    events: int = 1_000_000
    keys: int = 100_000
    retract: float = 0.2
    kills: int = 100  # kill -9 of an engine, kill9 and kill9_in_commit together
    others: int = 5  # of each other fault kind
    other_kinds: tuple[str, ...] = FAULTS[2:]
    seed: int = 1
    partitions: int = 3
    batch: int = 5_000  # max events per micro-batch
    idle: float = 6.0  # --until-idle of every engine run
    pipelines: tuple[str, ...] = ("grouped", "top_n", "upsert", "window", "join")
    lakehouse: tuple[str, ...] = ("delta",)  # tables the upsert (else the grouped) pipeline materializes into too
    cluster: bool = True  # on a standalone cluster the harness starts (else local[2])
    kafka_brokers: int = 1  # 3: a KRaft cluster, and its faults (refold.dev.chaoskafka) for the other kinds


def fault_plan(cfg: ChaosConfig, rng: random.Random) -> list[str]:
    """The seeded order of faults: `kills` kill -9s (a fifth of them inside the commit)
    and `others` of every other kind, shuffled."""
    in_commit = max(1, cfg.kills // 5) if cfg.kills else 0
    plan = ["kill9"] * (cfg.kills - in_commit) + ["kill9_in_commit"] * in_commit
    for kind in cfg.other_kinds:
        plan += [kind] * cfg.others
    rng.shuffle(plan)
    return plan


def inject(kind: str, target: Engine, rng: random.Random, home: Path, say: Any,
           cluster: localspark.ClusterInfo | None = None) -> None:
    """One fault on `target` (whose engine runs and has just committed new work)."""
    if kind in ("python_worker_kill", "executor_kill", "spark_worker_kill"):
        time.sleep(rng.uniform(0.0, 1.5))
        _kill_spark_part(kind, target, rng, say, cluster)
    elif kind == "state_dir_lost":
        target.kill()
        state = target.pipeline.spark.state_dir
        assert state is not None
        shutil.rmtree(Path(state) / target.name, ignore_errors=True)
    elif kind == "kill9":
        time.sleep(rng.uniform(0.0, 2.0))
        target.kill()
    elif kind == "kill9_in_commit":
        target.kill()
        batch = max(0, target.committed_batch())  # -1 while the broker restarts
        target.proc = target.start({"REFOLD_TEST_CRASH": f"in_txn:{batch + 1 + rng.randint(0, 1)}"})
        with contextlib.suppress(subprocess.TimeoutExpired):
            target.proc.wait(240)
        target.kill()  # when the hook's batch never came, kill it anyway
    elif kind == "broker_restart":
        time.sleep(rng.uniform(0.0, 2.0))
        localkafka.restart_hard(home, die_with_parent=False)
    elif kind == "spark_dir_lost":
        target.kill()
        shutil.rmtree(spark_checkpoint_dir(target.pipeline), ignore_errors=True)
    elif kind == "zombie":
        zombie = target.start()
        since = target.committed_batch()
        deadline = time.monotonic() + 240
        # The newer instance fences the older at its init; the older stops when it next
        # touches its transaction. Wait until one of the two has gone.
        while time.monotonic() < deadline:
            if target.proc is None or target.proc.poll() is not None or zombie.poll() is not None:
                break
            time.sleep(0.5)
        old = target.proc
        if old is not None and old.poll() is None and zombie.poll() is None:
            say(f"  zombie: both {target.name} instances still run after 240s; killing the older")
            target.kill(old)
        target.reap()
        if zombie.poll() is None:
            target.proc = zombie
        else:
            target.result.engine_exits[exit_kind(zombie.returncode)] += 1
        target.wait_for_progress(since, timeout=60)
    elif kind == "txn_timeout":
        target.kill()
        target.proc = target.start(
            {"REFOLD_TRANSACTION_TIMEOUT_MS": "4000", "REFOLD_TEST_STALL_IN_TXN_SECONDS": "12"}
        )
    else:
        raise ValueError(kind)


def _kill_spark_part(kind: str, target: Engine, rng: random.Random, say: Any,
                     cluster: localspark.ClusterInfo | None) -> None:
    """kill -9 of the target's Python workers, of one of its executors, or of a whole
    Spark worker (started again after a few seconds)."""
    if kind == "spark_worker_kill":
        assert cluster is not None
        index = rng.randrange(len(cluster.workers))
        localspark.kill_worker(index, home=cluster.home.parent)
        time.sleep(rng.uniform(2.0, 6.0))
        localspark.start(home=cluster.home.parent, quiet=True, die_with_parent=True)
        return
    if cluster is None:
        roots = [target.proc.pid] if target.proc is not None else []
    else:
        app = sparkprocs.application_id(cluster.ui_port, f"refold-{target.name}")
        roots = sorted(sparkprocs.executors(app, cluster.home / "work")) if app is not None else []
        if kind == "executor_kill":
            if roots:
                sparkprocs.kill([rng.choice(roots)])
            else:
                say(f"  executor_kill: no executor of {target.name} found")
            return
    workers = [pid for root in roots for pid in sparkprocs.python_workers(root)]
    if not workers:
        say(f"  python_worker_kill: no Python worker of {target.name} found")
    sparkprocs.kill(workers)


def _finish_and_verify(engines: list[Engine], result: ChaosResult, settings: dict[str, Any], say: Any,
                       upserts: int = 0, windowed: int = 0, join: JoinFeed | None = None) -> None:
    """Run every engine until idle, then check its outputs record by record against the
    reference, its checkpoint's count, and that no transaction is left open. `upserts`:
    how many records the upsert topic holds; `windowed`: the windowed view's topic;
    `join`: the join pipeline's input."""
    for engine in engines:
        engine.kill()
        for _attempt in range(3):
            code = engine.finish()
            if code == 0:
                break
            say(f"  {engine.name} exited {code} in the final run; again (log {engine.log_dir})")
        else:
            result.anomalies.append(f"{engine.name}: the final run did not finish cleanly")
    for number, engine in enumerate(engines, start=1):
        is_window = engine.pipeline.view.window is not None
        feed = join if engine.pipeline.view.join is not None else None
        say(f"checking {engine.name} ({number} of {len(engines)})")
        began = time.monotonic()
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:  # (its GBs go)
            report, peak = pool.submit(verify_pipeline, engine.pipeline, settings, feed).result()
        say(f"  {len(report.anomalies)} anomalies in {report.events:,} input, {report.view_records:,} view and "
            f"{report.delta_records:,} delta records; {time.monotonic() - began:.0f} s, peak {peak / 2**30:.1f} GiB")
        result.view_records += report.view_records
        result.delta_records += report.delta_records
        result.table_rows += report.table_rows
        result.anomalies += [f"{engine.name}: {a}" for a in report.anomalies]
        expected = upserts if engine.pipeline.source.form == "upsert" else windowed if is_window \
            else feed.events if feed is not None else result.events
        if report.events != expected:
            result.anomalies.append(f"{engine.name}: verified {report.events} input records, expected {expected}")
        checkpoints = load_checkpoints(engine.pipeline, settings)
        read = sum(c.records_in for c in checkpoints.values())
        if read != expected:
            result.anomalies.append(f"{engine.name}: the checkpoints count {read} records read, expected {expected}")
        p = engine.pipeline
        topics = [p.outputs.view.topic if p.outputs.view else "", p.outputs.delta.topic if p.outputs.delta else "",
                  p.state_topic, p.checkpoints_topic, p.dlq_topic]
        topics = [t for t in topics if t]
        result.anomalies += open_transactions(settings, topics)
        result.anomalies += final_markers(settings, [t for t in topics if t != p.checkpoints_topic])


def run_chaos(cfg: ChaosConfig, work: Path, *, bootstrap: str | None = None, say: Any = print) -> ChaosResult:
    """Run the whole chaos experiment in `work`; the broker is started (and stopped) here
    unless `bootstrap` names one (then broker restarts are skipped)."""
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    result = ChaosResult()
    home = work / "kafka-home"
    own_broker = bootstrap is None
    on_cluster = cfg.kafka_brokers > 1
    if on_cluster:
        if not own_broker:
            raise UserError("the Kafka cluster's faults need the cluster the harness starts itself")
        bootstrap = kafkacluster.start(kafkacluster.free_port_range(2 * cfg.kafka_brokers), cfg.kafka_brokers,
                                       timeout=180.0, home=home, quiet=True, die_with_parent=True).bootstrap
        say(f"Kafka cluster of {cfg.kafka_brokers} KRaft nodes at {bootstrap}")
    elif own_broker:
        bootstrap = localkafka.start(localkafka.free_port(), home=home, quiet=True, die_with_parent=True).bootstrap
    assert bootstrap is not None
    settings = {"bootstrap.servers": bootstrap}
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engines: list[Engine] = []
    cluster: localspark.ClusterInfo | None = None
    try:
        if cfg.cluster:
            cluster = localspark.start(2, 2, "2g", home=work / "spark-home", quiet=True, die_with_parent=True)
            say(f"Spark standalone cluster at {cluster.url} (2 workers x 2 cores; logs under {cluster.home})")
        say(f"generating {cfg.events:,} events over {cfg.keys:,} keys ({cfg.retract:.0%} retractions/corrections)")
        # a team of about ten players: the Top-N per team re-groups, and the reference's
        # leaderboard (which ranks a group's rows again at every event) stays quick
        workload = Workload(events=cfg.events, keys=cfg.keys, retract_share=cfg.retract, seed=cfg.seed,
                            teams=max(3, cfg.keys // 10))
        rows = [jsonbytes.dumps(r) for r in generate(workload)]
        result.events = len(rows)
        source = f"chaos-source-{uuid.uuid4().hex[:6]}"
        upsert_source = f"chaos-upserts-{uuid.uuid4().hex[:6]}"
        window_source = f"chaos-windows-{uuid.uuid4().hex[:6]}"
        upserts = 0
        window = window_workload(cfg.events, cfg.keys, cfg.seed)
        window_rows = [jsonbytes.dumps(r) for r in generate_windowed(window)] if "window" in cfg.pipelines else []
        join = JoinFeed(cfg.events, cfg.keys, cfg.seed) if "join" in cfg.pipelines else None
        master = cluster.url if cluster is not None else None
        # on the cluster an engine waits out a leader's election (the broker's session timeout,
        # 9 s) before it counts as idle
        idle = max(cfg.idle, 30.0) if on_cluster else cfg.idle
        engines = [Engine(p, logs, result, idle)
                   for p in write_pipelines(cfg.pipelines, work, source, bootstrap, batch=cfg.batch, master=master,
                                            upsert_source=upsert_source, lakehouse=cfg.lakehouse,
                                            window_source=window_source, window=window, join=join)]
        plan = fault_plan(cfg, rng)
        if not own_broker:
            plan = [k for k in plan if k != "broker_restart"]
        if cluster is None:
            plan = [k for k in plan if k not in CLUSTER_FAULTS]
        parts = list(chunks(rows, len(plan) + 1))
        window_parts = list(chunks(window_rows, len(parts))) if window_rows else []
        if join is not None:
            join.cut(len(parts))
        say(f"{len(plan)} faults over {len(parts)} chunks; pipelines {', '.join(e.name for e in engines)}; "
            f"logs in {logs}")
        for index, part in enumerate(parts):
            kind = plan[index] if index < len(plan) else None
            # a leader's kill gets the second half of its chunk (of every topic) written after
            # the kill, so that the engine has input waiting while the cluster elects a new leader
            split = kind is not None and kind.startswith(("leader_kill_", "partition"))

            def write(rows: Sequence[bytes], half: int | None, index: int = index) -> None:
                """Chunk `index` (`rows`, the source's) of every topic: the source, the upsert
                topic's records from it, the windowed and join pipelines' own topics (`half` 0
                or 1: each one's first or second half)."""
                nonlocal upserts
                if rows := halved(rows, half):
                    produce_chunk(settings, source, rows, cfg.partitions, say)
                    if "upsert" in cfg.pipelines:
                        records = upsert_records(rows)
                        produce_upserts(settings, upsert_source, records, cfg.partitions, say)
                        upserts += len(records)
                # the last chunk takes what the windowed input's cut leaves over
                for part_w in (window_parts[index:] if index == len(parts) - 1 else window_parts[index:index + 1]):
                    if rows_w := halved(part_w, half):
                        produce_chunk(settings, window_source, rows_w, cfg.partitions, say)
                if join is not None:
                    join.write(settings, index, index == len(parts) - 1, cfg.partitions, say, half)

            write(part, 0 if split else None)
            if kind is None:
                continue  # the last chunks come after the last fault
            target = engines[index % len(engines)]
            since = max(0, target.committed_batch())
            for engine in engines:
                engine.ensure_running()
            if not target.wait_for_progress(since):
                if target.proc is not None and target.proc.poll() is None:
                    result.stalls += 1  # alive, yet no commit: a liveness bug to look into
                    say(f"  {target.name} made no progress for 180s while running; killing it")
                    target.kill()
                target.reap()
                target.ensure_running()
                target.wait_for_progress(since)
            if kind in KAFKA_FAULTS:
                recovery = inject_kafka(kind, target, rng, home, settings, say,
                                        after_kill=functools.partial(write, part, 1) if split else None)
                if kind.startswith("leader_kill_"):
                    result.leader_recoveries.append(recovery)
            else:
                inject(kind, target, rng, home, say, cluster)
            result.faults[kind] += 1
            elapsed = time.monotonic() - started
            say(f"  [{index + 1}/{len(plan)}] {kind} on {target.name} "
                f"(batch {since}→, {elapsed:.0f}s, {sum(result.faults.values())} faults)")
        say("all faults injected; every engine runs until idle")
        if on_cluster and not wait_in_sync(home):
            result.anomalies.append("the Kafka cluster is not in sync 180s after the last fault")
        _finish_and_verify(engines, result, settings, say, upserts, len(window_rows), join)
        brokers = sorted(admin_client(settings).list_topics(timeout=30).brokers)
        hanging = find_hanging(bootstrap, brokers)
        result.hanging = (len(brokers), len(hanging))
        result.anomalies += [f"find-hanging: {line}" for line in hanging]
    finally:
        for engine in engines:
            engine.kill()
        if cluster is not None:
            localspark.stop(cluster.home.parent)
        if on_cluster:
            kafkacluster.stop(home=home)
            netpartition.remove_cgroups()
        elif own_broker:
            localkafka.stop(home=home)
    result.seconds = time.monotonic() - started
    return result


def _cluster_kinds() -> tuple[str, ...]:
    """The cluster's fault kinds this machine can inject (a partition needs root,
    cgroup v2 and iptables: without them it is left out, with a line saying why)."""
    why = netpartition.unavailable()
    if why is None:
        return KAFKA_FAULTS
    print(f"chaos: no partition faults here: {why}", file=sys.stderr, flush=True)
    return tuple(kind for kind in KAFKA_FAULTS if kind != "partition")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChaosConfig()
    parser.add_argument("--events", type=int, default=defaults.events)
    parser.add_argument("--keys", type=int, default=defaults.keys)
    parser.add_argument("--retract", type=float, default=defaults.retract)
    parser.add_argument("--kills", type=int, default=defaults.kills, help="kill -9s of an engine")
    parser.add_argument("--others", type=int, default=defaults.others, help="faults of every other kind")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="max events per micro-batch")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures there")
    parser.add_argument("--lakehouse", default=",".join(defaults.lakehouse),
                        help="table drivers the upsert (else the grouped) pipeline materializes into too: delta, iceberg, or ''")
    parser.add_argument("--pipelines", default=",".join(defaults.pipelines),
                        help="which pipelines run: grouped, top_n, upsert, window (a tumble with a lateness), "
                             "join (revenue per region over orders joined with customers)")
    parser.add_argument("--local", action="store_true",
                        help="run the engines on local[2], not on a standalone cluster (no executor or worker faults)")
    parser.add_argument("--kafka-brokers", type=int, default=1, choices=(1, 3),
                        help="3: a three-broker KRaft cluster, its faults in place of the other kinds "
                             "(leader, coordinator and controller kills, a lost data directory, a rolling restart)")
    args = parser.parse_args(argv)
    cfg = ChaosConfig(events=args.events, keys=args.keys, retract=args.retract, kills=args.kills,
                      others=args.others, batch=args.batch, seed=args.seed, cluster=not args.local,
                      lakehouse=tuple(d for d in args.lakehouse.split(",") if d),
                      kafka_brokers=args.kafka_brokers,
                      pipelines=tuple(p for p in args.pipelines.split(",") if p),
                      other_kinds=_cluster_kinds() if args.kafka_brokers > 1 else defaults.other_kinds)
    own_work = args.work is None
    work = args.work or Path(tempfile.mkdtemp(prefix="refold-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    for earlier in sorted(set(work.parent.glob("refold-chaos-*")) - {work}) if own_work else ():
        print(f"chaos: another run's folder is there: {earlier} (one that failed or died, or one running)",
              file=sys.stderr)
    from refold.environment import jars_home

    os.environ.setdefault("REFOLD_JARS", str(jars_home()))  # keep the jar cache, move the rest
    os.environ["REFOLD_HOME"] = str(work / "refold-home")

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        result = run_chaos(cfg, work, say=say)
    except KafkaException as exc:
        say(f"chaos: Kafka failed: {exc}; the run's logs and data are kept in {work}")
        return 2
    for anomaly in result.anomalies[:50]:
        say(f"ANOMALY {anomaly}")
    if own_work and not result.anomalies:  # (its brokers' data: gigabytes)
        shutil.rmtree(work, ignore_errors=True)
    elif own_work:
        say(f"chaos: the run's logs and data are kept in {work}")
    print(result.line(), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"config": dataclasses.asdict(cfg),
                                         "faults": dict(result.faults), "events": result.events,
                                         "engine_starts": result.engine_starts,
                                         "engine_exits": dict(result.engine_exits),
                                         "table_rows": result.table_rows,
                                         "anomalies": result.anomalies, "seconds": result.seconds,
                                         "leader_kill_to_commit_s": result.leader_recoveries,
                                         "find_hanging": {"brokers": result.hanging[0],
                                                          "found": result.hanging[1]}}, indent=2))
    return 1 if result.anomalies else 0


if __name__ == "__main__":
    sys.exit(main())
