"""Peak resident memory of a process tree, sampled from `/proc` in a thread (Linux).

`make bench` wraps each contender in `PeakRss(pid)`: the tree is the process and all
its descendants at each sample (a JVM a Python process started, its Python workers),
and the peak is the largest sum of their `VmRSS` seen. Sampling misses spikes
shorter than the interval; a bench run lasts seconds to minutes, so that is noise.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")


def children_map() -> dict[int, list[int]]:
    """Parent pid → child pids, for every process visible now."""
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def tree_of(pid: int) -> list[int]:
    tree = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, ()))
    return out


def rss_bytes(pid: int) -> int:
    """VmRSS of one process, 0 when it is gone (or a zombie)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    return sum(rss_bytes(p) for p in tree_of(pid))


class PeakRss:
    """`with PeakRss(pid) as peak: ...` then `peak.bytes`: the largest tree RSS sampled."""

    def __init__(self, pid: int | None = None, interval: float = 0.25) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss(self.pid))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mib(self) -> float:
        return self.bytes / 2**20
