"""`refold.spark.daemon`: PySpark's worker daemon with pyspark imported from its
installation, not from the archives Spark puts first on the workers' path."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from refold.spark.daemon import unzipped_path


def _package(root: Path, name: str) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    return root / name


def _archive(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x/__init__.py", "")
    return str(path)


def test_the_archives_inside_the_unpacked_installation_go(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    home = _package(site, "pyspark")
    _package(site, "py4j")
    own_zip = _archive(home / "python" / "lib" / "pyspark.zip")
    own_py4j = _archive(home / "python" / "lib" / "py4j-0.10.9.9-src.zip")
    own_jar = _archive(home / "jars" / "spark-core_2.13-4.1.1.jar")
    elsewhere = _archive(tmp_path / "spark-home" / "python" / "lib" / "pyspark.zip")
    stdlib = str(tmp_path / "python311.zip")  # on every path, usually absent
    path = [own_zip, own_py4j, "", own_jar, elsewhere, stdlib, str(site)]

    assert unzipped_path(path) == ["", elsewhere, stdlib, str(site)]


@pytest.mark.parametrize("unpacked", [["pyspark"], ["py4j"], []])
def test_without_both_packages_unpacked_the_path_stays(tmp_path: Path, unpacked: list[str]) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    for name in unpacked:
        _package(site, name)
    home = site / "pyspark"
    path = [_archive(home / "python" / "lib" / "pyspark.zip"), _archive(home / "jars" / "spark-core.jar"), str(site)]

    assert unzipped_path(path) == path


@pytest.mark.spark
def test_a_spark_task_imports_pyspark_unzipped(spark: Any) -> None:
    """The engine's session runs its Python workers through the daemon: a task sees no
    archive of the pyspark installation on its path, nor their importers."""
    import pyspark

    home = os.path.dirname(os.path.realpath(pyspark.__file__))

    def probe(_: Any) -> Any:
        import sys

        import pyspark as worker_pyspark

        archives = [entry for entry in list(sys.path) + list(sys.path_importer_cache) if os.path.isfile(entry)]
        yield (os.path.realpath(worker_pyspark.__file__), archives, "refold.spark.tasks" in sys.modules)

    [(imported, archives, preloaded)] = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
    assert imported.startswith(home + os.sep) and "python/lib" not in imported
    assert not [entry for entry in archives if os.path.realpath(entry).startswith(home + os.sep)], archives
    assert preloaded  # by the daemon, before it forked the worker (this task never imports it)


@pytest.mark.spark
def test_a_spark_worker_starts_with_the_daemons_imports_frozen(spark: Any) -> None:
    """PySpark's daemon runs `gc.collect()` in a worker after every task: the objects the
    daemon imported before forking are frozen, so that collection does not scan them."""

    def probe(_: Any) -> Any:
        import gc
        import time

        began = time.process_time()
        gc.collect()
        yield gc.get_freeze_count(), len(gc.get_objects()), time.process_time() - began

    [(frozen, scanned, _seconds)] = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
    assert frozen > 50_000  # refold.spark.tasks and everything it imports (~100k objects)
    assert scanned < frozen / 2, (frozen, scanned)
