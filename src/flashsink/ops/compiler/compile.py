"""Compiling one kernel through the disk cache: :func:`compile_kernel`.

One kernel per (kind, ``KernelConfig``): lengths, batch, window and scale are runtime arguments. The
levels are ``registry``'s dict, flashsink's verified disk cache (``diskcache``) under :func:`cache_key`,
and TileLang's compiler through ``JITKernel`` (:func:`jit`), never TileLang's own disk cache, which
loads files nobody checked. nvcc is needed, a GPU is not (``cfg.arch`` is the target).

A compile points the process's temporary directory at the cache's (``diskcache.private_tmp``), which
must not happen under another thread of the user's program: :func:`compile_kernel` runs it in a fresh
interpreter (:func:`_run_compile_child`); ``registry``'s worker processes compile in place.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import hashlib
import logging
import os
import pickle
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from ...errors import CacheDirError, CompileError, tail
from ...kernel_config import KernelConfig
from . import diskcache, kinds

log = logging.getLogger("flashsink")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}
_logging_done = False


def configure_logging() -> None:
    """Apply ``FLASHSINK_LOG`` to the "flashsink" logger once per process; without it info, unless the
    application set the level. A stderr handler only where the application configured no logging."""
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
# a kernel: its PrimFunc, compile arguments and disk-cache key

EXECUTION_BACKEND = "tvm_ffi"


def build_prim_func(kind: str, cfg: KernelConfig):
    """The TileLang ``PrimFunc`` of one kernel (lowering input, not compiled)."""
    return kinds.builder(kind)(cfg)


def pass_configs() -> dict:
    """Every kernel's pass configs: exp2/log2 through the fast hardware approximations."""
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@dataclasses.dataclass
class CompileArgs:
    out_idx: list | None
    pass_configs: dict
    compile_flags: list | None


def compile_args(func) -> CompileArgs:
    """What ``tilelang.compile`` would pass to ``JITKernel``: the function's attrs merged with ours."""
    attrs = func.attrs
    has = (lambda name: attrs is not None and name in attrs)  # noqa: E731
    out_idx = [int(i) for i in attrs["tilelang_out_idx"]] if has("tilelang_out_idx") else None
    configs = dict(attrs["tilelang_pass_configs"]) if has("tilelang_pass_configs") else {}
    configs.update(pass_configs())
    flags = [str(f) for f in attrs["tilelang_compile_flags"]] if has("tilelang_compile_flags") else None
    return CompileArgs(out_idx, configs, flags)


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

    from ..._version import __version__

    return {
        "flashsink": __version__,
        "tilelang": tilelang.__version__,
        "tvm_ffi": getattr(tvm_ffi, "__version__", "?"),
        "nvcc": _nvcc_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def _tiles(kind: str, cfg) -> dict:
    """Kind ``kind``'s own tile choice for ``cfg`` (none for fixed blocks): a change to one tile function
    leaves the other kinds' entries valid."""
    fn = kinds.check_kind(kind).tiles
    if fn is None:
        return {}
    try:
        return {fn.__name__: dataclasses.asdict(fn(cfg))}
    except Exception as exc:  # a table that does not cover this config
        return {fn.__name__: f"n/a ({type(exc).__name__})"}


def cache_key(kind: str, cfg, func, args: CompileArgs) -> dict:
    """The disk-cache key: the configuration, the tiles, the kernel's TIR (an edit to a kernel is a new
    key at the same version), compile arguments and versions."""
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
# one TileLang compile, retried on transient failures

def jit(func, cfg, args: CompileArgs):
    """One TileLang compile (lowering, nvcc, host library) with TileLang's binary cache off: it would load
    a cubin nobody checked into a kernel flashsink then stores as verified (a global switch: compile
    processes only)."""
    import tilelang
    from tilelang.jit import JITKernel

    was_on = tilelang.is_cache_enabled()
    tilelang.disable_cache()
    try:
        return JITKernel(
            func, out_idx=args.out_idx, execution_backend=EXECUTION_BACKEND, target=cfg.target(),
            pass_configs=args.pass_configs, compile_flags=args.compile_flags,
        )
    finally:
        if was_on:
            tilelang.enable_cache()


_ELECT = re.compile(r"tl_shuffle_elect<(\d+)>")


def narrow_elections(source: str) -> list[int]:
    """The extents of ``tl_shuffle_elect<extent>`` under 32 threads in a kernel's CUDA: ``elect.sync``
    there waits for lanes that never come and the kernel hangs (perf-log v18); 0 is the whole block."""
    return sorted({int(n) for n in _ELECT.findall(source) if 0 < int(n) < 32})


def check_source(source: str) -> None:
    """RuntimeError if the kernel's CUDA ``source`` would hang (:func:`narrow_elections`)."""
    narrow = narrow_elections(source)
    if narrow:
        raise RuntimeError(
            f"the kernel elects a lane under a branch of {narrow} thread(s), fewer than a warp: elect.sync "
            f"would wait for the warp's other lanes and hang. Issue its bulk copies (T.tma_copy) from a "
            f"branch of whole warps (the copy elects one lane itself)")


#: extra attempts after a transient failure
COMPILE_RETRIES = 2
RETRY_DELAY_S = 1.0

_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EMFILE,
                     errno.ENFILE, errno.ETXTBSY}
