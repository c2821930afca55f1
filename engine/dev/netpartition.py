"""Cutting one node of a local Kafka cluster off the network, then healing it (the chaos
harness's `partition` fault, `refold.dev.chaoskafka`).

Every node listens on 127.0.0.1, so addresses cannot tell them apart. Two things can:
the ports a node listens on (what others send to it) and the cgroup its JVM runs in
(what it sends: its replies, its fetches from the leaders, its votes and heartbeats to
the controllers). A node to be cut off is started inside a cgroup of its own (cgroup
v2; its sockets carry the cgroup they were made in, so it must start there), and the
cut is two iptables rules on the host's OUTPUT chain, which every packet over the
loopback passes:

    iptables -I OUTPUT -m cgroup --path refold-chaos/<node> -j DROP        # all it sends
    iptables -I OUTPUT -p tcp -o lo -m multiport --dports <its ports> -j DROP  # all sent to it

Packets are dropped, not refused: connections hang as they do behind a failed switch,
until TCP's and Kafka's timeouts notice. Healing deletes the rules; the node's
connections resume or are made again. This needs root, a cgroup v2 hierarchy and
iptables with the `cgroup` and `multiport` matches (`unavailable()` says which is
missing; the harness leaves the fault out then, and says why).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

_PARENT = "refold-chaos"


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup` on a v2 host,
    `/sys/fs/cgroup/unified` on a hybrid one), or None."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def node_cgroup(name: str) -> Path:
    """The cgroup directory a node runs in (made when missing)."""
    root = cgroup2_root()
    if root is None:
        raise OSError("no cgroup v2 hierarchy is mounted")
    folder = root / _PARENT / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["iptables", "-w", "5", *args], capture_output=True, text=True, check=False
    )


def unavailable() -> str | None:
    """Why a partition cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "it needs root (iptables and cgroups)"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    if cgroup2_root() is None:
        return "no cgroup v2 hierarchy is mounted"
    try:
        probe = node_cgroup(f"probe-{uuid.uuid4().hex[:6]}")
    except OSError as exc:
        return f"cannot make a cgroup: {exc}"
    try:
        rule = ("OUTPUT", "-m", "cgroup", "--path", _relative(probe), "-j", "DROP")
        added = _iptables("-I", *rule)
        if added.returncode != 0:
            return f"iptables cannot match by cgroup: {added.stderr.strip()}"
        _iptables("-D", *rule)
        return None
    finally:
        probe.rmdir()


def _relative(folder: Path) -> str:
    root = cgroup2_root()
    assert root is not None
    return str(folder.relative_to(root))


class Cut:
    """The rules that cut one node off: `apply()`, then `heal()` (both idempotent)."""

    def __init__(self, cgroup: Path, ports: Sequence[int]) -> None:
        self._rules = [
            ("OUTPUT", "-m", "cgroup", "--path", _relative(cgroup), "-j", "DROP"),
            (
                "OUTPUT",
                "-o",
                "lo",
                "-p",
                "tcp",
                "-m",
                "multiport",
                "--dports",
                ",".join(map(str, ports)),
                "-j",
                "DROP",
            ),
        ]
        self._applied: list[tuple[str, ...]] = []

    def apply(self) -> None:
        for rule in self._rules:
            done = _iptables("-I", *rule)
            if done.returncode != 0:
                self.heal()
                raise OSError(f"iptables -I {' '.join(rule)}: {done.stderr.strip()}")
            self._applied.append(rule)

    def heal(self) -> None:
        while self._applied:
            _iptables("-D", *self._applied.pop())

    def __enter__(self) -> Cut:
        self.apply()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.heal()


def remove_cgroups() -> None:
    """Remove the (empty) cgroups of nodes that no longer run; those still in use stay."""
    root = cgroup2_root()
    folder = root / _PARENT if root is not None else None
    if folder is None or not folder.is_dir():
        return
    for child in folder.iterdir():
        with contextlib.suppress(OSError):
            child.rmdir()
