"""Time alternatives of the forward kernel on the GPU, in one device call.

    source .gpu/setup.sh && python tools/fwd_variants.py [--problems causal-d128,golden] [--jobs 16] [--json out.json]

For each problem of tools/bwd_variants.py (H=64, H_kv=8, bhsd, B=1, sinks), or of ``VARLEN`` (the bench's
packed varlen batch, thd: ``varlen-swa``, ``varlen-full``), and each variant of the
forward (``fwd.build_fwd``'s options: tiles, how the mask is applied, the scale folded into the
exponent, the hand warp-specialized kernel ``ws`` of fwd_ws.py): compile every kernel in parallel
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
    """(label, Tiles fields or None for the tile table's, mask, fold_scale, ws) for head dim ``d``;
    tiles are those plausible in registers and shared memory on the H200. ``ws``: fwd_ws.py's
    kernel (mask "branch"; ``block_m / 64`` consumer warpgroups, ``stages`` K/V ring slots)."""
    tiles = [(128, 64, 256, 2), (64, 128, 128, 2), (192, 128, 384, 2)]
    if d <= 64:
        tiles += [(128, 128, 256, 3), (128, 256, 256, 2), (256, 128, 512, 2)]
    out = [("x".join(map(str, t[:2])) + f"/t{t[2]}/s{t[3]}", t, "select", False, False) for t in tiles]
    for fold in (False, True):
        for mask in ("select", "flag", "branch", "split"):
            if mask != "select" or fold:
                out.append(("/".join([f"mask={mask}"] * (mask != "select") + ["fold"] * fold), None, mask, fold, False))
    ws = [(128, 128, 256, 2), (128, 64, 256, 2)] if d > 64 else [(128, 128, 256, 2), (128, 128, 256, 3),
                                                                 (192, 128, 384, 2), (128, 176, 256, 2)]
    out += [("ws " + "x".join(map(str, t[:2])) + f"/s{t[3]}", t, "branch", False, True) for t in ws]
    # one program per tile instead of the persistent grid; the consumers without turns; the scale
    # folded into the exponent's FMA
    out += [(f"ws/{o} " + "x".join(map(str, t[:2])) + f"/s{t[3]}", t, "branch", False, o) for t in ws[:1]
            for o in ("np", "nopp", "fold")]
    if d <= 64:  # the fold with D64's own 192-row tiles (config.fwd_tiles), and with a third K/V ring slot
        out.append(("ws/fold 192x128/s2", (192, 128, 384, 2), "branch", False, "fold"))
        out.append(("ws/fold 192x128/s3", (192, 128, 384, 3), "branch", False, "fold"))
    # the fold with 64-key tiles: a narrow window's query tile computes fewer masked logits (a 128-row
    # tile under W=128 sees 255 keys: 2-3 tiles of 128, 4-5 of 64)
    out += [(f"ws/fold 128x64/s{st}", (128, 64, 256, st), "branch", False, "fold") for st in (2, 3)]
    # the fold with one column group in every 8 / 4 of exponentials on the FMA pipe (softmax.exp2_fma)
    own = (192, 128, 384, 2) if d <= 64 else (128, 128, 256, 2)
    out += [(f"ws/fold/fma{k} " + "x".join(map(str, own[:2])) + "/s2", own, "branch", False, f"fma{k}") for k in (8, 4)]
    # strict's forward option (fwd_ws.build_fwd_ws(o32=True)): P @ V two-term and O also in fp32 for the
    # backward's Delta; two consumers (D64's three spill 272 bytes with the second term's registers)
    out += [("ws/fold/o32 128x128/s2", (128, 128, 256, 2), "branch", False, "o32")]
    # ... and with the register epilogue (and, at D64, Q double-buffered) as D64's fast forward since
    # v15: strict's training forward at D64 is 1.4x fast's (ptxas: no spills, 168 registers)
    out += [(f"ws/fold/o32/{o} 128x128/s2", (128, 128, 256, 2), "branch", False, f"o32/{o}")
            for o in (("regs", "regs/q2") if d <= 64 else ("regs",))]
    # o stored from registers (build_fwd_ws(epilogue="regs")): no barrier of every consumer thread at a
    # tile's end, so the ping-pong's two warpgroups are not realigned at every query tile (windows: 2-3
    # KV tiles per query tile); at the forward's own tiles and at 128 rows (the windowed tiles D64 ran
    # until docs/perf-log.md v15); and Q double-buffered (build_fwd_ws(q_slots=2)): the next query tile's Q
    # loads while this one computes, instead of on the tile boundary. Head dim 64's forward is regs/q2
    # since v15 (config.fwd_ws_options); every other ws row names its options, smem and one slot unless
    # its label says otherwise
    out += [(f"ws/fold/{o} " + "x".join(map(str, t[:2])) + "/s2", t, "branch", False, o)
            for t in dict.fromkeys([own, (128, 128, 256, 2)]) for o in ("regs", "q2", "regs/q2")]
    # a GQA group's heads packed into one tile (build_fwd_ws(pack_gqa=True), FA4's default on Hopper): at
    # W=128 a tile of 24 positions x 8 heads spans 2-3 KV tiles where 192 positions span 3 (perf-log.md v15);
    # with the forward's own options (regs/q2) and without them; head dims 64 and 128 (fwd_ws._pack_rows)
    if d == 64:
        out += [(f"ws/fold/{o} 192x128/s2", own, "branch", False, o) for o in ("regs/q2/pack", "pack")]
        # packed (the library's D64 forward since v18) over 64-key tiles: 24 positions at W=128 see 151
        # keys, 3-4 tiles of 64 (192-256 keys a row) against 2-3 of 128 (256-384); and 128-row tiles
        # (16 positions a head, two consumer warpgroups). Wins under windows only would need a kind of
        # their own (the window is a runtime value)
        out += [(f"ws/fold/regs/q2/pack 192x64/s{st}", (192, 64, 384, st), "branch", False, "regs/q2/pack")
                for st in (3, 4)]
        out.append(("ws/fold/regs/q2/pack 128x128/s2", (128, 128, 256, 2), "branch", False, "regs/q2/pack"))
        # the windowed kind's neighbours (config.fwd_window_tiles is 192x64/s3 regs/q2/pack since v19): 128
        # rows (16 positions see 143 keys at W=128, 3-4 tiles of 64) and one Q slot
        out.append(("ws/fold/regs/q2/pack 128x64/s3", (128, 64, 256, 3), "branch", False, "regs/q2/pack"))
        out.append(("ws/fold/regs/pack 192x64/s3", (192, 64, 384, 3), "branch", False, "regs/pack"))
    elif d == 128:  # golden: two boxes a head; its tiles span as many KV tiles, only K/V loads fall
        out.append(("ws/fold/pack 128x128/s2", own, "branch", False, "pack"))
        # ... with the register epilogue and Q double-buffered (D64's options), and over 64-key tiles:
        # 16 positions at W=128 see 143 keys, 3-4 tiles of 64 (~205 keys a row) against 2 of 128 (256)
        out.append(("ws/fold/regs/q2/pack 128x128/s2", own, "branch", False, "regs/q2/pack"))
        out += [(f"ws/fold/{o} 128x64/s{st}", (128, 64, 256, st), "branch", False, o)
                for o in ("pack", "regs/q2/pack") for st in (2, 3)]
    # each consumer warpgroup over the KV tiles its own 64 rows see (build_fwd_ws(wg_ranges=True)), with
    # 64-key tiles: at W=128 a warpgroup then computes 192 keys per row where a tile of 128 (192) rows over
    # 128-key tiles computes 256 (384); the forward's own options, 2-4 ring slots (64-key slots are small).
    # A window's tiles would need a kernel kind of their own (the window is a runtime value) unless one
    # tile shape wins everywhere: at D64 the 192x128 row below is one kernel for windows and causal
    wgr = ("regs/q2/wgr", (192, 64, 384)) if d <= 64 else ("wgr", (128, 64, 256))
    out += [(f"ws/fold/{wgr[0]} " + "x".join(map(str, wgr[1][:2])) + f"/s{st}", (*wgr[1], st), "branch", False,
             wgr[0]) for st in (2, 3, 4)]
    if d <= 64:  # and over D64's own 128-key tiles: at W=128 each warpgroup of a 192-row tile sees 2 of its 3
        out.append(("ws/fold/regs/q2/wgr 192x128/s2", own, "branch", False, "regs/q2/wgr"))
    # the wait for P V kept after the softmax (build_fwd_ws(pin_wait=True); ptxas hoists it above the softmax
    # otherwise) and the mask by per-row key limits (mask_limits=True), both the library's since docs/perf-log.md
    # v20: the forward's own kernel, the windowed kind's and strict's o32, each with neither, either and both
    mine = ("regs/q2/pack", own) if d <= 64 else ("", own)
    win = ("regs/q2/pack", (192, 64, 384, 3)) if d <= 64 else ("pack", (128, 64, 256, 3))
    def ws_row(o, t):
        """The row of fwd_ws.py's kernel with options ``o`` ("a/b/..": the fold always) at tiles ``t``."""
        return ("ws/" + "fold/" * (not o.startswith("fold")) + o + " " + "x".join(map(str, t[:2])) + f"/s{t[3]}",
                t, "branch", False, o)

    for o, t in (mine, win, ("o32", (128, 128, 256, 2))):
        o = o or "fold"
        out += [ws_row(o + x, t) for x in ("", "/pin", "/lim", "/pin/lim")]
    # one column group in 8 of exponentials on the FMA pipe again, now that the softmax runs beside P V
    # (v11 lost 16% with it, when ptxas kept the softmax after the product's wait)
    if d <= 64:
        out.append(("ws/fold/regs/q2/pack/pin/lim/fma8 192x128/s2", own, "branch", False, "regs/q2/pack/pin/lim/fma8"))
    # the output's rescale only where a warp's rows moved their pivot by more than 2**8 (lazy_rescale=8), with
    # and (the library's options since v21) without pin_wait
    out += [ws_row((o or "fold") + x, t) for o, t in (mine, win) for x in ("/pin/lim/lazy", "/lim/lazy")]
    # the persistent programs in round-robin (build_fwd_ws(snake=False), the order until docs/perf-log.md v23)
    # against the snake, the library's since then: the same kernels otherwise
    out += [ws_row((o or "fold") + "/lim/rr", t) for o, t in (mine, win)]
    if d == 128:  # FlashAttention-4's causal forward at D128 on Hopper: a GQA group packed into 128x128 tiles
        out += [ws_row("pack/lim" + x, own) for x in ("", "/lazy")]
    # each consumer warpgroup's rows of o staged in shared memory and stored 16 bytes a thread (epilogue="wg"),
    # and the next tile's Q loaded before this tile's K and V (q_ahead: two or three Q slots), docs/perf-log.md v24
    if d <= 64:
        out += [ws_row(x, t) for t in (own, win[1]) for x in
                ("regs/q2/pack/lim/qa", "regs/q3/pack/lim/qa", "wg/q2/pack/lim", "wg/q2/pack/lim/qa",
                 "wg/q3/pack/lim/qa")]
    else:
        out += [ws_row(x, own) for x in ("wg/lim",)]
        out += [ws_row(x, win[1]) for x in ("q2/pack/lim/qa", "wg/pack/lim", "wg/q2/pack/lim/qa")]
    # the row tiles back to back (build_fwd_ws(chain=True), docs/perf-log.md v25): a tile's last P V issued with the
    # next tile's first S, its epilogue after that tile's first softmax; the windowed kind's options with it,
    # and the forward's own (causal: one row tile in ~43 KV tiles, so little to gain there)
    if d <= 64:
        out += [ws_row(x, win[1]) for x in ("wg/q2/pack/lim/chain", "wg/q3/pack/lim/chain")]
        out += [ws_row("regs/q2/pack/lim/chain", own)]
        # two programs an SM (build_fwd_ws(per_sm=2)), each a row tile of one consumer warpgroup (no ping-pong):
        # one program's row tile chain (the wait for Q, the first softmax, the last P V, the epilogue) runs while
        # the other's products have the tensor cores. Two consumers a program would have 80 registers (spills)
        out += [ws_row("wg/q2/pack/lim/sm2", (64, 64, 128, st)) for st in (2, 3)]
        out += [ws_row(x, (64, 64, 128, 3)) for x in ("wg/pack/lim/sm2", "wg/q3/pack/lim/qa/sm2")]
        # the consumer warpgroups free of the ping-pong's turns ("free": the scale still folded, where "nopp"
        # unfolds it too), and the windowed kernel's ring and Q slots again
        out += [ws_row(x, win[1]) for x in ("wg/q2/pack/lim/free", "wg/q2/pack/lim/chain/free", "wg/q3/pack/lim")]
        out += [ws_row("wg/q2/pack/lim", (192, 64, 384, st)) for st in (2, 4)]
        # o stored by TMA from the staged buffer, one thread a warpgroup (build_fwd_ws(epilogue="tma")), the
        # windowed kind's and the causal forward's options otherwise
        out += [ws_row("tma/q2/pack/lim", win[1]), ws_row("tma/q2/pack/lim", own)]
        # four consumer warpgroups (256 rows: 32 positions of 8 heads; 112 registers a consumer thread): at W=128
        # a row tile then always sees 3 KV tiles of 64 (24 positions see 3-4), and the row tile's fixed cost
        # (docs/perf-log.md v24: 4.06 us against 1.05 us a KV tile) is shared by a third more rows
        out += [ws_row(x, (256, 64, 512, st)) for x in ("tma/q2/pack/lim", "tma/pack/lim") for st in (2, 3)]
        out += [ws_row(x, (256, 64, 512, st)) for x, st in (("wg/q2/pack/lim", 3), ("tma/q2/pack/lim", 4),
                                                              ("tma/q3/pack/lim/qa", 3))]
        # the sink's load ahead of the wait for Q (build_fwd_ws(sink_early=True)), the windowed kind's options at
        # 192 and 256 rows and the causal forward's; and D64's causal ring at three slots
        out += [ws_row("tma/q2/pack/lim/se", (bm_, 64, 2 * bm_, 3)) for bm_ in (192, 256)]
        out += [ws_row("regs/q2/pack/lim/se", own), ws_row("regs/q2/pack/lim", (192, 128, 384, 3)),
                ws_row("regs/q2/pack/lim/se", (192, 128, 384, 3))]
    else:
        out += [ws_row(x, win[1]) for x in ("wg/pack/lim/chain", "wg/q2/pack/lim/chain", "wg/q2/pack/lim")]
        out += [ws_row("wg/pack/lim/sm2", (64, 64, 128, 3))]
        out += [ws_row(x, win[1]) for x in ("wg/q2/pack/lim/free", "wg/q3/pack/lim")]
        out += [ws_row("wg/q2/pack/lim", (128, 64, 256, st)) for st in (2, 4)]
        out += [ws_row("tma/q2/pack/lim", win[1]), ws_row("tma/lim", own)]
        # golden's windowed tiles at 192 rows (three consumer warpgroups, 160 registers; 24 positions of 8 heads),
        # as the 256-row tiles did for head dim 64 (docs/perf-log.md v28): a row tile's fixed cost over more rows
        out += [ws_row("tma/q2/pack/lim", (192, 64, 384, 3))]
        out += [ws_row("tma/q2/pack/lim/se", win[1]), ws_row("wg/lim/se", own)]
    return out


def _func(job):
    from flashsink.ops.compile import build_prim_func
    from flashsink.ops.config import Tiles
    from flashsink.ops.fwd import build_fwd

    dtype, d, tiles, mask, fold, ws = job[:6]
    cfg = _cfg(dtype, d, "strict" if isinstance(ws, str) and "o32" in ws.split("/") else "fast")
    if len(job) > 6:  # a packed batch's kernel (VARLEN problems)
        cfg = dataclasses.replace(cfg, layout=job[6])
    if tiles is None and mask == "select" and not fold and not ws:
        return build_prim_func("fwd", cfg)  # the library's kernel
    opts = ws.split("/") if isinstance(ws, str) else []
    if opts and set(opts) <= {"np", "nopp", "fold", "fma8", "fma4", "o32", "regs", "wg", "q2", "q3", "qa", "pack", "wgr",
                              "pin", "lim", "lazy", "rr", "chain", "sm2", "sm3", "sm4", "free", "tma", "se"}:
        from flashsink.ops.fwd_ws import PERSISTENT_CTAS, build_fwd_ws

        fma = next((int(o[3:]) for o in opts if o.startswith("fma")), 0)
        return build_fwd_ws(cfg, Tiles(*tiles), ctas=None if "np" in opts else PERSISTENT_CTAS,
                            pingpong=not {"nopp", "free"} & set(opts) and tiles[0] > 64,  # (one consumer: no turns)
                            fold=not {"np", "nopp"} & set(opts), fma_every=fma,
                            o32="o32" in opts, epilogue=next((e for e in ("regs", "wg", "tma") if e in opts), "smem"),
                            q_slots=3 if "q3" in opts else 2 if "q2" in opts else 1, q_ahead="qa" in opts,
                            pack_gqa="pack" in opts, wg_ranges="wgr" in opts,
                            pin_wait="pin" in opts, mask_limits="lim" in opts,
                            lazy_rescale=8.0 if "lazy" in opts else 0.0, snake="rr" not in opts,
                            chain="chain" in opts,
                            per_sm=next((int(o[2:]) for o in opts if o.startswith("sm")), 1),
                            sink_early="se" in opts)
    if ws is True:  # fwd_ws.py's kernel unfolded, smem epilogue, one Q slot (not config.fwd_ws_options)
        from flashsink.ops.fwd_ws import build_fwd_ws

        return build_fwd_ws(cfg, Tiles(*tiles), fold=False)
    return build_fwd(cfg, tiles=Tiles(*tiles) if tiles else None, mask=mask, fold_scale=fold, ws=ws)


#: seconds a child gets to load a hand-synchronized variant (from the disk cache) and run it once
PROBE_TIMEOUT_S = 120


def _probe_child(job, n, out):
    """Child process: load ``job``'s kernel and run it once on an ``n``-row problem; ``None`` or the error on ``out``."""
    try:
        import torch

        from flashsink.ops.config import LOG2E, NO_WINDOW

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
    from flashsink.ops.config import padded_rows, varlen_rows

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
                         f"tools/bwd_variants.py's ('all', the default: every one; {DEFAULT!r} always runs, it is the reference)")
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

    from flashsink.ops.config import LOG2E, NO_WINDOW

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
