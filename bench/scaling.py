"""Scaling curves and recovery time of Refold: key space, retraction share, restart.

Three parts (`--parts`, default all):

- keys: for each key-space size in `--keys`, a seeded changelog of `--events` events
  (`refold.dev.testing.Workload` over that many keys, 20 % retractions/corrections) is
  produced to a fresh topic and Refold runs over it (`bench.run.pipeline`, timed by
  `bench.run.timed_run`, each point in a process of its own with its own Spark
  session): events/s, seconds, batches, peak RSS of that process and its JVM, and the number of distinct
  keys the workload touched. With a fixed event count a large key space is only
  partly touched (300k events reach at most 300k of 10M keys; the generator also
  sends 20 % of its appends to the hottest 1 % of keys), so the state grows with
  the touched keys, not with `--keys`: read the curve against `touched_keys`.
- retract: the same at `--retract-keys` keys (default 100k), one point per share
  of retractions/corrections in `--retract`.
- recovery: `--recovery-keys` keys, each with one `+A` event (so every key is live
  and the state holds them all), are produced and reduced by `refold run` as a
  subprocess (the pipeline's YAML is written to the work folder; the process is
  run and killed by `refold.dev.chaos.Engine`). Once everything is committed it is
  killed with SIGKILL, `--chunk` new events are produced, and it is restarted:
  the figure is the seconds from the restart (process start, so the JVM start and
  Spark's are in it) to the first new committed batch (a checkpoint with a higher
  batch number in `P.checkpoints`, read with read_committed and polled by
  `refold.dev.chaos.Engine` about every 1-2 s). Twice: with the Spark checkpoint
  directory kept, and with it deleted (the offsets come from Kafka). The shards'
  local state stores (`spark.state_dir`, under /tmp/refold-bench/state) are kept both
  times, so the state comes from them as they are, not from `P.state`
  (`python -m bench.tasks --parts restart` compares a restart with them and one
  without). When the engine finds a kept directory disagreeing with Kafka's offsets it
  discards it, and recovery.json says so (`spark_checkpoint_discarded`). From the
  engine's JSON log: when the driver had fenced and claimed the shards and when the
  streaming query ran, counted from the restart (the shards' own restore lines are
  logged on the executors' Python workers; see `restore_figures`).

Each point's process first makes a warm-up run (`--warmup-events`, not reported) that
gives its Spark session its Python workers and JIT; its peak RSS is of that process
alone (in one shared process the column would be cumulative). Machines here are noisy: read the shape, not the seconds.

Writes `scaling.json` (keys and retraction curves, the parts that ran) and
`recovery.json` into `--json-dir`; progress goes to stderr, a table per part to stdout.

    python -m bench.scaling [--keys 10000,100000,1000000,10000000] [--retract 0,0.2,0.5]
                            [--events 300000] [--recovery-keys 1000000]
                            [--parts keys,retract,recovery] [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import yaml
from confluent_kafka import KafkaException

from bench.latency import append_event, prepare_topics, run_info, say, write_json
from bench.run import RESULTS, forget_state, pipeline, timed_run
from refold.cli.produce import produce
from refold.config import Pipeline
from refold.dev.chaos import ChaosResult, Engine
from refold.dev.testing import Workload, generate
from refold.model import jsonbytes
from refold.recovery.restore import load_checkpoint
from refold.spark.job import spark_checkpoint_dir, spark_session

PARTS = ("keys", "retract", "recovery")
RECOVERY_TARGET_S = 60.0
# the driver: "recovered P: 4 shard(s) fenced and claimed for run R, batch B, offsets {…} (1.2s)"
CLAIMED = re.compile(r"fenced and claimed .*\((\d+(?:\.\d+)?)s\)$")
# the driver, from a shard task's summary: "shard 0 started on worker pid 123: state store restored (why; N
# P.state records read, 3.4s)"
SHARD_RECOVERED = re.compile(r"state store (\w+) \(.*; (\d+) P\.state records read, (\d+(?:\.\d+)?)s\)$")
DISCARDED = "disagrees with Kafka's committed offsets"
TOUCHED_NOTE = ("every point has the same event count, so a large key space is only partly touched "
                "(touched_keys); state size follows touched_keys, not keys")


@dataclass(frozen=True, slots=True)
class Settings:
    bootstrap: str
    run_id: str
    events: int
    batch: int
    partitions: int
    seed: int

    @property
    def kafka(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap}


def numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """argparse type: a comma-separated list of `kind`."""

    def parse(text: str) -> list[Any]:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values

    return parse


def produce_lines(s: Settings, topic: str, lines: list[bytes]) -> None:
    started = time.monotonic()
    produce(s.kafka, topic, lines, ["player_name"], partitions=s.partitions, per_transaction=50_000,
            prevalidate=False, progress=False)
    seconds = time.monotonic() - started
    say(f"  produced {len(lines):,} events to {topic} in {seconds:.1f}s")


def workload_lines(workload: Workload) -> tuple[list[bytes], int]:
    """The workload's events as JSON lines, and how many distinct keys they touch."""
    keys: set[str] = set()
    lines = []
    for record in generate(workload):
        keys.add(record[workload.key_column])
        lines.append(jsonbytes.dumps(record))
    return lines, len(keys)


