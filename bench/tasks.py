"""The executor model's figures (the shards reduce in Spark tasks): four parts, each
measured in one run on this machine and printed as ratios.

- cpu: CPU seconds per event on the driver against on the executors. `run_pipeline`
  runs in a process of its own with Spark `local[2]` (a warm-up run first, not
  reported, so the Python workers exist and have imported Refold), over a fresh topic
  of `--cpu-events` events. Measured from the run's start (`run_pipeline` called) to
  the first sample after its last commit (sampled every 0.25 s, so the idle wait
  that ends the run is left out), from `/proc`: *driver* = that Python process (every
  thread of it: py4j's callback threads that run `foreachBatch`, the monitor, the
  start's fencing and claiming, librdkafka's threads), by `getrusage(RUSAGE_SELF)`,
  less the sampling thread's own CPU; *executors* = the Spark Python processes under
  its JVM (`python -m refold.spark.daemon` and the workers it forks, which run the
  `ShardTask`s): their user+system CPU, plus what the daemon reaped of workers that
  exited (cutime/cstime); *JVM* = the one Spark JVM, which in `local[N]` is the driver's
  JVM and the executor's in one (Kafka fetches, Arrow conversion, scheduling), so it
  is reported beside, in neither share. The figure: driver / (driver + executors),
  target ≤ 5 %. It includes the run's fixed costs (fencing, claiming, the query's
  start), which a long run spreads over more events: `driver_cpu_per_batch_s` says
  what a batch costs the driver.
- workers: throughput with 1 executor of 1 core against 2 executors of 1 core each,
  on a Spark standalone cluster of 2 workers x 1 core started for this part
  (`refold.dev.localspark`, stopped after it), over the same 4-partition topic of
  `--workers-events` events; each size in a process of its own (its own Spark
  application: `spark.executor.cores=1`, `spark.cores.max=1|2`) with a warm-up run
  first. Also the CPU of each cluster worker's executor (its Python processes, its
  JVM) during the measured run, to show that both executors reduced, and the driver's
  (this point's Python process and its JVM, which here is the driver's alone): the
  CPU split with the JVMs counted on both sides. Target ratio ≥ 1.5. Each worker JVM
  (and so each executor it launches, and its Python workers) is pinned to a core of
  its own (`sched_setaffinity`: worker i to core i mod the machine's cores), so that
  "1 core" is one: unpinned, the 1-executor run's JVM fetches on the second core
  while its Python worker reduces on the first. `--no-pin` measures unpinned. The
  driver and the broker are not pinned and share both cores with the executors, so
  the ratio is a floor of what two machines would give.
- restart: `refold run` as a subprocess (`refold.dev.chaos.Engine`, Spark `local[2]`)
  over `--restart-keys` live keys (one `+A` each) until all are committed; then
  kill -9, `--chunk` new events over those keys, restart: the seconds from the
  process start to the first new committed batch (a higher batch in `P.checkpoints`),
  first with the executors' local stores (`spark.state_dir`) intact, then with them
  deleted (the first batch's tasks restore them from `P.state`). The Spark
  checkpoint directory is kept both times. Ratio: cold / intact. From the engine's
  log, also when the query ran (JVM, Spark and the driver's claim: the same work
  both times) and the rest, the first batch's tasks, where the stores differ.
- keys: many live keys against 10k. For each key count (10,000 and `--many-keys`),
  in a process of its own (`local[2]`, a warm-up run first): a load run over that
  many live keys (one `+A` each, every event a new key), then a measured run, after a
  restart of the query (so every shard's reducer starts empty and loads the keys it
  touches from its store), of `--keys-events` events over the same key space (20 %
  retractions/corrections, `refold.dev.testing.Workload`; with fewer events than keys
  only part of them is touched: `touched_keys`). Reported: both runs' events/s and the
  peak RSS of each Spark Python worker process and of each shard host
  (`refold.spark.hosts`, forked from a worker, named `refold-host`: the reducers'
  keys live there, the workers only relay) (sampled from `/proc` every 0.25 s; a worker lives on from
  run to run). Ratio: the measured run's events/s at
  `--many-keys` / at 10k keys. `--state-cache-keys` sets `spark.state_cache_keys`
  (keys a shard's reducer keeps in memory, default 200,000 a shard: past 4 x that,
  with 4 shards, the reducers start empty again) for both. `--keys-cluster` runs it
  on a standalone cluster of 2 workers x 1 core (pinned, as in the workers part) and
  also reports each executor's peak RSS: the sum over its JVM and its Python
  processes, sampled together.

- regroup: a view that re-groups (keyed by `team`, `--regroup-teams` values, over the
  same topic keyed by player) in `shards: 1` against `shards: 2`, both on the 2-worker
  cluster of the workers part (pinned the same way, both executors), and beside them
  the same view as one shard (no `shards`: today's merge of every partition). Each in
  a Spark application of its own, a warm-up run first. Target: shards 2 / shards 1 ≥ 1.5.

Throughput is events / (the last committed batch - the run's start after the
driver's fencing), as `bench.run.timed_run` counts it. Writes `tasks.json` into
`--json-dir` (default docs/bench) with the parts that ran; progress goes to stderr,
the summary to stdout. Machines here are noisy: read the ratios, not the seconds.

    python -m bench.tasks [--parts cpu,workers,restart,keys] [--batch 100000]
                          [--cpu-events 300000] [--workers-events 600000]
                          [--warmup-events 200000] [--no-pin] [--restart-keys 200000]
                          [--many-keys 200000] [--keys-events 100000] [--keys-cluster]
                          [--json-dir docs/bench]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.latency import prepare_topics, run_info, say, write_json
from bench.procs import rss_bytes, tree_of
from bench.run import RESULTS, forget_state, pipeline
from bench.scaling import (
    Settings,
    engine_log,
    live_keys,
    numbers,
    produce_lines,
    restore_figures,
    wait_for_records,
    write_yaml,
)
from refold.dev.testing import Workload, generate
from refold.model import jsonbytes

PARTS = ("cpu", "workers", "restart", "keys", "regroup")
ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/refold-bench/tasks")  # the parts' local stores (spark.state_dir) and logs
MARKERS = ("pyspark.daemon", "refold.spark.daemon", "pyspark.worker")  # a Spark Python process's command line
TICK = os.sysconf("SC_CLK_TCK")
TARGETS = {"cpu": 0.05, "workers": 1.5, "regroup": 1.5}
BASE_KEYS = 10_000  # the keys part's reference key count


# /proc -------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[int, str, float, float] | None:
    """(ppid, comm, own CPU s, reaped children's CPU s) of a process; None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    own = (int(fields[11]) + int(fields[12])) / TICK
    reaped = (int(fields[13]) + int(fields[14])) / TICK
    return int(fields[1]), comm, own, reaped


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def comm(pid: int) -> str:
    """The process's name (a shard host forked from a worker is named `refold-host`)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def spark_python(pid: int) -> bool:
    """A Spark Python process: the daemon or a worker it forked (never the JVM, whose
    class path names pyspark's jars)."""
    stat = proc_stat(pid)
    return stat is not None and stat[1] != "java" and any(marker in cmdline(pid) for marker in MARKERS)


def cpu_snapshot(root: int) -> dict[str, float]:
    """CPU seconds so far under `root` (not counting `root` itself): the Spark Python
    processes (their own CPU and what they reaped of exited workers) and the JVMs
    (their own: every thread)."""
    python = jvm = 0.0
    for pid in tree_of(root):
        if pid == root:
            continue
        stat = proc_stat(pid)
        if stat is None:
            continue
        _ppid, comm, own, reaped = stat
        if comm == "java":
            jvm += own
        elif spark_python(pid):
            python += own + reaped
    return {"python_workers_s": python, "jvm_s": jvm}


def machine_busy() -> float:
    """CPU seconds the machine's cores have spent busy since boot, all processes
    (`/proc/stat`: everything but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def driver_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class CpuSample:
    at: float  # time.monotonic()
    driver_s: float  # this process, less the sampler thread's own CPU
    local: dict[str, float]  # cpu_snapshot(this process)
    cluster: list[dict[str, float]]  # cpu_snapshot of each standalone worker
    machine_s: float  # machine_busy(): every process, the broker's and this bench's too


class Sampler:
    """Samples `/proc` every `interval` s in a thread of its own: the peak RSS of every
    Spark Python process under this process and `cluster` (the standalone workers'
    JVMs), and CPU samples (`CpuSample`), so a run's CPU can be read up to its last
    commit (not through the idle wait that ends it). The thread's own CPU is left out
    of the driver's."""

    def __init__(self, cluster: list[int], interval: float = 0.25) -> None:
        self.cluster = cluster
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        # each standalone worker's executors together (JVMs and Python processes): peak RSS
        self.executor_peaks: list[int] = [0] * len(cluster)
        self.samples: list[CpuSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def sample(self) -> CpuSample:
        return CpuSample(time.monotonic(), driver_cpu() - self._own(), cpu_snapshot(os.getpid()),
                         [cpu_snapshot(pid) for pid in self.cluster], machine_busy())

    def _own(self) -> float:
        return time.thread_time() if threading.current_thread() is self._thread else self._own_s

    _own_s = 0.0

    def _run(self) -> None:
        while True:
            trees = {root: tree_of(root) for root in (os.getpid(), *self.cluster)}  # one /proc walk each
            for index, worker in enumerate(self.cluster):
                executors = sum(rss_bytes(pid) for pid in trees[worker] if pid != worker)
                self.executor_peaks[index] = max(self.executor_peaks[index], executors)
            for tree in trees.values():
                for pid in tree:
                    if pid in self.roles or spark_python(pid):
                        if pid not in self.roles:
                            stat = proc_stat(pid)
                            parent = proc_stat(stat[0]) if stat is not None else None
                            self.roles[pid] = ("host" if comm(pid) == "refold-host" else
                                               "daemon" if parent is not None and parent[1] == "java" else "worker")
                        self.peaks[pid] = max(self.peaks.get(pid, 0), rss_bytes(pid))
            self.samples.append(self.sample())
            self._own_s = time.thread_time()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Sampler:
        self.samples.append(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def at(self, moment: float) -> CpuSample:
        """The first sample taken at or after `moment` (the last one when none was)."""
        return next((sample for sample in self.samples if sample.at >= moment), self.samples[-1])

    def workers(self, role: str = "worker") -> list[int]:
        """Each worker process's (or, `role="host"`, shard host's) peak RSS (bytes), largest first."""
        return sorted((peak for pid, peak in self.peaks.items() if self.roles.get(pid) == role), reverse=True)


# One Spark application (a process of its own) ----------------------------------------


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """`--point SPEC`: one Spark session (`spec["master"]`, `spec["conf"]`) and its runs in
    order: each produces what it says first (`live`: that many live keys; `workload`:
    Workload events), then runs `run_pipeline` until idle, sampled by a `Sampler`
    (`cpu`: report the CPU split, from the run's start to the sample just after its
    last commit; `rss`: report the Spark Python processes' peak RSS)."""
    from refold.spark.job import run_pipeline, spark_session

    settings = {"bootstrap.servers": spec["bootstrap"]}
    cluster = spec.get("cluster_workers") or []
    spark = spark_session(spec["master"], spec.get("conf") or {}, name=spec["name"])
    out: list[dict[str, Any]] = []
    try:
        for run in spec["runs"]:
            produced = _produce_step(settings, run, spec)
            p = pipeline(run["pipeline"], run["source"], spec["bootstrap"], spec["batch"], state_dir=spec["state_dir"],
                         spark=spec.get("pipeline_spark"), key=run.get("key", "player_name"), shards=run.get("shards"))
            prepare_topics(settings, p, spec["partitions"])
            with Sampler(cluster) as sampler:
                progress = run_pipeline(p, spec["bootstrap"], until_idle=spec["idle"], spark=spark, quiet=True)
            if progress.last_commit is None:
                raise SystemExit(f"{p.pipeline}: no batch committed")
            events = run["events"]
            if progress.events != events:
                raise SystemExit(f"{p.pipeline}: reduced {progress.events} events, expected {events}")
            seconds = progress.last_commit - progress.started
            result: dict[str, Any] = {"label": run["label"], "pipeline": p.pipeline, "events": events,
                                      "seconds": seconds, "events_per_s": events / seconds,
                                      "batches": progress.batches, **produced}
            if run.get("cpu"):
                result.update(cpu_split(sampler.samples[0], sampler.at(progress.last_commit), progress.batches))
            if run.get("rss"):
                peaks = sampler.workers()
                hosts = sampler.workers("host")
                result.update(host_peak_rss_bytes=hosts[0] if hosts else None, host_peak_rss_each=hosts)
                result.update(worker_peak_rss_bytes=peaks[0] if peaks else None, worker_peak_rss_each=peaks,
                              daemon_peak_rss_bytes=max((v for pid, v in sampler.peaks.items()
                                                         if sampler.roles[pid] == "daemon"), default=None))
                if cluster:  # an executor: its JVM and its Python processes, on each worker
                    result.update(executor_peak_rss_each=sampler.executor_peaks)
            say(f"  {run['label']}: {events:,} events, {result['events_per_s']:,.0f} events/s "
                f"({seconds:.1f}s, {progress.batches} batches)")
            out.append(result)
            if not run.get("keep_state"):
                forget_state(p)
    finally:
        spark.stop()
    return {"runs": out}


def cpu_split(before: CpuSample, after: CpuSample, batches: int) -> dict[str, Any]:
    """The CPU between two samples: the driver's Python process; the Spark JVM under it
    (in local mode the driver's and the executor's in one; on a cluster the driver's
    alone); the Spark Python processes under it (local mode's executor) and, on a
    standalone cluster, each worker's executor (its Python processes, its JVM)."""
    driver = after.driver_s - before.driver_s
    local_python = after.local["python_workers_s"] - before.local["python_workers_s"]
    jvm = after.local["jvm_s"] - before.local["jvm_s"]
    cluster_python = [a["python_workers_s"] - b["python_workers_s"]
                      for a, b in zip(after.cluster, before.cluster, strict=True)]
    cluster_jvm = [a["jvm_s"] - b["jvm_s"] for a, b in zip(after.cluster, before.cluster, strict=True)]
    executor_python = local_python + sum(cluster_python)
    figures: dict[str, Any] = {
        "cpu_window_s": after.at - before.at, "driver_cpu_s": driver, "jvm_cpu_s": jvm,
        "executor_python_cpu_s": executor_python, "driver_cpu_per_batch_s": driver / max(1, batches),
        "driver_share": driver / (driver + executor_python) if driver + executor_python else None,
        # the share of the machine's cores busy (any process): near 1, no core was left for more shards
        "machine_busy_share": (after.machine_s - before.machine_s) / ((after.at - before.at) * (os.cpu_count() or 1)),
    }
    if after.cluster:  # the JVM under this process is the driver's alone: a split with the JVMs too
        executors = executor_python + sum(cluster_jvm)
        figures.update(cluster_worker_python_cpu_s=cluster_python, cluster_executor_jvm_cpu_s=cluster_jvm,
                       driver_with_jvm_share=(driver + jvm) / ((driver + jvm + executors) or 1))
    return figures


def _produce_step(settings: dict[str, Any], run: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    s = Settings(spec["bootstrap"], "point", 0, spec["batch"], spec["partitions"], spec["seed"])
    if "live" in run:
        produce_lines(s, run["source"], live_keys(run["live"], spec["seed"]))
        return {"live_keys": run["live"]}
    if "workload" in run:
        w = run["workload"]
        records = list(generate(Workload(events=w["events"], keys=w["keys"], retract_share=w["retract"],
                                         seed=w["seed"], teams=w.get("teams", 3))))
        produce_lines(s, run["source"], [jsonbytes.dumps(r) for r in records])
        touched = len({r["player_name"] for r in records})
        return {"keys": w["keys"], "touched_keys": touched, "retract_share": w["retract"]}
    return {}


def point(spec: dict[str, Any]) -> dict[str, Any]:
    """`run_point` in a fresh `python -m bench.tasks --point …` process."""
    with tempfile.TemporaryDirectory(prefix="refold-tasks-point-") as folder:
        result = Path(folder) / "point.json"
        command = [sys.executable, "-m", "bench.tasks", "--point", orjson.dumps(spec).decode(),
                   "--point-json", str(result)]
        done = subprocess.run(command, cwd=ROOT, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{spec['name']}: exit {done.returncode}")
        figures: dict[str, Any] = orjson.loads(result.read_bytes())
        return figures


# The parts ---------------------------------------------------------------------------


def base_spec(s: Settings, args: argparse.Namespace, name: str) -> dict[str, Any]:
    return {"name": name, "bootstrap": s.bootstrap, "batch": s.batch, "partitions": s.partitions, "seed": s.seed,
            "state_dir": str(WORK / "state"), "idle": args.idle, "master": "local[2]", "conf": {},
            "pipeline_spark": {"state_cache_keys": args.state_cache_keys} if args.state_cache_keys else None}


def workload_topic(s: Settings, topic: str, events: int, keys: int) -> int:
    lines = [jsonbytes.dumps(r) for r in generate(Workload(events=events, keys=keys, retract_share=0.2, seed=s.seed))]
    produce_lines(s, topic, lines)
    return len(lines)


def part_cpu(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    say(f"cpu: {args.cpu_events:,} events over {args.cpu_keys:,} keys, local[2], driver vs executor CPU")
    warm, topic = f"bench-tasks-{s.run_id}-cpu-warm", f"bench-tasks-{s.run_id}-cpu"
    warm_events = workload_topic(s, warm, args.warmup_events, 1_000)
    events = workload_topic(s, topic, args.cpu_events, args.cpu_keys)
    spec = base_spec(s, args, f"refold-tasks-cpu-{s.run_id}")
    spec["runs"] = [
        {"label": "warm-up (not reported)", "pipeline": f"{warm}-p", "source": warm, "events": warm_events},
        {"label": "measured", "pipeline": f"{topic}-p", "source": topic, "events": events, "cpu": True},
    ]
    measured = point(spec)["runs"][-1]
    return {"events": events, "keys": args.cpu_keys, "master": "local[2]", "target_driver_share": TARGETS["cpu"],
            **measured}


def part_workers(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    say(f"workers: {args.workers_events:,} events over {args.workers_keys:,} keys, {s.partitions} partitions, "
        "1 executor x 1 core vs 2 executors x 1 core on a standalone cluster")
    warm, topic = f"bench-tasks-{s.run_id}-workers-warm", f"bench-tasks-{s.run_id}-workers"
    warm_events = workload_topic(s, warm, args.warmup_events, 1_000)
    events = workload_topic(s, topic, args.workers_events, args.workers_keys)
    sizes: dict[str, Any] = {}
    with cluster_for(True, args) as cluster:
        for n in (1, 2):
            spec = {**base_spec(s, args, f"refold-tasks-workers{n}-{s.run_id}"), **cluster}
            spec["conf"] = {**cluster["conf"], "spark.cores.max": str(n)}
            spec["runs"] = [
                {"label": f"{n} executor(s): warm-up (not reported)", "pipeline": f"{warm}-p{n}", "source": warm,
                 "events": warm_events},
                {"label": f"{n} executor(s)", "pipeline": f"{topic}-p{n}", "source": topic, "events": events,
                 "cpu": True},
            ]
            sizes[f"executors_{n}"] = point(spec)["runs"][-1]
    ratio = sizes["executors_2"]["events_per_s"] / sizes["executors_1"]["events_per_s"]
    return {"events": events, "keys": args.workers_keys, "partitions": s.partitions, "cores_per_executor": 1,
            "executor_memory": args.executor_memory, "pinned": args.pin, **sizes, "ratio": ratio, "target_ratio": TARGETS["workers"]}


def part_regroup(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    say(f"regroup: {args.regroup_events:,} events over {args.workers_keys:,} players, a view per team "
        f"({args.regroup_teams:,} teams), one shard vs shards 1 vs shards 2 on a 2-worker cluster")
    warm, topic = f"bench-tasks-{s.run_id}-regroup-warm", f"bench-tasks-{s.run_id}-regroup"
    lines = [jsonbytes.dumps(r) for r in generate(Workload(events=args.regroup_events, keys=args.workers_keys,
                                                           seed=s.seed, teams=args.regroup_teams))]
    produce_lines(s, topic, lines)
    warm_events = workload_topic(s, warm, args.warmup_events, 1_000)
    sizes: dict[str, Any] = {}
    with cluster_for(True, args) as cluster:
        for label, shards in (("one_shard", "merged"), ("shards_1", 1), ("shards_2", 2)):
            spec = {**base_spec(s, args, f"refold-tasks-regroup-{label}-{s.run_id}"), **cluster}
            spec["runs"] = [
                {"label": f"{label}: warm-up (not reported)", "pipeline": f"{warm}-{label}", "source": warm,
                 "events": warm_events, "key": "team", "shards": shards},
                {"label": label, "pipeline": f"{topic}-{label}", "source": topic, "events": len(lines),
                 "key": "team", "shards": shards, "cpu": True},
            ]
            sizes[label] = point(spec)["runs"][-1]
    return {"events": len(lines), "players": args.workers_keys, "teams": args.regroup_teams,
            "partitions": s.partitions, "pinned": args.pin, **sizes,
            "ratio": sizes["shards_2"]["events_per_s"] / sizes["shards_1"]["events_per_s"],
            "ratio_to_one_shard": sizes["shards_2"]["events_per_s"] / sizes["one_shard"]["events_per_s"],
            "target_ratio": TARGETS["regroup"]}


def pin_workers(pids: list[int]) -> list[int]:
    """Pin every thread of worker JVM i to core i mod the cores this process may use; the
    executors a worker launches later inherit the core. Returns the cores, in order."""
    usable = sorted(os.sched_getaffinity(0))
    cores = [usable[i % len(usable)] for i in range(len(pids))]
    for pid, core in zip(pids, cores, strict=True):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(tid), {core})
    return cores


def part_restart(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    from refold.dev.chaos import ChaosResult, Engine
    from refold.recovery.restore import load_checkpoint

    keys, name = args.restart_keys, f"bench-tasks-{s.run_id}-restart"
    work = WORK / name
    state = work / "state"
    say(f"restart: {keys:,} live keys, `refold run` local[2], kill -9 and {args.chunk:,} new events, "
        f"stores intact then deleted; work folder {work}")
    produce_lines(s, name, live_keys(keys, s.seed))
    p = pipeline(name, name, s.bootstrap, s.batch, state_dir=state,
                 spark={"state_cache_keys": args.state_cache_keys} if args.state_cache_keys else None)
    prepare_topics(s.kafka, p, s.partitions)
    work.mkdir(parents=True, exist_ok=True)
    engine = Engine(write_yaml(p, work), work / "logs", ChaosResult(), idle=3600.0)
    engine.log_dir.mkdir(parents=True, exist_ok=True)
    total = keys
    runs: dict[str, Any] = {}
    try:
        engine.ensure_running()
        build_s = wait_for_records(engine, s.kafka, total, timeout=7200)
        say(f"  the state of {keys:,} keys is committed ({build_s:.0f}s from the first start)")
        for label, cold in (("stores_intact", False), ("stores_deleted", True)):
            time.sleep(max(2.0, 5 * p.trigger_seconds))  # Spark records its last batch
            engine.kill()
            store = state / p.pipeline
            store_bytes = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.is_dir() else 0
            if cold:
                shutil.rmtree(store, ignore_errors=True)
            lines = [jsonbytes.dumps(r) for r in generate(Workload(events=args.chunk, keys=keys, retract_share=0.0,
                                                                seed=s.seed + len(runs) + 1))]
            produce_lines(s, name, lines)
            since = engine.committed_batch()
            started, restarted = time.monotonic(), time.time()
            engine.ensure_running()
            if not engine.wait_for_progress(since, timeout=900):
                raise SystemExit(f"restart: no new batch within 900s (log: {engine_log(engine)})")
            seconds = time.monotonic() - started
            logged = restore_figures(engine_log(engine), restarted)
            up = logged["query_running_after_s"]
            say(f"  {label}: first new batch {seconds:.1f}s after the process start (query running after "
                f"{'?' if up is None else f'{up:.1f}s'})")
            runs[label] = {"seconds": seconds, "claimed_after_s": logged["recovered_after_s"],
                           "query_running_after_s": up,
                           "first_batch_after_query_s": None if up is None else seconds - up,
                           "store_bytes_before": store_bytes, "store_deleted": cold,
                           "new_events": len(lines), "batch_before": since, "log": logged["log"]}
            total += len(lines)
            wait_for_records(engine, s.kafka, total, timeout=1800)
    finally:
        engine.kill()
    checkpoint = load_checkpoint(p, s.kafka)
    shutil.rmtree(state, ignore_errors=True)
    forget_state(p)
    return {"keys": keys, "initial_build_s": build_s, "chunk": args.chunk, "trigger": p.trigger, **runs,
            "records_in": checkpoint.records_in if checkpoint else None,
            "ratio": runs["stores_deleted"]["seconds"] / runs["stores_intact"]["seconds"]}


def part_keys(s: Settings, args: argparse.Namespace) -> dict[str, Any]:
    where = "a standalone cluster of 2 workers x 1 core" if args.keys_cluster else "local[2]"
    say(f"keys: {BASE_KEYS:,} vs {args.many_keys:,} live keys, then {args.keys_events:,} events over them "
        f"after a restart; {where}, peak RSS of each Spark Python worker"
        + (" and of each executor (its JVM and its Python processes)" if args.keys_cluster else ""))
    with cluster_for(args.keys_cluster, args) as cluster:
        return _keys_points(s, args, cluster)


@contextlib.contextmanager
def cluster_for(wanted: bool, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """A point spec's update for a standalone cluster of 2 workers x 1 core (started here,
    stopped after; each worker pinned to a core unless `--no-pin`) with both as
    executors; {} (local[2]) when not `wanted`."""
    if not wanted:
        yield {}
        return
    from refold.dev import localspark

    home = Path(tempfile.mkdtemp(prefix="refold-tasks-cluster-"))
    info = localspark.start(2, 1, args.worker_memory, home=home, quiet=True, die_with_parent=True)
    try:
        say(f"  cluster at {info.url}: {len(info.workers)} workers x 1 core, {args.worker_memory} each")
        pids = [w.pid for w in info.workers if w.pid is not None]
        if args.pin:
            cores = pin_workers(pids)
            say(f"  worker JVMs pinned to cores {', '.join(map(str, cores))} (their executors inherit it)")
        yield {"master": info.url, "cluster_workers": pids,
               "conf": {"spark.executor.cores": "1", "spark.cores.max": "2",
                        "spark.executor.memory": args.executor_memory}}
    finally:
        localspark.stop(home)
        shutil.rmtree(home, ignore_errors=True)


def _keys_points(s: Settings, args: argparse.Namespace, cluster: dict[str, Any]) -> dict[str, Any]:
    points: dict[str, Any] = {}
    warm = f"bench-tasks-{s.run_id}-keys-warm"
    warm_events = workload_topic(s, warm, args.warmup_events, 1_000)
    for keys in (BASE_KEYS, args.many_keys):
        topic = f"bench-tasks-{s.run_id}-keys{keys}"
        spec = {**base_spec(s, args, f"refold-tasks-keys{keys}-{s.run_id}"), **cluster}
        workload = {"events": args.keys_events, "keys": keys, "retract": 0.2, "seed": s.seed}
        spec["runs"] = [
            {"label": "warm-up (not reported)", "pipeline": f"{warm}-p{keys}", "source": warm,
             "events": warm_events},
            {"label": f"{keys:,} keys: load ({keys:,} new keys)", "pipeline": f"{topic}-p", "source": topic,
             "events": keys, "live": keys, "rss": True, "keep_state": True},
            {"label": f"{keys:,} keys: measured", "pipeline": f"{topic}-p", "source": topic,
             "events": args.keys_events, "workload": workload, "rss": True},
        ]
        _warm, load, measured = point(spec)["runs"]
        points[str(keys)] = {"load": load, "measured": measured}
    base, many = points[str(BASE_KEYS)], points[str(args.many_keys)]
    return {"events": args.keys_events, "state_cache_keys": args.state_cache_keys, "points": points,
            "master": cluster.get("master", "local[2]"),
            "ratio": many["measured"]["events_per_s"] / base["measured"]["events_per_s"],
            "load_ratio": many["load"]["events_per_s"] / base["load"]["events_per_s"]}


# Output ------------------------------------------------------------------------------


def mib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**20:,.0f} MiB"


def summary(figures: dict[str, Any]) -> None:
    print(f"\nbench.tasks, one run ({figures['run']}, {figures['cores']} cores, load {figures['load_average_1m']:.2f}), "
          f"batch {figures['batch']:,}, {figures['partitions']} partitions")
    cpu = figures.get("cpu")
    if cpu:
        per = 1e6 / cpu["events"]
        share = cpu["driver_share"]
        print(f"\n[cpu] {cpu['events']:,} events, local[2], {cpu['batches']} batches, {cpu['events_per_s']:,.0f} events/s; "
              f"CPU over {cpu['cpu_window_s']:.1f}s, from the run's start to its last commit")
        print(f"  driver Python   {cpu['driver_cpu_s']:7.2f} CPU s  {cpu['driver_cpu_s'] * per:7.1f} µs/event  "
              f"({cpu['driver_cpu_per_batch_s']:.2f} s a batch)")
        print(f"  executor Python {cpu['executor_python_cpu_s']:7.2f} CPU s  {cpu['executor_python_cpu_s'] * per:7.1f} µs/event")
        print(f"  Spark JVM       {cpu['jvm_cpu_s']:7.2f} CPU s  {cpu['jvm_cpu_s'] * per:7.1f} µs/event  "
              "(driver and executor in one JVM in local mode: in neither share)")
        print(f"  driver share of the Python CPU: {share:.1%} (target ≤ {cpu['target_driver_share']:.0%}) "
              f"{'ok' if share <= cpu['target_driver_share'] else 'MISSED'}")
    workers = figures.get("workers")
    if workers:
        one, two = workers["executors_1"], workers["executors_2"]
        pinned = "each worker pinned to a core" if workers.get("pinned") else "unpinned"
        print(f"\n[workers] {workers['events']:,} events, standalone cluster, executors of 1 core ({pinned})")
        for label, r in (("1 executor ", one), ("2 executors", two)):
            each = ", ".join(f"{c:.1f}" for c in r.get("cluster_worker_python_cpu_s", []))
            jvms = ", ".join(f"{c:.1f}" for c in r.get("cluster_executor_jvm_cpu_s", []))
            print(f"  {label}: {r['events_per_s']:8,.0f} events/s ({r['seconds']:.1f}s, {r['batches']} batches)")
            print(f"      CPU s: driver Python {r['driver_cpu_s']:.2f}, driver JVM {r['jvm_cpu_s']:.2f}; on each "
                  f"cluster worker: executor Python {each}, executor JVM {jvms}; driver share "
                  f"{r['driver_share']:.1%} of the Python CPU, {r['driver_with_jvm_share']:.1%} with the JVMs")
        print(f"  2 / 1: {workers['ratio']:.2f}x (target ≥ {workers['target_ratio']:.1f}x) "
              f"{'ok' if workers['ratio'] >= workers['target_ratio'] else 'MISSED'}")
    regroup = figures.get("regroup")
    if regroup:
        print(f"\n[regroup] {regroup['events']:,} events keyed by player, a view per team ({regroup['teams']:,} "
              f"teams), on the 2-worker cluster ({'pinned' if regroup.get('pinned') else 'unpinned'})")
        for label in ("one_shard", "shards_1", "shards_2"):
            r = regroup[label]
            each = ", ".join(f"{c:.1f}" for c in r.get("cluster_worker_python_cpu_s", []))
            print(f"  {label.replace('_', ' '):<9}: {r['events_per_s']:8,.0f} events/s ({r['seconds']:.1f}s, "
                  f"{r['batches']} batches); executor Python CPU s on each worker: {each}; "
                  f"machine busy {r['machine_busy_share']:.0%}")
        print(f"  shards 2 / shards 1: {regroup['ratio']:.2f}x (target ≥ {regroup['target_ratio']:.1f}x) "
              f"{'ok' if regroup['ratio'] >= regroup['target_ratio'] else 'MISSED'}; shards 2 / one shard: "
              f"{regroup['ratio_to_one_shard']:.2f}x")
    restart = figures.get("restart")
    if restart:
        print(f"\n[restart] kill -9 with {restart['keys']:,} live keys: process start → first new committed batch")
        for label in ("stores_intact", "stores_deleted"):
            r = restart[label]
            up, rest = r["query_running_after_s"], r["first_batch_after_query_s"]
            print(f"  {label.replace('_', ' '):<15} {r['seconds']:6.1f}s (query running after "
                  f"{'?' if up is None else f'{up:.1f}s'}, then the first batch "
                  f"{'?' if rest is None else f'{rest:.1f}s'}; stores before the kill: "
                  f"{mib(r['store_bytes_before'])})")
        print(f"  deleted / intact: {restart['ratio']:.2f}x")
    keys = figures.get("keys")
    if keys:
        print(f"\n[keys] live keys, then {keys['events']:,} events over them after a restart "
              f"({keys.get('master', 'local[2]')})")
        for count, point_figures in keys["points"].items():
            load, measured = point_figures["load"], point_figures["measured"]
            print(f"  {int(count):>10,} keys: load {load['events_per_s']:8,.0f} events/s, measured "
                  f"{measured['events_per_s']:8,.0f} events/s ({measured['touched_keys']:,} keys touched); "
                  "peak RSS of a Python worker: load "
                  f"{mib(load['worker_peak_rss_bytes'])}, measured {mib(measured['worker_peak_rss_bytes'])}; "
                  f"of a shard host: load {mib(load.get('host_peak_rss_bytes'))}, "
                  f"measured {mib(measured.get('host_peak_rss_bytes'))}")
            if "executor_peak_rss_each" in load:
                print("      peak RSS of each executor (JVM + Python): load "
                      f"{', '.join(mib(b) for b in load['executor_peak_rss_each'])}; measured "
                      f"{', '.join(mib(b) for b in measured['executor_peak_rss_each'])}")
        print(f"  measured events/s, many keys / {BASE_KEYS:,}: {keys['ratio']:.2f}x  "
              f"(load: {keys['load_ratio']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=numbers(str), default=list(PARTS), help=f"which parts: {','.join(PARTS)}")
    parser.add_argument("--batch", type=int, default=100_000, help="max events per micro-batch")
    parser.add_argument("--partitions", type=int, default=4, help="source partitions")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle before an in-process run ends")
    parser.add_argument("--warmup-events", type=int, default=200_000, help="events of each unreported warm-up run")
    parser.add_argument("--state-cache-keys", type=int, default=None,
                        help="spark.state_cache_keys of every pipeline (default: the engine's)")
    parser.add_argument("--cpu-events", type=int, default=300_000)
    parser.add_argument("--cpu-keys", type=int, default=30_000)
    parser.add_argument("--workers-events", type=int, default=600_000)
    parser.add_argument("--workers-keys", type=int, default=15_000)
    # 9 batches of 100k: at 300k (3 batches) the last batch's stage 2 runs alone, a third
    # of the run without stage 2 beside stage 1, which the ratio would measure instead
    parser.add_argument("--regroup-events", type=int, default=800_000)
    parser.add_argument("--regroup-teams", type=int, default=2_000, help="the regroup part's view keys")
    parser.add_argument("--worker-memory", default="1g", help="what each standalone worker offers")
    parser.add_argument("--executor-memory", default="768m")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="workers: leave the worker JVMs unpinned (by default each has a core of its own)")
    parser.add_argument("--restart-keys", type=int, default=200_000, help="live keys before the kill (1M, 10M: slow)")
    parser.add_argument("--chunk", type=int, default=1_000, help="new events produced before each restart")
    parser.add_argument("--many-keys", type=int, default=200_000, help="the keys part's large key count")
    parser.add_argument("--keys-events", type=int, default=100_000, help="the keys part's measured events")
    parser.add_argument("--keys-cluster", action="store_true",
                        help="keys: on a standalone cluster of 2 workers x 1 core (each executor's RSS: its JVM "
                             "and its Python processes), not local[2]")
    parser.add_argument("--json-dir", type=Path, default=RESULTS, help="where tasks.json goes")
    parser.add_argument("--bootstrap", default=None, help="the broker (default: the local one, started if needed)")
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)  # a JSON spec: one Spark application
    parser.add_argument("--point-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        args.point_json.write_bytes(orjson.dumps(run_point(orjson.loads(args.point))))
        return 0
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(PARTS)}")

    from refold.dev.localkafka import ensure_broker

    info = run_info()
    s = Settings(ensure_broker(args.bootstrap, start_local=True), info["run"], 0, args.batch, args.partitions,
                 args.seed)
    figures: dict[str, Any] = {**info, "batch": args.batch, "partitions": args.partitions, "seed": args.seed,
                               "warmup_events": args.warmup_events}
    started = time.monotonic()
    failed: dict[str, str] = {}
    for part, run in (("cpu", part_cpu), ("workers", part_workers), ("restart", part_restart), ("keys", part_keys),
                      ("regroup", part_regroup)):
        if part not in args.parts:
            continue
        began = time.monotonic()
        try:
            figures[part] = {**run(s, args), "part_seconds": time.monotonic() - began}
        except (SystemExit, Exception) as exc:  # one part failing keeps the others' figures
            failed[part] = str(exc) or type(exc).__name__
            say(f"  {part} failed: {failed[part]}")
    figures["failed"] = failed
    figures["seconds"] = time.monotonic() - started
    summary(figures)
    for part, reason in failed.items():
        print(f"[{part}] FAILED ({reason})")
    write_json(args.json_dir / "tasks.json", figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
