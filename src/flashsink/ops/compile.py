"""Building and caching the kernels.

One compiled kernel per (kernel kind, :class:`KernelConfig`); sequence lengths, batch,
window and scale are runtime arguments, so a new length never recompiles. Compilation
only needs nvcc, not a GPU: pass an explicit architecture (``cfg.arch``) and the same
code path builds kernels on a CPU-only machine (CI, precompile).
"""

import logging
import threading
import time

from .config import KernelConfig

log = logging.getLogger("flashsink")

KINDS = ("fwd", "preprocess", "bwd", "dq", "postprocess")

_cache: dict = {}
_lock = threading.Lock()


def _builder(kind: str):
    from . import bwd, fwd

    return {
        "fwd": fwd.build_fwd,
        "preprocess": bwd.build_preprocess,
        "bwd": bwd.build_bwd,
        "dq": bwd.build_dq,
        "postprocess": bwd.build_postprocess,
    }[kind]


def build_prim_func(kind: str, cfg: KernelConfig):
    """The TileLang ``PrimFunc`` of one kernel (lowering input, not compiled)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return _builder(kind)(cfg)


def get_kernel(kind: str, cfg: KernelConfig):
    """The compiled kernel for ``(kind, cfg)``, compiling it on first use."""
    key = (kind, cfg)
    kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _cache.get(key)
        if kernel is None:
            kernel = compile_kernel(kind, cfg)
            _cache[key] = kernel
    return kernel


def compile_kernel(kind: str, cfg: KernelConfig):
    import tilelang

    log.info("flashsink: compiling the %s kernel for %s (first use; cached for this process)", kind, cfg.short())
    start = time.perf_counter()
    kernel = tilelang.compile(
        build_prim_func(kind, cfg),
        target=cfg.target(),
        execution_backend="tvm_ffi",
        # the same for every kernel: exp2/log2 through the fast hardware approximations
        pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True},
    )
    log.info("flashsink: compiled %s for %s in %.1f s", kind, cfg.short(), time.perf_counter() - start)
    return kernel


def cache_size() -> int:
    """Number of kernels compiled in this process (used by the no-recompile test)."""
    return len(_cache)
