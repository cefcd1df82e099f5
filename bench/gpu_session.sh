#!/usr/bin/env bash
# One lent-GPU session in one call: install, the GPU suite, the GPU-only tests, a tuning pass of quantized-KV
# decode at issue 21's benchmark shape, and that benchmark again with the tables it produced. Everything lands
# in $OUT (at most 8 files: the device tool's limit).
#
#   OUT=/tmp/out SUITE_SKIP="gpu_df11" bash bench/gpu_session.sh      (PEERS_DIR: default bench/peers_files)
#   OUT=/tmp/out TUNE_OPS="df11_rows_decode df11_rows_gemv" bash bench/gpu_session.sh   (step 3b: tune more ops)
#
# SUITE_SKIP: more suite sections or bench modules to skip (the suite's tuning pass is always skipped: step 3
# tunes instead). One --skip only: argparse keeps the last one given.
#
# The whole call ends by SESSION_SECONDS (default 540: the device tool runs a command at most 600 s, and a lease
# is 15 minutes with the machine's start): each step runs under its own limit capped by what is left, a step
# with nothing left is skipped and says so, and $OUT/extra.tgz is rewritten after every step, so a slow or
# failing step costs its own numbers only and a kill keeps what finished.
# Each step's TERM is followed by a KILL 20 s on (`timeout -k 20`): a step that swallowed its TERM cannot hold the
# session past its deadline.
set -u
OUT=${OUT:?set OUT to the output folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEADLINE=$(( $(date +%s) + ${SESSION_SECONDS:-540} ))
RESERVE=${PACK_RESERVE:-15}  # seconds kept for packing after the last step
work=$(mktemp -d)  # everything but the suite's JSON and the log is tarred into $OUT/extra.tgz

# budget LIMIT: the next step's seconds, LIMIT capped by what is left before the deadline (0: skip it).
budget() {
  local left=$(( DEADLINE - $(date +%s) - RESERVE ))
  if (( left >= $1 )); then echo "$1"; elif (( left >= 5 )); then echo "$left"; else echo 0; fi
}
# skipped WHAT [WHY]: a log line for a step not run (default reason: nothing left before the deadline).
skipped() { echo "gpu_session: skipped $1 (${2:-session deadline: SESSION_SECONDS=${SESSION_SECONDS:-540}})" | tee -a "$OUT/log.txt"; }
pack() { tar czf "$OUT/extra.tgz.part" -C "$work" . && mv "$OUT/extra.tgz.part" "$OUT/extra.tgz"; }
trap 'pack; exit 124' TERM

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUT/smi.txt" 2>&1
t=$(budget 120)
timeout -s TERM -k 20 "$t" $PY -m pip install -q -e . --no-deps --no-build-isolation >"$OUT/install.txt" 2>&1 \
  || timeout -s TERM -k 20 "$t" $PY -m pip install -q . --no-deps --no-build-isolation >>"$OUT/install.txt" 2>&1

# 1. The suite: ceilings, correctness of every kernel, the kernels' benchmarks (no tuning pass: step 3), the
# peers beside ours when their files came along (bench/fetch_peers.sh; carry bench/peers_files).
PEERS_DIR=${PEERS_DIR:-bench/peers_files}
t=$(budget "${SUITE_SECONDS:-360}")
if (( t > 0 )); then
  timeout -s TERM -k 20 "$t" $PY bench/gpu_suite.py --out "$OUT/suite.json" --peers-dir "$PEERS_DIR" \
    --skip tuning ${SUITE_SKIP:-} \
    2>&1 | grep -v -e "UserWarning: no tuned config" -e "cfg = \|config = launch_config(" | tee -a "$OUT/log.txt"
else skipped "the suite"; fi
pack

# 1b. The GPU model fitted on the suite's single operators (bench/gpu_ops.py: the LLMCompass set, leave-one-out) and
# checked on a Llama-3-8B layer's operators: CPU work on the suite's JSON, its table into the log.
t=$(budget 30)
if (( t > 0 )) && [ -s "$OUT/suite.json" ]; then
  timeout -s TERM -k 20 "$t" $PY -m codesign.dataflow.gpu_model --suite "$OUT/suite.json" --no-validation \
    >"$work/gpu_model_fit.txt" 2>&1
  tail -60 "$work/gpu_model_fit.txt" | tee -a "$OUT/log.txt"
fi
pack

# 2. The tests marked gpu (skipped on CPU machines): compiled kernels against their references, CUDA-graph decode.
t=$(budget "${TESTS_SECONDS:-120}")
if (( t > 0 )); then
  timeout -s TERM -k 20 "$t" $PY -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/kernels tests/integrations >"$work/gpu_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$work/gpu_tests.txt" | tail -8 | tee -a "$OUT/log.txt"  # full log: extra.tgz
else skipped "the gpu tests"; fi
pack

# 3. Tune quantized-KV decode at the benchmark's shape (batch 16, context 32k, Llama-3-8B heads, blocks of 32).
# The first H200 session found 20 s of search plus start-up (inputs, fp64 reference) needs more than 32 s.
# Default formats: those whose kernels changed since the last timing (KIVI, Oaken and mixed metadata reads;
# INT8's WORDS8 switch) and INT4; int2 and fp8 were tuned in session 4 (KV_FORMATS="... int2 fp8" adds them).
# Each format's fastest predicted configs (bench/attention_configs.py --shortlist, sm_90) are tried first, then the
# rest of its space in order; without the file, random search.
shape="M=16,q_heads=32,kv_heads=8,head_dim=128,block_size=32,ctx=32768"
SHORTLIST=${SHORTLIST:-bench/results/attention_shortlist_sm90.json}
if [ -s "$SHORTLIST" ]; then search="--strategy exhaustive --first $SHORTLIST"; else search="--strategy random"; fi
for fmt in ${KV_FORMATS:-int8 int4 kivi oaken mixed}; do
  t=$(budget "${TUNE_SECONDS:-60}")
  if (( t < 30 )); then skipped "tuning paged_attention_$fmt" "$t s for it, tuning needs 30"; continue; fi  # start-up ~20 s
  timeout -s TERM -k 20 "$t" $PY -m codesign.cli tune --op "paged_attention_$fmt" --shape "$shape" \
    --dtype bfloat16 $search --max-seconds "${TUNE_BUDGET:-25}" --cache "$work/cache.jsonl" \
    --export --out-dir "$work/tables" --json "$work/tune_$fmt.json" 2>&1 | grep -v UserWarning | tail -3 \
    | tee -a "$OUT/log.txt"
  pack
done

# 3b. Opt-in: more ops, each at its bench/gpu_suite.py TUNE_SHAPES shape, into the same cache and tables (e.g. the
# DF11 rows layout's kernels, untuned so far: TUNE_OPS="df11_rows_decode df11_rows_gemv"; ~TUNE_SECONDS each).
for op in ${TUNE_OPS:-}; do
  t=$(budget "${TUNE_SECONDS:-60}")
  if (( t < 30 )); then skipped "tuning $op" "$t s for it, tuning needs 30"; continue; fi
  op_shape=$($PY -c "import sys; sys.path.insert(0, 'bench'); import gpu_suite; print(gpu_suite.TUNE_SHAPES['$op'])") \
    || { echo "gpu_session: no TUNE_SHAPES entry for $op" | tee -a "$OUT/log.txt"; continue; }
  timeout -s TERM -k 20 "$t" $PY -m codesign.cli tune --op "$op" --shape "$op_shape" \
    --dtype bfloat16 --strategy random --max-seconds "${TUNE_BUDGET:-25}" --cache "$work/cache.jsonl" \
    --export --out-dir "$work/tables" --json "$work/tune_$op.json" 2>&1 | grep -v UserWarning | tail -3 \
    | tee -a "$OUT/log.txt"
  pack
done

# 4. The KV benchmark again, looking the tuned tables up first.
t=$(budget "${KV_SECONDS:-90}")
if (( t > 0 )) && [ -d "$work/tables" ]; then
  CODESIGN_CONFIG_DIR="$work/tables" timeout -s TERM -k 20 "$t" $PY bench/gpu_kvquant.py \
    >"$work/kv_tuned.json" 2>"$work/kv_tuned.err"
  tail -c 3000 "$work/kv_tuned.json" | tee -a "$OUT/log.txt"
elif (( t > 0 )); then echo "gpu_session: no tuned tables, the tuned KV benchmark not run" | tee -a "$OUT/log.txt"
else skipped "the tuned KV benchmark"; fi
pack
# 5. With time left: compiled decode (torch.compile, mode="reduce-overhead") beside captured decode of the fused bf16
# Llama-3-8B at batch 1; compiling the 32-layer step takes a minute or more, so it comes last and only with
# HF_COMPILED_SECONDS (default 150) left.
t=$(budget "${HF_COMPILED_SECONDS:-150}")
if (( t >= ${HF_COMPILED_SECONDS:-150} )); then
  timeout -s TERM -k 20 "$t" $PY bench/gpu_hf.py --variants codesign-bf16-fused-graph codesign-bf16-fused-compiled \
    --batches 1 --out "$work/hf_compiled.json" 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/log.txt"
else skipped "compiled decode" "$t s left, it needs ${HF_COMPILED_SECONDS:-150}"; fi
pack
echo "gpu_session: done in $(( $(date +%s) - DEADLINE + ${SESSION_SECONDS:-540} )) s" | tee -a "$OUT/log.txt"
