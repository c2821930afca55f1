"""Charts of the bench figures: PNGs next to the JSON files they are drawn from.

Reads whichever of these exist in `--dir` (default docs/bench) and draws, with
matplotlib's Agg backend (no display needed):

- contenders.json (`make bench`, bench/run.py) → contenders.png: events/s per contender;
- scaling.json (bench/scaling.py) → scaling_keys.png: events/s and peak RSS against
  the key space (log scale), and scaling_retract.png: events/s against the share of
  retractions/corrections;
- latency.json (bench/latency.py) → latency.png: the latency distribution (CDF) with
  the trigger, p50 and p99 marked;
- recovery.json (bench/scaling.py) → recovery.png: seconds from a restart after
  kill -9 to the first new committed batch, with and without the Spark checkpoint
  directory, against the 60 s target.

A missing or unreadable input is skipped with a message; the others are still drawn.
Every chart names the run's size in its title and the run (id, machine) in a caption.

    python -m bench.plots [--dir docs/bench]
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.run import RESULTS, TITLES

MIB = 2**20
NOTE_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 1.5}


def caption(fig: Figure, data: dict[str, Any]) -> None:
    """The run id, machine and load under the chart."""
    load = data.get("load_average_1m")
    where = f"{data.get('cores', '?')} cores" + (f", load {load:.1f}" if isinstance(load, int | float) else "")
    fig.text(0.01, 0.01, f"run {data.get('run', '?')} · {data.get('machine', '?')} · {where}",
             fontsize=7, color="gray")


def save(fig: Figure, path: Path) -> None:
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def label_bars(ax: Axes, bars: Any, texts: list[str]) -> None:
    for bar, text in zip(bars, texts, strict=True):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points", bbox=NOTE_BOX, zorder=5)


def plot_contenders(data: dict[str, Any], out: Path) -> None:
    contenders: dict[str, dict[str, Any]] = data["contenders"]
    names = list(contenders)
    rates = [contenders[n]["events_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # the contenders' names, wrapped: five of them side by side do not fit on one line each
    bars = ax.bar([textwrap.fill(TITLES.get(n, n).split(",")[0], 16) for n in names], rates,
                  color=["tab:orange" if n == "refold" else "tab:blue" for n in names])
    label_bars(ax, bars, [f"{r:,.0f}\n{contenders[n]['peak_rss_bytes'] / MIB:,.0f} MiB" for n, r in zip(names, rates,
                                                                                                     strict=True)])
    ax.set_ylabel("throughput (events/s)")
    ax.set_title(f"Contenders: {data['events']:,} events, {data['keys']:,} keys,\n"
                 f"{data['retract_share']:.0%} retractions/corrections, batch {data['batch']:,}")
    ax.margins(y=0.2)
    caption(fig, data)
    save(fig, out / "contenders.png")


def plot_scaling_keys(data: dict[str, Any], out: Path) -> None:
    curve = data["keys_curve"]
    points = curve["points"]
    keys = [p["keys"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(keys, [p["events_per_s"] for p in points], "o-", color="tab:orange", label="events/s")
    ax.set_xscale("log")
    ax.set_xticks(keys, [f"{p['keys']:,}\n({p['touched_keys']:,} touched)" for p in points], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("key space (keys, log scale; in brackets: distinct keys the events touched)")
    ax.set_ylabel("throughput (events/s)", color="tab:orange")
    ax.set_ylim(bottom=0)
    rss = ax.twinx()
    rss.plot(keys, [p["peak_rss_bytes"] / MIB for p in points], "s--", color="tab:blue", label="peak RSS")
    rss.set_ylabel("peak RSS, Python + JVM (MiB)", color="tab:blue")
    rss.set_ylim(bottom=0)
    ax.set_title(f"Throughput vs key space: {data['events']:,} events per point, "
                 f"{curve['retract_share']:.0%} retractions/corrections\n"
                 "(a fixed event count touches only part of a large key space)", fontsize=10)
    caption(fig, data)
    save(fig, out / "scaling_keys.png")


def plot_scaling_retract(data: dict[str, Any], out: Path) -> None:
    curve = data["retract_curve"]
    points = curve["points"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bars = ax.bar([f"{p['retract_share']:.0%}" for p in points], [p["events_per_s"] for p in points],
                  color="tab:orange")
    label_bars(ax, bars, [f"{p['events_per_s']:,.0f}\n{p['touched_keys']:,} keys" for p in points])
    ax.set_xlabel("share of retractions and corrections (% of events)")
    ax.set_ylabel("throughput (events/s)")
    ax.set_title(f"Throughput vs retractions: {data['events']:,} events per point, {curve['keys']:,} keys",
                 fontsize=10)
    ax.margins(y=0.2)
    caption(fig, data)
    save(fig, out / "scaling_retract.png")


def plot_latency(data: dict[str, Any], out: Path) -> None:
    values: list[float] = data["cdf_s"]
    quantiles = [i / (len(values) - 1) for i in range(len(values))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(values, quantiles, color="tab:orange", label="events (CDF)")
    ax.axvline(data["trigger_s"], color="gray", linestyle="--", label=f"trigger {data['trigger']}")
    for name, style in (("p50_s", ":"), ("p99_s", "-.")):
        ax.axvline(data[name], color="tab:blue", linestyle=style,
                   label=f"{name[:-2]} {data[name]:.2f} s")
    ax.set_xlabel("end-to-end latency: produced → committed view record seen (s)")
    ax.set_ylabel("share of events")
    ax.set_ylim(0, 1.01)
    ax.set_xlim(left=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Latency at {data['rate']:,.0f} events/s, trigger {data['trigger']}: {data['count']:,} events "
                 f"over {data['seconds']:g} s (p99/trigger {data['p99_over_trigger']:.2f})", fontsize=10)
    caption(fig, data)
    save(fig, out / "latency.png")


PHASES = (("recovered_after_s", "process, JVM, Spark start + state restore"),
          ("query_running_after_s", "streaming query start"),
          ("seconds", "first new batch committed"))


def plot_recovery(data: dict[str, Any], out: Path) -> None:
    runs: dict[str, dict[str, Any]] = data["runs"]
    labels = [name.replace("_", " ").replace("spark", "Spark")
              + ("\n(the engine discarded it)" if run.get("spark_checkpoint_discarded") else "")
              for name, run in runs.items()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, run in enumerate(runs.values()):
        bottom = 0.0
        for phase, (key, title) in enumerate(PHASES):
            value = run.get(key)
            if not isinstance(value, int | float) or value < bottom:
                continue
            ax.bar(labels[index], value - bottom, bottom=bottom, color=f"C{phase}",
                   label=title if index == 0 else None)
            bottom = value
        note = f"{run['seconds']:.1f} s"
        if run.get("state_records") is not None:
            note += f"\n{run['state_records']:,} state records"
        ax.annotate(note, (index, run["seconds"]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points", bbox=NOTE_BOX, zorder=5)
    ax.axhline(data["target_s"], color="red", linestyle="--", label=f"target {data['target_s']:.0f} s")
    ax.set_ylabel("seconds from restart after kill -9")
    ax.margins(y=0.25)
    # below the plot: inside it, the legend covered the bars' notes
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    ax.set_title(f"Recovery: {data['keys']:,} live keys, {data['chunk']:,} new events after the kill",
                 fontsize=10)
    caption(fig, data)
    save(fig, out / "recovery.png")


CHARTS: list[tuple[str, str, Callable[[dict[str, Any], Path], None]]] = [
    ("contenders.json", "contenders", plot_contenders),
    ("scaling.json", "keys_curve", plot_scaling_keys),
    ("scaling.json", "retract_curve", plot_scaling_retract),
    ("latency.json", "cdf_s", plot_latency),
    ("recovery.json", "runs", plot_recovery),
]


def load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"skipped {path.name}: not found in {path.parent}")
        return None
    except (OSError, ValueError) as exc:
        print(f"skipped {path.name}: unreadable ({exc})")
        return None
    if not isinstance(data, dict):
        print(f"skipped {path.name}: not a JSON object")
        return None
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=RESULTS, help="where the JSON files are and the PNGs go")
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"--dir: {args.dir} is not a folder")
    drawn = 0
    cache: dict[str, dict[str, Any] | None] = {}
    for name, needs, draw in CHARTS:
        if name not in cache:
            cache[name] = load(args.dir / name)
        data = cache[name]
        if data is None:
            continue
        if needs not in data:
            print(f"skipped {draw.__name__[5:]}: {name} has no {needs}")
            continue
        try:
            draw(data, args.dir)
            drawn += 1
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            plt.close("all")
            print(f"skipped {draw.__name__[5:]}: {name} is not in the expected format ({type(exc).__name__}: {exc})")
    print(f"{drawn} chart{'s' if drawn != 1 else ''} in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
