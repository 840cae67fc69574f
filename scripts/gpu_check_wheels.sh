#!/usr/bin/env bash
# Fetches, here, the wheels that the engine sections of benchmarks/gpu_check.py need on the GPU
# machine, whose image has PyTorch but not pydantic (asyncrl.config and so the inference engine
# import it): pydantic and its dependencies at the versions installed here, for CPython 3.12 on
# x86-64 Linux, into .whl/ (git-ignored). scripts/gpu_check.sh unpacks them into a temporary folder
# there; nothing is installed into that machine's environment.
#
# Usage: bash scripts/gpu_check_wheels.sh      (then carry .whl along with the repository)
#   PY_VERSION   the GPU machine's Python (default 3.12)
#   WHEEL_DIR    where the wheels go (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
mapfile -t reqs < <(python3 - <<'PY'
from importlib.metadata import version
for name in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"):
    print(f"{name}=={version(name)}")
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEEL_DIR" "${reqs[@]}"
echo "gpu_check_wheels: ${reqs[*]} in $WHEEL_DIR"
