"""Compiling a kernel through the disk cache: :func:`compile_kernel`.

One compiled kernel per (kernel kind, :class:`KernelConfig`); sequence lengths, batch,
window and scale are runtime arguments, so a new length never recompiles. Compilation
only needs nvcc, not a GPU: pass an explicit architecture (``cfg.arch``) and the same
code path builds kernels on a CPU-only machine (CI, precompile).

Three levels, in order:

1. this process's dict (``registry.get_kernel``);
2. flashsink's disk cache (``diskcache.py``: ``FLASHSINK_CACHE_DIR``, private, verified entries,
   one compile per key across processes): this module saves kernels to it and loads them from it;
3. TileLang's compiler, called through ``JITKernel`` directly (``lowering.jit``, with the retries of
   ``retry.py``). TileLang's own disk cache (``~/.tilelang/cache``) is deliberately bypassed: it loads
   entries it has not checked for owner or permissions, and flashsink kernels must only ever be
   loaded from verified entries.

The key a kernel is stored under is ``keys.cache_key``. A failed compile raises
:class:`flashsink.CompileError`; transient failures (a killed compiler, a full disk, no memory)
are retried ``retry.COMPILE_RETRIES`` times first.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from pathlib import Path

from ...errors import CompileError
from . import diskcache, keys, kinds, logs, retry
from .config import KernelConfig
from .keys import EXECUTION_BACKEND, CompileArgs
from .logs import log

_compile_lock = threading.RLock()  # compile_kernel: private_tmp swaps the process's temp dir

#: what compile_kernel did in this process: "compiled", "disk" (loaded a verified entry),
#: "rebuilt" (an entry failed verification and was replaced). Read by tests and precompile.
counts: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------------------------
# saving and loading through the disk cache (TileLang's tvm_ffi serialization, our verification)

_SO = "executable.so"
_DEVICE = "device_kernel.cu"
_HOST = "host_kernel.cu"
_PARAMS = "params.json"


def _write_kernel(kernel, d: Path) -> None:
    """The files TileLang's own tvm_ffi cache writes, exported as it exports them on Linux: with no
    extra keywords (its cache adds some only for Windows' and macOS' linkers). tests/test_tilelang_api.py
    fails if a TileLang upgrade changes that, so this needs none of TileLang's private names."""
    from tilelang.engine.param import dump_kernel_params

    (d / _DEVICE).write_text(kernel.kernel_source or "")
    (d / _HOST).write_text(kernel.adapter.get_host_source() or "")
    (d / _PARAMS).write_text(dump_kernel_params(kernel.params))
    kernel.adapter.get_exportable_executable().export_library(str(d / _SO))


def _load_kernel(files: dict, func, cfg, args: CompileArgs, root: Path):
    """A kernel from an entry's verified bytes: the library is loaded from a private copy of
    exactly the bytes that were hashed (removed once loaded)."""
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource

    with diskcache.scratch(root, "load") as d:
        so_path = str(d / _SO)
        with open(so_path, "xb") as f:
            f.write(files[_SO])
        return JITKernel.from_database(
            func=func,
            host_kernel_source=CachedTextSource(text=files[_HOST].decode()),
            device_kernel_source=CachedTextSource(text=files[_DEVICE].decode()),
            kernel_lib_path=so_path,
            params=load_kernel_params(files[_PARAMS].decode()),
            target=cfg.target(),
            target_host=None,
            out_idx=args.out_idx,
            execution_backend=EXECUTION_BACKEND,
            pass_configs=args.pass_configs,
            compile_flags=args.compile_flags,
        )


def compile_kernel(kind: str, cfg: KernelConfig, *, load_only: bool = False):
    """The kernel for ``(kind, cfg)``: loaded from the disk cache when a verified entry exists,
    compiled (and saved) otherwise (``load_only``: None then). Raises :class:`flashsink.CompileError`
    if it cannot be built and :class:`flashsink.errors.CacheDirError` if the cache directory is unsafe."""
    logs.configure_logging()
    root = diskcache.ensure_cache_dir()
    kinds.check_kind(kind)
    cfg = kinds.canonical(kind, cfg)  # one build for the fields the kernel does not read
    try:
        func = keys.build_prim_func(kind, cfg)
    except Exception as exc:  # the kernel's TileLang code failed for this configuration
        raise CompileError(kind, cfg, cfg.target(), retry.error_text(exc)) from exc
    args = keys.compile_args(func)
    key = keys.cache_key(kind, cfg, func, args)
    name = diskcache.entry_name(kind, key)
    with _compile_lock, diskcache.key_lock(root, name):
        entry_existed = (root / "kernels" / name).exists()
        start = time.perf_counter()
        hit = diskcache.load(root, name, key)
        if hit is not None:
            try:
                kernel = _load_kernel(hit[1], func, cfg, args, root)
            except Exception as exc:  # e.g. written by an incompatible runtime: rebuild it
                log.warning("flashsink: could not load cache entry %s (%s: %s); rebuilding it",
                            root / "kernels" / name, type(exc).__name__, exc)
                diskcache.discard(root, root / "kernels" / name)
            else:
                counts["disk"] += 1
                log.debug("flashsink: loaded the %s kernel for %s from the disk cache %s in %.2f s",
                          kind, cfg.short(), root / "kernels" / name, time.perf_counter() - start)
                return kernel
        if load_only:
            return None
        log.info(
            "flashsink: compiling the %s kernel for %s (first use of this configuration on this machine, "
            "so this call is slow: ~10-60 s); it is then cached in %s",
            kind, cfg.short(), root,
        )
        kernel = retry.compile_with_retries(kind, cfg, func, args, root)
        seconds = time.perf_counter() - start
        counts["rebuilt" if entry_existed else "compiled"] += 1
        try:
            with diskcache.private_tmp(root):
                diskcache.store(root, name, key, functools.partial(_write_kernel, kernel), kind=kind,
                                summary=f"{kind} {cfg.short()}", extra={"compile_seconds": round(seconds, 1)})
        except Exception as exc:  # the kernel works; only the cache is missing it
            log.warning("flashsink: compiled %s for %s but could not save it to the disk cache %s: %s: %s",
                        kind, cfg.short(), root, type(exc).__name__, exc)
        else:
            kernel = _reload(kernel, root, name, key, func, cfg, args)
        log.debug("flashsink: compiled %s for %s in %.1f s", kind, cfg.short(), seconds)
        return kernel


def _reload(kernel, root: Path, name: str, key: dict, func, cfg, args: CompileArgs):
    """The kernel just stored, loaded back from its verified entry (milliseconds). The compiled one's
    host code is C source that TileLang links into a library (g++, 0.3-0.7 s) at its first call, the
    same link the store has just done; the loaded one is that library, already linked. Falls back to
    the compiled kernel if the entry cannot be read back."""
    try:
        hit = diskcache.load(root, name, key)
        if hit is not None:
            return _load_kernel(hit[1], func, cfg, args, root)
    except Exception as exc:  # noqa: BLE001  (the compiled kernel still works)
        log.debug("flashsink: could not load %s back from the disk cache (%s: %s); using the compiled kernel",
                  name, type(exc).__name__, exc)
    return kernel
