"""Build every kernel the GPU tests need, in parallel processes, into TileLang's disk cache.

    python tools/precompile_gpu_cases.py [arch]     (default sm_90a)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def suite_pairs(arch: str) -> list:
    """(kind, config) of every kernel the GPU test matrix builds for ``arch``."""
    from gpu_cases import case_config, decode_cases, kernel_configs, kvcache_cases, kvcache_config, merge_test_config

    from flashsink.ops.compiler.kinds import kvcache_kinds, route_kinds
    from flashsink.ops.compiler.precompile import kinds_for

    # the split-KV forward only where the tests take it (decode cases, in both precision modes: the
    # configuration, hence the kernel's cache key, carries the mode), not for every config
    split = {case_config(arch, c, precision=p) for c in decode_cases() for p in ("fast", "strict")}
    pairs = [(k, cfg) for cfg in dict.fromkeys(kernel_configs(arch)) for k in kinds_for(cfg)
             if k not in route_kinds("decode") or cfg in split]
    # attention_kvcache's kernels only for its cases (tests/test_kvcache_gpu.py)
    pairs += [(k, kvcache_config(arch, c)) for c in kvcache_cases() for k in kvcache_kinds()]
    pairs += [("merge_splits", merge_test_config(arch))]
    return pairs


if __name__ == "__main__":
    from flashsink.ops.compiler.precompile import precompile

    sys.exit(1 if precompile([], pairs=suite_pairs(sys.argv[1] if len(sys.argv) > 1 else "sm_90a")) else 0)
