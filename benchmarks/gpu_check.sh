#!/usr/bin/env bash
# The prepared GPU check: bench_pretrain at both shapes, the ChnSentiCorp GPU profile through the bundle, bf16
# labelling at batch 32 and 256; docs/results/gpu_*.json written as it goes (see benchmarks/gpu_check.py).
#   benchmarks/gpu_check.sh                 # on a GPU machine with the project installed (about 5 minutes, H100)
#   benchmarks/gpu_check.sh --dry-run       # on CPU at toy size, into a temporary directory
# Other options (--steps, --config, --out, --store, --label-input) go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
