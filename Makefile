# Refold — two commands on a fresh clone: `make test` and `make demo`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
REFOLD := $(VENV)/bin/refold
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native

.PHONY: setup jars registry test test-slow test-container container unit lint docs demo chaos bench bench-hotpath bench-contenders bench-latency bench-scaling bench-tasks \
	bench-plots bench-clean bench-ingest bench-replication bench-windows bench-join \
	kafka-start kafka-stop clean

setup: $(STAMP) $(NATIVE)

# setuptools' notice "Editable installation" (engine/ is installed as `refold` through a
# meta path finder) is information only; a filter on its exact words keeps it off the terminal.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The native reduction core (Rust, native/): pip builds it with maturin and cargo, crates
# from crates.io; the engine runs in Python without it (refold.runtime.native).
$(NATIVE): $(STAMP) native/pyproject.toml native/Cargo.toml native/Cargo.lock $(wildcard native/src/*.rs native/src/*/*.rs native/src/*/*/*.rs)
	@command -v cargo >/dev/null || { echo "make setup: the native core needs Rust's cargo (Debian: apt-get install cargo)"; exit 1; }
	$(PY) -m pip install --quiet ./native
	touch $(NATIVE)

# Maven jars (Kafka broker, Spark's Kafka connector) into .refold/jars.
jars: setup
	$(REFOLD) jars

# Apicurio Registry (Maven Central, ~150 MB, once) for the tests against a real schema registry.
registry: setup
	$(PY) -m refold.dev.localregistry build

lint: setup
	$(VENV)/bin/ruff check engine connectors tests bench
	$(VENV)/bin/mypy

unit: setup
	$(PY) -m pytest tests -m "not kafka and not spark and not container and not slow" -q

test: setup jars registry lint
	$(PY) -m pytest tests -q --durations=60 -m "not container and not slow"

# The long end-to-end checks that repeat what a faster test in `make test` proves (marker
# slow): CI runs them after make test.
test-slow: setup jars
	$(PY) -m pytest tests -q --durations=10 -m slow

# The engine image (docker/Dockerfile) with docker, else podman (refold.dev.container:
# podman's storage under .refold/container; stand-in base images where none can be pulled).
CONTAINER_TAG ?= refold-engine:latest
container: setup
	$(PY) -m refold.dev.container build --tag $(CONTAINER_TAG)

# The end-to-end container test: the image built with podman, the engine in it against a
# broker on the host (tests/test_container.py; needs podman, buildah, runc, mmdebstrap).
test-container: setup jars
	$(PY) -m pytest tests/test_container.py -q -m container --durations=5

# The manual (docs/, mkdocs.yml) as a site in site/; strict: a broken link or a page
# missing from the navigation fails (tests/test_docs_site.py runs the same build).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

demo: setup jars
	$(PY) -m refold.dev.demo

chaos: setup jars
	$(PY) -m refold.dev.chaos
	$(PY) -m refold.dev.chaos --kafka-brokers 3 --kills 20

