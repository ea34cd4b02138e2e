#!/usr/bin/env bash
# The GPU suite, in one device call (compilation is the slow part; a fresh machine
# compiles everything again):
#   source .gpu/setup.sh && bash tools/gpu_suite.sh [pytest -k expression]
# 1. precompiles every kernel the GPU tests need, in parallel processes (TileLang's disk cache);
# 2. runs the GPU tests (pytest -m gpu), 3. `flashsink check` on the golden problem,
# 4. times the golden and gpt-oss configurations. Logs go to $OUT (or ./gpu-out).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$out/commit.txt"

python tools/precompile_gpu_cases.py sm_90a 2>&1 | tee "$out/precompile.log"
pc=$?

kexpr=${1:-}
FLASHSINK_TEST_LOG="$out/precision.log" timeout ${PYTEST_TIMEOUT:-420} python -m pytest tests/test_kernels_gpu.py -m gpu -q -rfE -p no:cacheprovider \
  ${kexpr:+-k "$kexpr"} --junitxml="$out/junit.xml" 2>&1 | tee "$out/pytest.log"
pt=$?

timeout 300 python -m flashsink check 2>&1 | tee "$out/check.log"
ck=$?

timeout 300 python tools/time_configs.py 2>&1 | tee "$out/timing.log"
tm=$?

echo
echo "==== summary ===="
echo "precompile rc=$pc  pytest rc=$pt  check rc=$ck  timing rc=$tm"
tail -n 1 "$out/pytest.log"
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -40
cat "$out/timing.log" | tail -n 12
