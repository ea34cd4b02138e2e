"""Compile many kernels ahead of time, in parallel processes.

TileLang keeps compiled kernels in its on-disk cache (``TILELANG_CACHE_DIR``), so kernels
built here are loaded, not rebuilt, by later processes. Works without a GPU: the
architecture is part of each :class:`KernelConfig`.
"""

import concurrent.futures as cf
import multiprocessing as mp
import os
import sys
import time

from .compile import KINDS, compile_kernel
from .config import KernelConfig


def kinds_for(cfg: KernelConfig) -> tuple:
    """The kernels one configuration needs for forward and backward."""
    return ("fwd", "preprocess", "bwd", "dq") if cfg.deterministic else ("fwd", "preprocess", "bwd", "postprocess")


def _compile_one(job):
    kind, cfg = job
    start = time.perf_counter()
    try:
        compile_kernel(kind, cfg)
    except Exception as exc:  # reported by the parent, which decides what failed
        return kind, cfg, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
    return kind, cfg, time.perf_counter() - start, None


def precompile(configs, *, kinds=None, jobs=None, out=sys.stderr) -> list:
    """Compile every (kind, config) pair; returns the list of failures (empty when all built)."""
    todo = []
    for cfg in dict.fromkeys(configs):
        for kind in kinds or kinds_for(cfg):
            if kind not in KINDS:
                raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
            todo.append((kind, cfg))
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    failures = []
    print(f"precompiling {len(todo)} kernels in {jobs} processes ...", file=out, flush=True)
    start = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        for n, (kind, cfg, secs, err) in enumerate(pool.map(_compile_one, todo), 1):
            status = "ok" if err is None else "FAILED"
            print(f"[{n}/{len(todo)}] {kind:<11} {cfg.short():<60} {secs:6.1f} s {status}", file=out, flush=True)
            if err is not None:
                failures.append((kind, cfg, err))
    print(f"precompile done in {time.perf_counter() - start:.0f} s, {len(failures)} failed", file=out, flush=True)
    for kind, cfg, err in failures:
        print(f"  {kind} {cfg.short()}: {err[-2000:]}", file=out, flush=True)
    return failures
