"""No sm_90a kernel flashsink builds has its wgmma serialized by ptxas (issue 55).

ptxas serializes a function's warpgroup products when they do not fit its registers (C7512) or when a
non-wgmma instruction touches an accumulator inside a pipeline stage (C7514): every wgmma then waits for
the one before it, and the kernel still runs, correct and slower (perf-log v11, v20). Only ptxas says so,
so every default kernel (``kinds.precompile_kinds``) of the representative configurations below is lowered
and compiled for sm_90a here, without a GPU (``lowering.ptxas_output``), and fails with its kind and
configuration if ptxas reports a serialized wgmma.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import os
import shutil

import pytest

pytest.importorskip("tilelang")

from flashsink.ops.compiler import compile as keys, kinds, compile as lowering  # noqa: E402
from flashsink.kernel_config import KernelConfig, Tiles, bwd_dq_first  # noqa: E402

#: (precision, deterministic)
MODES = (("fast", False), ("strict", False), ("fast", True), ("strict", True))


def _configs():
    """gpt-oss's GQA group (8, sinks) at head dims 64 and 128, causal (the windowed forward too) and full,
    every mode, padded and packed; fp16, and bshd (attention_kvcache's kernels), causal."""
    for d, causal, layout, (precision, det) in itertools.product((64, 128), (True, False), ("bhsd", "thd"), MODES):
        yield KernelConfig("sm_90a", "bfloat16", d, d, 8, causal, True, layout, det, precision)
    for d, precision in itertools.product((64, 128), ("fast", "strict")):
        yield KernelConfig("sm_90a", "float16", d, d, 8, True, True, "bhsd", False, precision)
        yield KernelConfig("sm_90a", "bfloat16", d, d, 8, True, True, "bshd", False, precision)


def _kernels() -> list:
    """Each (kind, configuration it is built for) of :func:`_configs`, once."""
    pairs = (((kind, kinds.canonical(kind, cfg)) for kind in kinds.precompile_kinds(cfg)) for cfg in _configs())
    return list(dict.fromkeys(itertools.chain.from_iterable(pairs)))


def _ptxas_all(pairs) -> dict:
    """ptxas's output for each (kind, cfg) of ``pairs`` ("" for a kernel without wgmma): one lowering per
    distinct TIR here (none for a TIR without a matrix product), its nvcc in a thread per CPU while the
    next one lowers."""
    done, out = {}, {}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for kind, cfg in pairs:
            func = keys.build_prim_func(kind, cfg)
            args = keys.compile_args(func)
            text = func.script(show_meta=True)
            key = (hashlib.sha256(text.encode()).hexdigest(), repr(args), cfg.arch)
            if key not in done:
                source = lowering.device_source(func, cfg, args) if "gemm" in text else ""
                done[key] = pool.submit(lowering.ptxas_output, source, cfg.arch, args) if "wgmma" in source else None
            out[kind, cfg] = done[key]
    return {pair: "" if f is None else f.result() for pair, f in out.items()}


def _known(kind, cfg) -> tuple:
    """The serialization known today, as strict xfails (each flips to a failure once fixed): D64's dq-first
    main backward (C7512, registers). ``build_bwd_ws(ds_first=True)`` compiles without it; it becomes the
    default once a GPU has timed it against this order (perf-log v33, Next 1)."""
    if kind == "bwd" and bwd_dq_first(cfg):
        return (pytest.mark.xfail(strict=True, reason="C7512 in D64's dq-first order until ds_first is timed"),)
    return ()


@pytest.fixture(scope="module")
def ptxas(request) -> dict:
    """:func:`_ptxas_all` of the kernels of this session's selected tests (``-k`` builds only those)."""
    pairs = [(item.callspec.params["kind"], item.callspec.params["cfg"]) for item in request.session.items
             if getattr(item, "originalname", None) == "test_no_serialized_wgmma"]
    return _ptxas_all(dict.fromkeys(pairs))


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("kind, cfg", [pytest.param(kind, cfg, id=f"{kind}-{cfg.short()}", marks=_known(kind, cfg))
                                       for kind, cfg in _kernels()])
def test_no_serialized_wgmma(ptxas, kind, cfg):
    out = ptxas[kind, cfg]
    lines = lowering.serialized_wgmma(out)
    assert not lines, f"ptxas serializes the wgmma of {kind} for {cfg.short()} ({lowering.ptxas_usage(out)}): {lines}"


@pytest.mark.l0
def test_serialized_wgmma_reads_ptxas_notes():
    """The parse of ptxas's output (CUDA 13.0's wording; C7512 and C7514 by code too)."""
    out = """bwd.cu(207): warning #1046-D: floating-point value cannot be represented exactly
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
insufficient register resources for the function 'k'
ptxas info    : Function properties for k
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem"""
    assert lowering.serialized_wgmma(out) == [out.splitlines()[1].strip()]
    assert lowering.ptxas_usage(out) == "168 registers, 8 B spill stores, 12 B spill loads"
    c7514 = ("ptxas info : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "non wgmma instructions reading accumulator registers of  a wgmma")
    assert lowering.serialized_wgmma(c7514) == [c7514]
    other = "ptxas warning : (C7514) another wording"
    assert lowering.serialized_wgmma(other) == [other]
    assert lowering.serialized_wgmma(out.replace("serialized", "issued").replace("C7512", "C7599")) == []
    assert len(_kernels()) == len(set(_kernels()))


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_ds_first_compiles_without_serialized_wgmma():
    """The fix of :func:`_known`'s kernel, not yet the default: D64's dq-first main backward with
    ``ds_first=True`` (dS^T into dP^T's registers before P^T is rounded) compiles without C7512."""
    from flashsink.kernel_config import bwd_tiles
    from flashsink.ops.kernels.bwd_ws import build_bwd_ws

    cfg = KernelConfig("sm_90a", "bfloat16", 64, 64, 8, True, True, "bhsd", False, "fast")
    assert bwd_dq_first(cfg)
    func = build_bwd_ws(cfg, bwd_tiles(cfg), 1, True, ds_first=True)
    args = keys.compile_args(func)
    out = lowering.ptxas_output(lowering.device_source(func, cfg, args), cfg.arch, args)
    assert not lowering.ptxas_usage(out).startswith("?"), out  # ptxas ran and reported its registers
    assert not lowering.serialized_wgmma(out), lowering.serialized_wgmma(out)


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_dk_in_flight_compiles_without_serialized_wgmma():
    """FlashAttention-3's order at D128 head-major (``dq_first``, ``ds_first``, ``dk_in_flight``: dK's product
    running into the next tile, perf-log v34) compiles without a serialized wgmma; without ``ds_first`` ptxas
    serializes it (C7512: P^T's registers are still live)."""
    from flashsink.kernel_config import bwd_tiles
    from flashsink.ops.kernels.bwd_ws import build_bwd_ws

    cfg = KernelConfig("sm_90a", "bfloat16", 128, 128, 8, True, True, "bhsd", False, "fast")
    func = build_bwd_ws(cfg, bwd_tiles(cfg), 8, True, ds_first=True, head_major=True, dk_in_flight=True)
    args = keys.compile_args(func)
    out = lowering.ptxas_output(lowering.device_source(func, cfg, args), cfg.arch, args)
    assert not lowering.ptxas_usage(out).startswith("?"), out
    assert not lowering.serialized_wgmma(out), lowering.serialized_wgmma(out)


@pytest.mark.l1
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("d", [128, 64])
def test_tma_epilogue_compiles_without_serialized_wgmma(d):
    """The head-major kernel in FlashAttention-3's order with dK/dV added by bulk reduce-adds (``tma_epilogue``,
    perf-log v36) compiles without a serialized wgmma and fits shared memory; with dk and dv read on the path of a
    program that sees no row, ptxas serialized every wgmma (C7515)."""
    from flashsink.ops.kernels.bwd_ws import build_bwd_ws

    cfg = KernelConfig("sm_90a", "bfloat16", d, d, 8, True, True, "bhsd", False, "fast")
    t = Tiles(64, 128, 256, 2) if d == 128 else Tiles(128, 128, 256, 2)  # the head-major kernels' tiles (v34)
    func = build_bwd_ws(cfg, t, 8, True, ds_first=True, head_major=True, dk_in_flight=True, tma_epilogue=True)
    args = keys.compile_args(func)
    out = lowering.ptxas_output(lowering.device_source(func, cfg, args), cfg.arch, args)
    assert not lowering.ptxas_usage(out).startswith("?"), out
    assert not lowering.serialized_wgmma(out), lowering.serialized_wgmma(out)