# `make bench`: the last runs' topics deleted (bench-clean), then every benchmark in one go (~20 minutes
# at the defaults on 2 cores), then the plots.
# Parts: bench-contenders (Refold vs the limit pipe, Spark SQL, Refold's reducer on Spark's sink, Flink; BENCH_ARGS, e.g.
# "--events 50000 --keys 5000 --contenders limit,refold"), bench-latency (at half the
# peak bench-contenders measured; LATENCY_ARGS), bench-scaling (keys, retractions,
# recovery; SCALING_ARGS), bench-tasks (the executor model: driver vs executor CPU,
# 1 vs 2 executors, restart with and without the local stores, many live keys, a
# re-grouping view in shards 1 vs 2; ~10 minutes; TASKS_ARGS, e.g. "--parts regroup"; by default
# the many-keys run has 10M live keys, ~5 of those minutes), bench-ingest (`refold ingest` of a
# 10M-row Parquet snapshot, then of one with 1 % changed and 0.1 % removed, beside DuckDB's diff
# of the two files and the limit pipe; INGEST_ARGS, e.g. "--rows 1000000"), bench-windows (a
# windowed view over 1M out-of-order events with late ones and late corrections: Refold with a
# lateness (per event, and emit: final) vs Flink's TUMBLE TVF and Spark's window(), each with a watermark; late events counted,
# lost or dead-lettered; Refold's state per shard against one horizon's worth; WINDOWS_ARGS, e.g.
# "--events 50000 --contenders refold,spark-sql"), bench-join (revenue per region over 1M order
# events joined with 50k customers who move between regions: Refold's join and grouped view vs
# Flink SQL's regular join + GROUP BY on the same two topics, both checked; JOIN_ARGS, e.g.
# "--events 50000 --customers 2500"), bench-plots.
# The first Flink run makes .refold/flink-venv.
TASKS_ARGS ?= --many-keys 10000000
INGEST_ARGS ?=
WINDOWS_ARGS ?=
JOIN_ARGS ?=

bench: bench-clean bench-hotpath bench-contenders bench-latency bench-scaling bench-tasks bench-ingest bench-windows \
	bench-join bench-replication bench-plots

# the topics earlier bench runs left on the local broker (a few GB a run), and their files
bench-clean: setup jars
	$(PY) -m bench.cleanup

# CPU per event of one shard's batches without Spark or commits: the grouped view on each
# core (and their ratio), then the Top-N view and the grouped view per tumble, hop and
# session window; last the join's reducers alone (its own options, not HOTPATH_ARGS:
# bench.hotpath_join)
bench-hotpath: setup jars
	$(PY) -m bench.hotpath $(HOTPATH_ARGS)
	$(PY) -m bench.hotpath --view top_n $(HOTPATH_ARGS)
	$(PY) -m bench.hotpath --view tumble $(HOTPATH_ARGS)
	$(PY) -m bench.hotpath --view hop $(HOTPATH_ARGS)
	$(PY) -m bench.hotpath --view session $(HOTPATH_ARGS)
	$(PY) -m bench.hotpath --view join
	$(PY) -m bench.hotpath --view join-shard

bench-contenders: setup jars
	$(PY) -m bench.run $(BENCH_ARGS)

bench-latency: setup jars
	$(PY) -m bench.latency $(LATENCY_ARGS)

bench-scaling: setup jars
	$(PY) -m bench.scaling $(SCALING_ARGS)

bench-tasks: setup jars
	$(PY) -m bench.tasks $(TASKS_ARGS)

# refold ingest --merge snapshot, its wall time, CPU and peak RSS beside DuckDB and the limit pipe
bench-ingest: setup jars
	$(PY) -m bench.ingest $(INGEST_ARGS)

# the price of replication: the limit pipe and Refold on one broker, then on a local cluster of
# three (replication factor 3, min.insync.replicas 2), in one run
bench-replication: setup jars
	$(PY) -m bench.replication $(REPLICATION_ARGS)

# windowed views over out-of-order input: Refold (exactly once, lateness, dead letters) vs Flink
# SQL's TUMBLE and Spark's window(), late events counted and lost, state boundedness (bench/windows.py)
bench-windows: setup jars
	$(PY) -m bench.windows $(WINDOWS_ARGS)

# a join then a grouped view: Refold's `view.join` + revenue per region vs Flink SQL's regular
# join + GROUP BY over the same orders and customers changelogs, both checked (bench/join.py)
bench-join: setup jars
	$(PY) -m bench.join $(JOIN_ARGS)

bench-plots: setup
	$(PY) -m bench.plots

kafka-start: setup jars
	$(REFOLD) kafka start

kafka-stop: setup
	$(REFOLD) kafka stop

clean:
	-$(REFOLD) kafka stop
	rm -rf .refold $(VENV)
