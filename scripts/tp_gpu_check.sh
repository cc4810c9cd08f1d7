#!/usr/bin/env bash
# Issue 25 on a two-GPU host, in one call (about 8 minutes; run from the repo root):
#   scripts/tp_gpu_check.sh [OUT_DIR]      (default: $OUT, else /tmp/tp-check)
# 1. the tensor-parallel GPU tests (the one-shot symmetric-memory all-reduce + fused add/RMSNorm against
#    NCCL + PyTorch; TP=2 greedy == TP=1 through the engine with CUDA graphs), while the 8B-shape random
#    checkpoint is written;
# 2. the standard offline workload (1000 requests, docs/benchmarks.md) at TP=1 and TP=2 with the defaults;
# 3. the TP=2 decode-step profile at batch 256, before (every all-reduce on NCCL) and after (one-shot).
# Files: tests.txt, tp_step.json, tput_tp1.json, tput_tp2.json, summary.txt; the summary is printed last.
set -u
OUT_DIR=${1:-${OUT:-/tmp/tp-check}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
MODEL=${MODEL_DIR:-/tmp/m8b}
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

stamp "8B checkpoint -> $MODEL, GPU tests in parallel"
if [ ! -f "$MODEL/config.json" ]; then
  $PY scripts/make_model.py --out "$MODEL" --preset llama-3-8b --device cuda > "$OUT_DIR/make_model.txt" 2>&1 &
  MAKE_PID=$!
else
  MAKE_PID=""
fi
timeout 200 $PY -m pytest -q -p no:cacheprovider -m gpu -x tests/test_tensor_parallel_gpu.py \
  > "$OUT_DIR/tests.txt" 2>&1
echo "exit $?" >> "$OUT_DIR/tests.txt"
stamp "tests: $(tail -2 "$OUT_DIR/tests.txt" | tr '\n' ' ')"
[ -n "$MAKE_PID" ] && wait "$MAKE_PID"
stamp "checkpoint ready"


for TP in 1 2; do
  timeout 170 $PY scripts/bench_throughput.py --model "$MODEL" --device cuda --num-requests 1000 \
    --runs paged --tensor-parallel-size $TP --json-out "$OUT_DIR/tput_tp$TP.json" \
    > "$OUT_DIR/tput_tp$TP.txt" 2>&1
  stamp "throughput TP=$TP: exit $?"
done

timeout 170 $PY scripts/bench_tp_step.py --model "$MODEL" --tensor-parallel-size 2 --batch 256 \
  --variants nccl,symm_mem --modes graphs --no-piecewise-graphs --steps 32 --kernels 8 \
  --json-out "$OUT_DIR/tp_step.json" > "$OUT_DIR/tp_step.txt" 2>&1
stamp "profile: exit $?"

$PY - "$OUT_DIR" > "$OUT_DIR/summary.txt" 2>&1 <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("tests:", " ".join((out / "tests.txt").read_text().split("\n")[-3:]).strip())
try:
    for r in json.loads((out / "tp_step.json").read_text()):
        if "skipped" in r:
            print(f"profile {r['variant']} b{r['batch']}: skipped ({r['skipped']})")
            continue
        print(
            f"profile {r['variant']} b{r['batch']}: step {r['step_wall_ms']} ms, GPU {r['gpu_ms']} ms, "
            f"{r['decode_tok_s']} tok/s, all-reduces {r.get('all_reduce_calls')} x "
            f"{r.get('all_reduce_message_bytes')} B = {r.get('all_reduce_us')} us, idle {r.get('gpu_idle_ms')} ms"
        )
        print("  groups us:", r["kernels"]["groups"] if r.get("kernels") else None)
except Exception as e:  # noqa: BLE001
    print("profile: no result:", e)
tput = {}
for tp in (1, 2):
    try:
        run = json.loads((out / f"tput_tp{tp}.json").read_text())["runs"][-1]
        tput[tp] = run["output_tokens_per_s"]
        keys = ("output_tokens_per_s", "wall_s", "peak_running", "preemptions", "num_kv_blocks")
        print(f"throughput TP={tp}:", {k: run.get(k) for k in keys})
    except Exception as e:  # noqa: BLE001
        print(f"throughput TP={tp}: no result:", e)
if len(tput) == 2:
    print(f"TP=2 / TP=1 output tok/s: {tput[2] / tput[1]:.2f}x (goal >= 1.7x)")
PYEOF
cat "$OUT_DIR/summary.txt"
stamp "done"
