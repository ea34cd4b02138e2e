"""What a kernel is: its PrimFunc, its compile arguments, and its disk-cache key.

:func:`cache_key` is the key ``compile.compile_kernel`` stores and loads a kernel under: the static
configuration, the kind's tiles, the TIR's hash, the compile arguments and :func:`versions`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import platform
import subprocess
import sys

from . import kinds
from ...kernel_config import KernelConfig

EXECUTION_BACKEND = "tvm_ffi"


def build_prim_func(kind: str, cfg: KernelConfig):
    """The TileLang ``PrimFunc`` of one kernel (lowering input, not compiled)."""
    return kinds.check_kind(kind).build(cfg)


def pass_configs() -> dict:
    """Pass configs for every kernel: exp2/log2 through the fast hardware approximations."""
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@dataclasses.dataclass
class CompileArgs:
    out_idx: list | None
    pass_configs: dict
    compile_flags: list | None


def compile_args(func) -> CompileArgs:
    """What ``tilelang.compile`` would pass to ``JITKernel``: function-level attrs merged with ours."""
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


def cache_key(kind: str, cfg, func, args: CompileArgs) -> dict:
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
