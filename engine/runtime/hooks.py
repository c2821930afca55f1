"""Test hooks: the places where chaos tests kill or stall the engine.

Injected, never read inline: whoever starts the engine builds them once from
`refold.environment.test_hook_settings()` (`Hooks.from_settings`); everyone else gets
`NO_HOOKS`, whose calls do nothing. The variables (never set in production):

- `REFOLD_TEST_CRASH=<where>:<batch>`: SIGKILL at that point of that batch
  (`mid_batch`: the batch is decoded, nothing reduced or sent; `in_txn`: its records
  sent, not committed; `after_commit`: committed, before Spark records the batch).
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

    __slots__ = ("_stalled", "crash_at", "stall_seconds", "stall_until")

    def __init__(
        self, crash_at: str | None = None, stall_seconds: float | None = None, stall_until: Path | None = None
    ) -> None:
        self.crash_at = crash_at
        self.stall_seconds = stall_seconds
        self.stall_until = stall_until
        self._stalled = False

    @classmethod
    def from_settings(cls, settings: Mapping[str, str]) -> Hooks:
        """From the variables `refold.environment.test_hook_settings()` found set."""
        seconds = settings.get(environment.TEST_STALL_IN_TXN_SECONDS)
        until = settings.get(environment.TEST_STALL_UNTIL)
        return cls(
            crash_at=settings.get(environment.TEST_CRASH),
            stall_seconds=float(seconds) if seconds else None,
            stall_until=Path(until) if until else None,
        )

    def crash_point(self, where: str, batch: int) -> None:
        """Kill this process with SIGKILL when `<where>:<batch>` is the crash asked for."""
        if self.crash_at is not None and self.crash_at == f"{where}:{batch}":
            log.warning("test hook: kill -9 at %s of batch %d", where, batch)
            os.kill(os.getpid(), signal.SIGKILL)

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


def _seconds(value: float) -> str:
    return f"{value:g}"


NO_HOOKS = Hooks()
