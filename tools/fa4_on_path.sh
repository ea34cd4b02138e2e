# Sourced by the GPU scripts that time FA4 (tools/gpu_bench.sh, lab/gpu_bwd_traffic.sh): once an earlier call on this
# machine unpacked both parts of .fa4 (.fa4/setup.sh), FA4 goes on the path even when this call did not carry
# .fa4/setup.sh (2026-12-04: a call that did not lost FA4's column).
if [ -f /tmp/fa4site/.done ] && [[ ":${PYTHONPATH:-}:" != *":/tmp/fa4site:"* ]]; then
  export PYTHONPATH="/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
fi