_TRANSIENT_TEXT = ("No space left on device", "Disk quota exceeded", "Cannot allocate memory", "out of memory",
                   "Resource temporarily unavailable", "Too many open files", "died due to signal",
                   "Killed", "killed", "timed out")


def compiler_output(exc: BaseException) -> str:
    """The exception's text without the CUDA source TileLang puts before nvcc's output."""
    text = str(exc)
    marker = "Compilation error:"
    return text[text.rfind(marker):] if marker in text else text


def is_transient(exc: BaseException) -> bool:
    """Whether another try may succeed: the compiler was killed or timed out, or the machine ran out of
    disk, memory or file handles (anywhere in the exception's chain); never a verdict on the kernel."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (MemoryError, subprocess.TimeoutExpired)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        if any(t in compiler_output(exc) for t in _TRANSIENT_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def error_text(exc: BaseException) -> str:
    """What a :class:`flashsink.CompileError` reports: nvcc's output, else the message and where it was raised."""
    if "Compilation error:" in str(exc):
        return tail(compiler_output(exc))
    return tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4)))


def compile_with_retries(kind: str, cfg, func, args: CompileArgs, root: Path):
    """:func:`jit` in the cache's private temporary directory, then :func:`check_source`; a failure that
    is not transient, or the last one, is a :class:`flashsink.CompileError`."""
    attempt = 0
    while True:
        attempt += 1
        try:
            with diskcache.private_tmp(root):
                kernel = jit(func, cfg, args)
            check_source(kernel.get_kernel_source() or "")
            return kernel
        except Exception as exc:
            if attempt <= COMPILE_RETRIES and is_transient(exc):
                log.warning(
                    "flashsink: compiling %s for %s failed with a transient error (%s); retry %d of %d",
                    kind, cfg.short(), tail(compiler_output(exc), 300).replace("\n", " "), attempt, COMPILE_RETRIES,
                )
                time.sleep(RETRY_DELAY_S * attempt)
                continue
            raise CompileError(kind, cfg, cfg.target(), error_text(exc), attempts=attempt) from exc


# ----------------------------------------------------------------------------------------------
# compile_kernel: the disk cache's entry, else a compile in a compile process

_compile_process = False  # set by enter_compile_process

#: what compile_kernel did in this process: "compiled", "disk" (a verified entry loaded), "rebuilt" (an
#: entry that failed verification replaced); read by precompile's workers and the tests
counts: collections.Counter = collections.Counter()

# the files TileLang's own tvm_ffi cache writes for a kernel
_SO = "executable.so"
_DEVICE = "device_kernel.cu"
_HOST = "host_kernel.cu"
_PARAMS = "params.json"


def _write_kernel(kernel, d: Path) -> None:
    """An entry's files, exported as TileLang's tvm_ffi cache exports them on Linux
    (tests/test_tilelang_api.py fails if a TileLang upgrade changes that)."""
    from tilelang.engine.param import dump_kernel_params

    (d / _DEVICE).write_text(kernel.kernel_source or "")
    (d / _HOST).write_text(kernel.adapter.get_host_source() or "")
    (d / _PARAMS).write_text(dump_kernel_params(kernel.params))
    kernel.adapter.get_exportable_executable().export_library(str(d / _SO))


