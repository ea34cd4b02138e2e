"""Time alternatives of the main backward kernel on the GPU, in one device call.

    source .gpu/setup.sh && python tools/bwd_variants.py [--problems causal-d128,gptoss-full] [--jobs 16]

For each problem (H=64, H_kv=8, bhsd, B=1) and each variant (tiles, dQ reduction) of the fast
main backward: compile every kernel in parallel processes first (TileLang's own disk cache, then
loaded here), then check the fast gradients against the strict path (relative L2; the strict path
meets the precision standard) and time every kernel with ``triton.testing.do_bench`` (median).
Prints one table per problem: kernel times, the whole fast and strict backward, fwd+bwd TFLOP/s.
The defaults the library uses are marked ``*``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import sys
import time

PROBLEMS = {
    # name: (dtype, N, D, window)
    "causal-d128": ("bfloat16", 4096, 128, None),
    "gptoss-full": ("bfloat16", 8192, 64, None),
    "golden": ("float16", 4096, 128, 128),
    "gptoss-swa": ("bfloat16", 4096, 64, 128),
}
H, HK = 64, 8


def _variants(d: int) -> list:
    """(label, Tiles fields, (dq_bulk, overlap, split)) of the fast main backward for head dim ``d``."""
    t = (64, 128, 256, 2)
    out = [("64x128/s2", t, (False, False, 1)),
           ("64x128/s2/bulk", t, (True, False, 1)),
           ("64x128/s2/overlap", t, (False, True, 1)),
           ("64x128/s2/split2", t, (False, False, 2)),
           ("64x128/s2/split4", t, (False, False, 4)),
           ("64x128/s2/split8", t, (False, False, 8)),
           ("64x128/s2/split4/bulk+overlap", t, (True, True, 4)),
           ("64x128/s2/split8/bulk+overlap", t, (True, True, 8)),
           ("64x128/s1/split4", (64, 128, 256, 1), (False, False, 4)),
           ("32x128/s2/split4", (32, 128, 256, 2), (False, False, 4))]
    if d <= 64:
        out += [("128x128/s2/split4", (128, 128, 256, 2), (False, False, 4)),
                ("128x128/s2/split8/bulk+overlap", (128, 128, 256, 2), (True, True, 8))]
    return out


def _cfg(dtype: str, d: int, precision: str):
    from flashsink.ops.config import KernelConfig

    return KernelConfig(arch="sm_90a", dtype=dtype, head_dim=d, head_dim_v=d, groups=H // HK, causal=True,
                        has_sinks=True, layout="bhsd", precision=precision)


def _func(job):
    from flashsink.ops import bwd
    from flashsink.ops.compile import build_prim_func
    from flashsink.ops.config import Tiles

    kind, dtype, d, precision, tiles, opts = job
    cfg = _cfg(dtype, d, precision)
    if kind == "bwd-variant":
        return bwd.build_bwd(cfg, tiles=Tiles(*tiles), dq_bulk=opts[0], overlap=opts[1], split=opts[2])
    return build_prim_func(kind, cfg)


def _compile(job, build=_func):
    """``(job, kernel or None, error or None, seconds)``: compiled here; in a pool worker the kernel
    is left in TileLang's disk cache (None returned), the main process loads it with a second call.
    ``build(job)`` gives the PrimFunc (tools/fwd_variants.py passes its own)."""
    import tilelang

    from flashsink.ops.compile import pass_configs

    t0 = time.perf_counter()
    try:
        k = tilelang.compile(build(job), target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                             pass_configs=pass_configs())
    except Exception as exc:  # reported in the table
        return job, None, f"{type(exc).__name__}: {str(exc)[-300:]}", time.perf_counter() - t0
    return job, k if mp.current_process().name == "MainProcess" else None, None, time.perf_counter() - t0


def compile_all(jobs, processes: int, build=_func, label=str):
    """Compile ``jobs`` in ``processes`` spawned processes into TileLang's disk cache, then load them
    here: ``(kernels, errors)``, dicts by job. Progress (``label(job)`` per kernel) on stderr."""
    compile_one = functools.partial(_compile, build=build)
    t0 = time.perf_counter()
    print(f"compiling {len(jobs)} kernels with {processes} processes ...", file=sys.stderr, flush=True)
    errors = {}
    with mp.get_context("spawn").Pool(processes) as pool:
        for done, (job, _, err, secs) in enumerate(pool.imap_unordered(compile_one, jobs), 1):
            print(f"  [{done}/{len(jobs)}] {time.perf_counter() - t0:4.0f} s  {label(job)} ({secs:.0f} s) "
                  + (f"FAILED: {err}" if err else "ok"), file=sys.stderr, flush=True)
            if err:
                errors[job] = err
    print(f"compiled in {time.perf_counter() - t0:.0f} s; loading", file=sys.stderr, flush=True)
    kernels = {}
    for job in jobs:
        if job not in errors:
            _, k, err, _ = compile_one(job)  # TileLang's disk cache: a load
            if err:
                errors[job] = err
            else:
                kernels[job] = k
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return kernels, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-run", action="store_true",
                    help="for ncu: compile and launch only the library's fast kernels, once each, no timing")
    args = ap.parse_args()
    names = [n for n in args.problems.split(",") if n]

    jobs = []
    for name in names:
        dtype, _, d, _ = PROBLEMS[name]
        for kind in ("fwd", "preprocess", "bwd", "postprocess"):
            for prec in ("fast", "strict") if kind in ("preprocess", "bwd") else ("fast",):
                jobs.append((kind, dtype, d, prec, None, None))
        for _, tiles, opts in () if args.profile_run else _variants(d):
            jobs.append(("bwd-variant", dtype, d, "fast", tiles, opts))
    jobs = list(dict.fromkeys(jobs))
    kernels, errors = compile_all(jobs, args.jobs)

    import torch
    from triton.testing import do_bench

    from flashsink.ops.config import LOG2E, NO_WINDOW

    results = []
    for name in names:
        dtype_name, n, d, window = PROBLEMS[name]
        dt = getattr(torch, dtype_name)
        torch.manual_seed(0)
        q = torch.randn(1, H, n, d, device="cuda", dtype=dt)
        k = torch.randn(1, HK, n, d, device="cuda", dtype=dt)
        v = torch.randn(1, HK, n, d, device="cuda", dtype=dt)
        do = torch.randn(1, H, n, d, device="cuda", dtype=dt)
        sinks = torch.randn(H, device="cuda", dtype=torch.float32)
        scale = 1 / math.sqrt(d)
        win = NO_WINDOW if window is None else window
        rows = max(128, -(-n // 128) * 128)
        pairs = sum(min(i + 1, win) for i in range(n)) * H
        flops_fb = 14 * pairs * d

        def kern(kind, prec, tiles=None, bulk=None):
            return kernels.get((kind, dtype_name, d, prec, tiles, bulk))

        o = torch.empty_like(q)
        lse = torch.empty(1, H, rows, dtype=torch.float32, device="cuda")
        kern("fwd", "fast")(q, k, v, sinks, win, scale * LOG2E, o, lse)
        row = {"problem": name, "kernels": {}, "errors": {str(j): e for j, e in errors.items() if j[1:3] == (dtype_name, d)}}

        def backward(prec, main, split=1):
            acc = torch.zeros(1, H, rows, d, dtype=torch.float32, device="cuda")
            dlse = torch.zeros(1, H, rows, dtype=torch.float32, device="cuda")
            delta = torch.empty(1, H, rows, dtype=torch.float32, device="cuda")
            dsink = torch.zeros(H, dtype=torch.float32, device="cuda")
            part = torch.empty(1, H, 1, dtype=torch.float32, device="cuda")
            if prec == "fast":
                kern("preprocess", prec)(o, do, lse, dlse, sinks, delta, dsink, part)
            else:
                kern("preprocess", prec)(q, k, v, do, lse, dlse, sinks, win, scale, delta, dsink, part)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            post = kern("postprocess", "fast")
            if split > 1:
                dkv = torch.zeros(2, 1, HK, rows, d, dtype=torch.float32, device="cuda")
                main(q, k, v, do, lse, delta, win, scale, acc, dkv[0], dkv[1])
                post(dkv[0], dk)
                post(dkv[1], dv)
            else:
                main(q, k, v, do, lse, delta, win, scale, acc, dk, dv)
            post(acc, dq)
            return dq, dk, dv, dsink

        if args.profile_run:
            torch.cuda.synchronize()
            backward("fast", kern("bwd", "fast"))
            torch.cuda.synchronize()
            continue
        ref = backward("strict", kern("bwd", "strict"))
        fwd_ms = do_bench(lambda: kern("fwd", "fast")(q, k, v, sinks, win, scale * LOG2E, o, lse), return_mode="median")
        row["kernels"]["fwd"] = fwd_ms
        for prec in ("fast", "strict"):
            ms = do_bench(lambda: backward(prec, kern("bwd", prec)), return_mode="median")
            row["kernels"][f"bwd total ({prec})"] = ms
            row["kernels"][f"fwd+bwd TFLOP/s ({prec})"] = flops_fb / ((fwd_ms + ms) * 1e-3) / 1e12
        acc = torch.zeros(1, H, rows, d, dtype=torch.float32, device="cuda")
        delta = torch.zeros(1, H, rows, dtype=torch.float32, device="cuda")
        dsink = torch.zeros(H, dtype=torch.float32, device="cuda")
        part = torch.empty(1, H, 1, dtype=torch.float32, device="cuda")
        dlse = torch.zeros(1, H, rows, dtype=torch.float32, device="cuda")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        row["kernels"]["preprocess (fast)"] = do_bench(lambda: kern("preprocess", "fast")(o, do, lse, dlse, sinks, delta, dsink, part), return_mode="median")
        row["kernels"]["preprocess (strict)"] = do_bench(lambda: kern("preprocess", "strict")(q, k, v, do, lse, dlse, sinks, win, scale, delta, dsink, part), return_mode="median")
        row["kernels"]["postprocess"] = do_bench(lambda: kern("postprocess", "fast")(acc, dq), return_mode="median")
        row["kernels"]["zero fill"] = do_bench(lambda: acc.zero_(), return_mode="median")
        row["kernels"]["main (strict)"] = do_bench(lambda: kern("bwd", "strict")(q, k, v, do, lse, delta, win, scale, acc, dk, dv), return_mode="median")
        dkv = torch.zeros(2, 1, HK, rows, d, dtype=torch.float32, device="cuda")
        for label, tiles, opts in [("default*", None, (None, None, 1))] + _variants(d):
            main = kern("bwd", "fast") if tiles is None else kern("bwd-variant", "fast", tiles, opts)
            if main is None:
                row["kernels"][f"main fast {label}"] = "compile failed"
                continue
            split = opts[2]
            got = backward("fast", main, split)
            errs = [float((g.double() - r.double()).norm() / r.double().norm()) for g, r in zip(got, ref)]
            outs = (acc, dkv[0], dkv[1]) if split > 1 else (acc, dk, dv)
            ms = do_bench(lambda: main(q, k, v, do, lse, delta, win, scale, *outs), return_mode="median")
            total = do_bench(lambda: backward("fast", main, split), return_mode="median")
            row["kernels"][f"main fast {label}"] = ms
            row["kernels"][f"  bwd total {label}"] = total
            row["kernels"][f"  fwd+bwd TFLOP/s {label}"] = flops_fb / ((fwd_ms + total) * 1e-3) / 1e12
            row["kernels"][f"  relL2 vs strict dq/dk/dv/dsink {label}"] = " ".join(f"{e:.1e}" for e in errs)
        results.append(row)
        print(f"\n== {name}: {dtype_name} N={n} D={d} W={window} H={H}/{HK} (fwd+bwd {flops_fb / 1e12:.2f} TFLOP)")
        for key, val in row["kernels"].items():
            print(f"  {key:<48} {val:.4f}" if isinstance(val, float) else f"  {key:<48} {val}")
        for j, e in row["errors"].items():
            print(f"  compile error {j}: {e[:200]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
