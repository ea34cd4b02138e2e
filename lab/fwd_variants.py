"""Time alternatives of the forward kernel on the GPU, in one device call.

    source .gpu/setup.sh && python lab/fwd_variants.py [--problems causal-d128,golden] [--jobs 16] [--json out.json]

For each problem of lab/bwd_variants.py (H=64, H_kv=8, bhsd, B=1, sinks), or of ``VARLEN`` (the bench's
packed varlen batch, thd: ``varlen-swa``, ``varlen-full``), and each variant of the
forward (the pipelined kernel's tiles and mask, ``fwd.build_fwd_pipelined``; the hand warp-specialized
kernel ``ws`` of fwd_ws.py with its options): compile every kernel in parallel
processes first (TileLang's own disk cache, then loaded here; a kernel that fails to build is a row
of the table, not the end of the run); the hand-synchronized ``ws`` variants run once in a child
process with a time limit first (a fault or a deadlocked mbarrier is a row, not the end); then check each
variant's o and lse against the library's default forward (which meets the precision standard) and
time it with ``triton.testing.do_bench`` (median). Prints one table per problem: ms, TFLOP/s
(``4 * visible pairs * D``), speed-up over the default, max and relative L2 errors of o and lse.
Kernels depend on (dtype, head dim) only, so problems sharing them compile them once.

Compile on the CPU host first, so the device call compiles nothing (docs/perf-log.md v21: 35 kernels in 197 s
on 2 CPU cores, a 0.4 MB archive; the GPU host loaded every one from it): run the same command here with
``TILELANG_CACHE_DIR=$PWD/.tlcache`` (the probes and the timing then fail for want of CUDA, after the
compile), ``tar -cJf .tlcache.tar.xz .tlcache``, carry it, and start the device command with
``tar -xJf .tlcache.tar.xz && export TILELANG_CACHE_DIR=$PWD/.tlcache``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import sys

from bwd_variants import HK, PROBLEMS, H, _cfg, _chosen, _load, _variants_arg, compile_all

DEFAULT = "default*"
#: packed batches (thd): the bench's varlen preset (gpt-oss shapes, ``flashsink.bench.problems``' lengths);
#: name: (dtype, sequences, tokens, D, window)
VARLEN = {"varlen-swa": ("bfloat16", 64, 32768, 64, 128), "varlen-full": ("bfloat16", 64, 32768, 64, None)}


def _variants(d: int) -> list:
    """(label, Tiles fields or None for the tile table's, mask, False (the job key's fold slot), ws) for
    head dim ``d``. ``ws`` False: the pipelined kernel (``fwd.build_fwd_pipelined``) with ``mask``; else fwd_ws.py's kernel,
    True unfolded with its defaults, or a string of its options ("fold", "o32", "regs"/"wg"/"tma", "q2",
    "pack", joined by "/")."""
    tiles = [(128, 64, 256, 2), (64, 128, 128, 2), (192, 128, 384, 2)]
    if d <= 64:
        tiles += [(128, 128, 256, 3), (128, 256, 256, 2), (256, 128, 512, 2)]
    out = [("x".join(map(str, t[:2])) + f"/t{t[2]}/s{t[3]}", t, "select", False, False) for t in tiles]
    out.append(("mask=branch", None, "branch", False, False))
    ws = [(128, 128, 256, 2), (128, 64, 256, 2)] if d > 64 else [(128, 128, 256, 2), (128, 128, 256, 3),
                                                                 (192, 128, 384, 2), (128, 176, 256, 2)]
    out += [("ws " + "x".join(map(str, t[:2])) + f"/s{t[3]}", t, "branch", False, True) for t in ws]
    own = (192, 128, 384, 2) if d <= 64 else (128, 128, 256, 2)
    win = (192, 64, 384, 3) if d <= 64 else (128, 64, 256, 3)

    def ws_row(o, t):
        """The row of fwd_ws.py's kernel with options ``o`` ("a/b/..": the fold always) at tiles ``t``."""
        return ("ws/" + "fold/" * (not o.startswith("fold")) + o + " " + "x".join(map(str, t[:2])) + f"/s{t[3]}",
                t, "branch", False, o)

    # the fold, strict's o32 (two consumers), each epilogue, Q slots and GQA packing at the forward's tiles
    out += [ws_row("fold", own), ws_row("o32", (128, 128, 256, 2))]
    out += [ws_row(o, own) for o in ("regs", "q2", "regs/q2", "wg", "wg/q2", "pack", "regs/q2/pack", "wg/pack")]
    # the windowed kind's neighbours: its epilogues, slots and packing at its 64-key tiles and at 128 keys
    out += [ws_row(o, win) for o in ("regs/q2/pack", "wg/q2/pack", "tma/q2/pack", "wg/pack", "tma/pack")]
    rows = (256, 192) if d <= 64 else (128, 192)
    out += [ws_row("tma/q2/pack", (bm, 64, 2 * bm, st)) for bm in rows for st in (2, 3, 4)]
    return list({row[0]: row for row in out}.values())  # (a label once: the windowed tiles repeat)


