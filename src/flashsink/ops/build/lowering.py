"""One TileLang compile (lowering, nvcc, host library) and the check of its CUDA source.

:func:`jit` calls ``JITKernel`` directly, not through TileLang's own disk caches (``compile.py`` says
why; its binary cache of cubins is switched off for the compile); :func:`check_source` rejects a kernel that would hang at its first launch.
"""

from __future__ import annotations

import re

from .keys import EXECUTION_BACKEND, CompileArgs


def jit(func, cfg, args: CompileArgs):
    """One TileLang compile (lowering + nvcc + host library), not through TileLang's caches.

    ``JITKernel`` itself skips TileLang's kernel cache, but its nvcc step goes through TileLang's binary
    cache (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``): it would write each cubin there and load
    a cubin it finds there, a file nobody checked, into a kernel flashsink then stores as verified. So that
    cache is off for the compile (TileLang's global switch, restored after; the callers hold
    ``compile._compile_lock``); the whole kernel goes to flashsink's own cache."""
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
