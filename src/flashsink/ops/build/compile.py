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

A compile never runs in the caller's process: the compiler's scratch files go to a private directory
of the cache (``diskcache.private_tmp``), which takes the process's temporary directory and ``TMPDIR``
for its duration, and that must not happen under another thread of the user's program. So
:func:`compile_kernel` hands the compile to a fresh interpreter (:func:`_run_compile_child`), which
compiles, stores the entry and exits; the caller loads the entry. flashsink's own worker processes
(``parallel.py``) call :func:`enter_compile_process` and compile in place.
"""

from __future__ import annotations

import collections
import functools
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from ...errors import CacheDirError, CompileError
from . import diskcache, keys, kinds, logs, retry
from ...kernel_config import KernelConfig
from .keys import EXECUTION_BACKEND, CompileArgs
from .logs import log

_compile_process = False  # enter_compile_process(): this process is one of flashsink's compile processes

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
    with diskcache.key_lock(root, name):
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
        job = (kind, cfg, func, args, root, name, key)  # the key's lock stays held here for the child
        if _compile_process:
            kernel, unsaved = _compile_and_store(job)
            if unsaved is None:
                kernel = _reload(kernel, root, name, key, func, cfg, args)
        else:
            # the child rebuilds the PrimFunc from (kind, cfg): a pickled one loses its layout annotations
            # (TileLang then cannot evaluate them: "the forward map must be injective")
            handed = _run_compile_child((kind, cfg, None, args, root, name, key))
            unsaved = handed and handed[0]
            kernel = _load_compiled(job, handed and handed[1])
        counts["rebuilt" if entry_existed else "compiled"] += 1
        if unsaved:  # the kernel works; only the cache is missing it
            log.warning("flashsink: compiled %s for %s but could not save it to the disk cache %s: %s",
                        kind, cfg.short(), root, unsaved)
        log.debug("flashsink: compiled %s for %s in %.1f s", kind, cfg.short(), time.perf_counter() - start)
        return kernel


def enter_compile_process() -> None:
    """Make this process one of flashsink's compile processes (the child below, ``parallel.py``'s workers):
    :func:`compile_kernel` compiles in it, pointing its temporary directory at the cache's (nothing else
    runs in such a process); its log shows warnings only unless ``FLASHSINK_LOG`` says otherwise (the
    process that started it prints the progress)."""
    global _compile_process
    _compile_process = True
    os.environ.setdefault("FLASHSINK_LOG", "warning")


def _compile_and_store(job) -> tuple:
    """In a compile process: compile ``job`` (retries), then store its entry. Returns (kernel, None), or
    (kernel, why) if the entry could not be stored."""
    kind, cfg, func, args, root, name, key = job
    start = time.perf_counter()
    kernel = retry.compile_with_retries(kind, cfg, func, args, root)
    seconds = time.perf_counter() - start
    try:
        with diskcache.private_tmp(root):
            diskcache.store(root, name, key, functools.partial(_write_kernel, kernel), kind=kind,
                            summary=f"{kind} {cfg.short()}", extra={"compile_seconds": round(seconds, 1)})
    except Exception as exc:  # noqa: BLE001  (the caller says so and still gets the kernel)
        return kernel, f"{type(exc).__name__}: {exc}"
    return kernel, None


def _child_build(job) -> tuple | None:
    """What the compile child runs: :func:`_compile_and_store`, its PrimFunc built here from (kind, cfg) and
    checked against the caller's key (the same code: the same kernel). Returns None once the entry is
    stored, else (why, {file name: bytes}): the kernel's files, for the caller to load."""
    kind, cfg, _, args, root, name, key = job
    diskcache.ensure_cache_dir(root)
    try:
        func = keys.build_prim_func(kind, cfg)
    except Exception as exc:  # noqa: BLE001  (the kernel's TileLang code failed here)
        raise CompileError(kind, cfg, cfg.target(), retry.error_text(exc)) from exc
    if keys.cache_key(kind, cfg, func, args) != key:
        raise CompileError(kind, cfg, cfg.target(), "the compile process built another kernel than the caller "
                           "keyed (its flashsink or TileLang differs from the caller's)")
    job = (kind, cfg, func, args, root, name, key)
    kernel, unsaved = _compile_and_store(job)
    if unsaved is None:
        return None
    with diskcache.private_tmp(job[4]) as d:
        _write_kernel(kernel, d)
        return unsaved, {p.name: p.read_bytes() for p in d.iterdir() if p.name != diskcache.TMP_MARKER}


# A fresh interpreter with this process's sys.path reads (the function, the job) pickled from its stdin
# and writes (status, result) pickled to its stdout, which is a copy of fd 1 taken before fd 1 is pointed
# at stderr: what the compiler prints cannot mix into the result. Not multiprocessing's spawn, which
# would run the top of the user's main script again in the child.
_CHILD_MAIN = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
               "from flashsink.ops.build.compile import _child_main; _child_main()")


def _child_main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    enter_compile_process()
    try:
        import tilelang  # noqa: F401  (before the job's pickled TileLang objects, its pass configs)

        fn, job = pickle.load(sys.stdin.buffer)
        result = ("ok", fn(job))
    except BaseException as exc:  # noqa: BLE001  (handed to the caller, which raises it)
        result = ("error", exc)
    try:
        blob = pickle.dumps(result)
    except Exception:  # noqa: BLE001  (an exception that does not pickle: its text)
        blob = pickle.dumps(("error", RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
    out.write(blob)
    out.close()


def _run_compile_child(job) -> tuple | None:
    """:func:`_child_build` of ``job`` in a fresh interpreter; returns its result, raises its error (a
    :class:`flashsink.CompileError`; anything else becomes one). The child's temporary directory and
    environment are its own: this process's stay as they are (no thread of it sees them change)."""
    kind, cfg = job[0], job[1]
    payload = pickle.dumps(list(sys.path)) + pickle.dumps((_child_build, job))
    env = {**os.environ, "FLASHSINK_LOG": os.environ.get("FLASHSINK_LOG", "warning")}
    proc = subprocess.run([sys.executable, "-c", _CHILD_MAIN], input=payload, stdout=subprocess.PIPE, env=env)
    try:
        status, value = pickle.loads(proc.stdout)
    except Exception:  # noqa: BLE001  (killed, or died before it could answer)
        raise CompileError(kind, cfg, cfg.target(), f"the compile process ended with exit status "
                           f"{proc.returncode} and no result (its output is above, on stderr)") from None
    if status == "ok":
        return value
    if isinstance(value, (CompileError, CacheDirError)):
        raise value
    raise CompileError(kind, cfg, cfg.target(), f"{type(value).__name__}: {value}") from value


def _load_compiled(job, files: dict | None):
    """The kernel the compile child just built: loaded from its verified entry, or (it could not be
    stored) from the files it handed back."""
    kind, cfg, func, args, root, name, key = job
    try:
        if files is None:
            hit = diskcache.load(root, name, key)
            if hit is None:
                raise RuntimeError(f"the entry {root / 'kernels' / name} it stored is missing")
            files = hit[1]
        return _load_kernel(files, func, cfg, args, root)
    except CacheDirError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CompileError(kind, cfg, cfg.target(), f"compiled, but loading the result failed: "
                           f"{type(exc).__name__}: {exc}") from exc


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
