"""Build, on a machine without a GPU, the sm_90a kernels a GPU session needs first, into
FLASHSINK_CACHE_DIR, so a fresh GPU machine loads them instead of compiling them:

    FLASHSINK_CACHE_DIR=$PWD/.fscache python tools/precompile_cpu_bundle.py [--jobs N] [recorded.jsonl]
    tar -cJf .fscache.tar.xz -C .fscache kernels   # ~20 KB a kernel; carry it with .gpu

(tools/unpack_kernel_bundle.sh also takes an archive of the folder itself, ``tar -cJf .fscache.tar.xz .fscache``.)

What it builds: every kernel of the GPU suite's matrix (tools/precompile_gpu_cases.py's list), the
kernels a previous suite run recorded (tools/precompile_recorded.py's input: the suite leaves
recorded.jsonl in its logs.tgz), and the benchmark presets' configurations in fast, strict and
deterministic mode. A kernel is found on the GPU machine only where its cache key matches there: the
same TIR and the same versions (flashsink, tilelang, tvm_ffi, nvcc's build string, platform,
keys.versions); an entry the GPU machine's runtime cannot load is rebuilt there, not used
(compile.compile_kernel). So a first GPU call should load one kernel before relying on the bundle.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools it reuses

ARCH = "sm_90a"
#: the kernel configurations the GPU suite's record-mode run asked for (torch.compile, Hugging Face, kvcache
#: tests; 73 lines at e9568f1): with them in the bundle the suite compiles nothing of its own (v19: 92 kernels,
#: 123 s of a device call). A new test's kernels are missing until the file is refreshed from a suite's logs.tgz.
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_recorded.jsonl")


def _bench() -> list:
    from flashsink.kernel_config import KernelConfig
    from flashsink.ops.compiler.kinds import precompile_kinds

    out = []
    for dtype, d, layout in (("float16", 128, "bhsd"), ("bfloat16", 128, "bhsd"), ("bfloat16", 64, "bhsd"),
                             ("bfloat16", 64, "thd")):
        for det, precision in ((False, "fast"), (False, "strict"), (True, "fast")):
            cfg = KernelConfig(ARCH, dtype, d, d, 8, True, True, layout, det, precision)
            out += [(k, cfg) for k in precompile_kinds(cfg)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recorded", nargs="?", default=None,
                    help="a suite run's recorded.jsonl (FLASHSINK_RECORD_KERNELS; default: the copy in tools/, "
                         "from the suite of docs/perf-log.md v21)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default one per CPU)")
    args = ap.parse_args()
    from precompile_gpu_cases import suite_pairs
    from precompile_recorded import recorded_pairs

    from flashsink.ops.compiler.precompile import precompile

    pairs = suite_pairs(ARCH) + recorded_pairs(args.recorded or RECORDED)
    pairs += _bench()
    pairs = list(dict.fromkeys(pairs))
    print(f"{len(pairs)} kernels for {ARCH} into {os.environ.get('FLASHSINK_CACHE_DIR', 'the default cache')}",
          flush=True)
    t0 = time.time()
    failed = precompile([], pairs=pairs, jobs=args.jobs)
    print(f"done in {time.time() - t0:.0f} s, {len(failed) if failed else 0} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
