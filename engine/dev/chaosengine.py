"""The chaos harness's engines (`refold run` processes it starts, kills and waits
for) and its tally (`ChaosResult`)."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from refold.config import Pipeline, load_pipeline
from refold.recovery.restore import load_checkpoint

FAULTS = ("kill9", "kill9_in_commit", "broker_restart", "spark_dir_lost", "zombie", "txn_timeout",
          "python_worker_kill", "executor_kill", "spark_worker_kill", "state_dir_lost")


@dataclass
class ChaosResult:
    events: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    engine_starts: int = 0
    stalls: int = 0  # an engine alive but without a new commit for 180 s (then killed)
    engine_exits: Counter[str] = field(default_factory=Counter)
    view_records: int = 0
    delta_records: int = 0
    table_rows: int = 0  # rows of the lakehouse tables checked
    anomalies: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # seconds from each kill -9 of a partition leader (a cluster fault) to the target
    # engine's next committed batch; None where it made none within 180 s
    leader_recoveries: list[float | None] = field(default_factory=list)
    hanging: tuple[int, int] = (0, 0)  # Kafka's find-hanging after the run: brokers asked, transactions found

    def line(self) -> str:
        kinds = FAULTS + tuple(kind for kind in self.faults if kind not in FAULTS)  # the Kafka cluster's too
        faults = " ".join(f"{kind}={self.faults.get(kind, 0)}" for kind in kinds)
        exits = " ".join(f"{k}={v}" for k, v in sorted(self.engine_exits.items()))
        return (
            f"chaos: events={self.events:,} faults[{faults}] total_faults={sum(self.faults.values())} "
            f"engine_starts={self.engine_starts} stalls={self.stalls} exits[{exits}] view_records={self.view_records:,} "
            f"delta_records={self.delta_records:,} table_rows={self.table_rows:,} anomalies={len(self.anomalies)} wall={self.seconds:.0f}s"
            + self.recovery_text()
            + (f" find_hanging[brokers={self.hanging[0]} found={self.hanging[1]}]" if self.hanging[0] else "")
        )

    def recovery_text(self) -> str:
        """` leader_kill_to_commit[median=… max=… n=…]`, or nothing without leader kills."""
        if not self.leader_recoveries:
            return ""
        seen = sorted(s for s in self.leader_recoveries if s is not None)
        missed = len(self.leader_recoveries) - len(seen)
        median = f"{statistics.median(seen):.1f}s" if seen else "-"
        worst = f"{seen[-1]:.1f}s" if seen else "-"
        return (f" leader_kill_to_commit[median={median} max={worst} n={len(seen)}"
                + (f" none_within_180s={missed}" if missed else "") + "]")


class Engine:
    """One pipeline's engine processes: the current one and, briefly, a zombie."""

    def __init__(self, path: Path, log_dir: Path, result: ChaosResult, idle: float) -> None:
        self.path = path
        self.idle = idle
        self.pipeline: Pipeline = load_pipeline(path)
        self.settings = self.pipeline.kafka.librdkafka()
        self.log_dir = log_dir
        self.result = result
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def name(self) -> str:
        return self.pipeline.pipeline

    def start(self, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        # The pipeline file names the harness's broker; a REFOLD_BOOTSTRAP_SERVERS around
        # (the test session sets one for its own broker) would win over it.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("REFOLD_TEST_") and k != "REFOLD_BOOTSTRAP_SERVERS"}
        env.update(extra_env or {})
        self.runs += 1
        self.result.engine_starts += 1
        log = (self.log_dir / f"{self.name}.{self.runs:04d}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "refold.cli.main", "run", str(self.path), "--until-idle", str(self.idle)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        return proc

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.reap()
            self.proc = self.start()

    def reap(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.result.engine_exits[exit_kind(self.proc.returncode)] += 1
            self.proc = None

    def kill(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        proc = proc or self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        self.reap()

    def committed_batch(self) -> int:
        try:
            checkpoint = load_checkpoint(self.pipeline, self.settings)
        except Exception:  # the broker may be restarting
            return -1
        return checkpoint.batch if checkpoint is not None else 0

    def wait_for_progress(self, since: int, timeout: float = 180.0) -> bool:
        """Until the engine commits a batch past `since`; False when it exits or stalls."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.committed_batch() > since:
                return True
            if self.proc is None or self.proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def finish(self, timeout: float = 900.0) -> int:
        """Run until idle (a fresh run when none is running); the exit code."""
        self.ensure_running()
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
        self.reap()
        return code


def exit_kind(code: int) -> str:
    return {0: "idle", -9: "killed"}.get(code, f"code{code}")
