#!/usr/bin/env bash
# A focused GPU check that fits one device call from a fresh machine (the whole suite, tools/gpu_suite.sh,
# needs two calls on one warm machine):
#   source .gpu/setup.sh && bash lab/gpu_quick.sh
# 1. precompiles, in parallel processes, the kernels of the named cases (both precision modes) and of every
#    packed varlen case (tests/gpu_cases.py);
# 2. runs those tests (test_kernels_gpu.py -k QUICK_K, all of test_varlen_gpu.py) with XDIST workers
#    (the 16k varlen cases' fp64 references need ~40 GB each: with 8 workers they can run out of memory;
#    run them alone, QUICK_K="16k" XDIST=0);
# 3. `flashsink bench` (BENCH_SYSTEMS) on golden, gpt-oss SWA (with gate 2, so the fast mode's rows are
#    judged by the fast gate), gpt-oss full N=8192 and the causal bf16 D128 N4096 H64/8 problem
#    (--no-gate2 there: their rows show the strict gate's verdict), unless SKIP_BENCH=1.
# Each step stops at STOP_AT seconds (default 560) so that the call's limit never loses the logs; logs
# and summary.txt go to $OUT (or ./gpu-out).
set -uo pipefail
dest=${OUT:-gpu-out}
mkdir -p "$dest"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tlcache}
export FLASHSINK_CACHE_DIR=${FLASHSINK_CACHE_DIR:-$PWD/.fscache}
export PYTHONUNBUFFERED=1
stop_at=${STOP_AT:-560}
left() { local l=$((stop_at - SECONDS)); echo $(( l > 5 ? l : 5 )); }
commit=${FLASHSINK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}

timeout "$(left)" python lab/precompile_quick.py > "$dest/precompile.log" 2>&1
pc=$?
echo "precompiled at ${SECONDS}s (rc=$pc)" >> "$dest/precompile.log"

timeout "$(($(left) - ${BENCH_S:-150}))" python -m pytest tests/test_kernels_gpu.py tests/test_varlen_gpu.py -m gpu -q -rfE \
  -p no:cacheprovider -n "${XDIST:-8}" --max-worker-restart=2 -k "${QUICK_K:-named or lse or empty or varlen}" --durations=10 \
  > "$dest/pytest.log" 2>&1
pt=$?

tm=skipped
if [ -z "${SKIP_BENCH:-}" ]; then
  sys=${BENCH_SYSTEMS:-flashsink,flashsink-strict,flex,fla,sdpa}
  { timeout "$(left)" python -m flashsink bench --systems "$sys" --preset golden,gptoss-swa \
    && timeout "$(left)" python -m flashsink bench --systems "$sys" --preset gptoss-full --seq 8192 --no-gate2 \
    && timeout "$(left)" python -m flashsink bench --systems "$sys" --shape 1,64,8,4096,128 --no-gate2; } \
    > "$dest/bench.txt" 2> "$dest/bench.err"
  tm=$?
fi

{
  echo "==== quick GPU check ($commit, ${SECONDS}s)"
  echo "precompile rc=$pc  pytest rc=$pt  bench rc=$tm"
  tail -n 2 "$dest/precompile.log"
  grep -E "[0-9]+ (passed|failed|error)" "$dest/pytest.log" | tail -n 2
  grep -E "^(FAILED|ERROR)" "$dest/pytest.log" | head -30
  [ -f "$dest/bench.txt" ] && grep -A 12 "^summary" "$dest/bench.txt"
} | tee "$dest/summary.txt"
