"""The materialization drivers (DESIGN.md §4): `protocol` (Flow's materialization
protocol), `runtime` (the side that drives it), and one module per driver.

**Bookkeeping columns.** Besides a view's own columns, the tables the drivers write
carry columns of Refold's own, all named with a leading underscore. A reader of a view
table selects the view's columns (or reads `_doc`) and leaves these alone:

| column | tables | what |
|---|---|---|
| `_doc` | every driver's view and delta tables | the whole row as JSON, exactly as the view emitted it (what `Load` returns) |
| `_writer` | SQLite, PostgreSQL, Delta Lake, Iceberg | the shard that stored the row, `<writer>-<shard>` (e.g. `0-0`); null for rows from before shards |
| `_cause` | SQLite, PostgreSQL | the input event behind the row, the `refold.cause` of the view (delta) record that made it: `<partition>:<offset>` of the source topic; null with `outputs.provenance: off`, after a full refresh (a backfill) and for rows from before the column |
| `_key` | PostgreSQL, Delta Lake, Iceberg, Parquet | the key values as a JSON list (PostgreSQL: `jsonb`), in the view key's order |
| `_batch` | every table but SQLite's view tables | the batch that stored the row |
| `_seq` | Delta Lake, Iceberg and PostgreSQL delta tables | the row's place in its batch: `(_batch, _writer, _seq)` is the order the delta rows were written in |
| `_part` | PostgreSQL delta tables | the part (source partition) of the batch the row came from |
| `_deleted` | Parquet view files | the key's row was deleted in that file's batch |

SQLite and PostgreSQL keep each materialization's fencing nonce and runtime
checkpoint in a table of their own, `_refold_checkpoints`. `BOOKKEEPING` lists the
column names.
"""

BOOKKEEPING = ("_doc", "_writer", "_cause", "_key", "_batch", "_seq", "_part", "_deleted")
