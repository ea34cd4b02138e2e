"""Time the attention_kvcache forward kernel on the GPU at several split counts, in one device call.

    source .gpu/setup.sh && python tools/kvcache_variants.py [--lengths 4096,16384,65536] [--page-size 256]

The problem is the bench's decode-paged preset (B=8, H=64, H_kv=8, D=64, bf16, one query per row, a
random block table with pages shared by no two rows). The kernel (``fwd_kvcache.build_fwd_kvcache``)
is timed alone with ``triton.testing.do_bench`` (median) at multiples of ``ops/kvcache.n_splits_for``'s
split count, then the whole call (``flashsink.attention_kvcache``) for reference, with the bytes each
moves. Its correctness (odd lengths, rows past their capacity, bad pages, page sizes, windows) is
tests/test_kvcache_gpu.py's, in the GPU suite; until v13 this tool also compared the per-load gather
with the shared page table, bitwise (docs/perf.md v12-v13).
"""

from __future__ import annotations

import argparse
import math
import sys

B, H, HK, D = 8, 64, 8, 64


def _problem(n, page_size, seed):
    """q, the paged caches, the block table and the lengths."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-n // page_size)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * pages, page_size, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * pages, page_size, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(B * pages, device="cuda", generator=g).to(torch.int32).view(B, pages)
    lengths = torch.full((B,), n, dtype=torch.int32, device="cuda")
    return q, k, v, table, lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--splits-x", default="1,2,4",
                    help="key splits per row as multiples of ops/kvcache.n_splits_for's (about PROGRAMS_PER_SM programs "
                         "per SM; a latency-bound gather may want more programs in flight)")
    args = ap.parse_args()
    multiples = [int(x) for x in args.splits_x.split(",")]

    import torch
    from triton.testing import do_bench

    import flashsink
    from flashsink.ops.compile import get_kernel
    from flashsink.ops.config import LOG2E, NO_WINDOW, KernelConfig, arch_of, split_tiles
    from flashsink.ops.kvcache import n_splits_for
    from flashsink._validate_kvcache import validate_kvcache

    cfg = KernelConfig(arch=arch_of(torch.device("cuda")), dtype="bfloat16", head_dim=D, head_dim_v=D, groups=H // HK,
                       causal=True, has_sinks=False, layout="bshd")
    kern = get_kernel("fwd_kvcache", cfg)  # the library's kernel, through its cache
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = LOG2E / math.sqrt(D)
    print(f"{'cache':>8} {'splits':<14} {'ms':>8} {'GB/s':>7} {'x first':>7}")
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v, table, lengths = _problem(n, args.page_size, seed=n)
        spec = validate_kvcache(q, k, v, lengths, table, None, window=None, scale=None, return_lse=False)
        base_splits = n_splits_for(spec, split_tiles(cfg), sms)
        nbytes = 2 * B * n * HK * D * 2  # K and V read once
        rows = []
        for x in multiples:
            splits = base_splits * x
            o = torch.empty((B, H, 1, splits, D), device="cuda")
            lse = torch.empty((B, H, 1, splits), device="cuda")
            ms = do_bench(lambda: kern(q, k, v, table, lengths, NO_WINDOW, scale, o, lse), warmup=25, rep=200)
            rows.append((f"kernel x{x}", ms, splits))
        for name, ms, sp in rows:
            print(f"{n:>8} {name:<14} {ms:8.4f} {nbytes / ms / 1e6:7.0f} {rows[0][1] / ms:7.2f}  ({sp} splits)")
        whole = do_bench(lambda: flashsink.attention_kvcache(q, k, v, lengths, block_table=table), warmup=25, rep=200)
        print(f"{n:>8} {'api call':<14} {whole:8.4f} {nbytes / whole / 1e6:7.0f}          (attention_kvcache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
