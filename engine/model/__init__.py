"""The changelog model (DESIGN.md §1): `Op` and `ChangelogEvent`, the message key,
the one `-C`/`+C` pairing (`Pairing`), the stream forms (`RETRACT_FORM`, Debezium
envelopes) and `Reason`, the one list of dead-letter reasons. Pure Python: no I/O."""
