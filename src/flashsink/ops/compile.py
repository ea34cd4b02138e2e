"""Building and caching the kernels.

One compiled kernel per (kernel kind, :class:`KernelConfig`); sequence lengths, batch,
window and scale are runtime arguments, so a new length never recompiles. Compilation
only needs nvcc, not a GPU: pass an explicit architecture (``cfg.arch``) and the same
code path builds kernels on a CPU-only machine (CI, precompile).

Three levels, in order:

1. this process's dict (``get_kernel``);
2. flashsink's disk cache (``diskcache.py``: ``FLASHSINK_CACHE_DIR``, private, verified entries,
   one compile per key across processes);
3. TileLang's compiler, called through ``JITKernel`` directly. TileLang's own disk cache
   (``~/.tilelang/cache``) is deliberately bypassed: it loads entries it has not checked for
   owner or permissions, and flashsink kernels must only ever be loaded from verified entries.

A failed compile raises :class:`flashsink.CompileError`; transient failures (a killed compiler,
a full disk, no memory) are retried ``COMPILE_RETRIES`` times first.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import errno
import functools
import hashlib
import logging
import multiprocessing as mp
import os
import platform
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from ..errors import CompileError, tail
from . import diskcache, kinds
from .config import KernelConfig

log = logging.getLogger("flashsink")

KINDS = tuple(kinds.KINDS)  # the registry: kinds.py

#: extra attempts after a transient failure (so at most 1 + COMPILE_RETRIES compiles)
COMPILE_RETRIES = 2
RETRY_DELAY_S = 1.0
EXECUTION_BACKEND = "tvm_ffi"

_cache: dict = {}
_lock = threading.Lock()  # get_kernel: one compile or load at a time in this process
_compile_lock = threading.RLock()  # compile_kernel: private_tmp swaps the process's temp dir

#: what compile_kernel did in this process: "compiled", "disk" (loaded a verified entry),
#: "rebuilt" (an entry failed verification and was replaced). Read by tests and precompile.
counts: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------------------------
# logging: FLASHSINK_LOG

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}
_logging_done = False


def configure_logging() -> None:
    """Apply ``FLASHSINK_LOG`` (debug, info, warning, error, off) to the "flashsink" logger, once
    per process. Without it the level is info, unless the application set the logger's level
    itself. When the application has not configured logging (no handler on the root logger), a
    stderr handler is added so the lines are seen."""
    global _logging_done
    if _logging_done:
        return
    _logging_done = True
    given = os.environ.get("FLASHSINK_LOG", "").strip().lower()
    level = _LEVELS.get(given) if given else None
    if given and level is None:
        log.warning("flashsink: FLASHSINK_LOG=%r is not one of %s; using info", given, ", ".join(_LEVELS))
        level = logging.INFO
    if level is not None:
        log.setLevel(level)
    elif log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


# ----------------------------------------------------------------------------------------------
# what a kernel is: its PrimFunc, its compile arguments, its cache key

def build_prim_func(kind: str, cfg: KernelConfig):
    """The TileLang ``PrimFunc`` of one kernel (lowering input, not compiled)."""
    return kinds.check_kind(kind).build(cfg)


def pass_configs() -> dict:
    """Pass configs for every kernel: exp2/log2 through the fast hardware approximations."""
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@dataclasses.dataclass
class _CompileArgs:
    out_idx: list | None
    pass_configs: dict
    compile_flags: list | None


def _compile_args(func) -> _CompileArgs:
    """What ``tilelang.compile`` would pass to ``JITKernel``: function-level attrs merged with ours."""
    attrs = func.attrs
    has = (lambda name: attrs is not None and name in attrs)  # noqa: E731
    out_idx = [int(i) for i in attrs["tilelang_out_idx"]] if has("tilelang_out_idx") else None
    configs = dict(attrs["tilelang_pass_configs"]) if has("tilelang_pass_configs") else {}
    configs.update(pass_configs())
    flags = [str(f) for f in attrs["tilelang_compile_flags"]] if has("tilelang_compile_flags") else None
    return _CompileArgs(out_idx, configs, flags)


@functools.cache
def _nvcc_version() -> str:
    try:
        from tilelang.contrib.nvcc import get_nvcc_compiler

        nvcc = get_nvcc_compiler()
    except Exception:  # no CUDA toolkit found
        return "none"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


@functools.cache
def versions() -> dict:
    """Everything outside the kernel's own code that changes the compiled binary."""
    import tilelang
    import tvm_ffi

    from .._version import __version__

    return {
        "flashsink": __version__,
        "tilelang": tilelang.__version__,
        "tvm_ffi": getattr(tvm_ffi, "__version__", "?"),
        "nvcc": _nvcc_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def _tiles(kind: str, cfg) -> dict:
    """The tile choice kind ``kind`` makes for ``cfg`` (its tile function, by name; none for a kind of fixed
    blocks). Only its own: the TIR's hash already covers every size the kernel was built with, and a key
    that held every kind's choice (as until v20) made any change to one tile function a new key for
    every kernel, so every cached kernel and CPU-built bundle had to be compiled again."""
    fn = kinds.check_kind(kind).tiles
    if fn is None:
        return {}
    try:
        return {fn.__name__: dataclasses.asdict(fn(cfg))}
    except Exception as exc:  # a table that does not cover this config
        return {fn.__name__: f"n/a ({type(exc).__name__})"}


def cache_key(kind: str, cfg, func, args: _CompileArgs) -> dict:
    """The disk-cache key: the static configuration, the tiles, the kernel's TIR (so an edit to a
    kernel's code is a new key even at the same version), compile arguments and versions."""
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg)
    return {
        "kind": kind,
        "config_type": type(cfg).__qualname__,
        "config": config,
        "tiles": _tiles(kind, cfg),
        "tir_sha256": hashlib.sha256(func.script(show_meta=True).encode()).hexdigest(),
        "target": cfg.target(),
        "execution_backend": EXECUTION_BACKEND,
        "out_idx": args.out_idx,
        "pass_configs": {str(k): repr(v) for k, v in sorted(args.pass_configs.items(), key=lambda kv: str(kv[0]))},
        "compile_flags": args.compile_flags,
        "versions": versions(),
    }


