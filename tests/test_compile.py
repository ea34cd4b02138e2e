"""Every kernel compiles for Hopper (sm_90a) and Ampere (sm_80) without a GPU.

TileLang lowers and nvcc builds with an explicit target, so CI (CPU only) proves each kernel
and each architecture-specific code path builds. One variant per kernel and arch here; the
full matrix is `tools/gpu_kernels.py`'s, built by `flashsink precompile --kernels`.
"""

import shutil

import pytest

from flashsink.ops.compiler.compile import compile_kernel
from flashsink.ops.compiler.kinds import KINDS
from flashsink.kernel_config import KernelConfig

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def _cfg(arch, kind, **over):
    base = dict(
        arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, groups=8, causal=True, has_sinks=True,
        layout="bhsd", deterministic=(kind == "dq"), precision="strict",
    )
    base.update(over)
    return KernelConfig(**base)


@pytest.mark.l1
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("kind", tuple(KINDS))
def test_kernel_compiles(arch, kind):
    if kind == "fwd_split" and arch == "sm_80":
        pytest.skip("fwd_split is Hopper-only (sm_80's code generator rejects it in TileLang 0.1.15); "
                    "decode on sm_80 runs the regular forward, see test_decode.py")
    if kind == "fwd_o32" and arch == "sm_80":
        pytest.skip("fwd_o32 is Hopper-only (the warp-specialized forward; config.fwd_o32): strict on sm_80 "
                    "recomputes Delta from P and dP")
    if kind == "fwd_window" and arch == "sm_80":
        pytest.skip("fwd_window is Hopper-only (the warp-specialized forward packed over 64-key tiles; "
                    "config.fwd_window_tiles): sm_80 runs every window with its one forward")
    # fp16 + D=128 + bshd for the forward so the other dtype, head dim and layout build too.
    over = dict(dtype="float16", head_dim=128, head_dim_v=128, layout="bshd") if kind == "fwd" else {}
    if kind in ("fwd_kvcache", "merge_splits"):  # attention_kvcache's (q, o in bshd)
        over = dict(layout="bshd")
    kernel = compile_kernel(kind, _cfg(arch, kind, **over))
    src = kernel.get_kernel_source()
    assert "__global__" in src
    if kind == "fwd_kvcache":
        assert "BlockTable[" in src and "SeqLens[" in src  # pages and lengths read on the device
    if kind in ("fwd", "fwd_unfolded", "fwd_window", "fwd_o32", "bwd", "dq", "fwd_split", "fwd_kvcache"):
        # The matrix products use Hopper's warpgroup MMA on sm_90a, and must not on sm_80.
        assert ("wgmma" in src) == (arch == "sm_90a"), f"{kind} on {arch}: wgmma presence is wrong"


@pytest.mark.l1
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("kind", ["preprocess", "bwd", "dq"])
def test_fast_kernels_compile(arch, kind):
    """precision="fast": single-term products, Delta from O (the kinds that read precision)."""
    src = compile_kernel(kind, _cfg(arch, kind, precision="fast")).get_kernel_source()
    assert "__global__" in src
    if kind in ("bwd", "dq"):
        assert ("wgmma" in src) == (arch == "sm_90a"), f"{kind} on {arch}: wgmma presence is wrong"


@pytest.mark.l1
def test_split_main_backward_compiles():
    """bwd_split (fast mode): the GQA group over several programs per KV tile, dK/dV added into fp32
    accumulators (so atomics for dK and dV). D256: the head dims the ws kernel serves run unsplit."""
    cfg = _cfg("sm_90a", "bwd_split", precision="fast", head_dim=256, head_dim_v=256)
    src = compile_kernel("bwd_split", cfg).get_kernel_source()
    assert "wgmma" in src and src.count("AtomicAdd") >= 2


@pytest.mark.l2
def test_deterministic_main_kernel_compiles():
    """The deterministic main backward (no dQ atomics, per-program sink partials)."""
    src = compile_kernel("bwd", _cfg("sm_90a", "bwd", deterministic=True, has_sinks=True)).get_kernel_source()
    assert "AtomicAdd" not in src


@pytest.mark.l1
@pytest.mark.parametrize(
    "arch, kind",
    [("sm_90a", k) for k in ("fwd", "preprocess", "bwd", "dq", "postprocess")] + [("sm_80", "fwd"), ("sm_80", "bwd")],
)
def test_varlen_kernel_compiles(arch, kind):
    """The packed variable-length (``thd``) variants: offsets from cu_seqlens, grids sized by the
    longest sequence."""
    src = compile_kernel(kind, _cfg(arch, kind, layout="thd")).get_kernel_source()
    assert "__global__" in src
    assert kind == "postprocess" or "CuQ" in src  # the postprocess runs over packed rows as one run
    if kind in ("fwd", "bwd", "dq"):
        assert ("wgmma" in src) == (arch == "sm_90a"), f"{kind} on {arch}: wgmma presence is wrong"