# The throughput curves ---------------------------------------------------------------


def throughput_point(s: Settings, spark: Any, keys: int, retract: float, tag: str) -> dict[str, Any]:
    """Refold over a fresh topic of `s.events` events at `keys` keys and `retract` share."""
    name = f"bench-scaling-{s.run_id}-{tag}"
    say(f"{tag}: {s.events:,} events over {keys:,} keys, {retract:.0%} retractions/corrections")
    lines, touched = workload_lines(Workload(events=s.events, keys=keys, retract_share=retract, seed=s.seed))
    produce_lines(s, name, lines)
    p = pipeline(name, name, s.bootstrap, s.batch)
    prepare_topics(s.kafka, p, s.partitions)
    try:
        result = timed_run(p, s.bootstrap, spark, len(lines))
    finally:
        forget_state(p)
    say(f"  {result['events_per_s']:,.0f} events/s over {touched:,} touched keys "
        f"({result['seconds']:.1f}s, peak RSS {result['peak_rss_bytes'] / 2**20:,.0f} MiB)")
    return {"keys": keys, "retract_share": retract, "events": len(lines), "touched_keys": touched, **result}


def print_curve(title: str, points: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'keys':>12} {'touched':>10} {'retract':>8} {'events/s':>10} {'seconds':>8} {'batches':>8} {'peak RSS':>10}")
    for p in points:
        print(f"{p['keys']:>12,} {p['touched_keys']:>10,} {p['retract_share']:>8.0%} {p['events_per_s']:>10,.0f} "
              f"{p['seconds']:>8.1f} {p['batches']:>8} {p['peak_rss_bytes'] / 2**20:>6,.0f} MiB")


def curves(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """The keys and retraction curves the chosen parts ask for, each point in a process
    of its own (its own Spark session and warm-up), so its peak RSS is its own."""
    out: dict[str, Any] = {}
    if "keys" in args.parts:
        points = [point_process(s, args, k, 0.2, f"k{k}") for k in args.keys]
        out["keys_curve"] = {"retract_share": 0.2, "points": points}
    if "retract" in args.parts:
        points = [point_process(s, args, args.retract_keys, r, f"r{round(r * 100)}") for r in args.retract]
        out["retract_curve"] = {"keys": args.retract_keys, "points": points}
    if "keys_curve" in out:
        print_curve(f"throughput vs key space ({s.events:,} events each, 20% retractions/corrections; "
                    "a fixed event count touches only part of a large key space)", out["keys_curve"]["points"])
    if "retract_curve" in out:
        print_curve(f"throughput vs retraction share ({s.events:,} events each, {args.retract_keys:,} keys)",
                    out["retract_curve"]["points"])
    return out


def point_process(s: Settings, args: argparse.Namespace, keys: int, retract: float, tag: str) -> dict[str, Any]:
    """One curve point in a fresh `python -m bench.scaling --point …` process."""
    with tempfile.TemporaryDirectory(prefix="refold-scaling-point-") as folder:
        result = Path(folder) / "point.json"
        command = [sys.executable, "-m", "bench.scaling", "--point", f"{tag},{keys},{retract}",
                   "--point-json", str(result), "--run-id", s.run_id, "--bootstrap", s.bootstrap,
                   "--events", str(s.events), "--batch", str(s.batch), "--partitions", str(s.partitions),
                   "--seed", str(s.seed), "--warmup-events", str(args.warmup_events)]
        done = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, check=False)
        if done.returncode != 0:
            raise SystemExit(f"scaling point {tag}: exit {done.returncode}")
        point: dict[str, Any] = orjson.loads(result.read_bytes())
        return point