# ----------------------------------------------------------------------------------------------
# compile, with retries

_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EMFILE,
                     errno.ENFILE, errno.ETXTBSY}
_TRANSIENT_TEXT = ("No space left on device", "Disk quota exceeded", "Cannot allocate memory", "out of memory",
                   "Resource temporarily unavailable", "Too many open files", "died due to signal",
                   "Killed", "killed", "timed out")


def _compiler_output(exc: BaseException) -> str:
    """The exception text without the CUDA source TileLang puts in front of nvcc's output."""
    text = str(exc)
    marker = "Compilation error:"
    return text[text.rfind(marker):] if marker in text else text


def is_transient(exc: BaseException) -> bool:
    """Failures worth another try: the compiler was killed or timed out, or the machine ran out
    of disk, memory or file handles. Errors in the kernel or the compiler's verdict are not."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (MemoryError, subprocess.TimeoutExpired)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        if any(t in _compiler_output(exc) for t in _TRANSIENT_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _error_text(exc: BaseException) -> str:
    if "Compilation error:" in str(exc):  # nvcc's verdict: its output is what matters
        return tail(_compiler_output(exc))
    # a lowering or front-end error: the message and where it was raised
    return tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4)))


def _jit(func, cfg, args: _CompileArgs):
    """One TileLang compile (lowering + nvcc + host library), not through TileLang's cache."""
    from tilelang.jit import JITKernel

    return JITKernel(
        func, out_idx=args.out_idx, execution_backend=EXECUTION_BACKEND, target=cfg.target(),
        pass_configs=args.pass_configs, compile_flags=args.compile_flags,
    )


_ELECT = re.compile(r"tl_shuffle_elect<(\d+)>")


def narrow_elections(source: str) -> list[int]:
    """The lane elections in a kernel's CUDA source that run under fewer threads than a warp:
    TileLang issues a bulk copy (TMA) or barrier setup from one lane it picks with
    ``tl::tl_shuffle_elect<extent>``, ``elect.sync`` over the full warp, where ``extent`` is the number
    of threads of the branch around it. Under a branch of fewer than 32 threads (``if tx == ...``
    around a ``T.tma_copy``) the elected lane waits at ``elect.sync`` for lanes that never come: the
    kernel hangs (the H200 showed it, docs/perf.md v18). 0 means the whole block and is fine."""
    return sorted({int(n) for n in _ELECT.findall(source) if 0 < int(n) < 32})


def check_source(source: str) -> None:
    """Raise ``RuntimeError`` if ``source`` (a kernel's CUDA) would hang: :func:`narrow_elections`."""
    narrow = narrow_elections(source)
    if narrow:
        raise RuntimeError(
            f"the kernel elects a lane under a branch of {narrow} thread(s), fewer than a warp: elect.sync "
            f"would wait for the warp's other lanes and hang. Issue its bulk copies (T.tma_copy) from a "
            f"branch of whole warps (the copy elects one lane itself)")


def _compile_with_retries(kind: str, cfg, func, args: _CompileArgs, root: Path):
    attempt = 0
    while True:
        attempt += 1
        try:
            with diskcache.private_tmp(root):
                kernel = _jit(func, cfg, args)
            check_source(kernel.get_kernel_source() or "")
            return kernel
        except Exception as exc:
            if attempt <= COMPILE_RETRIES and is_transient(exc):
                log.warning(
                    "flashsink: compiling %s for %s failed with a transient error (%s); retry %d of %d",
                    kind, cfg.short(), tail(_compiler_output(exc), 300).replace("\n", " "), attempt, COMPILE_RETRIES,
                )
                time.sleep(RETRY_DELAY_S * attempt)
                continue
            raise CompileError(kind, cfg, cfg.target(), _error_text(exc), attempts=attempt) from exc


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


