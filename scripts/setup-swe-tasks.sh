#!/usr/bin/env bash
# The shipped SWE task set, examples/swe/tasks.jsonl: downloads the source distributions it was
# made from (PyPI sdists: source and tests) and recreates its task repositories under
# examples/swe/repos/ (gitignored), checking that each one's commit is its row's base_commit.
#
#   bash scripts/setup-swe-tasks.sh          # needs PyPI through pip, git, and asyncrl installed
#                                            # (pip install -e .: the rebuild is `asyncrl swe-tasks --rebuild`)
#
# Safe to re-run: repositories already at their base_commit are left as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's asyncrl, installed or not
if ! "$PYTHON" -c "import asyncrl.tools.swe_tasks" 2>/dev/null; then
  echo "setup-swe-tasks: $PYTHON cannot import asyncrl: install it first (pip install -e .)" >&2
  exit 1
fi
TASKS=examples/swe/tasks.jsonl
# name (the instance ids' prefix) -> the sdist the tasks were made from
SOURCES=("toolz toolz==1.2.0" "inflection inflection==0.5.1")

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for entry in "${SOURCES[@]}"; do
  read -r name spec <<<"$entry"
  mkdir -p "$tmp/$name/dl" "$tmp/$name/src"
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "$spec" -d "$tmp/$name/dl"
  tar -xzf "$tmp/$name"/dl/*.tar.gz -C "$tmp/$name/src"
  src="$(find "$tmp/$name/src" -mindepth 1 -maxdepth 1 -type d)"
  echo "setup-swe-tasks: $spec -> task repositories of $name"
  "$PYTHON" -m asyncrl swe-tasks --rebuild "$TASKS" --repo "$src" --name "$name"
done