def one_point(s: Settings, args: argparse.Namespace) -> None:
    """`--point TAG,KEYS,RETRACT`: a warm-up run (not reported), then the point; its
    figures go to `--point-json`."""
    tag, keys, retract = args.point.split(",")
    spark = spark_session(name=f"refold-scaling-{tag}")
    try:
        if args.warmup_events:
            warm = Settings(s.bootstrap, s.run_id, args.warmup_events, s.batch, s.partitions, s.seed)
            say("warm-up run (not reported):")
            throughput_point(warm, spark, 1_000, 0.2, f"warmup-{tag}")
        point = throughput_point(s, spark, int(keys), float(retract), tag)
    finally:
        spark.stop()
    args.point_json.write_bytes(orjson.dumps(point))


# Recovery ----------------------------------------------------------------------------


def live_keys(keys: int, seed: int) -> list[bytes]:
    """One `+A` per key over exactly `keys` keys, named as `refold.dev.testing` names them."""
    rng = random.Random(seed)
    start = 1_700_000_000_000
    return [append_event(f"k{i:07d}", rng.randint(0, 1000), start + i) for i in range(keys)]


def write_yaml(p: Pipeline, folder: Path) -> Path:
    path = folder / f"{p.pipeline}.yaml"
    path.write_text(yaml.safe_dump(p.model_dump(mode="json", by_alias=True, exclude_unset=True), sort_keys=False))
    return path


def wait_for_records(engine: Engine, settings: dict[str, Any], total: int, timeout: float) -> float:
    """Until the engine's checkpoint counts `total` events read; the seconds it took."""
    started = last_report = time.monotonic()
    done = 0
    while True:
        done = committed_events(engine, settings, done)
        now = time.monotonic()
        if done >= total:
            return now - started
        if engine.proc is None or engine.proc.poll() is not None:
            raise SystemExit(f"recovery: `refold run` exited after {done:,} of {total:,} events "
                             f"(log: {engine_log(engine)})")
        if now - started > timeout:
            raise SystemExit(f"recovery: {done:,} of {total:,} events committed after {timeout:g}s "
                             f"(log: {engine_log(engine)})")
        if now - last_report >= 15:
            last_report = now
            say(f"  {done:,} of {total:,} events committed ({now - started:.0f}s)")
        time.sleep(1.0)


def committed_events(engine: Engine, settings: dict[str, Any], before: int) -> int:
    """The events the engine's last checkpoint counts as read (`before` while Kafka
    cannot say, e.g. just after the topics were created)."""
    try:
        checkpoint = load_checkpoint(engine.pipeline, settings)
    except KafkaException:
        return before
    return checkpoint.records_in if checkpoint else 0


def engine_log(engine: Engine) -> Path:
    """The stderr log of the engine's latest run (refold.dev.chaos.Engine names them so)."""
    return engine.log_dir / f"{engine.name}.{engine.runs:04d}.log"


def log_messages(log: Path) -> list[tuple[float, str]]:
    """(epoch seconds, message) of the engine's JSON log lines (`refold run` logs JSON
    lines when stderr is not a terminal); Spark's own lines are skipped."""
    out = []
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = orjson.loads(line)
            out.append((datetime.fromisoformat(entry["time"]).timestamp(), str(entry["message"])))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


