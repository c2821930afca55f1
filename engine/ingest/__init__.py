"""Writing corrections safely: ingest snapshots, ledgers, upserts and appends as the
changelog they mean, and correct or retract one row by its primary key, against the
topic's own live rows (docs/ingest.md)."""

from refold.ingest.merge import BadInput, TopicNotKeyed
from refold.ingest.run import IngestResult, KeyedChange, NoLiveRow, correct, ingest, retract

__all__ = ["BadInput", "IngestResult", "KeyedChange", "NoLiveRow", "TopicNotKeyed", "correct", "ingest", "retract"]
