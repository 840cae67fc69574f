#!/usr/bin/env bash
# The optional tiers the test suite exercises, installed where this machine allows:
#   - bubblewrap (Debian package): the sandbox's OS boundary (docs/envs.md);
#   - the vLLM tier in its own venv, .venv-vllm (scripts/setup-vllm.sh; docs/inference.md);
#   - the shipped SWE task set's repositories, from PyPI sdists (scripts/setup-swe-tasks.sh; docs/envs.md),
#     rebuilt by asyncrl itself: run `pip install -e ".[dev,verifiers]"` (the Python extras) first.
# A tier that cannot be installed is reported and its tests skip, saying why; this script never fails.
set -uo pipefail
cd "$(dirname "$0")/.."

if command -v bwrap >/dev/null; then
  echo "setup-tiers: bubblewrap $(bwrap --version 2>/dev/null | awk '{print $2}') present"
elif (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) 2>/dev/null \
  || (command -v sudo >/dev/null && sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap >/dev/null); then
  echo "setup-tiers: installed bubblewrap"
else
  echo "setup-tiers: warning: could not install bubblewrap; the sandbox isolation tests will skip" >&2
fi

if ! bash scripts/setup-vllm.sh; then
  echo "setup-tiers: warning: could not set up the vLLM tier; tests marked vllm will skip" >&2
fi

if ! bash scripts/setup-swe-tasks.sh; then
  echo "setup-tiers: warning: could not build the SWE task set (examples/swe); its repository tests will skip" >&2
fi
exit 0
