#!/usr/bin/env bash
# On a TPU host with only a local package index (scripts/tpu_host_setup.sh's host): installs the project's
# dependencies beside the host's JAX, then runs `python -m orchestrator.bench.tpu` with the arguments given.
#   bash scripts/tpu_run_checks.sh --out runs/tpu --minutes 9
set -u
cd "$(dirname "$0")/.."
. scripts/tpu_host_setup.sh || exit 1
python3 -m orchestrator.bench.tpu "$@"
