"""The project's files state what is true now: none of them dates a fact by the work
session it came from (an ordinal or "this" before the word session, a note of one)
or names an issue of the project's tracker by its number. A user cannot look
either up; the fact, without its history, is what belongs in the file, and the
history belongs in CHANGELOG.md and the commits.

The patterns leave the other sessions alone: Spark sessions (`SparkSession`,
`spark_session`), database and pytest sessions, process sessions
(`start_new_session`), session windows (`session:`, `session_window(`, "a session
window", "the session's gap") and the drivers' `_Session` classes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
    r"|twentieth|thirtieth|fortieth|\d+(?:st|nd|rd|th))"
)
_GAP = r"(?:[ \t]+|[ \t]*\n[ \t]*)"  # a space, or a line break where a sentence wraps
# "session" followed by "window": an event-time window (the docs always say so)
_WINDOW = r"(?![ -]?windows?\b)"
PATTERNS = [
    # an ordinal before the word, also hyphenated or wrapped onto the next line
    re.compile(rf"\b{_ORDINAL}(?:{_GAP}|-)sessions?\b{_WINDOW}", re.IGNORECASE),
    # this, that, the previous, the next one…
    re.compile(
        rf"\b(?:this|that|previous|earlier|next|last|later|past|prior|recent|our){_GAP}"
        rf"(?:work{_GAP})?sessions?\b{_WINDOW}",
        re.IGNORECASE,
    ),
    re.compile(rf"\bsession[ -]notes?\b|\bsessions?{_GAP}ago\b|\b(?:at|from|since|until|by)"
               rf"{_GAP}the{_GAP}session['\u2019]s{_GAP}(?:start|end)\b", re.IGNORECASE),
    # the word issue before a number, with a space, a hyphen or a hash between (not the
    # word ending a line above a numbered list)
    re.compile(r"\bissues?(?:[ \t]*[#-]?[ \t]*|[ \t]*\n[ \t]*(?!\d+\.\s))\d+\b", re.IGNORECASE),
    # a hash and a number on their own (an upstream project's issue, owner/repo then the
    # hash, is a word's suffix: allowed)
    re.compile(r"(?<![\w/.&+-])#\d+\b"),
]


def references(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line on which a reference to a work session or a
    tracker issue starts (a reference may wrap onto the next line)."""
    lines = text.splitlines()
    starts = sorted({text.count("\n", 0, match.start()) for pattern in PATTERNS
                     for match in pattern.finditer(text)})
    return [(index + 1, lines[index].strip()) for index in starts]


def _tracked_texts() -> list[tuple[str, str]]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    texts = []
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        try:
            texts.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return texts


def test_no_file_refers_to_work_sessions_or_tracker_issues() -> None:
    texts = _tracked_texts()
    assert len(texts) > 100, "git ls-files listed too few files: is this a checkout?"
    found = [f"{name}:{number}: {line}" for name, text in texts for number, line in references(text)]
    assert not found, (
        "state the fact, not the work session or tracker issue it came from "
        f"({len(found)} lines):\n" + "\n".join(found)
    )


# The phrases are assembled, so this file does not hold what it looks for.
_S = "session"


def test_the_patterns_find_session_and_issue_references() -> None:
    for phrase in [
        f"measured in the ninth {_S}: 200,000 dumps",
        f"## Twenty-third {_S} (2026-11-27): the contenders",
        f"the twenty-first {_S}'s run",
        f"as before the 18th {_S}",
        f"Making stage 2 cheaper, as this {_S} did",
        f"in the previous {_S} we found",
        f"a {_S} note on the bench",
        f"three {_S}s ago",
        f"the twelfth\n{_S} measured it",
        f"Refold is 2.5x its sixth-{_S} throughput",
        f"the run was stopped at the {_S}'s end",
        "the targets of " + "issue\n16 are met",
        "Added with re-grouping in shards (" + "issue" + " 17)",
        "issue" + "-18 target",
        "the " + "issue" + " #" + "41 asks",
        "blocked (see " + "#" + "41)",
    ]:
        assert references(phrase), phrase


def test_the_patterns_leave_other_sessions_alone() -> None:
    for phrase in [
        "spark = spark_session(name='refold-bench')",
        "a session-wide local SparkSession of its own",
        "the engine is up end to end: Spark session, query, first commit",
        "COPY into this database session's temporary staging table",
        "A session window: rows of one key whose event times are less than `gap` apart.",
        "  session: {gap: 30m}",
        "SELECT session_window(ts, '10 minutes')",
        "the first session window of a key",
        "this session window closes when no event comes within the gap",
        "the last session window of the key grows by the late event",
        "the next session window's start",
        "The session's broker: where it is and where it came from.",
        "stopped at the end of the session",
        "start_new_session=True,",
        "class _Session(FencedSession[Connection]):",
        "flush() ends in a SystemError (confluent-kafka-python#865)",
        "# 1. the header",
        "an issue with the broker's log",
        "how to report an issue\n1. the command",
    ]:
        assert not references(phrase), phrase
