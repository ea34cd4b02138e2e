"""One TileLang compile (lowering, nvcc, host library) and the checks of its CUDA source.

:func:`jit` calls ``JITKernel`` directly, not through TileLang's own disk caches (``compile.py`` says
why; its binary cache of cubins is switched off for the compile); :func:`check_source` rejects a kernel that
would hang at its first launch; :func:`serialized_wgmma` reads what ptxas says of a kernel's warpgroup products
(tests/test_ptxas.py, without a GPU).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from .keys import EXECUTION_BACKEND, CompileArgs


def jit(func, cfg, args: CompileArgs):
    """One TileLang compile (lowering + nvcc + host library), not through TileLang's caches.

    ``JITKernel`` itself skips TileLang's kernel cache, but its nvcc step goes through TileLang's binary
    cache (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``): it would write each cubin there and load
    a cubin it finds there, a file nobody checked, into a kernel flashsink then stores as verified. So that
    cache is off for the compile (TileLang's global switch, restored after; it only ever runs in flashsink's
    own compile processes, ``compile.enter_compile_process``); the whole kernel goes to flashsink's cache."""
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
    """The lane elections in a kernel's CUDA source that run under fewer threads than a warp:
    TileLang issues a bulk copy (TMA) or barrier setup from one lane it picks with
    ``tl::tl_shuffle_elect<extent>``, ``elect.sync`` over the full warp, where ``extent`` is the number
    of threads of the branch around it. Under a branch of fewer than 32 threads (``if tx == ...``
    around a ``T.tma_copy``) the elected lane waits at ``elect.sync`` for lanes that never come: the
    kernel hangs (the H200 showed it, docs/perf-log.md v18). 0 means the whole block and is fine."""
    return sorted({int(n) for n in _ELECT.findall(source) if 0 < int(n) < 32})


def check_source(source: str) -> None:
    """Raise ``RuntimeError`` if ``source`` (a kernel's CUDA) would hang: :func:`narrow_elections`."""
    narrow = narrow_elections(source)
    if narrow:
        raise RuntimeError(
            f"the kernel elects a lane under a branch of {narrow} thread(s), fewer than a warp: elect.sync "
            f"would wait for the warp's other lanes and hang. Issue its bulk copies (T.tma_copy) from a "
            f"branch of whole warps (the copy elects one lane itself)")


def device_source(func, cfg, args: CompileArgs) -> str:
    """``func``'s CUDA source after TileLang's whole lowering, without nvcc: what :func:`jit` hands nvcc
    (``kernel.get_kernel_source()`` of the compiled kernel)."""
    import tilelang
    import tvm

    with tvm.transform.PassContext(opt_level=3, config=args.pass_configs), tvm.target.Target(cfg.target()):
        return tilelang.lower(func, target=cfg.target()).kernel_source


def ptxas_output(source: str, arch: str, args: CompileArgs) -> str:
    """What nvcc and ptxas print (``-Xptxas -v``: registers, spills) compiling ``source`` to a cubin for
    ``arch`` with the options TileLang's own compile passes (its include paths and ``compile_flags``,
    ``--use_fast_math`` under the fast-math pass config). TileLang keeps that output to itself, so the
    source is compiled once more here. Raises ``RuntimeError`` if nvcc fails."""
    import tilelang
    from tilelang.contrib import nvcc

    options = nvcc.default_compile_options(args.compile_flags)
    if args.pass_configs.get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH):
        options.append("--use_fast_math")
    with tempfile.TemporaryDirectory(prefix="flashsink-ptxas-") as d:
        cu, cubin = Path(d) / "kernel.cu", Path(d) / "kernel.cubin"
        cu.write_text(source)
        cmd = [nvcc.get_nvcc_compiler(), "--cubin", "-O3", "-lineinfo", f"-arch={arch}", *options,
               "-Xptxas", "-v", "-o", str(cubin), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{out[-4000:]}")
    return out


#: ptxas's notes that a function's wgmma run one at a time ("Potential Performance Loss: wgmma.mma_async
#: instructions are serialized due to ..."): C7512 (registers), C7514 (a non-wgmma instruction reads an
#: accumulator inside a pipeline stage) and their siblings, by code or by text
_SERIALIZED = re.compile(r"^.*(?:\(C751[24]\)|wgmma.*serialized).*$", re.MULTILINE)


def serialized_wgmma(output: str) -> list:
    """The lines of ``output`` (:func:`ptxas_output`) where ptxas serializes a function's wgmma: every
    product then waits for the one before it, the tensor cores never run two at once (perf-log v11, v20)."""
    return [line.strip() for line in _SERIALIZED.findall(output)]


def ptxas_usage(output: str) -> str:
    """ptxas's registers and spills in ``output``, one line: "168 registers, 0 B spill stores, 0 B spill loads"."""
    regs = re.findall(r"Used (\d+) registers", output)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
    st, ld = spills[-1] if spills else ("?", "?")
    return f"{regs[-1] if regs else '?'} registers, {st} B spill stores, {ld} B spill loads"