def _func(job):
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import Tiles
    from flashsink.ops.kernels.fwd import build_fwd_pipelined
    from flashsink.ops.kernels.fwd_ws import build_fwd_ws

    dtype, d, tiles, mask, fold, ws = job[:6]
    cfg = _cfg(dtype, d, "strict" if isinstance(ws, str) and "o32" in ws.split("/") else "fast")
    if len(job) > 6:  # a packed batch's kernel (VARLEN problems)
        cfg = dataclasses.replace(cfg, layout=job[6])
    if tiles is None and mask == "select" and not fold and not ws:
        return build_prim_func("fwd", cfg)  # the library's kernel
    if isinstance(ws, str):
        opts = ws.split("/")
        return build_fwd_ws(cfg, Tiles(*tiles), fold=True, o32="o32" in opts,
                            epilogue=next((e for e in ("regs", "wg", "tma") if e in opts), "smem"),
                            q_slots=2 if "q2" in opts else 1, pack_gqa="pack" in opts)
    if ws is True:  # fwd_ws.py's kernel unfolded, smem epilogue, one Q slot (not config.fwd_ws_options)
        return build_fwd_ws(cfg, Tiles(*tiles))
    return build_fwd_pipelined(cfg, tiles=Tiles(*tiles) if tiles else None, mask=mask)


#: seconds a child gets to load a hand-synchronized variant (from the disk cache) and run it once
PROBE_TIMEOUT_S = 120


def _probe_child(job, n, out):
    """Child process: load ``job``'s kernel and run it once on an ``n``-row problem; ``None`` or the error on ``out``."""
    try:
        import torch

        from flashsink.kernel_config import LOG2E, NO_WINDOW

        kern = _load(job, _func)
        dt, d = getattr(torch, job[0]), job[1]
        packed = len(job) > 6
        lens = (n // 3, n - n // 3) if packed else (n,)
        q, k, v, sinks, seq, lse_shape = _inputs(torch, dt, d, lens, packed)
        for win in (NO_WINDOW, 128):
            kern(q, k, v, sinks, *seq, win, LOG2E / math.sqrt(d), torch.empty_like(q),
                 torch.empty(lse_shape, dtype=torch.float32, device="cuda"), *_o32(job, q))
        torch.cuda.synchronize()
        out.put(None)
    except Exception as exc:
        out.put(f"{type(exc).__name__}: {str(exc)[-300:]}")


def _probe(jobs, n: int) -> dict:
    """``{job: None | error}``: each job run once in a child process with a time limit, so a variant
    that faults or hangs is reported, not fatal."""
    import multiprocessing as mp
    import queue

    status = {}
    ctx = mp.get_context("spawn")
    for job in jobs:
        out = ctx.Queue()
        proc = ctx.Process(target=_probe_child, args=(job, n, out))
        proc.start()
        try:
            status[job] = out.get(timeout=PROBE_TIMEOUT_S)
        except queue.Empty:
            status[job] = (f"child process died (exit code {proc.exitcode})" if not proc.is_alive()
                           else f"HUNG or too slow: no answer in {PROBE_TIMEOUT_S} s, killed")
        if proc.is_alive():
            proc.kill()
        proc.join()
        print(f"  probe {job}: {status[job] or 'ok'}", file=sys.stderr, flush=True)
    return status


def _inputs(torch, dt, d: int, lens, packed: bool):
    """``(q, k, v, sinks, seq, lse_shape)`` for sequences of ``lens``: one bhsd sequence, or (``packed``) a
    thd batch, whose kernels take ``seq = (cu_seqlens_q, cu_seqlens_k, max_seqlen)`` after the sinks."""
    from flashsink.kernel_config import padded_rows, varlen_rows

    total = sum(lens)
    shape_q, shape_kv = ((total, H, d), (total, HK, d)) if packed else ((1, H, total, d), (1, HK, total, d))
    q = torch.randn(shape_q, device="cuda", dtype=dt)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=dt) for _ in range(2))
    sinks = torch.randn(H, device="cuda", dtype=torch.float32)
    if not packed:
        return q, k, v, sinks, (), (1, H, padded_rows(total))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    return q, k, v, sinks, (cu, cu, max(lens)), (H, varlen_rows(total))


