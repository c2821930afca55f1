"""Kafka's own check for hanging transactions, run after a chaos run: `find-hanging`
of Kafka's `kafka-transactions.sh` (`org.apache.kafka.tools.TransactionsCommand`, from
the `kafka-tools` jar set) against each broker.

A hanging transaction is one a partition still counts as open although its producer
is gone and its coordinator no longer knows it (KIP-664): its records block every
`read_committed` reader of that partition after its first offset. Refold's own check
(`refold.kafka.io.open_transactions`: the last stable offset stays below the high
watermark) sees the same symptom per partition; Kafka's tool looks at each broker's
producer state and asks the coordinators, so it names the producer as well.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable

from refold.spark.jars import kafka_tools_classpath, require_java

_COMMAND = "org.apache.kafka.tools.TransactionsCommand"


def find_hanging(bootstrap: str, broker_ids: Iterable[int], timeout: float = 120.0) -> list[str]:
    """One line per hanging transaction on any of `broker_ids` (`topic[partition]:
    producer P, epoch E, from offset O, open M min`), or one line saying the tool could
    not answer for a broker (that is a failure of the check, never a pass)."""
    java = require_java()
    classpath = kafka_tools_classpath()
    problems: list[str] = []
    for broker in broker_ids:
        command = [
            java,
            "-cp",
            classpath,
            _COMMAND,
            "--bootstrap-server",
            bootstrap,
            "find-hanging",
            "--broker-id",
            str(broker),
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            problems.append(f"find-hanging on broker {broker}: no answer within {timeout:.0f}s")
            continue
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            problems.append(
                f"find-hanging on broker {broker} failed (exit {done.returncode}): {last}"
            )
            continue
        problems += [f"broker {broker}: {line}" for line in hanging_rows(done.stdout)]
    return problems


def hanging_rows(output: str) -> list[str]:
    """The tool's table (a header `Topic Partition ProducerId …`, then a row per hanging
    transaction, tab-separated) as one readable line per row."""
    rows = [line.split("\t") for line in output.splitlines() if line.strip()]
    if not rows or rows[0][0].strip() != "Topic":
        return (
            [f"unexpected find-hanging output: {output.strip()[:200]!r}"] if output.strip() else []
        )
    header = [cell.strip() for cell in rows[0]]
    found = []
    for row in rows[1:]:
        cell = dict(zip(header, (c.strip() for c in row), strict=False))
        found.append(
            f"{cell.get('Topic')}[{cell.get('Partition')}]: producer {cell.get('ProducerId')}, "
            f"epoch {cell.get('ProducerEpoch')}, from offset {cell.get('StartOffset')}, "
            f"open {cell.get('Duration(min)')} min"
        )
    return found
