#!/usr/bin/env bash
# One prepared run of the GPU checks (docs/gpu.md, "One prepared run"), sized for a lent machine's budget: one call
# of at most 10 minutes, its start included in 15 minutes of device time. Stages, each under its own time limit, each
# writing $OUT/<stage>.log and a line of $OUT/summary.txt (what a timed-out stage printed stays in its log):
#
#   env    torch / CUDA / transformers / hydra as the run sees them; a method attached to a tiny model on the device
#   tests  the tests marked `device`, on CUDA (LUKA_TEST_DEVICE=cuda: rows of a batch each equal to the row alone,
#          stacked and packed layers, 0 host syncs under CUDA's sync-debug mode, the graph-ready steady state, the
#          Triton kernel compiled for real), -v so that a timeout keeps what passed and failed
#   half   the rest of them, every method in bfloat16 and float16 (tests/test_half_precision.py: 216 cases), not
#          in the default run (name it in a second call if the budget allows)
#   bench  decode tokens/s at batch 1, 4, 8, 16 on Llama-3.1-8B's shape in bf16 at 8K (issue 60's GPU command):
#          $OUT/gpu_8b_8k.json and .png, beside stock transformers' batched generate
#
# On the lent machine (its python3 holds a CUDA torch), after `bash scripts/gpu_kit.sh` here:
#   device run, carry [".whl"], timeout_s 600:  bash scripts/gpu_checks.sh            (or name stages: ... tests bench)
# Here, the same flow on the CPU in about two minutes (small sizes; what it proves is the script, not the GPU):
#   GPU_CHECKS_SMOKE=1 PYTHON=.venv/bin/python OUT=/tmp/gpu_smoke bash scripts/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-results/gpu_checks}
SMOKE=${GPU_CHECKS_SMOKE:-0}
STAGES=${*:-env tests bench}
ALLOWED="env, tests, bench, half"
for s in $STAGES; do  # every name checked before any stage runs
    case $s in env|tests|bench|half) ;; *) echo "gpu_checks: unknown stage '$s'; allowed: $ALLOWED"; exit 2 ;; esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the wheels the machine's image lacks (scripts/gpu_kit.sh), ahead of its own
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/luka_site \
        .whl/*.whl || { echo "gpu_checks: the wheels in .whl/ did not install"; exit 1; }
    export PYTHONPATH="/tmp/luka_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$SMOKE" = 1 ]; then DEV=cpu; DTYPE=float32; WORKERS=2; else DEV=cuda; DTYPE=bfloat16; WORKERS=8; fi

summary="$OUT/summary.txt"
: > "$summary"
stage() {  # name, seconds, command...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name: at most $limit s, from $(date -u +%T) UTC"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$summary"
    tail -n 30 "$OUT/$name.log"
}

for s in $STAGES; do
    case $s in
    env)
        stage env 90 "$PY" - "$DEV" "$DTYPE" <<'PYEOF'
import sys, time
import torch, transformers, hydra, triton
dev, dtype = sys.argv[1], sys.argv[2]
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "hydra", hydra.__version__, "triton", triton.__version__)
if dev == "cuda":
    print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
import luka_bench as lb
from luka_bench.models import TinyRandomModel
t0 = time.perf_counter()
lm = TinyRandomModel(name="tiny", arch="llama", num_hidden_layers=2, device=dev, dtype=dtype).load()
with lb.attach(lm, lb.method("h2o", budget=0.25)) as kv:
    prompts = [[(7 * i) % 250 + 3 for i in range(n)] for n in (297, 245)]  # two lengths, ids of its 256-token vocabulary
    answers = kv.generate_many(prompts, None, max_new_tokens=4, batch_size=2)
    alone = [kv.generate(p, None, max_new_tokens=4) for p in prompts]
print("two rows decoded together with h2o on", dev, [a.token_ids for a in answers], "alone",
      [a.token_ids for a in alone], f"{time.perf_counter() - t0:.1f} s")
PYEOF
        ;;
    tests)
        if [ "$SMOKE" = 1 ]; then
            sel=(tests/test_batch_rows.py tests/test_graph_ready.py -k "h2o or streaming")
        else
            sel=(-m device tests/ --ignore tests/test_half_precision.py)
        fi
        stage tests 270 env LUKA_TEST_DEVICE="$DEV" "$PY" -m pytest -v -p no:cacheprovider -n "$WORKERS" \
            --timeout 150 --durations 15 -rfE "${sel[@]}"
        ;;
    half)
        if [ "$SMOKE" = 1 ]; then sel=(-k "h2o and llama"); else sel=(); fi
        stage half 270 env LUKA_TEST_DEVICE="$DEV" "$PY" -m pytest -v -p no:cacheprovider -n "$WORKERS" \
            --timeout 150 --durations 15 -rfE tests/test_half_precision.py "${sel[@]}"
        ;;
    bench)
        if [ "$SMOKE" = 1 ]; then
            args=(--model tiny_llama --batches 1,2 --steps 3 --length 1200 --tasks niah_single_1,fwe --rounds 1
                  --methods full h2o)
        else
            args=(--model shape_llama31_8b --device cuda --dtype bfloat16 --length 8192 --rounds 2)
        fi
        stage bench 200 "$PY" scripts/bench_batch.py "${args[@]}" --json "$OUT/gpu_8b_8k.json" --plot
        ;;
    esac
done
echo "== summary ($OUT)"
cat "$summary"
