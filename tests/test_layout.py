"""The layout's rules, checked: no module over 500 lines, the engine's runtime path
imports nothing of `refold.dev` (local servers, demo, chaos harness), and the figures'
pages stay short enough to read (their history goes to CHANGELOG.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
MAX_FIGURE_PAGE_LINES = 300
RUNTIME = (
    "refold.cli.main", "refold.spark.job", "refold.runtime.processor", "refold.recovery.restore",
    "refold.ops.monitor", "refold.ops.status", "refold.connectors.runtime", "refold.connectors.postgres",
    "refold.connectors.sqlite", "refold.connectors.parquet", "refold.connectors.webhook",
)  # fmt: skip


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for folder in ("engine", "connectors")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_figures_pages_stay_under_300_lines() -> None:
    long = {name: lines for name in ("docs/PERFORMANCE.md", "docs/RELIABILITY.md")
            if (lines := len((ROOT / name).read_text().splitlines())) >= MAX_FIGURE_PAGE_LINES}
    assert long == {}


def test_the_runtime_path_imports_nothing_of_dev() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {RUNTIME!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('refold.dev')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
