"""`refold produce` / `refold consume` on the real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.kafka

REFOLD = [sys.executable, "-m", "refold.cli.main"]

EVENTS = [
    {"op": "+A", "event_time": 1000, "player_name": "Alice", "score": 100},
    {"op": "+A", "event_time": 1001, "player_name": "Bob", "score": 80},
    {"op": "-C", "event_time": 1002, "player_name": "Bob", "score": 80},
    {"op": "+C", "event_time": 1002, "player_name": "Bob", "score": 85},
    {"op": 1, "event_time": 1003, "player_name": "Alice", "score": 100},
]


def _run(args: list[str], bootstrap: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*REFOLD, "--bootstrap-servers", bootstrap, *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def test_round_trip_all_four_ops(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    name = topic(partitions=1)
    path = tmp_path / "events.jsonl"
    path.write_bytes(_jsonl(EVENTS))
    produced = _run(["produce", name, str(path), "--key", "player_name"], bootstrap_servers)
    assert produced.returncode == 0, produced.stderr.decode()
    assert "wrote 5 events" in produced.stdout.decode()

    consumed = _run(["consume", name, "--from-beginning", "--until-idle", "3"], bootstrap_servers)
    assert consumed.returncode == 0, consumed.stderr.decode()
    rows = [orjson.loads(line) for line in consumed.stdout.splitlines()]
    assert [r["op"] for r in rows] == ["+A", "+A", "-C", "+C", "-R"]
    assert rows[3] == {"op": "+C", "event_time": 1002, "player_name": "Bob", "score": 85}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"op": "+X", "player_name": "Al", "score": 1}, "op must be one of"),
        ({"op": "+A", "player_name": None, "score": 1}, "null key"),
        ({"op": "+C", "player_name": "Al", "score": 1}, "+C without a preceding -C"),
    ],
)
def test_invalid_line_is_named_and_nothing_is_written(
    bootstrap_servers: str, topic, tmp_path: Path, bad: dict, reason: str
) -> None:
    name = topic(partitions=1)
    path = tmp_path / "events.jsonl"
    path.write_bytes(_jsonl([EVENTS[0], EVENTS[1], bad]))
    produced = _run(["produce", name, str(path), "--key", "player_name"], bootstrap_servers)
    assert produced.returncode == 2
    err = produced.stderr.decode()
    assert "line 3" in err and reason in err
    consumed = _run(["consume", name, "--from-beginning", "--until-idle", "2"], bootstrap_servers)
    assert consumed.stdout == b""


def test_unpaired_correction_at_end_is_refused(bootstrap_servers: str, topic, tmp_path: Path) -> None:
    name = topic(partitions=1)
    path = tmp_path / "events.jsonl"
    path.write_bytes(_jsonl([EVENTS[0], EVENTS[2]]))
    produced = _run(["produce", name, str(path), "--key", "player_name"], bootstrap_servers)
    assert produced.returncode == 2
    assert "-C at the end of the input without its +C" in produced.stderr.decode()


def test_killed_between_correction_halves_leaves_nothing_visible(bootstrap_servers: str, topic) -> None:
    name = topic(partitions=1)
    proc = subprocess.Popen(
        [*REFOLD, "--bootstrap-servers", bootstrap_servers, "produce", name, "-", "--key", "player_name",
         "--per-transaction", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None
    # One committed transaction of two events, then a -C whose +C never comes.
    proc.stdin.write(_jsonl(EVENTS[:3]))
    proc.stdin.flush()
    time.sleep(3.0)  # let the -C reach the broker inside its open transaction
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)

    consumed = _run(["consume", name, "--from-beginning", "--until-idle", "3"], bootstrap_servers)
    rows = [orjson.loads(line) for line in consumed.stdout.splitlines()]
    assert [r["op"] for r in rows] == ["+A", "+A"]
