#!/usr/bin/env bash
# The benchmark with every peer, in one device call (after tools/gpu_suite.sh on a warm machine,
# the kernels are already in the cache):
#   source .gpu/setup.sh && PRESETS="golden gptoss-swa" bash tools/gpu_bench.sh
# One `flashsink bench` per preset, or per custom problem (PRESETS="shape=1,64,8,4096,128 golden")
# (each writes its JSON as it goes, so a cut-short call keeps
# what finished); presets started after BUDGET_S seconds are left for the next call. Then the
# per-kernel profiles (golden, gpt-oss full N=8192) and tools/bench_merge.py over every JSON in
# bench-results/ (earlier calls' results travel there as untracked files).
set -uo pipefail
dest=${OUT:-gpu-out}
mkdir -p "$dest" bench-results
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tlcache}
export FLASHSINK_CACHE_DIR=${FLASHSINK_CACHE_DIR:-$PWD/.fscache}
source tools/unpack_kernel_bundle.sh
export PYTHONUNBUFFERED=1
source tools/fa4_on_path.sh
python -c "import flash_attn.cute" 2>/dev/null && echo "fa4: on the path" || echo "fa4: not available (the fa4 rows will say why)"
start=$SECONDS
for p in ${PRESETS:-golden gptoss-swa causal-d128 gptoss-full varlen decode decode-paged hf-train}; do
  if (( SECONDS - start > ${BUDGET_S:-420} )); then echo "not started (time): $p" | tee -a "$dest/bench.txt"; continue; fi
  # an entry shape=B,H,HKV,N,D[,W] is one custom problem (--shape, dtype $DTYPE, default bf16): the
  # issues' own problems (H=64, H_kv=8) are not all presets
  case $p in
    shape=*) args=(--shape "${p#shape=}" --dtype "${DTYPE:-bf16}"); name=shape-$(echo "${p#shape=}" | tr , _) ;;
    *) args=(--preset "$p"); name=$p ;;
  esac
  echo "=== $p (at ${SECONDS}s)" | tee -a "$dest/bench.txt"
  timeout ${PRESET_TIMEOUT_S:-300} python -m flashsink bench "${args[@]}" --json "bench-results/$name.json" \
    ${BENCH_ARGS:-} 2>>"$dest/bench-progress.log" | tee -a "$dest/bench.txt"
done
if [ -n "${PROFILE:-}" ]; then
  timeout ${PROFILE_TIMEOUT_S:-120} python -m flashsink bench --systems flashsink --preset golden --mode fwd+bwd --profile --no-gate2 \
    2>>"$dest/bench-progress.log" | tee "$dest/profile.txt"
  timeout ${PROFILE_TIMEOUT_S:-120} python -m flashsink bench --systems flashsink --preset gptoss-full --seq 8192 --mode fwd+bwd --profile \
    --no-gate2 2>>"$dest/bench-progress.log" | tee -a "$dest/profile.txt"
fi
# the device brings back at most 8 files: the JSONs travel in one archive
tar -czf "$dest/bench-json.tgz" bench-results/*.json 2>/dev/null
python tools/bench_merge.py --plot "$dest/bench.png" bench-results/*.json > "$dest/merged.txt" 2>&1
grep -A 60 "^summary" "$dest/merged.txt"
