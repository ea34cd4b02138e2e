"""No sm_90a kernel flashsink builds has its wgmma serialized by ptxas (issue 55).

ptxas serializes a function's warpgroup products when they do not fit its registers (C7512) or when a
non-wgmma instruction touches an accumulator inside a pipeline stage (C7514): every wgmma then waits for
the one before it, and the kernel still runs, correct and slower (perf-log v11, v20). Only ptxas says so,
so every default kernel (``kinds.precompile_kinds``) of the representative configurations below is lowered
and compiled for sm_90a here, without a GPU (:func:`ptxas_output`), and fails with its kind and
configuration if ptxas reports a serialized wgmma.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

tilelang = pytest.importorskip("tilelang")

from flashsink.ops.compiler import compile as keys, kinds  # noqa: E402
from flashsink.kernel_config import KernelConfig, Tiles, bwd_dq_first  # noqa: E402


def device_source(func, cfg, args) -> str:
    """``func``'s CUDA source after TileLang's whole lowering, without nvcc: what ``compile.jit`` hands
    nvcc (``kernel.get_kernel_source()`` of the compiled kernel)."""
    import tvm

    with tvm.transform.PassContext(opt_level=3, config=args.pass_configs), tvm.target.Target(cfg.target()):
        return tilelang.lower(func, target=cfg.target()).kernel_source


def ptxas_output(source: str, arch: str, args) -> str:
    """What nvcc and ptxas print (``-Xptxas -v``: registers, spills) compiling ``source`` to a cubin for
    ``arch`` with the options TileLang's own compile passes (its include paths and ``compile_flags``,
    ``--use_fast_math`` under the fast-math pass config): TileLang keeps that output to itself, so the
    source is compiled once more here. RuntimeError if nvcc fails."""
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
    product then waits for the one before it (perf-log v11, v20)."""
    return [line.strip() for line in _SERIALIZED.findall(output)]


def ptxas_usage(output: str) -> str:
    """ptxas's registers and spills in ``output``, one line: "168 registers, 0 B spill stores, 0 B spill loads"."""
    regs = re.findall(r"Used (\d+) registers", output)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", output)
    st, ld = spills[-1] if spills else ("?", "?")
    return f"{regs[-1] if regs else '?'} registers, {st} B spill stores, {ld} B spill loads"


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
                source = device_source(func, cfg, args) if "gemm" in text else ""
                done[key] = pool.submit(ptxas_output, source, cfg.arch, args) if "wgmma" in source else None
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
    lines = serialized_wgmma(out)
    assert not lines, f"ptxas serializes the wgmma of {kind} for {cfg.short()} ({ptxas_usage(out)}): {lines}"


@pytest.mark.l0
def test_serialized_wgmma_reads_ptxas_notes():
    """The parse of ptxas's output (CUDA 13.0's wording; C7512 and C7514 by code too)."""
    out = """bwd.cu(207): warning #1046-D: floating-point value cannot be represented exactly
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to \
insufficient register resources for the function 'k'
ptxas info    : Function properties for k
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem"""
    assert serialized_wgmma(out) == [out.splitlines()[1].strip()]
    assert ptxas_usage(out) == "168 registers, 8 B spill stores, 12 B spill loads"
    c7514 = ("ptxas info : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "non wgmma instructions reading accumulator registers of  a wgmma")
    assert serialized_wgmma(c7514) == [c7514]
    other = "ptxas warning : (C7514) another wording"
    assert serialized_wgmma(other) == [other]
    assert serialized_wgmma(out.replace("serialized", "issued").replace("C7512", "C7599")) == []
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
    out = ptxas_output(device_source(func, cfg, args), cfg.arch, args)
    assert not ptxas_usage(out).startswith("?"), out  # ptxas ran and reported its registers
    assert not serialized_wgmma(out), serialized_wgmma(out)


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
    out = ptxas_output(device_source(func, cfg, args), cfg.arch, args)
    assert not ptxas_usage(out).startswith("?"), out
    assert not serialized_wgmma(out), serialized_wgmma(out)


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
    out = ptxas_output(device_source(func, cfg, args), cfg.arch, args)
    assert not ptxas_usage(out).startswith("?"), out
    assert not serialized_wgmma(out), serialized_wgmma(out)
