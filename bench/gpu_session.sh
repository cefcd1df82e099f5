#!/usr/bin/env bash
# One lent-GPU session in one call (about 7 minutes on an H200): install, the GPU suite, the GPU-only
# tests, a tuning pass of quantized-KV decode at issue 5's benchmark shape, and that benchmark again
# with the tables it produced. Everything lands in $OUT (at most 8 files: the device tool's limit).
#
#   OUT=/tmp/out SUITE_SKIP="gpu_df11" bash bench/gpu_session.sh      (PEERS_DIR: default bench/peers_files)
#   OUT=/tmp/out TUNE_OPS="df11_rows_decode df11_rows_gemv" bash bench/gpu_session.sh   (step 3b: tune more ops)
#
# SUITE_SKIP: more suite sections or bench modules to skip (the suite's tuning pass is always skipped: step 3
# tunes instead). One --skip only: argparse keeps the last one given.
#
# Each step has its own time limit and the next step runs whatever the last one did, so one slow or
# failing step costs its own numbers only.
set -u
OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUT/smi.txt" 2>&1
($PY -m pip install -q -e . --no-deps --no-build-isolation || $PY -m pip install -q . --no-deps --no-build-isolation) \
  >"$OUT/install.txt" 2>&1

# 1. The suite: ceilings, correctness of every kernel, the kernels' benchmarks (no tuning pass: step 3), the
# peers beside ours when their files came along (bench/fetch_peers.sh; carry bench/peers_files).
PEERS_DIR=${PEERS_DIR:-bench/peers_files}
timeout -s TERM "${SUITE_SECONDS:-360}" $PY bench/gpu_suite.py --out "$OUT/suite.json" --peers-dir "$PEERS_DIR" \
  --skip tuning ${SUITE_SKIP:-} \
  2>&1 | grep -v -e "UserWarning: no tuned config" -e "cfg = \|config = launch_config(" | tee "$OUT/log.txt"

work=$(mktemp -d)  # everything below is tarred into $OUT/extra.tgz at the end

# 2. The tests marked gpu (skipped on CPU machines): compiled kernels against their references.
timeout -s TERM "${TESTS_SECONDS:-120}" $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels \
  >"$work/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$work/gpu_tests.txt" | tail -8 | tee -a "$OUT/log.txt"  # full log: extra.tgz

# 3. Tune quantized-KV decode at the benchmark's shape (batch 16, context 32k, Llama-3-8B heads, blocks of 32).
# The first H200 session found 20 s of search plus start-up (inputs, fp64 reference) needs more than 32 s.
# Default formats: those whose kernels changed since the last timing (KIVI, Oaken and mixed metadata reads;
# INT8's WORDS8 switch) and INT4; int2 and fp8 were tuned in session 4 (KV_FORMATS="... int2 fp8" adds them).
shape="M=16,q_heads=32,kv_heads=8,head_dim=128,block_size=32,ctx=32768"
for fmt in ${KV_FORMATS:-int8 int4 kivi oaken mixed}; do
  timeout -s TERM "${TUNE_SECONDS:-60}" $PY -m codesign.cli tune --op "paged_attention_$fmt" --shape "$shape" \
    --dtype bfloat16 --strategy random --max-seconds "${TUNE_BUDGET:-25}" --cache "$work/cache.jsonl" \
    --export --out-dir "$work/tables" --json "$work/tune_$fmt.json" 2>&1 | grep -v UserWarning | tail -3 \
    | tee -a "$OUT/log.txt"
done

# 3b. Opt-in: more ops, each at its bench/gpu_suite.py TUNE_SHAPES shape, into the same cache and tables (e.g. the
# DF11 rows layout's kernels, untuned so far: TUNE_OPS="df11_rows_decode df11_rows_gemv"; ~TUNE_SECONDS each).
for op in ${TUNE_OPS:-}; do
  op_shape=$($PY -c "import sys; sys.path.insert(0, 'bench'); import gpu_suite; print(gpu_suite.TUNE_SHAPES['$op'])") \
    || { echo "gpu_session: no TUNE_SHAPES entry for $op" | tee -a "$OUT/log.txt"; continue; }
  timeout -s TERM "${TUNE_SECONDS:-60}" $PY -m codesign.cli tune --op "$op" --shape "$op_shape" \
    --dtype bfloat16 --strategy random --max-seconds "${TUNE_BUDGET:-25}" --cache "$work/cache.jsonl" \
    --export --out-dir "$work/tables" --json "$work/tune_$op.json" 2>&1 | grep -v UserWarning | tail -3 \
    | tee -a "$OUT/log.txt"
done

# 4. The KV benchmark again, looking the tuned tables up first.
CODESIGN_CONFIG_DIR="$work/tables" timeout -s TERM "${KV_SECONDS:-90}" $PY bench/gpu_kvquant.py \
  >"$work/kv_tuned.json" 2>"$work/kv_tuned.err"
tail -c 3000 "$work/kv_tuned.json" | tee -a "$OUT/log.txt"
tar czf "$OUT/extra.tgz" -C "$work" .
echo "gpu_session: done"
