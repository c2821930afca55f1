"""docs/tutorial.md (and docs/joins.md), run as a reader runs it: its commands typed into
one shell, on a real broker and real Spark, its outputs compared with what the page shows.

The page's conventions (also in the comment at the top of its source):

- a ```sh block holds commands: every ```sh block, in order, goes to one bash
  (`set -eo pipefail`; each block sourced from a file, with stdin from /dev/null, so
  a command that reads stdin cannot eat the next one). The shell starts in a
  temporary folder that stands for the clone (`.venv` there links to this
  checkout's virtualenv) with `.venv/bin` on PATH, REFOLD_BOOTSTRAP_SERVERS naming
  the test broker and REFOLD_HOME a folder of its own;
- a block whose fence names a file (```yaml title="revenue.yaml") is written, as it
  stands, to that name in the shell's current folder before the next command;
- a ```text block is what the ```sh block before it prints (stdout and stderr
  together; Python unbuffered, so in a terminal's order), compared line by line
  after `normalise`: librdkafka's own log lines (`%4|…`) left out, and a duration
  such as `0.09s` matching any. A ```sh block without one is not compared (`refold
  run`'s progress lines are not the page's business), only required to succeed;
- any other block is not run.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from confluent_kafka.admin import AdminClient

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tutorial.md"
VENV = REPO / ".venv"

# The topics the page's commands make: none may exist before, every one must exist on
# the test broker after (so every command and the pipeline went to REFOLD_BOOTSTRAP_SERVERS).
TOPICS = ("purchases", "revenue.view", "revenue.delta", "revenue.checkpoints", "revenue.state")
# the other pages run the same way, each with its topics
PAGES = {"tutorial.md": TOPICS,
         "joins.md": ("orders", "customers", "regions.view", "regions.checkpoints", "regions.state")}

BLOCK_SECONDS = 300.0  # the longest one block may take (a `refold run` takes ~25 s alone)

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_FENCE = re.compile(r"^```(?P<info>[^`\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_TITLE = re.compile(r'\btitle="(?P<name>[^"]+)"')
_LIBRDKAFKA_LOG = re.compile(r"^%\d+\|\d+\.\d+\|")
_DURATION = re.compile(r"\b\d+\.\d+s\b")


@dataclass(frozen=True, slots=True)
class Step:
    """One block of the page the test acts on."""

    kind: Literal["sh", "file", "output"]
    text: str
    line: int  # of the opening fence in the page
    name: str = ""  # a file's name


def page_steps(markdown: str, page: str = "tutorial.md") -> list[Step]:
    """The page's blocks the test acts on, in order: commands, files, outputs. An output
    block that does not follow a command block (another output, a file, nothing) is a
    mistake in the page: ValueError naming its line."""
    # comments hold no blocks (the page's own describes the conventions): blank them
    # out, keeping their newlines so that line numbers stay the page's
    markdown = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    steps: list[Step] = []
    for match in _FENCE.finditer(markdown):
        info, body = match.group("info").strip(), match.group("body")
        line = markdown.count("\n", 0, match.start()) + 1
        title = _TITLE.search(info)
        lang = info.split()[0] if info else ""
        if title:
            name = title.group("name")
            if Path(name).name != name:
                raise ValueError(f"docs/{page}:{line}: a file block's title is a file name, not {name!r}")
            steps.append(Step("file", body, line, name))
        elif lang == "sh":
            steps.append(Step("sh", body, line))
        elif lang == "text":
            if not steps or steps[-1].kind != "sh":
                raise ValueError(f"docs/{page}:{line}: an output block that follows no ```sh block")
            steps.append(Step("output", body, line))
    return steps


def normalise(text: str) -> list[str]:
    """Lines to compare: librdkafka's log lines left out, durations made alike, trailing
    blanks gone."""
    lines = [_DURATION.sub("<duration>", line.rstrip()) for line in text.splitlines()
             if not _LIBRDKAFKA_LOG.match(line)]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class Shell:
    """One bash, fed block by block, as a reader's terminal. After each block it prints
    a marker line with its current folder, so the test knows where the block's output
    ends and where the next file goes."""

    def __init__(self, cwd: Path, env: dict[str, str], scripts: Path, page: str = "tutorial.md") -> None:
        self.page = page
        self.scripts = scripts
        self.cwd = cwd
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the test can end it and its children
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send("set -eo pipefail")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def run(self, step: Step) -> str:
        """Runs one block; returns what it printed. AssertionError when the shell ends (a
        command failed: `set -e`) or the block takes longer than BLOCK_SECONDS."""
        script = self.scripts / f"block-{step.line}.sh"
        script.write_text(step.text)
        marker = f"__tutorial_block_done_{uuid.uuid4().hex}"
        self._send(f". {_quote(str(script))} < /dev/null\nprintf '\\n%s %s\\n' {marker} \"$PWD\"")
        printed: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=BLOCK_SECONDS)
            except queue.Empty:
                raise AssertionError(
                    f"docs/{self.page}:{step.line}: the block ran longer than {BLOCK_SECONDS:.0f}s; "
                    f"it printed:\n" + "\n".join(printed[-60:])
                ) from None
            if line is None:
                code = self.proc.wait(timeout=30)
                raise AssertionError(
                    f"docs/{self.page}:{step.line}: a command failed (exit status {code}):\n"
                    f"{step.text}it printed:\n" + "\n".join(printed[-60:])
                )
            if line.startswith(marker + " "):
                self.cwd = Path(line[len(marker) + 1:])
                if printed and printed[-1] == "":  # the marker's own leading newline
                    printed.pop()
                return "\n".join(printed)
            printed.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._send("exit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a command still runs (a block that timed out)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _topics(kafka_config: dict[str, Any]) -> set[str]:
    """The broker's topics (a client of its own, gone when this returns)."""
    return set(AdminClient(dict(kafka_config)).list_topics(timeout=30).topics)


