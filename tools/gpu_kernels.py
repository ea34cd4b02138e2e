"""The kernels the GPU runs need, as JSONL for `flashsink precompile --kernels FILE` (one JSON object a
line: "kind" and the KernelConfig fields):

    python tools/gpu_kernels.py [--arch sm_90a] [--bench] > kernels.jsonl

Every kernel of the GPU test matrix (tests/gpu_cases.py), and with --bench the benchmark presets'
configurations in fast, strict and deterministic mode. The kernel bundle a machine without a GPU builds
for a fresh GPU machine (carried as .fscache.tar.xz, unpacked by tools/unpack_kernel_bundle.sh):

    FLASHSINK_CACHE_DIR=$PWD/.fscache flashsink precompile --kernels <(python tools/gpu_kernels.py --bench) \
        --recorded tools/suite_recorded.jsonl --bundle .fscache.tar.xz

A kernel is found on the GPU machine only where its cache key matches there: the same TIR and the same
versions (flashsink, tilelang, tvm_ffi, nvcc's build string, platform); an entry the GPU machine's
runtime cannot load is rebuilt there, not used. So a first GPU call should load one kernel before
relying on the bundle.

A script, not an option of `flashsink precompile`: the matrix is the tests' case lists, which the library
does not import.
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def suite_pairs(arch: str) -> list:
    """(kind, config) of every kernel the GPU test matrix builds for ``arch``."""
    from gpu_cases import case_config, decode_cases, kernel_configs, kvcache_cases, kvcache_config, merge_test_config

    from flashsink.ops.compiler.kinds import kinds_for, kvcache_kinds, route_kinds

    # the split-KV forward only where the tests take it (decode cases, in both precision modes: the
    # configuration, hence the kernel's cache key, carries the mode), not for every config
    split = {case_config(arch, c, precision=p) for c in decode_cases() for p in ("fast", "strict")}
    pairs = [(k, cfg) for cfg in dict.fromkeys(kernel_configs(arch)) for k in kinds_for(cfg)
             if k not in route_kinds("decode") or cfg in split]
    # attention_kvcache's kernels only for its cases (tests/test_kvcache_gpu.py)
    pairs += [(k, kvcache_config(arch, c)) for c in kvcache_cases() for k in kvcache_kinds()]
    pairs += [("merge_splits", merge_test_config(arch))]
    return pairs


def bench_pairs(arch: str) -> list:
    """(kind, config) of the benchmark presets' configurations in fast, strict and deterministic mode."""
    from flashsink.kernel_config import KernelConfig
    from flashsink.ops.compiler.kinds import precompile_kinds

    out = []
    for dtype, d, layout in (("float16", 128, "bhsd"), ("bfloat16", 128, "bhsd"), ("bfloat16", 64, "bhsd"),
                             ("bfloat16", 64, "thd")):
        for det, precision in ((False, "fast"), (False, "strict"), (True, "fast")):
            cfg = KernelConfig(arch, dtype, d, d, 8, True, True, layout, det, precision)
            out += [(k, cfg) for k in precompile_kinds(cfg)]
    return out


def main() -> int:
    from flashsink.kernel_config import SUPPORTED_ARCHS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=SUPPORTED_ARCHS, default="sm_90a", help="default sm_90a")
    ap.add_argument("--bench", action="store_true", help="also the benchmark presets' kernels")
    args = ap.parse_args()
    pairs = suite_pairs(args.arch) + (bench_pairs(args.arch) if args.bench else [])
    for kind, cfg in dict.fromkeys(pairs):
        print(json.dumps({"kind": kind, **dataclasses.asdict(cfg)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