def _load_kernel(files: dict, func, cfg, args: _CompileArgs, root: Path):
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
    configure_logging()
    root = diskcache.ensure_cache_dir()
    kinds.check_kind(kind)
    cfg = kinds.canonical(kind, cfg)  # one build for the fields the kernel does not read
    try:
        func = build_prim_func(kind, cfg)
    except Exception as exc:  # the kernel's TileLang code failed for this configuration
        raise CompileError(kind, cfg, cfg.target(), _error_text(exc)) from exc
    args = _compile_args(func)
    key = cache_key(kind, cfg, func, args)
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
        kernel = _compile_with_retries(kind, cfg, func, args, root)
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


def _reload(kernel, root: Path, name: str, key: dict, func, cfg, args: _CompileArgs):
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


def get_kernel(kind: str, cfg: KernelConfig):
    """The launcher of the kernel for ``(kind, cfg)``: one dict lookup per launch once built. The
    first miss of a configuration builds every kernel it needs (:func:`_first_use`)."""
    kernel = _cache.get((kind, cfg))
    if kernel is not None:
        return kernel
    return _first_use(kind, cfg)


def _first_use(kind: str, cfg: KernelConfig):
    record = os.environ.get("FLASHSINK_RECORD_KERNELS")
    if record:
        _record_and_stop(record, kind, cfg)
    with _lock:
        if (kind, cfg) not in _cache:
            _build_config(kind, cfg)
    return _cache[(kind, cfg)]


# ----------------------------------------------------------------------------------------------
# Many kernels at once, in worker processes (TileLang's lowering is Python and holds the GIL): a
# first use (below) and `flashsink precompile` (precompile.py)


def _init_worker():
    # the parent prints one progress line per kernel; workers only say what goes wrong
    os.environ.setdefault("FLASHSINK_LOG", "warning")


def _compile_one(job):
    """Returns (kind, cfg, seconds, "compiled" | "cached" | "rebuilt", error text or None)."""
    kind, cfg = job
    start = time.perf_counter()
    before = dict(counts)
    try:
        compile_kernel(kind, cfg)
    except Exception as exc:  # reported by the parent, which decides what failed
        return kind, cfg, time.perf_counter() - start, "failed", f"{type(exc).__name__}: {exc}"
    done = {k: v - before.get(k, 0) for k, v in counts.items()}
    how = "rebuilt" if done.get("rebuilt") else "compiled" if done.get("compiled") else "cached"
    return kind, cfg, time.perf_counter() - start, how, None


def _executor(jobs: int):
    """Worker processes (spawned: no CUDA state or locks inherited)."""
    return cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker)


def compile_parallel(todo, *, jobs=None):
    """Compile (kind, config) pairs in worker processes into the disk cache; yields
    ``(kind, cfg, seconds, how, error)`` per pair as each finishes, in ``todo``'s order."""
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    with _executor(jobs) as pool:
        yield from pool.map(_compile_one, todo)


#: worker processes for a first use's parallel build, besides the calling process (None: one per
#: kernel but the longest, which the calling process builds, up to the CPU count less one)
FIRST_USE_JOBS = None


def _build_config(kind: str, cfg: KernelConfig) -> None:
    """``kind`` and the other kernels of its route that ``cfg`` launches (``kinds.first_use_kinds``: the
    forward and backward kernels, or the decode ones): the ones in the disk cache are loaded, the
    others compiled at once into the disk cache, then loaded. A kernel other than ``kind`` that fails
    to build is left out here; its own first launch raises the error.

    Of several missing kernels, the longest to build (``kinds.Kind.build_s``: the forward) is compiled
    in this process, which has its imports done, while worker processes (TileLang's lowering holds
    the GIL in its Python parts) build the others, longest first: a spawned worker spends ~3.5 s on
    its interpreter and imports before its first kernel, and that is then off the first use's
    critical path (docs/perf.md, "First use: where the compile time goes"). With fewer workers than
    kernels, this process then builds those no worker has started."""
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
        with _executor(jobs) as pool:
            # submitted first: the workers start (interpreter, imports) while this process compiles
            futures = [pool.submit(_compile_one, (k, cfg)) for k in rest]
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
        return compile_kernel(k, cfg, load_only=load_only)
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


class KernelRecorded(RuntimeError):
    """Raised instead of compiling when ``FLASHSINK_RECORD_KERNELS`` is set (see below)."""


def _record_and_stop(path: str, kind: str, cfg: KernelConfig) -> None:
    """Test-suite tooling: append the configuration a call needs to ``path`` (one JSON object per
    line) and stop the call. ``tools/gpu_suite.sh`` runs tests once this way to learn which
    kernels they need, precompiles those in parallel, then runs the tests for real."""
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, **dataclasses.asdict(cfg)}) + "\n")
    raise KernelRecorded(f"FLASHSINK_RECORD_KERNELS: recorded {kind} {cfg.short()}")


def cache_size() -> int:
    """Number of kernels compiled in this process (used by the no-recompile test)."""
    return len(_cache)