def _delete_topics(kafka_config: dict[str, Any], names: list[str]) -> None:
    admin = AdminClient(dict(kafka_config))
    for future in admin.delete_topics(names, operation_timeout=30).values():
        future.result(30)


# The page, read without a broker -------------------------------------------------------


def test_the_page_follows_its_conventions() -> None:
    steps = page_steps(PAGE.read_text())
    kinds = [step.kind for step in steps]
    assert kinds.count("sh") >= 10 and kinds.count("output") >= 8, kinds
    files = {step.name: step.text for step in steps if step.kind == "file"}
    assert set(files) >= {"purchases.jsonl", "revenue.yaml", "correction.jsonl", "table.py"}
    pipeline = yaml.safe_load(files["revenue.yaml"])
    # no kafka: block, so the pipeline follows REFOLD_BOOTSTRAP_SERVERS and the local broker
    assert "kafka" not in pipeline
    assert pipeline["outputs"]["view"]["topic"] in TOPICS and pipeline["outputs"]["delta"]["topic"] in TOPICS
    commands = "\n".join(step.text for step in steps if step.kind == "sh")
    for needed in ("refold produce", "refold run", "refold consume", "--until-idle", "python table.py"):
        assert needed in commands


def test_page_steps_reads_the_conventions() -> None:
    page = (
        '<!--\n```sh\nnot run\n```\n-->\nText.\n\n```sh\necho hi\n```\n\n```text\nhi\n```\n\n'
        '```yaml title="p.yaml"\na: 1\n```\n\n```yaml\nshown only\n```\n'
    )
    assert page_steps(page) == [
        Step("sh", "echo hi\n", 8), Step("output", "hi\n", 12), Step("file", "a: 1\n", 16, "p.yaml")
    ]
    with pytest.raises(ValueError, match=r"tutorial\.md:1: an output block that follows no"):
        page_steps("```text\nhi\n```\n")
    with pytest.raises(ValueError, match="a file name"):
        page_steps('```sh title="../x.sh"\nrm -rf /\n```\n')


def test_normalise() -> None:
    assert normalise("wrote 4 events (0.09s)\n%4|1795828430.709|GETPID|rdkafka#producer-2| retrying\n\n") == [
        "wrote 4 events (<duration>)"
    ]
    assert normalise("a (12.50s)") == normalise("a (0.01s)")
    assert normalise("consumed 7 records") != normalise("consumed 8 records")


# The page, run ----------------------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("page", ["tutorial.md", pytest.param("joins.md", marks=pytest.mark.slow)])
def test_the_page_runs_as_written(tmp_path: Path, bootstrap_servers: str, kafka_config: dict[str, Any],
                                  page: str) -> None:
    """The tutorial in `make test`; the joins page, which runs the engine twice more, in
    `make test-slow`."""
    assert (VENV / "bin" / "refold").is_file(), f"no virtualenv with refold in {VENV} (make setup)"
    steps = page_steps((REPO / "docs" / page).read_text(), page)
    topics = PAGES[page]
    before = _topics(kafka_config)
    present = sorted(set(topics) & before)
    assert not present, (
        f"docs/{page}'s topics {', '.join(present)} already exist on {bootstrap_servers}: "
        "the page starts from a broker without them"
    )

    clone = tmp_path / "clone"  # stands for the reader's clone
    clone.mkdir()
    (clone / ".venv").symlink_to(VENV, target_is_directory=True)
    scripts = tmp_path / "blocks"
    scripts.mkdir()
    env = dict(os.environ)
    env.update(
        PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        REFOLD_BOOTSTRAP_SERVERS=bootstrap_servers,
        REFOLD_HOME=str(tmp_path / "refold-home"),
        PYTHONUNBUFFERED="1",
    )
    transcript: list[str] = []  # every block, how long it took and what it printed: transcript.txt
    shell = Shell(clone, env, scripts, page)
    try:
        printed = ""
        for step in steps:
            if step.kind == "file":
                (shell.cwd / step.name).write_text(step.text)
            elif step.kind == "sh":
                started = time.monotonic()
                printed = shell.run(step)
                took = time.monotonic() - started
                transcript += [f"$ (docs/{page}:{step.line}, {took:.1f}s)", step.text.rstrip(), printed]
            else:
                expected, got = normalise(step.text), normalise(printed)
                assert got == expected, (
                    f"docs/{page}:{step.line}: the page shows\n" + "\n".join(expected)
                    + "\nbut the commands printed\n" + "\n".join(got)
                )
        after = _topics(kafka_config)
        missing = sorted(set(topics) - after)
        assert not missing, f"the commands made no topics {', '.join(missing)} on {bootstrap_servers}"
    finally:
        shell.close()
        (tmp_path / "transcript.txt").write_text("\n".join(transcript) + "\n")
        # leave the broker as it was, so that the page can run on it again
        pipelines = {name.split(".")[0] for name in topics if "." in name}
        made = [name for name in _topics(kafka_config) - before if name in topics or name.split(".")[0] in pipelines]
        if made:
            with contextlib.suppress(Exception):  # as the topic fixture: cleanup, not the test
                _delete_topics(kafka_config, sorted(made))
