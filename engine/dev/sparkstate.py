"""What the local Spark cluster (`refold.dev.localspark`) knows of itself: the layout
its last start recorded in `<home>/spark/cluster.json` (ports, each worker's settings)
and the master UI's `/json/` view (the workers' states as the master sees them).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refold.dev.localproc import HOST

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    index: int
    port: int
    cores: int
    memory: str


@dataclass(frozen=True, slots=True)
class Layout:
    """What cluster.json records: the ports and each worker's settings."""

    port: int
    ui_port: int
    workers: tuple[WorkerSpec, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "port": self.port,
                "ui_port": self.ui_port,
                "workers": [
                    {"index": w.index, "port": w.port, "cores": w.cores, "memory": w.memory}
                    for w in self.workers
                ],
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Layout:
        data = json.loads(text)
        workers = tuple(
            WorkerSpec(int(w["index"]), int(w["port"]), int(w["cores"]), str(w["memory"]))
            for w in data["workers"]
        )
        return cls(int(data["port"]), int(data["ui_port"]), workers)


def write_layout(base: Path, layout: Layout) -> None:
    (base / "cluster.json").write_text(layout.to_json() + "\n")


def read_layout(base: Path) -> Layout | None:
    try:
        return Layout.from_json((base / "cluster.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def master_state(ui_port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    """The master UI's `/json/` view (status, workers with their states, apps), or
    None when it does not answer."""
    try:
        with _NO_PROXY.open(f"http://{HOST}:{ui_port}/json/", timeout=timeout) as response:
            state = json.load(response)
    except (OSError, ValueError):  # URLError is an OSError
        return None
    return state if isinstance(state, dict) else None


def listed_state(listed: list[dict[str, Any]], port: int) -> str | None:
    """The state the master lists for the worker at HOST:`port` (ALIVE before any
    dead registration there), or None."""
    mine = [w for w in listed if w.get("host") == HOST and w.get("port") == port]
    if not mine:
        return None
    mine.sort(key=lambda w: (w.get("state") == "ALIVE", str(w.get("id"))))
    return str(mine[-1].get("state"))
