"""Read Delta and Iceberg tables with Spark itself and print their rows as JSON lines.

Run by `tests/test_lakehouse_e2e.py` in a subprocess of its own, so that the Spark
session of the test run (the engine's, without these jars) is never touched:

    python tests/lakehouse_spark_read.py '<request as JSON>'

The request: {"delta": {"path": …, "tables": [...]}, "iceberg": {"warehouse": …,
"catalog": …, "namespace": …, "tables": [...]}}. The session is `local[1]` with the
`lakehouse-readers` jar set of `refold.spark.jars`: Delta tables are read by path
through delta-spark, Iceberg tables by name through Iceberg's Spark runtime, with the
SQLite file of pyiceberg's SQL catalog (`<warehouse>/catalog.db`) as a JDBC catalog
named like the driver's `catalog` setting. Each output line is `{"format", "table",
"row"}`, the row with every column of the table as Spark reads it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from refold.spark.jars import resolve


def session(catalog: str | None, warehouse: str | None) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master("local[1]")
        .appName("refold-lakehouse-read")
        .config("spark.jars", ",".join(str(jar) for jar in resolve("lakehouse-readers")))
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        # a short-lived JVM: C1 only and the serial collector halve its CPU time (measured)
        .config("spark.driver.extraJavaOptions", "-Dlog4j2.level=WARN -XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        # Delta's session extension and catalog: without them delta-spark refuses even a
        # read by path (DELTA_CONFIGURE_SPARK_SESSION_WITH_EXTENSION_AND_CATALOG)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
    )
    if catalog is not None and warehouse is not None:
        root = Path(warehouse).resolve()
        prefix = f"spark.sql.catalog.{catalog}"
        builder = (
            builder.config(prefix, "org.apache.iceberg.spark.SparkCatalog")
            .config(f"{prefix}.type", "jdbc")
            .config(f"{prefix}.uri", f"jdbc:sqlite:{root / 'catalog.db'}")
            .config(f"{prefix}.warehouse", root.as_uri())
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def emit(fmt: str, table: str, frame: Any) -> None:
    for row in frame.collect():
        print(json.dumps({"format": fmt, "table": table, "row": row.asDict(recursive=True)}, default=str))


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    delta, iceberg = request.get("delta"), request.get("iceberg")
    spark = session(iceberg and iceberg["catalog"], iceberg and iceberg["warehouse"])
    try:
        for table in delta["tables"] if delta else ():
            emit("delta", table, spark.read.format("delta").load(str(Path(delta["path"]).resolve() / table)))
        for table in iceberg["tables"] if iceberg else ():
            emit("iceberg", table, spark.table(f"{iceberg['catalog']}.{iceberg['namespace']}.{table}"))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
