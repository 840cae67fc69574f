#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): trainer MFU, FP8 block-scale matmul, engine decode tok/s and
# exact mode on one GPU, in under 5 minutes on an H200, with the machine's own PyTorch.
#
# Usage, from anywhere: bash scripts/gpu_check.sh [extra arguments of benchmarks/gpu_check.py]
#   Writes gpu_check.json and gpu_check.md to $GPU_CHECK_OUT, else $OUT,
#   else outputs/gpu_check. Exit status 1 if a check failed or a section raised.
#   Where the interpreter lacks pydantic (the GPU image does) and .whl/ holds wheels
#   (scripts/gpu_check_wheels.sh), they are unpacked into a temporary folder put on PYTHONPATH;
#   without them the decode and exact sections report the missing module and the others still run.
set -uo pipefail
launched="$(date +%s.%N)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${GPU_CHECK_OUT:-${OUT:-outputs/gpu_check}}"
extra=""
if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl; then
    extra="$site:"
  else
    echo "gpu_check.sh: could not unpack .whl/; running without pydantic" >&2
  fi
fi
PYTHONUNBUFFERED=1 PYTHONPATH="${extra}src${PYTHONPATH:+:$PYTHONPATH}" \
  exec "$PY" benchmarks/gpu_check.py --out "$out" --launched-at "$launched" "$@"
