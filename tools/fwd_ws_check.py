"""Check the hand warp-specialized forward (fwd_ws.py) against the pipelined one on the GPU, over the
shapes that break tile arithmetic: odd lengths, seq_q != seq_kv (bottom-right causal), windows of 1,
100 and 128, no sinks, full attention, bshd, packed varlen batches with sequences of length 0 and 1.

    source .gpu/setup.sh && python tools/fwd_ws_check.py [--jobs 16]

Both kernels write into NaN-poisoned outputs; o is compared where the pipelined kernel's rows are real
(max abs difference and relative L2) and lse over the real rows. Prints one line per case and a
summary; exit code 1 if any case differs by more than rounding (relative L2 over 1e-2 or a NaN where
the pipelined kernel has none).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from bwd_variants import compile_all

#: (dtype, head dim, layout, causal, sinks): the configurations checked
CONFIGS = [
    ("bfloat16", 64, "bhsd", True, True),
    ("float16", 128, "bhsd", True, True),
    ("bfloat16", 128, "bshd", True, False),
    ("bfloat16", 64, "bhsd", False, True),
    ("float16", 64, "thd", True, True),
]
#: (seq_q, seq_kv, window or None) for the padded layouts
SHAPES = [(777, 777, None), (1, 1, None), (300, 1000, None), (1000, 300, None), (4096, 4096, 1),
          (2000, 2000, 100), (4096, 4096, 128), (129, 129, 128)]
#: packed varlen batches: the sequences' lengths (q and k alike) and the window
VARLEN = [((5, 0, 1, 300, 777, 128, 129), None), ((1000, 1, 2048), 128), ((64,) * 40, None)]
H, HK = 16, 2
TILES = {64: (128, 128, 256, 2), 128: (128, 128, 256, 2)}


def _func(job):
    from flashsink.ops.build.config import KernelConfig, Tiles, fwd_fold, fwd_ws_options
    from flashsink.ops.kernels.fwd import build_fwd_pipelined
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    dtype, d, layout, causal, sinks, ws = job
    cfg = KernelConfig("sm_90a", dtype, d, d, H // HK, causal, sinks, layout, deterministic=False, precision="strict")
    if not ws:
        return build_fwd_pipelined(cfg)
    t = Tiles(*TILES[d])
    return build_fwd_ws(cfg, t, fold=fwd_fold(cfg), **fwd_ws_options(cfg, t))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    jobs = [c + (ws,) for c in CONFIGS for ws in (False, True)]
    kernels, errors = compile_all(jobs, args.jobs, _func, str)

    import torch

    from flashsink.ops.build.config import LOG2E, NO_WINDOW, padded_rows, varlen_rows

    bad, lines = 0, []
    for cfg in CONFIGS:
        dtype, d, layout, causal, sinks = cfg
        ref, ws = kernels.get(cfg + (False,)), kernels.get(cfg + (True,))
        if ref is None or ws is None:
            lines.append(f"{cfg}: not built: {errors.get(cfg + (False,))} / {errors.get(cfg + (True,))}")
            bad += 1
            continue
        dt = getattr(torch, dtype)
        cases = VARLEN if layout == "thd" else SHAPES
        for case in cases:
            torch.manual_seed(hash(str((cfg, case))) % 2**31)
            sk = torch.randn(H, device="cuda", dtype=torch.float32) if sinks else torch.zeros(H, device="cuda")
            scale_log2 = LOG2E / math.sqrt(d)
            if layout == "thd":
                lens, window = case
                total = sum(lens)
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
                q = torch.randn(total, H, d, device="cuda", dtype=dt)
                k, v = (torch.randn(total, HK, d, device="cuda", dtype=dt) for _ in range(2))
                lse_shape, rows = (H, varlen_rows(total)), total
                extra = (cu, cu, max(lens))
                real = (slice(None), slice(0, total))
            else:
                nq, nk, window = case
                shape = (lambda n, h: (1, h, n, d)) if layout == "bhsd" else (lambda n, h: (1, n, h, d))
                q = torch.randn(*shape(nq, H), device="cuda", dtype=dt)
                k, v = (torch.randn(*shape(nk, HK), device="cuda", dtype=dt) for _ in range(2))
                lse_shape = (1, H, padded_rows(nq))
                extra = ()
                real = (slice(None), slice(None), slice(0, nq))
            win = NO_WINDOW if window is None else window
            outs = []
            for kern in (ref, ws):
                o = torch.full_like(q, float("nan"))
                lse = torch.full(lse_shape, float("nan"), dtype=torch.float32, device="cuda")
                kern(q, k, v, sk, *extra, win, scale_log2, o, lse)
                outs.append((o, lse[real]))
            torch.cuda.synchronize()
            (o0, l0), (o1, l1) = outs
            nan_new = bool((o1.isnan() & ~o0.isnan()).any() or (l1.isnan() & ~l0.isnan()).any())
            fin = ~o0.isnan()
            rel = float((o1[fin].double() - o0[fin].double()).norm() / o0[fin].double().norm().clamp_min(1e-30))
            mx = float((o1[fin].double() - o0[fin].double()).abs().max()) if fin.any() else 0.0
            lf = torch.isfinite(l0)
            lmx = float((l1[lf] - l0[lf]).abs().max()) if lf.any() else 0.0
            same_inf = bool(((l0 == l1) | lf).all())
            ok = not nan_new and rel < 1e-2 and lmx < 1e-2 and same_inf
            bad += not ok
            lines.append(f"{'ok  ' if ok else 'DIFF'} {dtype:<8} D{d:<3} {layout} causal={causal!s:<5} sinks={sinks!s:<5} "
                         f"{str(case)[:48]:<48} o relL2 {rel:.2e} max {mx:.2e}  lse max {lmx:.2e}"
                         + ("  NEW NaN" if nan_new else "") + ("" if same_inf else "  lse inf differs"))
            print(lines[-1], flush=True)
    print(f"\nsummary: {len(lines) - bad} ok, {bad} differ or did not build")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
