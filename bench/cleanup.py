"""Delete the topics earlier bench runs left on the local broker (`make bench-clean`, the
first step of `make bench`).

Every bench part names its topics after its run (`bench-<timestamp>…`,
`hotpath-<timestamp>…`) and keeps them, so that a run's input and outputs can be read
afterwards. Nothing deleted them: a `make bench` run leaves a few GB, and a bench
clone's broker once held 38 GB after a day of runs, with 7 GB of the disk left. This
deletes every topic of the local broker of this Refold home whose name starts with a
bench's prefix (`BENCH_PREFIXES`), then waits until the broker removed their files (`file.delete.delay.ms` after the deletion: a second on the local broker),
so that the disk's work is over before a benchmark starts. It never touches another
cluster: with `REFOLD_BOOTSTRAP_SERVERS` set it does nothing.

    python -m bench.cleanup [--wait 120]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from bench.latency import say
from refold import environment
from refold.dev import localkafka
from refold.kafka.io import admin_client, list_topics

BENCH_PREFIXES = ("bench-", "hotpath-")


def bench_topics(names: Iterable[str]) -> list[str]:
    """The names among `names` that a bench made."""
    return sorted(name for name in names if name.startswith(BENCH_PREFIXES))


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


_LOG_FOLDER = re.compile(r"(?P<topic>.+)-\d+(?:\.[0-9a-f]+-delete)?")


def _left(data_dir: Path, topics: set[str]) -> list[Path]:
    """The log folders of `topics` still in `data_dir` (`<topic>-<partition>`, or with
    `.<id>-delete` after it once the broker marked them)."""
    found = []
    for folder in data_dir.iterdir():
        named = _LOG_FOLDER.fullmatch(folder.name)
        if named is not None and named["topic"] in topics and folder.is_dir():
            found.append(folder)
    return found


def clean(settings: Mapping[str, Any], data_dir: Path | None, wait: float = 120.0) -> list[str]:
    """Delete the bench topics on the broker `settings` name; wait (at most `wait`
    seconds) until their folders left `data_dir`, when given. Returns the topics deleted."""
    admin = admin_client(settings)
    doomed = bench_topics(list_topics(admin).topics)
    if not doomed:
        return []
    for name, future in admin.delete_topics(doomed, operation_timeout=60).items():
        try:
            future.result()
        except KafkaException as exc:
            raise SystemExit(f"bench-clean: deleting topic {name!r}: {exc.args[0].str()}") from exc
    if data_dir is not None:
        deadline, last_report, names = time.monotonic() + wait, time.monotonic(), set(doomed)
        while left := _left(data_dir, names):
            if time.monotonic() >= deadline:
                say(f"  {len(left)} log folder(s) of the deleted topics still in {data_dir} after {wait:g}s; going on")
                break
            if time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                say(f"  the broker is removing {len(left)} log folder(s)…")
            time.sleep(0.2)
    return doomed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for the broker to remove the deleted topics' files (default 120)")
    args = parser.parse_args(argv)
    if environment.bootstrap_servers():
        say("bench-clean: REFOLD_BOOTSTRAP_SERVERS names a cluster; only the local broker's bench topics are "
            "deleted here, so nothing was")
        return 0
    info = localkafka.start()  # this home's broker (the running one, else started): never one that only listens on its port
    before = _size(info.data_dir)
    deleted = clean({"bootstrap.servers": info.bootstrap}, info.data_dir, args.wait)
    freed = (before - _size(info.data_dir)) / 2**30
    say(f"bench-clean: deleted {len(deleted)} bench topic(s) on {info.bootstrap}, {freed:,.1f} GiB freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
