#!/usr/bin/env bash
# The prepared GPU check: by default the GPU profile's own pretraining under the sync debug mode, and HF on the
# same pairs (gpu_pretrain.json); --full: bench_pretrain at both shapes, the ChnSentiCorp GPU profile through the
# bundle, bf16 labelling at batch 32 and 256; docs/results/gpu_*.json written as it goes (see gpu_check.py).
#   benchmarks/gpu_check.sh                 # the GPU profile's pretraining, ~300 steps, vs HF (meant to fit 8 min, H100)
#   benchmarks/gpu_check.sh --full          # the whole-pipeline check (20+ minutes)
#   benchmarks/gpu_check.sh --dry-run       # on CPU at toy size, into a temporary directory
# Other options (--steps, --config, --lexicon, --no-graphs, --out, --store, --label-input) go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
