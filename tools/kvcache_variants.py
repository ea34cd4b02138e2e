"""Time the attention_kvcache forward kernel's variants on the GPU and check they agree, in one device call.

    source .gpu/setup.sh && python tools/kvcache_variants.py [--lengths 4096,16384,65536] [--page-size 256]

Variants of ``fwd_kvcache.build_fwd_kvcache``: the default (each 16-byte load derives its row's page
from the block table inside its address) and ``table=True`` (each key tile's rows resolved to (page,
row in page) once, V loaded with K before the products). The problem is the bench's decode-paged
preset (B=8, H=64, H_kv=8, D=64, bf16, one query per row, a random block table with pages shared by
no two rows) and, for the check, a second batch with a row past its capacity (NaN row), a bad page
index in a used entry (NaN for the rows that see it) and rows of different lengths. The partials
(fp32 o and lse per split) of every variant must equal the default's bitwise (NaN where it has NaN);
each kernel is then timed alone with ``triton.testing.do_bench`` (median), and the whole call
(``flashsink.attention_kvcache``, the default kernel) for reference, with the bytes it moves.
"""

from __future__ import annotations

import argparse
import math
import sys

VARIANTS = {"default*": {}, "table": {"table": True}}
B, H, HK, D = 8, 64, 8, 64


def _compile(cfg, opts):
    from bwd_variants import _load  # tools/: the variant tools' one compile call (sm_90a)

    from flashsink.ops.fwd_kvcache import build_fwd_kvcache

    return _load(opts, lambda o: build_fwd_kvcache(cfg, **o))


def _problem(n, page_size, seed, odd=False):
    """q, the paged caches, the block table and the lengths; ``odd``: rows of different lengths, one
    past its capacity, one bad page index in a used entry."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-n // page_size)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * pages, page_size, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * pages, page_size, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(B * pages, device="cuda", generator=g).to(torch.int32).view(B, pages)
    lengths = torch.full((B,), n, dtype=torch.int32, device="cuda")
    if odd:
        lengths = torch.randint(1, n + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
        lengths[1] = pages * page_size + 1  # past the capacity: a NaN row
        table[2, 0] = B * pages + 5  # outside the cache: NaN for the rows that see its keys
    return q, k, v, table, lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--splits-x", default="1,2,4",
                    help="key splits per row as multiples of ops/kvcache.n_splits_for's (about two waves of "
                         "programs; a latency-bound gather may want more programs in flight)")
    args = ap.parse_args()
    multiples = [int(x) for x in args.splits_x.split(",")]

    import torch
    from triton.testing import do_bench

    import flashsink
    from flashsink.ops.config import LOG2E, NO_WINDOW, KernelConfig, arch_of, split_tiles
    from flashsink.ops.kvcache import n_splits_for
    from flashsink._validate_kvcache import validate_kvcache

    cfg = KernelConfig(arch=arch_of(torch.device("cuda")), dtype="bfloat16", head_dim=D, head_dim_v=D, groups=H // HK,
                       causal=True, has_sinks=False, layout="bshd")
    kernels = {name: _compile(cfg, opts) for name, opts in VARIANTS.items()}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = LOG2E / math.sqrt(D)
    failed = False
    print(f"{'cache':>8} {'variant':<14} {'ms':>8} {'GB/s':>7} {'x dflt':>7}  check")
    for n in [int(x) for x in args.lengths.split(",")]:
        for odd in (True, False):
            q, k, v, table, lengths = _problem(n, args.page_size, seed=n + odd, odd=odd)
            spec = validate_kvcache(q, k, v, lengths, table, None, window=None, scale=None, return_lse=False)
            base_splits = n_splits_for(spec, split_tiles(cfg), sms)
            splits = base_splits

            def run(kern, out=None):
                """The kernel's partials, into ``out`` (timing) or fresh NaN-poisoned buffers."""
                o, lse = out or (torch.full((B, H, 1, splits, D), float("nan"), device="cuda"),
                                 torch.full((B, H, 1, splits), float("nan"), device="cuda"))
                kern(q, k, v, table, lengths, NO_WINDOW, scale, o, lse)
                return o, lse

            want = run(kernels["default*"])
            rows = []
            for name, kern in kernels.items():
                splits = base_splits
                got = run(kern)
                same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
                           for a, b in zip(got, want))
                failed |= not same
                if odd:
                    print(f"{n:>8} {name:<10} {'-':>8} {'-':>7} {'-':>7}  {'bitwise equal' if same else 'DIFFERS'} "
                          f"(odd lengths, a NaN row, a bad page)")
                    continue
                for x in multiples:  # the partials of other split counts differ (other sums): timed only
                    splits = base_splits * x
                    out = run(kern)
                    ms = do_bench(lambda: run(kern, out), warmup=25, rep=200)
                    rows.append((f"{name} x{x}" if x != 1 else name, ms, splits))
            if odd:
                continue
            nbytes = 2 * B * n * HK * D * 2  # K and V read once
            base = rows[0][1]
            for name, ms, sp in rows:
                print(f"{n:>8} {name:<14} {ms:8.4f} {nbytes / ms / 1e6:7.0f} {base / ms:7.2f}  ({sp} splits)")
            whole = do_bench(lambda: flashsink.attention_kvcache(q, k, v, lengths, block_table=table), warmup=25, rep=200)
            print(f"{n:>8} {'api call':<10} {whole:8.4f} {nbytes / whole / 1e6:7.0f}        (attention_kvcache, default)")
    print("FAIL: a variant's partials differ" if failed else "all variants agree")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
