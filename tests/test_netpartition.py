"""The chaos harness's cluster checks beyond its faults' own: a node cut off the network
and healed (`refold.dev.netpartition`), and Kafka's `find-hanging` after a run
(`refold.dev.hanging`), each against real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pg_fixtures import IN_CI

from refold.dev import netpartition
from refold.dev.hanging import find_hanging, hanging_rows
from refold.dev.localproc import spawn

_WHY_NOT = netpartition.unavailable()
# CI runs as root with cgroup v2 and iptables: there, a partition that cannot be made fails
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None and not IN_CI, reason=f"no partitions here: {_WHY_NOT}"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1.5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, TimeoutError, OSError):
        return False


def test_a_cut_node_neither_answers_nor_is_reached_until_healed(tmp_path: Path) -> None:
    port = _free_port()
    cgroup = netpartition.node_cgroup(f"test-{port}")
    server = spawn(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        what="a web server",
        log_file=tmp_path / "server.log",
        pid_file=tmp_path / "server.pid",
        cwd=tmp_path,
        cgroup=cgroup,
    )
    try:
        deadline = time.monotonic() + 20
        while not _answers(port):
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.2)
        assert (
            f"0::/refold-chaos/test-{port}"
            in Path(f"/proc/{server.pid}/cgroup").read_text().splitlines()
        )
        with netpartition.Cut(cgroup, [port]):
            assert not _answers(port)
            # what it sends is dropped too: its outgoing connection gets no answer
            probe = subprocess.run(
                [
                    "sh",
                    "-c",
                    f"echo $$ > {cgroup}/cgroup.procs; exec {sys.executable} -c "
                    f"\"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/', timeout=1.5)\"",
                ],
                capture_output=True,
                timeout=30,
                check=False,
            )
            assert probe.returncode != 0
        assert _answers(port)
    finally:
        server.kill()
        server.wait()
        netpartition.remove_cgroups()
    assert not cgroup.exists()


def test_find_hanging_reads_kafkas_table() -> None:
    header = "Topic\tPartition\tProducerId\tProducerEpoch\tCoordinatorEpoch\tStartOffset\tLastTimestamp\tDuration(min)\t"
    assert hanging_rows(header + "\n") == []
    row = "t\t2\t1001\t0\t5\t42\t1700000000000\t16\t"
    assert hanging_rows(f"{header}\n{row}\n") == [
        "t[2]: producer 1001, epoch 0, from offset 42, open 16 min"
    ]
    assert hanging_rows("Exception in thread main") == [
        "unexpected find-hanging output: 'Exception in thread main'"
    ]


def test_find_hanging_on_the_test_broker_finds_nothing_and_no_answer_is_a_failure(kafka_broker: Any) -> None:
    assert find_hanging(kafka_broker.bootstrap, [1]) == []
    problems = find_hanging(f"127.0.0.1:{_free_port()}", [1], timeout=8)
    assert len(problems) == 1 and problems[0].startswith("find-hanging on broker 1")
