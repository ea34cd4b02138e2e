"""Time the attention_kvcache forward kernel on the GPU at several split counts, in one device call.

    source .gpu/setup.sh && python tools/kvcache_variants.py [--lengths 4096,16384,65536] [--page-size 256]

The problem is the bench's decode-paged preset (B=8, H=64, H_kv=8, D=64, bf16, one query per row, a
random block table with pages shared by no two rows). The kernel (``fwd_kvcache.build_fwd_kvcache``)
is timed alone with ``triton.testing.do_bench`` (median) at multiples of ``ops/kvcache.n_splits_for``'s
split count, then the whole call (``flashsink.attention_kvcache``) for reference, with the bytes each
moves. Its correctness (odd lengths, rows past their capacity, bad pages, page sizes, windows) is
tests/test_kvcache_gpu.py's, in the GPU suite; until v13 this tool also compared the per-load gather
with the shared page table, bitwise (docs/perf-log.md v12-v13).

``--aligned``: also the kernel built with ``aligned=True`` (a key tile's K and V as one TMA box of one page,
pipelined; page sizes that are multiples of the key tile), compiled through TileLang's disk cache (compile
it on the CPU host first, as tools/fwd_variants.py says), checked against the library's kernel first (both
kernels' partials merged by ``ops/decode.combine_splits``: lengths of every residue, several pages sizes,
two query rows a sequence, a window, cache rows past each length and unused pages filled with NaN, and a
block-table entry outside the cache, whose row both kernels must give as NaN), then timed beside it.

``--masked``: also the kernels built with ``branch=False`` (the per-element mask on every key tile, as before
docs/perf-log.md v30: ``fwd_kvcache``'s gather and, with ``--split-layouts``, the split decode's kernel), timed beside
the library's in the same run, rows "masked ..."; through TileLang's disk cache, as ``--aligned``.

``--split-layouts``: also the split decode's kernel (``fwd_split.py``, ``attention``'s decode path) alone over
contiguous caches in both padded layouts, ``[B, H_kv, S, D]`` (bhsd: a key tile is 16 KB contiguous) and
``[B, S, H_kv, D]`` (bshd: 128-byte rows 1 KB apart, as in a page), at ``decode.n_splits_for``'s split
count: whether the paged cache's layout, rather than its gather, is what holds ``attention_kvcache`` under
the split decode (docs/perf-log.md v29, Next 4). Through TileLang's disk cache, as ``--aligned``.
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
                    help="key splits per row as multiples of ops/kvcache.n_splits_for's (about PROGRAMS_PER_SM programs "
                         "per SM; a latency-bound gather may want more programs in flight)")
    ap.add_argument("--splits", default=None,
                    help="key splits per row as counts (e.g. 5,9,17), instead of --splits-x's multiples: the split "
                         "decode runs 5 at B=8 (two waves), the gather 17 at 16k-64k keys")
    ap.add_argument("--aligned", action="store_true",
                    help="also check and time build_fwd_kvcache(aligned=True) (page sizes multiples of the key tile)")
    ap.add_argument("--aligned-stages", default="0",
                    help="with --aligned: the pipeline's TMA stages, one kernel each (0: the tiles' two)")
    ap.add_argument("--split-layouts", action="store_true",
                    help="also time the split decode's kernel over contiguous bhsd and bshd caches")
    ap.add_argument("--masked", action="store_true",
                    help="also time the kernels built with branch=False (the mask on every key tile, before v30)")
    args = ap.parse_args()
    multiples = [int(x) for x in args.splits_x.split(",")]
    counts = None if args.splits is None else [int(x) for x in args.splits.split(",")]
    if counts is not None and min(counts) < 1:
        ap.error(f"--splits must be positive counts, got {args.splits}")

    import torch
    from triton.testing import do_bench

    import flashsink
    from flashsink.ops.compile import get_kernel
    from flashsink.ops.config import LOG2E, NO_WINDOW, KernelConfig, arch_of, split_tiles
    from flashsink.ops.kvcache import n_splits_for
    from flashsink._validate_kvcache import validate_kvcache

    cfg = KernelConfig(arch=arch_of(torch.device("cuda")), dtype="bfloat16", head_dim=D, head_dim_v=D, groups=H // HK,
                       causal=True, has_sinks=True, layout="bshd")  # (the forward ignores sinks: the bundle's kernel)
    kern = get_kernel("fwd_kvcache", cfg)  # the library's kernel, through its cache
    kernels = {"kernel": kern}
    if args.masked:
        kernels["masked"] = _masked_kernel(cfg)
    if args.aligned:
        if args.page_size % split_tiles(cfg).block_n:
            ap.error(f"--aligned needs a page size that is a multiple of {split_tiles(cfg).block_n}, "
                     f"got {args.page_size}")
        for st in (int(x) for x in args.aligned_stages.split(",")):
            name = "aligned" + (f" s{st}" if st else "")
            aligned = _aligned_kernel(cfg, st)
            if _check_aligned(kern, aligned, cfg, name):
                kernels[name] = aligned
            else:
                print(f"{name}: FAILED its check against the library's kernel; not timed")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = LOG2E / math.sqrt(D)
    print(f"{'cache':>8} {'splits':<14} {'ms':>8} {'GB/s':>7} {'x first':>7}")
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v, table, lengths = _problem(n, args.page_size, seed=n)
        spec = validate_kvcache(q, k, v, lengths, table, None, window=None, scale=None, return_lse=False)
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
            rows += _split_rows(cfg, q, n, sms, scale, args.masked)
        for name, ms, sp in rows:
            print(f"{n:>8} {name:<14} {ms:8.4f} {nbytes / ms / 1e6:7.0f} {rows[0][1] / ms:7.2f}  ({sp} splits)")
        sinks = torch.zeros(H, device="cuda")  # (with sinks: the kernel bundle's configuration)
        whole = do_bench(lambda: flashsink.attention_kvcache(q, k, v, lengths, block_table=table, sinks=sinks),
                         warmup=25, rep=200)
        print(f"{n:>8} {'api call':<14} {whole:8.4f} {nbytes / whole / 1e6:7.0f}          (attention_kvcache)")
    return 0


def _split_kernel(cfg, layout, branch=True):
    """fwd_split.build_fwd_split for ``layout``, through TileLang's disk cache (bwd_variants' loader)."""
    import dataclasses

    from bwd_variants import _load

    from flashsink.ops.fwd_split import build_fwd_split

    return _load(dataclasses.replace(cfg, layout=layout), lambda c: build_fwd_split(c, branch=branch))


def _masked_kernel(cfg):
    """build_fwd_kvcache(branch=False): the gather with the mask on every key tile, through TileLang's disk cache."""
    from bwd_variants import _load

    from flashsink.ops.fwd_kvcache import build_fwd_kvcache

    return _load(cfg, lambda c: build_fwd_kvcache(c, branch=False))


