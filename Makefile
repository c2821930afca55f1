# Refold — two commands on a fresh clone: `make test` and `make demo`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
REFOLD := $(VENV)/bin/refold
STAMP  := $(VENV)/.installed

.PHONY: setup jars test unit lint demo chaos bench kafka-start kafka-stop clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Maven jars (Kafka broker, Spark's Kafka connector) into .refold/jars.
jars: setup
	$(REFOLD) jars

lint: setup
	$(VENV)/bin/ruff check engine connectors tests bench
	$(VENV)/bin/mypy

unit: setup
	$(PY) -m pytest tests -m "not kafka and not spark" -q

test: setup jars lint
	$(PY) -m pytest tests -q --durations=15

demo: setup jars
	$(PY) -m refold.demo

chaos: setup jars
	$(PY) -m bench.chaos

# Refold vs the limit pipe, Spark and Flink; e.g. BENCH_ARGS="--events 50000 --keys 5000 --contenders limit,refold".
# The first run makes .refold/flink-venv (PyFlink) and resolves Flink's Kafka connector jar.
bench: setup jars
	$(PY) -m bench.run $(BENCH_ARGS)

kafka-start: setup jars
	$(REFOLD) kafka start

kafka-stop: setup
	$(REFOLD) kafka stop

clean:
	-$(REFOLD) kafka stop
	rm -rf .refold $(VENV)
