#!/usr/bin/env bash
# Kernel variants timed side by side on the GPU, then (NCU=1) an ncu profile of the library's
# forward and main backward, in one device call:
#   source .gpu/setup.sh && bash lab/gpu_perf.sh
# BWD_VARIANTS / FWD_VARIANTS: the --variants of lab/bwd_variants.py / lab/fwd_variants.py
# (comma-separated: the labels containing one of them, or "=label" exactly; empty: that tool is skipped); BWD_PROBLEMS / FWD_PROBLEMS their --problems; KVCACHE=1 also runs
# lab/kvcache_variants.py (attention_kvcache's kernel variants, kvcache.txt); JOBS compile
# processes (default 8, so that a suite precompile can run beside it). Outputs go to $OUT (or
# ./gpu-out): bwd_variants.txt, fwd_variants.txt, ncu.txt, perf-summary.txt, and perf-logs.tgz (the
# JSONs and stderr; the device tool brings back at most 8 files).
set -uo pipefail
dest=${OUT:-gpu-out}
mkdir -p "$dest"
work=$(mktemp -d /tmp/gpu-perf.XXXXXX)
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tlcache}
export FLASHSINK_CACHE_DIR=${FLASHSINK_CACHE_DIR:-$PWD/.fscache}
source tools/unpack_kernel_bundle.sh
export PYTHONUNBUFFERED=1
stop_at=${STOP_AT:-560}
left() { local l=$((stop_at - SECONDS)); echo $(( l > 5 ? l : 5 )); }
jobs=${JOBS:-8}
bw=${BWD_VARIANTS-"ws 64x128/s2,strict"}
fw=${FWD_VARIANTS-"=ws 128x128/s2,=ws/fold 128x128/s2"}
br=skipped fr=skipped nr=skipped
if [ -n "$bw" ]; then
  timeout "$(left)" python lab/bwd_variants.py --problems "${BWD_PROBLEMS:-causal-d128,gptoss-full}" --jobs "$jobs" \
    --variants "$bw" --json "$work/bwd_variants.json" > "$dest/bwd_variants.txt" 2> "$work/bwd_variants.err"
  br=$?
fi
if [ -n "$fw" ]; then
  timeout "$(left)" python lab/fwd_variants.py --problems "${FWD_PROBLEMS:-causal-d128,gptoss-full}" --jobs "$jobs" \
    --variants "$fw" --json "$work/fwd_variants.json" > "$dest/fwd_variants.txt" 2> "$work/fwd_variants.err"
  fr=$?
fi
kr=skipped
if [ -n "${KVCACHE:-}" ]; then
  timeout "$(left)" python lab/kvcache_variants.py > "$dest/kvcache.txt" 2> "$work/kvcache.err"
  kr=$?
fi
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  # one eager fwd+bwd of causal bf16 D64 N8192 H64/8 after a warm-up; the forward and the main
  # backward profiled once each (speed of light, warp stalls, tensor-core and issue utilization)
  timeout "$(left)" ncu --target-processes all -k "regex:flashsink_(fwd|bwd)_kernel" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats python lab/ncu_target.py > "$dest/ncu.txt" 2>&1
  nr=$?
fi
{
  echo "==== gpu_perf (${FLASHSINK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, ${SECONDS}s): bwd rc=$br fwd rc=$fr kvcache rc=$kr ncu rc=$nr"
  [ -f "$dest/bwd_variants.txt" ] && grep -E "^==|main |bwd total|TFLOP|bitwise|WRONG|FAIL|preprocess|pre/" "$dest/bwd_variants.txt"
  [ -f "$dest/fwd_variants.txt" ] && tail -n 30 "$dest/fwd_variants.txt"
  [ -f "$dest/kvcache.txt" ] && cat "$dest/kvcache.txt"
} | tee "$dest/perf-summary.txt"
tar -czf "$dest/perf-logs.tgz" -C "$work" .
