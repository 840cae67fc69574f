#!/usr/bin/env bash
# The reverse-text demo in one command: init-model -> sft-data -> sft -> eval -> rl -> eval.
#
#   bash examples/reverse_text/run.sh                 # outputs under outputs/reverse_text
#   OUT=/tmp/rt PORT=8600 SEED=1 bash examples/reverse_text/run.sh
#   BACKEND=vllm bash examples/reverse_text/run.sh    # RL stage on vLLM (bash scripts/setup-vllm.sh first)
#
# SEED (default 0) seeds the model init, the SFT data, SFT and RL. The eval keeps seed 0, so every
# seed's models are scored on the same 128 held-out tasks.
#
# Every stage prints progress; the RL stage evaluates on held-out tasks every 10 steps and names its
# best version; the last lines compare the SFT and RL models on held-out tasks and give the path of
# the run's report (plots of the RL run, its eval curve and both evals: open it in a browser).
# Re-running overwrites the previous run's stages (only the directories this script writes).
# SFT stops at a loss, so its last step varies; $OUT/sft/final links to its weights, the RL start point
# that rl.toml names.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-outputs/reverse_text}"
PORT="${PORT:-8400}"
SEED="${SEED:-0}"
# Must match [[orchestrator.envs.envs]] args in rl.toml: SFT data, RL tasks and eval share one env.
ENV_ARGS='{"min_len": 3, "max_len": 5}'
SFT_ROWS="${SFT_ROWS:-26000}"
CORRUPT_PROB="${CORRUPT_PROB:-0.3}"
EVAL_TASKS="${EVAL_TASKS:-128}"
MAX_TOKENS="${MAX_TOKENS:-10}"
ASYNCRL="${ASYNCRL:-python -m asyncrl}"
BACKEND="${BACKEND:-embedded}"
case "$BACKEND" in
  embedded) BACKEND_CFG=() ;;
  vllm) BACKEND_CFG=(@ "$HERE/rl-vllm.toml") ;;
  *) echo "BACKEND must be embedded or vllm, got '$BACKEND'" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

stage() { printf '\n=== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
last_weights() { ls -d "$1"/weights/step_* | sort -V | tail -1; }  # $1/weights/step_N, N the largest

t0=$SECONDS
rm -rf "$OUT/base" "$OUT/data" "$OUT/sft" "$OUT/rl" "$OUT/eval.jsonl"
mkdir -p "$OUT"

stage "1/6 init-model: a random tiny MoE"
$ASYNCRL init-model --preset tiny-moe --init-std 0.06 --out "$OUT/base" --seed "$SEED"

stage "2/6 sft-data: $SFT_ROWS reference answers, ${CORRUPT_PROB} of them with one wrong character"
$ASYNCRL sft-data --env reverse-text --num "$SFT_ROWS" --out "$OUT/data/sft.jsonl" \
    --corrupt-prob "$CORRUPT_PROB" --env-args "$ENV_ARGS" --seed "$SEED"

stage "3/6 sft: imperfect demonstrations -> the RL start point"
$ASYNCRL sft @ "$HERE/sft.toml" --model.path "$OUT/base" --data.path "$OUT/data/sft.jsonl" \
    --run-dir "$OUT/sft" --seed "$SEED"
ln -sfn "weights/$(basename "$(last_weights "$OUT/sft")")" "$OUT/sft/final"
SFT_MODEL="$OUT/sft/final"

evaluate() {  # $1 label, $2 model
    $ASYNCRL eval --model "$2" --label "$1" --env reverse-text --env-args "$ENV_ARGS" \
        --num "$EVAL_TASKS" --max-tokens "$MAX_TOKENS" --temperature 0 1 --json-out "$OUT/eval.jsonl"
}

stage "4/6 eval of the SFT model ($EVAL_TASKS held-out tasks, greedy and at temperature 1)"
evaluate sft "$SFT_MODEL"

stage "5/6 rl: inference server ($BACKEND) + orchestrator + trainer, asynchronous"
$ASYNCRL rl @ "$HERE/rl.toml" "${BACKEND_CFG[@]}" --model "$SFT_MODEL" --run-dir "$OUT/rl" \
    --deployment.base-port "$PORT" --seed "$SEED"
RL_MODEL="$(last_weights "$OUT/rl")"

stage "6/6 eval of the RL model"
evaluate rl "$RL_MODEL"

stage "done in $((SECONDS - t0)) s"
python - "$OUT" <<'PY'
import json, sys
rows = {(r["label"], r["temperature"]): r for r in map(json.loads, open(f"{sys.argv[1]}/eval.jsonl"))}
lines = [json.loads(line) for line in open(f"{sys.argv[1]}/rl/metrics.jsonl")]
orch = [r for r in lines if r.get("role") == "orchestrator"]
evals = [r for r in lines if r.get("role") == "eval"]  # [orchestrator.eval] in rl.toml
sft = [json.loads(line) for line in open(f"{sys.argv[1]}/sft/metrics.jsonl")]
tail = [r["loss"] for r in sft[-25:]]
print(f"SFT: {len(sft)} steps, mean loss of the last {len(tail)} {sum(tail) / len(tail):.3f}")
rewards = [r["reward/mean"] for r in orch if "reward/mean" in r]  # steps where episodes finished
k = max(1, len(rewards) // 4)
first = sum(rewards[:k]) / k
last = sum(rewards[-k:]) / k
for t, name in ((0.0, "greedy"), (1.0, "sampled, temperature 1")):
    sft, rl = rows[("sft", t)], rows[("rl", t)]
    print(f"eval reward ({name}, {sft['num_tasks']} held-out tasks): SFT {sft['reward']:.3f} -> RL {rl['reward']:.3f}"
          f"  (exact match {sft['rewards'].get('exact', 0):.3f} -> {rl['rewards'].get('exact', 0):.3f})")
print(f"training reward (sampled, steps where episodes finished): first {k} {first:.3f} -> last {k} {last:.3f}")
if evals:
    print("held-out pass@1 during RL: " + ", ".join(f"v{r['version']} {r['eval/reverse-text/pass@1']:.3f}" for r in evals))
PY
$ASYNCRL report "$OUT/rl" --eval "$OUT/eval.jsonl"  # prints "report: $OUT/rl/report/index.html"