def _o32(job, q) -> list:
    """The ``o32`` option's extra output (O in fp32, q's shape), or nothing."""
    import torch

    o32 = isinstance(job[5], str) and "o32" in job[5].split("/")
    return [torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)] if o32 else []


def _errors(got, ref) -> tuple:
    """(max abs error, relative L2 error) in float64; NaN anywhere gives NaN."""
    g, r = got.double(), ref.double()
    return float((g - r).abs().max()), float((g - r).norm() / r.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, one after another in turn (round-robin), and report "
                         "the median: a GPU's clock drifts over a call (docs/perf-log.md v29: the same kernel 1.14 ms "
                         "first in a run, 1.24 later), so one pass in order favours the first rows")
    ap.add_argument("--variants", default="all",
                    help="comma-separated: the variants whose label contains one of them, or '=label' exactly, as "
                         f"lab/bwd_variants.py's ('all', the default: every one; {DEFAULT!r} always runs, it is the reference)")
    args = ap.parse_args()
    args.variants = _variants_arg(ap, args.variants)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")

    def variants(d):
        return _chosen(_variants(d), args.variants)

    names = [n for n in args.problems.split(",") if n]
    unknown = [n for n in names if n not in PROBLEMS and n not in VARLEN]
    if unknown:
        ap.error(f"unknown problems {unknown}; known: {list(PROBLEMS) + list(VARLEN)}")

    def problem(name):
        """(dtype, D, window, sequence lengths, the job's layout suffix: () or ("thd",))."""
        if name in VARLEN:
            from flashsink.bench.problems import varlen_lengths

            dtype, n_seqs, total, d, window = VARLEN[name]
            return dtype, d, window, varlen_lengths(n_seqs, total), ("thd",)
        dtype, n, d, window = PROBLEMS[name]
        return dtype, d, window, (n,), ()

    labels = {}  # job -> label
    for name in names:
        dtype, d, _, _, lay = problem(name)
        labels[(dtype, d, None, "select", False, False, *lay)] = DEFAULT
        for label, tiles, mask, fold, ws in variants(d):
            labels[(dtype, d, tiles, mask, fold, ws, *lay)] = label
    # the split kernels (two pipelined loops) take several times as long to lower and compile: start them first
    jobs = sorted(labels, key=lambda job: job[3] != "split")
    kernels, errors = compile_all(jobs, args.jobs, _func, lambda job: f"{job[0]} D{job[1]} {labels[job]}")
    hand = [job for job in kernels if job[5]]
    for job, err in _probe(hand, 1000).items():
        if err is not None:
            kernels.pop(job)
            errors[job] = "probe: " + err

    import torch
    from triton.testing import do_bench

    from flashsink.kernel_config import LOG2E, NO_WINDOW

    results = []
    for name in names:
        dtype_name, d, window, lens, lay = problem(name)
        n = sum(lens)  # tokens (one sequence, or a packed batch's)
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        dt = getattr(torch, dtype_name)
        torch.manual_seed(0)
        q, k, v, sinks, seq, lse_shape = _inputs(torch, dt, d, lens, bool(lay))
        scale_log2 = LOG2E / math.sqrt(d)
        win = NO_WINDOW if window is None else window
        flops = 4 * sum(sum(min(i + 1, win) for i in range(m)) for m in lens) * H * d

        def run(kern, extra=()):
            o = torch.full_like(q, float("nan"))
            lse = torch.full(lse_shape, float("nan"), dtype=torch.float32, device="cuda")
            kern(q, k, v, sinks, *seq, win, scale_log2, o, lse, *extra)
            return o, lse

        ref_kern = kernels.get((dtype_name, d, None, "select", False, False, *lay))
        if ref_kern is None:
            print(f"  {name}: the default forward did not build, skipped", file=sys.stderr, flush=True)
            continue
        o_ref, lse_ref = run(ref_kern)
        row = {"problem": name, "dtype": dtype_name, "N": n, "D": d, "W": window, "flops": flops, "variants": {}}
        timed = {}  # label -> the call to time
        for label, tiles, mask, fold, ws in [(DEFAULT, None, "select", False, False)] + variants(d):
            job = (dtype_name, d, tiles, mask, fold, ws, *lay)
            kern = kernels.get(job)
            if kern is None:
                row["variants"][label] = {"error": "compile failed: " + errors.get(job, "not built")}
                continue
            extra = _o32(job, q)
            try:  # a kernel that builds may still fail to launch (e.g. more shared memory than the GPU has)
                o, lse = run(kern, extra)
                torch.cuda.synchronize()
            except Exception as exc:
                row["variants"][label] = {"error": f"launch failed: {type(exc).__name__}: {str(exc)[-300:]}"}
                continue
            o_err, lse_err = _errors(o, o_ref), _errors(lse[..., :n], lse_ref[..., :n])
            out_o, out_lse = torch.empty_like(q), torch.empty(lse_shape, dtype=torch.float32, device="cuda")
            call = functools.partial(kern, q, k, v, sinks, *seq, win, scale_log2, out_o, out_lse, *extra)
            row["variants"][label] = {"o_max": o_err[0], "o_rel_l2": o_err[1], "lse_max": lse_err[0],
                                      "lse_rel_l2": lse_err[1]}
            timed[label] = call
            if extra:  # the fp32 O against the rounded o the kernel wrote: o's rounding, nothing more
                row["variants"][f"  {label}: fp32 O vs its o"] = {"error": "max %.2e relL2 %.2e" % _errors(extra[0], o)}
        times = {label: [] for label in timed}
        for _ in range(args.rounds):  # round-robin, so a clock's drift over the call reaches every variant alike
            for label, call in timed.items():
                times[label].append(do_bench(call, return_mode="median"))
        base_ms = statistics.median(times[DEFAULT]) if DEFAULT in times else None
        for label, ts in times.items():
            ms = statistics.median(ts)
            row["variants"][label].update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, runs=ts,
                                          speedup=base_ms / ms if base_ms else float("nan"),
                                          spread=(max(ts) - min(ts)) / ms)
        results.append(row)
        what = f"N={n}" if not lay else f"{len(lens)} sequences, {n} tokens, thd"
        print(f"\n== {name}: {dtype_name} {what} D={d} W={window} H={H}/{HK} (fwd {flops / 1e12:.3f} TFLOP)")
        print(f"  {'variant':<24} {'ms':>8} {'TFLOP/s':>8} {'x dflt':>7} {'o max':>9} {'o relL2':>9} "
              f"{'lse max':>9} {'lse relL2':>9}" + (f" {'spread':>7}" if args.rounds > 1 else ""))
        for label, r in row["variants"].items():
            if "error" in r:
                print(f"  {label:<24} {r['error'][:200]}")
            else:
                print(f"  {label:<24} {r['ms']:8.4f} {r['tflops']:8.1f} {r['speedup']:7.3f} {r['o_max']:9.2e} "
                      f"{r['o_rel_l2']:9.2e} {r['lse_max']:9.2e} {r['lse_rel_l2']:9.2e}"
                      + (f" {100 * r['spread']:6.1f}%" if args.rounds > 1 else ""))
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
