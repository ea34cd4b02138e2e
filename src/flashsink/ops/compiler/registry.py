"""The in-memory kernel registry: :func:`get_kernel`, one dict lookup per launch once built.

The first miss of a configuration builds every kernel of its route (``kinds.first_use_kinds``):
loaded from the disk cache where they are there, the others compiled at once, the longest through
``compile.compile_kernel`` here (which compiles it in a child process of its own) and the rest in
worker processes (:func:`executor`: TileLang's lowering is Python and holds the GIL), as
``flashsink precompile`` does (:func:`compile_parallel`).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import threading
import time

from ...errors import CompileError
from ...kernel_config import KernelConfig
from . import compile as compile_mod
from . import diskcache, kinds
from .compile import log

_cache: dict = {}
_lock = threading.Lock()  # get_kernel: one compile or load at a time in this process


def get_kernel(kind: str, cfg: KernelConfig):
    """The launcher of the kernel for ``(kind, cfg)``: one dict lookup per launch once built. The
    first miss of a configuration builds every kernel it needs (:func:`_first_use`)."""
    kernel = _cache.get((kind, cfg))
    if kernel is not None:
        return kernel
    return _first_use(kind, cfg)


def _first_use(kind: str, cfg: KernelConfig):
    with _lock:
        if (kind, cfg) not in _cache:
            _build_config(kind, cfg)
    return _cache[(kind, cfg)]


#: worker processes for a first use's parallel build, besides the calling process (None: one per
#: kernel but the longest, which the calling process builds, up to the CPU count less one)
FIRST_USE_JOBS = None


def _build_config(kind: str, cfg: KernelConfig) -> None:
    """``kind`` and the other kernels of its route that ``cfg`` launches (``kinds.first_use_kinds``: the
    forward and backward kernels, or the decode ones): the ones in the disk cache are loaded, the
    others compiled at once into the disk cache, then loaded. A kernel other than ``kind`` that fails
    to build is left out here; its own first launch raises the error.

    Of several missing kernels, the longest to build (``kinds.Kind.build_s``: the forward) is started
    first, by ``compile_kernel`` from this process (its compile runs in a child of its own, so that no
    temporary directory of this process changes), while worker processes (TileLang's lowering holds
    the GIL in its Python parts) build the others, longest first. With fewer workers than kernels,
    this process then builds those no worker has started."""
    wanted = [k for k in kinds.first_use_kinds(kind, cfg) if (k, cfg) not in _cache]
    missing = []
    for k in wanted:
        kernel = _guarded(k, kind, cfg, load_only=True)
        if kernel is not None:
            _cache[(k, cfg)] = _launcher(kernel)
        else:
            missing.append(k)
    if len(missing) > 1:
        start = time.perf_counter()
        first, *rest = kinds.longest_first(missing)
        log.info("flashsink: compiling %d kernels (%s) for %s in parallel: first use of this configuration on "
                 "this machine, so this call is slow (~10-20 s); they are then cached in %s",
                 len(missing), " ".join(missing), cfg.short(), diskcache.ensure_cache_dir())
        jobs = FIRST_USE_JOBS or max(1, min(len(rest), (os.cpu_count() or 1) - 1))
        with executor(jobs) as pool:
            # submitted first: the workers start (interpreter, imports) while this process compiles
            futures = [pool.submit(compile_one, (k, cfg)) for k in rest]
            t = time.perf_counter()
            kernel = _guarded(first, kind, cfg)  # a failure of ``kind`` raises once the workers are done
            log.debug("flashsink: %s for %s: compiled in this process in %.1f s", first, cfg.short(),
                      time.perf_counter() - t)
            if kernel is not None:
                _cache[(first, cfg)] = _launcher(kernel)
            # fewer workers than kernels (a small machine): this process takes the longest of those no
            # worker has started yet (a future not yet handed to a worker can still be cancelled)
            for k, future in zip(rest, futures):
                if future.cancel():
                    kernel = _guarded(k, kind, cfg)
                    if kernel is not None:
                        _cache[(k, cfg)] = _launcher(kernel)
            for future in (f for f in futures if not f.cancelled()):
                k, _, seconds, how, err = future.result()
                log.debug("flashsink: %s for %s: %s in %.1f s%s", k, cfg.short(), how, seconds,
                          f" ({err})" if err else "")
        log.info("flashsink: compiled %d kernels for %s in %.1f s", len(missing), cfg.short(),
                 time.perf_counter() - start)
        missing = [k for k in rest if (k, cfg) not in _cache]
    for k in missing:  # loaded from the disk cache now (or compiled here: one kernel, or a failed worker)
        kernel = _guarded(k, kind, cfg)
        if kernel is not None:
            _cache[(k, cfg)] = _launcher(kernel)


def _guarded(k: str, kind: str, cfg: KernelConfig, *, load_only: bool = False):
    """compile_kernel; errors of kernels other than the one asked for are logged, not raised."""
    try:
        return compile_mod.compile_kernel(k, cfg, load_only=load_only)
    except CompileError as exc:
        if k == kind:
            raise
        log.debug("flashsink: building %s for %s failed (raised when it is launched): %s", k, cfg.short(), exc)
        return None


def _launcher(kernel):
    """What a launch calls: TileLang's tvm_ffi executable itself when the kernel allocates no outputs
    (ours never do), skipping the adapter's per-call argument stitching (microseconds per launch),
    and of that executable (a tvm_ffi Module) its entry function, found once.
    ``get_exportable_executable`` is the executable the adapter calls (tests/test_tilelang_api.py)."""
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "get_exportable_executable", None)
    if get is None or getattr(adapter, "result_idx", None):
        return kernel
    try:
        executable = get()
    except Exception:  # another TileLang version: the kernel's own call
        return kernel
    # its entry function itself: Module.__call__ is a Python frame that looks it up per call
    entry = getattr(executable, "entry_name", None)
    if entry is not None:
        try:
            return executable.get_function(entry)
        except Exception:  # noqa: BLE001  (a module without one: its own call)
            pass
    return executable


def cache_size() -> int:
    """Number of kernels compiled in this process (used by the no-recompile test)."""
    return len(_cache)


# ----------------------------------------------------------------------------------------------
# many kernels at once, in worker processes

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