def restore_figures(log: Path, restarted: float) -> dict[str, Any]:
    """From the engine's log (seconds after `restarted`, an epoch time): when the driver
    had fenced and claimed the shards (`recovered_after_s`; the JVM's and Spark's start
    overlap it) and when the query ran; whether the Spark checkpoint directory was
    discarded. The shards' stores are brought to their checkpoints in the first batch's
    tasks, on the executors; the driver logs each from the task's summary ("shard N
    started on worker …: state store how (why; records read, seconds)"): `state_records`
    sums the records read over the shards, `state_restore_s` is the longest."""
    figures: dict[str, Any] = {"state_records": None, "state_restore_s": None, "recovered_after_s": None,
                               "query_running_after_s": None, "spark_checkpoint_discarded": False,
                               "stores": {}}
    for at, message in log_messages(log):
        claimed = CLAIMED.search(message) if message.startswith("recovered") else None
        shard = SHARD_RECOVERED.search(message) if message.startswith("shard ") else None
        if claimed:
            figures["recovered_after_s"] = at - restarted
        elif shard:
            figures["stores"][shard.group(1)] = figures["stores"].get(shard.group(1), 0) + 1
            figures["state_records"] = (figures["state_records"] or 0) + int(shard.group(2))
            figures["state_restore_s"] = max(figures["state_restore_s"] or 0.0, float(shard.group(3)))
        elif message.startswith("pipeline ") and " running: " in message:
            figures["query_running_after_s"] = at - restarted
        elif DISCARDED in message:
            figures["spark_checkpoint_discarded"] = True
    return {**figures, "log": str(log)}


def restart(engine: Engine, s: Settings, chunk: int, keys: int, keep: bool, seed: int) -> dict[str, Any]:
    """Kill -9, new events, restart; seconds to the first new committed batch."""
    settle = max(2.0, 5 * engine.pipeline.trigger_seconds)
    time.sleep(settle)  # let Spark record the last batch in its own commit log
    engine.kill()
    spark_dir = spark_checkpoint_dir(engine.pipeline)
    if not keep:
        shutil.rmtree(spark_dir, ignore_errors=True)
    present = spark_dir.is_dir()
    lines, _touched = workload_lines(Workload(events=chunk, keys=keys, retract_share=0.0, seed=seed))
    produce_lines(s, engine.pipeline.source.topic, lines)
    since = engine.committed_batch()
    started, restarted = time.monotonic(), time.time()
    engine.ensure_running()
    if not engine.wait_for_progress(since, timeout=900):
        raise SystemExit(f"recovery: no new batch committed within 900s of the restart (log: {engine_log(engine)})")
    seconds = time.monotonic() - started
    say(f"  first new batch {seconds:.1f}s after the restart "
        f"({'with' if keep else 'without'} the Spark checkpoint directory)")
    return {"seconds": seconds, "spark_checkpoint_present": present, "new_events": len(lines),
            "batch_before": since, **restore_figures(engine_log(engine), restarted)}


def recovery(s: Settings, keys: int, chunk: int, work: Path) -> dict[str, Any]:
    name = f"bench-recovery-{s.run_id}"
    say(f"recovery: {keys:,} live keys, then kill -9 and {chunk:,} new events, twice; work folder {work}")
    initial = live_keys(keys, s.seed)
    produce_lines(s, name, initial)
    p = pipeline(name, name, s.bootstrap, s.batch)
    prepare_topics(s.kafka, p, s.partitions)
    engine = Engine(write_yaml(p, work), work / "logs", ChaosResult(), idle=3600.0)
    engine.log_dir.mkdir(parents=True, exist_ok=True)
    total = len(initial)
    try:
        engine.ensure_running()
        build_s = wait_for_records(engine, s.kafka, total, timeout=7200)
        say(f"  the state of {keys:,} keys is committed ({build_s:.0f}s from the first start)")
        runs: dict[str, Any] = {}
        for label, keep in (("with_spark_checkpoint", True), ("without_spark_checkpoint", False)):
            runs[label] = restart(engine, s, chunk, keys, keep, s.seed + len(runs) + 1)
            total += runs[label]["new_events"]
            wait_for_records(engine, s.kafka, total, timeout=1800)
    finally:
        engine.kill()
        forget_state(p)  # its local stores and Spark checkpoint (the logs stay in the work folder)
    return {"keys": keys, "initial_events": len(initial), "initial_build_s": build_s, "chunk": chunk,
            "batch": s.batch, "partitions": s.partitions, "trigger": p.trigger, "target_s": RECOVERY_TARGET_S,
            "pipeline": name, "runs": runs}


