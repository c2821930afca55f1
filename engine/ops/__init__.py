"""Operating a pipeline: `monitor` (Prometheus metrics, progress lines), `status`
(`refold status`: committed offsets, lag, last batch), `verify` (outputs checked
record by record against `refold.reference`)."""
