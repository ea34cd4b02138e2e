"""Build every kernel the GPU tests need, in parallel processes, into TileLang's disk cache.

    python tools/precompile_gpu_cases.py [arch]     (default sm_90a)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

if __name__ == "__main__":
    from gpu_cases import kernel_configs

    from flashsink.ops.precompile import precompile

    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90a"
    sys.exit(1 if precompile(kernel_configs(arch)) else 0)
