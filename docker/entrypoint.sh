#!/usr/bin/env bash
# The engine container's entrypoint: `refold run` on the mounted pipeline file.
#
#   REFOLD_BOOTSTRAP_SERVERS  the Kafka cluster (required), e.g. kafka:19092
#   REFOLD_PIPELINE           the pipeline file (default /pipeline/pipeline.yaml)
#   REFOLD_METRICS_PORT       serve Prometheus metrics on this port (optional)
#   REFOLD_UNTIL_IDLE         stop after this many seconds without input (optional; jobs, tests)
#   REFOLD_KAFKA_CONFIG       librdkafka settings, key=value lines (SASL, TLS: docs/SECURITY.md),
#                             e.g. a mounted secret; default /run/secrets/kafka.properties
#                             when that file exists
#
# Extra arguments go to `refold run`. The engine keeps no state of its own: Kafka
# is its recovery log, so the container needs no volume.
set -euo pipefail

pipeline="${REFOLD_PIPELINE:-/pipeline/pipeline.yaml}"
if [ -z "${REFOLD_BOOTSTRAP_SERVERS:-}" ]; then
  echo "refold: set REFOLD_BOOTSTRAP_SERVERS to the Kafka cluster, e.g. kafka:19092" >&2
  exit 2
fi
if [ ! -f "$pipeline" ]; then
  echo "refold: no pipeline file at $pipeline (mount one at /pipeline/pipeline.yaml or set REFOLD_PIPELINE)" >&2
  exit 2
fi

global=(--bootstrap-servers "$REFOLD_BOOTSTRAP_SERVERS")
kafka_config="${REFOLD_KAFKA_CONFIG:-}"
if [ -z "$kafka_config" ] && [ -f /run/secrets/kafka.properties ]; then
  kafka_config=/run/secrets/kafka.properties
fi
if [ -n "$kafka_config" ]; then
  if [ ! -r "$kafka_config" ]; then
    echo "refold: cannot read the Kafka settings file $kafka_config (REFOLD_KAFKA_CONFIG)" >&2
    exit 2
  fi
  global+=(--kafka-config "$kafka_config")
fi

args=(run "$pipeline")
if [ -n "${REFOLD_METRICS_PORT:-}" ]; then
  args+=(--metrics-port "$REFOLD_METRICS_PORT")
fi
if [ -n "${REFOLD_UNTIL_IDLE:-}" ]; then
  args+=(--until-idle "$REFOLD_UNTIL_IDLE")
fi
# the engine's log lines (JSON, one object a line, when not on a terminal) to stdout
exec refold "${global[@]}" "${args[@]}" "$@" 2>&1
