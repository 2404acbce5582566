#!/usr/bin/env bash
# Start N generators on this machine against a controller, stop them all on Ctrl-C / SIGTERM.
# (The learner does this itself with generators.local=N; this is for a learner started elsewhere.)
#
#   tools/launch_local.sh 2 tcp://127.0.0.1:5555 model=/path/to/base-model [overrides ...]
#
# Logs: generators/generator-<i>.log. Each generator hands its leases back when stopped.
set -euo pipefail
N=${1:?usage: launch_local.sh N CONTROLLER [hydra overrides ...]}
CONTROLLER=${2:?usage: launch_local.sh N CONTROLLER [hydra overrides ...]}
shift 2
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p generators
pids=()
for i in $(seq 0 $((N - 1))); do
  "$PYTHON" -m vapo_async.generator controller="$CONTROLLER" generator_id="local-$i" "$@" \
    > "generators/generator-$i.log" 2>&1 &
  pids+=($!)
  echo "generator local-$i: pid $!, log generators/generator-$i.log"
done
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
trap stop INT TERM
wait "${pids[@]}"
