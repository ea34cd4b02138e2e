"""Time the attention_kvcache forward kernel on the GPU at several split counts, in one device call.

    source .gpu/setup.sh && python lab/kvcache_variants.py [--lengths 4096,16384,65536] [--page-size 256]

The problem is the bench's decode-paged preset (B=8, H=64, H_kv=8, D=64, bf16, one query per row, a
random block table with pages shared by no two rows). The kernel (``fwd_kvcache.build_fwd_kvcache``)
is timed alone with ``triton.testing.do_bench`` (median) at multiples of ``ops/launch/decode.n_splits_for``'s
split count, then the whole call (``flashsink.attention_kvcache``) for reference, with the bytes each
moves. Its correctness (odd lengths, rows past their capacity, bad pages, page sizes, windows) is
tests/test_kvcache_gpu.py's, in the GPU suite.

``--split-layouts``: also the split decode's kernel (``fwd_split.py``, ``attention``'s decode path) alone over
contiguous caches in both padded layouts, ``[B, H_kv, S, D]`` (bhsd: a key tile is 16 KB contiguous) and
``[B, S, H_kv, D]`` (bshd: 128-byte rows 1 KB apart, as in a page), at ``decode.n_splits_for``'s split
count (compiled through TileLang's disk cache: compile it on the CPU host first, as lab/fwd_variants.py
says).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bwd_variants' loader

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
                    help="key splits per row as multiples of ops/launch/decode.n_splits_for's (about PROGRAMS_PER_SM programs "
                         "per SM; a latency-bound gather may want more programs in flight)")
    ap.add_argument("--splits", default=None,
                    help="key splits per row as counts (e.g. 5,9,17), instead of --splits-x's multiples: the split "
                         "decode runs 5 at B=8 (two waves), the gather 17 at 16k-64k keys")
    ap.add_argument("--split-layouts", action="store_true",
                    help="also time the split decode's kernel over contiguous bhsd and bshd caches")
    args = ap.parse_args()
    multiples = [int(x) for x in args.splits_x.split(",")]
    counts = None if args.splits is None else [int(x) for x in args.splits.split(",")]
    if counts is not None and min(counts) < 1:
        ap.error(f"--splits must be positive counts, got {args.splits}")

    import torch
    from triton.testing import do_bench

    import flashsink
    from flashsink.ops.compiler.registry import get_kernel
    from flashsink.kernel_config import LOG2E, NO_WINDOW, KernelConfig, arch_of, split_tiles
    from flashsink.ops.launch.kvcache import n_splits_for
    from flashsink._validate_kvcache import validate_kvcache

    cfg = KernelConfig(arch=arch_of(torch.device("cuda")), dtype="bfloat16", head_dim=D, head_dim_v=D, groups=H // HK,
                       causal=True, has_sinks=True, layout="bshd", deterministic=False, precision="strict")  # (the forward ignores sinks: the bundle's kernel)
    kern = get_kernel("fwd_kvcache", cfg)  # the library's kernel, through its cache
    kernels = {"kernel": kern}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = LOG2E / math.sqrt(D)
    print(f"{'cache':>8} {'splits':<14} {'ms':>8} {'GB/s':>7} {'x first':>7}")
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v, table, lengths = _problem(n, args.page_size, seed=n)
        spec = validate_kvcache(q, k, v, lengths, table, None, window=None, scale=None, return_lse=False,
                                layout="bshd")
        base_splits = n_splits_for(spec, split_tiles(cfg), sms)
        nbytes = 2 * B * n * HK * D * 2  # K and V read once
        rows = []
        for x, splits in ([(x, base_splits * x) for x in multiples] if counts is None else [(None, c) for c in counts]):
            o = torch.empty((B, H, 1, splits, D), device="cuda")
            lse = torch.empty((B, H, 1, splits), device="cuda")
            for name, kn in kernels.items():
                ms = do_bench(lambda: kn(q, k, v, table, lengths, NO_WINDOW, scale, o, lse), warmup=25, rep=200)
                rows.append((f"{name} x{x}" if x else f"{name} s{splits}", ms, splits))
        if args.split_layouts:
            rows += _split_rows(cfg, q, n, sms, scale)
        for name, ms, sp in rows:
            print(f"{n:>8} {name:<14} {ms:8.4f} {nbytes / ms / 1e6:7.0f} {rows[0][1] / ms:7.2f}  ({sp} splits)")
        sinks = torch.zeros(H, device="cuda")  # (with sinks: the kernel bundle's configuration)
        whole = do_bench(lambda: flashsink.attention_kvcache(q, k, v, lengths, block_table=table, sinks=sinks,
                                                             layout="bshd"),
                         warmup=25, rep=200)
        print(f"{n:>8} {'api call':<14} {whole:8.4f} {nbytes / whole / 1e6:7.0f}          (attention_kvcache)")
    return 0


def _split_kernel(cfg, layout):
    """fwd_split.build_fwd_split for ``layout``, through TileLang's disk cache (bwd_variants' loader)."""
    import dataclasses

    from bwd_variants import _load

    from flashsink.ops.kernels.fwd_split import build_fwd_split

    return _load(dataclasses.replace(cfg, layout=layout), build_fwd_split)


def _split_rows(cfg, q, n, sms, scale):
    """(label, ms, splits) of the split decode's kernel against ``n`` fresh random keys a row in contiguous
    bhsd and bshd caches (q the same)."""
    import torch
    from triton.testing import do_bench

    from flashsink._validate import validate_attention
    from flashsink.kernel_config import NO_WINDOW
    from flashsink.ops.launch.decode import n_splits_for

    k = torch.randn(B, n, HK, D, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    rows = []
    for layout in ("bhsd", "bshd"):
        q_l, k_l, v_l = (q, k, v) if layout == "bshd" else (x.transpose(1, 2).contiguous() for x in (q, k, v))
        spec = validate_attention(q_l, k_l, v_l, None, window=None, causal=True, scale=None, layout=layout)
        splits = n_splits_for(spec, cfg, sms)
        o = torch.empty((B, H, 1, splits, D), device="cuda")
        lse = torch.empty((B, H, 1, splits), device="cuda")
        kern = _split_kernel(cfg, layout)
        ms = do_bench(lambda: kern(q_l, k_l, v_l, NO_WINDOW, scale, o, lse), warmup=25, rep=200)
        rows.append((f"split {layout}", ms, splits))
    return rows


if __name__ == "__main__":
    sys.exit(main())
