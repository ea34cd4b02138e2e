"""Time alternatives of the main backward kernel on the GPU, in one device call.

    source .gpu/setup.sh && python lab/bwd_variants.py [--problems causal-d128,gptoss-full] [--jobs 16]
        [--variants ws,s3]

For each problem (H=64, H_kv=8, bhsd, B=1) and each variant (tiles, dQ reduction, the hand
warp-specialized kernel ``ws``) of the fast main backward: compile every kernel in parallel
processes first (TileLang's own disk cache, then loaded here); run each variant once in a child
process with a time limit (a variant that faults or hangs is reported and skipped, the run goes on);
then check the fast gradients against the strict path (relative L2; the strict path meets the
precision standard; a variant off by more than ``MAX_REL_L2`` is marked WRONG) and time every
kernel with ``triton.testing.do_bench`` (median). Prints one table per problem: kernel times, the
whole fast and strict backward, fwd+bwd TFLOP/s. The defaults the library uses are marked ``*``.
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
#: fast against strict differs by one rounding of P and dS to the input dtype: measured 2.7e-3
#: (bf16), 3.2e-4 (fp16) (docs/perf-log.md v6); a variant past this is wrong, not imprecise
MAX_REL_L2 = 1e-2
#: seconds a child process gets to run one variant once, and to start (load its kernels)
PROBE_TIMEOUT_S, PROBE_START_S = 60, 240


def _variants(d: int, only: str = "") -> list:
    """(label, Tiles fields, (dq_bulk, overlap, split, ws, precision, branch, swap, dq_first, ds_first[, head_major[,
    dk_in_flight[, tma_epilogue]]])) of the main backward for head dim ``d``. ``ws``: ``bwd_ws.build_bwd_ws(cfg, tiles, split,
    dq_first, ds_first, head_major=, dk_in_flight=)``
    (``t.stages`` is its ring's depth); otherwise ``bwd.build_bwd_pipelined(cfg, tiles, split, branch, swap, dq_bulk, overlap)``,
    TileLang's kernel (None: the config's choice for ``dq_bulk``, ``overlap`` and ``branch``)."""
    t = (64, 128, 256, 2)
    t3 = (64, 128, 256, 3)
    t128 = (128, 128, 256, 2)  # D64's dq-first tiles
    fast = [("64x128/s2", t, (False, False, 1, False)),
            ("64x128/s2/bulk", t, (True, False, 1, False)),
            ("64x128/s2/overlap", t, (False, True, 1, False)),
            ("64x128/s2/split2", t, (False, False, 2, False)),
            ("64x128/s2/split4", t, (False, False, 4, False)),
            ("64x128/s2/split8", t, (False, False, 8, False)),
            ("64x128/s2/split4/bulk+overlap", t, (True, True, 4, False)),
            ("64x128/s2/split8/bulk+overlap", t, (True, True, 8, False)),
            ("64x128/s1/split4", (64, 128, 256, 1), (False, False, 4, False)),
            ("32x128/s2/split4", (32, 128, 256, 2), (False, False, 4, False)),
            ("64x128/s3/bulk+overlap", t3, (True, True, 1, False)),
            ("64x128/s3/split8/bulk+overlap", t3, (True, True, 8, False)),
            ("ws 64x128/s2", t, (None, None, 1, True)),
            ("ws 64x128/s2/split4", t, (None, None, 4, True)),
            ("ws 64x128/s2/split8", t, (None, None, 8, True)),
            ("ws 64x128/s3", t3, (None, None, 1, True)),
            ("ws 64x128/s3/split8", t3, (None, None, 8, True))]
    if d <= 64:
        fast += [("128x128/s2/split4", (128, 128, 256, 2), (False, False, 4, False)),
                 ("128x128/s2/split8/bulk+overlap", (128, 128, 256, 2), (True, True, 8, False)),
                 ("ws 128x128/s2", (128, 128, 256, 2), (None, None, 1, True)),
                 ("ws 128x128/s2/split8", (128, 128, 256, 2), (None, None, 8, True))]
    out = [(label, tiles, opts + ("fast", None, False, False, False)) for label, tiles, opts in fast]
    # head-major grids (``build_bwd_ws(head_major=True)``, the 10th option): one program per (KV tile, query
    # head) with split 8, a head's KV tiles launched together (FlashAttention-4's grid: its Q/dO/dQ rows stay in L2)
    hm = [("ws 64x128/s2/split8/hm", t, (None, None, 8, True, "fast", None, False, False, False, True)),
          ("ws 64x128/s3/split8/hm", t3, (None, None, 8, True, "fast", None, False, False, False, True)),
          ("ws 64x128/s2/split4/hm", t, (None, None, 4, True, "fast", None, False, False, False, True))]
    if d <= 64:
        hm += [("ws 128x128/s2/dqfirst/split8/hm", t128, (None, None, 8, True, "fast", None, False, True, False, True)),
               ("ws 128x128/s2/dqfirst/split4/hm", t128, (None, None, 4, True, "fast", None, False, True, False, True)),
               ("ws 128x128/s2/split8/hm", t128, (None, None, 8, True, "fast", None, False, False, False, True)),
               # D64 head-major once its wgmma are no longer serialized (ds_first)
               ("ws 128x128/s2/dqfirst/dsfirst/split8/hm", t128,
                (None, None, 8, True, "fast", None, False, True, True, True))]
    out += hm
    # dK's product left running into the next tile (``build_bwd_ws(dk_in_flight=True)``, the 11th option;
    # FlashAttention-3's order: dQ's product first, waited for and handed over while dK's runs on)
    kf = [("ws 64x128/s2/dqfirst/dkflight", t, (None, None, 1, True, "fast", None, False, True, False, False, True)),
          ("ws 64x128/s2/dqfirst/dsfirst/dkflight", t, (None, None, 1, True, "fast", None, False, True, True, False, True)),
          ("ws 64x128/s2/dqfirst/dkflight/split8/hm", t,
           (None, None, 8, True, "fast", None, False, True, False, True, True)),
          ("ws 64x128/s3/dqfirst/dkflight/split8/hm", t3,
           (None, None, 8, True, "fast", None, False, True, False, True, True)),
          ("ws 64x128/s2/dqfirst/dsfirst/dkflight/split8/hm", t,
           (None, None, 8, True, "fast", None, False, True, True, True, True))]
    if d <= 64:
        kf += [("ws 128x128/s2/dqfirst/dsfirst/dkflight/split8/hm", t128,
                (None, None, 8, True, "fast", None, False, True, True, True, True)),
               ("ws 128x128/s2/dqfirst/dsfirst/dkflight", t128,
                (None, None, 1, True, "fast", None, False, True, True, False, True)),
               ("ws 128x128/s2/dqfirst/dkflight", t128,
                (None, None, 1, True, "fast", None, False, True, False, False, True))]
    out += kf
    # dK/dV added by bulk reduce-adds from shared memory (``build_bwd_ws(tma_epilogue=True)``, the 12th option;
    # FlashAttention-4's epilogue) in FlashAttention-3's head-major kernel, instead of per-thread atomics
    fa3 = (None, None, 8, True, "fast", None, False, True, True, True, True)
    out += [("ws 64x128/s2/dqfirst/dsfirst/dkflight/split8/hm/tmaepi", t, fa3 + (True,))]
    if d <= 64:
        out += [("ws 128x128/s2/dqfirst/dsfirst/dkflight/split8/hm/tmaepi", t128, fa3 + (True,))]
    # FlashAttention-3's order of the last two products: dQ's, then dK's, dQ handed off while dK's runs
    out += [("ws 64x128/s2/dqfirst", t, (None, None, 1, True, "fast", None, False, True, False))]
    if d <= 64:
        out += [("ws 128x128/s2/dqfirst", (128, 128, 256, 2), (None, None, 1, True, "fast", None, False, True, False))]
    # FlashAttention-3's order for D64's registers: dS^T into dP^T's registers before P^T is rounded, dV
    # issued after both roundings (``build_bwd_ws(ds_first=True)``, under measurement; the row above is the old order, which ptxas
    # serializes at D64's 128-row tiles: C7512, perf-log v20)
    out += [("ws 64x128/s2/dsfirst", t, (None, None, 1, True, "fast", None, False, False, True)),
            ("ws 64x128/s2/dqfirst/dsfirst", t, (None, None, 1, True, "fast", None, False, True, True))]
    if d <= 64:
        out += [("ws 128x128/s2/dqfirst/dsfirst", (128, 128, 256, 2),
                 (None, None, 1, True, "fast", None, False, True, True))]
    out += [("strict 64x128/s2", t, (None, None, 1, False, "strict", None, False, False, False)),
            ("strict 64x128/s2/branch", t, (None, None, 1, False, "strict", True, False, False, False)),
            # longest first from the grid's dims (KV heads along x): no index arithmetic
            ("strict 64x128/s2/swap", t, (None, None, 1, False, "strict", False, True, False, False)),
            ("strict 64x128/s2/swap+branch", t, (None, None, 1, False, "strict", True, True, False, False)),
            # the default's swap+branch with other stages and tiles
            ("strict 64x128/s1/swap+branch", (64, 128, 256, 1), (None, None, 1, False, "strict", True, True, False, False)),
            ("strict 64x128/s3/swap+branch", t3, (None, None, 1, False, "strict", True, True, False, False)),
            ("strict 32x128/s2/swap+branch", (32, 128, 256, 2), (None, None, 1, False, "strict", True, True, False, False)),
            # the hand warp-specialized kernel with strict's two-term products (8 wgmma per tile; a third
            # ring slot only at D64: at D128 the two-term dS^T's shared tiles leave no room for it)
            ("ws strict 64x128/s2", t, (None, None, 1, True, "strict", None, False, False, False))]
    if d <= 64:
        out += [("ws strict 64x128/s3", t3, (None, None, 1, True, "strict", None, False, False, False))]
    return _chosen(out, only)


def _chosen(variants: list, only: str) -> list:
    """The ``variants`` (label first) that ``--variants`` names: a label containing one of its
    comma-separated substrings, or ``=label`` exactly; all for an empty ``only``."""
    keys = [k for k in only.split(",") if k]
    return [v for v in variants if not keys or any(v[0] == k[1:] if k.startswith("=") else k in v[0] for k in keys)]



def _variants_arg(ap, only: str) -> str:
    """``--variants`` as :func:`_chosen` takes it: "all" (the default) for every variant; an empty list is
    refused, since on a GPU host it would compile every variant there (docs/perf-log.md v24: a list read with
    ``$(cat file)`` from a file that did not travel cost a device call)."""
    if only.strip() == "all":
        return ""
    if not [k for k in only.split(",") if k.strip()]:
        ap.error(f"--variants is empty ({only!r}); name the variants, or 'all' for every one of them")
    return only


#: variants of the strict preprocess (label, options), chosen by --variants as the main backward's are:
#: ``bwd.build_preprocess_strict(cfg, tiles, branch, lpt)`` ("/branch": P without the per-element mask on
#: wholly visible KV tiles; "/lpt": the query tiles with the most keys first; tiles default to
#: ``config.pre_tiles``), or ("o32") the kind ``preprocess_o32``
PRE_VARIANTS = [("strict pre", (("branch", False), ("lpt", False))),
                ("strict pre/branch", (("branch", True), ("lpt", False))),
                ("strict pre/lpt", (("branch", False), ("lpt", True))),
                ("strict pre/branch+lpt", (("branch", True), ("lpt", True))),
                # other tiles with the defaults' branch+lpt (Hopper's is 128 rows x 64 keys, 2 stages)
                ("strict pre/branch+lpt 64x128/s2", (("branch", True), ("lpt", True), ("tiles", (64, 128, 256, 2)))),
                ("strict pre/branch+lpt 128x64/s3", (("branch", True), ("lpt", True), ("tiles", (128, 64, 256, 3)))),
                ("strict pre/branch+lpt 64x64/s2", (("branch", True), ("lpt", True), ("tiles", (64, 64, 128, 2)))),
                # Delta from the forward's fp32 O in the fast preprocess's memory-bound pass; timed here on
                # the library's o upcast (so its Delta differs from P * dP's by o's rounding)
                ("strict pre/o32", (("o32", True),))]


def _pre_variants(only: str = "") -> list:
    return _chosen(PRE_VARIANTS, only)


def _cfg(dtype: str, d: int, precision: str):
    from flashsink.kernel_config import KernelConfig

    return KernelConfig(arch="sm_90a", dtype=dtype, head_dim=d, head_dim_v=d, groups=H // HK, causal=True,
                        has_sinks=True, layout="bhsd", precision=precision, deterministic=False)


def _func(job):
    from flashsink.ops.kernels import bwd, bwd_ws
    from flashsink import kernel_config as config
    from flashsink.ops.compiler.compile import build_prim_func
    from flashsink.kernel_config import Tiles

    kind, dtype, d, precision, tiles, opts = job
    cfg = _cfg(dtype, d, precision)
    if kind == "pre-variant":  # the strict preprocess with the options of PRE_VARIANTS
        opts = dict(opts)
        if opts.get("o32"):
            return bwd.build_preprocess_o32(cfg)
        t = Tiles(*opts["tiles"]) if "tiles" in opts else config.pre_tiles(cfg)
        return bwd.build_preprocess_strict(cfg, t, opts["branch"], opts["lpt"])
    if kind == "bwd-variant":
        dq_bulk, overlap, split, ws, prec, branch, swap, dq_first, ds_first, *rest = opts
        cfg, t = _cfg(dtype, d, prec), Tiles(*tiles)
        if ws:
            return bwd_ws.build_bwd_ws(cfg, t, split, dq_first, ds_first, head_major=bool(rest and rest[0]),
                                       dk_in_flight=len(rest) > 1 and bool(rest[1]),
                                       tma_epilogue=len(rest) > 2 and bool(rest[2]))
        return bwd.build_bwd_pipelined(cfg, t, split, config.bwd_branch(cfg) if branch is None else branch, swap,
                                       config.bwd_dq_bulk(cfg) if dq_bulk is None else dq_bulk,
                                       config.bwd_overlap(cfg) if overlap is None else overlap)
    return build_prim_func(kind, cfg)


def _load(job, build=_func):
    """The compiled kernel of ``job`` (from TileLang's disk cache once compiled); ``build(job)`` gives
    the PrimFunc (lab/fwd_variants.py passes its own)."""
    import tilelang

    from flashsink.ops.compiler.compile import check_source
    from flashsink.ops.compiler.compile import pass_configs

    kernel = tilelang.compile(build(job), target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                              pass_configs=pass_configs())
    check_source(kernel.get_kernel_source() or "")  # a variant that would hang fails here, not after 60 s
    return kernel


def _compile(job, build=_func):
    """``(job, kernel or None, error or None, seconds)``: compiled here; in a pool worker the kernel
    is left in TileLang's disk cache (None returned), the main process loads it with a second call."""
    t0 = time.perf_counter()
    try:
        k = _load(job, build)
    except Exception as exc:  # reported in the table
        return job, None, f"{type(exc).__name__}: {str(exc)[-300:]}", time.perf_counter() - t0
    return job, k if mp.current_process().name == "MainProcess" else None, None, time.perf_counter() - t0


class _Problem:
    """One problem's inputs on the GPU (seeded), its forward run, and its backward."""

    def __init__(self, name, kern):
        import torch

        from flashsink.kernel_config import LOG2E, NO_WINDOW

        dtype_name, self.n, self.d, window = PROBLEMS[name]
        n, d, dt = self.n, self.d, getattr(torch, dtype_name)
        self.kern = kern
        torch.manual_seed(0)
        self.q = torch.randn(1, H, n, d, device="cuda", dtype=dt)
        self.k = torch.randn(1, HK, n, d, device="cuda", dtype=dt)
        self.v = torch.randn(1, HK, n, d, device="cuda", dtype=dt)
        self.do = torch.randn(1, H, n, d, device="cuda", dtype=dt)
        self.sinks = torch.randn(H, device="cuda", dtype=torch.float32)
        self.scale = 1 / math.sqrt(d)
        self.win = NO_WINDOW if window is None else window
        self.rows = max(128, -(-n // 128) * 128)
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty(1, H, self.rows, dtype=torch.float32, device="cuda")
        self.fwd = lambda: kern("fwd", "fast")(self.q, self.k, self.v, self.sinks, self.win, self.scale * LOG2E,
                                               self.o, self.lse)
        self.fwd()

    def backward(self, prec, main, split=1):
        """dq, dk, dv, dsink of one backward with the main kernel ``main``."""
        import torch

        q, k, v, do, rows, d = self.q, self.k, self.v, self.do, self.rows, self.d
        acc = torch.empty(1, H, rows, d, dtype=torch.float32, device="cuda")  # the preprocess zeroes it
        dlse = torch.zeros(1, H, rows, dtype=torch.float32, device="cuda")
        delta = torch.empty(1, H, rows, dtype=torch.float32, device="cuda")
        dsink = torch.zeros(H, dtype=torch.float32, device="cuda")
        part = torch.empty(1, H, 1, dtype=torch.float32, device="cuda")
        if prec == "fast":
            self.kern("preprocess", prec)(self.o, do, self.lse, dlse, self.sinks, delta, dsink, part, acc)
        else:
            self.kern("preprocess", prec)(q, k, v, do, self.lse, dlse, self.sinks, self.win, self.scale, delta, dsink,
                                          part, acc)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        post = self.kern("postprocess", "fast")
        if split > 1:
            dkv = torch.zeros(2, 1, HK, rows, d, dtype=torch.float32, device="cuda")
            main(q, k, v, do, self.lse, delta, self.win, self.scale, acc, dkv[0], dkv[1])
            post(dkv[0], dk)
            post(dkv[1], dv)
        else:
            main(q, k, v, do, self.lse, delta, self.win, self.scale, acc, dk, dv)
        post(acc, dq)
        return dq, dk, dv, dsink


def _probe_worker(name, jobs, out):
    """Child process: run the fast backward once with each variant of ``jobs`` in turn, putting
    ``(job, "start")`` then ``(job, None | error)`` on ``out``; stops at the first error (a fault
    leaves the CUDA context unusable)."""
    import torch

    dtype_name, _, d, _ = PROBLEMS[name]
    cache = {}

    def kern(kind, prec, tiles=None, opts=None):
        key = (kind, dtype_name, d, prec, tiles, opts)
        if key not in cache:
            cache[key] = _load(key)
        return cache[key]

    prob = _Problem(name, kern)
    for job in jobs:
        out.put((job, "start"))
        try:
            main = kern(job[0], job[3], job[4], job[5])
            prob.backward(job[5][4], main, job[5][2])
            torch.cuda.synchronize()
        except Exception as exc:
            out.put((job, f"{type(exc).__name__}: {str(exc)[-300:]}"))
            return
        out.put((job, None))


def _probe(name, jobs, budget):
    """``{job: None | error}``: each variant of ``jobs`` run once in child processes with a time
    limit, so a variant that faults or hangs (a deadlocked mbarrier) is reported, not fatal.
    ``budget`` (a one-element list) counts the hangs left before the rest are skipped."""
    import queue

    status, pending = {}, list(jobs)
    ctx = mp.get_context("spawn")
    while pending:
        if budget[0] <= 0:
            status.update({j: "skipped: earlier variants hung" for j in pending})
            break
        out = ctx.Queue()
        proc = ctx.Process(target=_probe_worker, args=(name, pending, out))
        proc.start()
        current, limit, waited = pending[0], PROBE_START_S, 0
        while True:
            try:
                job, msg = out.get(timeout=5)
            except queue.Empty:
                waited += 5
                if not proc.is_alive():  # a fault can kill the child before it reports
                    status[current] = f"child process died (exit code {proc.exitcode})"
                    break
                if waited >= limit:
                    status[current] = f"HUNG or too slow: no answer in {limit} s, killed"
                    budget[0] -= 1
                    break
                continue
            if msg == "start":
                current, limit, waited = job, PROBE_TIMEOUT_S, 0
                continue
            status[job] = msg
            if msg is not None or len(status) == len(jobs):
                break
        if proc.is_alive():
            proc.kill()
        proc.join()
        pending = [j for j in pending if j not in status]
    return status


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


def _fa4_rows(row, prob, window, flops_fb):
    """FlashAttention-4's forward and fwd+bwd on the same inputs (its [B, S, H, D] layout, learnable sink,
    eager autograd calls as a user makes them), so a variant is compared with the peer in the same run;
    its backward is the difference. Skipped, with the reason, where ``flash_attn.cute`` does not import."""
    import torch
    from triton.testing import do_bench

    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - any import failure means no FA4 row
        row["kernels"]["FA4"] = f"not importable ({type(exc).__name__}: {exc})"[:200]
        return
    q, k, v, do = (x.transpose(1, 2).contiguous().requires_grad_() for x in (prob.q, prob.k, prob.v, prob.do))
    do = do.detach()
    sinks = prob.sinks.clone().requires_grad_()
    kw = dict(softmax_scale=prob.scale, causal=True, learnable_sink=sinks,
              window_size=(None, None) if window is None else (window - 1, 0))

    def fwd():
        out = flash_attn_func(q, k, v, **kw)
        return out[0] if isinstance(out, (tuple, list)) else out

    def fwd_bwd():
        fwd().backward(do)

    fwd_bwd()  # compiles
    torch.cuda.synchronize()
    with torch.no_grad():
        f_ms = do_bench(fwd, return_mode="median")
    fb_ms = do_bench(fwd_bwd, return_mode="median", grad_to_none=[q, k, v, sinks])
    row["kernels"]["FA4 fwd"] = f_ms
    row["kernels"]["FA4 fwd+bwd"] = fb_ms
    row["kernels"]["FA4 bwd (fwd+bwd - fwd)"] = fb_ms - f_ms
    row["kernels"]["FA4 fwd+bwd TFLOP/s"] = flops_fb / (fb_ms * 1e-3) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="all",
                    help="comma-separated substrings: only the variants whose label contains one (e.g. ws,s3); "
                         "'=label': that label exactly; 'all' (the default): every variant")
    ap.add_argument("--profile-run", action="store_true",
                    help="for ncu: compile and launch only the library's fast kernels, once each, no timing")
    args = ap.parse_args()
    args.variants = _variants_arg(ap, args.variants)
    names = [n for n in args.problems.split(",") if n]

    jobs = []
    for name in names:
        dtype, _, d, _ = PROBLEMS[name]
        for kind in ("fwd", "preprocess", "bwd", "postprocess"):
            for prec in ("fast", "strict") if kind in ("preprocess", "bwd") else ("fast",):
                jobs.append((kind, dtype, d, prec, None, None))
        # --profile-run builds the variants only where --variants names them
        for _, tiles, opts in _variants(d, args.variants) if not args.profile_run or args.variants else ():
            jobs.append(("bwd-variant", dtype, d, "fast", tiles, opts))
        for _, opts in () if args.profile_run else _pre_variants(args.variants):
            jobs.append(("pre-variant", dtype, d, "strict", None, opts))
    jobs = list(dict.fromkeys(jobs))
    kernels, errors = compile_all(jobs, args.jobs)

    import torch
    from triton.testing import do_bench

    budget = [2]
    results = []
    for name in names:
        dtype_name, n, d, window = PROBLEMS[name]

        def kern(kind, prec, tiles=None, opts=None):
            return kernels.get((kind, dtype_name, d, prec, tiles, opts))

        # hand-synchronized variants first run alone in a child: a fault or a hang is reported, not fatal
        hand = [j for j in kernels if j[0] == "bwd-variant" and j[1:3] == (dtype_name, d) and j[5][3]]
        probed = _probe(name, hand, budget) if hand and not args.profile_run else {}
        prob = _Problem(name, kern)
        q, k, v, do, lse, o, sinks = prob.q, prob.k, prob.v, prob.do, prob.lse, prob.o, prob.sinks
        win, scale, rows = prob.win, prob.scale, prob.rows
        pairs = sum(min(i + 1, win) for i in range(n)) * H
        flops_fb = 14 * pairs * d
        row = {"problem": name, "kernels": {}, "errors": {str(j): e for j, e in errors.items() if j[1:3] == (dtype_name, d)}}
        backward = prob.backward

        if args.profile_run:
            # the library's backward, then each named variant's, once: ncu sees the main kernels
            # (flashsink_bwd_kernel) in this order
            torch.cuda.synchronize()
            backward("fast", kern("bwd", "fast"))
            order = ["default*"]
            for label, tiles, opts in _variants(d, args.variants) if args.variants else ():
                main = kern("bwd-variant", "fast", tiles, opts)
                if main is not None:
                    backward(opts[4], main, opts[2])
                    order.append(label)
            torch.cuda.synchronize()
            print(f"{name}: flashsink_bwd_kernel launches, in order: {', '.join(order)}", file=sys.stderr)
            continue
        ref = backward("strict", kern("bwd", "strict"))
        fwd_ms = do_bench(prob.fwd, return_mode="median")
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
        row["kernels"]["preprocess (fast)"] = do_bench(lambda: kern("preprocess", "fast")(o, do, lse, dlse, sinks, delta, dsink, part, acc), return_mode="median")
        row["kernels"]["preprocess (strict)"] = do_bench(lambda: kern("preprocess", "strict")(q, k, v, do, lse, dlse, sinks, win, scale, delta, dsink, part, acc), return_mode="median")
        # the strict preprocess's variants: Delta and dsink against the library's (the mask only selects
        # exact zeros, so a variant that skips it where nothing is masked gives the same bits)
        pre_delta, pre_dsink = delta.clone(), dsink.clone()
        if _pre_variants(args.variants):  # the library's Delta and dsink, once, for every variant to match
            dsink.zero_()
            kern("preprocess", "strict")(q, k, v, do, lse, dlse, sinks, win, scale, delta, dsink, part, acc)
        for label, opts in _pre_variants(args.variants):
            pre = kern("pre-variant", "strict", None, opts)
            if pre is None:
                row["kernels"][label] = "compile failed"
                continue
            delta2, dsink2 = torch.zeros_like(delta), torch.zeros_like(dsink)
            if dict(opts).get("o32"):
                o32 = o.float()
                ins = lambda: (o32, do, lse, dlse, sinks, delta2, dsink2, part, acc)  # noqa: E731
            else:
                ins = lambda: (q, k, v, do, lse, dlse, sinks, win, scale, delta2, dsink2, part, acc)  # noqa: E731
            pre(*ins())
            torch.cuda.synchronize()
            # compared before timing: dsink accumulates (atomics) over the timed calls. Another tile
            # shape sums a row's products in another order, so Delta may differ in its last bits
            same = torch.equal(delta2[..., :n], delta[..., :n])
            delta_err = float((delta2[..., :n] - delta[..., :n]).norm() / delta[..., :n].norm())
            dsink_err = float((dsink2 - dsink).norm() / dsink.norm())
            row["kernels"][label] = do_bench(lambda: pre(*ins()), return_mode="median")
            row["kernels"][f"  {label}: Delta bitwise equal, Delta relL2, dsink relL2"] = (
                f"{same}, {delta_err:.1e}, {dsink_err:.1e}")
        delta.copy_(pre_delta)
        dsink.copy_(pre_dsink)
        row["kernels"]["postprocess"] = do_bench(lambda: kern("postprocess", "fast")(acc, dq), return_mode="median")
        row["kernels"]["zero fill"] = do_bench(lambda: acc.zero_(), return_mode="median")
        row["kernels"]["main (strict)"] = do_bench(lambda: kern("bwd", "strict")(q, k, v, do, lse, delta, win, scale, acc, dk, dv), return_mode="median")
        dkv = torch.zeros(2, 1, HK, rows, d, dtype=torch.float32, device="cuda")
        for label, tiles, opts in [("default*", None, (None, None, 1, False, "fast", None, False, False, False))] + _variants(d, args.variants):
            main = kern("bwd", "fast") if tiles is None else kern("bwd-variant", "fast", tiles, opts)
            if main is None:
                row["kernels"][f"main {label}"] = "compile failed"
                continue
            fault = probed.get(("bwd-variant", dtype_name, d, "fast", tiles, opts))
            if fault:
                row["kernels"][f"main {label}"] = f"RUN FAILED ({fault})"
                continue
            split, prec = opts[2], opts[4]
            got = backward(prec, main, split)
            errs = [float((g.double() - r.double()).norm() / r.double().norm()) for g, r in zip(got, ref)]
            if not all(e <= MAX_REL_L2 for e in errs):  # NaN fails too
                row["kernels"][f"main {label}"] = ("WRONG: relL2 vs strict dq/dk/dv/dsink "
                                                        + " ".join(f"{e:.1e}" for e in errs))
                continue
            outs = (acc, dkv[0], dkv[1]) if split > 1 else (acc, dk, dv)
            ms = do_bench(lambda: main(q, k, v, do, lse, delta, win, scale, *outs), return_mode="median")
            total = do_bench(lambda: backward(prec, main, split), return_mode="median")
            row["kernels"][f"main {label}"] = ms
            row["kernels"][f"  bwd total {label}"] = total
            row["kernels"][f"  fwd+bwd TFLOP/s {label}"] = flops_fb / ((fwd_ms + total) * 1e-3) / 1e12
            row["kernels"][f"  relL2 vs strict dq/dk/dv/dsink {label}"] = " ".join(f"{e:.1e}" for e in errs)
        _fa4_rows(row, prob, window, flops_fb)
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
