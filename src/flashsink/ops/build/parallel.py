"""Many kernels at once, in worker processes (TileLang's lowering is Python and holds the GIL): a
first use's parallel build (``registry._build_config``) and ``flashsink precompile`` (precompile.py).

Each worker runs ``compile.compile_kernel`` into the disk cache; the parent loads what they built.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time

from . import compile as compile_mod


def _init_worker():
    compile_mod.enter_compile_process()  # compiles run here; the parent prints the progress


def compile_one(job):
    """Returns (kind, cfg, seconds, "compiled" | "cached" | "rebuilt", error text or None)."""
    kind, cfg = job
    start = time.perf_counter()
    before = dict(compile_mod.counts)
    try:
        compile_mod.compile_kernel(kind, cfg)
    except Exception as exc:  # reported by the parent, which decides what failed
        return kind, cfg, time.perf_counter() - start, "failed", f"{type(exc).__name__}: {exc}"
    done = {k: v - before.get(k, 0) for k, v in compile_mod.counts.items()}
    how = "rebuilt" if done.get("rebuilt") else "compiled" if done.get("compiled") else "cached"
    return kind, cfg, time.perf_counter() - start, how, None


def executor(jobs: int):
    """Worker processes (spawned: no CUDA state or locks inherited)."""
    return cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker)


def compile_parallel(todo, *, jobs=None):
    """Compile (kind, config) pairs in worker processes into the disk cache; yields
    ``(kind, cfg, seconds, how, error)`` per pair as soon as it finishes (in the order they finish, not
    ``todo``'s: a fast kernel is reported while a slow one submitted before it still builds)."""
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    with executor(jobs) as pool:
        futures = [pool.submit(compile_one, job) for job in todo]
        for future in cf.as_completed(futures):
            yield future.result()
