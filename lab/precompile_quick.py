"""Build the kernels of lab/gpu_quick.sh's tests in parallel processes (the named cases in both precision
modes, every packed varlen case), into the disk cache.

    python lab/precompile_quick.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

if __name__ == "__main__":  # the pool's workers are spawned: they import this file, not run it
    from gpu_cases import case_config, named_cases, varlen_kernel_configs

    from flashsink.ops.compiler.kinds import kinds_for
    from flashsink.ops.compiler.precompile import precompile

    cfgs = [case_config("sm_90a", c, precision=p) for c in named_cases() for p in ("strict", "fast")]
    cfgs += varlen_kernel_configs("sm_90a", "strict") + varlen_kernel_configs("sm_90a", "fast")
    pairs = [(k, c) for c in dict.fromkeys(cfgs) for k in kinds_for(c) if k not in ("fwd_split", "merge_splits")]
    print(f"{len(pairs)} kernels", flush=True)
    sys.exit(1 if precompile([], pairs=pairs) else 0)
