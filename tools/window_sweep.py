"""The windowed forward's time against its window, to split its cost into a part per query tile and a
part per KV tile (a least-squares line through the points), in one device call:

    source .gpu/setup.sh && python tools/window_sweep.py [--shape 1,64,8,4096,64] [--windows 16,32,64,96,128]

Each window's KV tiles per query tile come from the kernel's own block ranges (``block_range``) for the
tiles ``config`` chooses, so the fit's x axis is what the kernel visits, not an estimate. Times are
``triton.testing.do_bench`` medians of the eager forward (bf16, sinks, bshd)."""

from __future__ import annotations

import argparse
import math


def kv_tiles_per_row_tile(n: int, window: int, rows: int, bn: int) -> float:
    """Mean KV tiles a row tile of ``rows`` positions visits under a causal window: the kernel's own
    ``block_range.kv_blocks_for_rows`` (plain arithmetic on Python ints)."""
    from flashsink.ops.tir.block_range import kv_blocks_for_rows

    spans = [int(hi) - int(lo) for lo, hi in (kv_blocks_for_rows(r0, rows, bn, n, n, window, True)
                                             for r0 in range(0, n, rows))]
    return sum(spans) / len(spans)


def main() -> int:
    import torch
    import triton.testing

    import flashsink
    from flashsink.ops.build.config import WINDOW_TILES_MAX, KernelConfig, fwd_window_tiles, fwd_windowed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,64,8,4096,64", help="B,H,H_kv,N,D")
    ap.add_argument("--windows", default="16,32,48,64,80,96,112,128")
    args = ap.parse_args()
    b, h, hkv, n, d = (int(x) for x in args.shape.split(","))
    cfg = KernelConfig(arch="sm_90a", dtype="bfloat16", head_dim=d, head_dim_v=d, groups=h // hkv, causal=True,
                       has_sinks=True, layout="bshd", deterministic=False, precision="fast")
    if not fwd_windowed(cfg):
        ap.error(f"{args.shape}: no windowed kind here (config.fwd_windowed: Hopper head dims 64/128 whose GQA group "
                 f"packs), so the windows would not share one kernel's tiles")
    windows = [int(x) for x in args.windows.split(",") if x]
    if len(set(windows)) < 2 or not all(1 <= w <= WINDOW_TILES_MAX for w in windows):
        ap.error(f"--windows: at least two different windows of 1..{WINDOW_TILES_MAX} keys (the windowed kind's), "
                 f"got {args.windows!r}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t = fwd_window_tiles(cfg)
    rows = t.block_m // (h // hkv)  # packed: positions per tile
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, hh, d, device="cuda", dtype=torch.bfloat16) for hh in (h, hkv, hkv))
    sinks = torch.randn(h, device="cuda", dtype=torch.float32)
    xs, ys = [], []
    print(f"tiles {t}; {rows} positions per row tile; {math.ceil(n / rows) * hkv * b} row tiles")
    print(f"{'window':>6} {'kv tiles/row tile':>18} {'ms':>8}")
    for w in windows:
        fn = lambda: flashsink.attention(q, k, v, sinks, window=w, layout="bshd")  # noqa: E731
        fn()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        x = kv_tiles_per_row_tile(n, w, rows, t.block_n)
        xs.append(x)
        ys.append(ms)
        print(f"{w:>6} {x:>18.3f} {ms:>8.4f}")
    k_ = len(xs)
    mx, my = sum(xs) / k_, sum(ys) / k_
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icpt = my - slope * mx
    tiles = math.ceil(n / rows) * hkv * b
    print(f"fit: ms = {icpt:.4f} + {slope:.4f} * kv_tiles  (per row tile on each of {sms} SMs: "
          f"{icpt / (tiles / sms) * 1e3:.2f} us fixed, {slope / (tiles / sms) * 1e3:.2f} us per KV tile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