@pytest.mark.l2
@pytest.mark.parametrize("groups", [1, 4])
def test_main_backward_compiles_other_group_sizes(groups):
    """The main backward's flat (head of the group, query tile) loop with G != 8: a kernel change
    once lowered for G=8 and failed for the D=64, G=4 backward (TileLang's ThreadSync rejected a
    shared-memory sync inside a divergent region), so the group sizes users run are built here."""
    src = compile_kernel("bwd", _cfg("sm_90a", "bwd", groups=groups)).get_kernel_source()
    assert "wgmma" in src


@pytest.mark.l1
def test_swapped_grid_main_backward_compiles():
    """``build_bwd_pipelined(swap=True)``: TileLang's main backward with its KV tiles longest first from the
    grid's own dims (KV heads along x, tiles along y), strict D64 on sm_90a, where the index-arithmetic order
    did not compile (docs/perf-log.md v10); ``config.bwd_swap``'s choice on padded layouts (at D64 strict
    runs the hand kernel, so TileLang's is built directly), the launch order's TIR but for the grid's
    bindings."""
    import tilelang

    from flashsink.ops.kernels.bwd import build_bwd_pipelined
    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.kernel_config import bwd_branch, bwd_tiles

    def build_bwd(cfg, swap=True):
        return build_bwd_pipelined(cfg, bwd_tiles(cfg), 1, bwd_branch(cfg), swap, True, True)

    cfg = _cfg("sm_90a", "bwd", precision="strict")
    func = build_bwd(cfg, swap=True)
    text = func.script()
    assert text == build_bwd(cfg).script() != build_bwd(cfg, swap=False).script()
    assert 'T.thread_binding(heads // 8, thread="blockIdx.x")' in text
    assert 'T.thread_binding(n_tiles, thread="blockIdx.y")' in text
    kernel = tilelang.compile(func, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi",
                              pass_configs=pass_configs())
    assert "__global__" in kernel.get_kernel_source()
    with pytest.raises(ValueError, match="padded layout"):
        build_bwd(_cfg("sm_90a", "bwd", precision="strict", layout="thd"), swap=True)


@pytest.mark.l1
@pytest.mark.parametrize("arch, opts", [("sm_90a", {"branch": False, "lpt": False}), ("sm_80", {"branch": True}),
                                        ("sm_90a", {"branch": True, "lpt": False})])
def test_strict_preprocess_options_compile(arch, opts):
    """``build_preprocess_strict(branch=, lpt=)`` (lab/bwd_variants.py's "strict pre/..."): P without the
    per-element mask on wholly visible KV tiles; the query tiles with the most keys first from the grid's
    layout. The library's kernel takes ``config.pre_branch`` / ``pre_lpt`` (both on Hopper, neither on
    sm_80); the other choices build and compile too, and lpt needs a padded layout."""
    import tilelang

    from flashsink.ops.kernels.bwd import build_preprocess, build_preprocess_strict
    from flashsink.ops.compiler.compile import build_prim_func, pass_configs
    from flashsink.kernel_config import pre_branch, pre_lpt, pre_tiles

    def build(cfg, branch=False, lpt=False):
        return build_preprocess_strict(cfg, pre_tiles(cfg), branch, lpt)

    cfg = _cfg(arch, "preprocess", precision="strict")
    func = build(cfg, **opts)
    lib = build(cfg, branch=pre_branch(cfg), lpt=pre_lpt(cfg)).script()
    assert build_prim_func("preprocess", cfg).script() == build_preprocess(cfg).script() == lib != func.script()
    kernel = tilelang.compile(func, target={"kind": "cuda", "arch": arch}, execution_backend="tvm_ffi",
                              pass_configs=pass_configs())
    assert "__global__" in kernel.get_kernel_source()
    with pytest.raises(ValueError, match="padded layout"):
        build(_cfg(arch, "preprocess", precision="strict", layout="thd"), lpt=True)