def _split_rows(cfg, q, n, sms, scale, masked=False):
    """(label, ms, splits) of the split decode's kernel against ``n`` fresh random keys a row in contiguous
    bhsd and bshd caches (q the same); ``masked``: also the kernel built with ``branch=False``."""
    import torch
    from triton.testing import do_bench

    from flashsink._validate import validate_attention
    from flashsink.ops.config import NO_WINDOW
    from flashsink.ops.decode import n_splits_for

    k = torch.randn(B, n, HK, D, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    rows = []
    for layout in ("bhsd", "bshd"):
        q_l, k_l, v_l = (q, k, v) if layout == "bshd" else (x.transpose(1, 2).contiguous() for x in (q, k, v))
        spec = validate_attention(q_l, k_l, v_l, None, window=None, causal=True, scale=None, layout=layout)
        splits = n_splits_for(spec, cfg, sms)
        o = torch.empty((B, H, 1, splits, D), device="cuda")
        lse = torch.empty((B, H, 1, splits), device="cuda")
        for label, branch in (("", True), ("masked ", False))[: 2 if masked else 1]:
            kern = _split_kernel(cfg, layout, branch)
            ms = do_bench(lambda: kern(q_l, k_l, v_l, NO_WINDOW, scale, o, lse), warmup=25, rep=200)
            rows.append((f"{label}split {layout}", ms, splits))
    return rows


def _aligned_kernel(cfg, stages=0):
    """build_fwd_kvcache(aligned=True, stages=stages), through TileLang's disk cache (bwd_variants' loader)."""
    from bwd_variants import _load

    from flashsink.ops.fwd_kvcache import build_fwd_kvcache

    return _load(cfg, lambda c: build_fwd_kvcache(c, prefetch=False, aligned=True, stages=stages))


def _check_aligned(ref, kern, cfg, name="aligned") -> bool:
    """The aligned kernel's merged o and lse against the library kernel's, case by case (printed); True if all
    agree: the same NaN rows, elsewhere within 1e-2 absolute on o and 1e-4 on lse (the products sum the last
    tile's keys in other columns)."""
    import torch

    from flashsink.ops.config import LOG2E, NO_WINDOW
    from flashsink.ops.decode import combine_splits

    ok_all = True
    g = torch.Generator(device="cuda").manual_seed(1)
    sinks = torch.zeros(H, device="cuda")
    for page_size, seq_q, window, bad in ((128, 1, None, False), (256, 1, None, False), (512, 5, None, False),
                                          (256, 1, 128, False), (128, 5, 200, False), (256, 1, None, True)):
        cap = 2048
        pages = cap // page_size
        lengths = torch.tensor([1, 5, 127, 128, 129, 1000, 1024, cap][:B], dtype=torch.int32, device="cuda")
        lengths = torch.maximum(lengths, torch.tensor(seq_q, device="cuda", dtype=torch.int32))
        q = torch.randn(B, seq_q, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        n_pages = B * pages + 3  # three pages no row uses
        k = torch.full((n_pages, page_size, HK, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        v = torch.full_like(k, float("nan"))
        table = torch.randperm(n_pages, device="cuda", generator=g)[: B * pages].to(torch.int32).view(B, pages)
        for b in range(B):  # keys below each row's length finite; past it (and unused pages) NaN
            n = int(lengths[b])
            for j in range(-(-n // page_size)):
                rows = min(page_size, n - j * page_size)
                k[table[b, j], :rows] = torch.randn(rows, HK, D, device="cuda", generator=g).to(k.dtype)
                v[table[b, j], :rows] = torch.randn(rows, HK, D, device="cuda", generator=g).to(v.dtype)
        if bad:
            table[6, 2] = n_pages  # row 6 (1024 keys) sees a page outside the cache
        splits = 3
        outs = []
        for kn in (ref, kern):
            o = torch.full((B, H, seq_q, splits, D), float("nan"), device="cuda")
            lse = torch.full((B, H, seq_q, splits), float("nan"), device="cuda")
            kn(q, k, v, table, lengths, NO_WINDOW if window is None else window, LOG2E / math.sqrt(D), o, lse)
            outs.append(combine_splits(o, lse, sinks, False))
        (o_r, l_r), (o_a, l_a) = outs
        same_nan = torch.equal(o_r.isnan(), o_a.isnan()) and torch.equal(l_r.isnan(), l_a.isnan())
        finite = ~l_r.isnan()
        err_o = float((o_r - o_a)[finite.unsqueeze(-1).expand_as(o_r)].abs().max()) if finite.any() else 0.0
        err_l = float((l_r - l_a)[finite].abs().max()) if finite.any() else 0.0
        nan_rows = int(l_r.isnan().flatten(1).any(1).sum())
        ok = same_nan and err_o <= 1e-2 and err_l <= 1e-4 and (nan_rows == (1 if bad else 0))
        ok_all &= ok
        print(f"{name} check: page {page_size:>3} seq_q {seq_q} window {window} bad page {bad}: "
              f"o max err {err_o:.2e}, "
              f"lse {err_l:.2e}, NaN rows {nan_rows}, NaN pattern {'equal' if same_nan else 'DIFFERENT'}: "
              f"{'ok' if ok else 'FAIL'}")
    return ok_all


if __name__ == "__main__":
    sys.exit(main())
