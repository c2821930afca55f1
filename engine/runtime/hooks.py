"""Test hooks: the places where chaos tests kill or stall the engine.

Injected, never read inline: whoever starts the engine builds them once from
`refold.environment.test_hook_settings()` (`Hooks.from_settings`); everyone else gets
`NO_HOOKS`, whose calls do nothing. The variables (never set in production):

- `REFOLD_TEST_CRASH=<where>:<batch>`: SIGKILL of the engine (the driver process,
  with its Spark and tasks) at that point of a shard's batch (`mid_batch`: the batch
  is decoded, nothing reduced or sent; `in_txn`: its records sent, not committed;
  `after_commit`: committed, before the local store and Spark record it).
- `REFOLD_TEST_CRASH_WORKER=<where>:<batch>[,<where>:<batch>…]`: the same points,
  SIGKILL of the Python worker that runs the shard's task (Spark runs the task again),
  once per point (a marker file each): the first worker to get there kills itself.
- `REFOLD_TEST_STALL_IN_TXN_SECONDS`: keep the first transaction open that long, or,
  with `REFOLD_TEST_STALL_UNTIL=<path>`, until that file exists (at most that long).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from refold import environment

log = logging.getLogger(__name__)


class Hooks:
    """Where to crash and how long to stall; all off by default."""

    __slots__ = ("_stalled", "crash_at", "crash_pid", "stall_seconds", "stall_until", "worker_crash_at",
                 "worker_crash_marker")

    def __init__(
        self,
        crash_at: str | None = None,
        stall_seconds: float | None = None,
        stall_until: Path | None = None,
        *,
        crash_pid: int | None = None,
        worker_crash_at: str | None = None,  # points, comma-separated
        worker_crash_marker: Path | None = None,
    ) -> None:
        self.crash_at = crash_at
        self.crash_pid = crash_pid  # the engine's process (None: this one)
        self.stall_seconds = stall_seconds
        self.stall_until = stall_until
        self.worker_crash_at = frozenset(p.strip() for p in worker_crash_at.split(",")) if worker_crash_at else frozenset()
        self.worker_crash_marker = worker_crash_marker
        self._stalled = False

    @classmethod
    def from_settings(cls, settings: Mapping[str, str]) -> Hooks:
        """From the variables `refold.environment.test_hook_settings()` found set."""
        seconds = settings.get(environment.TEST_STALL_IN_TXN_SECONDS)
        until = settings.get(environment.TEST_STALL_UNTIL)
        worker = settings.get(environment.TEST_CRASH_WORKER)
        return cls(
            crash_at=settings.get(environment.TEST_CRASH),
            stall_seconds=float(seconds) if seconds else None,
            stall_until=Path(until) if until else None,
            crash_pid=os.getpid(),  # where the hooks are built: the engine's driver
            worker_crash_at=worker,
            worker_crash_marker=environment.home() / f"crash-worker-{os.getpid()}" if worker else None,
        )

    def crash_point(self, where: str, batch: int) -> None:
        """SIGKILL the engine when `<where>:<batch>` is the crash asked for; SIGKILL this
        Python worker when it is the worker crash asked for (once)."""
        point = f"{where}:{batch}"
        if self.crash_at == point:
            log.warning("test hook: kill -9 of the engine at %s of batch %d", where, batch)
            os.kill(self.crash_pid or os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # a worker outlives its driver by a moment
        if point in self.worker_crash_at and self._first_worker_crash(point):
            log.warning("test hook: kill -9 of Python worker %d at %s of batch %d", os.getpid(), where, batch)
            os.kill(os.getpid(), signal.SIGKILL)

    def _first_worker_crash(self, point: str) -> bool:
        if self.worker_crash_marker is None:
            return True
        marker = worker_crash_marker(self.worker_crash_marker, point)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.open("x").close()
        except FileExistsError:
            return False
        return True

    def stall_in_transaction(self) -> None:
        """Inside the first transaction only: wait the stall asked for."""
        if self.stall_seconds is None or self._stalled:
            return
        self._stalled = True
        release = self.stall_until
        log.warning("test hook: stalling %ss inside the transaction%s", _seconds(self.stall_seconds),
                    f" or until {release} exists" if release else "")
        deadline = time.monotonic() + self.stall_seconds
        while time.monotonic() < deadline and not (release is not None and release.exists()):
            time.sleep(0.1)


def worker_crash_marker(base: Path, point: str) -> Path:
    """The file that says a worker crashed at `point` (`<base>-<where>-<batch>`)."""
    return base.with_name(f"{base.name}-{point.replace(':', '-')}")


def _seconds(value: float) -> str:
    return f"{value:g}"


NO_HOOKS = Hooks()