def print_recovery(result: dict[str, Any]) -> None:
    print(f"\nrecovery after kill -9 ({result['keys']:,} live keys, {result['chunk']:,} new events; "
          f"target ≤ {result['target_s']:.0f}s)")
    print(f"{'run':<26} {'1st batch':>10} {'recovered':>10} {'query up':>9} {'state records':>14} "
          f"{'restore':>8} {'Spark dir':>10}")
    for label, r in result["runs"].items():
        spark_dir = "discarded" if r["spark_checkpoint_discarded"] else ("kept" if r["spark_checkpoint_present"]
                                                                          else "deleted")
        print(f"{label:<26} {r['seconds']:>9.1f}s {seconds(r['recovered_after_s']):>10} "
              f"{seconds(r['query_running_after_s']):>9} {optional(r['state_records']):>14} "
              f"{seconds(r['state_restore_s']):>8} {spark_dir:>10}")
    print("(seconds after the restart: to the first new committed batch, to the end of the engine's recovery "
          "(JVM and Spark start included), to the streaming query running; restore: reading P.checkpoints and "
          "P.state and rebuilding the reducer; Spark dir discarded: the engine found it disagreeing with Kafka's offsets)")


def seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}s"


def optional(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=numbers(int), default=[10_000, 100_000, 1_000_000, 10_000_000],
                        help="key-space sizes of the keys curve, comma-separated")
    parser.add_argument("--retract", type=numbers(float), default=[0.0, 0.2, 0.5],
                        help="retraction/correction shares of the retraction curve, comma-separated")
    parser.add_argument("--retract-keys", type=int, default=100_000, help="key space of the retraction curve")
    parser.add_argument("--events", type=int, default=300_000, help="events per curve point")
    parser.add_argument("--warmup-events", type=int, default=20_000,
                        help="events of an unreported first run that warms the Spark session (0: none)")
    parser.add_argument("--recovery-keys", type=int, default=1_000_000, help="live keys in the recovered state")
    parser.add_argument("--chunk", type=int, default=1_000, help="new events produced before each restart")
    parser.add_argument("--parts", type=numbers(str), default=list(PARTS), help=f"which parts: {','.join(PARTS)}")
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch")
    parser.add_argument("--partitions", type=int, default=4, help="source partitions")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-dir", type=Path, default=RESULTS, help="where scaling.json and recovery.json go")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # TAG,KEYS,RETRACT: one point (internal)
    parser.add_argument("--point-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None,
                        help="recovery's working folder: pipeline YAML, engine logs (default: a temporary one)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(PARTS)}")
    if any(k < 1 for k in args.keys) or any(not 0 <= r < 1 for r in args.retract):
        parser.error("--keys must be positive and --retract shares in [0, 1)")

    from refold.dev.localkafka import ensure_broker

    info = run_info()
    s = Settings(ensure_broker(args.bootstrap, start_local=True), args.run_id or info["run"], args.events, args.batch,
                 args.partitions, args.seed)
    if args.point:
        one_point(s, args)
        return 0
    common = {**info, "events": args.events, "batch": args.batch, "partitions": args.partitions, "seed": args.seed,
              "warmup_events": args.warmup_events, "note": TOUCHED_NOTE}
    if {"keys", "retract"} & set(args.parts):
        figures = curves(s, args)
        write_json(args.json_dir / "scaling.json", {**common, **figures})
    if "recovery" in args.parts:
        work = args.work or Path(tempfile.mkdtemp(prefix="refold-recovery-"))
        work.mkdir(parents=True, exist_ok=True)
        result = recovery(s, args.recovery_keys, args.chunk, work)
        print_recovery(result)
        write_json(args.json_dir / "recovery.json", {**info, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