def _load_kernel(files: dict, func, cfg, args: CompileArgs, root: Path):
    """A kernel from an entry's verified bytes: the library is loaded from a private copy of exactly the
    bytes that were hashed, never from the entry's own file."""
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
    """The kernel for ``(kind, cfg)``: a verified disk-cache entry loaded, else compiled and saved
    (``load_only``: None then). Raises :class:`flashsink.CompileError` if it cannot be built and
    :class:`flashsink.errors.CacheDirError` if the cache directory is unsafe."""
    configure_logging()
    root = diskcache.ensure_cache_dir()
    kinds.check_kind(kind)
    cfg = kinds.canonical(kind, cfg)  # one build for the fields the kernel does not read
    try:
        func = build_prim_func(kind, cfg)
    except Exception as exc:  # the kernel's TileLang code failed for this configuration
        raise CompileError(kind, cfg, cfg.target(), error_text(exc)) from exc
    args = compile_args(func)
    key = cache_key(kind, cfg, func, args)
    name = diskcache.entry_name(kind, key)
    entry = root / "kernels" / name
    with diskcache.key_lock(root, name):
        entry_existed = entry.exists()
        start = time.perf_counter()
        hit = diskcache.load(root, name, key)
        if hit is not None:
            try:
                kernel = _load_kernel(hit[1], func, cfg, args, root)
            except Exception as exc:  # e.g. written by an incompatible runtime: rebuild it
                log.warning("flashsink: could not load cache entry %s (%s: %s); rebuilding it",
                            entry, type(exc).__name__, exc)
                diskcache.discard(root, entry)
            else:
                counts["disk"] += 1
                log.debug("flashsink: loaded the %s kernel for %s from the disk cache %s in %.2f s",
                          kind, cfg.short(), entry, time.perf_counter() - start)
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
                kernel = _reload(kernel, job)
        else:
            # the child builds the PrimFunc again: a pickled one loses its layout annotations
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
    """Make this process a compile process (the child below, ``registry``'s workers), where
    :func:`compile_kernel` compiles in place; warnings only unless ``FLASHSINK_LOG`` says otherwise (the
    process that started it prints the progress)."""
    global _compile_process
    _compile_process = True
    os.environ.setdefault("FLASHSINK_LOG", "warning")


def _compile_and_store(job) -> tuple:
    """In a compile process: (kernel, None) once compiled and stored, (kernel, why) if the entry could
    not be stored."""
    kind, cfg, func, args, root, name, key = job
    start = time.perf_counter()
    kernel = compile_with_retries(kind, cfg, func, args, root)
    seconds = time.perf_counter() - start
    try:
        with diskcache.private_tmp(root):
            diskcache.store(root, name, key, functools.partial(_write_kernel, kernel), kind=kind,
                            summary=f"{kind} {cfg.short()}", extra={"compile_seconds": round(seconds, 1)})
    except Exception as exc:  # noqa: BLE001  (the caller says so and still gets the kernel)
        return kernel, f"{type(exc).__name__}: {exc}"
    return kernel, None


def _child_build(job) -> tuple | None:
    """The compile child's work: :func:`_compile_and_store`, with the PrimFunc built here and checked
    against the caller's key (the same code: the same kernel). None once stored, else (why, {file name:
    bytes}) for the caller to load."""
    kind, cfg, _, args, root, name, key = job
    diskcache.ensure_cache_dir(root)
    try:
        func = build_prim_func(kind, cfg)
    except Exception as exc:  # noqa: BLE001  (the kernel's TileLang code failed here)
        raise CompileError(kind, cfg, cfg.target(), error_text(exc)) from exc
    if cache_key(kind, cfg, func, args) != key:
        raise CompileError(kind, cfg, cfg.target(), "the compile process built another kernel than the caller "
                           "keyed (its flashsink or TileLang differs from the caller's)")
    kernel, unsaved = _compile_and_store((kind, cfg, func, args, root, name, key))
    if unsaved is None:
        return None
    with diskcache.private_tmp(root) as d:
        _write_kernel(kernel, d)
        return unsaved, {p.name: p.read_bytes() for p in d.iterdir() if p.name != diskcache.TMP_MARKER}


# The child reads (function, job) pickled from its stdin and writes (status, result) to a copy of fd 1
# taken before fd 1 is pointed at stderr, so what the compiler prints cannot mix into the result. Not
# multiprocessing's spawn, which would run the top of the user's main script again.
_CHILD_MAIN = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
               "from flashsink.ops.compiler.compile import _child_main; _child_main()")


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
    """:func:`_child_build` of ``job`` in a fresh interpreter with this process's ``sys.path``; its result,
    or its error raised (anything but a CompileError or CacheDirError becomes a CompileError)."""
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
    """The kernel the compile child built: from its verified entry, or from the files it handed back
    when it could not store them."""
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


def _reload(kernel, job):
    """The kernel just stored, loaded back from its entry, whose host code is linked already (the
    compiled one's is linked again by g++ at its first call, 0.3-0.7 s); else the compiled kernel."""
    kind, cfg, func, args, root, name, key = job
    try:
        hit = diskcache.load(root, name, key)
        if hit is not None:
            return _load_kernel(hit[1], func, cfg, args, root)
    except Exception as exc:  # noqa: BLE001  (the compiled kernel still works)
        log.debug("flashsink: could not load %s back from the disk cache (%s: %s); using the compiled kernel",
                  name, type(exc).__name__, exc)
    return kernel