@pytest.mark.l1
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_kvcache_gathers_through_a_shared_page_table(arch):
    """``build_fwd_kvcache`` resolves each key tile's rows to (page, row) once, into shared memory, and
    its K/V loads index the cache through that table: no division by ``page_size`` inside a load's
    address (the 64-bit division routines that held the per-load gather to ~300 GB/s, docs/perf-log.md v13)."""
    import re

    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_kvcache import build_fwd_kvcache

    func = build_fwd_kvcache(_cfg(arch, "fwd_kvcache", layout="bshd"))
    src = tilelang.compile(func, target={"kind": "cuda", "arch": arch}, execution_backend="tvm_ffi",
                           pass_configs=pass_configs()).get_kernel_source()
    loads = [line for line in src.splitlines() if re.search(r"[(*]\s*\(?(K|V) \+", line)]
    assert loads and all("pg_s" in line and "off_s" in line for line in loads), loads
    assert not any(re.search(r"[/%] *\(?(\(int64_t\))?page_size", line) for line in loads), loads


@pytest.mark.l1
def test_kvcache_prefetch_loads_the_next_tile_into_registers():
    """``build_fwd_kvcache``: each key tile's K/V rows are gathered into registers (``k_r``, ``v_r``) one
    step ahead and stored to shared memory at the next step's start, so their loads are in flight during
    this tile's products and softmax (``fetch``'s zeros and NaN keys); the GPU suite checks the outputs."""
    import re

    import tilelang

    from flashsink.ops.compiler.compile import pass_configs
    from flashsink.ops.kernels.fwd_kvcache import build_fwd_kvcache

    cfg = _cfg("sm_90a", "fwd_kvcache", layout="bshd")
    src = tilelang.compile(build_fwd_kvcache(cfg), target={"kind": "cuda", "arch": "sm_90a"},
                           execution_backend="tvm_ffi", pass_configs=pass_configs()).get_kernel_source()
    loop = [line.strip() for line in src[src.index("for (int kb"):].splitlines()]
    # inside the key loop: shared K/V written from the registers first, then the next tile's rows
    # written into them (from the cache's loads, through the gather's zero / NaN choices)
    to_shared = [i for i, line in enumerate(loop) if re.match(r"\*\(uint4\*\)\(\(\(bfloat16_t\*\)(k_s|v_s)\)", line)]
    to_regs = [i for i, line in enumerate(loop) if re.match(r"\*\(uint4\*\)\((k_r|v_r) \+", line)]
    assert len(to_shared) == 2 and len(to_regs) == 2 and max(to_shared) < min(to_regs)
    assert all(re.search(r"= \*\(uint4\*\)\((k_r|v_r) \+", loop[i]) for i in to_shared)
    assert sum(bool(re.search(r"\*\(uint4\*\)\((K|V) \+", line)) for line in loop) == 2


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


@pytest.mark.l1
@pytest.mark.parametrize("kind, layout", [("fwd_split", "bhsd"), ("fwd_kvcache", "bshd")])
def test_split_kv_kernels_mask_only_the_partial_key_tiles(kind, layout):
    """The split-KV kernels (``attention``'s decode, ``fwd_split``; ``attention_kvcache``'s ``fwd_kvcache``) evaluate
    the per-element mask only on key tiles that some query row of the tile does not see whole (the rows' last keys,
    a window's leading edge); the wholly visible tiles (``block_range.full_kv_blocks_for_rows``) are only scaled, on
    a branch taken once a tile (``mask.branch_tile``, the backward's). A decode split streams tens of such tiles: the mask was 41% of ``fwd_split``'s
    key-loop instructions (sm_90a SASS, 870 -> 503 a wholly visible tile; ``fwd_kvcache``'s gather 1,452 -> 1,069,
    docs/perf-log.md v30). The GPU suite checks the outputs (decode and kvcache cases with windows, lengths off the
    tiles, several query rows, chunks)."""
    from flashsink.ops.compiler.compile import build_prim_func

    lines = build_prim_func(kind, _cfg("sm_90a", kind, layout=layout)).script().splitlines()
    loop = next(i for i, line in enumerate(lines) if line.strip().startswith("for kb in"))
    body = lines[loop:]
    # mask.branch_tile: the tile's condition bound once (``full: T.bool = ...``), then ``if full:``
    cond = next(i for i, line in enumerate(body) if line.strip().startswith("full: T.bool = T.bitwise_and(kb >= "))
    branch = cond + 1
    assert body[branch].strip() == "if full:"
    other = next(i for i in range(branch + 1, len(body))
                 if body[i].strip() == "else:" and _indent(body[i]) == _indent(body[branch]))
    assert any(line.strip() == "acc_s[i, j] = acc_s[i, j] * scale_log2" for line in body[branch:other])
    masks = [i for i, line in enumerate(body)
             if "acc_s[i, j] = T.if_then_else(" in line and 'T.infinity("float32")' in line]
    assert masks and all(i > other for i in masks), (branch, other, masks)  # the select on the else branch only
    ends = [i for i in range(other + 1, len(body)) if body[i].strip() and _indent(body[i]) <= _indent(body[other])]
    assert all(i < ends[0] for i in masks)
