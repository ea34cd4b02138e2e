#!/usr/bin/env bash
# Issue 55's measurement in one device call: the main backward's variants under work timed beside the
# library's default and FlashAttention-4 (lab/bwd_variants.py, its FA4 rows), then ncu's rows of the
# issue's table (time, DRAM bytes, L2 hit rate, instructions, grid) for the library's whole fwd+bwd, FA4's,
# and each variant's main kernel, on causal bf16 H64/8 D128 N4096 and D64 N8192:
#   source .gpu/setup.sh && VARIANTS=/hm bash lab/gpu_bwd_traffic.sh
# VARIANTS: lab/bwd_variants.py's --variants (default "/hm": the head-major grids); PROBLEMS its
# --problems; NCU=0 skips the profiles; NCU_SOURCE=1 adds SASS-level source counters of the library's and
# FA4's main backward at D128 (details-*.txt here, the per-line CSVs in the archive). FA4 is used once both parts of .fa4 are unpacked on this machine
# (.fa4/setup.sh). Outputs in $OUT (or ./gpu-out): bwd_variants.txt, ncu-table.md, summary.txt, and
# traffic-logs.tgz (stderr, the JSON, ncu's CSVs).
set -uo pipefail
dest=${OUT:-gpu-out}
mkdir -p "$dest"
work=$(mktemp -d /tmp/gpu-bwd.XXXXXX)
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tlcache}
export FLASHSINK_CACHE_DIR=${FLASHSINK_CACHE_DIR:-$PWD/.fscache}
source tools/unpack_kernel_bundle.sh
export PYTHONUNBUFFERED=1
source tools/fa4_on_path.sh
stop_at=${STOP_AT:-560}
left() { local l=$((stop_at - SECONDS)); echo $(( l > 5 ? l : 5 )); }
variants=${VARIANTS:-/hm}
problems=${PROBLEMS:-causal-d128,gptoss-full}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader > "$work/gpu.txt"
timeout "$(left)" python lab/bwd_variants.py --problems "$problems" --jobs "${JOBS:-16}" --variants "$variants" \
  --json "$work/bwd_variants.json" > "$dest/bwd_variants.txt" 2> "$work/bwd_variants.err"
br=$?
nr=skipped
if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
  metrics+=,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread
  ncu --query-metrics 2>/dev/null | grep -q "sm__pipe_tensor_op_gmma_cycles_active" \
    && metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  tables=()
  nr=0
  for pair in causal-d128=1,64,8,4096,128 gptoss-full=1,64,8,8192,64; do
    name=${pair%%=*} shape=${pair#*=}
    [[ ",$problems," == *",$name,"* ]] || continue
    for sys in flashsink fa4; do
      NCU_SHAPE=$shape timeout "$(left)" ncu --csv --clock-control none --profile-from-start off --metrics "$metrics" \
        python lab/ncu_bwd_pair.py $sys > "$work/ncu-$sys-$name.csv" 2>> "$work/ncu.err" || nr=$?
      tables+=("$sys $name=$work/ncu-$sys-$name.csv")
    done
    timeout "$(left)" ncu --csv --clock-control none -k "regex:^flashsink_bwd_kernel$" --metrics "$metrics" \
      python lab/bwd_variants.py --profile-run --problems "$name" --variants "$variants" \
      > "$work/ncu-variants-$name.csv" 2>> "$work/ncu.err" || nr=$?
    tables+=("variants $name=$work/ncu-variants-$name.csv")
  done
  python lab/ncu_table.py "${tables[@]}" > "$dest/ncu-table.md" 2>&1
  # NCU_SOURCE=1: where the main kernels' instructions and stalls go, SASS line by line (the library's
  # default and FA4's at causal D128), for the instruction target: one CSV each, the hottest lines first
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    for sys in flashsink fa4; do
      NCU_SHAPE=1,64,8,4096,128 timeout "$(left)" ncu --clock-control none --profile-from-start off \
        -k "regex:^flashsink_bwd_kernel$|FlashAttentionBackwardSm90" --section SourceCounters \
        --section WarpStateStats --section InstructionStats -o "$work/source-$sys" \
        python lab/ncu_bwd_pair.py $sys >> "$work/ncu.err" 2>&1 || nr=$?
      ncu --import "$work/source-$sys.ncu-rep" --page source --csv --print-source sass \
        > "$work/source-$sys.csv" 2>> "$work/ncu.err"
      ncu --import "$work/source-$sys.ncu-rep" --page details > "$dest/details-$sys.txt" 2>> "$work/ncu.err"
    done
  fi
  grep "launches, in order" "$work/ncu.err" >> "$dest/ncu-table.md"
fi
{
  echo "==== gpu_bwd_traffic (${FLASHSINK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; $(cat "$work/gpu.txt"); ${SECONDS}s): variants rc=$br ncu rc=$nr"
  grep -E "^==|main |bwd total|TFLOP|WRONG|FAIL|FA4|postprocess|preprocess \(fast\)" "$dest/bwd_variants.txt"
  [ -f "$dest/ncu-table.md" ] && cat "$dest/ncu-table.md"
} > "$dest/summary.txt"
cat "$dest/summary.txt"
tar -czf "$dest/traffic-logs.tgz" -C "$work" .
